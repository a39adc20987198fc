# mypy: disable-error-code="empty-body"
"""Hook specifications of the qaic plugin system.

Most hooks return a sequence of small frozen descriptors (see :mod:`qaic_core.descriptors`).
Descriptors are selected by name, never by the order in which plugins were registered.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from qaic_core.descriptors import (
    AttentionBackend,
    DeviceBackend,
    ExecutionPath,
    ModelLoader,
    SessionFactory,
)
from qaic_core.observe import Observer

hookspec = pluggy.HookspecMarker("qaic")


@hookspec
def qaic_device_backends() -> Sequence[DeviceBackend]:
    """Return the device backends this plugin provides.

    A device backend enumerates devices, exposes a ``qaicrt``-compatible runtime module and
    optionally a compiler that takes ``qaic-compile`` arguments. Names must be unique across
    all installed plugins (for example ``sim`` or ``qaicrt``).
    """


@hookspec
def qaic_execution_paths() -> Sequence[ExecutionPath]:
    """Return execution paths: named ways to open a step model (``aot``, ``pyt``).

    A serving runner selects a path by name and drives the step model it opens through the
    Protocols in :mod:`qaic_core.execution`; it never imports the package behind the path.
    """


@hookspec
def qaic_model_loaders() -> Sequence[ModelLoader]:
    """Return model loaders: named ways to load a model for an execution path.

    Each declares the kind it loads (``hf_checkpoint``, ``qpc``, ``vllm_classes``; see
    :data:`qaic_core.descriptors.LOADER_KINDS`). A path takes the loader named by
    ``ExecutionConfig.loader`` or ``QAIC_MODEL_LOADER``, else its best applicable one.
    """


@hookspec
def qaic_session_factories() -> Sequence[SessionFactory]:
    """Return session factories: named device-session implementations over a backend's runtime.

    The ``aot`` path opens its program through the factory named by ``ExecutionConfig.session``
    or ``QAIC_SESSION_FACTORY``, else the best available one (``qaicrt``).
    """


@hookspec
def qaic_attention_backends() -> Sequence[AttentionBackend]:
    """Return attention implementations for the eager path, each named and given by class path."""


@hookspec
def qaic_observers() -> Sequence[Observer]:
    """Return observers of device runs and serving steps (benchmarks, tests, profilers)."""
