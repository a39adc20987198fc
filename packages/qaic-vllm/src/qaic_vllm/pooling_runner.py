"""vLLM's pooling runner on Cloud AI: whole prompts in batches of the compiled size, pooled results out.

The runner is typed against qaic-core's :class:`~qaic_core.execution.PoolingModel`. Each step's
requests are grouped by the smallest compiled ``embed_seq_len`` that holds them, and each group
runs in batches of the compiled batch (``--max-num-seqs``). The program returns hidden states
(``pooling_device: cpu``), pooled vectors (``qaic``) or class logits; vLLM's own pooler heads
then apply each request's parameters on the host: the sentence-transformers projector,
``dimensions`` (matryoshka models), ``normalize`` and a classifier's activation.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.execution import (
    CLASSIFY,
    HIDDEN_OUTPUT,
    ExecutionConfig,
    OpenOptions,
    PoolingModel,
)
from qaic_core.observe import StepRecord
from qaic_vllm.config import model_dir_of
from qaic_vllm.envs import lrt_debug
from qaic_vllm.faults import FaultBudget, FaultSettings, QaicFatalError, fatal_reported
from qaic_vllm.pooling_config import pooling_settings, pooling_task
from qaic_vllm.runner_output import QaicRunnerOutput
from qaic_vllm.scheduler import QaicScheduler
from qaic_vllm.worker import QaicWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.pooling_params import PoolingParams

log = logging.getLogger("qaic.vllm.pooling")


@dataclass
class PoolingRequest:
    req_id: str
    token_ids: list[int]
    params: PoolingParams


@dataclass(frozen=True)
class _Metadata:
    """What vLLM's pooler heads read of a ``PoolingMetadata``: the requests' parameters, in order."""

    pooling_params: list[Any]


class PoolingModelRunner:
    """Runs each step's pooling requests on a :class:`PoolingModel` and applies vLLM's heads on the host."""

    proposer = None
    """No speculative decoding for pooling models (the worker's shutdown looks for one)."""

    def __init__(self, vllm_config: VllmConfig, model: PoolingModel, task: str) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.task = task
        self.shape = model.pooling_shape
        model_config = vllm_config.model_config
        self.seq_pooling = _seq_pooling_type(model_config)
        self.head = _head(model_config, task)
        self.requests: dict[str, PoolingRequest] = {}
        self.observers = get_plugin_manager().observers()
        self.fault_budget = FaultBudget(FaultSettings.from_env())

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return (self.task,)

    # -- per step --------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with self.observers.timed("runner"):
            return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in [*so.finished_req_ids, *(so.preempted_req_ids or ())]:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is None:
                raise RuntimeError(f"request {new.req_id} reached a pooling model without pooling parameters")
            tokens = list(new.prefill_token_ids or new.prompt_token_ids or [])
            self.requests[new.req_id] = PoolingRequest(new.req_id, tokens, new.pooling_params)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[])
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if int(n) != len(request.token_ids):
                raise RuntimeError(
                    f"request {req_id}: {n} of {len(request.token_ids)} tokens scheduled; a pooling model on "
                    "Cloud AI runs whole prompts (chunked prefill must be off)"
                )
        try:
            rows = self.run([self.requests[r] for r in req_ids])
        except QaicRuntimeError as exc:
            return self._contain(exc, req_ids)
        outputs = self.finish([self.requests[r] for r in req_ids], rows)
        for req_id in req_ids:
            self.requests.pop(req_id, None)  # a pooling request is done after its one step
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids], pooler_output=list(outputs)
        )

    def run(self, requests: Sequence[PoolingRequest]) -> list[np.ndarray]:
        """The program's rows for ``requests``: grouped by bucket, in batches of the compiled batch."""
        plan = plan_runs([len(r.token_ids) for r in requests], self.shape.seq_lens, self.shape.batch_size)
        rows: dict[int, np.ndarray] = {}
        for _, members in plan:
            results = self.model.submit([requests[i].token_ids for i in members]).wait()
            rows.update(zip(members, results, strict=True))
        if self.observers:
            tokens = sum(len(r.token_ids) for r in requests)
            self.observers.step(StepRecord(0, tokens, len(requests)))
        log.debug("qaic: %d pooling request(s) in %d run(s): %s", len(requests), len(plan), plan)
        return [rows[i] for i in range(len(requests))]

    def finish(self, requests: Sequence[PoolingRequest], rows: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """vLLM's pooling on the host: sequence pooling of hidden states, then the task's head."""
        if self.shape.output == HIDDEN_OUTPUT:
            pooled = [self._pool(row) for row in rows]
        else:
            pooled = [np.asarray(row, np.float32) for row in rows]
        data = torch.from_numpy(np.stack(pooled))
        out = self.head(data, _Metadata([r.params for r in requests]))
        if isinstance(out, torch.Tensor):
            return list(out.float().unbind(0))
        return [t.float() for t in out]

    def _pool(self, hidden: np.ndarray) -> np.ndarray:
        if self.seq_pooling == "CLS":
            return np.asarray(hidden[0], np.float32)
        if self.seq_pooling == "LAST":
            return np.asarray(hidden[-1], np.float32)
        return np.asarray(hidden, np.float32).mean(axis=0)

    def _contain(self, exc: QaicRuntimeError, req_ids: list[str]) -> QaicRunnerOutput:
        """A run failed: count it, reload the program and fail (or recompute) the step's requests."""
        cause = str(exc).splitlines()[0]
        log.error("qaic: device fault: %s; %d pooling request(s) affected", cause, len(req_ids))
        self.fault_budget.record(cause)
        try:
            self.model.recover()
        except Exception as again:
            raise QaicFatalError(f"the device did not come back after '{cause}': {again}") from again
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        recompute = self.fault_budget.settings.policy == "recompute"
        message = f"Cloud AI device fault: {cause}; the device was reloaded and the server keeps serving" + (
            "; this request is computed again" if recompute else "; retry the request"
        )
        return QaicRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            failed=dict.fromkeys(req_ids, message),
            recompute=recompute,
        )

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        raise RuntimeError("pooling models sample no tokens")

    def take_draft_token_ids(self) -> None:
        return None

    def close(self) -> None:
        self.model.close()


def plan_runs(lengths: Sequence[int], seq_lens: Sequence[int], batch: int) -> list[tuple[int, list[int]]]:
    """``(seq_len, request indices)`` per run: each request on the smallest length that holds it,
    each run at most ``batch`` requests, shorter lengths first."""
    groups: dict[int, list[int]] = defaultdict(list)
    ordered = sorted(seq_lens)
    for i, n in enumerate(lengths):
        fits = [s for s in ordered if n <= s]
        if not fits:
            raise QaicConfigError(
                f"a prompt of {n} tokens is longer than the longest embed_seq_len {ordered[-1]}: shorten it"
            )
        groups[fits[0]].append(i)
    return [
        (seq_len, groups[seq_len][start : start + batch])
        for seq_len in sorted(groups)
        for start in range(0, len(groups[seq_len]), batch)
    ]


def _seq_pooling_type(model_config: Any) -> str:
    pooler = model_config.pooler_config
    try:
        return str(pooler.get_seq_pooling_type()) if pooler is not None else "MEAN"
    except Exception:
        return str(getattr(pooler, "seq_pooling_type", None) or "MEAN")


def _head(model_config: Any, task: str) -> Any:
    """vLLM's pooler head for the task: embedding (projector, dimensions, normalize) or classifier."""
    from vllm.model_executor.layers.pooler.activations import PoolerNormalize, resolve_classifier_act_fn
    from vllm.model_executor.layers.pooler.seqwise import ClassifierPoolerHead, EmbeddingPoolerHead

    if task == CLASSIFY:
        pooler = model_config.pooler_config
        return ClassifierPoolerHead(
            classifier=None,  # the classification head runs in the program
            logit_mean=getattr(pooler, "logit_mean", None),
            logit_sigma=getattr(pooler, "logit_sigma", None),
            head_dtype=model_config.head_dtype,
            activation=resolve_classifier_act_fn(model_config, static_num_labels=False),
        )
    from vllm.model_executor.models.adapters import _load_st_projector

    return EmbeddingPoolerHead(
        projector=_load_st_projector(model_config),
        head_dtype=model_config.head_dtype,
        activation=PoolerNormalize(),
    )


class QaicPoolingScheduler(QaicScheduler):
    """vLLM's own scheduling (whole prompts, up to the batch): no one-prefill-at-a-time limit."""

    def _schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        return Scheduler.schedule(self, throttle_prefills)


class QaicPoolingWorker(QaicWorker):
    """The Cloud AI worker for ``--runner pooling``: opens a :class:`PoolingModel` through the execution path."""

    pooling_runner: PoolingModelRunner | None = None

    def _load_model(self) -> None:
        assert self.backend is not None and self.path is not None, "init_device() must run first"
        task = pooling_task(self.vllm_config)
        config = ExecutionConfig(
            model_dir=model_dir_of(self.model_config.model),
            settings=self.settings.compile,
            device=self.backend,
            qpc_path=self.settings.qpc_path,
            dtype=self.settings.dtype,
            progress=True,
            options=OpenOptions(enable_debug_logs=lrt_debug()),
            task=task,
            pooling=pooling_settings(self.vllm_config),
        )
        start = time.perf_counter()
        model = self.path.open(config)
        self.compile_seconds = time.perf_counter() - start
        if not isinstance(model, PoolingModel):
            model.close()
            raise QaicConfigError(
                f"execution path {self.path.name!r} opened no pooling model for task {task}: choose the aot path"
            )
        log.info("qaic: %s pooling model ready in %.1fs", self.path.name, self.compile_seconds)
        self.pooling_runner = PoolingModelRunner(self.vllm_config, model, task)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        blocks = int(kv_cache_config.num_blocks)
        if blocks < self.settings.compile.decode_batch_size + 1:
            raise RuntimeError(
                f"vLLM allotted {blocks} KV blocks; Cloud AI needs max_num_seqs + 1 = "
                f"{self.settings.compile.decode_batch_size + 1}"
            )

    def get_supported_tasks(self) -> tuple[str, ...]:
        runner = self.pooling_runner
        return runner.supported_tasks if runner is not None else (pooling_task(self.vllm_config),)

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        runner = self.pooling_runner
        assert runner is not None, "load_model() must run before execute_model()"
        with fatal_reported("serving"):
            return runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        raise RuntimeError("pooling models sample no tokens")

    def take_draft_token_ids(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.stop()
        if self.pooling_runner is not None:
            self.pooling_runner.close()
        self.pooling_runner = None
