"""Core of the qaic stack: hook specs, plugin manager, shared types and QPC layout."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"
PROJECT_NAME = "qaic"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for plugin implementations of the hooks in :mod:`qaic_core.hookspecs`."""

from qaic_core import env, execution, observe, qpc, settings, types  # noqa: E402
from qaic_core.descriptors import (  # noqa: E402
    AttentionBackend,
    DeviceBackend,
    ExecutionPath,
    ModelLoader,
    SessionFactory,
)
from qaic_core.errors import (  # noqa: E402
    QaicBackendNotFoundError,
    QaicConfigError,
    QaicError,
    QaicPluginError,
)
from qaic_core.manager import (  # noqa: E402
    QaicPluginManager,
    get_plugin_manager,
    new_plugin_manager,
    reset_plugin_manager,
)

__all__ = [
    "PROJECT_NAME",
    "AttentionBackend",
    "DeviceBackend",
    "ExecutionPath",
    "ModelLoader",
    "QaicBackendNotFoundError",
    "QaicConfigError",
    "QaicError",
    "QaicPluginError",
    "QaicPluginManager",
    "SessionFactory",
    "__version__",
    "env",
    "execution",
    "get_plugin_manager",
    "hookimpl",
    "new_plugin_manager",
    "observe",
    "qpc",
    "reset_plugin_manager",
    "settings",
    "types",
]
