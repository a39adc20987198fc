"""The handshake fingerprint, the KV message format and the mxint8 compact form."""

from __future__ import annotations

import numpy as np
import pytest

from qaic_core.errors import QaicConfigError
from qaic_core.execution import SlotKV
from qaic_kvconnector import mxint8, wire
from qaic_kvconnector.settings import ConnectorSettings


def _device_mxint8(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """float16 values as an mxint8 KV cache hands them to the host (the simulator's encoding)."""
    from qaic_sim import mx

    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 3
    return mx.decode_mxint8(mx.encode_mxint8(x, axis=-1)).astype(np.float16)


@pytest.mark.parametrize("head_dim", [16, 32, 48, 128])
def test_mxint8_codes_match_the_device_and_decode_exactly(head_dim: int) -> None:
    from qaic_sim import mx

    values = _device_mxint8((1, 2, 7, head_dim))
    codes, scales = mxint8.encode(values)
    held = mx.encode_mxint8(values.astype(np.float32), axis=-1)
    same = scales == held.scales  # elsewhere a block's largest code is -128: held one exponent lower
    assert same.mean() > 0.9
    padded = -(-head_dim // 32) * 32
    ours = codes.view(np.uint8).reshape(*scales.shape, 32)
    assert np.array_equal(ours[same], held.codes.reshape(1, 2, 7, padded // 32, 32)[same])
    back = mxint8.decode(codes, scales, head_dim, np.float16)
    assert back.dtype == np.float16 and np.array_equal(back, values)
    assert codes.nbytes + scales.nbytes == mxint8.wire_bytes(values.shape)


def test_mxint8_travels_compact_and_float_kv_raw() -> None:
    values = _device_mxint8((1, 2, 9, 64))
    kv = SlotKV(9, {"past_key.0": values, "past_value.0": _device_mxint8((1, 2, 9, 64), seed=1)}, "mxint8")
    header, buffers = wire.encode_kv(kv)
    assert header["nbytes"] == 2 * mxint8.wire_bytes(values.shape) < 2 * values.nbytes * 0.6
    back = wire.decode_kv(header, [b.tobytes() for b in buffers])
    assert back.dtype == "mxint8" and back.num_tokens == 9
    for name, arr in kv.tensors.items():
        assert np.array_equal(back.tensors[name], arr)
    header, buffers = wire.encode_kv(kv, compact=False)
    assert header["nbytes"] == 2 * values.nbytes
    short = SlotKV(2, {"past_key.0": _device_mxint8((1, 2, 2, 16))}, "mxint8")  # 33 bytes per 16 values
    assert [t["wire"] for t in wire.encode_kv(short)[0]["tensors"]] == ["raw"]
    raw = SlotKV(3, {"past_key.0": np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)}, "float32")
    header, buffers = wire.encode_kv(raw)
    assert [t["wire"] for t in header["tensors"]] == ["raw"]
    assert np.array_equal(
        wire.decode_kv(header, [b.tobytes() for b in buffers]).tensors["past_key.0"],
        raw.tensors["past_key.0"],
    )
    with pytest.raises(ValueError, match="buffers"):
        wire.decode_kv(header, [buffers[0].tobytes(), b""])


def test_fingerprint_differences_name_each_key() -> None:
    probe = SlotKV(1, {"past_key.0": np.zeros((1, 2, 1, 16), np.float16)}, "float16")
    mine = wire.fingerprint("tiny", 512, probe)
    assert mine["layout"] == "past_key.0:2x16:float16"
    theirs = wire.fingerprint(
        "tiny", 256, SlotKV(1, {"past_key.0": np.zeros((1, 4, 1, 16), np.float16)}, "mxint8")
    )
    diff = wire.differences(mine, theirs, "decode", "prefill")
    assert [d.split(":")[0] for d in diff] == ["ctx_len", "kv_dtype", "layout"]
    assert "ctx_len: decode 512, prefill 256" in diff
    assert wire.differences(mine, dict(mine), "a", "b") == []
    assert wire.prompt_hash([1, 2, 3]) == wire.prompt_hash((1, 2, 3)) != wire.prompt_hash([1, 2])


def test_settings_validate_extra_config() -> None:
    s = ConnectorSettings.from_mapping("kv_consumer", 0, {"transport": "SHM", "transfer_timeout_s": 2})
    assert s.transport == "shm" and s.is_consumer and not s.is_producer and s.transfer_timeout_s == 2
    assert ConnectorSettings.from_mapping("kv_both", 1, {}).is_producer
    with pytest.raises(QaicConfigError, match="kv_role"):
        ConnectorSettings.from_mapping("decoder", 1, {})
    with pytest.raises(QaicConfigError, match=r"unknown keys \['speed'\].*link_gbps"):
        ConnectorSettings.from_mapping("kv_producer", 1, {"speed": 3})
    with pytest.raises(QaicConfigError, match="transport='rdma'"):
        ConnectorSettings.from_mapping("kv_producer", 1, {"transport": "rdma"})
    with pytest.raises(QaicConfigError, match="transfer_timeout_s"):
        ConnectorSettings.from_mapping("kv_producer", 1, {"transfer_timeout_s": 0})
    with pytest.raises(QaicConfigError, match="compact_mxint8"):
        ConnectorSettings.from_mapping("kv_producer", 1, {"compact_mxint8": "maybe"})
