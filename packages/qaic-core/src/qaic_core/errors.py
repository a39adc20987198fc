"""Exception types shared by every qaic package."""

from __future__ import annotations


class QaicError(Exception):
    """Base class of every error raised by the qaic stack."""


class QaicConfigError(QaicError, ValueError):
    """A setting is invalid; the message names the setting, the limit and the fix."""


class QaicPluginError(QaicError):
    """A plugin failed to load, or two plugins registered the same name."""


class QaicBackendNotFoundError(QaicError, LookupError):
    """The requested backend is not installed or not available on this machine."""


class QaicRuntimeError(QaicError, RuntimeError):
    """A runtime call returned a failing status; ``status`` holds the QStatus code."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
