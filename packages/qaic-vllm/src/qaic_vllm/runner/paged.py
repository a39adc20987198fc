"""The paged model runner: vLLM's scheduler output in, one flattened step of a paged-KV model out.

Typed against qaic-core's :class:`~qaic_core.execution.PagedStepModel` only (it never knows which
execution path opened the model). Each request keeps its tokens, its KV block ids (as vLLM's KV
cache manager hands them out, prefix-cache hits included) and a row of the host sampler. A step
runs every scheduled request's tokens, prefill chunks and decodes alike, as one
:class:`~qaic_core.execution.PagedBatch`; the requests whose scheduled tokens reach the end of
what they hold are sampled on the host with vLLM's semantics (:class:`qaic_vllm.sampling.HostSampler`).
A preempted request is dropped and comes back as a new one to be recomputed, as in vLLM. A device
fault costs every request that holds KV blocks (the reload loses them all): they fail or are
computed again, as the fault policy says (:class:`~qaic_vllm.runner.containment.FaultContainment`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicRuntimeError
from qaic_core.execution import PagedBatch, PagedStepModel
from qaic_core.observe import StepRecord
from qaic_vllm.runner.containment import FaultContainment
from qaic_vllm.runner.requests import PagedRequests
from qaic_vllm.runner.sample import apply_grammar_bitmask, logprobs_layout, row_logprobs
from qaic_vllm.runner_output import QaicRunnerOutput
from qaic_vllm.sampling import HostSampler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

log = logging.getLogger("qaic.vllm.runner")


@dataclass
class PagedStep:
    """One step as planned: the batch, and which requests sample from which logits row."""

    batch: PagedBatch
    req_ids: list[str]
    sample_reqs: list[str]
    decode_rows: int
    prefill_tokens: int


class PagedModelRunner:
    """Drives a :class:`PagedStepModel` from SchedulerOutputs and samples on the host."""

    def __init__(self, vllm_config: VllmConfig, model: PagedStepModel) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = model.shape.vocab_size
        self.sampler = HostSampler(vllm_config, self.max_num_reqs, self.max_model_len, self.vocab_size)
        self.requests = PagedRequests(self.max_num_reqs, self.sampler)
        self.observers = get_plugin_manager().observers()
        self.containment = FaultContainment(model.recover)
        self.pending: tuple[PagedStep, np.ndarray] | QaicRunnerOutput | None = None
        """A step waiting for ``sample_tokens`` (structured output), or its fault."""

    # -- planning -----------------------------------------------------------------------------
    def plan(self, so: SchedulerOutput) -> PagedStep:
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sample_reqs: list[str] = []
        req_ids = list(so.num_scheduled_tokens)
        decodes = prefill_tokens = 0
        for req_id in req_ids:
            n = int(so.num_scheduled_tokens[req_id])
            state = self.requests[req_id]
            start, end = state.num_computed, state.num_computed + n
            if end > len(state.token_ids):
                raise RuntimeError(
                    f"request {req_id}: scheduled up to token {end} but only {len(state.token_ids)} are known"
                )
            ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(state.block_ids)
            if end == len(state.token_ids):
                logits_indices.append(len(ids) - 1)
                sample_reqs.append(req_id)
            if n == 1 and start > 0 and end == len(state.token_ids):
                decodes += 1
            else:
                prefill_tokens += n
        copies = [(int(c.src_block_id), int(c.dst_block_id)) for c in so.kv_cache_block_copies or ()]
        batch = PagedBatch(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            logits_indices=logits_indices,
            block_copies=copies,
        )
        return PagedStep(batch, req_ids, sample_reqs, decodes, prefill_tokens)

    # -- steps --------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step; None when structured output needs the grammar first (then ``sample_tokens``)."""
        with self.observers.timed("runner"):
            return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.requests.update(so)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[])
        step = self.plan(so)
        running = len(self.requests)
        try:
            logits = self.model.submit_batch(step.batch).wait()
        except QaicRuntimeError as exc:
            failed = self.contain(exc, step.req_ids)
            if so.has_structured_output_requests:
                self.pending = failed
                return None
            return failed
        self.requests.advance(so.num_scheduled_tokens)
        if self.observers:
            self.observers.step(StepRecord(step.decode_rows, step.prefill_tokens, running))
        if so.has_structured_output_requests:
            self.pending = (step, logits)
            return None
        return self._output(step, logits, None)

    def contain(self, exc: QaicRuntimeError, req_ids: list[str]) -> QaicRunnerOutput:
        """A run failed: the reload loses every KV block, so every request held pays, not only the step's."""
        output = self.containment.contain(exc, req_ids, list(self.requests))
        for req_id in output.failed:
            self.requests.remove(req_id)
        return output

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step ``execute_model`` left pending, under the grammar's token bitmask."""
        if self.pending is None:
            raise RuntimeError("sample_tokens() called without a pending execute_model() step")
        pending, self.pending = self.pending, None
        if isinstance(pending, QaicRunnerOutput):
            return pending  # the step failed on the device
        step, logits = pending
        return self._output(step, logits, grammar_output)

    def _output(
        self, step: PagedStep, logits: np.ndarray, grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        with self.observers.timed("sampling"):
            sampled, logprobs = self._sample(step, logits, grammar)
        tokens = [sampled.get(req_id, []) for req_id in step.req_ids]
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=tokens,
            logprobs=logprobs_layout(step.req_ids, tokens, logprobs),
        )

    def _sample(
        self, step: PagedStep, logits: np.ndarray, grammar: GrammarOutput | None
    ) -> tuple[dict[str, list[int]], dict[str, LogprobsLists]]:
        rows = [i for i, r in enumerate(step.sample_reqs) if self.requests[r].params is not None]
        reqs = [step.sample_reqs[i] for i in rows]
        if not reqs:
            return {}, {}
        batch = torch.from_numpy(np.ascontiguousarray(logits[rows, : self.vocab_size]))
        if grammar is not None:
            apply_grammar_bitmask(batch, reqs, grammar)
        states = [self.requests[r] for r in reqs]
        tokens, lp = self.sampler.sample(batch, [s.row for s in states], [len(s.token_ids) for s in states])
        out: dict[str, list[int]] = {}
        lp_rows: dict[str, LogprobsLists] = {}
        for i, state in enumerate(states):
            out[state.req_id] = [tokens[i]]
            state.token_ids.append(tokens[i])
            self.sampler.append_token(state.row, tokens[i])
            if lp is not None:
                lp_rows[state.req_id] = row_logprobs(lp, i)
        return out, lp_rows

    def take_draft_token_ids(self) -> None:
        return None

    def close(self) -> None:
        self.model.close()
