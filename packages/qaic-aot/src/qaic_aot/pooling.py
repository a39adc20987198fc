"""Pooling models on the ``aot`` path: export, compile one specialization per ``embed_seq_len``, run.

The program follows QEfficient's ``QEFFAutoModel`` contract (see :mod:`qaic_aot.export.encoder`):
``input_ids`` and ``attention_mask`` of ``[batch_size, seq_len]`` in, ``output`` or ``logits`` out.
A run holds up to ``batch_size`` sequences on the smallest compiled ``seq_len`` that fits the
longest of them; padding is masked and unused rows are never read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qaic_aot import cache, compose, model_files, program_config
from qaic_aot.compile import (
    EXPORT_DTYPE,
    compile_params,
    ensure_compiled,
    ensure_export,
    exporter_identity,
    select_compiler_backend,
)
from qaic_aot.export.pooling_archs import POOLING_ARCHITECTURES, pooling_architecture
from qaic_aot.iodesc import program_dir
from qaic_core import env
from qaic_core import qpc as layout
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    HIDDEN_OUTPUT,
    LOGITS_OUTPUT,
    POOLED_OUTPUT,
    ExecutionConfig,
    PoolingSettings,
    PoolingShape,
)
from qaic_core.session import DeviceSession, RunInFlight
from qaic_core.settings import CompileSettings
from qaic_core.types import Specialization

log = logging.getLogger("qaic.aot.pooling")

POOLING_PIPELINE_VERSION = 2
"""Bumped when the pooling graphs or their compile inputs change, so old cache entries are not reused
(2: decoder RMSNorm as QEfficient's compiler-known ``CustomRMSNorm``)."""
PAD_TOKEN = 0


def specializations(batch_size: int, pooling: PoolingSettings) -> list[Specialization]:
    """QEfficient's embedding specializations: ``Embedding`` (one length) or ``Embedding_<i>``."""
    many = len(pooling.seq_lens) > 1
    return [
        Specialization(f"Embedding_{i}" if many else "Embedding", {"batch_size": batch_size, "seq_len": n})
        for i, n in enumerate(pooling.seq_lens)
    ]


def export_pooling_onnx(
    model_dir: Path,
    out_path: Path,
    settings: CompileSettings,
    pooling: PoolingSettings,
    *,
    progress: bool = True,
) -> Path:
    """Write the pooling graph of ``model_dir`` to ``out_path``."""
    import onnx

    from qaic_aot.export.encoder import build_pooling_graph
    from qaic_aot.export.onnx_export import EXTERNAL_DATA_BYTES, _save, load_config
    from qaic_aot.export.weights import load_weights

    config = load_config(model_dir)
    started = time.monotonic()
    model = build_pooling_graph(
        config, load_weights(model_dir, progress), model_dir, settings, pooling, progress=progress
    )
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    if weight_bytes < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(model, full_check=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _save(model, out_path, weight_bytes)
    log.info("exported pooling model %s to %s in %.1fs", model_dir, out_path, time.monotonic() - started)
    return out_path


def export_params(model_dir: Path, arch: str, pooling: PoolingSettings) -> dict[str, Any]:
    """What the pooling ONNX depends on: the model files, the pooling compiled in, the longest length."""
    return {
        "architecture": arch,
        "model_files": cache.model_fingerprint(model_dir),
        "dtype": EXPORT_DTYPE,
        "exporter": exporter_identity(),
        "pooling": {"device": pooling.device, "method": pooling.method, "normalize": pooling.normalize},
        "max_seq_len": pooling.max_seq_len,
        "pooling_pipeline_version": POOLING_PIPELINE_VERSION,
    }


def compile_pooling_model(
    model_dir: Path | str,
    settings: CompileSettings,
    pooling: PoolingSettings,
    *,
    task: str | None = None,
    backend: str | DeviceBackend | None = None,
    progress: bool = True,
    qeff_home: Path | None = None,
) -> Path:
    """Export and compile a pooling model with ``settings.decode_batch_size`` rows per run; cached.

    Returns the ``qpc-<hash>`` directory. ``settings`` gives the compiler options (cores, fp16,
    mxfp6, devices); ``pooling`` the ``embed_seq_len`` specializations and pooling compiled in.
    """
    model_dir = model_files.check_model_dir(Path(model_dir))
    raw = model_files.read_config(model_dir)
    arch = model_files.architecture(raw, model_dir)
    if arch not in POOLING_ARCHITECTURES:
        raise QaicConfigError(
            f"architecture {arch!r} is not supported as a pooling model on the aot path; supported: "
            f"{', '.join(POOLING_ARCHITECTURES)}"
        )
    pooling_architecture(_Archs(arch), task)
    device_backend = select_compiler_backend(backend)
    home = Path(qeff_home) if qeff_home is not None else env.qeff_home()
    eparams = export_params(model_dir, arch, pooling)
    edir = cache.export_dir(home, arch, model_dir.name, cache.hash_params(eparams))
    onnx_path = ensure_export(
        model_dir,
        edir,
        model_dir.name,
        settings,
        eparams,
        progress=progress,
        export=lambda out: export_pooling_onnx(model_dir, out, settings, pooling, progress=progress),
    )
    cparams = compile_params(settings, device_backend)
    cparams["pooling"] = {"seq_lens": list(pooling.seq_lens), "batch_size": settings.decode_batch_size}
    cdir = cache.compile_dir(edir, cache.hash_params(cparams))

    def write_inputs(onnx: Path, out_dir: Path) -> list[str]:
        layout.write_specializations(
            out_dir / layout.SPECIALIZATIONS_FILE, specializations(settings.decode_batch_size, pooling)
        )
        if settings.num_devices > 1:
            devices = list(settings.device_group or range(settings.num_devices))
            layout.write_json(
                out_dir / program_config.mdp_file_name(settings.num_devices),
                layout.mdp_partition(devices, settings.num_cores),
            )
        return program_config.compiler_argv(
            onnx, out_dir, settings, has_custom_io=False, retained_state=False
        )

    ensure_compiled(
        onnx_path, cdir, settings, cparams, device_backend, raw, progress=progress, write_inputs=write_inputs
    )
    return cdir


class _Archs:
    """A config stand-in carrying only ``architectures`` (for :func:`pooling_architecture`)."""

    def __init__(self, arch: str) -> None:
        self.architectures = [arch]


class PoolingRun:
    """A run in flight; ``wait()`` gives one float32 array per submitted sequence."""

    def __init__(
        self, run: RunInFlight | None, pick: Callable[[dict[str, np.ndarray]], list[np.ndarray]]
    ) -> None:
        self._run = run
        self._pick = pick

    def wait(self) -> list[np.ndarray]:
        return self._pick(self._run.wait() if self._run is not None else {})


class AotPoolingModel:
    """A compiled pooling program on its device group, run batch by batch (a :class:`PoolingModel`)."""

    def __init__(self, session: DeviceSession, pooling: PoolingSettings, qpc_dir: Path | None = None) -> None:
        self.session = session
        self.qpc_dir = qpc_dir
        names = set(session.input_names)
        if not {"input_ids", "attention_mask"} <= names:
            raise QaicConfigError(
                f"the program's inputs {sorted(names)} are not a pooling model's (input_ids, attention_mask): "
                "it was not exported as an embedding or classification model"
            )
        bindings = {b.name: b for b in session.bindings}
        if "logits" in bindings:
            self._name, kind = "logits", LOGITS_OUTPUT
        elif "output" in bindings:
            self._name = "output"
            kind = HIDDEN_OUTPUT if len(bindings["output"].dims) == 3 else POOLED_OUTPUT
        else:
            raise QaicConfigError("the program has no 'output' or 'logits' output: it is not a pooling model")
        index = session.binding_index_map["input_ids"]
        shapes = sorted({tuple(shape[index][1]) for shape in session.allowed_shapes})
        batches = {s[0] for s in shapes}
        if len(batches) != 1:
            raise QaicConfigError(f"the program's input_ids shapes {shapes} do not share one batch size")
        seq_lens = tuple(sorted(s[1] for s in shapes))
        if tuple(pooling.seq_lens) != seq_lens:
            raise QaicConfigError(
                f"the program was compiled for embed_seq_len {list(seq_lens)} but {list(pooling.seq_lens)} is "
                "configured: set embed_seq_len to the program's lengths or recompile"
            )
        width = int(bindings[self._name].dims[-1])
        self._shape = PoolingShape(
            batch_size=batches.pop(),
            seq_lens=seq_lens,
            hidden_size=width if kind != LOGITS_OUTPUT else 0,
            output=kind,
            width=width,
        )
        self._next_exec = 0

    @property
    def pooling_shape(self) -> PoolingShape:
        return self._shape

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset()

    def bucket(self, num_tokens: int) -> int:
        for n in self._shape.seq_lens:
            if num_tokens <= n:
                return n
        raise QaicConfigError(
            f"a sequence of {num_tokens} tokens is longer than the largest compiled embed_seq_len "
            f"{self._shape.seq_lens[-1]}: shorten it or compile a longer one"
        )

    def submit(self, sequences: Sequence[Sequence[int]]) -> PoolingRun:
        shape = self._shape
        if len(sequences) > shape.batch_size:
            raise QaicConfigError(
                f"{len(sequences)} sequences in one run, the program takes {shape.batch_size} (the compiled "
                "batch, --max-num-seqs): split them"
            )
        if not sequences:
            return PoolingRun(None, lambda _: [])
        lengths = [len(s) for s in sequences]
        if min(lengths) < 1:
            raise QaicConfigError("cannot pool an empty sequence: give at least one token")
        seq_len = self.bucket(max(lengths))
        ids = np.full((shape.batch_size, seq_len), PAD_TOKEN, np.int64)
        mask = np.zeros((shape.batch_size, seq_len), np.int64)
        mask[:, 0] = 1  # unused rows see one token, so nothing degenerates; their results are dropped
        for row, tokens in enumerate(sequences):
            ids[row, : lengths[row]] = tokens
            mask[row, : lengths[row]] = 1
        exec_index = self._next_exec
        self._next_exec = (self._next_exec + 1) % self.session.num_exec_objects
        run = self.session.submit({"input_ids": ids, "attention_mask": mask}, exec_index)
        name, hidden = self._name, shape.output == HIDDEN_OUTPUT

        def pick(out: dict[str, np.ndarray]) -> list[np.ndarray]:
            data = np.asarray(out[name], dtype=np.float32)
            if hidden:
                return [data[row, :n].copy() for row, n in enumerate(lengths)]
            return [data[row].copy() for row in range(len(lengths))]

        return PoolingRun(run, pick)

    def run(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self.submit(sequences).wait()

    def recover(self) -> None:
        self.session.reload()

    def close(self) -> None:
        if self.session.is_active:
            self.session.deactivate()


def check(config: ExecutionConfig) -> None:
    """Configuration-time checks of a pooling model: the architecture serves the task; a prebuilt program exists."""
    raw = model_files.read_config(Path(config.model_dir))
    arch = model_files.architecture(raw, Path(config.model_dir))
    pooling_architecture(_Archs(arch), config.task)
    if (
        config.qpc_path is not None
        and not (program_dir(Path(config.qpc_path)) / layout.PROGRAM_FILE).is_file()
    ):
        raise QaicConfigError(
            f"qpc_path {config.qpc_path}: no {layout.PROGRAM_FILE} there: compile it or fix the path"
        )


def compile_program(config: ExecutionConfig) -> Path:
    """Compile the pooling model for the configured batch and lengths (cached); the QPC directory."""
    pooling = _pooling_of(config)
    settings = config.settings
    log.info(
        "qaic: compiling %s for %s with %d sequences per run, embed_seq_len %s, pooling on %s "
        "(cached after the first time)",
        config.model_dir,
        config.task,
        settings.decode_batch_size,
        list(pooling.seq_lens),
        pooling.device,
    )
    return compile_pooling_model(
        config.model_dir,
        settings,
        pooling,
        task=config.task,
        backend=config.device,
        progress=config.progress,
    )


def _pooling_of(config: ExecutionConfig) -> PoolingSettings:
    if config.pooling is None:
        raise QaicConfigError(f"task {config.task!r} needs pooling settings (embed_seq_len, pooling_device)")
    return config.pooling


def open_pooling_model(config: ExecutionConfig) -> AotPoolingModel:
    """Load the pooling program with the selected model loader (compiled and cached, or prebuilt) and
    open it with the selected session factory (:mod:`qaic_aot.compose`)."""
    pooling = _pooling_of(config)
    settings = config.settings
    qpc_dir = compose.load_program(config)
    program = program_dir(qpc_dir)
    session = compose.open_session(config, qpc_dir)
    try:
        model = AotPoolingModel(session, pooling, qpc_dir)
    except Exception:
        session.deactivate()
        raise
    if model.pooling_shape.batch_size != settings.decode_batch_size:
        model.close()
        raise QaicConfigError(
            f"the program runs {model.pooling_shape.batch_size} sequences at a time but --max-num-seqs is "
            f"{settings.decode_batch_size}: set --max-num-seqs {model.pooling_shape.batch_size} or recompile"
        )
    log.info("qaic: pooling program ready: %s (%s output)", program, model.pooling_shape.output)
    return model
