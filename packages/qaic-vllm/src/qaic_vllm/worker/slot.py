"""The Cloud AI worker of the slot KV layout (``aot``): a compiled program's step model, stepped by :class:`SlotModelRunner`."""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from qaic_core.execution import ExecutionConfig, OpenOptions, StepModel
from qaic_vllm import kv_transfer
from qaic_vllm.config import EngineSettings
from qaic_vllm.envs import lrt_debug
from qaic_vllm.runner.slot import SlotModelRunner
from qaic_vllm.speculative.config import SpecSettings, with_speculation
from qaic_vllm.speculative.proposers import Proposer
from qaic_vllm.worker.slot_kv import SlotKVWorker

log = logging.getLogger("qaic.vllm.worker")


class QaicWorker(SlotKVWorker):
    """One worker per device group: the program's slots hold each sequence's KV on the device."""

    spec: SpecSettings | None = None
    step_model: StepModel | None = None
    kv_transfer: kv_transfer.ConnectorDriver | None = None
    """The KV connector ``--kv-transfer-config`` selects (disaggregated prefill and decode)."""

    def engine_settings(self) -> EngineSettings:
        """The target's settings once speculative decoding has claimed its share of the shapes."""
        settings, self.spec = with_speculation(self.vllm_config, super().engine_settings())
        return settings

    def open_model(self) -> SlotModelRunner:
        """Open the step model: for ``aot``, compile for the engine's shapes (cached) or check a prebuilt QPC."""
        assert self.path is not None
        config = self.execution_config(OpenOptions(enable_debug_logs=lrt_debug()))
        model = self.open_path(config)
        if not isinstance(model, StepModel):
            self.refuse(
                model,
                "a paged-KV model, which this worker does not serve yet",
                "choose the aot execution path",
            )
        self.step_model = model
        proposer = self.open_proposer(model, config)
        k = self.spec.num_speculative_tokens if self.spec is not None else 0
        return SlotModelRunner(self.vllm_config, model, proposer, k)

    def open_proposer(self, model: StepModel, config: ExecutionConfig) -> Proposer | None:
        """The speculative method's proposer; a draft model gets its own program on the same devices."""
        spec = self.spec
        if spec is None:
            return None
        from qaic_vllm.speculative import factory

        assert self.path is not None
        try:
            return factory.open_proposer(spec, model, self.path, config)
        except BaseException:
            model.close()
            raise

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.check_blocks(kv_cache_config)
        assert self.step_model is not None, "load_model() must run before initialize_from_config()"
        self.kv_transfer = kv_transfer.open_connector(self.vllm_config, kv_cache_config, self.step_model)

    def get_kv_connector_handshake_metadata(self) -> dict[tuple[int, int], Any] | None:
        """The KV connector's address and fingerprint, for vLLM's scheduler-side connector."""
        return kv_transfer.handshake_metadata(self.kv_transfer)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        if self.kv_transfer is not None:
            return self.kv_transfer.step(scheduler_output, super().execute_model)
        return super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        output = super().sample_tokens(grammar_output)
        if self.kv_transfer is not None and isinstance(output, ModelRunnerOutput):
            return self.kv_transfer.attach(output)  # a KV connector turns async scheduling off
        return output

    def shutdown(self) -> None:
        kv_transfer.close_connector(self.kv_transfer)
        self.kv_transfer = None
        super().shutdown()
        self.step_model = None
