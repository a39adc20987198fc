"""The Cloud AI worker for ``--runner pooling``: a :class:`PoolingModel` stepped by :class:`PoolingModelRunner`."""

from __future__ import annotations

from typing import Any

from vllm.v1.outputs import ModelRunnerOutput

from qaic_core.execution import OpenOptions, PoolingModel
from qaic_vllm.envs import lrt_debug
from qaic_vllm.pooling_config import pooling_settings, pooling_task
from qaic_vllm.runner.pooling import PoolingModelRunner
from qaic_vllm.worker.slot_kv import SlotKVWorker


class QaicPoolingWorker(SlotKVWorker):
    """Whole prompts in, one result each out; vLLM counts one stand-in block per sequence, as for slots."""

    def open_model(self) -> PoolingModelRunner:
        assert self.path is not None
        task = pooling_task(self.vllm_config)
        config = self.execution_config(
            OpenOptions(enable_debug_logs=lrt_debug()), task=task, pooling=pooling_settings(self.vllm_config)
        )
        model = self.open_path(config)
        if not isinstance(model, PoolingModel):
            self.refuse(model, f"no pooling model for task {task}", "choose the aot path")
        return PoolingModelRunner(self.vllm_config, model, task)

    def get_supported_tasks(self) -> tuple[str, ...]:
        runner = self.runner
        if isinstance(runner, PoolingModelRunner):
            return runner.supported_tasks
        return (pooling_task(self.vllm_config),)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        raise RuntimeError("pooling models sample no tokens")
