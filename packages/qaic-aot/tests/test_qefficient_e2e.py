"""End to end with QEfficient installed: its exporter writes the ONNX, the simulator compiles and runs it.

QEfficient is not on the package index CI installs from, so this module is skipped there; it runs in
any environment where ``import QEfficient`` works (docs/aot.md, "QEfficient's exporter, checked end to end"). Each case
exports a tiny random Llama with ``QEFFAutoModelForCausalLM`` (the default exporter when QEfficient is
importable), compiles it with the simulated ``qaic-compile`` and checks greedy tokens against
transformers, token for token: through our ``CausalLM`` (continuous batching with more prompts than
slots, one sequence at a time, a speculative target), through QEfficient's own
``cloud_ai_100_exec_kv`` over the simulator's ``qaicrt``, and through QEfficient's whole flow
(``export``, ``compile`` with the simulated compiler in place of the SDK's binary, ``generate``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from models import HFReference, more_prompts

import qaic_aot
from qaic_aot.export.onnx_export import EXPORTER_ENV, choose_exporter
from qaic_core.settings import CompileSettings

pytest.importorskip("QEfficient", reason="QEfficient is not installed (it is not on the package index)")

MAX_NEW_TOKENS = 10
BASE = {"prefill_seq_len": 8, "ctx_len": 64, "num_cores": 1, "convert_to_fp16": False}
CASES = {
    "continuous-batching": {"full_batch_size": 4},
    "one-sequence": {},
    "speculative-target": {"full_batch_size": 4, "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", autouse=True)
def qefficient_exporter() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EXPORTER_ENV, "qefficient")
        mp.setenv("QAIC_BACKEND", "sim")
        yield


@pytest.fixture(scope="module")
def qeff_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qeff-home")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> HFReference:
    return HFReference(model_dir)


def _compile(model_dir: Path, settings: CompileSettings, qeff_home: Path) -> Path:
    return qaic_aot.compile_model(model_dir, settings, progress=False, qeff_home=qeff_home)


def test_qefficient_is_the_default_exporter_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXPORTER_ENV)
    assert choose_exporter() == "qefficient"


@pytest.mark.parametrize("case", list(CASES))
def test_qefficient_export_compiled_by_the_simulator_matches_transformers(
    case: str, model_dir: Path, ref: HFReference, qeff_home: Path
) -> None:
    settings = CompileSettings(**BASE, **CASES[case])
    qpc_dir = _compile(model_dir, settings, qeff_home)

    entry = qpc_dir.parent
    params = json.loads((entry / "hashed_export_params.json").read_text())
    assert params["route"] == "qefficient" and params["exporter"].startswith("QEfficient ")
    graph = onnx.load(str(entry / f"{model_dir.name}.onnx"), load_external_data=False)
    used = {(f.domain, f.name) for f in graph.functions}
    suffix = "CB" if settings.full_batch_size else ""
    assert ("com.qualcomm.cloud", f"CtxScatter{suffix}") in used  # QEfficient's own KV ops
    assert not [p for p in entry.iterdir() if p.is_dir() and p.name.startswith("qefficient-export")]

    prompts = more_prompts(ref.tokenizer)
    session = qaic_aot.QAICInferenceSession(qpc_dir / "qpc")
    try:
        lm = qaic_aot.CausalLM(session, settings)
        got = lm.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=ref.eos_token_id)
    finally:
        session.deactivate()
    assert got == [ref.greedy(p, MAX_NEW_TOKENS) for p in prompts]


def test_qefficients_own_generation_runs_the_program_on_the_simulator(
    model_dir: Path, ref: HFReference, qeff_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cloud_ai_100_exec_kv`` over the simulator's ``qaicrt``, as it runs over the Platform SDK's."""
    from QEfficient.generation import cloud_infer
    from QEfficient.generation.text_generation_inference import cloud_ai_100_exec_kv

    from qaic_sim import aicapi, qaicrt

    # What installing the Platform SDK provides: importable qaicrt and QAicApi_pb2 modules.
    monkeypatch.setattr(cloud_infer, "qaicrt", qaicrt, raising=False)
    monkeypatch.setattr(cloud_infer, "aicapi", aicapi, raising=False)
    monkeypatch.setattr(cloud_infer, "is_qaicrt_imported", True)
    monkeypatch.setattr(cloud_infer, "is_aicapi_imported", True, raising=False)

    settings = CompileSettings(**BASE, **CASES["continuous-batching"])
    qpc = _compile(model_dir, settings, qeff_home) / "qpc"
    # One prompt per slot: with more prompts than slots, QEfficient's own bookkeeping (its
    # update_decode_input stores a refilled slot's first token in the row of the slot's number, not of
    # the prompt) overwrites the first token reported for an earlier prompt; the device results are right.
    texts = [
        "Hello world!",
        "Once upon a time there was a small decoder that predicted",
        "The quick brown fox",
        "Paris.",
    ]
    out: Any = cloud_ai_100_exec_kv(
        ref.tokenizer, str(qpc), prompt=texts, generation_len=MAX_NEW_TOKENS, stream=False
    )
    generated = np.asarray(out.generated_ids)
    for row, text in zip(generated, texts, strict=True):
        expected = ref.greedy(list(ref.tokenizer(text)["input_ids"]), MAX_NEW_TOKENS)
        assert [int(t) for t in row[: len(expected)]] == expected, text


def test_qefficients_own_export_compile_and_generate_on_the_simulator(
    ref: HFReference, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QEfficient's whole flow, with the simulated ``qaic-compile`` in place of the SDK's binary."""
    from QEfficient import QEFFAutoModelForCausalLM
    from QEfficient.generation import cloud_infer
    from QEfficient.utils import constants

    from qaic_sim import aicapi, qaicrt

    # The SDK's compiler is a fixed path (/opt/qti-aic/exec/qaic-compile); the simulator's takes its flags.
    monkeypatch.setattr(constants, "COMPILER", [sys.executable, "-m", "qaic_sim.cli", "compile", "-aic-hw"])
    monkeypatch.setattr(cloud_infer, "qaicrt", qaicrt, raising=False)
    monkeypatch.setattr(cloud_infer, "aicapi", aicapi, raising=False)
    monkeypatch.setattr(cloud_infer, "is_qaicrt_imported", True)
    monkeypatch.setattr(cloud_infer, "is_aicapi_imported", True, raising=False)

    model = QEFFAutoModelForCausalLM.from_pretrained(str(model_dir), continuous_batching=True)
    onnx_path = model.export(export_dir=str(tmp_path / "export"))
    qpc = model.compile(
        onnx_path=str(onnx_path),
        compile_dir=str(tmp_path / "compile"),
        prefill_seq_len=8,
        ctx_len=64,
        full_batch_size=4,
        num_cores=1,
    )  # QEfficient's defaults: -convert-to-fp16, float16 KV cache
    assert (Path(qpc) / "programqpc.bin").is_file() or (Path(qpc) / "qpc" / "programqpc.bin").is_file()
    texts = ["Hello world!", "The quick brown fox", "Paris.", "Once upon a time there was"]
    out: Any = model.generate(tokenizer=ref.tokenizer, prompts=texts, generation_len=MAX_NEW_TOKENS)
    for row, text in zip(np.asarray(out.generated_ids), texts, strict=True):
        expected = ref.greedy(list(ref.tokenizer(text)["input_ids"]), MAX_NEW_TOKENS)
        assert [int(t) for t in row[: len(expected)]] == expected, text
