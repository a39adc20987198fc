"""ProgramCost from an exported ONNX graph: bind the symbols, inline local functions, infer shapes, count."""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import re
from collections import defaultdict
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference
from onnx import helper, numpy_helper

from qaic_sim.timing_cost import ACTIVATION_BYTES, ProgramCost, side_bytes_per_element

log = logging.getLogger("qaic.sim.timing")

KV_INPUT = re.compile(r"^past_(key|value)\.\d+$")
RETAINED_SUFFIX = "_RetainedState"
FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
)
PASS_THROUGH = frozenset(
    {"Transpose", "Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "DequantizeLinear"}
)
"""Ops that only re-view a weight: a MatMul behind them still reads the weight."""


CCL_SYMBOL = "comp_ctx_lengths"
"""QEfficient's compute-context length: the symbol sizing the ``comp_ctx_lengths`` input."""

SMALL_INITIALIZER = 64
"""Initializers up to this many elements (shapes, axes, scalars) keep their data for shape inference."""


def _bind(model: onnx.ModelProto, symbols: Mapping[str, int]) -> onnx.ModelProto:
    """A weightless copy with every symbolic input/output dimension replaced by its value.

    Large initializers become typed graph inputs: inference needs their shapes, not their bytes, and a
    multi-gigabyte model would otherwise be copied (and exceed protobuf's 2 GB limit in inference).
    """
    bound = onnx.ModelProto()
    bound.ir_version = model.ir_version
    bound.opset_import.extend(model.opset_import)
    bound.functions.extend(model.functions)
    g = bound.graph
    g.name = model.graph.name
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    declared = {v.name for v in model.graph.input}
    for init in model.graph.initializer:
        if math.prod(init.dims) <= SMALL_INITIALIZER and not init.external_data:
            g.initializer.append(init)
        elif init.name not in declared:
            g.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    missing: set[str] = set()
    for is_output, values in ((False, g.input), (True, g.output)):
        for value in values:
            for dim in value.type.tensor_type.shape.dim:
                if not dim.HasField("dim_param"):
                    continue
                if dim.dim_param in symbols:
                    dim.dim_value = int(symbols[dim.dim_param])
                elif is_output:
                    dim.Clear()  # a name the exporter made up (Castlogits_dim_0): inference sizes it
                else:
                    missing.add(dim.dim_param)
    if missing:
        given = ", ".join(sorted(symbols)) or "none"
        raise ValueError(
            f"symbols {sorted(missing)} have no value (given: {given}); add them to the specialization"
        )
    return bound


_CONSTANT_FORMS: dict[str, tuple[Any, bool]] = {
    "value_int": (np.int64, True),
    "value_ints": (np.int64, False),
    "value_float": (np.float32, True),
    "value_floats": (np.float32, False),
}
"""Constant attributes other than ``value`` (onnxscript writes ``value_ints`` for list literals)."""


def _tensor_constants(graph: onnx.GraphProto) -> None:
    """Rewrite ``Constant(value_int[s]/value_float[s])`` as ``Constant(value=tensor)``.

    onnxruntime's symbolic shape inference reads only ``value``; the other forms mean the same tensor.
    """
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        if attr.name not in _CONSTANT_FORMS:
            continue
        dtype, scalar = _CONSTANT_FORMS[attr.name]
        value = onnx.helper.get_attribute_value(attr)
        array = np.array(value if scalar else list(value), dtype=dtype)
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(array)))


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...] | None]:
    """Static shape of every value after inference (None where a dimension stayed unknown)."""
    out: dict[str, tuple[int, ...] | None] = {}
    g = model.graph
    for value in [*g.input, *g.value_info, *g.output]:
        t = value.type.tensor_type
        if not t.HasField("shape"):
            out[value.name] = None
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        out[value.name] = None if any(d < 0 for d in dims) else tuple(dims)
    for init in g.initializer:
        out[init.name] = tuple(init.dims)
    return out


@functools.cache
def _symbolic_inference() -> Any:
    """onnxruntime's SymbolicShapeInference, loaded from its file: the ``onnxruntime.tools`` package imports torch."""
    spec = importlib.util.find_spec("onnxruntime")
    path = Path(spec.origin).parent / "tools" / "symbolic_shape_infer.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        return SymbolicShapeInference
    file_spec = importlib.util.spec_from_file_location("qaic_sim._ort_symbolic_shape_infer", path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module.SymbolicShapeInference


def _shapes_by_run(
    model: onnx.ModelProto,
    symbols: Mapping[str, int],
    inferred: onnx.ModelProto,
    shapes: Mapping[str, tuple[int, ...] | None],
) -> dict[str, tuple[int, ...]]:
    """Shapes of the unsized contraction operands, from one onnxruntime run of ``model`` on zero inputs.

    Only values of the top-level graph can be read back (a function's inner values have no name there).
    """
    import onnxruntime as ort

    graph = model.graph
    produced = {name for node in graph.node for name in node.output}
    declared = {o.name for o in graph.output}
    types = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output]}
    wanted = [
        name
        for node in inferred.graph.node
        if node.op_type in ("MatMul", "Gemm", "Einsum")
        for name in [*node.input[:2], node.output[0]]
        if shapes.get(name) is None and name in produced and name in types
    ]
    wanted = list(dict.fromkeys(wanted))
    if not wanted:
        return {}
    inits = {i.name for i in graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for value in graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        dims = [
            int(d.dim_value) if d.HasField("dim_value") else int(symbols[d.dim_param])
            for d in tensor.shape.dim
        ]
        feeds[value.name] = np.zeros(dims, dtype=helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    extra = []
    for name in wanted:
        if name in declared:
            continue
        value = onnx.ValueInfoProto()
        value.CopyFrom(types[name])
        value.type.tensor_type.ClearField("shape")
        extra.append(value)
    count = len(graph.output)
    graph.output.extend(extra)
    try:
        data = model.SerializeToString()
    finally:
        del graph.output[count:]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    results = session.run(wanted, feeds)
    log.debug("sized %d contraction operands by one run on zero inputs", len(wanted))
    return {name: tuple(np.shape(r)) for name, r in zip(wanted, results, strict=True)}


def _contractions_sized(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...] | None]) -> bool:
    """Whether every MatMul/Gemm/Einsum operand and output has a static shape."""
    return all(
        shapes.get(name) is not None
        for node in model.graph.node
        if node.op_type in ("MatMul", "Gemm", "Einsum")
        for name in [*node.input[:2], node.output[0]]
    )


def _numel(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


def _need(shapes: dict[str, tuple[int, ...] | None], name: str, node: onnx.NodeProto) -> tuple[int, ...]:
    shape = shapes.get(name)
    if shape is None:
        raise ValueError(
            f"{node.op_type} node {node.name or node.output[0]!r}: input {name!r} has no static shape after "
            "shape inference; bind every symbol, define custom ops as model-local functions and keep "
            "shape-valued initializers loaded"
        )
    return shape


def _matmul_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...] | None]) -> tuple[int, int]:
    """(FLOPs, rows) of a MatMul or Gemm: 2 x outputs x contracted size."""
    a = _need(shapes, node.input[0], node)
    if node.op_type == "Gemm":
        trans_a = any(at.name == "transA" and at.i for at in node.attribute)
        b = _need(shapes, node.input[1], node)
        k = a[0] if trans_a else a[1]
        m = a[1] if trans_a else a[0]
        n = b[0] if any(at.name == "transB" and at.i for at in node.attribute) else b[1]
        return 2 * m * n * k, m
    k = a[-1]
    out = _need(shapes, node.output[0], node)
    return 2 * _numel(out) * k, max(_numel(a) // max(k, 1), 1)


def _einsum_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...] | None]) -> int:
    """2 x the product of every distinct index size (a contraction's multiply-adds); ``...`` counts its dims."""
    equation = next(at.s.decode() for at in node.attribute if at.name == "equation").replace(" ", "")
    operands = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    batch: tuple[int, ...] = ()  # the dims '...' stands for, broadcast over the operands
    for letters, name in zip(operands, node.input, strict=False):
        shape = _need(shapes, name, node)
        if "..." in letters:
            head, tail = letters.split("...")
            covered = shape[len(head) : len(shape) - len(tail)]
            shape = shape[: len(head)] + shape[len(shape) - len(tail) :]
            letters = head + tail
            width = max(len(batch), len(covered))
            batch = tuple(
                max(a, b)
                for a, b in zip(
                    (1,) * (width - len(batch)) + batch, (1,) * (width - len(covered)) + covered, strict=True
                )
            )
        sizes.update(zip(letters, shape, strict=False))
    return 2 * math.prod(sizes.values()) * math.prod(batch)


def onnx_cost(
    model: onnx.ModelProto,
    symbols: Mapping[str, int],
    *,
    weight_bytes_per_param: float,
    kv_bytes_per_elem: float,
) -> ProgramCost:
    """Count MatMul/Gemm/Einsum FLOPs, weight bytes from initializers, KV bytes from past_* bindings."""
    if weight_bytes_per_param <= 0 or kv_bytes_per_elem <= 0:
        raise ValueError(
            "weight_bytes_per_param and kv_bytes_per_elem must be positive (see mx.bytes_per_element)"
        )
    bound = _bind(model, symbols)
    top_consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in bound.graph.node:  # before inlining: CtxScatter and friends are still visible
        for name in node.input:
            top_consumers[name].append(node)
    inlined = onnx.inliner.inline_local_functions(bound) if bound.functions else bound
    _tensor_constants(inlined.graph)
    inferred = onnx.shape_inference.infer_shapes(inlined, strict_mode=False, data_prop=True)
    shapes = _shapes(inferred)
    if not _contractions_sized(inferred, shapes):
        # ONNX's own inference stops at index arithmetic (Range, Expand of computed shapes) inside the
        # KV functions; onnxruntime's symbolic inference evaluates it.
        log.debug("onnx shape inference left matmul shapes unknown; using onnxruntime symbolic inference")
        try:
            inferred = _symbolic_inference().infer_shapes(inlined, auto_merge=True, guess_output_rank=True)
            shapes = _shapes(inferred)
        except Exception as exc:  # its assertions and sympy errors have many types
            log.debug("onnxruntime symbolic inference failed: %r", exc)
    if not _contractions_sized(inferred, shapes):
        # Some graphs defeat both (QEfficient's attention without continuous batching): one run sizes them.
        try:
            shapes.update(_shapes_by_run(model, symbols, inferred, shapes))
        except Exception as exc:  # a run on zero inputs can fail (a zero in a Reshape's shape input)
            # The check below then names the contraction that stayed unsized, and the fix.
            log.debug("sizing contractions by a run on zero inputs failed: %r", exc)
    graph = inferred.graph
    inits = {i.name: (tuple(i.dims), i.data_type) for i in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    producers: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
        producers.update(dict.fromkeys(node.output, node))

    side = side_bytes_per_element(weight_bytes_per_param)
    flops = 0
    tokens = 1
    weight_read = 0.0
    storage = 0.0
    matmul_weights: set[str] = set()
    allreduce_bytes = 0.0
    allreduces = 0
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm"):
            f, rows = _matmul_flops(node, shapes)
            flops += f
            weight = _weight_behind(node.input[1], inits, producers)
            if weight is not None:
                matmul_weights.add(weight)
                tokens = max(tokens, rows)
                if _feeds_residual(node, consumers, producers, inits):
                    allreduces += 1
                    allreduce_bytes += _numel(shapes.get(node.output[0])) * ACTIVATION_BYTES
        elif node.op_type == "Einsum":
            flops += _einsum_flops(node, shapes)

    for name, (dims, data_type) in inits.items():
        if data_type not in FLOAT_TYPES:
            continue  # shapes, axes and indices: folded by the compiler, never streamed
        numel = _numel(dims)
        per = weight_bytes_per_param if name in matmul_weights else side
        storage += numel * per
        gathers = [n for n in consumers[name] if n.op_type == "Gather" and n.input[0] == name]
        if name not in matmul_weights and gathers and len(gathers) == len(consumers[name]):
            weight_read += sum(_numel(shapes.get(n.output[0])) or numel for n in gathers) * per  # rows only
        else:
            weight_read += numel * per

    kv_read = kv_write = 0.0
    kv_storage = 0.0
    activation = 0.0
    outputs = {o.name for o in graph.output}
    for value in [*graph.input, *graph.output]:
        if value.name in inits:
            continue
        shape = shapes.get(value.name)
        base = value.name.removesuffix(RETAINED_SUFFIX)
        if KV_INPUT.match(value.name):
            kv_read += _numel(shape) * kv_bytes_per_elem
            kv_storage += _numel(shape) * kv_bytes_per_elem
            scatters = [n for n in top_consumers[value.name] if "scatter" in n.op_type.lower()]
            if scatters:
                kv_write += sum(_numel(shapes.get(n.input[-1])) for n in scatters) * kv_bytes_per_elem
            elif value.name + RETAINED_SUFFIX in outputs:
                kv_write += _numel(shapes.get(value.name + RETAINED_SUFFIX)) * kv_bytes_per_elem
        elif not (value.name.endswith(RETAINED_SUFFIX) and KV_INPUT.match(base)):
            itemsize = np.dtype(
                onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            ).itemsize
            activation += _numel(shape) * itemsize
    ccl, ctx = symbols.get(CCL_SYMBOL), symbols.get("ctx_len")
    if ccl and ctx and 0 < ccl < ctx:
        kv_read *= ccl / ctx  # a compute-context length: attention reads only the first ccl positions
    log.debug("onnx cost: %.3g FLOPs, %.3g weight bytes, %.3g KV bytes read", flops, weight_read, kv_read)
    return ProgramCost(
        flops=float(flops),
        weight_bytes=weight_read,
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        activation_bytes=activation,
        tokens=tokens,
        allreduces=allreduces,
        allreduce_bytes=allreduce_bytes,
        weight_storage_bytes=storage,
        kv_storage_bytes=kv_storage,
    )


def _weight_behind(name: str, inits: Container[str], producers: Mapping[str, onnx.NodeProto]) -> str | None:
    """The initializer a matmul operand re-views (through Transpose/Cast/...), if any."""
    seen = 0
    while name not in inits and name in producers and seen < 4:
        node = producers[name]
        if node.op_type not in PASS_THROUGH:
            return None
        name, seen = node.input[0], seen + 1
    return name if name in inits else None


def _feeds_residual(
    node: onnx.NodeProto,
    consumers: Mapping[str, list[onnx.NodeProto]],
    producers: Mapping[str, onnx.NodeProto],
    inits: Container[str],
) -> bool:
    """A row-parallel matmul (output/down projection): its output, maybe plus a bias, meets the residual in an Add.

    The other addend must not be computed from this output (GELU's x + 0.044715 x^3 is no residual).
    """
    frontier = [node.output[0]]
    for _ in range(2):
        nxt = []
        for value in frontier:
            for user in consumers.get(value, []):
                if user.op_type != "Add":
                    continue
                other = [i for i in user.input if i != value]
                if other and all(i not in inits for i in other):
                    return not any(_derives_from(o, node.output[0], producers) for o in other)
                nxt.extend(user.output)
        frontier = nxt
    return False


def _derives_from(value: str, source: str, producers: Mapping[str, onnx.NodeProto], depth: int = 8) -> bool:
    """Whether ``value`` is computed from ``source`` within ``depth`` nodes."""
    frontier = {value}
    for _ in range(depth):
        if source in frontier:
            return True
        frontier = {i for v in frontier if v in producers for i in producers[v].input}
    return source in frontier
