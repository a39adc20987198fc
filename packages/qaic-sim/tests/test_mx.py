"""MX formats against hand-computed encodings, a brute-force nearest-value reference and proven bounds."""

from __future__ import annotations

import numpy as np
import pytest

from qaic_sim import mx

E2M3_MAGNITUDES = (
    [i / 8 for i in range(8)]  # subnormals: 0.mmm * 2^0
    + [1 + i / 8 for i in range(8)]  # exponent 0
    + [2 + i / 4 for i in range(8)]  # exponent 1
    + [4 + i / 2 for i in range(8)]  # exponent 2, max 7.5
)


def block(*values: float) -> np.ndarray:
    """One 32-element block: the given values followed by zeros."""
    out = np.zeros(32, dtype=np.float32)
    out[: len(values)] = values
    return out


def test_fp6_code_table_is_e2m3() -> None:
    codes = np.arange(64, dtype=np.uint8).reshape(2, 32)
    t = mx.MxTensor("mxfp6", codes, np.array([127, 127], dtype=np.uint8), (64,), 0)
    values = mx.decode(t)
    assert values[:32].tolist() == E2M3_MAGNITUDES
    assert values[32:].tolist() == [-v for v in E2M3_MAGNITUDES]


def test_fp6_hand_computed_block_with_ties() -> None:
    # max 6.0: floor(log2 6) = 2, shared exponent 2 - emax 2 = 0, so values sit on the E2M3 grid itself.
    x = block(6.0, 0.0625, 0.1875, 1.0625, 1.1875, 2.125, 5.25, 5.75, -6.0, 7.5, 0.3, 0.04)
    t = mx.encode_mxfp6(x)
    assert t.scales.tolist() == [127]
    expected = block(6.0, 0.0, 0.25, 1.0, 1.25, 2.0, 5.0, 6.0, -6.0, 7.5, 0.25, 0.0)
    np.testing.assert_array_equal(mx.quantize_mxfp6(x), expected)
    # 6.0 = 1.100b * 2^2: biased exponent 3, mantissa 4; sign bit is 0b100000.
    assert t.codes[0, :12].tolist() == [28, 0, 2, 8, 10, 16, 26, 28, 60, 31, 2, 0]


def test_fp6_shared_scale_and_clamp() -> None:
    # max 100: floor(log2 100) = 6, shared 4 (scale 16, E8M0 code 131); 100/16 = 6.25 ties to 6.0 -> 96;
    # -3/16 = -0.1875 ties to -0.25 (even code 2) -> -4; 1/16 = 0.0625 ties to 0.
    x = block(100.0, -3.0, 1.0)
    t = mx.encode_mxfp6(x)
    assert t.scales.tolist() == [131]
    np.testing.assert_array_equal(mx.decode(t), block(96.0, -4.0, 0.0))
    # 7.9 is in [4, 8): shared 0, rounds to 8.0 which clamps to the max normal 7.5.
    np.testing.assert_array_equal(mx.quantize_mxfp6(block(7.9, -7.8)), block(7.5, -7.5))


def test_zero_block_and_padding() -> None:
    x = np.concatenate([np.arange(32, dtype=np.float32), np.zeros(32), [3.0] * 8]).astype(np.float32)
    t = mx.encode_mxfp6(x)
    assert t.codes.shape == (3, 32) and t.scales.shape == (3,)
    assert t.scales[1] == 0  # all-zero block: smallest scale, all codes zero
    assert not t.codes[1].any() and not t.codes[2, 8:].any()
    assert t.nbytes == 96 * 0.75 + 3
    np.testing.assert_array_equal(mx.decode(t)[64:], [3.0] * 8)
    assert mx.decode(t).shape == (72,)


def test_axis_handling_matches_transpose() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(70, 5)).astype(np.float32)
    np.testing.assert_array_equal(mx.quantize_mxfp6(w, axis=0), mx.quantize_mxfp6(w.T).T)
    np.testing.assert_array_equal(mx.quantize_mxint8(w, axis=0), mx.quantize_mxint8(w.T).T)
    t = mx.encode_mxint8(w, axis=0)
    assert t.codes.shape == (5, 3, 32) and mx.decode_mxint8(t).shape == (70, 5)


@pytest.mark.parametrize("shape,axis", [((1000,), -1), ((7, 33, 4), 1), ((3, 64), 0), ((2, 2, 95), -1)])
def test_round_trip_equals_quantize(shape: tuple[int, ...], axis: int) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_t(2, size=shape) * 10.0 ** rng.integers(-6, 6, size=shape)).astype(np.float32)
    np.testing.assert_array_equal(mx.decode(mx.encode_mxfp6(x, axis)), mx.quantize_mxfp6(x, axis))
    np.testing.assert_array_equal(mx.decode(mx.encode_mxint8(x, axis)), mx.quantize_mxint8(x, axis))


def test_fp6_is_nearest_representable_ties_to_even() -> None:
    """Brute force: every element is the nearest of the 64 decoded codes at the block's scale."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, 32)) * 2.0 ** rng.integers(-20, 20, size=(400, 1))
    x[:, 5] = np.round(x[:, 5] * 16) / 16  # plenty of exact ties
    t = mx.encode_mxfp6(x)
    grid = np.array(E2M3_MAGNITUDES + [-v for v in E2M3_MAGNITUDES])
    grid_codes = np.arange(64)
    scale = np.ldexp(1.0, t.scales.astype(int) - 127)  # (400, 1): one block per row
    y = x / scale
    dist = np.abs(y[..., None] - grid)
    best = dist.min(axis=-1, keepdims=True)
    # among equally near codes prefer an even mantissa (code LSB 0); beyond 7.5 the clamp is nearest
    candidates = np.where(np.isclose(dist, best, rtol=0, atol=1e-12), grid_codes, 1000)
    even = np.where(candidates % 2 == 0, candidates, 1000).min(axis=-1)
    chosen = np.where(even < 1000, even, candidates.min(axis=-1))
    np.testing.assert_array_equal(np.abs(mx.decode(t)), np.abs(grid[chosen] * scale))


def test_int8_hand_computed() -> None:
    # max 1.5: shared 0; 3/128 * 64 = 1.5 ties to 2; 2.5/128 * 64 = 1.25 rounds to 1.
    x = block(1.5, 3 / 128, 2.5 / 128, -1.0, -1.999)
    t = mx.encode_mxint8(x)
    assert t.scales.tolist() == [127]
    assert t.codes[0, :5].tolist() == [96, 2, 1, 192, 128]
    np.testing.assert_array_equal(mx.decode_mxint8(t), block(1.5, 2 / 64, 1 / 64, -1.0, -2.0))
    # 1.999 * 64 rounds to 128, which clamps to 127; max 3.0 gives shared 1 (E8M0 128).
    np.testing.assert_array_equal(mx.quantize_mxint8(block(1.999)), block(127 / 64))
    assert mx.encode_mxint8(block(3.0, 1.0)).scales.tolist() == [128]
    np.testing.assert_array_equal(mx.quantize_mxint8(block(3.0, 1.0)), block(3.0, 1.0))
    assert t.nbytes == 32 + 1


def test_error_bounds_hold_and_are_tight() -> None:
    """|q - x| <= max|block| / 16 (mxfp6) and <= max|block| / 128 (mxint8); normals within 2^-4 relative."""
    rng = np.random.default_rng(3)
    x = rng.standard_t(3, size=(2000, 32)) * 2.0 ** rng.integers(-30, 30, size=(2000, 1))
    bmax = np.abs(x).max(axis=1, keepdims=True)
    err6 = np.abs(mx.quantize_mxfp6(x).astype(np.float64) - x)
    err8 = np.abs(mx.quantize_mxint8(x).astype(np.float64) - x)
    ratio6, ratio8 = (err6 / bmax).max(), (err8 / bmax).max()
    assert ratio6 <= 2**-4 and ratio6 > 0.9 * 2**-4
    assert ratio8 <= 2**-7 and ratio8 > 0.9 * 2**-7
    shared = np.floor(np.log2(bmax)) - 2
    normal = np.abs(x) >= 2.0**shared
    assert (err6[normal] / np.abs(x[normal])).max() <= 2**-4


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="inf or NaN"):
        mx.quantize_mxfp6(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="axis 2"):
        mx.quantize_mxint8(np.ones((2, 2)), axis=2)
    with pytest.raises(TypeError, match="floating-point"):
        mx.quantize_mxfp6(np.arange(4))
    with pytest.raises(ValueError, match="unknown precision"):
        mx.bytes_per_element("int4")


def test_tiny_values_clamp_the_scale() -> None:
    t = mx.encode_mxint8(block(1e-40))
    assert t.scales.tolist() == [0]  # 2^-133 is below E8M0's 2^-127: the scale clamps, the element rounds
    assert mx.decode(t)[0] == pytest.approx(2.0**-127 / 64 * round(1e-40 * 2.0**127 * 64))


def test_fp16_and_bytes_per_element() -> None:
    x = np.array([1.0 + 2**-11, 1.0 + 3 * 2**-11, 70000.0, 1e-8], dtype=np.float32)
    out = mx.round_fp16(x)
    assert out.dtype == np.float32
    assert out[0] == 1.0 and out[1] == 1.0 + 2**-9  # ties to even at the fp16 ulp (2^-10)
    assert np.isinf(out[2]) and mx.round_fp16(x, saturate=True)[2] == 65504.0
    assert mx.round_fp16(np.array([-np.inf, -1e9]), saturate=True).tolist() == [-np.inf, -65504.0]
    assert out[3] == np.float32(np.float16(1e-8))  # fp16 subnormal
    assert mx.bytes_per_element("float32") == 4 and mx.bytes_per_element("fp16") == 2
    assert mx.bytes_per_element("mxfp6") == 0.78125 and mx.bytes_per_element("mxint8") == 1.03125


def test_large_weights_round_trip_through_storage() -> None:
    """A 100k-weight matrix (speed is measured by benchmarks, not asserted here)."""
    w = np.random.default_rng(4).normal(size=(100, 1000)).astype(np.float32)
    np.testing.assert_array_equal(mx.decode(mx.encode_mxfp6(w)), mx.quantize_mxfp6(w))
    np.testing.assert_array_equal(mx.decode_mxint8(mx.encode_mxint8(w)), mx.quantize_mxint8(w))


def test_state_no_run_writes_keeps_its_codes() -> None:
    """Encoding is not idempotent (-2.0 codes decode to a power of two); update() keeps unchanged blocks."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 64, 32)).astype(np.float32)
    x[0, 0, 0, 3] = -1.999  # rounds to the -128 code: decoded, it is -2.0 * scale
    first = mx.encode_mxint8(x, axis=-1)
    decoded = mx.decode_mxint8(first)
    assert not np.array_equal(mx.decode_mxint8(mx.encode_mxint8(decoded, axis=-1)), decoded)
    state = first
    for _ in range(5):  # runs that write nothing: the state stays exactly as stored
        state = mx.update(state, mx.decode_mxint8(state))
    assert np.array_equal(mx.decode_mxint8(state), decoded)
    written = decoded.copy()
    written[2, 1, 7] = 0.5  # one position written: only its block is encoded again
    after = mx.decode_mxint8(mx.update(state, written))
    assert np.allclose(after[2, 1, 7], 0.5) and np.array_equal(
        np.delete(after[2, 1], 7, 0), np.delete(decoded[2, 1], 7, 0)
    )
