"""The host's usable cores follow the process's affinity mask."""

from __future__ import annotations

import os
import socket

import pytest

from qaic_core.host import ephemeral_ports, free_ports, usable_cpus


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


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, high = ephemeral_ports()
    assert 1024 <= low < high
    base = free_ports(3)
    assert base + 3 <= low
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for offset, sock in enumerate(socks):
            sock.bind(("127.0.0.1", base + offset))
            sock.listen()
        # While they are taken, the next answer is elsewhere.
        other = free_ports(3)
        assert not set(range(other, other + 3)) & set(range(base, base + 3))
    finally:
        for sock in socks:
            sock.close()
