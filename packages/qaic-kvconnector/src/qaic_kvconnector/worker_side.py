"""The connector in the worker: slot KV in and out of the card through the step model only.

Every device call (``read_slot_kv`` / ``write_slot_kv``) happens on the runner's thread inside the
connector hooks the runner calls between steps; the network side runs on the server's and the
client's threads, so a decode instance keeps decoding while transfers land.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from qaic_core.errors import QaicConfigError
from qaic_core.execution import SLOT_KV_TRANSFER, StepModel
from qaic_kvconnector import wire
from qaic_kvconnector.metadata import LoadSpec, QaicConnectorMetadata, QaicHandshake
from qaic_kvconnector.settings import ConnectorSettings
from qaic_kvconnector.transport import Fetched, KVClient, KVServer

log = logging.getLogger("qaic.kvconnector")


@dataclass
class TransferTotals:
    """Transfers since start-up (both directions), for logs and benchmarks."""

    sent: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    receive_seconds: float = 0.0
    failed: int = 0


class WorkerSide:
    """Holds (prefill) and fetches (decode) requests' KV; one per worker."""

    def __init__(self, settings: ConnectorSettings, model_name: str) -> None:
        self.settings = settings
        self.model_name = model_name
        self.model: StepModel | None = None
        self.fingerprint: dict[str, object] = {}
        self.server: KVServer | None = None
        self.client: KVClient | None = None
        self.totals = TransferTotals()
        self._held: set[str] = set()
        """Requests held and not yet reported: reported as sent once vLLM lists them finished."""
        self._fetching: dict[str, tuple[LoadSpec, Future[Fetched]]] = {}
        self._received: set[str] = set()
        self._failed: set[str] = set()

    def bind(self, model: StepModel) -> None:
        """Take the runner's step model; start the KV server (and the client on a decode instance)."""
        if SLOT_KV_TRANSFER not in model.capabilities:
            raise QaicConfigError(
                "disaggregated serving moves each request's KV slot by slot, but this step model does not "
                f"claim {SLOT_KV_TRANSFER!r}: serve with the aot execution path on a device backend with "
                "'slicing'"
            )
        self.model = model
        probe = model.read_slot_kv(0, 1)
        self.fingerprint = wire.fingerprint(self.model_name, model.shape.ctx_len, probe)
        s = self.settings
        self.server = KVServer(
            s.host, s.port, self.fingerprint, s.transport, s.keep_s, s.link_gbps, s.link_scale
        )
        if s.is_consumer:
            self.client = KVClient(self.fingerprint, s.transfer_timeout_s)
        log.info(
            "qaic: KV connector %s on %s:%d (%s, %s KV): %s",
            s.role,
            s.host,
            self.server.port,
            s.transport,
            probe.dtype,
            self.fingerprint["layout"],
        )

    def handshake(self) -> QaicHandshake | None:
        if self.server is None:
            return None
        return QaicHandshake(
            host=self.settings.host, port=self.server.port, fingerprint=dict(self.fingerprint)
        )

    # -- per step ---------------------------------------------------------------------------
    def start_loads(self, meta: QaicConnectorMetadata) -> None:
        """Start this step's fetches, and place in their slots the ones that arrived."""
        for spec in meta.loads:
            if self.client is None:
                log.warning(
                    "qaic: request %s asks for remote KV but this instance is not a consumer", spec.req_id
                )
                self._failed.add(spec.req_id)
                continue
            future = self.client.fetch(spec.host, spec.port, spec.remote_req_id)
            self._fetching[spec.req_id] = (spec, future)
        self._place_arrived()

    def _place_arrived(self) -> None:
        assert self.model is not None
        for req_id, (spec, future) in list(self._fetching.items()):
            if not future.done():
                continue
            del self._fetching[req_id]
            try:
                got = future.result()
                if got.kv.num_tokens != spec.num_tokens:
                    raise QaicConfigError(
                        f"{got.kv.num_tokens} positions arrived but the request needs {spec.num_tokens}"
                    )
                self.model.write_slot_kv(spec.slot, got.kv)
            except Exception as exc:
                self.totals.failed += 1
                self._failed.add(req_id)
                then = (
                    "computing its prompt here"
                    if self.settings.on_failure == "recompute"
                    else "the request fails"
                )
                log.warning("qaic: the KV of request %s did not arrive (%s); %s", req_id, exc, then)
                continue
            self.totals.received += 1
            self.totals.received_bytes += got.nbytes
            self.totals.receive_seconds += got.seconds
            self._received.add(req_id)
            log.info(
                "qaic: request %s: %d KV positions (%d bytes) arrived in %.1f ms",
                req_id,
                spec.num_tokens,
                got.nbytes,
                got.seconds * 1000,
            )

    def save(self, meta: QaicConnectorMetadata) -> None:
        """Copy out the slots of requests whose prompt finished this step (after the step ran)."""
        assert self.model is not None and self.server is not None
        for req_id in meta.drops:
            self.server.drop(req_id)
        for spec in meta.saves:
            self._held.add(spec.req_id)
            start = time.perf_counter()
            try:
                kv = self.model.read_slot_kv(spec.slot, spec.num_tokens)
                header, buffers = wire.encode_kv(kv, self.settings.compact_mxint8)
                self.server.hold(spec.req_id, header, buffers)
            except Exception:
                log.exception(
                    "qaic: could not hold the KV of request %s; its decode instance will recompute",
                    spec.req_id,
                )
                continue
            self.totals.sent += 1
            self.totals.sent_bytes += int(header["nbytes"])
            log.debug(
                "qaic: holding %d KV positions of %s (%d bytes, %.1f ms)",
                spec.num_tokens,
                spec.req_id,
                header["nbytes"],
                (time.perf_counter() - start) * 1000,
            )

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed) since the last call; failed ones are also in received."""
        if self._fetching:
            self._place_arrived()
        sent = self._held & finished_req_ids
        self._held -= sent
        received = self._received | self._failed
        failed = self._failed
        self._received, self._failed = set(), set()
        return sent, received, failed

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.close()
