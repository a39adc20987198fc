"""Part 1: the raw session loop that ``vllm serve`` is compared with (same QPC, pacing and batch)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qaic_bench.server import ServeShape
from qaic_core.settings import CompileSettings

log = logging.getLogger("qaic.bench")


def compile_settings(shape: ServeShape, dtype: str) -> CompileSettings:
    """The compile settings ``vllm serve`` derives from these engine arguments (qaic_vllm.config)."""
    from qaic_vllm.prefill import prefill_shapes

    prefill = min(shape.prefill_seq_len, shape.max_model_len)
    shapes = prefill_shapes(shape.overrides(), prefill, shape.max_num_seqs, prebuilt=False)
    return CompileSettings(
        prefill_seq_len=prefill,
        prefill_seq_lens=shapes.seq_lens,  # the plugin's shorter and batched prefills
        prefill_batch_size=shapes.batch_size,
        prefill_batch_seq_len=shapes.given_batch_seq_len,
        ctx_len=shape.max_model_len,
        batch_size=1,
        full_batch_size=shape.max_num_seqs,
        convert_to_fp16=dtype == "float16",
        aic_enable_depth_first=True,  # the plugin's default, as vllm-qaic's
        comp_ctx_lengths_prefill=tuple(shape.comp_ctx_lengths),
        comp_ctx_lengths_decode=tuple(shape.comp_ctx_lengths),
    )


def qpc_dirs(qeff_home: Path) -> set[Path]:
    """Every compiled program under a QEFF_HOME (``.../qpc-<hash>`` holding ``qpc/programqpc.bin``)."""
    return {p.parent.parent for p in qeff_home.glob("**/qpc-*/qpc/programqpc.bin")}


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids drawn past the first few (special) tokens."""
    rng = np.random.default_rng(seed)
    low = min(16, vocab_size - 1)
    return [rng.integers(low, vocab_size, size=n).tolist() for n in lengths]


def raw_session_loop(
    model_dir: Path,
    shape: ServeShape,
    dtype: str,
    qeff_home: Path,
    input_lens: Sequence[int],
    output_len: int,
    *,
    require_cached: bool = True,
) -> dict[str, Any]:
    """Greedy generation with ``CausalLM`` on the QPC ``vllm serve`` compiled; output tokens per second.

    With ``require_cached`` the QPC must already be in ``qeff_home``: a new compile here would mean
    the settings differ from the server's, and the comparison would not be of the same program.
    """
    from qaic_aot import CausalLM, QAICInferenceSession, compile_model

    settings = compile_settings(shape, dtype)
    before = qpc_dirs(qeff_home)
    qpc = compile_model(model_dir, settings, progress=False, qeff_home=qeff_home)
    if require_cached and qpc not in before:
        raise RuntimeError(
            f"the raw loop compiled a new program {qpc} instead of reusing the server's "
            f"{sorted(str(p) for p in before)}: its compile settings differ from the engine's"
        )
    session = QAICInferenceSession(qpc / "qpc")
    try:
        lm = CausalLM(session, settings)
        batch = lm.full_batch_size
        prompts = random_prompts(input_lens, lm.vocab_size)
        log.info("raw loop: warming up with %d prompts", batch)
        lm.generate(prompts[:batch], max_new_tokens=2)
        log.info("raw loop: %d prompts x %d tokens, %d slots", len(prompts), output_len, batch)
        t0 = time.perf_counter()
        outputs = lm.generate(prompts, max_new_tokens=output_len)
        elapsed = time.perf_counter() - t0
    finally:
        session.deactivate()
    tokens = sum(len(o) for o in outputs)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed, "qpc": str(qpc)}
