"""The attention a decode step can run on the fused kernel, found in the compiled graph (:mod:`.attention`).

A block is one layer's grouped-query attention as qaic-aot's decoder graph writes it: the new keys
and values ``CtxScatter``-ed into a held cache and ``CtxGather``-ed back, queries ``[B, S, heads, D]``
grouped as ``[B, KV, G, S, D]``, ``MatMul`` with the transposed keys, a scalar scale,
``Where(mask, masked, scores)``, ``Softmax`` over the keys, ``MatMul`` with the values and the merge
back to ``[B, S, heads * D]``, each step's fp16 rounding (a Cast pair) allowed. Anything else is not
a block.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qaic_core.custom_ops import KV_OPS_DOMAIN
from qaic_sim.kv_ops import kv_calls


@dataclass(frozen=True)
class Block:
    """One layer's attention as the graph computes it, by value names."""

    key_cache: str
    value_cache: str
    key_out: str
    value_out: str
    query: str
    """``[B, S, heads, D]`` queries, before the transpose to heads-first."""
    key: str
    value: str
    mask: str
    """Boolean ``[B, 1, 1, S, C]``: True where a key is hidden."""
    masked_score: float
    scale: float
    out: str
    """``[B, S, heads * D]``: the attention output the output projection reads."""
    num_heads: int
    kv_heads: int
    batch_index: str | None
    position_ids: str
    ctx_indices: str


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.inits = {t.name: t for t in g.initializer}
        self.inputs = {v.name for v in g.input}
        self.outputs = {v.name for v in g.output}

    def const(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
        return None

    def only(self, name: str, op: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def after_rounding(self, name: str) -> str:
        """The fp16-rounded value of ``name`` when the program rounds it (a Cast pair), else ``name``."""
        down = self.only(name, "Cast")
        if down is None or _cast_to(down) != TensorProto.FLOAT16:
            return name
        up = self.only(down.output[0], "Cast")
        return up.output[0] if up is not None and _cast_to(up) == TensorProto.FLOAT else name

    def ints(self, name: str) -> list[int] | None:
        value = self.const(name)
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def _cast_to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), -1)


def _perm(node: onnx.NodeProto | None) -> list[int] | None:
    if node is None:
        return None
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _axis(node: onnx.NodeProto, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), default)


def _call(
    g: _Graph, kinds: dict[str, tuple[str | None, list[str]]], name: str, kind: str
) -> dict[str, str] | None:
    """The actual inputs (by formal name) of the KV op of ``kind`` that writes ``name``."""
    node = g.producer.get(name)
    if node is None or node.domain != KV_OPS_DOMAIN:
        return None
    found, formals = kinds.get(node.op_type, (None, []))
    if found != kind:
        return None
    return dict(zip(formals, node.input, strict=False))


def _match(g: _Graph, kinds: dict[str, tuple[str | None, list[str]]], gather: onnx.NodeProto) -> Block | None:
    """The attention block whose key gather is ``gather``, or None when the graph says something else."""
    k_read = _call(g, kinds, gather.output[0], "gather")
    if k_read is None:
        return None
    k_write = _call(g, kinds, k_read["data"], "scatter")
    if k_write is None or k_write["data"] not in g.inputs or k_read["data"] not in g.outputs:
        return None
    k5 = g.only(gather.output[0], "Unsqueeze")
    kt = None if k5 is None or g.ints(k5.input[1]) != [2] else g.only(k5.output[0], "Transpose")
    if kt is None or _perm(kt) != [0, 1, 2, 4, 3]:
        return None
    qk = g.only(kt.output[0], "MatMul")
    if qk is None or qk.input[1] != kt.output[0]:
        return None
    q5 = g.made_by(qk.input[0], "Reshape")
    qt = None if q5 is None else g.made_by(q5.input[0], "Transpose")
    q_shape = None if q5 is None else g.ints(q5.input[1])
    if qt is None or _perm(qt) != [0, 2, 1, 3] or q_shape is None or len(q_shape) != 5:
        return None
    kv_heads, groups, head_dim = q_shape[1], q_shape[2], q_shape[4]
    mul = g.only(g.after_rounding(qk.output[0]), "Mul")
    scale = None if mul is None else g.const(mul.input[1])
    if mul is None or scale is None or scale.size != 1:
        return None
    where = g.only(g.after_rounding(mul.output[0]), "Where")
    masked = None if where is None else g.const(where.input[1])
    if (
        where is None
        or where.input[2] != g.after_rounding(mul.output[0])
        or masked is None
        or masked.size != 1
    ):
        return None
    softmax = g.only(where.output[0], "Softmax")
    if softmax is None or _axis(softmax, -1) not in (-1, 4):
        return None
    pv = g.only(g.after_rounding(softmax.output[0]), "MatMul")
    v5 = None if pv is None else g.made_by(pv.input[1], "Unsqueeze")
    if pv is None or v5 is None or g.ints(v5.input[1]) != [2]:
        return None
    v_read = _call(g, kinds, v5.input[0], "gather")
    v_write = None if v_read is None else _call(g, kinds, v_read["data"], "scatter")
    if (
        v_read is None
        or v_write is None
        or v_write["data"] not in g.inputs
        or v_read["data"] not in g.outputs
    ):
        return None
    heads = kv_heads * groups
    r1 = g.only(g.after_rounding(pv.output[0]), "Reshape")
    t1 = (
        None
        if r1 is None or g.ints(r1.input[1]) != [0, heads, -1, head_dim]
        else g.only(r1.output[0], "Transpose")
    )
    r2 = None if t1 is None or _perm(t1) != [0, 2, 1, 3] else g.only(t1.output[0], "Reshape")
    if r2 is None or g.ints(r2.input[1]) != [0, 0, heads * head_dim]:
        return None
    index = ("batch_index", "position_ids")
    if any(k_write.get(k) != v_write.get(k) for k in index) or k_read.get("batch_index") != k_write.get(
        "batch_index"
    ):
        return None
    if k_read["ctx_indices"] != v_read["ctx_indices"] or v_read.get("batch_index") != k_write.get(
        "batch_index"
    ):
        return None
    kt_new = g.made_by(k_write["updates"], "Transpose")
    vt_new = g.made_by(v_write["updates"], "Transpose")
    if _perm(kt_new) != [0, 2, 1, 3] or _perm(vt_new) != [0, 2, 1, 3]:
        return None
    assert kt_new is not None and vt_new is not None
    return Block(
        key_cache=k_write["data"],
        value_cache=v_write["data"],
        key_out=k_read["data"],
        value_out=v_read["data"],
        query=qt.input[0],
        key=kt_new.input[0],
        value=vt_new.input[0],
        mask=where.input[0],
        masked_score=float(masked.reshape(-1)[0]),
        scale=float(scale.reshape(-1)[0]),
        out=r2.output[0],
        num_heads=heads,
        kv_heads=kv_heads,
        batch_index=k_write.get("batch_index"),
        position_ids=k_write["position_ids"],
        ctx_indices=k_read["ctx_indices"],
    )


def find_blocks(model: onnx.ModelProto, in_place: Collection[str]) -> list[Block]:
    """Every layer's attention the fused kernel can run (the graph's KV ops still function calls).

    Only caches the runtime updates in place (``in_place``, see ``kv_ops.in_place_state``) qualify:
    the kernel appends to the cache it reads, so its output must be that same buffer.
    """
    g = _Graph(model)
    kinds = kv_calls(model)
    blocks = []
    for node in model.graph.node:
        if node.domain == KV_OPS_DOMAIN and kinds.get(node.op_type, (None, []))[0] == "gather":
            block = _match(g, kinds, node)
            if block is not None and {block.key_cache, block.value_cache} <= set(in_place):
                blocks.append(block)
    return blocks
