"""The simulator's ``qaic-compile``: checks the real flags, models run costs, writes ``qpc/programqpc.bin``."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError, QaicError
from qaic_core.types import BUFFER_DTYPES, Binding, BufferType, Direction, Specialization
from qaic_sim import aicapi, attention, costing, kv_ops, kv_shared, mx, transforms
from qaic_sim.compiler_flags import CompileOptions, parse_argv
from qaic_sim.config import QAIC_SIM_TIMING
from qaic_sim.machine import get_machine
from qaic_sim.qpcfile import ProgramManifest, SpecShapes, write_program

log = logging.getLogger("qaic.sim.compiler")

RETAINED_SUFFIX = "_RetainedState"
ONNX_TYPES: dict[int, BufferType] = {
    TensorProto.FLOAT: BufferType.FLOAT,
    TensorProto.FLOAT16: BufferType.FLOAT_16,
    TensorProto.INT64: BufferType.INT64_I,
    TensorProto.INT32: BufferType.INT32_I,
    TensorProto.INT16: BufferType.INT16_Q,
    TensorProto.INT8: BufferType.INT8_Q,
    TensorProto.UINT8: BufferType.UINT8_Q,
    TensorProto.BOOL: BufferType.INT8,
}
PRECISIONS: dict[str, BufferType] = {
    "float16": BufferType.FLOAT_16,
    "fp16": BufferType.FLOAT_16,
    "float": BufferType.FLOAT,
    "float32": BufferType.FLOAT,
    "mxint8": BufferType.FLOAT_16,
}
"""custom_io precisions and the host buffer type each gives; mxint8 travels as fp16."""


COMPILER_REVISION = 2
"""Raised when the executable graph the compiler writes changes (2: the fused decode attention)."""


def compiler_revision() -> str:
    """What shapes the programs compiled now: the revision, and the fused attention when it is off."""
    fused = get_machine().config.fused_attention
    return f"{COMPILER_REVISION}" if fused else f"{COMPILER_REVISION}, exported attention"


def compile_argv(argv: Sequence[str]) -> Path:
    """Compile like ``qaic-compile ARGV``; returns the path of ``programqpc.bin``."""
    start = time.perf_counter()
    opts = parse_argv(argv)
    log.info("compiling %s -> %s", opts.model, opts.binary_dir)
    model = onnx.load(str(opts.model))
    inits = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in inits]
    outputs = list(model.graph.output)
    retained = _retained_pairs(opts, inputs, outputs)
    specs = _specializations(opts, inputs, outputs)
    precisions = _custom_io(opts, inputs, outputs, retained)
    num_devices = _num_devices(opts.mdp_config)

    transforms.tolerate_invalid_kv_indices(model)
    mx_weights: set[str] = set()
    if opts.mxfp6_matmul:
        mx_weights = transforms.quantize_matmul_weights(model)
    if opts.convert_to_fp16:
        transforms.round_weights_fp16(model, skip=mx_weights)
        transforms.round_activations_fp16(model, held=set(retained))

    in_place = kv_ops.in_place_state(model, retained)
    blocks = attention.fusable_blocks(model, in_place) if get_machine().config.fused_attention else []
    with (
        kv_ops.device_kernels(model),
        kv_shared.shared_indices(model),
        attention.fused_attention(model, blocks, rounded=opts.convert_to_fp16),
    ):
        model_bytes = model.SerializeToString()
    _check_executable(model_bytes, opts.model)
    probe = _OutputProbe(model_bytes)
    spec_dims = [_spec_dims(model, inputs, outputs, s, probe) for s in specs]
    bindings = _bindings(inputs, outputs, spec_dims, precisions, retained)
    manifest = ProgramManifest(
        bindings=tuple(bindings),
        specs=tuple(
            SpecShapes(s.name, dict(s.symbols), tuple(d)) for s, d in zip(specs, spec_dims, strict=True)
        ),
        retained=retained,
        precisions=precisions,
        num_cores=opts.num_cores,
        num_devices=num_devices,
        convert_to_fp16=opts.convert_to_fp16,
        mxfp6_matmul=opts.mxfp6_matmul,
        weights_bytes=_weights_bytes(model, mx_weights, opts.convert_to_fp16),
        retained_bytes=_retained_bytes(bindings, retained, precisions),
        activation_bytes=_activation_bytes(bindings, spec_dims, retained),
        argv=opts.argv,
        source_model=str(opts.model.resolve()),
        in_place=tuple(sorted(in_place)),
    )
    manifest = _with_costs(manifest, model, opts.model)
    extra = {layout.SPECIALIZATIONS_FILE: _specs_json(specs).encode()}
    if opts.custom_io is not None:
        extra[layout.CUSTOM_IO_FILE] = opts.custom_io.read_bytes()
    if opts.mdp_config is not None:
        extra["mdp.json"] = opts.mdp_config.read_bytes()
    path = write_program(opts.binary_dir, manifest, model_bytes, iodesc_bytes(manifest), extra)
    log.info(
        "compiled %s: %d bindings, %d specializations, %.1f MB device memory, in %.2fs",
        path,
        len(bindings),
        len(specs),
        manifest.dram_bytes / 2**20,
        time.perf_counter() - start,
    )
    return path


def _with_costs(manifest: ProgramManifest, model: onnx.ModelProto, source: Path) -> ProgramManifest:
    """Model every specialization's run cost once, here: a program that cannot be timed fails to compile."""
    if not get_machine().config.timing:
        log.info("%s=0: %s is compiled without modelled run costs", QAIC_SIM_TIMING, source)
        return manifest
    costs = costing.program_costs(model, manifest, str(source))
    specs = tuple(
        dataclasses.replace(s, cost=c.to_json()) for s, c in zip(manifest.specs, costs, strict=True)
    )
    return dataclasses.replace(manifest, specs=specs)


def _check_executable(model_bytes: bytes, source: Path) -> None:
    """Fail at compile time, as the real compiler does, on a graph the executor cannot run."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    try:
        ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises several unrelated types
        raise QaicError(f"{source}: the graph cannot be compiled for the simulator: {exc}") from exc


def _retained_pairs(
    opts: CompileOptions, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]
) -> dict[str, str]:
    names = {v.name for v in inputs}
    pairs = {o.name[: -len(RETAINED_SUFFIX)]: o.name for o in outputs if o.name.endswith(RETAINED_SUFFIX)}
    if not opts.retained_state:
        return {}
    if not pairs:
        raise QaicConfigError(
            f"-retained-state was given but {opts.model} has no output named '<input>{RETAINED_SUFFIX}'; "
            "export the model with retained-state outputs or drop -retained-state"
        )
    orphans = sorted(out for base, out in pairs.items() if base not in names)
    if orphans:
        raise QaicConfigError(
            f"retained-state outputs without a matching input: {orphans}; output 'X{RETAINED_SUFFIX}' needs input 'X'"
        )
    return pairs


def _dim_params(values: Sequence[onnx.ValueInfoProto]) -> list[str]:
    found: list[str] = []
    for v in values:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param and not d.HasField("dim_value") and d.dim_param not in found:
                found.append(d.dim_param)
    return found


def _specializations(
    opts: CompileOptions, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]
) -> list[Specialization]:
    needed = _dim_params(inputs)
    if opts.specializations is not None:
        specs = layout.read_specializations(opts.specializations)
        where = f"-network-specialization-config={opts.specializations}"
    elif opts.define_symbols:
        specs = [Specialization("default", dict(opts.define_symbols))]
        where = "-onnx-define-symbol"
    elif needed:
        raise QaicConfigError(
            f"{opts.model} has symbolic dimensions {needed} but no values were given: pass "
            "-network-specialization-config=specializations.json (or -onnx-define-symbol=NAME,VALUE)"
        )
    else:
        return [Specialization("default", {})]
    for s in specs:
        missing = [p for p in needed if p not in s.symbols]
        if missing:
            raise QaicConfigError(
                f"{where}: specialization {s.name!r} does not set {missing}, which the model's inputs "
                f"use as dimensions; add them to its symbols"
            )
        bad = {k: v for k, v in s.symbols.items() if v < 0}
        if bad:
            raise QaicConfigError(f"{where}: specialization {s.name!r} has negative symbols {bad}")
        seq, ctx = s.symbols.get("seq_len"), s.symbols.get("ctx_len")
        if seq is not None and ctx is not None and seq > ctx:
            raise QaicConfigError(
                f"{where}: specialization {s.name!r} has seq_len={seq} > ctx_len={ctx}; "
                "a chunk cannot be longer than the context: lower seq_len or raise ctx_len"
            )
    return specs


def _custom_io(
    opts: CompileOptions,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    retained: dict[str, str],
) -> dict[str, str]:
    if opts.custom_io is None:
        return {}
    where = f"-custom-IO-list-file={opts.custom_io}"
    raw = layout.read_custom_io(opts.custom_io)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inputs, *outputs]}
    out: dict[str, str] = {}
    for name, prec in raw.items():
        if name not in types:
            raise QaicConfigError(f"{where}: {name!r} is not an input or output of {opts.model}")
        key = prec.strip().lower()
        if key not in PRECISIONS:
            raise QaicConfigError(
                f"{where}: precision {prec!r} of {name!r} is not one of {sorted(PRECISIONS)}"
            )
        if types[name] not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            raise QaicConfigError(f"{where}: {name!r} is not a float tensor; only float IO takes a precision")
        if key == "mxint8" and name not in retained and name not in retained.values():
            raise QaicConfigError(f"{where}: mxint8 applies to retained state only, not to {name!r}")
        out[name] = "float16" if key == "fp16" else ("float" if key == "float32" else key)
    for base, ret in retained.items():
        if out.get(base) != out.get(ret):
            raise QaicConfigError(
                f"{where}: {base!r} is {out.get(base, 'unset')} but {ret!r} is {out.get(ret, 'unset')}; "
                "a retained-state pair must use one precision"
            )
    return out


def _num_devices(path: Path | None) -> int:
    if path is None:
        return 1
    where = f"-mdp-load-partition-config={path}"
    try:
        data = json.loads(path.read_text())
        parts = data["partitions"]
        devices = parts[0]["devices"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise QaicConfigError(
            f"{where}: expected {{connections, partitions: [{{devices: [...]}}]}} ({exc})"
        ) from exc
    if len(parts) != 1:
        raise QaicConfigError(
            f"{where}: the simulator supports one partition, found {len(parts)}; list every device "
            "of the group in one partition (as qaic_core.qpc.mdp_partition writes it)"
        )
    if not devices:
        raise QaicConfigError(
            f"{where}: the partition lists no devices; give one {{deviceId, numCores}} entry per device"
        )
    return len(devices)


def _resolve(v: onnx.ValueInfoProto, symbols: dict[str, int]) -> list[int] | None:
    dims: list[int] = []
    for d in v.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.dim_param in symbols:
            dims.append(int(symbols[d.dim_param]))
        else:
            return None
    return dims


class _OutputProbe:
    """Output shapes of one run on zero-filled inputs, for graphs whose shapes inference cannot size.

    QEfficient gathers the logits rows with ``Range`` over a batch size computed from a shape, which
    ONNX's inference does not evaluate (the real compiler folds it). A run of the executable graph gives
    the shapes exactly; the onnxruntime session is made once, on first use.
    """

    def __init__(self, model_bytes: bytes) -> None:
        self._model_bytes = model_bytes
        self._session: object | None = None

    def __call__(
        self, inputs: list[onnx.ValueInfoProto], dims: list[tuple[int, ...]], spec: Specialization
    ) -> dict[str, tuple[int, ...]]:
        import onnxruntime as ort

        if self._session is None:
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.intra_op_num_threads = 1
            self._session = ort.InferenceSession(self._model_bytes, opts, providers=["CPUExecutionProvider"])
        session = self._session
        assert isinstance(session, ort.InferenceSession)
        feeds = {
            v.name: np.zeros(d, dtype=onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))
            for v, d in zip(inputs, dims, strict=True)
        }
        start = time.perf_counter()
        try:
            results = session.run(None, feeds)
        except Exception as exc:  # onnxruntime raises several unrelated types
            log.warning("sizing the outputs of %r by a run failed: %s", spec.name, exc)
            return {}
        log.info(
            "sized the outputs of %r by one run on zeros (%.2fs): shape inference left them unknown",
            spec.name,
            time.perf_counter() - start,
        )
        return {o.name: tuple(np.shape(r)) for o, r in zip(session.get_outputs(), results, strict=True)}


def _spec_dims(
    model: onnx.ModelProto,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    spec: Specialization,
    probe: _OutputProbe | None = None,
) -> list[tuple[int, ...]]:
    dims: list[tuple[int, ...]] = []
    for v in inputs:
        resolved = _resolve(v, spec.symbols)
        assert resolved is not None  # checked by _specializations
        dims.append(tuple(resolved))
    pending = [o for o in outputs if _resolve(o, spec.symbols) is None]
    inferred: dict[str, onnx.ValueInfoProto] = {}
    if pending:
        inferred = _infer_outputs(model, inputs, dims, spec)
    unsized = [
        o for o in pending if o.name not in inferred or _resolve(inferred[o.name], spec.symbols) is None
    ]
    ran = probe(inputs, dims, spec) if unsized and probe is not None else {}
    for o in outputs:
        resolved = _resolve(o, spec.symbols)
        if resolved is None and o.name in inferred:
            resolved = _resolve(inferred[o.name], spec.symbols)
        if resolved is None and o.name in ran:
            resolved = list(ran[o.name])
        if resolved is None:
            raise QaicConfigError(
                f"cannot determine the shape of output {o.name!r} for specialization {spec.name!r}: "
                "give the output static or symbolic dims (dim_param) in the ONNX"
            )
        dims.append(tuple(resolved))
    return dims


def _infer_outputs(
    model: onnx.ModelProto,
    inputs: list[onnx.ValueInfoProto],
    dims: list[tuple[int, ...]],
    spec: Specialization,
) -> dict[str, onnx.ValueInfoProto]:
    static = onnx.ModelProto()
    static.CopyFrom(model)
    by_name = {v.name: d for v, d in zip(inputs, dims, strict=False)}
    for v in static.graph.input:
        if v.name in by_name:
            shape = v.type.tensor_type.shape
            for d, n in zip(shape.dim, by_name[v.name], strict=True):
                d.Clear()
                d.dim_value = n
    for o in static.graph.output:
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(static, data_prop=True)
    except Exception as exc:
        log.warning("shape inference for %r failed: %s", spec.name, exc)
        return {}
    return {o.name: o for o in inferred.graph.output if o.type.tensor_type.HasField("shape")}


def _bindings(
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    spec_dims: list[list[tuple[int, ...]]],
    precisions: dict[str, str],
    retained: dict[str, str],
) -> list[Binding]:
    retained_names = set(retained) | set(retained.values())
    bindings: list[Binding] = []
    for i, v in enumerate([*inputs, *outputs]):
        if v.name in precisions:
            btype = PRECISIONS[precisions[v.name]]
        else:
            elem = v.type.tensor_type.elem_type
            if elem not in ONNX_TYPES:
                raise QaicConfigError(
                    f"{v.name!r} has ONNX type {TensorProto.DataType.Name(elem)}, which the device IO "
                    f"does not take; use one of {[TensorProto.DataType.Name(t) for t in ONNX_TYPES]}"
                )
            btype = ONNX_TYPES[elem]
        ranks = {len(d[i]) for d in spec_dims}
        if len(ranks) != 1:
            raise QaicConfigError(f"{v.name!r} has a different rank in different specializations")
        dims = tuple(max(d[i][k] for d in spec_dims) for k in range(ranks.pop()))
        size = int(np.prod(dims, dtype=np.int64)) * BUFFER_DTYPES[btype].itemsize
        bindings.append(
            Binding(
                name=v.name,
                index=i,
                type=btype,
                dir=Direction.IN if i < len(inputs) else Direction.OUT,
                dims=dims,
                size=size,
                is_partial_buf_allowed=v.name in retained_names,
            )
        )
    return bindings


def _weights_bytes(model: onnx.ModelProto, mx_weights: set[str], fp16: bool) -> int:
    total = 0.0
    for t in model.graph.initializer:
        n = math.prod(t.dims)
        if t.name in mx_weights:
            total += n * mx.bytes_per_element("mxfp6")
        elif t.data_type == TensorProto.FLOAT:
            total += n * (2 if fp16 else 4)
        else:
            total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return math.ceil(total)


def _retained_bytes(bindings: list[Binding], retained: dict[str, str], precisions: dict[str, str]) -> int:
    total = 0.0
    for b in bindings:
        if b.name in retained:
            n = math.prod(b.dims)
            total += n * (
                mx.bytes_per_element("mxint8") if precisions.get(b.name) == "mxint8" else b.dtype.itemsize
            )
    return math.ceil(total)


def _activation_bytes(
    bindings: list[Binding], spec_dims: list[list[tuple[int, ...]]], retained: dict[str, str]
) -> int:
    """IO staging for the largest specialization, double-buffered (a stated estimate)."""
    state = set(retained) | set(retained.values())
    best = 0
    for dims in spec_dims:
        total = sum(
            math.prod(d) * b.dtype.itemsize
            for b, d in zip(bindings, dims, strict=True)
            if b.name not in state
        )
        best = max(best, total)
    return 2 * best


def _specs_json(specs: list[Specialization]) -> str:
    return json.dumps(
        {
            "specializations": [
                {"name": s.name, "symbols": {k: str(v) for k, v in s.symbols.items()}} for s in specs
            ]
        },
        indent=2,
    )


def iodesc_bytes(manifest: ProgramManifest) -> bytes:
    """The IoDesc: one ``default`` io set (also the selected set) and one allowed shape per spec (if several)."""
    desc = aicapi.IoDesc()
    io_set = desc.io_sets.add(name="default")
    for b in manifest.bindings:
        io_set.bindings.add(
            name=b.name,
            index=b.index,
            type=int(b.type),
            dir=int(b.dir),
            quant_scale=b.quant_scale,
            quant_offset=b.quant_offset,
            dims=list(b.dims),
            size=b.size,
            is_partial_buf_allowed=b.is_partial_buf_allowed,
        )
    desc.selected_set.CopyFrom(io_set)
    if len(manifest.specs) < 2:
        # As the real runtime reports it: a program of one specialization lists no allowed shapes
        # (callers such as QEfficient's _fetch_full_batch_size then read the binding dims).
        return bytes(desc.SerializeToString())
    for spec in manifest.specs:
        allowed = desc.allowed_shapes.add()
        for b, dims in zip(manifest.bindings, spec.dims, strict=True):
            allowed.shapes.add(type=int(b.type), dims=list(dims))
    return bytes(desc.SerializeToString())
