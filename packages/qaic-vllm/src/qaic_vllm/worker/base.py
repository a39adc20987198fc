"""What every Cloud AI worker shares: the device and plugin set-up, opening a model, tracing each step.

A worker role (slot, paged, pooling) implements one seam, :meth:`QaicWorkerBase.open_model`: it
opens its kind of model through the selected execution path (:meth:`QaicWorkerBase.open_path`)
and returns the runner that steps it. vLLM's worker calls then go to that runner.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn, Protocol

import torch
from vllm.config import VllmConfig
from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from qaic_core import get_plugin_manager
from qaic_core.descriptors import DeviceBackend, ExecutionPath
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    GENERATE,
    ExecutionConfig,
    OpenOptions,
    PagedStepModel,
    PoolingModel,
    PoolingSettings,
    StepModel,
)
from qaic_vllm.config import EngineSettings, engine_settings
from qaic_vllm.data_parallel import replica_note
from qaic_vllm.envs import VLLM_QAIC_MAX_CPU_THREADS, max_cpu_threads
from qaic_vllm.faults import fatal_reported
from qaic_vllm.metrics import CardMetrics, start_card_metrics, stop_card_metrics
from qaic_vllm.platform import configure_logging
from qaic_vllm.profiling import IterationTracer
from qaic_vllm.torch_device import name_device_type, neutralise_accelerator

log = logging.getLogger("qaic.vllm.worker")


class Runner(Protocol):
    """What a worker asks of the runner its role opens."""

    def execute_model(self, so: Any) -> ModelRunnerOutput | None: ...

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | AsyncModelRunnerOutput: ...

    def take_draft_token_ids(self) -> DraftTokenIds | None: ...

    def close(self) -> None: ...


class QaicWorkerBase(WorkerBase):
    """One worker per device group (vLLM sees world size 1; multi-SoC slicing is the compiler's job)."""

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
        self.settings: EngineSettings = self.engine_settings()
        self.runner: Runner | None = None
        self.backend: DeviceBackend | None = None
        self.path: ExecutionPath | None = None
        self.compile_seconds = 0.0
        self.tracer: IterationTracer | None = None
        self.card_metrics: CardMetrics | None = None

    def engine_settings(self) -> EngineSettings:
        """The compile shapes and options this engine runs with (checked at configuration time)."""
        return engine_settings(self.vllm_config)

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
        self.tracer = IterationTracer(self.backend, self.vllm_config.profiler_config.torch_profiler_dir)
        note = replica_note(self.vllm_config, self.settings.compile.device_group)
        if note:
            log.info("%s", note)
        self.card_metrics = start_card_metrics(self.vllm_config, self.settings.compile, self.backend)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Open the role's model and its runner (for ``aot``: compile for the engine's shapes, cached)."""
        with fatal_reported("loading the model"):
            assert self.backend is not None and self.path is not None, "init_device() must run first"
            self.runner = self.open_model()

    def open_model(self) -> Runner:
        """The role's seam: open its model through :meth:`open_path` and return the runner that steps it."""
        raise NotImplementedError

    def execution_config(
        self, options: OpenOptions | None = None, task: str = GENERATE, pooling: PoolingSettings | None = None
    ) -> ExecutionConfig:
        """What the execution path opens: the engine's shapes on the selected device backend."""
        assert self.backend is not None
        return self.settings.execution_config(self.model_config.model, self.backend, options, task, pooling)

    def open_path(self, config: ExecutionConfig) -> StepModel | PagedStepModel | PoolingModel:
        """Open the model through the selected execution path, timed."""
        assert self.path is not None, "init_device() must run first"
        start = time.perf_counter()
        model = self.path.open(config)
        self.compile_seconds = time.perf_counter() - start
        log.info("qaic: %s model ready in %.1fs", self.path.name, self.compile_seconds)
        return model

    def refuse(self, model: StepModel | PagedStepModel | PoolingModel, opened: str, fix: str) -> NoReturn:
        """The path opened a kind of model this worker does not step: close it and say what to choose."""
        model.close()
        assert self.path is not None
        raise QaicConfigError(f"execution path {self.path.name!r} opened {opened}: {fix}")

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=self.compile_seconds, encoder=0.0)

    def get_model(self) -> Any:
        raise NotImplementedError(
            f"the {self.settings.execution_path} execution path's model lives behind its step model; "
            "there is no torch model to hand out"
        )

    # -- per step --------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
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
            return self.runner.sample_tokens(grammar_output)

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
        raise NotImplementedError(f"LoRA is not supported on the qaic {self.settings.execution_path} path")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        stop_card_metrics(self.card_metrics)
        if self.tracer is not None:
            self.tracer.stop()
        if self.runner is not None:
            self.runner.close()  # frees the NSP cores for the next program
        self.runner = None
