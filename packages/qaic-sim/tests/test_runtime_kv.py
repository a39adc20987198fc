"""Runtime semantics on a retained-KV program built from CtxScatter/CtxGather ONNX functions."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from qeff_session import QeffStyleSession
from sim_programs import D, KvReference, compile_program, kv_specs, write_kv_model

from qaic_sim import aicapi, mx, qaicrt
from qaic_sim.qaicrt import QStatus

FBS, CTX, PRE = 2, 16, 4


@pytest.fixture(scope="module")
def kv_program(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("kv")
    onnx_path, w = write_kv_model(root / "kv.onnx")
    return compile_program(root / "prog", onnx_path, kv_specs(FBS, CTX, PRE)), w


def _prefill(rng: np.random.Generator, slot: int, start: int) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((1, PRE, D)).astype(np.float32),
        "position_ids": np.arange(start, start + PRE, dtype=np.int64)[None],
        "batch_index": np.array([[slot]], np.int64),
    }


def _decode(rng: np.random.Generator, positions: list[int]) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((FBS, 1, D)).astype(np.float32),
        "position_ids": np.array(positions, np.int64)[:, None],
        "batch_index": np.arange(FBS, dtype=np.int64)[:, None],
    }


def test_kv_round_trips_across_prefill_and_decode(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, w = kv_program
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    ref = KvReference(w, FBS, CTX)
    rng = np.random.default_rng(3)
    s.skip_buffers(["past_key.0", "past_key.0_RetainedState"])
    for slot in range(FBS):
        inputs = _prefill(rng, slot, 0)
        s.set_buffers({"y": np.zeros((1, D), np.float32)})
        out = s.run(inputs)
        np.testing.assert_allclose(
            out["y"],
            ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"]),
            rtol=1e-5,
            atol=1e-5,
        )
        assert "past_key.0_RetainedState" not in out  # a zero-size output is not copied back
    s.set_buffers({"y": np.zeros((FBS, D), np.float32)})
    for step in range(3):
        inputs = _decode(rng, [PRE + step] * FBS)
        out = s.run(inputs)
        expected = ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"])
        np.testing.assert_allclose(out["y"], expected, rtol=1e-5, atol=1e-5)
    s.deactivate()


def test_supplied_kv_replaces_the_retained_state(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, w = kv_program
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[1])
    rng = np.random.default_rng(4)
    inputs = _prefill(rng, 1, 0)
    past = rng.standard_normal((FBS, 1, CTX, D)).astype(np.float32)
    s.set_buffers(
        {
            "y": np.zeros((1, D), np.float32),
            "past_key.0_RetainedState": np.zeros((FBS, 1, CTX, D), np.float32),
        }
    )
    out = s.run({**inputs, "past_key.0": past})
    ref = KvReference(w, FBS, CTX)
    ref.cache[:] = past
    expected_y = ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"])
    np.testing.assert_allclose(out["y"], expected_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["past_key.0_RetainedState"], ref.cache, rtol=1e-6)
    s.deactivate()


def test_specialization_is_chosen_by_outputs_too(
    kv_program: tuple[Path, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    qpc, _ = kv_program
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    s.skip_buffers(["past_key.0", "past_key.0_RetainedState"])
    assert len(s.allowed_shapes) == 2
    rng = np.random.default_rng(5)
    # Prefill inputs with the decode-shaped output buffer: no specialization has both.
    s.set_buffers({"y": np.zeros((FBS, D), np.float32)})
    with caplog.at_level(logging.ERROR, logger="qaic.sim.runtime"), pytest.raises(ValueError):
        s.run(_prefill(rng, 0, 0))
    assert "No matching dimension found" in caplog.text
    assert "Prefill" in caplog.text and "Decode" in caplog.text
    assert s.exec_obj.lastError.startswith("No matching dimension found")
    # The same inputs with a matching output run the prefill specialization.
    s.set_buffers({"y": np.zeros((1, D), np.float32)})
    s.run(_prefill(rng, 0, 0))
    assert s.exec_obj.lastSpecialization == "Prefill"
    s.deactivate()


def test_zero_copy_setdata_fills_outputs_in_place(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, w = kv_program
    ctx = qaicrt.Context(qaicrt.QIDList([2]))
    queue = qaicrt.Queue(ctx, 2)
    program = qaicrt.Program(ctx, 2, qaicrt.Qpc(str(qpc)), qaicrt.QAicProgramProperties())
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    rng = np.random.default_rng(6)
    ref = KvReference(w, FBS, CTX)
    inputs = _decode(rng, [0, 5])
    y = np.full((FBS, D), np.nan, np.float32)
    pairs = [(0, inputs["x"]), (1, inputs["position_ids"]), (2, inputs["batch_index"]), (4, y)]
    assert exe.setData(pairs) == QStatus.SUCCESS
    assert queue.enqueue(exe) == QStatus.SUCCESS
    assert exe.waitForCompletion() == QStatus.SUCCESS
    np.testing.assert_allclose(
        y, ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"]), rtol=1e-5, atol=1e-5
    )
    # Without past_key.0 and with no y buffer: the state still advances on the device.
    inputs = _decode(rng, [1, 6])
    assert (
        exe.setData([(0, inputs["x"]), (1, inputs["position_ids"]), (2, inputs["batch_index"])])
        == QStatus.SUCCESS
    )
    queue.enqueue(exe)
    assert exe.waitForCompletion() == QStatus.SUCCESS
    ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"])
    np.testing.assert_allclose(
        program.state_array(program.image.by_name["past_key.0"], (FBS, 1, CTX, D)),
        ref.cache,
        rtol=1e-5,
        atol=1e-5,
    )
    program.unload()


def test_missing_plain_input_fails_the_run(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, _ = kv_program
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    program.load()
    program.activate()
    exe = qaicrt.ExecObj(ctx, program)
    rng = np.random.default_rng(7)
    inputs = _decode(rng, [0, 0])
    exe.setData([(0, inputs["x"]), (2, inputs["batch_index"])])
    qaicrt.Queue(ctx, 0).enqueue(exe)
    assert exe.waitForCompletion() == QStatus.INVAL
    assert "position_ids" in exe.lastError
    program.unload()


def test_run_before_activate_fails(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, _ = kv_program
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    inputs = _decode(np.random.default_rng(0), [0, 0])
    exe.setData([(0, inputs["x"]), (1, inputs["position_ids"]), (2, inputs["batch_index"])])
    qaicrt.Queue(ctx, 0).enqueue(exe)
    assert exe.waitForCompletion() == QStatus.INVAL
    assert "activate" in exe.lastError
    program.unload()


def test_slices_write_and_read_one_slot(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, w = kv_program
    ctx = qaicrt.Context()
    queue = qaicrt.Queue(ctx, 0)
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    program.load()
    program.activate()
    spec = {
        "BufferSpecs": [
            {
                "Name": "past_key.*",
                "ElemSize": 4,
                "DimSpecs": [{"start": "batch_index"}, {"start": 0}, {"start": "ctx_start"}, {"start": 0}],
            }
        ]
    }
    status, handle = program.createSlicingSpecHandle(json.dumps(spec))
    assert status == QStatus.SUCCESS
    status, _ = program.createSlicingSpecHandle(
        json.dumps({"BufferSpecs": [{"Name": "nope", "DimSpecs": []}]})
    )
    assert status == QStatus.INVAL
    rng = np.random.default_rng(8)
    slot_kv = rng.standard_normal((1, 1, CTX, D)).astype(np.float32)
    inputs = _decode(rng, [3, 3])
    y = np.zeros((FBS, D), np.float32)
    read_back = np.zeros((1, 1, CTX, D), np.float32)
    pairs = [
        (0, inputs["x"]),
        (1, inputs["position_ids"]),
        (2, inputs["batch_index"]),
        (3, slot_kv),
        (4, y),
        (5, read_back),
    ]
    exe = qaicrt.ExecObj(ctx, program)
    status, _ = exe.setDataWithSlices(pairs, handle, [("batch_index", 1), ("ctx_start", 0)])
    assert status == QStatus.SUCCESS
    queue.enqueue(exe)
    assert exe.waitForCompletion() == QStatus.SUCCESS
    ref = KvReference(w, FBS, CTX)
    ref.cache[1] = slot_kv[0]
    np.testing.assert_allclose(
        y, ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(read_back[0], ref.cache[1], rtol=1e-6)
    status, _ = exe.setDataWithSlices(pairs, handle, [("batch_index", 1)])
    assert status == QStatus.INVAL
    assert "ctx_start" in exe.lastError
    queue.enqueue(exe)
    assert exe.waitForCompletion() == QStatus.INVAL  # a failed setData also fails the run
    program.unload()


def test_mxint8_kv_is_stored_in_mx_format(tmp_path: Path) -> None:
    onnx_path, w = write_kv_model(tmp_path / "kv.onnx")
    precisions = {"past_key.0": "mxint8", "past_key.0_RetainedState": "mxint8"}
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs(FBS, CTX, PRE), custom_io=precisions)
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    assert s.bindings[s.binding_index_map["past_key.0"]].type == aicapi.FLOAT_16_TYPE
    s.skip_buffers(["past_key.0", "past_key.0_RetainedState"])
    rng = np.random.default_rng(9)
    ref = KvReference(w, FBS, CTX)
    s.set_buffers({"y": np.zeros((1, D), np.float32)})
    inputs = _prefill(rng, 0, 0)
    s.run(inputs)
    ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"])
    held = s.program.state["past_key.0"]
    assert isinstance(held, mx.MxTensor) and held.fmt == "mxint8"
    expected_cache = mx.quantize_mxint8(ref.cache, axis=-1)
    np.testing.assert_array_equal(mx.decode_mxint8(held), expected_cache)
    # The next run reads the decoded MX INT8 cache, not the exact one.
    s.set_buffers({"y": np.zeros((FBS, D), np.float32)})
    inputs = _decode(rng, [PRE, 0])
    out = s.run(inputs)
    ref.cache[:] = expected_cache
    np.testing.assert_allclose(
        out["y"], ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"]), rtol=1e-5, atol=1e-5
    )
    s.deactivate()


def test_fp16_kv_custom_io_holds_fp16_state(tmp_path: Path) -> None:
    onnx_path, w = write_kv_model(tmp_path / "kv.onnx")
    precisions = {"past_key.0": "float16", "past_key.0_RetainedState": "float16"}
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs(FBS, CTX, PRE), custom_io=precisions)
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    s.skip_buffers(["past_key.0"])
    s.set_buffers(
        {
            "y": np.zeros((1, D), np.float32),
            "past_key.0_RetainedState": np.zeros((FBS, 1, CTX, D), np.float16),
        }
    )
    rng = np.random.default_rng(10)
    inputs = _prefill(rng, 1, 2)
    out = s.run(inputs)
    ref = KvReference(w, FBS, CTX)
    ref.run(inputs["x"], inputs["position_ids"], inputs["batch_index"])
    assert out["past_key.0_RetainedState"].dtype == np.float16
    np.testing.assert_array_equal(out["past_key.0_RetainedState"], ref.cache.astype(np.float16))
    assert s.program.state["past_key.0"].dtype == np.float16
    s.deactivate()


def test_fp16_datapath_keeps_kv_at_fp16_values(tmp_path: Path) -> None:
    onnx_path, w = write_kv_model(tmp_path / "kv.onnx")
    precisions = {"past_key.0": "float16", "past_key.0_RetainedState": "float16"}
    flags = ("-retained-state", "-convert-to-fp16")
    qpc = compile_program(
        tmp_path / "p", onnx_path, kv_specs(FBS, CTX, PRE), flags=flags, custom_io=precisions
    )
    s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
    s.skip_buffers(["past_key.0"])
    rng = np.random.default_rng(12)
    for slot in range(FBS):
        s.set_buffers(
            {
                "y": np.zeros((1, D), np.float32),
                "past_key.0_RetainedState": np.zeros((FBS, 1, CTX, D), np.float16),
            }
        )
        inputs = _prefill(rng, slot, 0)
        out = s.run(inputs)
    held = s.program.state["past_key.0"]
    np.testing.assert_array_equal(held, held.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(out["past_key.0_RetainedState"], held.astype(np.float16))
    r16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    k = r16(r16(inputs["x"]) @ r16(w))  # the last prefill wrote slot FBS-1
    np.testing.assert_allclose(held[FBS - 1, 0, :PRE], k[0], rtol=1e-3, atol=1e-3)
    s.deactivate()


def test_qbuffer_over_an_array_receives_the_output(kv_program: tuple[Path, np.ndarray]) -> None:
    qpc, w = kv_program
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 3, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    inputs = _decode(np.random.default_rng(13), [2, 3])
    y = np.zeros((FBS, D), np.float32)
    buffers = [
        qaicrt.QBuffer(inputs["x"]),
        qaicrt.QBuffer(inputs["position_ids"].tobytes()),
        qaicrt.QBuffer(inputs["batch_index"]),
        qaicrt.QBuffer(b""),
        qaicrt.QBuffer(y),
        qaicrt.QBuffer(bytearray(0)),
    ]
    dims = qaicrt.BufferDimensionsVecRef(
        [(4, [FBS, 1, D]), (8, [FBS, 1]), (8, [FBS, 1]), (4, [0]), (4, [FBS, D]), (4, [0])]
    )
    assert dims[3] == (4, [0])  # dims read back as lists, as the real binding returns them
    assert exe.setData(buffers, dims) == QStatus.SUCCESS
    qaicrt.Queue(ctx, 3).enqueue(exe)
    assert exe.waitForCompletion() == QStatus.SUCCESS
    expected = KvReference(w, FBS, CTX).run(inputs["x"], inputs["position_ids"], inputs["batch_index"])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    status, outs = exe.getData()
    assert status == QStatus.SUCCESS and outs[5].size == 0
    np.testing.assert_array_equal(np.frombuffer(bytes(outs[4]), np.float32).reshape(FBS, D), y)
    bad = qaicrt.BufferDimensionsVecRef(
        [(4, [FBS, 1, D]), (8, [FBS, 1]), (8, [FBS, 1]), (4, [0]), (4, [FBS, D + 1]), (4, [0])]
    )
    assert exe.setData(buffers, bad) == QStatus.INVAL
    assert "holds 64 bytes but dims [2, 9] need 72" in exe.lastError
    program.unload()
