"""The ``aot`` path's own model loaders (``hf``, ``qpc``) and session factory (``qaicrt``).

They are registered from :mod:`qaic_aot.plugin` through the hooks ``qaic_model_loaders`` and
``qaic_session_factories``; :mod:`qaic_aot.compose` picks one of each by name when a model opens.
Everything heavy is imported on use, so loading the plugin stays free of torch and onnx.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from qaic_core.execution import GENERATE, ExecutionConfig

if TYPE_CHECKING:
    from qaic_aot.session import QAICInferenceSession
    from qaic_core.session import SessionRequest

log = logging.getLogger("qaic.aot")

HF_LOADER = "hf"
QPC_LOADER = "qpc"
QAICRT_SESSION = "qaicrt"


def compiles(config: ExecutionConfig) -> bool:
    """The ``hf`` loader applies when no prebuilt program is given."""
    return config.qpc_path is None


def has_prebuilt(config: ExecutionConfig) -> bool:
    """The ``qpc`` loader applies when a prebuilt program is given (``qpc_path``)."""
    return config.qpc_path is not None


def load_checkpoint(config: ExecutionConfig) -> Path:
    """Export and compile the Hugging Face checkpoint for the configured shapes (cached); the QPC directory."""
    if config.task != GENERATE:
        from qaic_aot import pooling

        return pooling.compile_program(config)
    from qaic_aot.compile import compile_model

    settings = config.settings
    log.info(
        "qaic: compiling %s for full_batch_size=%d ctx_len=%d prefill_seq_len=%d (cached after the first time)",
        config.model_dir,
        settings.decode_batch_size,
        settings.ctx_len,
        settings.prefill_seq_len,
    )
    return Path(compile_model(config.model_dir, settings, backend=config.device, progress=config.progress))


def load_prebuilt(config: ExecutionConfig) -> Path:
    """The prebuilt QPC of ``qpc_path``; a causal LM's is checked against the model and the shapes."""
    if config.qpc_path is None:
        from qaic_core.errors import QaicConfigError

        raise QaicConfigError("the qpc model loader loads a prebuilt program: give qpc_path")
    qpc_dir = Path(config.qpc_path)
    if config.task == GENERATE:
        from qaic_aot.validate import validate_qpc

        log.info("qaic: checking the prebuilt QPC %s against %s", qpc_dir, config.model_dir)
        validate_qpc(qpc_dir, config.model_dir, config.settings, backend=config.device)
    return qpc_dir


def open_runtime_session(request: SessionRequest) -> QAICInferenceSession:
    """QEfficient's ``QAICInferenceSession`` surface over the backend's ``qaicrt``-compatible runtime."""
    from qaic_aot.session import QAICInferenceSession

    return QAICInferenceSession(
        request.program,
        device_ids=list(request.device_ids) if request.device_ids else None,
        backend=request.backend,
        enable_debug_logs=request.enable_debug_logs,
        num_exec_objects=request.num_exec_objects,
    )
