"""How the ``aot`` path opens a model: a model loader and a session factory, each chosen by name.

The loader (``ExecutionConfig.loader``, ``QAIC_MODEL_LOADER``, else the best applicable one of
kinds ``hf_checkpoint`` / ``qpc``) gives a program directory; the session factory
(``ExecutionConfig.session``, ``QAIC_SESSION_FACTORY``, else ``qaicrt``) opens it on the device group.
"""

from __future__ import annotations

import logging
from pathlib import Path

from qaic_aot.iodesc import program_dir
from qaic_core import get_plugin_manager
from qaic_core import qpc as layout
from qaic_core.descriptors import PROGRAM_KINDS
from qaic_core.errors import QaicPluginError
from qaic_core.execution import ExecutionConfig
from qaic_core.runtime import missing_members
from qaic_core.session import DeviceSession, SessionRequest

log = logging.getLogger("qaic.aot")

PATH = "aot"


def load_program(config: ExecutionConfig) -> Path:
    """The QPC directory the selected model loader gives for ``config``."""
    loader = get_plugin_manager().select_model_loader(config, PROGRAM_KINDS, PATH)
    loaded = loader.load(config)
    if not isinstance(loaded, str | Path):
        raise QaicPluginError(
            f"model loader {loader.name!r} ({loader.package}) loads {loader.kind} but returned a "
            f"{type(loaded).__name__}, not a program directory: fix the plugin or name another loader"
        )
    qpc_dir = Path(loaded)
    if not (program_dir(qpc_dir) / layout.PROGRAM_FILE).is_file():
        raise QaicPluginError(
            f"model loader {loader.name!r} ({loader.package}) returned {qpc_dir}, which holds no "
            f"{layout.PROGRAM_FILE}: fix the plugin or name another loader"
        )
    log.info("qaic: model loader %s gave the program %s", loader.name, qpc_dir)
    return qpc_dir


def open_session(config: ExecutionConfig, qpc_dir: Path) -> DeviceSession:
    """The program of ``qpc_dir`` loaded and activated by the selected session factory."""
    factory = get_plugin_manager().select_session_factory(config.session)
    group = config.settings.device_group
    request = SessionRequest(
        program=program_dir(qpc_dir),
        backend=config.device,
        device_ids=tuple(group) if group else None,
        enable_debug_logs=config.options.enable_debug_logs,
    )
    session = factory.open(request)
    missing = missing_members(session, DeviceSession)
    if missing:
        raise QaicPluginError(
            f"session factory {factory.name!r} ({factory.package}) opened a {type(session).__name__} "
            f"that lacks {', '.join(missing)} of qaic_core.session.DeviceSession: fix the plugin"
        )
    return session
