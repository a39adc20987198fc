"""The KV-cache custom ops as the simulated device runs them.

The real compiler has kernels for ``CtxScatter``, ``CtxGather`` and their continuous-batching (CB)
variants in domain ``com.qualcomm.cloud``; the function bodies an exporter writes (ours or
QEfficient's) only tell onnxruntime what they mean. Those bodies build a full ``[batch, heads, n, 3]``
index grid for every gather and scatter, and need extra copies of the whole cache to tolerate invalid
positions, which costs far more on the CPU than the attention itself. The simulated compiler swaps
them for bodies that do the same work directly:

- gather: pick the batch's cache rows (``Gather`` on axis 0), then read positions per (row, head)
  with ``GatherND(batch_dims=2)``; an invalid index (negative, ``INT32_MAX``, beyond the context)
  reads position 0, which the model masks;
- scatter: one ``ScatterND`` into the cache; an invalid position writes nothing. It is redirected to
  repeat a valid write of the same row with the same value (the row's first valid position), or, in a
  row with no valid position, to write back the value already at position 0, so no index tuple ever
  changes a value the model did not ask to change and duplicates always agree.

Semantics (``B`` batch entries, ``H`` heads, ``C`` context, ``D`` head size):

- ``CtxScatter[CB](data [F,H,C,D], [batch_index [B,1],] position_ids [B,S], updates [B,H,S,D])``:
  ``data[row(b), h, position_ids[b, s]] = updates[b, h, s]`` for every valid position;
- ``CtxGather[CB](data, [batch_index,] ctx_indices [B|1, 1, N] [, comp_ctx_len])`` -> ``[B,H,N,D]``:
  ``out[b, h, n] = data[row(b), h, ctx_indices[b, 0, n]]``; the compute-context length input (QEfficient's
  CCL) is already the length of ``ctx_indices`` and is not read.

``row(b)`` is ``batch_index[b, 0]`` for the CB variants and ``b`` otherwise. Functions of other names
or formal inputs (3-D variants, anything unknown) keep their bodies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qaic_core.custom_ops import KV_OPS_DOMAIN

log = logging.getLogger("qaic.sim.compiler")


_OPSET = 17


def _ints(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name)
    )


def _node(op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, **attrs)


def _prologue(data: str) -> list[onnx.NodeProto]:
    """Constants and ``ctx`` [1], the cache's context length."""
    return [
        _ints("k0", [0]),
        _ints("k1", [1]),
        _ints("k2", [2]),
        _ints("k3", [3]),
        _ints("k4", [4]),
        _ints("kneg1", [-1]),
        _node("Shape", [data], ["data_shape"]),
        _node("Slice", ["data_shape", "k2", "k3"], ["ctx"]),
    ]


def gather_function(name: str, inputs: list[str]) -> onnx.FunctionProto:
    """A fast body for ``CtxGather`` / ``CtxGatherCB`` with the given formal inputs.

    When every valid context index equals its position (``arange``, as both exporters build them),
    there are no more indices than the cache's context and the batch reads rows ``0..B-1`` in order,
    the result is a slice of the cache; otherwise rows and positions are gathered.
    """
    with_batch_index = name.endswith("CB")
    data, ctx_indices = inputs[0], inputs[2 if with_batch_index else 1]
    out = _out(name)
    nodes = _prologue(data)
    nodes += [
        _node("Cast", [ctx_indices], ["ci"], to=TensorProto.INT64),
        _node("Less", ["ci", "k0"], ["neg"]),
        _node("GreaterOrEqual", ["ci", "ctx"], ["over"]),
        _node("Or", ["neg", "over"], ["bad"]),
        _node("Shape", ["ci"], ["ci_shape"]),
        _node("Slice", ["ci_shape", "k2", "k3"], ["n"]),
        *_arange("n", "positions"),
        _node("Equal", ["ci", "positions"], ["at_place"]),
        _node("Or", ["at_place", "bad"], ["fine"]),
        _node("Cast", ["fine"], ["fine_i"], to=TensorProto.INT64),
        _node("ReduceMin", ["fine_i"], ["in_place_i"], keepdims=0),
        # A slice of the cache holds at most its context: more indices than that take the gather.
        _node("LessOrEqual", ["n", "ctx"], ["fits"]),
        _node("Cast", ["fits"], ["fits_i"], to=TensorProto.INT64),
        _node("ReduceMin", ["fits_i"], ["fits_one"], keepdims=0),
        _node("Mul", ["in_place_i", "fits_one"], ["in_order_i"]),
    ]
    if with_batch_index:
        nodes += [
            _node("Cast", ["batch_index"], ["bi64"], to=TensorProto.INT64),
            _node("Reshape", ["bi64", "kneg1"], ["rows"]),
            _node("Shape", ["rows"], ["b"]),
            *_arange("b", "first_rows"),
            _node("Equal", ["rows", "first_rows"], ["rows_at_place"]),
            _node("Cast", ["rows_at_place"], ["rows_i"], to=TensorProto.INT64),
            _node("ReduceMin", ["rows_i"], ["rows_in_order_i"], keepdims=0),
            _node("Mul", ["in_order_i", "rows_in_order_i"], ["fast_i"]),
            _node("Cast", ["fast_i"], ["fast"], to=TensorProto.BOOL),
        ]
        sliced = [
            _ints("axes02", [0, 2]),
            _node("Concat", ["b", "n"], ["ends"], axis=0),
            _node("Concat", ["k0", "k0"], ["starts"], axis=0),
            _node("Slice", [data, "starts", "ends", "axes02"], ["sliced"]),
        ]
        general = [_node("Gather", [data, "rows"], ["sel"], axis=0)]
    else:
        nodes += [_node("Cast", ["in_order_i"], ["fast"], to=TensorProto.BOOL)]
        sliced = [_node("Slice", [data, "k0", "n", "k2"], ["sliced"])]
        general = [_node("Identity", [data], ["sel"])]
    general += [
        _node("Where", ["bad", "k0", "ci"], ["safe"]),  # [B|1, 1, N]
        _node("Shape", ["sel"], ["sel_shape"]),
        _node("Slice", ["sel_shape", "k0", "k2"], ["bh"]),
        _node("Concat", ["bh", "n", "k1"], ["idx_shape"], axis=0),
        _node("Unsqueeze", ["safe", "k3"], ["safe4"]),
        _node("Expand", ["safe4", "idx_shape"], ["idx"]),  # [B, H, N, 1]
        _node("GatherND", ["sel", "idx"], ["gathered"], batch_dims=2),
    ]
    nodes.append(
        _node(
            "If",
            ["fast"],
            [out],
            then_branch=helper.make_graph(sliced, f"{name}_slice", [], [_untyped("sliced")]),
            else_branch=helper.make_graph(general, f"{name}_gather", [], [_untyped("gathered")]),
        )
    )
    return helper.make_function(
        KV_OPS_DOMAIN, name, inputs, [out], nodes, [helper.make_opsetid("", _OPSET)], []
    )


def _arange(length: str, out: str) -> list[onnx.NodeProto]:
    """``out`` = ``0 .. length-1`` for a one-element int64 ``length``."""
    return [
        _node("Squeeze", [length, "k0"], [f"{out}_len"]),
        _node("Squeeze", ["k0", "k0"], [f"{out}_start"]),
        _node("Squeeze", ["k1", "k0"], [f"{out}_step"]),
        _node("Range", [f"{out}_start", f"{out}_len", f"{out}_step"], [out]),
    ]


def _untyped(name: str) -> onnx.ValueInfoProto:
    return onnx.ValueInfoProto(name=name)


def scatter_function(name: str, inputs: list[str]) -> onnx.FunctionProto:
    """A fast body for ``CtxScatter`` / ``CtxScatterCB`` with the given formal inputs."""
    with_batch_index = name.endswith("CB")
    if with_batch_index:
        data, _, position_ids, updates = inputs
    else:
        data, position_ids, updates = inputs
    nodes = _prologue(data)
    nodes += [
        _node("Cast", [position_ids], ["pos"], to=TensorProto.INT64),  # [B, S]
        _node("Less", ["pos", "k0"], ["neg"]),
        _node("GreaterOrEqual", ["pos", "ctx"], ["over"]),
        _node("Or", ["neg", "over"], ["bad"]),
        _node("Not", ["bad"], ["good"]),
        _node("Cast", ["good"], ["good_i"], to=TensorProto.INT64),
        # The row's first valid position (ArgMax picks the first maximum) and whether it has one.
        _node("ArgMax", ["good_i"], ["first"], axis=1, keepdims=1),  # [B, 1]
        _node("ReduceMax", ["good_i"], ["any_i"], axes=[1], keepdims=1),  # [B, 1]
        _node("Cast", ["any_i"], ["any"], to=TensorProto.BOOL),
        _node("GatherElements", ["pos", "first"], ["first_pos"], axis=1),
        _node("Where", ["any", "first_pos", "k0"], ["spare_pos"]),  # [B, 1]
        _node("Where", ["bad", "spare_pos", "pos"], ["target"]),  # [B, S]
        # The value a redirected write stores: the first valid update, or what is already there.
        _node("Shape", [updates], ["upd_shape"]),
        _node("Slice", ["upd_shape", "k0", "k2"], ["bh"]),
        _node("Slice", ["upd_shape", "k3", "k4"], ["d"]),
        _node("Concat", ["bh", "k1", "d"], ["one_shape"], axis=0),  # [B, H, 1, D]
        _ints("ax23", [2, 3]),
        _node("Unsqueeze", ["first", "ax23"], ["first4"]),
        _node("Expand", ["first4", "one_shape"], ["first_idx"]),
        _node("GatherElements", [updates, "first_idx"], ["first_upd"], axis=2),
        # Position 0 of each row: sliced before the rows are picked, so the cache is not copied.
        _node("Slice", [data, "k0", "k1", "k2"], ["data0"]),
    ]
    if with_batch_index:
        nodes += [
            _node("Cast", ["batch_index"], ["bi64"], to=TensorProto.INT64),
            _node("Reshape", ["bi64", "kneg1"], ["rows"]),
            _node("Gather", ["data0", "rows"], ["current"], axis=0),
        ]
    else:
        nodes += [_node("Identity", ["data0"], ["current"])]
    nodes += [
        _ints("ax123", [1, 2, 3]),
        _node("Unsqueeze", ["any", "ax23"], ["any4"]),
        _node("Where", ["any4", "first_upd", "current"], ["spare_upd"]),
        _ints("ax13", [1, 3]),
        _node("Unsqueeze", ["bad", "ax13"], ["bad4"]),  # [B, 1, S, 1]
        _node("Where", ["bad4", "spare_upd", updates], ["values"]),
        # Index tuples (row, head, position) for ScatterND: [B, H, S, 3].
        _node("Shape", ["target"], ["target_shape"]),
        _node("Slice", ["target_shape", "k1", "k2"], ["s"]),
        _node("Concat", ["bh", "s", "k1"], ["idx_shape"], axis=0),
        _node("Slice", ["upd_shape", "k1", "k2"], ["h"]),
        _node("Squeeze", ["h", "k0"], ["h0"]),
        _ints("z", [0]),
        _node("Squeeze", ["z", "k0"], ["z0"]),
        _node("Squeeze", ["k1", "k0"], ["one0"]),
        _node("Range", ["z0", "h0", "one0"], ["heads"]),
        _ints("ax023", [0, 2, 3]),
        _node("Unsqueeze", ["heads", "ax023"], ["heads4"]),
        _node("Expand", ["heads4", "idx_shape"], ["idx_h"]),
        _node("Unsqueeze", ["target", "ax13"], ["target4"]),
        _node("Expand", ["target4", "idx_shape"], ["idx_c"]),
    ]
    if with_batch_index:
        nodes += [_ints("rows_shape4", [-1, 1, 1, 1]), _node("Reshape", ["rows", "rows_shape4"], ["rows4"])]
    else:
        nodes += [
            _node("Slice", ["upd_shape", "k0", "k1"], ["b"]),
            _node("Squeeze", ["b", "k0"], ["b0"]),
            _node("Range", ["z0", "b0", "one0"], ["batch"]),
            _node("Unsqueeze", ["batch", "ax123"], ["rows4"]),
        ]
    nodes += [
        _node("Expand", ["rows4", "idx_shape"], ["idx_b"]),
        _node("Concat", ["idx_b", "idx_h", "idx_c"], ["indices"], axis=3),
        _node("ScatterND", [data, "indices", "values"], [_out(name)]),
    ]
    return helper.make_function(
        KV_OPS_DOMAIN, name, inputs, [_out(name)], nodes, [helper.make_opsetid("", _OPSET)], []
    )


def _out(name: str) -> str:
    return f"{name.lower()}_out"


_BUILDERS = {
    ("CtxScatterCB", ("data", "batch_index", "position_ids", "updates")): scatter_function,
    ("CtxScatter", ("data", "position_ids", "updates")): scatter_function,
    ("CtxGatherCB", ("data", "batch_index", "ctx_indices")): gather_function,
    ("CtxGatherCB", ("data", "batch_index", "ctx_indices", "comp_ctx_len")): gather_function,
    ("CtxGather", ("data", "ctx_indices")): gather_function,
    ("CtxGather", ("data", "ctx_indices", "comp_ctx_len")): gather_function,
}
"""The known ops by name and formal inputs (as both exporters write them), and their fast bodies."""


def kernel_kind(function: onnx.FunctionProto) -> str | None:
    """``"scatter"`` or ``"gather"`` for a known KV op signature (which gets a device body), else None."""
    if function.domain != KV_OPS_DOMAIN or len(function.output) != 1:
        return None
    build = _BUILDERS.get((function.name, tuple(function.input)))
    return None if build is None else ("scatter" if build is scatter_function else "gather")


def kv_calls(model: onnx.ModelProto) -> dict[str, tuple[str | None, list[str]]]:
    """The model's KV-op functions by name: their kind (``kernel_kind``) and formal inputs."""
    return {f.name: (kernel_kind(f), list(f.input)) for f in model.functions if f.domain == KV_OPS_DOMAIN}


def in_place_state(model: onnx.ModelProto, retained: dict[str, str]) -> frozenset[str]:
    """Retained-state inputs the device kernels may update in place.

    An input qualifies when its only reader is a device-kernel scatter (a known ``CtxScatter[CB]``
    signature, which the simulated compiler always replaces) taking it as ``data`` and writing the
    matching ``..._RetainedState`` output (``Shape`` nodes, which read no values, may read it too):
    nothing reads the old cache's values after the write, so the run may bind that output to the
    input's memory.
    """
    scatters = {
        f.name
        for f in model.functions
        if f.domain == KV_OPS_DOMAIN and _BUILDERS.get((f.name, tuple(f.input))) is scatter_function
    }
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    found = set()
    for name, out in retained.items():
        users = [(node, i) for node, i in readers.get(name, []) if node.op_type != "Shape"]
        if len(users) != 1:
            continue
        node, i = users[0]
        if (
            i == 0
            and node.domain == KV_OPS_DOMAIN
            and node.op_type in scatters
            and list(node.output) == [out]
        ):
            found.add(name)
    return frozenset(found)


@contextmanager
def device_kernels(model: onnx.ModelProto) -> Iterator[set[str]]:
    """Within the block the known KV functions have the device's bodies; the originals come back after.

    The executable program is serialized inside the block; the timing model reads the graph outside
    it, so the modelled device time does not depend on how the simulator runs the ops.
    """
    originals = [onnx.FunctionProto() for _ in model.functions]
    for saved, function in zip(originals, model.functions, strict=True):
        saved.CopyFrom(function)
    try:
        yield native_kv_functions(model)
    finally:
        for function, saved in zip(model.functions, originals, strict=True):
            function.CopyFrom(saved)


def native_kv_functions(model: onnx.ModelProto) -> set[str]:
    """Replace the bodies of the known KV functions with the device's; returns the names replaced."""
    replaced: set[str] = set()
    for i, function in enumerate(model.functions):
        if function.domain != KV_OPS_DOMAIN or len(function.output) != 1:
            continue
        build = _BUILDERS.get((function.name, tuple(function.input)))
        if build is None:
            continue
        fast = build(function.name, list(function.input))
        # The caller's output name is positional; keep the formal one the body was written with.
        fast.output[0] = function.output[0]
        fast.node[-1].output[0] = function.output[0]
        for opset in function.opset_import:
            if opset.domain != "":
                fast.opset_import.append(opset)
        model.functions[i].CopyFrom(fast)
        replaced.add(function.name)
    if replaced:
        log.info("KV ops: device kernels for %s", ", ".join(sorted(replaced)))
    return replaced
