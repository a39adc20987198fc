"""Shared types that mirror the real runtime's records (IoDesc bindings, device resources)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class QStatus(enum.IntEnum):
    """The runtime's status codes (``qaicrt.QStatus``).

    The real module spells them ``QS_SUCCESS``, ``QS_NOMEM``, ...; those names are aliases here, so
    iteration and ``.name`` give the plain names.
    """

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


class BufferType(enum.IntEnum):
    """IoDesc buffer types. BFLOAT16 = 11 is unverified on real SDKs and travels as fp16."""

    FLOAT = 0
    FLOAT_16 = 1
    INT8_Q = 2
    UINT8_Q = 3
    INT16_Q = 4
    INT32_Q = 5
    INT32_I = 6
    INT64_I = 7
    INT8 = 8
    BFLOAT16 = 11


BUFFER_DTYPES: dict[BufferType, np.dtype] = {
    BufferType.FLOAT: np.dtype(np.float32),
    BufferType.FLOAT_16: np.dtype(np.float16),
    BufferType.INT8_Q: np.dtype(np.int8),
    BufferType.UINT8_Q: np.dtype(np.uint8),
    BufferType.INT16_Q: np.dtype(np.int16),
    BufferType.INT32_Q: np.dtype(np.int32),
    BufferType.INT32_I: np.dtype(np.int32),
    BufferType.INT64_I: np.dtype(np.int64),
    BufferType.INT8: np.dtype(np.bool_),
    BufferType.BFLOAT16: np.dtype(np.float16),
}


class Direction(enum.IntEnum):
    IN = 0
    OUT = 1


class SkuType(enum.StrEnum):
    """Card SKUs and the figures per SoC (QID) from the public product briefs."""

    STANDARD = "standard"
    PRO = "pro"
    ULTRA = "ultra"
    AI080_ULTRA = "ai080-ultra"


@dataclass(frozen=True)
class SkuSpec:
    """Per-card figures; ``*_per_soc`` values apply to each QID of the card."""

    sku: SkuType
    socs: int
    nsp_per_soc: int
    dram_mb_per_soc: int
    ddr_gbps_per_soc: float
    sram_mb_per_soc: int
    fp16_tflops_card: float
    int8_tops_card: float
    tdp_w: int


SKUS: dict[SkuType, SkuSpec] = {
    SkuType.STANDARD: SkuSpec(SkuType.STANDARD, 1, 16, 16 * 1024, 137.0, 126, 110.0, 325.0, 75),
    SkuType.PRO: SkuSpec(SkuType.PRO, 1, 16, 32 * 1024, 137.0, 144, 125.0, 375.0, 75),
    SkuType.ULTRA: SkuSpec(SkuType.ULTRA, 4, 16, 32 * 1024, 137.0, 144, 290.0, 870.0, 150),
    SkuType.AI080_ULTRA: SkuSpec(SkuType.AI080_ULTRA, 4, 8, 32 * 1024, 137.0, 144, 145.0, 435.0, 150),
}
"""AI 080 Ultra compute figures are half the Ultra's (8 of 16 NSPs): a stated assumption."""


@dataclass(frozen=True)
class DeviceInfo:
    """One QID's identity and resources, as ``Util.getResourceInfo`` reports them (MB)."""

    qid: int
    sku: SkuType
    card: int
    nsp_total: int
    nsp_free: int
    dram_total_mb: int
    dram_free_mb: int
    pci_vendor: int = 0x17CB
    pci_device: int = 0xA100


@dataclass(frozen=True)
class Binding:
    """One IoDesc binding (name, index, type, direction, dims, size in bytes)."""

    name: str
    index: int
    type: BufferType
    dir: Direction
    dims: tuple[int, ...]
    size: int
    quant_scale: float = 0.0
    quant_offset: int = 0
    is_partial_buf_allowed: bool = False

    @property
    def dtype(self) -> np.dtype:
        return BUFFER_DTYPES[self.type]


@dataclass(frozen=True)
class Specialization:
    """A named set of symbol values the compiled program accepts (one static shape set)."""

    name: str
    symbols: dict[str, int]

    def get(self, key: str, default: int | None = None) -> int | None:
        return self.symbols.get(key, default)
