"""Runtime status codes (shared with qaic-core), log levels and the internal failure type."""

from __future__ import annotations

import enum

from qaic_core.types import QStatus

__all__ = ["Failure", "QLogLevel", "QStatus"]


class QLogLevel(enum.IntEnum):
    """Runtime log levels accepted by ``Context.setLogLevel``."""

    QL_DEBUG = 0
    QL_INFO = 1
    QL_WARN = 2
    QL_ERROR = 3


class Failure(Exception):
    """Internal: a call fails with ``status``; the message is logged and kept as ``lastError``."""

    def __init__(self, status: QStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
