"""qaic-pyt registers with qaic-core through its entry point without errors."""

from __future__ import annotations

from qaic_core import get_plugin_manager


def test_registered_through_the_entry_point() -> None:
    pm = get_plugin_manager(strict=True)
    assert pm.has_plugin("pyt")
    assert "pyt" not in pm.load_errors
