"""MXINT8 (OCP Microscaling v1.0) codes and scales: how an mxint8 KV cache travels between instances.

An mxint8 KV cache crosses the host boundary as float16 values that already lie on the MXINT8
grid (the device decodes its stored blocks). Encoding them again gives back the device's codes:
one int8 code ``k`` per value (value ``k / 64 * 2**e``) and one E8M0 exponent ``e`` per 32 values
along the last axis (``head_dim``). That is 1 + 1/32 bytes per value on the wire instead of 2,
and decoding restores the very same float16 values: the hand-off adds no error of its own.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BLOCK = 32
E8M0_BIAS = 127
E_MIN, E_MAX = -127, 127


def _blocks(x: np.ndarray) -> np.ndarray:
    """``x`` as float32 with the last axis zero-padded to a multiple of 32 and split in blocks."""
    a = np.asarray(x, dtype=np.float32)
    pad = (-a.shape[-1]) % BLOCK
    if pad:
        a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), np.float32)], axis=-1)
    return a.reshape(*a.shape[:-1], -1, BLOCK)


def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes (int8, last axis padded to 32) and biased exponents (uint8, one per block of 32)."""
    blocks = _blocks(x)
    if not np.all(np.isfinite(blocks)):
        raise ValueError("an mxint8 KV cache cannot hold inf or NaN")
    amax = np.abs(blocks).max(axis=-1)
    mant, e = np.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = np.clip(np.where(amax > 0, e.astype(np.int32) - 1, E_MIN), E_MIN, E_MAX)
    # A block whose largest magnitude is a power of two may be code -128 one exponent lower: keep it there.
    edge = np.flatnonzero((mant == 0.5) & (shared > E_MIN))
    if edge.size:
        flat_blocks = blocks.reshape(-1, BLOCK)
        flat_shared = shared.reshape(-1)
        lower = flat_blocks[edge] * _pow2(-(flat_shared[edge] - 1))[:, None] * np.float32(64)
        fits = np.all((lower == np.rint(lower)) & (lower >= -128) & (lower <= 127), axis=-1)
        flat_shared[edge[fits]] -= 1
    scaled = blocks * (_pow2(-shared) * np.float32(64))[..., None]
    k = np.clip(np.rint(scaled, out=scaled), -128, 127, out=scaled).astype(np.int8)
    codes = k.reshape(*k.shape[:-2], -1)
    return codes, (shared + E8M0_BIAS).astype(np.uint8)


def decode(codes: np.ndarray, scales: np.ndarray, width: int, dtype: npt.DTypeLike) -> np.ndarray:
    """Values from codes and exponents, the last axis cut back to ``width``, as ``dtype``."""
    k = codes.reshape(*codes.shape[:-1], -1, BLOCK).astype(np.float32)
    k *= (_pow2(scales.astype(np.int32) - E8M0_BIAS) / np.float32(64))[..., None]
    return k.reshape(*k.shape[:-2], -1)[..., :width].astype(dtype)


def _pow2(exponents: np.ndarray) -> np.ndarray:
    """2**e as float32, exactly (E8M0's range, subnormals included)."""
    return np.ldexp(np.float32(1), exponents.astype(np.int32)).astype(np.float32)


def wire_bytes(shape: tuple[int, ...]) -> int:
    """Bytes the codes and exponents of an array of ``shape`` take."""
    padded = -(-shape[-1] // BLOCK) * BLOCK
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows * (padded + padded // BLOCK)
