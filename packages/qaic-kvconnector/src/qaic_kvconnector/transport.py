"""Moving one request's KV between instances: a server on every instance, a client on decode instances.

Every instance runs a :class:`KVServer` (a pyzmq ROUTER on ``kv_host:kv_port``) on a thread of
its worker. It answers ``HELLO`` with the instance's fingerprint, so a launcher or a peer can
check that two instances agree before any KV moves. A prefill instance also *holds* the KV of
the requests it computed and serves each one once:

- ``tcp``: the reply carries the KV itself (a JSON header, then one frame per array), so it
  works across machines;
- ``shm``: the KV was copied into a POSIX shared-memory segment when it was held; the reply
  names the segment, the decode instance copies it out and sends ``RELEASE``, and the prefill
  instance unlinks it (or does so after ``keep_s`` seconds when nobody came for it).

Every ``GET`` carries the asker's fingerprint: a server whose model, ctx_len, KV dtype or layout
differs refuses it, naming each difference. A :class:`KVClient` fetches on its own threads, so
a decode instance keeps stepping its other sequences while a transfer lands; a fetch fails (and
the request is recomputed) when the peer refuses, does not hold the KV, cannot be reached, or
does not answer within ``transfer_timeout_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from qaic_core.execution import SlotKV
from qaic_kvconnector import wire

log = logging.getLogger("qaic.kvconnector")

HELLO, GET, RELEASE = b"HELLO", b"GET", b"RELEASE"
KV, SHM, MISSING, REFUSED, ERROR = b"KV", b"SHM", b"MISSING", b"REFUSED", b"ERROR"
CONNECT_RETRIES = 5
"""Failed connection attempts (about 100 ms apart) after which a peer counts as unreachable."""


class TransferError(RuntimeError):
    """One request's KV could not be fetched; the message says why."""


@dataclass
class _Held:
    header: dict[str, Any]
    buffers: list[np.ndarray] = field(default_factory=list)
    segment: shared_memory.SharedMemory | None = None
    since: float = field(default_factory=time.monotonic)

    def free(self) -> None:
        self.buffers = []
        if self.segment is not None:
            self.segment.close()
            with contextlib.suppress(FileNotFoundError):
                self.segment.unlink()
            self.segment = None


def _raw(arr: np.ndarray) -> memoryview:
    """An array's bytes, without a copy when it is contiguous."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


def endpoint(host: str, port: int) -> str:
    """The zmq address of a KV server (IPv6 hosts in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KVServer:
    """The KV agent of one instance: answers handshakes and serves the KV this instance holds."""

    def __init__(
        self,
        host: str,
        port: int,
        fp: Mapping[str, Any],
        transport: str = "tcp",
        keep_s: float = 120.0,
        link_gbps: float | None = None,
        link_scale: float = 1.0,
    ) -> None:
        self.fingerprint = dict(fp)
        self.transport = transport
        self.keep_s = keep_s
        self.link_gbps = link_gbps
        self.link_scale = link_scale
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(endpoint(host, 0).rsplit(":", 1)[0])
            else:
                self._sock.bind(endpoint(host, port))
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"the KV server cannot listen on {endpoint(host, port)}: {exc}") from exc
        self.host = host
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="qaic-kv-server", daemon=True)
        self._thread.start()

    # -- the worker's side (its own thread) --------------------------------------------------
    def hold(self, req_id: str, header: dict[str, Any], buffers: Sequence[np.ndarray]) -> None:
        """Keep one request's KV until a decode instance fetches it (or ``keep_s`` passes)."""
        entry = _Held(header=dict(header))
        if self.transport == "shm":
            total = max(sum(int(b.nbytes) for b in buffers), 1)
            self._counter += 1
            name = f"qaic_kv_{os.getpid()}_{self._counter}"
            segment = shared_memory.SharedMemory(name=name, create=True, size=total)
            view = segment.buf
            assert view is not None
            offset = 0
            sizes = []
            for buf in buffers:
                n = int(buf.nbytes)
                view[offset : offset + n] = _raw(buf)
                sizes.append(n)
                offset += n
            entry.segment = segment
            entry.header["shm"] = segment.name
            entry.header["sizes"] = sizes
        else:
            entry.buffers = [np.ascontiguousarray(b) for b in buffers]
        with self._lock:
            old = self._held.pop(req_id, None)
            self._held[req_id] = entry
        if old is not None:
            old.free()

    def drop(self, req_id: str) -> None:
        with self._lock:
            entry = self._held.pop(req_id, None)
        if entry is not None:
            entry.free()

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            entries = list(self._held.values())
            self._held.clear()
        for entry in entries:
            entry.free()

    # -- the server thread -------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    try:
                        self._handle(self._sock.recv_multipart(copy=True))
                    except Exception:
                        log.exception("qaic: the KV server could not answer a message")
                self._expire()
        finally:
            self._sock.close()
            self._ctx.term()

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            return
        ident, kind, body = frames[0], frames[1], json.loads(frames[2] or b"{}")
        if kind == HELLO:
            self._reply(ident, HELLO, self.fingerprint)
        elif kind == GET:
            self._get(ident, body)
        elif kind == RELEASE:
            self.drop(str(body.get("req_id", "")))
        else:
            self._reply(ident, ERROR, {"error": f"unknown message {kind!r}"})

    def _get(self, ident: bytes, body: Mapping[str, Any]) -> None:
        req_id = str(body.get("req_id", ""))
        diff = wire.differences(self.fingerprint, body.get("fingerprint") or {}, "prefill", "decode")
        if diff:
            self._reply(ident, REFUSED, {"error": "instances differ: " + "; ".join(diff)})
            return
        with self._lock:
            entry = self._held.get(req_id) if self.transport == "shm" else self._held.pop(req_id, None)
        if entry is None:
            self._reply(ident, MISSING, {"error": f"this prefill instance holds no KV for request {req_id}"})
            return
        if entry.segment is not None:
            self._reply(ident, SHM, entry.header)
            return
        if self.link_gbps:
            # One link, one transfer at a time: the KV leaves after the time it takes at link rate.
            self._stop.wait(int(entry.header["nbytes"]) * self.link_scale * 8 / (self.link_gbps * 1e9))
        frames: list[Any] = [ident, KV, json.dumps(entry.header).encode()]
        frames += [_raw(b) for b in entry.buffers]
        self._sock.send_multipart(frames, copy=False)

    def _reply(self, ident: bytes, kind: bytes, body: Mapping[str, Any]) -> None:
        self._sock.send_multipart([ident, kind, json.dumps(body).encode()])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [r for r, e in self._held.items() if now - e.since > self.keep_s]
            entries = [self._held.pop(r) for r in stale]
        for req_id, entry in zip(stale, entries, strict=True):
            log.warning(
                "qaic: no decode instance fetched the KV of %s in %.0fs; dropped", req_id, self.keep_s
            )
            entry.free()


@dataclass(frozen=True)
class Fetched:
    """One request's KV as it arrived, with what the transfer cost."""

    kv: SlotKV
    nbytes: int
    seconds: float


class KVClient:
    """Fetches requests' KV from prefill instances on background threads."""

    def __init__(
        self,
        fp: Mapping[str, Any],
        timeout_s: float = 30.0,
        threads: int = 2,
    ) -> None:
        self.fingerprint = dict(fp)
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="qaic-kv-fetch")

    def fetch(self, host: str, port: int, req_id: str) -> Future[Fetched]:
        """Start fetching ``req_id``'s KV from the server at ``host:port``."""
        return self._pool.submit(self._fetch, host, port, req_id)

    def close(self) -> None:
        """Stop taking fetches; one in flight ends on its own (its socket closes when it does)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, host: str, port: int, req_id: str) -> Fetched:
        where = endpoint(host, port)
        start = time.monotonic()
        body = {"req_id": req_id, "fingerprint": self.fingerprint}
        kind, frames = request(self._ctx, where, GET, body, self.timeout_s)
        header = json.loads(frames[0])
        if kind in (REFUSED, MISSING, ERROR):
            raise TransferError(f"the prefill instance at {where} answered: {header.get('error')}")
        if kind == SHM:
            buffers = _read_segment(str(header["shm"]), [int(n) for n in header["sizes"]])
            with contextlib.suppress(zmq.ZMQError):
                send_only(self._ctx, where, RELEASE, {"req_id": req_id})
        elif kind == KV:
            buffers = list(frames[1:])
        else:
            raise TransferError(f"the prefill instance at {where} sent an unknown reply {kind!r}")
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        kv = wire.decode_kv(header, buffers)
        return Fetched(kv=kv, nbytes=nbytes, seconds=time.monotonic() - start)


def request(
    ctx: zmq.Context, where: str, kind: bytes, body: Mapping[str, Any], timeout_s: float
) -> tuple[bytes, list[Any]]:
    """Send one message and wait for the reply: (kind, [header bytes, *buffers as memoryviews]).

    Raises :class:`TransferError` when the peer cannot be reached (connection refused or lost)
    or does not answer within ``timeout_s``.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if where.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(where)
        sock.send_multipart([kind, json.dumps(body).encode()])
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        retries = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"no answer from {where} within {timeout_s:g}s")
            events = dict(poller.poll(int(min(left, 0.5) * 1000) + 1))
            if sock in events:
                frames = sock.recv_multipart(copy=False)
                return frames[0].bytes, [frames[1].bytes, *(f.buffer for f in frames[2:])]
            if monitor in events:
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise TransferError(f"the connection to {where} was lost (the instance stopped?)")
                retries += 1
                if retries >= CONNECT_RETRIES:
                    raise TransferError(f"{where} refuses connections (the instance is not running?)")
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def send_only(ctx: zmq.Context, where: str, kind: bytes, body: Mapping[str, Any]) -> None:
    """Send one message that has no reply (it is delivered while the process keeps running)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(where)
    sock.send_multipart([kind, json.dumps(body).encode()])
    sock.close()


def hello(where: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The fingerprint of the instance whose KV server listens at ``where``."""
    ctx = zmq.Context()
    try:
        kind, frames = request(ctx, where, HELLO, {}, timeout_s)
        if kind != HELLO:
            raise TransferError(f"{where} answered {kind!r} to a handshake")
        return dict(json.loads(frames[0]))
    finally:
        ctx.term()


def _read_segment(name: str, sizes: Sequence[int]) -> list[bytes]:
    """Copy the buffers out of a producer's shared-memory segment (which the producer unlinks)."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        raise TransferError(
            f"the shared-memory segment {name} is gone (the prefill instance stopped?)"
        ) from None
    if not name.startswith(f"qaic_kv_{os.getpid()}_"):  # Python 3.11 registers segments it only opened
        with contextlib.suppress(Exception):
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        view = segment.buf
        assert view is not None
        out, offset = [], 0
        for n in sizes:
            out.append(bytes(view[offset : offset + n]))
            offset += n
        return out
    finally:
        segment.close()
