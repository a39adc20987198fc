"""What the compiler is told besides the model: specializations, custom IO precisions, flags."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qaic_core import qpc as layout
from qaic_core.settings import CompileSettings
from qaic_core.types import Specialization

KV_INPUT = re.compile(r"^past_(key|value)\.(\d+)$")


@dataclass(frozen=True)
class OnnxSignature:
    """Input and output names of an exported graph and the symbolic dims it uses."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    symbols: frozenset[str]

    @property
    def num_layers(self) -> int:
        layers = {int(m.group(2)) for name in self.inputs if (m := KV_INPUT.match(name))}
        return max(layers) + 1 if layers else 0


def read_signature(onnx_path: Path) -> OnnxSignature:
    """Read names and symbolic dims without loading the weights (external data stays on disk)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    symbols: set[str] = set()
    for value in [*graph.input, *graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                symbols.add(dim.dim_param)
    return OnnxSignature(
        inputs=tuple(v.name for v in graph.input if v.name not in initializers),
        outputs=tuple(v.name for v in graph.output),
        symbols=frozenset(symbols),
    )


def specializations(settings: CompileSettings, symbols: frozenset[str] | None = None) -> list[Specialization]:
    """QEfficient's specializations: continuous-batching Prefill/Decode, or the fixed-batch pair.

    With ``full_batch_size`` the prefill runs one sequence (batch_size 1) and the decode the full
    batch. ``num_speculative_tokens`` K makes it QEfficient's speculative target (TLM) layout: the
    decode has ``seq_len`` K+1 and ``num_logits_to_keep`` K+1 (one logits row per token), every
    prefill ``num_logits_to_keep`` 1; there is no one-token decode (a single token runs on the K+1
    decode, padded with position -1). ``prefill_seq_lens`` add shorter prefills, and
    ``prefill_batch_size`` B a prefill of B sequences at the shortest length (and of 2, 4, ... below
    B, ``batched_prefill_rows``); they come after the decodes and are named Prefill too.
    Compute-context lengths (``settings.compute_context_lengths``) give every prefill one
    specialization per prefill length and the decode one per decode length, with the
    ``comp_ctx_lengths`` symbol, as QEfficient lays them out. Symbols the graph does not use
    are left out (the compiler rejects unknown symbols).
    """
    s = settings
    fbs = s.full_batch_size
    tlm = bool(s.num_speculative_tokens)
    decode_len = s.decode_seq_len
    prefill_batch = 1 if fbs is not None else s.batch_size
    decode_batch = fbs if fbs is not None else s.batch_size

    lengths = s.compute_context_lengths
    prefill_ccls: tuple[int | None, ...] = lengths[0] if lengths else (None,)
    decode_ccls: tuple[int | None, ...] = lengths[1] if lengths else (None,)

    def spec(name: str, batch: int, seq_len: int, logits: int) -> list[Specialization]:
        """One per compute-context length. QEfficient's key order: batch_size, seq_len, ctx_len,
        comp_ctx_lengths, num_logits_to_keep, full_batch_size."""
        out = []
        for ccl in decode_ccls if name == "Decode" else prefill_ccls:
            values: dict[str, int] = {"batch_size": batch, "seq_len": seq_len, "ctx_len": s.ctx_len}
            if ccl is not None:
                values["comp_ctx_lengths"] = ccl
            if tlm:
                values["num_logits_to_keep"] = logits
            if fbs is not None:
                values["full_batch_size"] = fbs
            out.append(Specialization(name, values))
        return out

    specs = spec("Prefill", prefill_batch, s.prefill_seq_len, 1)
    if fbs is not None or tlm or s.prefill_seq_len != 1:
        specs += spec("Decode", decode_batch, decode_len, decode_len)
    for length in sorted(set(s.prefill_seq_lens) - {s.prefill_seq_len}, reverse=True):
        specs += spec("Prefill", prefill_batch, length, 1)
    if s.batched_prefill_seq_len is not None:
        for rows in s.batched_prefill_rows:
            specs += spec("Prefill", rows, s.batched_prefill_seq_len, 1)
    if symbols is not None:
        specs = [
            Specialization(sp.name, {k: v for k, v in sp.symbols.items() if k in symbols}) for sp in specs
        ]
    unique: list[Specialization] = []
    for sp in specs:
        if all(sp.symbols != u.symbols for u in unique):
            unique.append(sp)
    return unique


def kv_precision(settings: CompileSettings) -> str:
    """KV cache precision: mxint8 when asked, else the compute precision (float16 or float32)."""
    if settings.mxint8:
        return "mxint8"
    return "float16" if settings.convert_to_fp16 else "float32"


def custom_io(settings: CompileSettings, num_layers: int) -> dict[str, str]:
    """custom_io.yaml entries: every ``past_key/value.N`` and its ``_RetainedState`` output."""
    return layout.kv_custom_io(num_layers, kv_precision(settings))


def mdp_file_name(num_devices: int) -> str:
    return f"mdp_ts_{num_devices}.json"


def compiler_argv(
    onnx_path: Path,
    out_dir: Path,
    settings: CompileSettings,
    *,
    has_custom_io: bool = True,
    retained_state: bool = True,
) -> list[str]:
    """``qaic-compile`` arguments (without the program name) for a program built into ``out_dir``.

    ``retained_state`` is off for programs that keep nothing between runs (pooling models).
    """
    s = settings
    argv = ["-aic-hw", "-aic-hw-version=ai100", f"-m={onnx_path}"]
    if retained_state:
        argv.append("-retained-state")
    if s.convert_to_fp16:
        argv.append("-convert-to-fp16")
    if s.mxfp6:
        argv.append("-mxfp6-matmul")
    argv.append(f"-aic-num-cores={s.num_cores}")
    if s.mos is not None:
        argv.append(f"-mos={s.mos}")
    if s.aic_enable_depth_first:
        argv.append("-aic-enable-depth-first")
    argv.append(f"-network-specialization-config={out_dir / layout.SPECIALIZATIONS_FILE}")
    if has_custom_io:
        argv.append(f"-custom-IO-list-file={out_dir / layout.CUSTOM_IO_FILE}")
    if s.num_devices > 1:
        argv.append(f"-mdp-load-partition-config={out_dir / mdp_file_name(s.num_devices)}")
    argv.append(f"-aic-binary-dir={out_dir / 'qpc'}")
    argv.extend(s.compiler_args)
    return argv


def relocate(argv: Sequence[str], old: Path, new: Path) -> list[str]:
    """The same arguments with paths under ``old`` pointing under ``new`` (for the record)."""
    return [a.replace(str(old), str(new)) for a in argv]
