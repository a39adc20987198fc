"""``vllm serve`` on the aot path, one server per traced family, token for token with transformers.

Each server serves a tiny random model of one family (qaic-aot's test models, exported by tracing
transformers' code) and answers concurrent greedy completions from the OpenAI client; every reply
must equal transformers' greedy continuation. Prompts outnumber the KV slots and some are longer
than a prefill chunk, so continuous batching and chunked prefill are both exercised.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from test_vllm_architectures import ARCHS, _aot_models
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

MAX_TOKENS = 6
SLOTS = 2


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_serve_answers_like_transformers(
    arch: str, tmp_path_factory: pytest.TempPathFactory, qeff_home: Path
) -> None:
    models = _aot_models()
    root = tmp_path_factory.mktemp(f"serve-{arch}")
    model_dir = models.build_tiny_model(arch, root)
    ref = models.HFReference(model_dir)
    prompts = models.more_prompts(ref.tokenizer)[: 2 * SLOTS + 1]
    args = [
        "--served-model-name", arch,
        "--max-model-len", "64",
        "--max-num-seqs", str(SLOTS),
        "--long-prefill-token-threshold", "8",
        "--dtype", "float32",
        "--additional-config", '{"execution_mode": "aot", "override_qaic_config": {"num_cores": 4}}',
    ]  # fmt: skip
    server = VllmServer(model_dir, args, root / "vllm-serve.log", env={"QAIC_AOT_EXPORTER": "qaic"})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)

        def complete(prompt: list[int]) -> list[int]:
            reply = client.completions.create(
                model=arch,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return list(reply.choices[0].token_ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(complete, prompts))
    finally:
        server.stop()
    for i, (prompt, got) in enumerate(zip(prompts, replies, strict=True)):
        expected = ref.greedy(prompt, MAX_TOKENS)
        # transformers stops at EOS; the server was told to ignore it, so compare up to the reference.
        assert got[: len(expected)] == expected, f"{arch} request {i}"
