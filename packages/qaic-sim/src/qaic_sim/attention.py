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

The blocks are found by :mod:`qaic_sim.attention_pattern`: the grouped-query attention of qaic-aot's
decoder graph; a graph whose attention has another shape (a traced or QEfficient export) keeps its
nodes. The timing model reads the exported graph, not this one, so the modelled device time does
not change.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper

from qaic_sim.attention_pattern import Block, find_blocks
from qaic_sim.graph_build import Names, arange, constants, declared_dims, restored

log = logging.getLogger("qaic.sim.compiler")

ORT_DOMAIN = "com.microsoft"
_PREFIX = "__qaic_attn_"


@functools.cache
def fused_kernel_available() -> bool:
    """Whether this onnxruntime's ``GroupQueryAttention`` takes ``query_seqlens`` (rows that write
    nothing) and ``attention_bias`` (the graph's mask)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

        return any(
            s.name == "GroupQueryAttention"
            and s.domain == ORT_DOMAIN
            and {"query_seqlens", "attention_bias"} <= {i.name for i in s.inputs}
            for s in ort_state.get_all_operator_schema()
        )
    except Exception:  # an onnxruntime without the schema API: keep the graph's nodes
        return False


def fusable_blocks(model: onnx.ModelProto, in_place: Collection[str]) -> list[Block]:
    """The blocks (:func:`~qaic_sim.attention_pattern.find_blocks`) this onnxruntime can fuse."""
    if not fused_kernel_available():
        log.info(
            "attention: onnxruntime's GroupQueryAttention lacks query_seqlens; decode runs the exported nodes"
        )
        return []
    return find_blocks(model, in_place)


def _flags(n: Names, block: Block) -> tuple[str, str, str, str]:
    """Nodes for the fast-path flag and the kernel's per-row inputs: (fast, seqlens_k, query_seqlens, total)."""
    constants(n, 3)
    zero, one, two, three, flat = (n(k) for k in ("k0", "k1", "k2", "k3", "kneg1"))
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

    def all_of(cond: str, name: str) -> str:
        as_int = n.add("Cast", [cond], f"{name}_i", to=TensorProto.INT64)
        return n.add("ReduceMin", [as_int], name, keepdims=0)

    checks = [
        all_of(n.add("Equal", [tokens, one], "one_token"), "one_token_ok"),
        all_of(n.add("Equal", [rows, n.add("Slice", [cache_shape, zero, one], "cache_rows")], "full"), "full_ok"),
        all_of(n.add("Equal", [ci, arange(n, width, "positions")], "ci_in_order"), "ci_ok"),
        all_of(n.add("LessOrEqual", [width, ctx], "fits"), "fits_ok"),
        all_of(n.add("Or", [n.add("Not", [valid], "idle"), n.add("Less", [pos, width], "seen")], "within"), "within_ok"),
    ]  # fmt: skip
    if block.batch_index is not None:
        bi = n.add("Reshape", [n.add("Cast", [block.batch_index], "bi64", to=TensorProto.INT64), flat], "bi")
        checks.append(
            all_of(
                n.add("Equal", [bi, arange(n, n.add("Shape", [bi], "bi_len"), "slots")], "bi_in_order"),
                "bi_ok",
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


def _fused_branch(n: Names, block: Block, flags: tuple[str, str, str, str], rounded: bool) -> onnx.GraphProto:
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
    dims = {v.name: declared_dims(v) for v in graph.input}
    shared: dict[tuple[object, ...], tuple[str, str, str, str]] = {}
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
            dims.get(block.key_cache) or block.key_cache,
        )
        flags = shared.get(key)
        before: list[onnx.NodeProto] = []  # the group's flags, made just before its first fused layer
        if flags is None:
            n = Names(f"{_PREFIX}g{len(shared)}_")
            flags = shared[key] = _flags(n, block)
            before = n.nodes
        then_graph = _fused_branch(Names(f"{_PREFIX}{b}_"), block, flags, rounded)
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
    with restored(model):
        yield fuse(model, blocks, rounded)
