"""OCP Microscaling (MX v1.0) MXFP6-E2M3 and MXINT8, plus fp16 rounding, as the device stores them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

BLOCK = 32
"""Elements that share one E8M0 scale (OCP MX v1.0, k = 32)."""

E8M0_BIAS = 127
E8M0_MIN, E8M0_MAX = -127, 127
"""Shared exponents an E8M0 byte can hold (code 255 is NaN and never produced)."""

FP6_EMAX = 2
FP6_MAX = 7.5
INT8_EMAX = 0

MxFormat = Literal["mxfp6", "mxint8"]

_BYTES_PER_ELEMENT: dict[str, float] = {
    "float32": 4.0,
    "float16": 2.0,
    "bfloat16": 2.0,
    "mxfp6": 6 / 8 + 1 / BLOCK,
    "mxint8": 1.0 + 1 / BLOCK,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}


def canonical_precision(precision: str) -> str:
    """Map a precision name or alias ("fp16") to its canonical name ("float16")."""
    name = _ALIASES.get(precision.lower(), precision.lower())
    if name not in _BYTES_PER_ELEMENT:
        known = ", ".join(sorted(_BYTES_PER_ELEMENT))
        raise ValueError(f"unknown precision {precision!r}: use one of {known}")
    return name


def bytes_per_element(precision: str) -> float:
    """Storage bytes per element, shared MX scales included (mxfp6 = 6 bits + 8 bits per 32)."""
    return _BYTES_PER_ELEMENT[canonical_precision(precision)]


def round_fp16(x: np.ndarray, *, saturate: bool = False) -> np.ndarray:
    """Round to the nearest fp16 (ties to even) and return float32; overflow is inf unless saturate.

    ``saturate`` clips finite values to +-65504 and keeps infinities, as exporters clip weights before
    -convert-to-fp16 (masks hold -inf on purpose).
    """
    a = np.asarray(x, dtype=np.float32)
    if saturate:
        a = np.where(np.isinf(a), a, np.clip(a, -65504.0, 65504.0))
    with np.errstate(over="ignore"):
        return a.astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class MxTensor:
    """An MX-encoded tensor: one uint8 code per element and one E8M0 byte per block of 32."""

    fmt: MxFormat
    codes: np.ndarray
    """uint8, shape (..., n_blocks, 32): the tensor with ``axis`` moved last and padded to 32."""
    scales: np.ndarray
    """uint8 E8M0 biased exponents, shape (..., n_blocks)."""
    shape: tuple[int, ...]
    axis: int

    @property
    def nbytes(self) -> float:
        """Real storage: fp6 codes packed at 6 bits, int8 at 8 bits, plus one byte per block."""
        bits = 6 if self.fmt == "mxfp6" else 8
        return self.codes.size * bits / 8 + self.scales.size


def _blocks(x: np.ndarray, axis: int) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Move ``axis`` last, zero-pad it to a multiple of 32 and split it into blocks (float64)."""
    a = np.asarray(x)
    if a.ndim == 0:
        raise ValueError("MX quantization needs at least one dimension; reshape the scalar to (1,)")
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"MX quantization takes floating-point arrays, got dtype {a.dtype}")
    ax = axis % a.ndim if -a.ndim <= axis < a.ndim else None
    if ax is None:
        raise ValueError(f"axis {axis} is out of range for an array of {a.ndim} dimensions")
    if not np.all(np.isfinite(a)):
        raise ValueError("MX formats cannot encode inf or NaN; clean the tensor before quantizing")
    moved = np.moveaxis(a.astype(np.float64), ax, -1)
    n = moved.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], pad))], axis=-1)
    return moved.reshape(*moved.shape[:-1], -1, BLOCK), a.shape, ax


def _unblock(values: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Inverse of ``_blocks``: drop the padding and put ``axis`` back."""
    flat = values.reshape(*values.shape[:-2], -1)[..., : shape[axis]]
    return np.moveaxis(flat, -1, axis).astype(np.float32)


def _shared_exponent(blocks: np.ndarray, emax_elem: int) -> np.ndarray:
    """floor(log2(max |x|)) - emax_elem per block, clamped to E8M0; all-zero blocks get the minimum."""
    amax = np.abs(blocks).max(axis=-1)
    _, e = np.frexp(amax)  # amax = m * 2**e with m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = np.where(amax > 0, e.astype(np.int64) - 1 - emax_elem, E8M0_MIN)
    return np.clip(shared, E8M0_MIN, E8M0_MAX)


def _fp6_round(y: np.ndarray) -> np.ndarray:
    """Round scaled values to the E2M3 grid (ties to even) and clamp to +-7.5."""
    mag = np.abs(y)
    _, e = np.frexp(mag)
    binade = np.clip(e.astype(np.int64) - 1, 0, FP6_EMAX)  # exponent 0 also covers the subnormals
    step = np.ldexp(1.0, binade - 3)
    q = np.rint(mag / step) * step
    return np.copysign(np.minimum(q, FP6_MAX), y)


def _int8_round(y: np.ndarray) -> np.ndarray:
    """Round scaled values to k/64 (ties to even), k clamped to the int8 range."""
    return np.clip(np.rint(y * 64.0), -128, 127)


def encode_mxfp6(x: np.ndarray, axis: int = -1) -> MxTensor:
    """Encode to MXFP6 E2M3: code = sign<<5 | exponent<<3 | mantissa, one E8M0 scale per 32."""
    blocks, shape, ax = _blocks(x, axis)
    shared = _shared_exponent(blocks, FP6_EMAX)
    q = _fp6_round(np.ldexp(blocks, -shared[..., None]))
    mag = np.abs(q)
    _, e = np.frexp(mag)
    normal = mag >= 1.0
    exp_field = np.where(normal, e.astype(np.int64), 0)  # biased exponent: unbiased + 1
    mant = np.where(normal, np.ldexp(mag, 4 - exp_field) - 8, mag * 8).astype(np.int64)
    sign = np.signbit(q).astype(np.int64) & (mag > 0)
    codes = (sign << 5 | exp_field << 3 | mant).astype(np.uint8)
    return MxTensor("mxfp6", codes, (shared + E8M0_BIAS).astype(np.uint8), shape, ax)


def encode_mxint8(x: np.ndarray, axis: int = -1) -> MxTensor:
    """Encode to MXINT8: two's-complement codes k (value k/64), one E8M0 scale per 32."""
    blocks, shape, ax = _blocks(x, axis)
    shared = _shared_exponent(blocks, INT8_EMAX)
    k = _int8_round(np.ldexp(blocks, -shared[..., None]))
    return MxTensor(
        "mxint8", k.astype(np.int8).view(np.uint8), (shared + E8M0_BIAS).astype(np.uint8), shape, ax
    )


def update(prev: MxTensor, x: np.ndarray) -> MxTensor:
    """``x`` encoded in ``prev``'s format, keeping ``prev``'s codes and scale in every block whose values
    did not change: data a run does not write stays as stored, as on the device.

    Encoding is not idempotent (a block whose -2.0 code decodes to a power of two gets a larger scale
    when encoded again), so encoding the whole buffer after every run would drift retained state
    that no run wrote, and a sequence's KV would depend on how many runs it sat through.
    """
    new = encode_mxint8(x, prev.axis) if prev.fmt == "mxint8" else encode_mxfp6(x, prev.axis)
    if new.codes.shape != prev.codes.shape:
        return new
    old_blocks, _, _ = _blocks(decode(prev), prev.axis)
    new_blocks, _, _ = _blocks(np.asarray(x, dtype=np.float32), prev.axis)
    same = np.all(old_blocks == new_blocks, axis=-1)
    codes = np.where(same[..., None], prev.codes, new.codes)
    scales = np.where(same, prev.scales, new.scales)
    return MxTensor(new.fmt, codes, scales, new.shape, new.axis)


def _scale(t: MxTensor) -> np.ndarray:
    return np.ldexp(1.0, t.scales.astype(np.int64) - E8M0_BIAS)[..., None]


def decode_mxfp6(t: MxTensor) -> np.ndarray:
    """Decode MXFP6 E2M3 codes and scales back to float32 in the original shape."""
    if t.fmt != "mxfp6":
        raise ValueError(f"decode_mxfp6 got an {t.fmt} tensor; use decode() to dispatch on the format")
    c = t.codes.astype(np.int64)
    sign = np.where(c >> 5 & 1, -1.0, 1.0)
    exp_field, mant = c >> 3 & 3, c & 7
    mag = np.where(exp_field == 0, mant / 8.0, np.ldexp(1.0 + mant / 8.0, exp_field - 1))
    return _unblock(sign * mag * _scale(t), t.shape, t.axis)


def decode_mxint8(t: MxTensor) -> np.ndarray:
    """Decode MXINT8 codes and scales back to float32 in the original shape."""
    if t.fmt != "mxint8":
        raise ValueError(f"decode_mxint8 got an {t.fmt} tensor; use decode() to dispatch on the format")
    k = t.codes.view(np.int8).astype(np.float64)
    return _unblock(k / 64.0 * _scale(t), t.shape, t.axis)


def decode(t: MxTensor) -> np.ndarray:
    """Decode any MX tensor to float32."""
    return decode_mxfp6(t) if t.fmt == "mxfp6" else decode_mxint8(t)


def quantize_mxfp6(w: np.ndarray, axis: int = -1) -> np.ndarray:
    """Quantize-dequantize to MXFP6 E2M3 (what an -mxfp6-matmul weight holds on the device)."""
    blocks, shape, ax = _blocks(w, axis)
    shared = _shared_exponent(blocks, FP6_EMAX)[..., None]
    return _unblock(np.ldexp(_fp6_round(np.ldexp(blocks, -shared)), shared), shape, ax)


def quantize_mxint8(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Quantize-dequantize to MXINT8 (what an mxint8 KV cache holds on the device)."""
    blocks, shape, ax = _blocks(x, axis)
    shared = _shared_exponent(blocks, INT8_EMAX)[..., None]
    return _unblock(np.ldexp(_int8_round(np.ldexp(blocks, -shared)) / 64.0, shared), shape, ax)
