"""``QaicConnector``: vLLM's V1 KV connector for disaggregated prefill and decode on Cloud AI.

Select it with ``--kv-transfer-config '{"kv_connector": "QaicConnector", "kv_role": "kv_producer"}'``
on prefill instances and ``"kv_role": "kv_consumer"`` on decode instances (``kv_both`` does
either, per request). Requests move whole: the prefill instance's worker copies the prompt's KV out
of the request's slot (``StepModel.read_slot_kv``), the decode instance's worker places it into
its own slot (``StepModel.write_slot_kv``). The runner hands its step model over through
:class:`qaic_core.kv_transfer.StepModelConsumer`; vLLM attention layers are never involved.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from qaic_core.execution import StepModel
from qaic_kvconnector.metadata import QaicConnectorMetadata, QaicHandshake
from qaic_kvconnector.scheduler_side import SchedulerSide
from qaic_kvconnector.settings import ConnectorSettings
from qaic_kvconnector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("qaic.kvconnector")


def served_model_name(vllm_config: VllmConfig) -> str:
    """The name clients use for the model: what two instances must agree on."""
    model_config = vllm_config.model_config
    if model_config is None:
        return ""
    name = model_config.served_model_name or model_config.model
    return str(name[0] if isinstance(name, (list, tuple)) else name)


class QaicConnector(KVConnectorBase_V1):
    """Hands each request's KV from a prefill instance's slot to a decode instance's slot."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self.settings = ConnectorSettings.from_vllm(vllm_config.kv_transfer_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.settings)
        else:
            self.worker = WorkerSide(self.settings, served_model_name(vllm_config))

    @property
    def requires_kv_delivery(self) -> bool:
        return self.settings.is_producer

    # -- the runner's seam (qaic_core.kv_transfer.StepModelConsumer) -------------------------
    def bind_step_model(self, model: StepModel) -> None:
        assert self.worker is not None, "bind_step_model() is a worker-side call"
        self.worker.bind(model)

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Nothing to register: the KV lives in the card's slots, reached through the step model."""
        return None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, QaicConnectorMetadata)
        self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, QaicConnectorMetadata)
        self.worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sent, received, failed = self.worker.results(set(finished_req_ids))
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # -- scheduler side ----------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self.scheduler is None:
            return
        for meta in metadata.values():
            if isinstance(meta, QaicHandshake):
                self.scheduler.set_handshake(meta)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None
