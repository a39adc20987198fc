"""The vLLM worker for Cloud AI: opens a step model through the selected execution path and runs it."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from qaic_core import get_plugin_manager
from qaic_core.descriptors import DeviceBackend, ExecutionPath
from qaic_core.errors import QaicConfigError
from qaic_core.execution import ExecutionConfig, OpenOptions, StepModel
from qaic_vllm import kv_transfer
from qaic_vllm.config import EngineSettings, engine_settings, model_dir_of
from qaic_vllm.envs import VLLM_QAIC_MAX_CPU_THREADS, lrt_debug, max_cpu_threads
from qaic_vllm.faults import fatal_reported
from qaic_vllm.model_runner import SlotModelRunner
from qaic_vllm.platform import configure_logging
from qaic_vllm.profiling import IterationTracer
from qaic_vllm.speculative.config import with_speculation
from qaic_vllm.speculative.proposers import Proposer
from qaic_vllm.torch_device import name_device_type, neutralise_accelerator

log = logging.getLogger("qaic.vllm.worker")


class QaicWorker(WorkerBase):
    """One worker per card (vLLM sees world size 1; multi-SoC slicing is the compiler's job)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        configure_logging()
        neutralise_accelerator()
        self.settings: EngineSettings
        self.settings, self.spec = with_speculation(vllm_config, engine_settings(vllm_config))
        self.runner: SlotModelRunner | None = None
        self.step_model: StepModel | None = None
        self.backend: DeviceBackend | None = None
        self.path: ExecutionPath | None = None
        self.compile_seconds = 0.0
        self.tracer: IterationTracer | None = None
        self.kv_transfer: kv_transfer.ConnectorDriver | None = None
        """The KV connector ``--kv-transfer-config`` selects (disaggregated prefill and decode)."""

    # -- start-up -----------------------------------------------------------------------------
    def init_device(self) -> None:
        with fatal_reported("starting the Cloud AI worker"):
            self._init_device()

    def _init_device(self) -> None:
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        self.device = torch.device("cpu")
        threads = max_cpu_threads()
        if threads is not None:
            torch.set_num_threads(threads)
            log.info("qaic: host work limited to %d torch thread(s) (%s)", threads, VLLM_QAIC_MAX_CPU_THREADS)
        name_device_type()
        init_distributed_environment(
            world_size=1,
            rank=self.rank,
            distributed_init_method=self.distributed_init_method,
            local_rank=self.local_rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        pm = get_plugin_manager()
        self.backend = pm.select_device_backend()
        self.path = pm.select_execution_path(self.settings.execution_path)
        log.info(
            "qaic: device backend %r (%s), execution path %r (%s)",
            self.backend.name,
            self.backend.package,
            self.path.name,
            self.path.package,
        )
        profiler = getattr(self.vllm_config, "profiler_config", None)
        self.tracer = IterationTracer(self.backend, str(getattr(profiler, "torch_profiler_dir", "") or ""))

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Open the step model: for ``aot``, compile for the engine's shapes (cached) or check a prebuilt QPC."""
        with fatal_reported("loading the model"):
            self._load_model()

    def _load_model(self) -> None:
        assert self.backend is not None and self.path is not None, "init_device() must run first"
        config = ExecutionConfig(
            model_dir=model_dir_of(self.model_config.model),
            settings=self.settings.compile,
            device=self.backend,
            qpc_path=self.settings.qpc_path,
            dtype=self.settings.dtype,
            progress=True,
            options=OpenOptions(enable_debug_logs=lrt_debug()),  # VLLM_QAIC_ENABLE_LRT_DEBUG
        )
        start = time.perf_counter()
        model = self.path.open(config)
        self.compile_seconds = time.perf_counter() - start
        if not isinstance(model, StepModel):
            model.close()
            raise QaicConfigError(
                f"execution path {self.path.name!r} opened a paged-KV model, which this worker does not serve "
                "yet: choose the aot execution path"
            )
        log.info("qaic: %s model ready in %.1fs", self.path.name, self.compile_seconds)
        self.step_model = model
        proposer = self._open_proposer(model, config)
        k = self.spec.num_speculative_tokens if self.spec is not None else 0
        self.runner = SlotModelRunner(self.vllm_config, model, proposer, k)

    def _open_proposer(self, model: StepModel, config: ExecutionConfig) -> Proposer | None:
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

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One tiny stand-in layer: the real KV lives on the device; vLLM only counts slots."""
        block_size = int(self.model_config.max_model_len)
        return {
            "qaic.kv": FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
            )
        }

    def get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return [layout.name for layout in KVCacheLayout]

    def determine_available_memory(self) -> int:
        spec = self.get_kv_cache_spec()["qaic.kv"]
        return int(spec.page_size_bytes * (self.settings.compile.decode_batch_size + 2))

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        blocks = int(kv_cache_config.num_blocks)
        if blocks < self.settings.compile.decode_batch_size + 1:
            raise RuntimeError(
                f"vLLM allotted {blocks} KV blocks; Cloud AI needs max_num_seqs + 1 = "
                f"{self.settings.compile.decode_batch_size + 1}"
            )
        assert self.step_model is not None, "load_model() must run before initialize_from_config()"
        self.kv_transfer = kv_transfer.open_connector(self.vllm_config, kv_cache_config, self.step_model)

    def get_kv_connector_handshake_metadata(self) -> dict[tuple[int, int], Any] | None:
        """The KV connector's address and fingerprint, for vLLM's scheduler-side connector."""
        return kv_transfer.handshake_metadata(self.kv_transfer)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=self.compile_seconds, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self) -> Any:
        raise NotImplementedError(
            f"the {self.settings.execution_path} execution path runs a compiled program; there is no torch model"
        )

    # -- per step --------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        if self.kv_transfer is not None:
            return self.kv_transfer.step(scheduler_output, self._execute_step)
        return self._execute_step(scheduler_output)

    def _execute_step(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        assert self.runner is not None, "load_model() must run before execute_model()"
        tracer = self.tracer
        with fatal_reported("serving"):
            if tracer is not None and tracer.active and scheduler_output.total_num_scheduled_tokens > 0:
                tracer.begin_iteration()
                try:
                    return self.runner.execute_model(scheduler_output)
                finally:
                    tracer.end_iteration()
            return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        assert self.runner is not None, "load_model() must run before sample_tokens()"
        with fatal_reported("serving"):
            output = self.runner.sample_tokens(grammar_output)
        if self.kv_transfer is not None and isinstance(output, ModelRunnerOutput):
            return self.kv_transfer.attach(output)  # a KV connector turns async scheduling off
        return output

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.runner.take_draft_token_ids() if self.runner is not None else None

    def profile(self, is_start: bool = True, profile_prefix: str | None = None, **kwargs: Any) -> None:
        if self.tracer is None:
            return
        if is_start:
            self.tracer.start()
        else:
            self.tracer.stop()

    def check_health(self) -> None:
        return None

    def add_lora(self, lora_request: Any) -> bool:
        raise NotImplementedError("LoRA is not supported on the qaic AOT path")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.stop()
        kv_transfer.close_connector(self.kv_transfer)
        self.kv_transfer = None
        if self.runner is not None and self.runner.proposer is not None:
            self.runner.proposer.close()
        if self.step_model is not None:
            self.step_model.close()  # frees the NSP cores for the next program
        self.step_model = None
        self.runner = None
