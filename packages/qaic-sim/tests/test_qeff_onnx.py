"""The simulated qaic-compile takes ONNX as QEfficient writes it, unchanged, and runs it as the device does.

The program (``qeff_models``) carries every QEfficient export feature the real compiler accepts: named
output dims shape inference must size, ``CustomRMSNorm`` in ``com.qti.aisw.onnx``, ``CtxGatherCB``
with a third ``comp_ctx_len`` input, ``INT32_MAX`` as the invalid position in CtxScatter/CtxGather,
``Constant(value_ints)`` in function bodies, and compute-context-length specializations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from qeff_models import INT32_MAX, VOCAB, QeffReference, QeffWeights, write_qeff_model
from qeff_session import QeffStyleSession
from sim_programs import ccl_specs, compile_program, write_matmul_model

from qaic_core.types import Specialization
from qaic_sim import aicapi, qaicrt, qpcfile
from qaic_sim.cli import main as sim_cli

CTX, SLOTS, CHUNK = 16, 2, 4
CCLS = (8, 16)


def specs() -> list[Specialization]:
    return ccl_specs(SLOTS, CTX, CHUNK, CCLS)


@pytest.fixture(scope="module")
def weights() -> QeffWeights:
    return QeffWeights.random(seed=3)


@pytest.fixture(scope="module")
def qpc(tmp_path_factory: pytest.TempPathFactory, weights: QeffWeights) -> Path:
    root = tmp_path_factory.mktemp("qeff-onnx")
    onnx_path = write_qeff_model(root / "model.onnx", weights)
    return compile_program(root / "qpc-x", onnx_path, specs())


def ccl_for(position: int) -> int:
    """QEfficient's choice: the smallest compute-context length that holds the position."""
    return next(c for c in CCLS if position < c)


def test_qeff_program_runs_chunked_prefill_and_decode_as_the_device(qpc: Path, weights: QeffWeights) -> None:
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    assert s.binding_index_map["comp_ctx_lengths"] == 5
    # The named logits dims were sized per specialization: [1, 1, V] for prefill, [2, 1, V] for decode.
    logits = s.bindings[s.binding_index_map["logits"]]
    assert list(logits.dims) == [SLOTS, 1, VOCAB]
    assert sorted({tuple(shape[6][1]) for shape in s.allowed_shapes}) == [(1, 1, VOCAB), (SLOTS, 1, VOCAB)]
    s.skip_buffers(["past_key.0", "past_value.0", "past_key.0_RetainedState", "past_value.0_RetainedState"])
    ref = QeffReference(weights, SLOTS, CTX)
    prompt = [5, 9, 2, 17, 30, 11]
    for start in range(0, len(prompt), CHUNK):
        chunk = prompt[start : start + CHUNK]
        ids = np.zeros((1, CHUNK), np.int64)
        pos = np.full((1, CHUNK), -1, np.int64)  # the graph turns -1 into INT32_MAX for the scatter
        ids[0, : len(chunk)] = chunk
        pos[0, : len(chunk)] = np.arange(start, start + len(chunk))
        ccl = ccl_for(start + CHUNK - 1)
        inputs = {
            "input_ids": ids,
            "position_ids": pos,
            "batch_index": np.array([[1]], np.int64),
            "comp_ctx_lengths": np.zeros(ccl, np.int64),
            "logits": np.zeros((1, 1, VOCAB), np.float32),
        }
        out = s.run(inputs)
        expected = ref.run(ids, pos, np.array([1]), ccl)
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)
    token = int(np.argmax(out["logits"][0, -1]))
    for position in range(len(prompt), 10):  # crosses from the 8-position to the 16-position program
        ids = np.array([[0], [token]], np.int64)
        pos = np.array([[-1], [position]], np.int64)  # slot 0 is idle
        ccl = ccl_for(position)
        out = s.run(
            {
                "input_ids": ids,
                "position_ids": pos,
                "batch_index": np.arange(SLOTS, dtype=np.int64).reshape(-1, 1),
                "comp_ctx_lengths": np.zeros(ccl, np.int64),
                "logits": np.zeros((SLOTS, 1, VOCAB), np.float32),
            }
        )
        expected = ref.run(ids, pos, np.arange(SLOTS), ccl)
        np.testing.assert_allclose(out["logits"][1], expected[1], rtol=1e-5, atol=1e-5)
        token = int(np.argmax(out["logits"][1, -1]))
    s.deactivate()
    status, perf = qaicrt.Util().getPerformanceInfo(0)
    assert status == qaicrt.QStatus.SUCCESS and perf.deviceTimeS > 0


def test_int32_max_positions_write_nothing(qpc: Path, weights: QeffWeights) -> None:
    """A chunk of padding only (every position INT32_MAX after the graph's Where) leaves the cache as it was."""
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    kv = np.random.default_rng(0).standard_normal((SLOTS, 2, CTX, 8)).astype(np.float32)
    out = s.run(
        {
            "input_ids": np.zeros((1, CHUNK), np.int64),
            "position_ids": np.array([[0, -1, -1, -1]], np.int64),
            "past_key.0": kv,
            "past_value.0": kv,
            "batch_index": np.array([[0]], np.int64),
            "comp_ctx_lengths": np.zeros(8, np.int64),
            "logits": np.zeros((1, 1, VOCAB), np.float32),
            "past_key.0_RetainedState": np.zeros_like(kv),
            "past_value.0_RetainedState": np.zeros_like(kv),
        }
    )
    kept = out["past_key.0_RetainedState"]
    np.testing.assert_array_equal(kept[1], kv[1])  # the other slot
    np.testing.assert_array_equal(kept[0, :, 1:], kv[0, :, 1:])  # every position but the one written
    assert not np.array_equal(kept[0, :, 0], kv[0, :, 0])
    assert INT32_MAX > CTX
    s.deactivate()


def test_held_state_is_written_in_place_and_supplied_inputs_are_not(qpc: Path) -> None:
    """The device kernels update the held KV where it lies; a KV the caller supplies stays untouched."""
    manifest, _ = qpcfile.read_manifest(qpcfile.find_program(qpc))
    assert manifest.in_place == ("past_key.0", "past_value.0")
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    kv = np.random.default_rng(1).standard_normal((SLOTS, 2, CTX, 8)).astype(np.float32)
    before = kv.copy()
    inputs = {
        "input_ids": np.ones((1, CHUNK), np.int64),
        "position_ids": np.arange(CHUNK, dtype=np.int64)[None],
        "batch_index": np.array([[1]], np.int64),
        "comp_ctx_lengths": np.zeros(8, np.int64),
        "logits": np.zeros((1, 1, VOCAB), np.float32),
        "past_key.0_RetainedState": np.zeros_like(kv),
        "past_value.0_RetainedState": np.zeros_like(kv),
    }
    out = s.run({**inputs, "past_key.0": kv, "past_value.0": kv})
    np.testing.assert_array_equal(kv, before)
    assert not np.array_equal(out["past_key.0_RetainedState"][1, :, :CHUNK], before[1, :, :CHUNK])
    supplied = out["past_key.0_RetainedState"].copy()
    # The next run reads the held state (no KV supplied) and writes position CHUNK in place.
    s.skip_buffers(["past_key.0", "past_value.0"])
    out = s.run({**inputs, "position_ids": np.array([[CHUNK, -1, -1, -1]], np.int64)})
    kept = out["past_key.0_RetainedState"]
    np.testing.assert_array_equal(kept[:, :, :CHUNK], supplied[:, :, :CHUNK])
    np.testing.assert_array_equal(kept[0], supplied[0])
    assert not np.array_equal(kept[1, :, CHUNK], supplied[1, :, CHUNK])
    s.deactivate()


def test_fp16_program_rounds_a_supplied_kv_and_updates_the_held_kv_in_place(
    tmp_path: Path, weights: QeffWeights
) -> None:
    """-convert-to-fp16: a float32 KV the caller hands in enters as fp16 values; the held KV is
    updated where it lies, as in a float32 program, and keeps fp16 values."""
    onnx_path = write_qeff_model(tmp_path / "model.onnx", weights)
    qpc16 = compile_program(
        tmp_path / "qpc16", onnx_path, specs(), flags=("-retained-state", "-convert-to-fp16")
    )
    manifest, _ = qpcfile.read_manifest(qpcfile.find_program(qpc16))
    assert manifest.convert_to_fp16 and manifest.in_place == ("past_key.0", "past_value.0")
    r16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    kv = np.random.default_rng(4).standard_normal((SLOTS, 2, CTX, 8)).astype(np.float32)
    assert not np.array_equal(kv, r16(kv))
    s = QeffStyleSession(qaicrt, aicapi, str(qpc16), device_ids=[0])
    inputs = {
        "input_ids": np.ones((1, CHUNK), np.int64),
        "position_ids": np.arange(CHUNK, dtype=np.int64)[None],
        "batch_index": np.array([[1]], np.int64),
        "comp_ctx_lengths": np.zeros(CTX, np.int64),
        "logits": np.zeros((1, 1, VOCAB), np.float32),
        "past_key.0_RetainedState": np.zeros_like(kv),
        "past_value.0_RetainedState": np.zeros_like(kv),
    }
    out = s.run({**inputs, "past_key.0": kv, "past_value.0": kv})
    kept = out["past_key.0_RetainedState"]
    np.testing.assert_array_equal(kept[0], r16(kv[0]))  # the other slot: the supplied values at fp16
    np.testing.assert_array_equal(kept[1, :, CHUNK:], r16(kv[1, :, CHUNK:]))
    s.skip_buffers(["past_key.0", "past_value.0"])
    s.run({**inputs, "position_ids": np.array([[CHUNK, -1, -1, -1]], np.int64)})
    held = s.program.state["past_key.0"]
    s.run({**inputs, "position_ids": np.array([[CHUNK + 1, -1, -1, -1]], np.int64)})
    assert s.program.state["past_key.0"] is held  # written in place, not replaced by a copy
    np.testing.assert_array_equal(held, r16(held))
    np.testing.assert_array_equal(held[0], r16(kv[0]))
    np.testing.assert_array_equal(held[1, :, :CHUNK], kept[1, :, :CHUNK])
    s.deactivate()


def test_compute_context_length_is_charged_per_specialization(qpc: Path) -> None:
    manifest, _ = qpcfile.read_manifest(qpcfile.find_program(qpc))
    costs = {(spec.name, spec.symbols["comp_ctx_lengths"]): spec.cost for spec in manifest.specs}
    for phase in ("Prefill", "Decode"):
        short, full = costs[(phase, 8)], costs[(phase, 16)]
        assert short is not None and full is not None
        assert 0 < short["kv_read_bytes"] < full["kv_read_bytes"]
        assert 0 < short["flops"] < full["flops"]


def test_one_specialization_lists_no_allowed_shapes(tmp_path: Path) -> None:
    onnx_path, _ = write_matmul_model(tmp_path / "mm.onnx", width=8)
    qpc = compile_program(
        tmp_path / "qpc-one", onnx_path, [Specialization("b2", {"batch_size": 2})], flags=()
    )
    status, data = qaicrt.Qpc(str(qpc)).getIoDescriptor()
    assert status == qaicrt.QStatus.SUCCESS
    desc = aicapi.IoDesc()
    desc.ParseFromString(bytes(data))
    assert len(desc.allowed_shapes) == 0
    assert [list(b.dims) for b in desc.selected_set.bindings] == [[2, 8], [2, 8]]


def test_compile_errors_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = sim_cli(["compile", "-aic-hw", f"-m={tmp_path / 'missing.onnx'}", f"-aic-binary-dir={tmp_path}/q"])
    captured = capsys.readouterr()
    assert code == 2
    assert "missing.onnx" in captured.err and "error" in captured.err
    assert "missing.onnx" not in captured.out
