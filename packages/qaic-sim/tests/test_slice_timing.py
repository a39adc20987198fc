"""KV slices (``setDataWithSlices``) cost their bytes over the SoC's PCIe link in the modelled time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sim_programs import D, compile_program, kv_specs, write_kv_model

from qaic_sim import qaicrt
from qaic_sim.qaicrt import QStatus
from qaic_sim.timing import PCIE_GEN4_X8_BYTES_PER_S

FBS, CTX, PRE = 2, 16, 4
SPEC = {
    "BufferSpecs": [
        {
            "Name": "past_key.*",
            "ElemSize": 4,
            "DimSpecs": [{"start": "batch_index"}, {"start": 0}, {"start": "ctx_start"}, {"start": 0}],
        }
    ]
}


@pytest.fixture(scope="module")
def qpc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slices")
    onnx_path, _ = write_kv_model(root / "kv.onnx")
    return compile_program(root / "prog", onnx_path, kv_specs(FBS, CTX, PRE))


def _run(program: qaicrt.Program, ctx: qaicrt.Context, slices: list[tuple[int, np.ndarray]]) -> float:
    exe = qaicrt.ExecObj(ctx, program)
    pairs = [
        (0, np.zeros((FBS, 1, D), np.float32)),
        (1, np.full((FBS, 1), -1, np.int64)),
        (2, np.arange(FBS, dtype=np.int64)[:, None]),
        (4, np.zeros((FBS, D), np.float32)),
        *slices,
    ]
    if slices:
        status, handle = program.createSlicingSpecHandle(json.dumps(SPEC))
        assert status == QStatus.SUCCESS
        status, _ = exe.setDataWithSlices(pairs, handle, [("batch_index", 1), ("ctx_start", 0)])
    else:
        exe.setData(pairs)
    qaicrt.Queue(ctx, 0).enqueue(exe)
    assert exe.waitForCompletion() == QStatus.SUCCESS
    return float(exe.lastDeviceTimeS)


def test_slice_bytes_cross_the_host_link(qpc: Path) -> None:
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    program.load()
    program.activate()
    try:
        plain = _run(program, ctx, [])
        written = np.ones((1, 1, CTX, D), np.float32)
        read_back = np.zeros((1, 1, CTX, D), np.float32)
        sliced = _run(program, ctx, [(3, written), (5, read_back)])
    finally:
        program.unload()
    link = (written.nbytes + read_back.nbytes) / PCIE_GEN4_X8_BYTES_PER_S
    assert sliced - plain == pytest.approx(link, rel=1e-6)
