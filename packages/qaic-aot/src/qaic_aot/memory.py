"""Device memory of a compiled causal LM, counted as the compiler counts it, and the shapes that fit.

The count follows the simulator's ``qaic-compile`` (``qaic_sim.compiler``), which a test keeps equal
to this estimate:

- weights: every initializer of the exported graph; MatMul weights at MX FP6 size with
  ``mxfp6`` (6 bits plus an 8-bit scale per 32), the rest (and everything without it) at fp16 with
  ``convert_to_fp16``, else fp32. The exporter adds rope tables of ``ctx_len`` rows and stores the
  LM head as its own MatMul weight even when it is tied to the embedding.
- retained state: ``past_key.N`` / ``past_value.N`` for ``full_batch_size`` slots of ``ctx_len``
  positions, at MX INT8 size with ``mxint8`` (8 bits plus a scale per 32), else fp16 or fp32.
- activations: the IO buffers (ids, positions, batch index, fp32 logits) of the largest
  specialization, double-buffered.

The program is spread evenly over its devices. A real compiler needs some scratch space beyond
this count (how much is unverified), so the shape chosen when none is given leaves
:data:`AUTO_HEADROOM` of the device free.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from qaic_core.advice import ProgramNeeds
from qaic_core.errors import QaicConfigError
from qaic_core.execution import ShapeChoice, ShapeRequest
from qaic_core.resources import MB, DeviceResources
from qaic_core.settings import CompileSettings

MXFP6_BYTES = 6 / 8 + 1 / 32
MXINT8_BYTES = 1 + 1 / 32
INT64 = 8
LOGITS_BYTES = 4
CONSTANT_SLACK = 4096
"""Small constants of the graph (shapes, axes, masks values), generously."""
AUTO_HEADROOM = 0.10
"""Part of each device's free memory the automatically chosen shape leaves unused."""
AUTO_MAX_BATCH = 16
AUTO_MIN_BATCH = 4
"""The automatic batch: up to 16 sequences, and a context short enough for at least 4 (vllm-qaic's 4-16)."""
EMBEDDING_NAMES = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings")
"""Weight names that are gathered (embeddings), not multiplied: they stay out of MX FP6."""


@dataclass(frozen=True)
class ModelDims:
    """What a program's memory depends on besides its shape."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rotary_dim: int
    """Width of the rope tables (0: learned positions)."""
    matmul_params: int
    other_params: int
    max_positions: int
    """The model's longest context (``max_position_embeddings`` / ``n_positions``)."""


@dataclass(frozen=True)
class ProgramMemory:
    """Device memory of one program over its whole device group, in bytes."""

    weights: int
    retained: int
    activations: int
    num_devices: int

    @property
    def total(self) -> int:
        return self.weights + self.retained + self.activations

    @property
    def per_device(self) -> int:
        return math.ceil(self.total / self.num_devices)

    def describe(self) -> str:
        return (
            f"weights {_mb(self.weights)} + KV cache {_mb(self.retained)} + activations "
            f"{_mb(self.activations)} = {_mb(self.total)}"
            + (
                f" over {self.num_devices} devices ({_mb(self.per_device)} each)"
                if self.num_devices > 1
                else ""
            )
        )


def _mb(n: float) -> str:
    return f"{n / MB:,.1f} MB"


# -- the model ------------------------------------------------------------------------------
def model_dims(model_dir: Path | str, config: Mapping[str, Any] | None = None) -> ModelDims:
    """Geometry from config.json and parameter counts from the safetensors headers (else the config)."""
    model_dir = Path(model_dir)
    if config is None:
        config = json.loads((model_dir / "config.json").read_text())
    dims = dims_from_config(config)
    shapes = _safetensors_shapes(model_dir)
    if not shapes:
        return dims
    matmul = other = 0
    has_head = False
    for name, shape in shapes.items():
        n = math.prod(shape)
        if len(shape) >= 2 and not any(e in name for e in EMBEDDING_NAMES):
            matmul += n
            has_head = has_head or name.endswith("lm_head.weight")
        else:
            other += n
    if not has_head:  # tied: the exporter stores the head as its own MatMul weight
        matmul += dims.vocab_size * _hidden(config)
    return ModelDims(**{**dims.__dict__, "matmul_params": matmul, "other_params": other})


def _hidden(config: Mapping[str, Any]) -> int:
    return int(config.get("hidden_size") or config.get("n_embd") or 0)


def dims_from_config(config: Mapping[str, Any]) -> ModelDims:
    """Parameter counts from the architecture alone (for a config without weights, or a QPC's record)."""
    from qaic_aot.export.families import GRAPH_ARCHITECTURES, SUPPORTED_ARCHITECTURES, decoder_spec

    archs = list(config.get("architectures") or [])
    if archs and archs[0] in SUPPORTED_ARCHITECTURES and archs[0] not in GRAPH_ARCHITECTURES:
        return _traced_dims(config)
    cfg = SimpleNamespace(**config)
    spec = decoder_spec(cfg, CompileSettings(ctx_len=1, prefill_seq_len=1))
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = h * q_out + 2 * h * kv_out + q_out * h + (2 if spec.mlp == "gpt2" else 3) * h * i
    norm = 2 * h if spec.norm == "layer" else h
    biases = 0
    if spec.family == "gpt2":
        biases = q_out + 2 * kv_out + h + i + h
    elif spec.family == "qwen2" or config.get("attention_bias"):
        biases = q_out + 2 * kv_out
    layer_other = 2 * norm + biases + (2 * spec.head_dim if spec.qk_norm else 0)
    max_pos = int(config.get("max_position_embeddings") or config.get("n_positions") or 0)
    positions = max_pos * h if spec.positions == "learned" else 0
    return ModelDims(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=v,
        rotary_dim=spec.rotary_dim if spec.positions == "rope" else 0,
        matmul_params=spec.num_layers * per_layer + v * h,
        other_params=spec.num_layers * layer_other + norm + v * h + positions,
        max_positions=max_pos,
    )


def _first(config: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = config.get(name)
        if value:
            return int(value)
    return 0


def _traced_dims(config: Mapping[str, Any]) -> ModelDims:
    """An estimate for architectures exported by tracing: their configs name things in many ways.

    The traced graph computes rope in the graph (no tables); a mixture of experts counts every expert.
    """
    layers = _first(config, "num_hidden_layers", "n_layer", "n_layers")
    h = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head", "n_heads")
    head_dim = _first(config, "head_dim") or h // max(heads, 1)
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv") or heads
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        kv_heads = 1  # Falcon-7B and GPTBigCode keep one KV head
    v = _first(config, "vocab_size")
    inter = (
        _first(config, "intermediate_size", "n_inner", "ffn_hidden_size")
        or (_first(config, "expansion_ratio") or 4) * h
    )
    experts = _first(config, "num_local_experts", "num_experts")
    mlp = 3 * h * inter
    if experts:
        expert_inter = _first(config, "moe_intermediate_size") or inter
        shared = _first(config, "shared_expert_intermediate_size")
        mlp = 3 * h * expert_inter * experts + 3 * h * shared + h * experts
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    per_layer = 2 * h * q_out + 2 * h * kv_out + mlp
    max_pos = _first(config, "max_position_embeddings", "n_positions", "max_seq_len")
    return ModelDims(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=v,
        rotary_dim=0,
        matmul_params=layers * per_layer + v * h,
        other_params=layers * 4 * h + h + v * h,
        max_positions=max_pos,
    )


def _safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor shapes from the headers of every safetensors file (the weights are not read)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return {}
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = [int(d) for d in entry["shape"]]
    return shapes


# -- a program ------------------------------------------------------------------------------
def program_memory(dims: ModelDims, s: CompileSettings) -> ProgramMemory:
    """What the compiler counts for ``dims`` compiled with settings ``s``."""
    dt = 2 if s.convert_to_fp16 else 4
    matmul = MXFP6_BYTES if s.mxfp6 else dt
    rope = 2 * s.ctx_len * dims.rotary_dim
    weights = dims.matmul_params * matmul + (dims.other_params + rope) * dt + CONSTANT_SLACK
    kv = MXINT8_BYTES if s.mxint8 else dt
    slots = s.full_batch_size or s.batch_size
    retained = 2 * dims.num_layers * slots * dims.num_kv_heads * s.ctx_len * dims.head_dim * kv
    return ProgramMemory(
        weights=math.ceil(weights),
        retained=math.ceil(retained),
        activations=_activations(dims, s),
        num_devices=s.num_devices,
    )


def _activations(dims: ModelDims, s: CompileSettings) -> int:
    continuous = s.full_batch_size is not None
    decode_rows = s.full_batch_size or s.batch_size
    prefill_rows = 1 if continuous else s.batch_size
    k1 = s.decode_seq_len
    # A speculative target (QEfficient's TLM layout) decodes K+1 tokens keeping K+1 logits per row;
    # its prefill keeps one.
    runs = [(prefill_rows, s.prefill_seq_len, 1), (decode_rows, k1, k1)]
    best = 0
    for rows, seq, logits in runs:
        io = 2 * rows * seq * INT64 + rows * logits * dims.vocab_size * LOGITS_BYTES
        if continuous:
            io += rows * INT64
        if k1 > 1:
            io += logits * INT64  # num_logits_to_keep
        if s.ccl:
            io += s.ctx_len * INT64  # comp_ctx_lengths: the longest is ctx_len
        best = max(best, io)
    return 2 * best


# -- fitting ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fit:
    """A shape, its memory, and the per-device memory it was measured against."""

    settings: CompileSettings
    memory: ProgramMemory
    budget: int
    devices: tuple[DeviceResources, ...]

    @property
    def fits(self) -> bool:
        return self.memory.per_device <= self.budget


def budget_of(devices: Sequence[DeviceResources], headroom: float = 0.0) -> int:
    """Per-device bytes a program may take: the least free memory of the group, less ``headroom``."""
    if not devices:
        raise QaicConfigError("no device reported its memory: check the device group with qaic-util")
    return int(min(d.dram_free_bytes for d in devices) * (1.0 - headroom))


def with_shape(s: CompileSettings, batch: int, ctx: int) -> CompileSettings:
    """``s`` for ``batch`` slots of ``ctx`` positions (the prefill chunk shrinks to the context if longer)."""
    return s.replace(full_batch_size=batch, ctx_len=ctx, prefill_seq_len=min(s.prefill_seq_len, ctx))


def fits(dims: ModelDims, s: CompileSettings, budget: int) -> bool:
    return program_memory(dims, s).per_device <= budget


def _fits_shape(dims: ModelDims, s: CompileSettings, batch: int, ctx: int, budget: int) -> bool:
    """Whether ``batch`` x ``ctx`` fits; a shape the settings reject (ctx below K+1) does not."""
    try:
        shaped = with_shape(s, batch, ctx)
    except QaicConfigError:
        return False
    return fits(dims, shaped, budget)


def largest_batch(dims: ModelDims, s: CompileSettings, budget: int, cap: int = 1 << 20) -> int:
    """The most slots that fit at ``s.ctx_len`` (0: not even one)."""
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_shape(dims, s, mid, s.ctx_len, budget):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_ctx(dims: ModelDims, s: CompileSettings, budget: int, step: int = 128) -> int:
    """The longest context (a multiple of ``step`` where one fits, else any) for ``s``'s batch; 0: none."""
    batch = s.full_batch_size or s.batch_size
    lo, hi = 0, max(dims.max_positions, s.ctx_len)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_shape(dims, s, batch, mid, budget):
            lo = mid
        else:
            hi = mid - 1
    return lo - lo % step if lo >= step else lo


def candidate_contexts(max_positions: int, floor: int) -> list[int]:
    """The model's full context, then halvings down to ``floor``."""
    out = [max_positions]
    c = 1 << (max_positions.bit_length() - 1)
    if c == max_positions:
        c //= 2
    while c >= floor:
        out.append(c)
        c //= 2
    return out


@dataclass(frozen=True)
class Choice:
    """The shape chosen for unset ``--max-num-seqs`` / ``--max-model-len``, and why."""

    batch: int
    ctx: int
    memory: ProgramMemory
    budget: int
    reason: str


def choose_shape(
    dims: ModelDims,
    s: CompileSettings,
    devices: Sequence[DeviceResources],
    *,
    batch: int | None,
    ctx: int | None,
) -> Choice:
    """Fill in whichever of ``batch`` / ``ctx`` is None so the program fits its devices.

    The context comes first: the model's own, halved until :data:`AUTO_MIN_BATCH` sequences fit
    (or one, for a model that barely fits); then as many sequences as fit, up to
    :data:`AUTO_MAX_BATCH`. :data:`AUTO_HEADROOM` of each device's free memory stays unused.
    """
    budget = budget_of(devices, AUTO_HEADROOM)
    floor = min(s.prefill_seq_len, dims.max_positions) or 1
    contexts = [ctx] if ctx is not None else candidate_contexts(dims.max_positions, floor)
    want = [batch] if batch is not None else [AUTO_MIN_BATCH, 1]
    for need in want:
        for c in contexts:
            b = (
                batch
                if batch is not None
                else min(largest_batch(dims, with_shape(s, 1, c), budget), AUTO_MAX_BATCH)
            )
            if b >= need and _fits_shape(dims, s, b, c, budget):
                mem = program_memory(dims, with_shape(s, b, c))
                why = _reason(dims, devices, budget, b, c, batch is None, ctx is None)
                return Choice(b, c, mem, budget, why)
    raise QaicConfigError(
        too_large(dims, with_shape(s, batch or 1, ctx or floor), devices, headroom=AUTO_HEADROOM)
    )


def _reason(
    dims: ModelDims,
    devices: Sequence[DeviceResources],
    budget: int,
    batch: int,
    ctx: int,
    batch_free: bool,
    ctx_free: bool,
) -> str:
    parts = []
    if ctx_free:
        parts.append(
            "the model's full context"
            if ctx == dims.max_positions
            else f"the longest context (of the model's {dims.max_positions}, halved) that holds "
            f"{AUTO_MIN_BATCH if batch >= AUTO_MIN_BATCH else 1} sequence(s)"
        )
    if batch_free:
        parts.append(
            f"the most sequences that fit, at most {AUTO_MAX_BATCH}"
            if batch < AUTO_MAX_BATCH
            else f"{AUTO_MAX_BATCH} sequences, the automatic maximum"
        )
    sku = devices[0].sku if devices else ""
    return (
        f"{' and '.join(parts)}, within {1 - AUTO_HEADROOM:.0%} of the {budget / (1 - AUTO_HEADROOM) / MB:,.0f} MB "
        f"free on each of {len(devices)} device(s){f' ({sku})' if sku else ''}"
    )


def too_large(
    dims: ModelDims, s: CompileSettings, devices: Sequence[DeviceResources], *, headroom: float = 0.0
) -> str:
    """Why ``s`` cannot fit, and the largest shapes that would (the error a request gets before compiling)."""
    budget = budget_of(devices, headroom)
    mem = program_memory(dims, s)
    worst = min(devices, key=lambda d: d.dram_free_mb)
    batch = s.full_batch_size or s.batch_size
    head = (
        f"full_batch_size={batch} (--max-num-seqs) at ctx_len={s.ctx_len} (--max-model-len) needs "
        f"{mem.describe()}, {_mb(mem.per_device)} per device, but QID {worst.qid} has "
        f"{worst.dram_free_mb:,} of {worst.dram_total_mb:,} MB free"
    )
    b = largest_batch(dims, s, budget)
    c = largest_ctx(dims, s, budget)
    options = []
    if b >= 1:
        options.append(f"--max-num-seqs {b} at --max-model-len {s.ctx_len}")
    if c >= 1:
        options.append(f"--max-model-len {c} at --max-num-seqs {batch}")
    if options:
        fix = "the largest that fit: " + ", or ".join(options)
    else:
        fix = "not even one sequence of the shortest context fits"
    return (
        f"{head}: {fix}; or compress with --quantization mxfp6 / --kv-cache-dtype mxint8, or use more "
        "devices (override_qaic_config device_group / num_devices)"
    )


def smaller_shape(dims: ModelDims, s: CompileSettings, budget: int) -> str:
    """A shape that would fit ``budget`` per device, in flag form, or empty."""
    b = largest_batch(dims, s, budget)
    if b >= 1:
        return f"--max-num-seqs {b} at --max-model-len {s.ctx_len}"
    c = largest_ctx(dims, with_shape(s, 1, s.ctx_len), budget)
    return f"--max-num-seqs 1 at --max-model-len {c}" if c >= 1 else ""


# -- a compiled program's record ----------------------------------------------------------------
def recorded_settings(program_dir: Path) -> tuple[CompileSettings, dict[str, Any]] | None:
    """The settings and Hugging Face config a cached program was compiled with (``qpc-<hash>``), if recorded."""
    from qaic_core import qpc as layout

    for root in (program_dir, program_dir.parent):
        params = root / layout.COMPILE_PARAMS_FILE
        if params.is_file():
            break
    else:
        return None
    try:
        values = json.loads(params.read_text())["settings"]
        settings = CompileSettings.from_mapping({k: v for k, v in values.items() if v is not None})
        qconfig = root / layout.QCONFIG_FILE
        hf = json.loads(qconfig.read_text()).get("huggingface_config", {}) if qconfig.is_file() else {}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return settings, hf


def program_needs(program_dir: Path, devices: Sequence[DeviceResources]) -> ProgramNeeds:
    """What a program on disk takes per device and, when it does not fit ``devices``, a shape that would."""
    recorded = recorded_settings(Path(program_dir))
    if recorded is None:
        return ProgramNeeds()
    settings, hf = recorded
    try:
        dims = dims_from_config(hf)
    except (QaicConfigError, AttributeError, TypeError, ValueError):
        return ProgramNeeds(num_cores=settings.num_cores)
    memory = program_memory(dims, settings)
    smaller = ""
    if devices and memory.per_device > budget_of(devices):
        smaller = smaller_shape(dims, settings, budget_of(devices))
    return ProgramNeeds(
        num_cores=settings.num_cores, dram_bytes_per_device=memory.per_device, smaller=smaller
    )


def size_shape(request: ShapeRequest) -> ShapeChoice:
    """The ``aot`` path's answer to a :class:`ShapeRequest`: a shape given in full is checked, else chosen."""
    dims = model_dims(request.model_dir)
    limit = request.max_positions
    dims = ModelDims(**{**dims.__dict__, "max_positions": min(dims.max_positions or limit, limit)})
    probe, devices = request.settings, list(request.devices)
    if request.batch is not None and request.ctx is not None:
        if not fits(dims, probe, budget_of(devices)):
            raise QaicConfigError(too_large(dims, probe, devices))
        return ShapeChoice(probe)
    choice = choose_shape(dims, probe, devices, batch=request.batch, ctx=request.ctx)
    return ShapeChoice(with_shape(probe, choice.batch, choice.ctx), choice.reason, choice.memory.describe())
