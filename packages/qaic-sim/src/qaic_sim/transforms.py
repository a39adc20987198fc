"""Graph rewrites that give the executed ONNX the device's numerics (fp16, MX FP6 weights)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qaic_sim import mx

log = logging.getLogger("qaic.sim.compiler")

_EXACT_OPS = {
    # Ops that only move or select values: their outputs are fp16 values when their inputs are.
    "Reshape", "Transpose", "Gather", "GatherElements", "GatherND", "Concat", "Slice", "Squeeze",
    "Unsqueeze", "Identity", "Expand", "ScatterND", "ScatterElements", "Where", "Flatten", "Split",
    "Tile", "Pad", "Cast", "CastLike", "Shape", "Size", "Constant", "ConstantOfShape", "Max", "Min",
    "Relu", "Abs", "Neg", "Clip", "TopK", "ArgMax", "ArgMin", "ReduceMax", "ReduceMin", "Range",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Not", "Trilu",
}  # fmt: skip


def _float_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]


def quantize_matmul_weights(model: onnx.ModelProto) -> set[str]:
    """Store MatMul/Gemm weight initializers as MX FP6 values (blocks along the reduction axis)."""
    inits = {t.name: t for t in _float_initializers(model)}
    done: set[str] = set()
    for node in model.graph.node:
        if node.op_type not in {"MatMul", "Gemm"} or len(node.input) < 2:
            continue
        name = node.input[1]
        if name not in inits or name in done:
            continue
        w = numpy_helper.to_array(inits[name])
        if w.ndim < 2:
            continue
        trans_b = any(a.name == "transB" and a.i for a in node.attribute) if node.op_type == "Gemm" else False
        axis = -1 if trans_b else -2
        inits[name].CopyFrom(
            numpy_helper.from_array(mx.quantize_mxfp6(w, axis=axis).astype(np.float32), name)
        )
        done.add(name)
    log.info("MX FP6: %d MatMul/Gemm weight tensors quantized", len(done))
    return done


def round_weights_fp16(model: onnx.ModelProto, skip: set[str]) -> None:
    """Round every float32 initializer and Constant to fp16 values (finite ones clipped to +-65504)."""
    for t in _float_initializers(model):
        if t.name in skip:
            continue
        t.CopyFrom(numpy_helper.from_array(mx.round_fp16(numpy_helper.to_array(t), saturate=True), t.name))
    for node in model.graph.node:
        if node.op_type != "Constant":
            continue
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                arr = mx.round_fp16(numpy_helper.to_array(attr.t), saturate=True)
                attr.t.CopyFrom(numpy_helper.from_array(arr, attr.t.name))


def _float_values(model: onnx.ModelProto) -> set[str]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:
        log.warning("shape inference failed (%s); fp16 rounding covers only typed values", exc)
        inferred = model
    g = inferred.graph
    values = list(g.value_info) + list(g.output) + list(g.input)
    return {v.name for v in values if v.type.tensor_type.elem_type == TensorProto.FLOAT}


def _rounding(src: str, dst: str) -> list[onnx.NodeProto]:
    """dst = fp16(src) as float32; overflow gives inf, as ``mx.round_fp16`` and the device do."""
    return [
        helper.make_node("Cast", [src], [f"{dst}__qaic_f16"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", [f"{dst}__qaic_f16"], [dst], to=TensorProto.FLOAT),
    ]


def round_activations_fp16(model: onnx.ModelProto) -> int:
    """Round float graph inputs, and the output of every float-producing compute node, to fp16.

    The graph keeps float32 tensors so every onnxruntime CPU kernel is available; the values
    it carries are those an fp16 datapath would hold.
    """
    floats = _float_values(model)
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    count = 0
    inits = {t.name for t in graph.initializer}
    renames: dict[str, str] = {}
    for value in graph.input:
        # Float inputs enter the fp16 datapath: round them first.
        if value.name in inits or value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        rounded = f"{value.name}__qaic_in16"
        nodes.extend(_rounding(value.name, rounded))
        renames[value.name] = rounded
        count += 1
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        nodes.append(node)
        if node.op_type in _EXACT_OPS or node.domain not in ("", "ai.onnx"):
            continue
        for i, out in enumerate(node.output):
            if not out or out not in floats:
                continue
            raw = f"{out}__qaic_f32"
            node.output[i] = raw
            nodes.extend(_rounding(raw, out))
            count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    log.info("fp16: rounding inserted after %d node outputs", count)
    return count
