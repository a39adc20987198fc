"""Compile settings: validation messages name the setting, the limit and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qaic_core.env import env_flag, parse_bool
from qaic_core.errors import QaicConfigError
from qaic_core.settings import SETTING_KEYS, SETTINGS, CompileSettings, settings_table


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


DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_every_field_is_described_once_with_its_default() -> None:
    defaults = CompileSettings()
    assert list(SETTINGS) == [f.name for f in dataclasses.fields(CompileSettings)]
    for name, spec in SETTINGS.items():
        assert spec.name == name and spec.help and spec.default == getattr(defaults, name)
        assert all(SETTING_KEYS[key] is spec for key in spec.keys)
    vendor = {"mxfp6_matmul": "mxfp6", "mxint8_kv_cache": "mxint8", "dfs": "aic_enable_depth_first"}
    vendor["aic_num_cores"] = "num_cores"
    assert {alias: SETTING_KEYS[alias].name for alias in vendor} == vendor


def test_from_mapping_parses_values_by_the_table() -> None:
    s = CompileSettings.from_mapping(
        {
            "mxfp6": "false",
            "mxint8_kv_cache": "Yes",
            "aic_num_cores": "8",
            "compiler_args": "-stats-level=70 '-x y'",
            "mos": None,
        }
    )
    assert (s.mxfp6, s.mxint8, s.num_cores, s.mos) == (False, True, 8, None)
    assert s.compiler_args == ("-stats-level=70", "-x y")
    # The setting's own name wins over a vendor alias, whichever comes first.
    for values in ({"dfs": True, "aic_enable_depth_first": "no"}, {"aic_enable_depth_first": 0, "dfs": "on"}):
        assert CompileSettings.from_mapping(values).aic_enable_depth_first is False
    with pytest.raises(QaicConfigError, match="--mos='two' is not an integer: give a whole number"):
        CompileSettings.from_mapping({"mos": "two"}, lambda key: SETTINGS[key].flag or key)


def test_a_bad_boolean_reads_the_same_from_a_variable_and_a_setting() -> None:
    words = "is not a boolean: use 1/0, true/false, yes/no or on/off"
    with pytest.raises(QaicConfigError) as from_env:
        env_flag("X", environ={"X": "maybe"})
    with pytest.raises(QaicConfigError) as from_alias:
        CompileSettings.from_mapping({"dfs": "maybe"})
    with pytest.raises(QaicConfigError) as from_parser:
        parse_bool("maybe", "mxfp6")
    assert str(from_env.value) == f"X='maybe' {words}"
    assert str(from_alias.value) == f"dfs='maybe' {words}"
    assert str(from_parser.value) == f"mxfp6='maybe' {words}"


def test_docs_carry_the_generated_settings_table() -> None:
    assert settings_table() in DOCS.read_text(), (
        "docs/configuration.md's settings table is stale; paste the output of "
        "python -c 'from qaic_core.settings import settings_table; print(settings_table())'"
    )
