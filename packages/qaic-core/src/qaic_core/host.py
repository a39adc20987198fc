"""The host machine as the stack's packages size their work to it: cores, and ports to listen on."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path


def usable_cpus() -> int:
    """Cores this process may run on: its affinity mask where the platform has one, else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_LISTEN_PORT = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for outgoing connections and port-0 binds (Linux's
    ``ip_local_port_range``; IANA's 49152-65535 where the platform does not say)."""
    try:
        low, high = (int(v) for v in _PORT_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 49152, 65535
    return low, high


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that nothing listens on now.

    The ports lie below the ephemeral range: a port the kernel chose for a port-0 bind is free again
    once probed, and another process's outgoing connection or port-0 bind can take it before a
    server that starts slowly binds it. Below that range, only another listener can.
    """
    low = min(ephemeral_ports()[0], 65536)
    start = _LOWEST_LISTEN_PORT if low - _LOWEST_LISTEN_PORT > 10 * count else 1024
    for _ in range(200):
        base = random.randrange(start, low - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports between {start} and {low} on 127.0.0.1")
