"""Tiny ONNX programs the conformance suite compiles on the backend under test."""

from __future__ import annotations

from pathlib import Path

import numpy as np


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
