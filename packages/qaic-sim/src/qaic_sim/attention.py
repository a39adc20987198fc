"""The device's attention kernel for decode steps: one fused op that reads the KV cache in place.

The exported graph computes each layer's attention as the IO contract spells it: ``CtxScatter`` the
new keys and values into the retained cache, ``CtxGather`` the cache back up to the compute-context
length, then a grouped-query ``MatMul`` / scale / mask / ``Softmax`` / ``MatMul``. On the CPU the
gather is a copy of the cache and the small ops cost more than the arithmetic. The device's compiler
fuses attention into one kernel; the simulated compiler does the same for a decode step: one
``GroupQueryAttention`` (onnxruntime's CPU kernel) appends the new key and value to the cache in
place and attends over each row's own positions, under the graph's own mask.

The fused kernel computes scores, probabilities and their sum at full precision and its output is
rounded to fp16 once, as a compiler-known kernel is (``qaic_core.custom_ops.FUSED_KERNELS``).

A run takes the fused kernel only when it means exactly what the graph says: one token per row
(decode), every cache row in order (``batch_index`` is ``0..B-1`` over the whole cache), the
compute-context indices ``0..C-1`` and each valid position below ``C``. A row whose position is
invalid (padding, ``-1``) writes nothing, as ``CtxScatter`` does on the device. Any other run
(prefill, a batched prefill, speculative verification, a sparse batch) takes the graph's own nodes,
kept whole in the other branch of an ``If``.

The pattern recognised is the grouped-query attention of qaic-aot's decoder graph (queries grouped
as ``[B, KV, G, S, D]``); a graph whose attention has another shape (a traced or QEfficient export)
keeps its nodes (``find_blocks`` returns nothing for it). The timing
model reads the exported graph, not this one, so the modelled device time does not change.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qaic_core.custom_ops import KV_OPS_DOMAIN
from qaic_sim.kv_ops import kernel_kind

log = logging.getLogger("qaic.sim.compiler")

ORT_DOMAIN = "com.microsoft"
_PREFIX = "__qaic_attn_"


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


def _kv_calls(model: onnx.ModelProto) -> dict[str, tuple[str | None, list[str]]]:
    return {f.name: (kernel_kind(f), list(f.input)) for f in model.functions if f.domain == KV_OPS_DOMAIN}


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
    if not fused_kernel_available():
        return []
    g = _Graph(model)
    kinds = _kv_calls(model)
    blocks = []
    for node in model.graph.node:
        if node.domain == KV_OPS_DOMAIN and kinds.get(node.op_type, (None, []))[0] == "gather":
            block = _match(g, kinds, node)
            if block is not None and {block.key_cache, block.value_cache} <= set(in_place):
                blocks.append(block)
    return blocks


_AVAILABLE: bool | None = None


def fused_kernel_available() -> bool:
    """Whether this onnxruntime's ``GroupQueryAttention`` takes ``query_seqlens`` (rows that write nothing)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

            _AVAILABLE = any(
                s.name == "GroupQueryAttention"
                and s.domain == ORT_DOMAIN
                and any(i.name == "query_seqlens" for i in s.inputs)
                and any(i.name == "attention_bias" for i in s.inputs)
                for s in ort_state.get_all_operator_schema()
            )
        except Exception:  # an onnxruntime without the schema API: keep the graph's nodes
            _AVAILABLE = False
    return _AVAILABLE


class _Nodes:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []

    def const(self, name: str, value: Any, dtype: Any) -> str:
        out = f"{self.prefix}{name}"
        self.nodes.append(
            helper.make_node(
                "Constant", [], [out], value=numpy_helper.from_array(np.array(value, dtype), out)
            )
        )
        return out

    def add(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        out = f"{self.prefix}{name}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def _flags(n: _Nodes, block: Block) -> tuple[str, str, str, str]:
    """Nodes for the fast-path flag and the kernel's per-row inputs: (fast, seqlens_k, query_seqlens, total)."""
    i64 = np.int64
    zero, one, two, three = (n.const(f"k{v}", [v], i64) for v in range(4))
    flat = n.const("flat", [-1], i64)
    pos_shape = n.add("Shape", [block.position_ids], "pos_shape")
    cache_shape = n.add("Shape", [block.key_cache], "cache_shape")
    rows = n.add("Slice", [pos_shape, zero, one], "rows")
    tokens = n.add("Slice", [pos_shape, one, two], "tokens")
    ctx = n.add("Slice", [cache_shape, two, three], "ctx")
    pos = n.add("Reshape", [n.add("Cast", [block.position_ids], "pos64", to=TensorProto.INT64), flat], "pos")
    valid = n.add(
        "And",
        [n.add("GreaterOrEqual", [pos, zero], "not_neg"), n.add("Less", [pos, ctx], "in_cache")],
        "valid",
    )
    ci = n.add("Reshape", [n.add("Cast", [block.ctx_indices], "ci64", to=TensorProto.INT64), flat], "ci")
    width = n.add("Shape", [ci], "width")

    def arange(length: str, name: str) -> str:
        end = n.add("Squeeze", [length, zero], f"{name}_end")
        start = n.add("Squeeze", [zero, zero], f"{name}_start")
        step = n.add("Squeeze", [one, zero], f"{name}_step")
        return n.add("Range", [start, end, step], name)

    def all_of(cond: str, name: str) -> str:
        as_int = n.add("Cast", [cond], f"{name}_i", to=TensorProto.INT64)
        return n.add("ReduceMin", [as_int], name, keepdims=0)

    checks = [
        all_of(n.add("Equal", [tokens, one], "one_token"), "one_token_ok"),
        all_of(n.add("Equal", [rows, n.add("Slice", [cache_shape, zero, one], "cache_rows")], "full"), "full_ok"),
        all_of(n.add("Equal", [ci, arange(width, "positions")], "ci_in_order"), "ci_ok"),
        all_of(n.add("LessOrEqual", [width, ctx], "fits"), "fits_ok"),
        all_of(n.add("Or", [n.add("Not", [valid], "idle"), n.add("Less", [pos, width], "seen")], "within"), "within_ok"),
    ]  # fmt: skip
    if block.batch_index is not None:
        bi = n.add("Reshape", [n.add("Cast", [block.batch_index], "bi64", to=TensorProto.INT64), flat], "bi")
        checks.append(
            all_of(
                n.add("Equal", [bi, arange(n.add("Shape", [bi], "bi_len"), "slots")], "bi_in_order"), "bi_ok"
            )
        )
    fast = checks[0]
    for k, check in enumerate(checks[1:]):
        fast = n.add("Mul", [fast, check], f"fast{k}")
    fast = n.add("Cast", [fast], "fast", to=TensorProto.BOOL)
    seqlens = n.add("Cast", [n.add("Where", [valid, pos, zero], "last")], "seqlens_k", to=TensorProto.INT32)
    query_lens = n.add("Cast", [valid], "query_seqlens", to=TensorProto.INT32)
    total = n.add("Cast", [width], "total", to=TensorProto.INT32)
    return fast, seqlens, query_lens, total


def _fused_branch(
    n: _Nodes, block: Block, flags: tuple[str, str, str, str], rounded: bool
) -> onnx.GraphProto:
    _, seqlens, query_lens, total = flags
    keep = n.const("merge_heads", [0, 0, -1], np.int64)
    q, k, v = (
        n.add("Reshape", [x, keep], name)
        for x, name in ((block.query, "q"), (block.key, "k"), (block.value, "v"))
    )
    mask = n.add("Squeeze", [block.mask, n.const("ax1", [1], np.int64)], "mask4")  # [B, 1, S, C]
    bias = n.add(
        "Where",
        [mask, n.const("masked", block.masked_score, np.float32), n.const("open", 0.0, np.float32)],
        "bias",
    )
    raw, key_out, value_out = f"{n.prefix}out_raw", f"{n.prefix}key_out", f"{n.prefix}value_out"
    n.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [q, k, v, block.key_cache, block.value_cache, seqlens, total, "", "", "", bias,
             "", "", "", "", "", query_lens],
            [raw, key_out, value_out],
            name=f"{n.prefix}kernel",
            domain=ORT_DOMAIN,
            num_heads=block.num_heads,
            kv_num_heads=block.kv_heads,
            scale=block.scale,
        )
    )  # fmt: skip
    out = raw
    if rounded:
        half = n.add("Cast", [raw], "out_f16", to=TensorProto.FLOAT16)
        out = n.add("Cast", [half], "out", to=TensorProto.FLOAT)
    return helper.make_graph(
        n.nodes, f"{n.prefix}fused", [], [onnx.ValueInfoProto(name=x) for x in (out, key_out, value_out)]
    )


def _uses(node: onnx.NodeProto) -> set[str]:
    """Every value a node reads: its inputs and its subgraphs' reads from the outer scope."""
    names = set(node.input)
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            made = {o for inner in sub.node for o in inner.output}
            for inner in sub.node:
                names |= _uses(inner) - made
    return names


def _rename(node: onnx.NodeProto, renames: dict[str, str]) -> None:
    for i, name in enumerate(node.input):
        node.input[i] = renames.get(name, name)
    for i, name in enumerate(node.output):
        node.output[i] = renames.get(name, name)
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            for inner in attr.g.node:
                _rename(inner, renames)
            for value in attr.g.output:
                value.name = renames.get(value.name, value.name)


def _block_nodes(nodes: list[onnx.NodeProto], block: Block, graph_outputs: set[str]) -> list[int] | None:
    """Indices of the nodes that compute the block from its inputs and feed nothing else."""
    sources = {block.query, block.key, block.value, block.key_cache, block.value_cache}
    results = {block.out, block.key_out, block.value_out}
    reached = set(sources)
    forward = set()
    for i, node in enumerate(nodes):
        if _uses(node) & reached:
            forward.add(i)
            reached.update(node.output)
    fused_reads = {block.query, block.key, block.value, block.mask, block.position_ids, block.ctx_indices}
    if block.batch_index is not None:
        fused_reads.add(block.batch_index)
    needed = set(results)
    inside = set()
    for i in reversed(range(len(nodes))):
        if i in forward and set(nodes[i].output) & needed:
            inside.add(i)
            needed |= _uses(nodes[i])
    while True:
        outside_reads = set(graph_outputs)
        for i, node in enumerate(nodes):
            if i not in inside:
                outside_reads |= _uses(node)
        outside_reads -= results  # the block's results become the If's outputs
        outside_reads |= fused_reads  # what the fused branch reads is made before the If
        leaking = {i for i in inside if set(nodes[i].output) & outside_reads}
        if not leaking:
            break
        inside -= leaking
    made = {o for i in inside for o in nodes[i].output}
    return sorted(inside) if results <= made else None


def fuse(model: onnx.ModelProto, blocks: list[Block], rounded: bool) -> int:
    """Give each block's decode runs the fused kernel (``If`` on the fast-path flag); returns how many."""
    graph = model.graph
    nodes = list(graph.node)
    outputs = {v.name for v in graph.output}
    dims = {v.name: str(v.type.tensor_type.shape) for v in graph.input if v.type.HasField("tensor_type")}
    shared: dict[tuple[str | None, str, str, str], tuple[str, str, str, str]] = {}
    fused = 0
    for b, block in enumerate(blocks):
        inside = _block_nodes(nodes, block, outputs)
        if inside is None:
            log.info("attention of %s: its nodes also feed others; the graph's nodes run", block.key_cache)
            continue
        key = (
            block.batch_index,
            block.position_ids,
            block.ctx_indices,
            dims.get(block.key_cache, block.key_cache),
        )
        flags = shared.get(key)
        before: list[onnx.NodeProto] = []  # the group's flags, made just before its first fused layer
        if flags is None:
            n = _Nodes(f"{_PREFIX}g{len(shared)}_")
            flags = shared[key] = _flags(n, block)
            before = n.nodes
        then_graph = _fused_branch(_Nodes(f"{_PREFIX}{b}_"), block, flags, rounded)
        general = [onnx.NodeProto() for _ in inside]
        for copy, i in zip(general, inside, strict=True):
            copy.CopyFrom(nodes[i])
        renames = {x: f"{x}__qaic_general" for x in (block.out, block.key_out, block.value_out)}
        for node in general:
            _rename(node, renames)
        else_graph = helper.make_graph(
            general, f"{_PREFIX}{b}_general", [], [onnx.ValueInfoProto(name=renames[x]) for x in renames]
        )
        choice = helper.make_node(
            "If",
            [flags[0]],
            [block.out, block.key_out, block.value_out],
            name=f"{_PREFIX}{b}_if",
            then_branch=then_graph,
            else_branch=else_graph,
        )
        last = inside[-1]
        kept: list[onnx.NodeProto] = []
        for i, node in enumerate(nodes):
            if i == last:
                kept += [*before, choice]
            elif i not in inside:
                kept.append(node)
        nodes = kept
        fused += 1
    if fused and not _in_order(nodes, model):
        log.warning("attention: the fused graph would not be in order; the graph's nodes run")
        return 0
    if fused:
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(o.domain == ORT_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
        log.info("attention: %d layers run decode steps on the fused kernel", fused)
    return fused


def _in_order(nodes: list[onnx.NodeProto], model: onnx.ModelProto) -> bool:
    """Whether every value a node reads (outer-scope reads of its subgraphs included) is known by then."""
    known = {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    made = {o for node in nodes for o in node.output}
    for node in nodes:
        early = sorted(name for name in _uses(node) if name in made and name not in known)
        if early:
            log.debug("attention: %s reads %s before it is made", node.name or node.op_type, early)
            return False
        known.update(node.output)
    return True


@contextmanager
def fused_attention(model: onnx.ModelProto, blocks: list[Block], rounded: bool) -> Iterator[int]:
    """Within the block the graph's decode attention runs on the fused kernel; the nodes come back after."""
    original = [onnx.NodeProto() for _ in model.graph.node]
    for saved, node in zip(original, model.graph.node, strict=True):
        saved.CopyFrom(node)
    opsets = [onnx.OperatorSetIdProto() for _ in model.opset_import]
    for saved_opset, opset in zip(opsets, model.opset_import, strict=True):
        saved_opset.CopyFrom(opset)
    try:
        yield fuse(model, blocks, rounded)
    finally:
        del model.graph.node[:]
        model.graph.node.extend(original)
        del model.opset_import[:]
        model.opset_import.extend(opsets)
