"""Core of the qaic stack: hook specs, plugin manager, shared types and QPC layout."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"
PROJECT_NAME = "qaic"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for plugin implementations of the hooks in :mod:`qaic_core.hookspecs`."""

from qaic_core import env, qpc, settings, types  # noqa: E402
from qaic_core.descriptors import (  # noqa: E402
    AttentionBackend,
    DeviceBackend,
    ModelLoader,
    SessionBackend,
)
from qaic_core.errors import (  # noqa: E402
    QaicBackendNotFoundError,
    QaicConfigError,
    QaicError,
    QaicPluginError,
)
from qaic_core.manager import QaicPluginManager, get_plugin_manager  # noqa: E402

__all__ = [
    "PROJECT_NAME",
    "AttentionBackend",
    "DeviceBackend",
    "ModelLoader",
    "QaicBackendNotFoundError",
    "QaicConfigError",
    "QaicError",
    "QaicPluginError",
    "QaicPluginManager",
    "SessionBackend",
    "__version__",
    "env",
    "get_plugin_manager",
    "hookimpl",
    "qpc",
    "settings",
    "types",
]
