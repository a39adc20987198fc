"""Checking a prebuilt program (given by path) against the model and the settings it will serve."""

from __future__ import annotations

from pathlib import Path

from qaic_aot import integrity, model_files
from qaic_aot.iodesc import load_program_io, program_dir
from qaic_core import get_plugin_manager
from qaic_core import qpc as layout
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings
from qaic_core.types import Binding, Specialization


def program_specializations(
    qpc_dir: Path, bindings: list[Binding], allowed: list[list[tuple[int, list[int]]]]
) -> list[Specialization]:
    """The program's specializations: from specializations.json, else read off the allowed shapes.

    The file is looked for next to ``programqpc.bin`` and one folder up (the ``qpc-<hash>`` entry).
    """
    program = program_dir(qpc_dir)
    for folder in (program, program.parent):
        path = folder / layout.SPECIALIZATIONS_FILE
        if path.is_file():
            return layout.read_specializations(path)
    index = {b.name: b.index for b in bindings}
    specs: list[Specialization] = []
    for i, shape in enumerate(allowed):
        symbols: dict[str, int] = {}
        if "input_ids" in index:
            symbols["batch_size"], symbols["seq_len"] = shape[index["input_ids"]][1][:2]
        if "past_key.0" in index:
            symbols["full_batch_size"], _, symbols["ctx_len"], _ = shape[index["past_key.0"]][1]
        specs.append(Specialization(f"spec{i}", symbols))
    return specs


def validate_qpc(
    qpc_dir: Path | str,
    model_dir: Path | str,
    settings: CompileSettings,
    *,
    backend: str | DeviceBackend | None = None,
) -> None:
    """Raise ``QaicConfigError`` naming every way the program disagrees with the model or settings.

    A program that is missing, damaged (its checksums, when recorded) or unreadable fails first,
    naming the file and how to rebuild it.
    """
    geometry = model_files.geometry(Path(model_dir))
    device_backend = get_plugin_manager().select_device_backend(backend)
    folder = integrity.check_prebuilt(Path(qpc_dir), device_backend, read_header=False)
    try:
        io = load_program_io(device_backend.runtime(), device_backend.aicapi(), folder)
    except Exception as exc:  # the real runtime raises its own types
        raise integrity.damaged(
            folder / layout.PROGRAM_FILE, f"the {device_backend.name} backend cannot read it: {exc}"
        ) from exc
    bindings = {b.name: b for b in io.bindings}
    problems: list[str] = []

    logits = bindings.get("logits")
    if logits is None:
        problems.append("the program has no 'logits' output: it is not a causal-LM program")
    elif logits.dims[-1] != geometry.vocab_size:
        problems.append(
            f"vocabulary: program {logits.dims[-1]}, model {geometry.vocab_size} (the program was compiled "
            "from another model: compile this one or give its own --qpc-path)"
        )
    layers = len([n for n in bindings if n.startswith("past_key.") and not n.endswith("_RetainedState")])
    if layers != geometry.num_layers:
        problems.append(
            f"layers: program {layers}, model {geometry.num_layers} (compiled from another model)"
        )
    kv = bindings.get("past_key.0")
    if kv is not None and len(kv.dims) == 4:
        if kv.dims[1] != geometry.num_kv_heads:
            problems.append(
                f"KV heads: program {kv.dims[1]}, model {geometry.num_kv_heads} (compiled from another model)"
            )
        if kv.dims[3] != geometry.head_dim:
            problems.append(
                f"head_dim: program {kv.dims[3]}, model {geometry.head_dim} (compiled from another model)"
            )

    specs = program_specializations(Path(qpc_dir), io.bindings, io.allowed_shapes)
    ctx_lens = {s.symbols["ctx_len"] for s in specs if "ctx_len" in s.symbols}
    if ctx_lens and settings.ctx_len not in ctx_lens:
        problems.append(
            f"ctx_len: program {sorted(ctx_lens)}, requested {settings.ctx_len}: set --ctx-len "
            f"(vLLM: --max-model-len) to {max(ctx_lens)}"
        )
    prefill_specs = [s for s in specs if s.name == "Prefill"] or [
        s for s in specs if s.symbols.get("seq_len", 1) > 1
    ]
    prefill = [s.symbols["seq_len"] for s in prefill_specs if "seq_len" in s.symbols]
    if prefill and settings.prefill_seq_len not in prefill:
        problems.append(
            f"prefill_seq_len: program {sorted(set(prefill))}, requested {settings.prefill_seq_len}: set "
            f"--prefill-seq-len (vLLM: --long-prefill-token-threshold) to {max(prefill)}"
        )
    fbs = {s.symbols["full_batch_size"] for s in specs if "full_batch_size" in s.symbols}
    if settings.full_batch_size is not None and fbs and settings.full_batch_size not in fbs:
        problems.append(
            f"full_batch_size: program {sorted(fbs)}, requested {settings.full_batch_size}: set "
            f"--full-batch-size (vLLM: --max-num-seqs) to {max(fbs)}"
        )
    if settings.full_batch_size is not None and not fbs and "batch_index" not in bindings:
        problems.append(
            "full_batch_size: the program was compiled without continuous batching (no batch_index input): "
            "recompile with --full-batch-size"
        )
    if settings.num_speculative_tokens:
        k1 = settings.num_speculative_tokens + 1
        widths = {s.symbols.get("seq_len") for s in specs if s.name != "Prefill"}
        if k1 not in widths or "num_logits_to_keep" not in bindings:
            problems.append(
                f"num_speculative_tokens: the program has no decode of {k1} tokens: recompile with "
                f"--num-speculative-tokens {settings.num_speculative_tokens}"
            )
    if settings.ccl and "comp_ctx_lengths" not in bindings:
        problems.append(
            "compute-context lengths: the program has no comp_ctx_lengths input: recompile with ccl_enabled "
            "/ comp_ctx_lengths_prefill / comp_ctx_lengths_decode, or leave them out"
        )
    if problems:
        raise QaicConfigError(
            f"the compiled program {qpc_dir} does not fit model {model_dir} and these settings:\n  - "
            + "\n  - ".join(problems)
        )
