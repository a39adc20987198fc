"""What the scheduler side tells the worker side each step, and what the worker tells it once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@dataclass(frozen=True)
class SaveSpec:
    """A prefill instance finishes ``req_id``'s prompt this step: hold its slot's first ``num_tokens``."""

    req_id: str
    slot: int
    num_tokens: int


@dataclass(frozen=True)
class LoadSpec:
    """A decode instance fetches ``remote_req_id``'s KV from ``host:port`` into ``slot``."""

    req_id: str
    slot: int
    num_tokens: int
    host: str
    port: int
    remote_req_id: str


@dataclass
class QaicConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    """Requests whose held KV nobody will fetch (aborted before their response went out)."""


@dataclass
class QaicHandshake(KVConnectorHandshakeMetadata):
    """The worker's KV server address and fingerprint, handed to the scheduler side at start-up."""

    host: str
    port: int
    fingerprint: dict[str, Any]
