"""Compute-context lengths end to end: settings, QEfficient's specializations, CausalLM's choice per run.

The program is compiled with one prefill specialization per prefill length and one decode per decode
length; each run takes the shortest length that holds the furthest position of any of its rows.
Greedy output equals transformers' while prompts and decodes cross the lengths, and a decode of a
short sequence costs less modelled device time than on a program without them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from models import HFReference, more_prompts

from qaic_aot import CausalLM, QAICInferenceSession, compile_model, program_config
from qaic_aot.session import RunHandle
from qaic_core import ccl
from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

BASE = CompileSettings(prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1, convert_to_fp16=False)
SETTINGS = BASE.replace(comp_ctx_lengths_prefill=(16,), comp_ctx_lengths_decode=(16, 32))
SYMBOLS = frozenset({"batch_size", "seq_len", "ctx_len", "full_batch_size", "comp_ctx_lengths"})


def test_lists_complete_to_ctx_len_and_follow_qefficients_generation() -> None:
    assert SETTINGS.compute_context_lengths == ((16, 64), (16, 32, 64))
    assert BASE.compute_context_lengths is None
    assert BASE.replace(comp_ctx_lengths_decode=(16,)).compute_context_lengths == ((64,), (16, 64))
    # ccl_enabled alone: QEfficient's generated lists (one length up to 4096).
    assert BASE.replace(ccl_enabled=True).compute_context_lengths == ((64,), (64,))
    big = CompileSettings(prefill_seq_len=128, ctx_len=32768, ccl_enabled=True)
    assert big.compute_context_lengths == ((4000, 8000, 16000, 32768), (4096, 8192, 16384, 32768))
    assert ccl.automatic_lists(8192, 1) == ((4096, 8192), (4096, 8192))
    assert ccl.covering((16, 32, 64), 15) == 16 and ccl.covering((16, 32, 64), 16) == 32


def test_ccl_specializations_follow_qefficient() -> None:
    specs = program_config.specializations(SETTINGS, SYMBOLS)
    common = {"ctx_len": 64, "full_batch_size": 2}
    assert [(s.name, s.symbols) for s in specs] == [
        ("Prefill", {"batch_size": 1, "seq_len": 8, "comp_ctx_lengths": 16, **common}),
        ("Prefill", {"batch_size": 1, "seq_len": 8, "comp_ctx_lengths": 64, **common}),
        ("Decode", {"batch_size": 2, "seq_len": 1, "comp_ctx_lengths": 16, **common}),
        ("Decode", {"batch_size": 2, "seq_len": 1, "comp_ctx_lengths": 32, **common}),
        ("Decode", {"batch_size": 2, "seq_len": 1, "comp_ctx_lengths": 64, **common}),
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"comp_ctx_lengths_decode": "16,128"}, r"comp_ctx_lengths_decode \[16, 128\]: 128 exceeds ctx_len \(64"),
        ({"comp_ctx_lengths_prefill": [32, 16]}, r"comp_ctx_lengths_prefill \[32, 16\] is not ascending.*\[16, 32\]"),
        ({"comp_ctx_lengths_decode": [16, 16]}, r"comp_ctx_lengths_decode \[16, 16\] is not ascending"),
        ({"comp_ctx_lengths_decode": "16,x"}, r"comp_ctx_lengths_decode '16,x' is not a list of lengths"),
        ({"ccl_enabled": True, "num_speculative_tokens": 2}, "cannot be combined"),
    ],
)  # fmt: skip
def test_bad_lists_are_refused_naming_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(QaicConfigError, match=message):
        CompileSettings.from_mapping({"prefill_seq_len": 8, "ctx_len": 64, **values})


@pytest.fixture(scope="module")
def ccl_lm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CausalLM]:
    qpc = compile_model(tiny_llama, SETTINGS, qeff_home=tmp_path_factory.mktemp("qeff"), progress=False)
    session = QAICInferenceSession(qpc)
    yield CausalLM(session, SETTINGS)
    session.deactivate()


class _Recorder:
    """Wraps a session's submit to note each run's (input_ids shape, compute-context length)."""

    def __init__(self, session: QAICInferenceSession) -> None:
        self.runs: list[tuple[tuple[int, ...], int]] = []
        self._submit = session.submit

    def __call__(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> RunHandle:
        self.runs.append((inputs["input_ids"].shape, len(inputs["comp_ctx_lengths"])))
        return self._submit(inputs, exec_index)


def test_greedy_output_equals_transformers_across_the_lengths(
    ccl_lm: CausalLM, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = layout.read_specializations(Path(ccl_lm.session.qpc_path).parent / layout.SPECIALIZATIONS_FILE)
    assert [s.symbols["comp_ctx_lengths"] for s in specs] == [16, 64, 16, 32, 64]
    ref = HFReference(tiny_llama)
    prompts = more_prompts(ref.tokenizer)
    long_prompt = (prompts[1] + prompts[3])[:20]  # chunks at 0-7, 8-15 (length 16) and 16-19 (64)
    short_prompt = prompts[0][:5]
    new_tokens = 16  # the long sequence decodes from position 20 across 32 to 35
    recorder = _Recorder(ccl_lm.session)
    monkeypatch.setattr(ccl_lm.session, "submit", recorder)
    out = ccl_lm.generate([long_prompt, short_prompt], new_tokens)
    assert out == [ref.greedy(long_prompt, new_tokens), ref.greedy(short_prompt, new_tokens)]
    prefills = [c for shape, c in recorder.runs if shape == (1, 8)]
    decodes = [c for shape, c in recorder.runs if shape == (2, 1)]
    assert prefills[:3] == [16, 16, 64]  # the third chunk reaches position 19
    assert prefills[3:] == [16]  # the short prompt
    assert decodes == sorted(decodes) and set(decodes) == {32, 64}  # the longest row decides
    assert ccl_lm.compute_context_length(2, 1, 31) == 32


def test_a_short_context_decode_costs_less_device_time(
    ccl_lm: CausalLM, tiny_llama: Path, tmp_path: Path
) -> None:
    def decode_time(lm: CausalLM) -> float:
        lm.prefill(0, [5, 6, 7])
        lm.decode({0: (8, 3)})  # positions up to 3: the 16-position length on the CCL program
        return float(lm.session._exec[0].lastDeviceTimeS)

    plain_qpc = compile_model(tiny_llama, BASE, qeff_home=tmp_path, progress=False)
    with QAICInferenceSession(plain_qpc) as session:
        plain = decode_time(CausalLM(session, BASE))
    short = decode_time(ccl_lm)
    assert 0 < short < plain


def test_the_memory_estimate_counts_the_ccl_input(ccl_lm: CausalLM, tiny_llama: Path) -> None:
    from qaic_aot import memory
    from qaic_sim.qpcfile import read_manifest

    manifest, _ = read_manifest(Path(ccl_lm.session.qpc_path))
    estimate = memory.program_memory(memory.model_dims(tiny_llama), SETTINGS)
    assert estimate.retained == manifest.retained_bytes
    assert estimate.activations == manifest.activation_bytes
    assert estimate.weights >= manifest.weights_bytes  # the traced graph has fewer constants


def test_a_program_without_ccl_is_refused_for_ccl_settings(tiny_llama: Path, tmp_path: Path) -> None:
    from qaic_aot.validate import validate_qpc

    plain_qpc = compile_model(tiny_llama, BASE, qeff_home=tmp_path, progress=False)
    with pytest.raises(QaicConfigError, match="no comp_ctx_lengths input: recompile with ccl_enabled"):
        validate_qpc(plain_qpc, tiny_llama, SETTINGS)
