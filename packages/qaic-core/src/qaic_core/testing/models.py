"""Tiny ONNX programs the conformance suite compiles on the backend under test."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from qaic_core import qpc as layout
from qaic_core.types import Specialization


def write_accumulator(path: Path, width: int = 4, slots: int = 2) -> Path:
    """A retained-state program: ``state[batch_index] += x``; outputs the new row and the state.

    Inputs: ``x`` [batch, width] float32, ``batch_index`` [batch, 1] int64, ``state``
    [slots, width] float32. Outputs: ``y`` [batch, width], ``state_RetainedState``.
    """
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", width])
    bidx = helper.make_tensor_value_info("batch_index", TensorProto.INT64, ["batch_size", 1])
    state = helper.make_tensor_value_info("state", TensorProto.FLOAT, [slots, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", width])
    out_state = helper.make_tensor_value_info("state_RetainedState", TensorProto.FLOAT, [slots, width])
    nodes = [
        helper.make_node("Gather", ["state", "idx_flat"], ["rows"], axis=0),
        helper.make_node("Reshape", ["batch_index", "minus_one"], ["idx_flat"]),
        helper.make_node("Add", ["rows", "x"], ["y"]),
        helper.make_node("ScatterND", ["state", "batch_index", "y"], ["state_RetainedState"]),
    ]
    minus_one = helper.make_tensor("minus_one", TensorProto.INT64, [1], np.array([-1], dtype=np.int64))
    graph = helper.make_graph(
        [nodes[1], nodes[0], nodes[2], nodes[3]], "accumulator", [x, bidx, state], [y, out_state], [minus_one]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def compile_accumulator(
    compiler: Callable[[Sequence[str]], None],
    root: Path,
    *,
    batch_sizes: Sequence[int] = (1, 2),
    width: int = 4,
    slots: int = 2,
    extra_flags: Sequence[str] = (),
) -> Path:
    """Write the accumulator program under ``root`` and compile it; returns ``root`` (QPC layout).

    One specialization per batch size, named ``b<N>`` (``one``/``two`` for 1 and 2), compiled with
    the flags QEfficient passes for a retained-state program on one core.
    """
    names = {1: "one", 2: "two"}
    onnx_path = write_accumulator(root / "accumulator.onnx", width=width, slots=slots)
    specs = [Specialization(names.get(b, f"b{b}"), {"batch_size": b}) for b in batch_sizes]
    layout.write_specializations(root / layout.SPECIALIZATIONS_FILE, specs)
    compiler(
        [
            "-aic-hw",
            "-aic-hw-version=ai100",
            f"-m={onnx_path}",
            "-retained-state",
            "-aic-num-cores=1",
            f"-network-specialization-config={root / layout.SPECIALIZATIONS_FILE}",
            *extra_flags,
            f"-aic-binary-dir={root / 'qpc'}",
        ]
    )
    return root
