"""Export a Hugging Face model to ONNX and compile it to a QPC, once per parameter set (cached)."""

from __future__ import annotations

import importlib.metadata as md
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qaic_aot import cache, integrity, model_files, program_config
from qaic_aot.progress import stage
from qaic_core import env, get_plugin_manager
from qaic_core import qpc as layout
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError, QaicError
from qaic_core.settings import CompileSettings

log = logging.getLogger("qaic.aot.compile")

PIPELINE_VERSION = 1
"""Bumped when the files or flags given to the compiler change, so old cache entries are not reused."""

EXPORT_DTYPE = "float32"

SPECULATIVE_LAYOUT = "qefficient-tlm"
"""The specializations of a speculative target program: QEfficient's TLM layout."""

COMPILE_INDEPENDENT = frozenset({"device_group"})
"""Settings that choose devices at load time and do not change the compiled program."""
KEYED_WHEN_SET = {
    "prefill_seq_lens": [],
    "prefill_batch_size": 1,
    "prefill_batch_seq_len": None,
    "ccl_enabled": False,
    "comp_ctx_lengths_prefill": [],
    "comp_ctx_lengths_decode": [],
}
"""Settings that enter the cache key only when they differ from these defaults (programs compiled
before they existed keep their key)."""


def select_compiler_backend(name: str | DeviceBackend | None) -> DeviceBackend:
    """The device backend whose compiler builds the program (``--backend`` / ``QAIC_BACKEND``)."""
    backend = get_plugin_manager().select_device_backend(name)
    if backend.compiler is None:
        raise QaicConfigError(
            f"device backend {backend.name!r} has no compiler: choose one that can compile with "
            "--backend (e.g. qaicrt with the Apps SDK, or sim)"
        )
    return backend


def exporter_identity() -> str:
    """Which exporter writes the ONNX (QEfficient or ours, see ``QAIC_AOT_EXPORTER``), with its version."""
    from qaic_aot.export.onnx_export import choose_exporter

    if choose_exporter() == "qefficient":
        return f"QEfficient {_version('QEfficient')}"
    return f"qaic-aot {_version('qaic-aot')}"


def exporter_route(arch: str) -> str:
    """QEfficient's name, or our route for ``arch``: the hand-built graph or traced transformers code."""
    from qaic_aot.export.families import export_route
    from qaic_aot.export.onnx_export import choose_exporter

    return "qefficient" if choose_exporter() == "qefficient" else export_route(arch)


def export_params(model_dir: Path, arch: str, settings: CompileSettings) -> dict[str, Any]:
    """Everything the ONNX depends on: the model files, dtype, exporter and IO contract options."""
    params = {
        "architecture": arch,
        "model_files": cache.model_fingerprint(model_dir),
        "dtype": EXPORT_DTYPE,
        "exporter": exporter_identity(),
        "route": exporter_route(arch),
        "continuous_batching": settings.full_batch_size is not None,
        "num_speculative_tokens": settings.num_speculative_tokens,
        # Our exporter sizes rope tables and sliding-window masks by ctx_len, so it is part of the key.
        "ctx_len": settings.ctx_len,
    }
    if settings.ccl:
        params["comp_ctx_lengths"] = True  # the comp_ctx_lengths input
    if params["route"] == "graph":
        from qaic_aot.export.decoder import GRAPH_REVISION

        params["graph_revision"] = GRAPH_REVISION  # a changed graph is exported again, not reused
    elif params["route"] == "traced":
        from qaic_aot.export.traced.export import TRACED_REVISION

        params["traced_revision"] = TRACED_REVISION
    return params


def compile_params(settings: CompileSettings, backend: DeviceBackend) -> dict[str, Any]:
    """Everything the program depends on besides the ONNX: settings, backend and compiler version."""
    values = {
        k: v
        for k, v in settings.to_dict().items()
        if k not in COMPILE_INDEPENDENT and not (k in KEYED_WHEN_SET and v == KEYED_WHEN_SET[k])
    }
    params: dict[str, Any] = {
        "settings": values,
        "backend": backend.name,
        "compiler": f"{backend.package} {_version(backend.package)}",
        "pipeline_version": PIPELINE_VERSION,
    }
    if backend.compiler_revision is not None:
        params["compiler_revision"] = backend.compiler_revision()
    if len(settings.batched_prefill_rows) > 1:
        # Batched prefills of fewer rows than prefill_batch_size were added to the same settings;
        # programs compiled with only the full batch are not reused.
        params["batched_prefill_rows"] = list(settings.batched_prefill_rows)
    if settings.num_speculative_tokens:
        # QEfficient's target layout (a one-logit prefill, no one-token decode) replaced ours, whose
        # cached programs are not reused.
        params["speculative_layout"] = SPECULATIVE_LAYOUT
    return params


def compile_model(
    model_dir: Path | str,
    settings: CompileSettings,
    *,
    backend: str | DeviceBackend | None = None,
    progress: bool = True,
    qeff_home: Path | None = None,
) -> Path:
    """Export and compile ``model_dir`` for ``settings``; returns the cached ``qpc-<hash>`` directory."""
    config = model_files.read_config(Path(model_dir))
    arch = model_files.architecture(config, Path(model_dir))
    _check_supported(arch)
    model_dir = model_files.check_model_dir(Path(model_dir))
    device_backend = select_compiler_backend(backend)
    home = Path(qeff_home) if qeff_home is not None else env.qeff_home()
    model_name = model_dir.name
    eparams = export_params(model_dir, arch, settings)
    edir = cache.export_dir(home, arch, model_name, cache.hash_params(eparams))
    onnx_path = ensure_export(model_dir, edir, model_name, settings, eparams, progress=progress)
    cparams = compile_params(settings, device_backend)
    cdir = cache.compile_dir(edir, cache.hash_params(cparams))
    ensure_compiled(onnx_path, cdir, settings, cparams, device_backend, config, progress=progress)
    return cdir


def ensure_export(
    model_dir: Path,
    edir: Path,
    model_name: str,
    settings: CompileSettings,
    params: dict[str, Any],
    *,
    progress: bool = True,
    export: Callable[[Path], Any] | None = None,
) -> Path:
    """The cached ONNX of ``model_dir``, exported under a lock unless it is already there.

    ``export(onnx_path)`` writes the graph; the causal-LM exporter (``run_export``) by default.
    """
    onnx_path = edir / f"{model_name}.onnx"
    with cache.locked(edir):
        if export_reusable(edir, onnx_path):
            log.info("reusing exported model %s", onnx_path)
            return onnx_path
        tmp = cache.temporary_dir(edir)
        try:
            if export is not None:
                export(tmp / onnx_path.name)
            else:
                run_export(model_dir, tmp / onnx_path.name, settings, progress=progress)
            layout.write_json(tmp / layout.EXPORT_PARAMS_FILE, params)
            integrity.seal(tmp, "export", recursive=False)
            # The manifest goes last: it marks a complete export (the params file did before it).
            cache.move_files_into(tmp, edir, last=(layout.EXPORT_PARAMS_FILE, integrity.MANIFEST_FILE))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s to %s", model_dir, onnx_path)
    return onnx_path


def export_reusable(edir: Path, onnx_path: Path) -> bool:
    """Whether the export in ``edir`` can be reused; a damaged one is moved aside (then False).

    An export with a manifest is checked against its checksums; one made before manifests
    existed (ONNX and params file, no manifest) is adopted when its graph parses.
    """
    required = (onnx_path.name, layout.EXPORT_PARAMS_FILE)
    complete = all((edir / name).is_file() for name in required)
    if (edir / integrity.MANIFEST_FILE).is_file():
        problem = integrity.verify(edir, required, update=True)
        if problem is None:
            return True
    elif complete:
        problem = integrity.onnx_problem(onnx_path)
        if problem is None:
            integrity.seal(edir, "export", recursive=False)
            log.info("recorded the checksums of %s, exported by an earlier version", onnx_path)
            return True
    else:
        if not edir.is_dir() or not integrity.entry_files(edir, recursive=False):
            return False
        problem = f"no {integrity.MANIFEST_FILE} completion marker (an interrupted export)"
    names = [*integrity.entry_files(edir, recursive=False)]
    if (edir / integrity.MANIFEST_FILE).is_file():
        names.append(integrity.MANIFEST_FILE)
    moved = cache.move_files_aside(edir, names)
    log.warning(
        "exported model %s is damaged: %s; moved its files to %s and exporting it again",
        onnx_path,
        problem,
        moved,
    )
    return False


def run_export(model_dir: Path, out_path: Path, settings: CompileSettings, *, progress: bool = True) -> Any:
    """Call the exporter (``qaic_aot.export.export_onnx``), which shows its own progress bars."""
    from qaic_aot.export import export_onnx

    log.info("exporting %s to ONNX (%s)", model_dir, exporter_identity())
    started = time.monotonic()
    result = export_onnx(
        model_dir, out_path, settings, dtype=EXPORT_DTYPE, progress=progress, ccl=settings.ccl
    )
    log.info("export of %s took %.1f s", model_dir.name, time.monotonic() - started)
    return result


def ensure_compiled(
    onnx_path: Path,
    cdir: Path,
    settings: CompileSettings,
    params: dict[str, Any],
    backend: DeviceBackend,
    hf_config: dict[str, Any],
    *,
    progress: bool = True,
    write_inputs: Callable[[Path, Path], list[str]] | None = None,
) -> Path:
    """The cached program for ``params``, compiled under a lock unless it already exists.

    ``write_inputs(onnx_path, out_dir)`` writes the compiler's input files and returns its argv
    (``write_compile_inputs``, a causal LM's, by default).
    """
    observers = get_plugin_manager().observers()
    with cache.locked(cdir):
        if compiled_reusable(cdir, backend):
            log.info("reusing compiled program %s", cdir)
            observers.program_compiled(cached=True, seconds=0.0)
            return cdir
        started = time.monotonic()

        def build(tmp: Path) -> None:
            if write_inputs is not None:
                argv = write_inputs(onnx_path, tmp)
            else:
                argv = write_compile_inputs(onnx_path, tmp, settings)
            with stage(f"compiling {onnx_path.name} with {backend.name}", enabled=progress, logger=log):
                run_compiler(backend, argv)
            if not layout.qpc_exists(tmp):
                raise QaicError(
                    f"the compiler finished but wrote no {layout.PROGRAM_FILE} under {tmp / 'qpc'}"
                )
            layout.write_json(tmp / layout.COMPILE_PARAMS_FILE, params)
            layout.write_json(
                tmp / layout.QCONFIG_FILE,
                {
                    "huggingface_config": hf_config,
                    "qpc_config": {
                        "compile_params": params,
                        "compiler_command": [
                            _compiler_name(backend),
                            *program_config.relocate(argv, tmp, cdir),
                        ],
                        "onnx_path": str(onnx_path),
                    },
                },
            )
            integrity.seal(tmp, "compile", recursive=True)  # last: the completion marker

        cache.build_dir_atomically(cdir, build)
        observers.program_compiled(cached=False, seconds=time.monotonic() - started)
    log.info("compiled program ready at %s", cdir)
    return cdir


def compiled_reusable(cdir: Path, backend: DeviceBackend) -> bool:
    """Whether the entry ``cdir`` can be reused; a damaged or partial one is moved aside (then False).

    An entry with a manifest is checked against its checksums; one made before manifests existed
    (program and params file, no manifest) is adopted when ``backend`` can read its header.
    """
    if not cdir.exists():
        return False
    if (cdir / integrity.MANIFEST_FILE).is_file():
        problem = integrity.verify(cdir, (integrity.PROGRAM_MEMBER,), update=True)
        if problem is None:
            return True
    elif (cdir / integrity.PROGRAM_MEMBER).is_file() and (cdir / layout.COMPILE_PARAMS_FILE).is_file():
        problem = integrity.header_problem(cdir / integrity.PROGRAM_MEMBER, backend)
        if problem is None:
            integrity.seal(cdir, "compile", recursive=True)
            log.info("recorded the checksums of %s, compiled by an earlier version", cdir)
            return True
    else:
        problem = (
            f"no {integrity.MANIFEST_FILE} completion marker and no complete program (an interrupted "
            "build or copy)"
        )
    moved = cache.move_aside(cdir)
    log.warning(
        "compiled program %s is damaged: %s; moved it to %s and compiling it again", cdir, problem, moved
    )
    return False


def write_compile_inputs(onnx_path: Path, out_dir: Path, settings: CompileSettings) -> list[str]:
    """Write specializations.json, custom_io.yaml and the mdp partition; return the compiler argv."""
    signature = program_config.read_signature(onnx_path)
    specs = program_config.specializations(settings, signature.symbols)
    layout.write_specializations(out_dir / layout.SPECIALIZATIONS_FILE, specs)
    kv_io = program_config.custom_io(settings, signature.num_layers)
    if kv_io:
        layout.write_custom_io(out_dir / layout.CUSTOM_IO_FILE, kv_io)
    if settings.num_devices > 1:
        devices = list(settings.device_group or range(settings.num_devices))
        layout.write_json(
            out_dir / program_config.mdp_file_name(settings.num_devices),
            layout.mdp_partition(devices, settings.num_cores),
        )
    return program_config.compiler_argv(onnx_path, out_dir, settings, has_custom_io=bool(kv_io))


def run_compiler(backend: DeviceBackend, argv: list[str]) -> None:
    assert backend.compiler is not None
    log.info("%s %s", _compiler_name(backend), " ".join(argv))
    backend.compiler(argv)


def _compiler_name(backend: DeviceBackend) -> str:
    return "qaic-compile" if backend.name != "sim" else "qaic-compile (sim)"


def _check_supported(arch: str) -> None:
    from qaic_aot.export import SUPPORTED_ARCHITECTURES

    if arch not in SUPPORTED_ARCHITECTURES:
        raise QaicConfigError(
            f"architecture {arch!r} is not supported by the AOT exporter; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "unknown"
