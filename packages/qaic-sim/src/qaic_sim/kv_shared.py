"""The KV-cache ops of a whole program with their index work done once, as the device does it.

Every layer's ``CtxScatter[CB]`` and ``CtxGather[CB]`` reads the same ``batch_index``,
``position_ids`` and ``ctx_indices``; the per-op bodies of :mod:`qaic_sim.kv_ops` recompute the
validity masks, the redirected positions and the ``[B, H, S, 3]`` index grid in every layer, about
fifty small nodes per op, which is most of what onnxruntime runs per decode step of a small model.
:func:`share_kv_indices` rewrites the graph so that each group of ops with the same index inputs and
the same cache shape (declared dims of the retained-state input the cache comes from) computes them
once, before the group's first op; each op keeps only the work on its own tensors:

- scatter: the redirected values (``Where`` of the row's first valid update or the value already at
  position 0) and one ``ScatterND``;
- gather: one ``If`` on the shared "rows and positions in order" flag: a ``Slice`` of the cache, or
  ``Gather`` of the rows then ``GatherND`` with the shared indices.

The results are those of :mod:`qaic_sim.kv_ops` bodies (same semantics for invalid positions). An op
whose cache shape is not declared keeps its function body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import onnx
from onnx import TensorProto, helper

from qaic_core.custom_ops import KV_OPS_DOMAIN
from qaic_sim.graph_build import Names, arange, constants, declared_dims, restored
from qaic_sim.kv_ops import kv_calls

log = logging.getLogger("qaic.sim.compiler")


def _rows(n: Names, batch_index: str | None) -> str | None:
    if batch_index is None:
        return None
    bi = n.add("Cast", [batch_index], "bi64", to=TensorProto.INT64)
    return n.add("Reshape", [bi, n("kneg1")], "rows")


def _scatter_shared(n: Names, data: str, batch_index: str | None, position_ids: str, updates: str) -> None:
    """Masks, redirected positions and the ScatterND index grid of a scatter group."""
    constants(n, 4)
    data_shape = n.add("Shape", [data], "data_shape")
    ctx = n.add("Slice", [data_shape, n("k2"), n("k3")], "ctx")
    pos = n.add("Cast", [position_ids], "pos", to=TensorProto.INT64)  # [B, S]
    neg = n.add("Less", [pos, n("k0")], "neg")
    over = n.add("GreaterOrEqual", [pos, ctx], "over")
    bad = n.add("Or", [neg, over], "bad")
    good_i = n.add("Cast", [n.add("Not", [bad], "good")], "good_i", to=TensorProto.INT64)
    first = n.add("ArgMax", [good_i], "first", axis=1, keepdims=1)  # the row's first valid position
    any_i = n.add("ReduceMax", [good_i], "any_i", axes=[1], keepdims=1)
    any_ = n.add("Cast", [any_i], "any", to=TensorProto.BOOL)
    first_pos = n.add("GatherElements", [pos, first], "first_pos", axis=1)
    spare_pos = n.add("Where", [any_, first_pos, n("k0")], "spare_pos")
    target = n.add("Where", [bad, spare_pos, pos], "target")
    upd_shape = n.add("Shape", [updates], "upd_shape")
    bh = n.add("Slice", [upd_shape, n("k0"), n("k2")], "bh")
    d = n.add("Slice", [upd_shape, n("k3"), n("k4")], "d")
    one_shape = n.add("Concat", [bh, n("k1"), d], "one_shape", axis=0)  # [B, H, 1, D]
    ax23 = n.ints("ax23", [2, 3])
    ax13 = n.ints("ax13", [1, 3])
    n.add("Expand", [n.add("Unsqueeze", [first, ax23], "first4"), one_shape], "first_idx")
    n.add("Unsqueeze", [any_, ax23], "any4")
    n.add("Unsqueeze", [bad, ax13], "bad4")  # [B, 1, S, 1]
    s = n.add("Slice", [n.add("Shape", [target], "target_shape"), n("k1"), n("k2")], "s")
    idx_shape = n.add("Concat", [bh, s, n("k1")], "idx_shape", axis=0)
    h = n.add("Slice", [upd_shape, n("k1"), n("k2")], "h")
    heads = arange(n, h, "heads")
    idx_h = n.add(
        "Expand", [n.add("Unsqueeze", [heads, n.ints("ax023", [0, 2, 3])], "heads4"), idx_shape], "idx_h"
    )
    idx_c = n.add("Expand", [n.add("Unsqueeze", [target, ax13], "target4"), idx_shape], "idx_c")
    rows = _rows(n, batch_index)
    if rows is None:
        b = n.add("Slice", [upd_shape, n("k0"), n("k1")], "b")
        rows4 = n.add("Unsqueeze", [arange(n, b, "batch"), n.ints("ax123", [1, 2, 3])], "rows4")
    else:
        rows4 = n.add("Reshape", [rows, n.ints("rows_shape4", [-1, 1, 1, 1])], "rows4")
    idx_b = n.add("Expand", [rows4, idx_shape], "idx_b")
    n.add("Concat", [idx_b, idx_h, idx_c], "indices", axis=3)


def _scatter_op(g: Names, n: Names, data: str, cb: bool, updates: str, out: str) -> None:
    """One op of a scatter group: its redirected values, then the write."""
    first_upd = n.add("GatherElements", [updates, g("first_idx")], "first_upd", axis=2)
    data0 = n.add("Slice", [data, g("k0"), g("k1"), g("k2")], "data0")  # position 0, before rows are picked
    current = n.add("Gather", [data0, g("rows")], "current", axis=0) if cb else data0
    spare = n.add("Where", [g("any4"), first_upd, current], "spare_upd")
    values = n.add("Where", [g("bad4"), spare, updates], "values")
    n.nodes.append(helper.make_node("ScatterND", [data, g("indices"), values], [out], name=n("scatter")))


def _gather_shared(n: Names, data: str, batch_index: str | None, ctx_indices: str) -> None:
    """Masks, the "in order" flag and the GatherND indices of a gather group."""
    constants(n, 3)
    data_shape = n.add("Shape", [data], "data_shape")
    ctx = n.add("Slice", [data_shape, n("k2"), n("k3")], "ctx")
    ci = n.add("Cast", [ctx_indices], "ci", to=TensorProto.INT64)
    bad = n.add(
        "Or", [n.add("Less", [ci, n("k0")], "neg"), n.add("GreaterOrEqual", [ci, ctx], "over")], "bad"
    )
    nn = n.add("Slice", [n.add("Shape", [ci], "ci_shape"), n("k2"), n("k3")], "n")
    at_place = n.add("Equal", [ci, arange(n, nn, "positions")], "at_place")
    fine_i = n.add("Cast", [n.add("Or", [at_place, bad], "fine")], "fine_i", to=TensorProto.INT64)
    in_place = n.add("ReduceMin", [fine_i], "in_place_i", keepdims=0)
    # A slice of the cache holds at most its context: more indices than that take the gather.
    fits = n.add("Cast", [n.add("LessOrEqual", [nn, ctx], "fits")], "fits_i", to=TensorProto.INT64)
    in_order = n.add("Mul", [in_place, n.add("ReduceMin", [fits], "fits_one", keepdims=0)], "in_order_i")
    rows = _rows(n, batch_index)
    if rows is None:
        n.add("Cast", [in_order], "fast", to=TensorProto.BOOL)
        b = n.add("Slice", [data_shape, n("k0"), n("k1")], "b")
    else:
        b = n.add("Shape", [rows], "b")
        rows_i = n.add("Cast", [n.add("Equal", [rows, arange(n, b, "first_rows")], "rows_at_place")], "rows_i",
                       to=TensorProto.INT64)  # fmt: skip
        rows_in_order = n.add("ReduceMin", [rows_i], "rows_in_order_i", keepdims=0)
        fast_i = n.add("Mul", [in_order, rows_in_order], "fast_i")
        n.add("Cast", [fast_i], "fast", to=TensorProto.BOOL)
        n.add("Concat", [b, nn], "ends", axis=0)
        n.add("Concat", [n("k0"), n("k0")], "starts", axis=0)
        n.ints("axes02", [0, 2])
    safe = n.add("Where", [bad, n("k0"), ci], "safe")  # [B|1, 1, N]
    h = n.add("Slice", [data_shape, n("k1"), n("k2")], "h")
    idx_shape = n.add("Concat", [b, h, nn, n("k1")], "idx_shape", axis=0)
    n.add("Expand", [n.add("Unsqueeze", [safe, n("k3")], "safe4"), idx_shape], "idx")  # [B, H, N, 1]


def _gather_op(g: Names, n: Names, data: str, cb: bool, out: str) -> None:
    """One op of a gather group: a slice of the cache when rows and positions are in order."""
    sliced = Names(n.prefix)
    general = Names(n.prefix)
    if cb:
        sliced.add("Slice", [data, g("starts"), g("ends"), g("axes02")], "sliced")
        sel = general.add("Gather", [data, g("rows")], "sel", axis=0)
    else:
        sliced.add("Slice", [data, g("k0"), g("n"), g("k2")], "sliced")
        sel = data
    general.add("GatherND", [sel, g("idx")], "gathered", batch_dims=2)
    then_graph = helper.make_graph(sliced.nodes, n("slice"), [], [onnx.ValueInfoProto(name=n("sliced"))])
    else_graph = helper.make_graph(general.nodes, n("gather"), [], [onnx.ValueInfoProto(name=n("gathered"))])
    n.nodes.append(
        helper.make_node(
            "If", [g("fast")], [out], name=n("if"), then_branch=then_graph, else_branch=else_graph
        )
    )


def share_kv_indices(model: onnx.ModelProto) -> int:
    """Rewrite the graph's known KV ops so that each group computes its index work once; returns the ops rewritten."""
    kinds = kv_calls(model)
    graph = model.graph
    declared = {v.name: declared_dims(v) for v in graph.input}
    cache_of: dict[str, str] = {}  # a scatter's output -> the retained-state input it updates
    groups: dict[tuple[Any, ...], Names] = {}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in graph.node:
        kind, formals = kinds.get(node.op_type, (None, []))
        if node.domain != KV_OPS_DOMAIN or kind is None or len(node.output) != 1:
            nodes.append(node)
            continue
        actual: dict[str, str] = dict(zip(formals, node.input, strict=False))
        data = actual["data"]
        cache = cache_of.get(data, data)
        dims = declared.get(cache)
        if dims is None:
            nodes.append(node)
            continue
        cb = node.op_type.endswith("CB")
        batch_index = actual.get("batch_index") if cb else None
        index = actual["position_ids" if kind == "scatter" else "ctx_indices"]
        key = (node.op_type, batch_index, index, dims)
        group = groups.get(key)
        if group is None:
            group = groups[key] = Names(f"__qaic_kv{len(groups)}_")
            if kind == "scatter":
                _scatter_shared(group, data, batch_index, index, actual["updates"])
            else:
                _gather_shared(group, cache, batch_index, index)  # the cache input: same shape, read first
            nodes.extend(group.nodes)
        op = Names(f"{group.prefix}op{rewritten}_")
        if kind == "scatter":
            _scatter_op(group, op, data, cb, actual["updates"], node.output[0])
            cache_of[node.output[0]] = cache
        else:
            _gather_op(group, op, data, cb, node.output[0])
        nodes.extend(op.nodes)
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    if rewritten:
        log.info("KV ops: %d ops share the index work of %d groups", rewritten, len(groups))
    return rewritten


@contextmanager
def shared_indices(model: onnx.ModelProto) -> Iterator[int]:
    """Within the block the graph's KV ops share their index work; the exported nodes come back after."""
    with restored(model):
        yield share_kv_indices(model)
