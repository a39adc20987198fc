"""The vLLM general-plugin entry point of qaic-kvconnector loads and is idempotent."""

from __future__ import annotations

import importlib.metadata as md


def test_entry_point_loads_and_can_run_twice() -> None:
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "qaic_kvconnector"]
    assert len(eps) == 1
    register = eps[0].load()
    register()
    register()
