"""The connector's settings: ``--kv-transfer-config`` with its ``kv_connector_extra_config`` keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qaic_core.env import parse_bool
from qaic_core.errors import QaicConfigError

CONNECTOR_NAME = "QaicConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
TRANSPORTS = ("tcp", "shm")

EXTRA_KEYS: dict[str, str] = {
    "transport": "tcp (across machines, pyzmq) or shm (one host: the KV travels in shared memory)",
    "kv_host": "address this instance's KV server binds and advertises (default 127.0.0.1)",
    "transfer_timeout_s": "seconds a decode instance waits for one request's KV before recomputing it",
    "keep_s": "seconds a prefill instance keeps KV that no decode instance has fetched",
    "link_gbps": "a prefill instance sends KV over TCP at this rate (Gbit/s): models a network on one host",
    "link_scale": "pace as if each transfer were this many times larger (a paced simulator's bigger model)",
    "compact_mxint8": "send an mxint8 KV cache as codes and scales (1 + 1/32 bytes per value)",
}
"""``kv_connector_extra_config`` keys the connector reads."""


@dataclass(frozen=True)
class ConnectorSettings:
    """What one instance's connector does and how it reaches its peers."""

    role: str = "kv_both"
    transport: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 14579
    transfer_timeout_s: float = 30.0
    keep_s: float = 120.0
    link_gbps: float | None = None
    link_scale: float = 1.0
    compact_mxint8: bool = True
    engine_id: str = ""
    on_failure: str = "recompute"
    """vLLM's ``kv_load_failure_policy``: a decode instance recomputes a prompt whose KV did not arrive, or fails it."""

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @classmethod
    def from_mapping(
        cls,
        role: str | None,
        port: int,
        extra: Mapping[str, Any],
        engine_id: str = "",
        on_failure: str = "recompute",
    ) -> ConnectorSettings:
        """Validate the values of ``--kv-transfer-config``; errors name the key and what it takes."""
        where = "--kv-transfer-config kv_connector_extra_config"
        if role not in ROLES:
            raise QaicConfigError(f"--kv-transfer-config kv_role={role!r}: use one of {', '.join(ROLES)}")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in EXTRA_KEYS.items())
            raise QaicConfigError(f"{where} has unknown keys {unknown}; {CONNECTOR_NAME} reads {known}")
        transport = str(extra.get("transport", "tcp")).lower()
        if transport not in TRANSPORTS:
            raise QaicConfigError(f"{where} transport={transport!r}: use {' or '.join(TRANSPORTS)}")
        if not 0 <= int(port) < 65536:
            raise QaicConfigError(f"--kv-transfer-config kv_port={port} is not a TCP port")
        link = extra.get("link_gbps")
        return cls(
            role=role,
            transport=transport,
            host=str(extra.get("kv_host", "127.0.0.1")),
            port=int(port),
            transfer_timeout_s=_positive(extra, "transfer_timeout_s", 30.0, where),
            keep_s=_positive(extra, "keep_s", 120.0, where),
            link_gbps=None if link in (None, "", 0) else _positive(extra, "link_gbps", 0.0, where),
            link_scale=_positive(extra, "link_scale", 1.0, where),
            compact_mxint8=parse_bool(extra.get("compact_mxint8", True), f"{where} compact_mxint8"),
            engine_id=engine_id,
            on_failure=on_failure,
        )

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> ConnectorSettings:
        """From vLLM's ``KVTransferConfig``."""
        return cls.from_mapping(
            kv_transfer_config.kv_role,
            int(kv_transfer_config.kv_port),
            dict(kv_transfer_config.kv_connector_extra_config or {}),
            str(kv_transfer_config.engine_id or ""),
            str(getattr(kv_transfer_config, "kv_load_failure_policy", "fail")),
        )


def _positive(extra: Mapping[str, Any], key: str, default: float, where: str) -> float:
    raw = extra.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise QaicConfigError(f"{where} {key}={raw!r} is not a number") from None
    if value <= 0:
        raise QaicConfigError(f"{where} {key}={raw!r} must be > 0")
    return value
