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
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.execution import CLASSIFY, HIDDEN_OUTPUT, PoolingModel
from qaic_core.observe import StepRecord
from qaic_vllm.runner.containment import FaultContainment
from qaic_vllm.runner_output import QaicRunnerOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.pooling_params import PoolingParams


@dataclass
class PoolingRequest:
    req_id: str
    token_ids: list[int]
    params: PoolingParams


log = logging.getLogger("qaic.vllm.pooling")


@dataclass(frozen=True)
class _Metadata:
    """What vLLM's pooler heads read of a ``PoolingMetadata``: the requests' parameters, in order."""

    pooling_params: list[Any]


class PoolingModelRunner:
    """Runs each step's pooling requests on a :class:`PoolingModel` and applies vLLM's heads on the host."""

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
        self.containment = FaultContainment(model.recover, what="pooling request")

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
        """A run failed: the step's requests pay (a pooling model keeps no state between steps)."""
        output = self.containment.contain(exc, req_ids, ())
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        return output

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
    if pooler is None or pooler.seq_pooling_type is None:  # not resolved: vLLM's default
        return "MEAN"
    return str(pooler.seq_pooling_type)


def _head(model_config: Any, task: str) -> Any:
    """vLLM's pooler head for the task: embedding (projector, dimensions, normalize) or classifier."""
    from vllm.model_executor.layers.pooler.activations import PoolerNormalize, resolve_classifier_act_fn
    from vllm.model_executor.layers.pooler.seqwise import ClassifierPoolerHead, EmbeddingPoolerHead

    if task == CLASSIFY:
        pooler = model_config.pooler_config
        return ClassifierPoolerHead(
            classifier=None,  # the classification head runs in the program
            logit_mean=pooler.logit_mean if pooler is not None else None,
            logit_sigma=pooler.logit_sigma if pooler is not None else None,
            head_dtype=model_config.head_dtype,
            activation=resolve_classifier_act_fn(model_config, static_num_labels=False),
        )
    from qaic_vllm.compat.models import load_st_projector

    return EmbeddingPoolerHead(
        projector=load_st_projector(model_config),
        head_dtype=model_config.head_dtype,
        activation=PoolerNormalize(),
    )
