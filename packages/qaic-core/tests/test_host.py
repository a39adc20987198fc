"""The host's usable cores follow the process's affinity mask."""

from __future__ import annotations

import os

import pytest

from qaic_core.host import usable_cpus


def test_usable_cpus_is_the_affinity_mask() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this platform")
    mask = os.sched_getaffinity(0)
    assert usable_cpus() == len(mask) >= 1
    first = min(mask)
    os.sched_setaffinity(0, {first})
    try:
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, mask)
