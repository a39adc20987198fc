"""Acceptance for the traced route: every architecture it exports matches transformers in fp32.

Each tiny model is exported by tracing transformers' own code (``qaic_aot.export.traced``), compiled by
``compile_model`` and run through ``CausalLM`` on the simulator: greedy tokens equal transformers'
``generate(do_sample=False)`` with more prompts than KV slots and prompts over several prefill chunks,
and teacher-forced logits of chunked prefills and joint decodes stay within fp32 rounding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from models import TRACED_ARCHS, HFReference, more_prompts
from test_parity import BASE, MAX_NEW_TOKENS, PRECISIONS, teacher_forced_error

import qaic_aot
from qaic_core.settings import CompileSettings

os.environ.setdefault("QAIC_BACKEND", "sim")

FP32_FLAGS, FP32_RTOL = PRECISIONS["fp32"]


@pytest.fixture(scope="module")
def qeff_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qeff-home-traced")


@pytest.fixture(scope="module")
def references(tiny_model_factory: Callable[[str], Path]) -> Callable[[str], HFReference]:
    cache: dict[str, HFReference] = {}

    def get(arch: str) -> HFReference:
        if arch not in cache:
            cache[arch] = HFReference(tiny_model_factory(arch))
        return cache[arch]

    return get


@contextmanager
def causal_lm(model_dir: Path, settings: CompileSettings, qeff_home: Path) -> Iterator[qaic_aot.CausalLM]:
    qpc_dir = qaic_aot.compile_model(model_dir, settings, progress=False, qeff_home=qeff_home)
    session = qaic_aot.QAICInferenceSession(qpc_dir / "qpc")
    try:
        yield qaic_aot.CausalLM(session, settings)
    finally:
        session.deactivate()


def check_parity(arch: str, model_dir: Path, ref: HFReference, qeff_home: Path) -> None:
    """Greedy tokens equal, then teacher-forced logits within fp32 rounding, on one compiled program."""
    prompts = more_prompts(ref.tokenizer)
    settings = CompileSettings(**BASE, **FP32_FLAGS)
    with causal_lm(model_dir, settings, qeff_home) as lm:
        got = lm.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=ref.eos_token_id)
        expected = [ref.greedy(p, MAX_NEW_TOKENS) for p in prompts]
        assert got == expected
        error, scale = teacher_forced_error(lm, ref)
    print(f"{arch} traced fp32: max |dlogit| {error:.3e} of max |logit| {scale:.2f}")
    assert error <= FP32_RTOL * scale


@pytest.mark.parametrize("arch", TRACED_ARCHS)
def test_traced_architecture_matches_transformers_fp32(
    arch: str,
    tiny_model_factory: Callable[[str], Path],
    references: Callable[[str], HFReference],
    qeff_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Llama 3.2 is a LlamaForCausalLM, whose default is the hand-built graph: trace it here too.
    monkeypatch.setenv("QAIC_AOT_ROUTE", "traced")
    check_parity(arch, tiny_model_factory(arch), references(arch), qeff_home)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hand_built_families_also_trace(
    arch: str,
    tiny_model_factory: Callable[[str], Path],
    references: Callable[[str], HFReference],
    qeff_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QAIC_AOT_ROUTE", "traced")
    check_parity(arch, tiny_model_factory(arch), references(arch), qeff_home)


@pytest.mark.parametrize("precision", ["fp16", "mxfp6+mxint8"])
@pytest.mark.parametrize("arch", ["gemma2", "falcon-mq", "mpt"])
def test_traced_logits_within_documented_tolerance(
    arch: str,
    precision: str,
    tiny_model_factory: Callable[[str], Path],
    references: Callable[[str], HFReference],
    qeff_home: Path,
) -> None:
    """Dense traced families keep docs/aot-numerics.md's tolerances (experts' top-k routing can flip
    under rounding, so mixtures of experts have no such bound)."""
    flags, rtol = PRECISIONS[precision]
    with causal_lm(tiny_model_factory(arch), CompileSettings(**BASE, **flags), qeff_home) as lm:
        error, scale = teacher_forced_error(lm, references(arch))
    print(f"{arch} traced {precision}: max |dlogit| {error:.3e} = {error / scale:.2e} of max |logit|")
    assert error <= rtol * scale
    assert error > 1e-5 * scale  # the compiler really applied the reduced precision


def test_qaic_aot_generate_serves_a_traced_architecture(
    tiny_model_factory: Callable[[str], Path], references: Callable[[str], HFReference], tmp_path: Path
) -> None:
    import json

    from test_cli import FLAGS, PROMPTS, qaic_aot

    model_dir, ref = tiny_model_factory("gemma2"), references("gemma2")
    args = ["generate", str(model_dir), *FLAGS, "--generation-len", "6", "--json", "--no-progress"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    generated = qaic_aot(*args, home=tmp_path / "home")
    assert generated.returncode == 0, generated.stderr
    for prompt, result in zip(PROMPTS, json.loads(generated.stdout), strict=True):
        ids = ref.tokenizer(prompt)["input_ids"]
        assert result["token_ids"] == ref.greedy(ids, 6)
