"""The connector in vLLM's scheduler: which requests' KV to hold (prefill) or fetch (decode).

Prefill side: a request that arrives with ``kv_transfer_params.do_remote_decode`` is computed as
usual (the router asks for one token). In the step that finishes its prompt, the worker side is
told to hold the slot's first ``prompt_len - 1`` positions; when the request finishes, its slot
stays allocated until the worker has copied them out, and the response carries
``kv_transfer_params`` naming this instance's KV server and the request.

Decode side: a request that arrives with ``do_remote_prefill`` (those parameters) reports those
``prompt_len - 1`` positions as computed elsewhere and waits (vLLM's ``WAITING_FOR_REMOTE_KVS``)
while the worker fetches them into its slot; vLLM then schedules the prompt's last token as a
decode, which gives the first output token. A fetch that fails is reported as failed: under
``kv_load_failure_policy: recompute`` vLLM frees the slot and computes the prompt locally.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from qaic_kvconnector.metadata import LoadSpec, QaicConnectorMetadata, QaicHandshake, SaveSpec
from qaic_kvconnector.settings import ConnectorSettings
from qaic_kvconnector.wire import prompt_hash

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("qaic.kvconnector")


class SchedulerSide:
    """Per-request bookkeeping; no I/O happens here."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.host = settings.host
        self.port = settings.port
        self._to_hold: dict[str, tuple[int, Request]] = {}
        """Prefill side: requests to hand off, by id: (slot, request), until their prompt is done."""
        self._held: dict[str, int] = {}
        """Prefill side: requests whose KV the worker holds, by id: positions held."""
        self._loads: list[LoadSpec] = []
        self._drops: list[str] = []

    def set_handshake(self, meta: QaicHandshake) -> None:
        """The worker's KV server listens here (its port is the one it bound)."""
        self.host, self.port = meta.host, int(meta.port)

    # -- decode side -------------------------------------------------------------------------
    def _remote(self, request: Request) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if not self.settings.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        return params

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None:
            return 0, False
        n = int(params.get("num_tokens") or 0)
        if n != request.num_prompt_tokens - 1 or params.get("prompt_hash") != prompt_hash(
            request.prompt_token_ids or []
        ):
            log.warning(
                "qaic: request %s carries KV for another prompt (%d positions, prompt of %d tokens); "
                "computing its prompt here",
                request.request_id,
                n,
                request.num_prompt_tokens,
            )
            return 0, False
        if n <= num_computed_tokens:
            return 0, False
        return n - num_computed_tokens, True

    # -- both sides ----------------------------------------------------------------------------
    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and self.settings.is_consumer:
            params["do_remote_prefill"] = False  # once: a failed fetch is recomputed, never fetched again
            if num_external_tokens > 0:
                self._loads.append(
                    LoadSpec(
                        req_id=request.request_id,
                        slot=_slot(blocks),
                        num_tokens=num_external_tokens,
                        host=str(params["remote_host"]),
                        port=int(params["remote_port"]),
                        remote_req_id=str(params["remote_request_id"]),
                    )
                )
        elif params.get("do_remote_decode") and self.settings.is_producer and request.num_prompt_tokens > 1:
            self._to_hold[request.request_id] = (_slot(blocks), request)

    def build_meta(self, so: SchedulerOutput) -> QaicConnectorMetadata:
        meta = QaicConnectorMetadata(loads=self._loads, drops=self._drops)
        self._loads, self._drops = [], []
        if self._to_hold:
            done: dict[str, int] = {}
            for new in so.scheduled_new_reqs:
                done[new.req_id] = int(new.num_computed_tokens)
            cached = so.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                done[req_id] = int(cached.num_computed_tokens[i])
            for req_id, computed in done.items():
                entry = self._to_hold.get(req_id)
                if entry is None:
                    continue
                slot, request = entry
                if computed + int(so.num_scheduled_tokens.get(req_id, 0)) >= request.num_prompt_tokens:
                    n = request.num_prompt_tokens - 1
                    meta.saves.append(SaveSpec(req_id=req_id, slot=slot, num_tokens=n))
                    self._held[req_id] = n
                    del self._to_hold[req_id]
        return meta

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Keep a held request's slot until the worker copied it; tell the router where its KV is."""
        req_id = request.request_id
        self._to_hold.pop(req_id, None)
        n = self._held.pop(req_id, None)
        if n is None:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._drops.append(req_id)
            return True, None
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.settings.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": req_id,
            "num_tokens": n,
            "prompt_hash": prompt_hash(request.prompt_token_ids or []),
            "transport": self.settings.transport,
        }


def _slot(blocks: KVCacheBlocks) -> int:
    """The request's KV slot: its one block's id minus one (block 0 is vLLM's null block)."""
    ids = blocks.get_block_ids()
    if not ids or not ids[0]:
        raise RuntimeError("the request holds no KV block; a Cloud AI slot cannot be chosen")
    return int(ids[0][0]) - 1
