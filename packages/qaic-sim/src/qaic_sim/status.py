"""``QStatus`` with the runtime's values under both spellings (``SUCCESS`` and ``QS_SUCCESS``)."""

from __future__ import annotations

import enum
import logging

from qaic_core.types import QStatus as CoreStatus

log = logging.getLogger("qaic.sim.runtime")


class QStatus(enum.IntEnum):
    """Runtime status codes; ``QS_*`` names are aliases of the plain ones."""

    SUCCESS = 0
    PERM = 1
    AGAIN = 2
    NOMEM = 3
    BUSY = 4
    NODEV = 5
    INVAL = 6
    NOSPC = 7
    BADFD = 8
    TIMEDOUT = 9
    PROTOCOL = 10
    UNSUPPORTED = 11
    DATA_CRC_ERROR = 12
    DEV_ERROR = 300
    ERROR = 500
    QS_SUCCESS = 0
    QS_PERM = 1
    QS_AGAIN = 2
    QS_NOMEM = 3
    QS_BUSY = 4
    QS_NODEV = 5
    QS_INVAL = 6
    QS_NOSPC = 7
    QS_BADFD = 8
    QS_TIMEDOUT = 9
    QS_PROTOCOL = 10
    QS_UNSUPPORTED = 11
    QS_DATA_CRC_ERROR = 12
    QS_DEV_ERROR = 300
    QS_ERROR = 500


assert {s.name: s.value for s in QStatus} == {s.name: s.value for s in CoreStatus}


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
