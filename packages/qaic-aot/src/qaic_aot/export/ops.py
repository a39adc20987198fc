"""CtxScatter / CtxGather: KV-cache ops as model-local ONNX functions in domain com.qualcomm.cloud.

The function bodies use standard ONNX ops only, so onnxruntime (which inlines local functions) and the
real compiler both accept the graph. Semantics:

- ``CtxScatter[CB](data, [batch_index,] position_ids, updates)`` writes ``updates[b, :, s]`` into row
  ``batch_index[b]`` (or ``b``) at ctx position ``position_ids[b, s]``; a negative position is padding and
  writes nothing (it is routed to a scratch slot that is sliced away).
- ``CtxGather[CB](data, [batch_index,] ctx_indices)`` reads the cache rows of the batch at ``ctx_indices``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from qaic_core.custom_ops import KV_OPS_DOMAIN

DOMAIN = KV_OPS_DOMAIN
DOMAIN_VERSION = 1
ONNX_OPSET = 17


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant",
        [],
        [name],
        value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values),
    )


def _scalar(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value])
    )


def _index_prologue(with_batch_index: bool, rows_from: str) -> list[onnx.NodeProto]:
    """Nodes computing ``rows`` [B, 1, 1, 1] (cache row per batch entry) and ``heads`` [1]."""
    nodes = [
        _const("c0", [0]),
        _const("c1", [1]),
        _const("c2", [2]),
        _scalar("s0", 0),
        _scalar("s1", 1),
        helper.make_node("Shape", ["data"], ["data_shape"]),
        helper.make_node("Gather", ["data_shape", "c1"], ["heads"], axis=0),
        helper.make_node("Squeeze", ["heads", "c0"], ["heads_s"]),
        helper.make_node("Range", ["s0", "heads_s", "s1"], ["head_range"]),
        _const("ax_023", [0, 2, 3]),
        _const("ax_23", [2, 3]),
        helper.make_node("Unsqueeze", ["head_range", "ax_023"], ["head_col"]),
        helper.make_node("Shape", [rows_from], ["rows_shape"]),
        helper.make_node("Gather", ["rows_shape", "c0"], ["batch"], axis=0),
    ]
    if with_batch_index:
        nodes.append(helper.make_node("Unsqueeze", ["batch_index", "ax_23"], ["rows"]))
    else:
        nodes += [
            helper.make_node("Squeeze", ["batch", "c0"], ["batch_s"]),
            helper.make_node("Range", ["s0", "batch_s", "s1"], ["batch_range"]),
            _const("ax_123", [1, 2, 3]),
            helper.make_node("Unsqueeze", ["batch_range", "ax_123"], ["rows"]),
        ]
    return nodes


def ctx_scatter_function(with_batch_index: bool) -> onnx.FunctionProto:
    """CtxScatterCB (with batch_index) or CtxScatter: write updates at positions, skipping negatives."""
    inputs = (
        ["data", "batch_index", "position_ids", "updates"]
        if with_batch_index
        else ["data", "position_ids", "updates"]
    )
    nodes = _index_prologue(with_batch_index, "position_ids")
    nodes += [
        helper.make_node("Gather", ["data_shape", "c2"], ["ctx"], axis=0),
        helper.make_node("Shape", ["position_ids"], ["pos_shape"]),
        helper.make_node("Gather", ["pos_shape", "c1"], ["seq"], axis=0),
        helper.make_node("Less", ["position_ids", "s0"], ["is_pad"]),
        # Padding goes to the scratch slot at index ctx, which is dropped after the scatter.
        helper.make_node("Where", ["is_pad", "ctx", "position_ids"], ["target"]),
        helper.make_node("Slice", ["data", "c0", "c1", "c2"], ["scratch"]),
        helper.make_node("Concat", ["data", "scratch"], ["data_ext"], axis=2),
        helper.make_node("Concat", ["batch", "heads", "seq", "c1"], ["idx_shape"], axis=0),
        helper.make_node("Expand", ["rows", "idx_shape"], ["idx_b"]),
        helper.make_node("Expand", ["head_col", "idx_shape"], ["idx_h"]),
        _const("ax_13", [1, 3]),
        helper.make_node("Unsqueeze", ["target", "ax_13"], ["target_col"]),
        helper.make_node("Expand", ["target_col", "idx_shape"], ["idx_c"]),
        helper.make_node("Concat", ["idx_b", "idx_h", "idx_c"], ["indices"], axis=3),
        helper.make_node("ScatterND", ["data_ext", "indices", "updates"], ["written"]),
        helper.make_node("Slice", ["written", "c0", "ctx", "c2"], ["out"]),
    ]
    name = "CtxScatterCB" if with_batch_index else "CtxScatter"
    return helper.make_function(
        DOMAIN, name, inputs, ["out"], nodes, [helper.make_opsetid("", ONNX_OPSET)], []
    )


def ctx_gather_function(with_batch_index: bool) -> onnx.FunctionProto:
    """CtxGatherCB (with batch_index) or CtxGather: read each batch entry's cache at ctx_indices [*, 1, n]."""
    inputs = ["data", "batch_index", "ctx_indices"] if with_batch_index else ["data", "ctx_indices"]
    rows_from = "batch_index" if with_batch_index else "data"
    nodes = _index_prologue(with_batch_index, rows_from)
    nodes += [
        helper.make_node("Shape", ["ctx_indices"], ["ci_shape"]),
        helper.make_node("Gather", ["ci_shape", "c2"], ["n"], axis=0),
        helper.make_node("Concat", ["batch", "heads", "n", "c1"], ["idx_shape"], axis=0),
        helper.make_node("Expand", ["rows", "idx_shape"], ["idx_b"]),
        helper.make_node("Expand", ["head_col", "idx_shape"], ["idx_h"]),
        _const("ax_3", [3]),
        helper.make_node("Unsqueeze", ["ctx_indices", "ax_3"], ["ci_col"]),
        helper.make_node("Expand", ["ci_col", "idx_shape"], ["idx_c"]),
        helper.make_node("Concat", ["idx_b", "idx_h", "idx_c"], ["indices"], axis=3),
        helper.make_node("GatherND", ["data", "indices"], ["out"]),
    ]
    name = "CtxGatherCB" if with_batch_index else "CtxGather"
    return helper.make_function(
        DOMAIN, name, inputs, ["out"], nodes, [helper.make_opsetid("", ONNX_OPSET)], []
    )


def kv_functions(with_batch_index: bool) -> list[onnx.FunctionProto]:
    """The two local functions a decoder graph needs."""
    return [ctx_scatter_function(with_batch_index), ctx_gather_function(with_batch_index)]
