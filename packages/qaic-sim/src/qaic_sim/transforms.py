"""Graph rewrites that give the executed ONNX the device's numerics (fp16, MX FP6 weights)."""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qaic_core.custom_ops import FUSED_KERNELS, KV_OPS_DOMAIN
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


def _rounded(node: onnx.NodeProto) -> bool:
    """Whether an fp16 program rounds this node's float outputs. A compiler-known fused kernel
    (``qaic_core.custom_ops.FUSED_KERNELS``) computes at full precision inside and is rounded as one
    node; other custom ops (the KV ops) only move fp16 values."""
    if node.domain in ("", "ai.onnx"):
        return node.op_type not in _EXACT_OPS
    return (node.domain, node.op_type) in FUSED_KERNELS


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


def round_activations_fp16(model: onnx.ModelProto, held: Collection[str] = ()) -> int:
    """Round float graph inputs, and the output of every float-producing compute node, to fp16.

    A compiler-known fused kernel (``qaic_core.custom_ops.FUSED_KERNELS``) is one node: its output is rounded, the
    steps inside it are not.

    The graph keeps float32 tensors so every onnxruntime CPU kernel is available; the values
    it carries are those an fp16 datapath would hold. Inputs named in ``held`` (retained state) are
    left as they come: the runtime feeds them fp16 values (the program's own rounded outputs, or a
    host buffer it rounds first), so the cache is neither copied twice per run nor kept from being
    updated in place.
    """
    floats = _float_values(model)
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    count = 0
    inits = {t.name for t in graph.initializer}
    renames: dict[str, str] = {}
    for value in graph.input:
        # Float inputs enter the fp16 datapath: round them first.
        if value.name in inits or value.name in held or value.type.tensor_type.elem_type != TensorProto.FLOAT:
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
        if not _rounded(node):
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


def _int64_const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name)
    )


def _tolerant_gather(node: onnx.NodeProto, p: str) -> list[onnx.NodeProto]:
    """Nodes that clamp GatherND indices outside ``[0, dim)`` to 0 (the device reads, the model masks)."""
    data, indices = node.input[0], node.input[1]
    batch_dims = next((a.i for a in node.attribute if a.name == "batch_dims"), 0)
    nodes = [
        _int64_const(f"{p}b", [batch_dims]),
        _int64_const(f"{p}last", [-1]),
        _int64_const(f"{p}zero", [0]),
        helper.make_node("Shape", [data], [f"{p}data_shape"]),
        helper.make_node("Shape", [indices], [f"{p}idx_shape"]),
        helper.make_node("Gather", [f"{p}idx_shape", f"{p}last"], [f"{p}k"], axis=0),
        helper.make_node("Add", [f"{p}b", f"{p}k"], [f"{p}end"]),
        helper.make_node("Slice", [f"{p}data_shape", f"{p}b", f"{p}end"], [f"{p}limits"]),
        helper.make_node("Less", [indices, f"{p}zero"], [f"{p}neg"]),
        helper.make_node("GreaterOrEqual", [indices, f"{p}limits"], [f"{p}over"]),
        helper.make_node("Or", [f"{p}neg", f"{p}over"], [f"{p}bad"]),
        helper.make_node("Where", [f"{p}bad", f"{p}zero", indices], [f"{p}safe"]),
    ]
    node.input[1] = f"{p}safe"
    return nodes


def _tolerant_scatter(node: onnx.NodeProto, p: str) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """Nodes around a ScatterND so that an index tuple outside the data (INT32_MAX, -1) writes nothing.

    Such tuples are sent to a scratch row appended on axis 0, which is sliced away afterwards.
    """
    data, indices, _updates = node.input[0], node.input[1], node.input[2]
    before = [
        _int64_const(f"{p}zero", [0]),
        _int64_const(f"{p}one", [1]),
        _int64_const(f"{p}last", [-1]),
        helper.make_node("Shape", [data], [f"{p}data_shape"]),
        helper.make_node("Shape", [indices], [f"{p}idx_shape"]),
        helper.make_node("Gather", [f"{p}idx_shape", f"{p}last"], [f"{p}k"], axis=0),
        helper.make_node("Slice", [f"{p}data_shape", f"{p}zero", f"{p}k"], [f"{p}limits"]),
        helper.make_node("Less", [indices, f"{p}zero"], [f"{p}neg"]),
        helper.make_node("GreaterOrEqual", [indices, f"{p}limits"], [f"{p}over"]),
        helper.make_node("Or", [f"{p}neg", f"{p}over"], [f"{p}bad_each"]),
        helper.make_node("Cast", [f"{p}bad_each"], [f"{p}bad_int"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [f"{p}bad_int", f"{p}last"], [f"{p}bad_count"], keepdims=1),
        helper.make_node("Greater", [f"{p}bad_count", f"{p}zero"], [f"{p}bad"]),
        helper.make_node("Slice", [f"{p}data_shape", f"{p}zero", f"{p}one"], [f"{p}rows"]),
        helper.make_node("Sub", [f"{p}k", f"{p}one"], [f"{p}rest"]),
        helper.make_node(
            "ConstantOfShape",
            [f"{p}rest"],
            [f"{p}rest_zeros"],
            value=numpy_helper.from_array(np.zeros(1, np.int64)),
        ),
        helper.make_node("Concat", [f"{p}rows", f"{p}rest_zeros"], [f"{p}scratch_idx"], axis=0),
        helper.make_node("Where", [f"{p}bad", f"{p}scratch_idx", indices], [f"{p}safe"]),
        helper.make_node("Slice", [data, f"{p}zero", f"{p}one", f"{p}zero"], [f"{p}scratch"]),
        helper.make_node("Concat", [data, f"{p}scratch"], [f"{p}data_ext"], axis=0),
    ]
    out = node.output[0]
    node.input[0], node.input[1] = f"{p}data_ext", f"{p}safe"
    node.output[0] = f"{p}written"
    after = [helper.make_node("Slice", [f"{p}written", f"{p}zero", f"{p}rows", f"{p}zero"], [out])]
    return before, after


def tolerate_invalid_kv_indices(model: onnx.ModelProto) -> int:
    """Give the KV-cache functions the device's tolerance of invalid position indices.

    QEfficient marks padding with ``INT32_MAX`` positions in ``CtxScatter`` and context indices beyond
    a row's last position with ``INT32_MAX`` in ``CtxGather``; the device ignores such writes and
    reads something harmless (masked by the model), while onnxruntime's ScatterND/GatherND abort on
    them. Inside every function of domain ``com.qualcomm.cloud``, ScatterND skips index tuples outside
    the data and GatherND reads index 0 for them. Returns how many nodes were changed.

    The executable program replaces the known functions' bodies with faster ones
    (``kv_ops.device_kernels``); these tolerant bodies are what the timing model reads and what runs
    for any other function of the domain.
    """
    changed = 0
    for function in model.functions:
        if function.domain != KV_OPS_DOMAIN:
            continue
        nodes: list[onnx.NodeProto] = []
        for node in function.node:
            prefix = f"__qaic_tolerant{changed}_"
            if node.op_type == "GatherND" and node.domain in ("", "ai.onnx"):
                nodes += _tolerant_gather(node, prefix)
                nodes.append(node)
                changed += 1
            elif node.op_type == "ScatterND" and node.domain in ("", "ai.onnx"):
                before, after = _tolerant_scatter(node, prefix)
                nodes += [*before, node, *after]
                changed += 1
            else:
                nodes.append(node)
        del function.node[:]
        function.node.extend(nodes)
    if changed:
        log.info("KV ops: %d ScatterND/GatherND nodes tolerate out-of-range position indices", changed)
    return changed
