# mypy: disable-error-code="empty-body"
"""Hook specifications of the qaic plugin system.

Every hook returns a sequence of small frozen descriptors (see :mod:`qaic_core.descriptors`).
Descriptors are selected by name, never by the order in which plugins were registered.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from qaic_core.descriptors import AttentionBackend, DeviceBackend, ModelLoader, SessionBackend

hookspec = pluggy.HookspecMarker("qaic")


@hookspec
def qaic_device_backends() -> Sequence[DeviceBackend]:
    """Return the device backends this plugin provides.

    A device backend enumerates devices, exposes a ``qaicrt``-compatible runtime module and
    optionally a compiler that takes ``qaic-compile`` arguments. Names must be unique across
    all installed plugins (for example ``sim`` or ``qaicrt``).
    """


@hookspec
def qaic_session_backends() -> Sequence[SessionBackend]:
    """Return session factories: callables that open a session over a compiled program (QPC).

    A session follows :class:`qaic_core.session.QaicSession` (QEfficient's
    ``QAICInferenceSession`` surface).
    """


@hookspec
def qaic_attention_backends() -> Sequence[AttentionBackend]:
    """Return attention implementations for the eager path, each named and given by class path."""


@hookspec
def qaic_model_loaders() -> Sequence[ModelLoader]:
    """Return model loaders: each names the architectures it supports and how to load them."""
