"""The vLLM worker for Cloud AI: compiles (or reuses) the QPC at start-up and runs the AOT runner."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from qaic_vllm.config import EngineSettings, engine_settings
from qaic_vllm.envs import VLLM_QAIC_MAX_CPU_THREADS, max_cpu_threads
from qaic_vllm.model_runner import AotModelRunner
from qaic_vllm.platform import configure_logging
from qaic_vllm.profiling import IterationTracer
from qaic_vllm.torch_device import name_device_type, neutralise_accelerator

log = logging.getLogger("qaic.vllm.worker")


def model_dir_of(model: str) -> Path:
    """A local model directory; hub names resolve only from the local cache (the card host is offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


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
        self.settings: EngineSettings = engine_settings(vllm_config)
        self.runner: AotModelRunner | None = None
        self.backend: Any = None
        self.qpc_dir: Path | None = None
        self.compile_seconds = 0.0
        self.tracer: IterationTracer | None = None

    # -- start-up -----------------------------------------------------------------------------
    def init_device(self) -> None:
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        from qaic_core import get_plugin_manager

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
        self.backend = get_plugin_manager().select_device_backend()
        log.info("qaic: device backend %r (%s)", self.backend.name, self.backend.package)
        profiler = getattr(self.vllm_config, "profiler_config", None)
        self.tracer = IterationTracer(self.backend, str(getattr(profiler, "torch_profiler_dir", "") or ""))

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Compile the model for the engine's shapes (cached), or check and use a prebuilt QPC."""
        import qaic_aot

        model_dir = model_dir_of(self.model_config.model)
        settings = self.settings.compile
        start = time.perf_counter()
        if self.settings.qpc_path is not None:
            qpc_dir = self.settings.qpc_path
            log.info("qaic: checking the prebuilt QPC %s against %s", qpc_dir, model_dir)
            qaic_aot.validate_qpc(qpc_dir, model_dir, settings)
        else:
            log.info(
                "qaic: compiling %s for full_batch_size=%d ctx_len=%d prefill_seq_len=%d (cached after the first time)",
                model_dir,
                settings.decode_batch_size,
                settings.ctx_len,
                settings.prefill_seq_len,
            )
            qpc_dir = Path(
                qaic_aot.compile_model(model_dir, settings, backend=self.backend.name, progress=True)
            )
        self.compile_seconds = time.perf_counter() - start
        self.qpc_dir = qpc_dir
        program_dir = qpc_dir / "qpc" if (qpc_dir / "qpc" / "programqpc.bin").exists() else qpc_dir
        log.info("qaic: QPC ready in %.1fs: %s", self.compile_seconds, program_dir)
        session = qaic_aot.QAICInferenceSession(
            program_dir,
            device_ids=list(settings.device_group) if settings.device_group else None,
            backend=self.backend.name,
        )
        lm = qaic_aot.CausalLM(session, settings)
        self.runner = AotModelRunner(self.vllm_config, lm)

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

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=self.compile_seconds, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self) -> Any:
        raise NotImplementedError("the AOT path runs a compiled program; there is no torch model")

    # -- per step --------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        assert self.runner is not None, "load_model() must run before execute_model()"
        tracer = self.tracer
        if tracer is not None and tracer.active and scheduler_output.total_num_scheduled_tokens > 0:
            tracer.begin_iteration()
            try:
                return self.runner.execute_model(scheduler_output)
            finally:
                tracer.end_iteration()
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        assert self.runner is not None, "load_model() must run before sample_tokens()"
        return self.runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> None:
        return None

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
        if self.runner is not None:
            session = getattr(self.runner.lm, "session", None)
            if session is not None and getattr(session, "is_active", False):
                session.deactivate()  # frees the NSP cores for the next program
        self.runner = None
