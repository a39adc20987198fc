"""Speculative decoding (n-gram, suffix, draft model) against non-speculative greedy output."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qaic_core.errors import QaicConfigError

K = 3
DRAFT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
"""The tiny target's shape (conftest's ``tiny_model``), for drafts built beside it."""
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 256,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": 16,
    "dtype": "float32",
    "disable_log_stats": False,
}
TEXTS = [
    "Hello world, what is",
    "Once upon a time there was a small language model. It lived on a tiny card in a quiet rack",
    "The weather",
    "A recipe for bread: mix flour with salt",
    "Rivers flow from the mountains to the sea.",
]


@contextmanager
def engine(model: Path, speculative: dict[str, Any] | None, cores: int = 4, **extra: Any) -> Iterator[Any]:
    import vllm.envs
    from vllm import LLM

    overrides = {"override_qaic_config": {"num_cores": cores}, **extra.pop("additional_config", {})}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = LLM(
            model=str(model),
            seed=0,
            speculative_config=speculative,
            additional_config=overrides,
            **ENGINE_ARGS,
            **extra,
        )
        try:
            yield llm
        finally:
            del llm
            gc.collect()
    vllm.envs.disable_envs_cache()


def greedy(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def spec_counts(llm: Any) -> tuple[int, int]:
    """(drafts proposed, drafts accepted) from vLLM's own speculative-decoding metrics."""
    values = {m.name: m for m in llm.get_metrics()}
    drafts = values["vllm:spec_decode_num_draft_tokens"].value
    accepted = values["vllm:spec_decode_num_accepted_tokens"].value
    return int(drafts), int(accepted)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different random model with the same tokenizer: it proposes, the target decides."""
    from qaic_vllm.default_model import build_model

    return build_model(tmp_path_factory.mktemp("draft") / "draft", seed=7, **DRAFT_CONFIG)


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "suffix", "num_speculative_tokens": K},
    ],
    ids=["ngram", "suffix"],
)
def test_host_proposers_keep_greedy_output(
    tiny_model: Path,
    prompts: list[list[int]],
    hf_greedy: Callable[..., list[int]],
    speculative: dict[str, Any],
) -> None:
    with engine(tiny_model, speculative) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(40))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 40)
        drafts, accepted = spec_counts(llm)
    # A random model's greedy output repeats itself, so lookups find drafts and some are right.
    assert drafts > 0 and 0 < accepted <= drafts


def test_a_draft_identical_to_the_target_is_always_accepted(
    tiny_model: Path, prompts: list[list[int]], hf_greedy: Callable[..., list[int]]
) -> None:
    speculative = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": K}
    draft_cores = {"draft_override_qaic_config": {"num_cores": 4}}
    with engine(tiny_model, speculative, additional_config=draft_cores) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 24)
        drafts, accepted = spec_counts(llm)
    assert drafts > 0 and accepted == drafts


def test_a_different_draft_keeps_greedy_output(
    tiny_model: Path, other_draft: Path, prompts: list[list[int]], hf_greedy: Callable[..., list[int]]
) -> None:
    speculative = {"method": "draft_model", "model": str(other_draft), "num_speculative_tokens": K}
    draft_cores = {"draft_override_qaic_config": {"num_cores": 4}}
    with engine(tiny_model, speculative, additional_config=draft_cores) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 24)
        drafts, accepted = spec_counts(llm)
    assert drafts > 0 and accepted < drafts  # an unrelated model is often wrong


def test_an_unknown_method_is_refused_naming_the_supported_ones(tiny_model: Path) -> None:
    speculative = {"method": "eagle", "model": str(tiny_model), "num_speculative_tokens": K}
    refused = pytest.raises(
        Exception, match=r"not supported on Cloud AI: use one of ngram, suffix, draft_model"
    )
    with refused, engine(tiny_model, speculative):
        pass


def test_a_draft_with_another_tokenizer_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    from qaic_vllm.default_model import build_model

    draft = build_model(tmp_path / "small-vocab", seed=3, tokenizer_vocab=300, **DRAFT_CONFIG)
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    with pytest.raises(Exception, match="different tokenizer"), engine(tiny_model, speculative):
        pass


def test_a_draft_override_of_the_targets_scheduling_is_refused(tiny_model: Path) -> None:
    speculative = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": K}
    draft = {"draft_override_qaic_config": {"num_cores": 4, "max_num_partial_prefills": 2}}
    refused = pytest.raises(
        Exception, match=r"sets \['max_num_partial_prefills'\]: a draft's shapes and scheduling"
    )
    with refused, engine(tiny_model, speculative, additional_config=draft):
        pass


def _sampler(vocab: int, temperature: float, seed: int | None = None) -> Any:
    from vllm import SamplingParams

    from qaic_vllm.sampling import HostSampler

    sampler = HostSampler(object(), 1, 64, vocab)
    sampler.add_request(0, 1, [0], SamplingParams(temperature=temperature, seed=seed))
    return sampler


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Many draws of two tokens: with drafts right, wrong or absent the output follows softmax(logits)."""
    vocab = 6
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2], [0.3, 0.1, 1.5, 0.0, -1.0, 0.7]])
    target = torch.softmax(logits[0], dim=-1).numpy()
    draws = 20000
    numpy_state = np.random.get_state()
    np.random.seed(20)  # the sampler's shared stream is seeded from numpy's: one fixed run, not a flaky one
    try:
        samplers = [_sampler(vocab, 1.0) for _ in range(2)]
    finally:
        np.random.set_state(numpy_state)  # other tests keep numpy's stream as they found it
    for draft, sampler in zip((4, 1), samplers, strict=True):  # the likeliest token, then an unlikely one
        counts = np.zeros(vocab)
        second = np.zeros(vocab)
        for _ in range(draws):
            tokens, _ = sampler.verify(logits, 0, 1, [draft])
            counts[tokens[0]] += 1
            if len(tokens) == 2:
                second[tokens[1]] += 1
        # Total variation distance of the first token from the target's distribution.
        assert 0.5 * np.abs(counts / draws - target).sum() < 0.02
        if second.sum():
            # An unlikely draft leaves about 2,000 second tokens: the bound follows the sample size
            # (an unbiased sampler stays under it in more than 99.9% of runs).
            expected = torch.softmax(logits[1], dim=-1).numpy()
            assert 0.5 * np.abs(second / second.sum() - expected).sum() < 2.5 / np.sqrt(second.sum())


def test_greedy_verification_accepts_exactly_the_argmax_prefix() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    sampler = _sampler(3, 0.0)
    assert sampler.verify(logits, 0, 1, [1, 0])[0] == [1, 0, 2]  # both right, then the bonus
    assert sampler.verify(logits, 0, 1, [1, 2])[0] == [1, 0]  # second wrong: the target's token
    assert sampler.verify(logits, 0, 1, [2, 0])[0] == [1]


def test_seeded_speculative_sampling_is_reproducible() -> None:
    logits = torch.randn(4, 50)
    first = _sampler(50, 0.8, seed=5).verify(logits, 0, 1, [3, 4, 5])[0]
    again = _sampler(50, 0.8, seed=5).verify(logits, 0, 1, [3, 4, 5])[0]
    assert first == again


def test_spec_settings_refuse_a_k_beyond_the_context() -> None:
    from types import SimpleNamespace

    from qaic_core.settings import CompileSettings
    from qaic_vllm.config import EngineSettings
    from qaic_vllm.speculative.config import spec_settings

    sc = SimpleNamespace(method="ngram", num_speculative_tokens=40, prompt_lookup_min=1, prompt_lookup_max=2)
    engine_settings = EngineSettings(CompileSettings(prefill_seq_len=8, ctx_len=32), None, "float32")
    with pytest.raises(QaicConfigError, match="lower num_speculative_tokens or raise --max-model-len"):
        spec_settings(SimpleNamespace(speculative_config=sc), engine_settings)  # type: ignore[arg-type]


def test_request_options_keep_working_with_speculation(
    tiny_model: Path, prompts: list[list[int]], hf_greedy: Callable[..., list[int]]
) -> None:
    import re

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    speculative = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2}
    with engine(tiny_model, speculative) as llm:
        tok = llm.get_tokenizer()
        expected = hf_greedy(prompts[0], 30)
        # max_tokens cuts a step's accepted drafts short.
        for n in (1, 5, 7):
            out = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(n))[0].outputs[0]
            assert list(out.token_ids) == expected[:n]
        # A stop string ends the output even when it arrives among accepted drafts.
        stop = tok.decode(expected[10:12])
        full = tok.decode(expected)
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
        out = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0]
        assert out.text == full[: full.index(stop)]
        # Structured output: the grammar masks every verified position.
        choice = SamplingParams(
            temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], choice)
        assert all(o.outputs[0].text in {"yes", "no"} for o in outs)
        pattern = r"(red|green|blue) [0-9]{2}"
        regex = SamplingParams(
            temperature=1.0, seed=2, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=pattern)
        )
        mixed = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], [regex, greedy(20)])
        assert re.fullmatch(pattern, mixed[0].outputs[0].text)
        assert list(mixed[1].outputs[0].token_ids) == hf_greedy(prompts[1], 20)
        # Logprobs of every accepted token come back, one entry per token.
        lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        out = llm.generate([{"prompt_token_ids": prompts[2]}], lp)[0].outputs[0]
        assert list(out.token_ids) == hf_greedy(prompts[2], 12)
        assert out.logprobs is not None and len(out.logprobs) == 12
        assert all(token in entry for token, entry in zip(out.token_ids, out.logprobs, strict=True))
