"""Compile settings: validation messages name the setting, the limit and the fix."""

from __future__ import annotations

import pytest

from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings


def test_defaults_match_qefficient() -> None:
    s = CompileSettings()
    assert (s.prefill_seq_len, s.ctx_len, s.batch_size, s.num_cores) == (32, 128, 1, 16)
    assert s.decode_batch_size == 1 and s.decode_seq_len == 1
    s = CompileSettings(full_batch_size=8, num_speculative_tokens=3)
    assert s.decode_batch_size == 8 and s.decode_seq_len == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prefill_seq_len": 256, "ctx_len": 128}, "--ctx-len"),
        ({"ctx_len": 0}, "--ctx-len"),
        ({"num_cores": 17}, "between 1 and 16"),
        ({"num_devices": 2, "device_group": (0,)}, "num_devices is 2"),
        ({"num_devices": 2, "device_group": (1, 1)}, "twice"),
        ({"mos": 0}, "mos"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"batch_size": 4, "full_batch_size": 2}, "full_batch_size"),
        ({"full_batch_size": 0}, "--full-batch-size"),
        ({"num_devices": 2, "device_group": (0,)}, "--device-group"),
        ({"num_devices": 2, "device_group": (1, 1)}, "--device-group"),
        ({"num_devices": 1, "device_group": (-1,)}, "negative device id: fix --device-group"),
        ({"num_devices": 0}, "--device-group"),
        ({"mos": 0}, "--mos"),
        ({"num_speculative_tokens": 0}, "--num-speculative-tokens"),
        ({"num_speculative_tokens": 128, "ctx_len": 128}, "raise --ctx-len"),
        ({"batch_size": 4, "full_batch_size": 2}, "--full-batch-size"),
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict, needle: str) -> None:
    with pytest.raises(QaicConfigError, match=needle):
        CompileSettings(**kwargs)


def test_from_mapping_accepts_aliases_and_rejects_unknown_keys() -> None:
    s = CompileSettings.from_mapping(
        {"mxfp6_matmul": True, "dfs": True, "device_group": "0,1", "num_devices": 2}
    )
    assert s.mxfp6 and s.aic_enable_depth_first and s.device_group == (0, 1)
    with pytest.raises(QaicConfigError, match="unknown compile setting 'num_core'"):
        CompileSettings.from_mapping({"num_core": 4})
    with pytest.raises(QaicConfigError, match="device_group '0,a' is not a list of device ids"):
        CompileSettings.from_mapping({"device_group": "0,a", "num_devices": 2})


def test_round_trip_through_dict() -> None:
    s = CompileSettings(full_batch_size=4, device_group=(0, 1), num_devices=2, compiler_args=("-x",))
    assert CompileSettings.from_mapping(s.to_dict()) == s
