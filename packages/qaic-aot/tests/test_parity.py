"""Acceptance: programs compiled by the pipeline and run on the simulator match transformers.

For every supported architecture a tiny random model is exported, compiled (``compile_model``) and run
through ``CausalLM``: in fp32 the greedy tokens equal transformers' ``generate(do_sample=False)`` token for
token (prompts over several prefill chunks, more prompts than KV slots, decode crossing chunk
boundaries); with fp16, MX FP6 weights and MX INT8 KV cache the logits stay within the tolerances
documented in docs/aot-numerics.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from models import TINY_ARCHS, HFReference, more_prompts

import qaic_aot
from qaic_core.settings import CompileSettings

os.environ.setdefault("QAIC_BACKEND", "sim")

BASE = {"prefill_seq_len": 8, "ctx_len": 64, "full_batch_size": 4, "num_cores": 1}
MAX_NEW_TOKENS = 10
TEACHER_STEPS = 6

# Largest |logit - fp32 reference| allowed, relative to the largest |reference logit| (docs/aot-numerics.md).
PRECISIONS: dict[str, tuple[dict[str, bool], float]] = {
    "fp32": ({"convert_to_fp16": False}, 1e-5),
    "fp16": ({"convert_to_fp16": True}, 6e-3),
    "mxint8": ({"convert_to_fp16": True, "mxint8": True}, 4e-2),
    "mxfp6": ({"convert_to_fp16": True, "mxfp6": True}, 0.2),
    "mxfp6+mxint8": ({"convert_to_fp16": True, "mxfp6": True, "mxint8": True}, 0.2),
}


@pytest.fixture(scope="module")
def qeff_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qeff-home")


@pytest.fixture(scope="module")
def references(tiny_model_factory: Callable[[str], Path]) -> Callable[[str], HFReference]:
    cache: dict[str, HFReference] = {}

    def get(arch: str) -> HFReference:
        if arch not in cache:
            cache[arch] = HFReference(tiny_model_factory(arch))
        return cache[arch]

    return get


@contextmanager
def _causal_lm(model_dir: Path, settings: CompileSettings, qeff_home: Path) -> Iterator[qaic_aot.CausalLM]:
    qpc_dir = qaic_aot.compile_model(model_dir, settings, progress=False, qeff_home=qeff_home)
    session = qaic_aot.QAICInferenceSession(qpc_dir / "qpc")
    try:
        yield qaic_aot.CausalLM(session, settings)
    finally:
        session.deactivate()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_tokens_match_transformers_fp32(
    arch: str,
    tiny_model_factory: Callable[[str], Path],
    references: Callable[[str], HFReference],
    qeff_home: Path,
) -> None:
    ref = references(arch)
    prompts = more_prompts(ref.tokenizer)
    assert max(len(p) for p in prompts) > 3 * BASE["prefill_seq_len"]
    settings = CompileSettings(**BASE, convert_to_fp16=False)
    with _causal_lm(tiny_model_factory(arch), settings, qeff_home) as lm:
        got = lm.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=ref.eos_token_id)
    expected = [ref.greedy(p, MAX_NEW_TOKENS) for p in prompts]
    assert got == expected


def teacher_forced_error(lm: qaic_aot.CausalLM, ref: HFReference) -> tuple[float, float]:
    """Max |logits - reference| and max |reference| over chunked prefills and joint decode steps."""
    prompts = more_prompts(ref.tokenizer)[1:4]
    slots = [0, 2, 3]  # slot 1 stays unused: its decode row is padding
    tokens = [ref.greedy(p, MAX_NEW_TOKENS)[:TEACHER_STEPS] for p in prompts]
    expected = [ref.logits(p + t) for p, t in zip(prompts, tokens, strict=True)]
    diffs, scale = [], 0.0
    for slot, prompt, exp in zip(slots, prompts, expected, strict=True):
        diffs.append(np.abs(lm.prefill(slot, prompt) - exp[len(prompt) - 1]).max())
        scale = max(scale, float(np.abs(exp).max()))
    for step in range(TEACHER_STEPS - 1):
        rows = {
            slot: (toks[step], len(prompt) + step)
            for slot, prompt, toks in zip(slots, prompts, tokens, strict=True)
            if step < len(toks) - 1
        }
        out = lm.decode(rows)
        for slot, prompt, exp in zip(slots, prompts, expected, strict=True):
            if slot in rows:
                diffs.append(np.abs(out[slot] - exp[len(prompt) + step]).max())
    return float(max(diffs)), scale


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_within_documented_tolerance(
    arch: str,
    precision: str,
    tiny_model_factory: Callable[[str], Path],
    references: Callable[[str], HFReference],
    qeff_home: Path,
) -> None:
    flags, rtol = PRECISIONS[precision]
    settings = CompileSettings(**BASE, **flags)
    with _causal_lm(tiny_model_factory(arch), settings, qeff_home) as lm:
        error, scale = teacher_forced_error(lm, references(arch))
    print(f"{arch} {precision}: max |dlogit| {error:.3e} = {error / scale:.2e} of max |logit| {scale:.2f}")
    assert error <= rtol * scale, f"{precision} logits off by {error:.3e} (limit {rtol * scale:.3e})"
    if precision != "fp32":
        # The reduced-precision program really differs from fp32 (the compiler applied the setting).
        assert error > 1e-5 * scale
