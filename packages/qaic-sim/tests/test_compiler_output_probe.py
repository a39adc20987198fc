"""Outputs whose size ONNX's shape inference cannot follow are sized by one run of the program.

QEfficient's exporter picks each row's logits with index arithmetic on a computed batch size
(``Range(0, Shape(position_ids)[0])``) and names the output dims itself (``Castlogits_dim_0``);
ONNX's inference does not evaluate ``Range``, the real compiler folds it. The simulated compiler
must give every specialization its real output shape.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sim_programs import compile_program

from qaic_core.types import Specialization
from qaic_sim import aicapi, qaicrt, timing_onnx
from qaic_sim.qpcfile import read_manifest

HIDDEN = 8


def _write_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((4, HIDDEN)).astype(np.float32), "w")
    head = numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "head")

    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
        )

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["position_ids"], ["pos_shape"]),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1, np.int64))),
        helper.make_node("Gather", ["pos_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Gather", ["pos_shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "batch", "one"], ["rows"]),
        const("axis1", [1]),
        helper.make_node("Unsqueeze", ["rows", "axis1"], ["rows2"]),
        helper.make_node("Mul", ["rows2", "seq"], ["offsets"]),
        helper.make_node("ArgMax", ["position_ids"], ["last"], axis=1, keepdims=1),
        helper.make_node("Add", ["offsets", "last"], ["flat_index"]),
        const("flat_shape", [-1, HIDDEN]),
        helper.make_node("Reshape", ["h", "flat_shape"], ["h_flat"]),
        helper.make_node("Gather", ["h_flat", "flat_index"], ["last_hidden"], axis=0),
        helper.make_node("MatMul", ["last_hidden", "head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "range-gather",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "seq_len", 4]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
        ],
        [
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["Castlogits_dim_0", "Castlogits_dim_1", HIDDEN]
            )
        ],
        [weight, head],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


SPECS = [
    Specialization("Prefill", {"batch_size": 1, "seq_len": 4}),
    Specialization("Decode", {"batch_size": 3, "seq_len": 1}),
]


def test_outputs_sized_by_index_arithmetic_get_each_specializations_shape(tmp_path: Path) -> None:
    onnx_path = _write_model(tmp_path / "model.onnx")
    qpc = compile_program(tmp_path / "qpc-x", onnx_path, SPECS, flags=())
    manifest, _ = read_manifest(qpc)
    logits = next(b.index for b in manifest.bindings if b.name == "logits")
    assert [tuple(s.dims[logits]) for s in manifest.specs] == [(1, 1, HIDDEN), (3, 1, HIDDEN)]

    iodesc = aicapi.IoDesc()
    status, data = qaicrt.Qpc(str(qpc)).getIoDescriptor()
    assert status == qaicrt.QStatus.SUCCESS
    iodesc.ParseFromString(bytes(data))
    allowed = [[list(shape.dims) for shape in a.shapes] for a in iodesc.allowed_shapes]
    assert [a[-1] for a in allowed] == [[1, 1, HIDDEN], [3, 1, HIDDEN]]


class _FailingInference:
    @staticmethod
    def infer_shapes(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("symbolic inference gave up")


def test_the_timing_model_sizes_by_a_run_what_symbolic_inference_gives_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    onnx_path = _write_model(tmp_path / "model.onnx")
    symbolic = read_manifest(compile_program(tmp_path / "qpc-a", onnx_path, SPECS, flags=()))[0]
    monkeypatch.setattr(timing_onnx, "_symbolic_inference", lambda: _FailingInference)
    by_run = read_manifest(compile_program(tmp_path / "qpc-b", onnx_path, SPECS, flags=()))[0]
    # x @ w over batch x seq tokens, then the head over one row per sequence: 2 * rows * in * out FLOPs.
    expected = [2 * 4 * 4 * HIDDEN + 2 * 1 * HIDDEN * HIDDEN, 2 * 3 * 4 * HIDDEN + 2 * 3 * HIDDEN * HIDDEN]
    assert [s.cost["flops"] for s in by_run.specs] == expected
    assert [s.cost for s in by_run.specs] == [s.cost for s in symbolic.specs]
