"""Environment parsing: visible devices, QEFF_HOME, flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from qaic_core.env import env_flag, parse_visible_devices, qeff_home, requested_backend
from qaic_core.errors import QaicConfigError


def test_visible_devices_filter_and_reorder() -> None:
    assert parse_visible_devices(None, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert parse_visible_devices("", [0, 1]) == [0, 1]
    assert parse_visible_devices("2,0", [0, 1, 2, 3]) == [2, 0]
    assert parse_visible_devices(" 3 ", [0, 1, 2, 3]) == [3]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a", "not a device id"),
        ("0,,1", "empty entry"),
        ("7", "does not exist"),
        ("1,1", "twice"),
        ("-1", "not a device id"),
    ],
)
def test_visible_devices_errors_are_clear(value: str, message: str) -> None:
    with pytest.raises(QaicConfigError, match=message) as err:
        parse_visible_devices(value, [0, 1, 2, 3])
    assert "QAIC_VISIBLE_DEVICES" in str(err.value)


def test_qeff_home_default_and_override(tmp_path: Path) -> None:
    assert qeff_home({"QEFF_HOME": str(tmp_path)}) == tmp_path
    assert qeff_home({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "qeff_models"
    assert qeff_home({}).name == "qeff_models"


def test_flags_and_backend() -> None:
    assert env_flag("X", environ={"X": "yes"}) is True
    assert env_flag("X", environ={"X": "0"}) is False
    assert env_flag("X", True, environ={}) is True
    with pytest.raises(QaicConfigError, match="X='maybe'"):
        env_flag("X", environ={"X": "maybe"})
    assert requested_backend({"QAIC_BACKEND": " sim "}) == "sim"
    assert requested_backend({}) is None
