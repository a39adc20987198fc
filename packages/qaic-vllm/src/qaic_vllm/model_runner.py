"""The slot model runner: vLLM's scheduler diff in, one static-shape step of a step model out.

The runner is typed against qaic-core's :class:`~qaic_core.execution.StepModel` and never knows
which execution path opened it. State persists per request (keyed by req_id) as in vLLM's V2
runners. Each request owns KV slot ``block_id - 1`` (one block of ``max_model_len`` tokens per
sequence). A step runs all decoding requests as ONE full-batch decode (unused rows get position
-1) and its prefill chunks; when the model claims ``overlap`` the decode is in flight while the
chunks run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

from qaic_core import get_plugin_manager
from qaic_core.execution import OVERLAP, Pending, StepModel
from qaic_core.observe import StepRecord
from qaic_vllm.sampling import HostSampler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput

log = logging.getLogger("qaic.vllm.runner")


@dataclass
class RequestState:
    """What the runner keeps per request between steps."""

    req_id: str
    slot: int
    token_ids: list[int]
    num_computed: int
    params: SamplingParams | None


@dataclass
class StepPlan:
    """One step's device work: decode rows (slot -> token, position) and prefill chunks."""

    decode: dict[int, tuple[int, int]] = field(default_factory=dict)
    decode_reqs: list[str] = field(default_factory=list)
    prefill: list[tuple[str, list[int], int]] = field(default_factory=list)
    sample_reqs: list[str] = field(default_factory=list)


class SlotModelRunner:
    """Drives a slot-layout :class:`StepModel` from SchedulerOutputs and samples on the host."""

    def __init__(self, vllm_config: VllmConfig, model: StepModel) -> None:
        self.vllm_config = vllm_config
        self.model = model
        shape = model.shape
        self.full_batch_size = shape.num_slots
        self.prefill_seq_len = shape.prefill_seq_len
        self.ctx_len = shape.ctx_len
        self.vocab_size = shape.vocab_size
        self.overlap = OVERLAP in model.capabilities
        self.requests: dict[str, RequestState] = {}
        self.sampler = HostSampler(vllm_config, self.full_batch_size, self.ctx_len, self.vocab_size)
        self.observers = get_plugin_manager().observers()
        self._pending: tuple[list[str], StepPlan, dict[str, np.ndarray]] | None = None

    # -- request bookkeeping ----------------------------------------------------------------
    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.sampler.remove_request(state.slot)
            self.model.release_slot(state.slot)

    def _add_new(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            self._remove(new.req_id)
            block_ids = new.block_ids[0] if new.block_ids else []
            if not block_ids:
                raise RuntimeError(f"request {new.req_id} came without a KV block; cannot pick a slot")
            slot = int(block_ids[0]) - 1
            if not 0 <= slot < self.full_batch_size:
                raise RuntimeError(
                    f"request {new.req_id} got block {block_ids[0]}, outside the {self.full_batch_size} KV slots"
                )
            tokens = list(new.prefill_token_ids or new.prompt_token_ids or [])
            prompt_len = len(new.prompt_token_ids or tokens)
            state = RequestState(
                req_id=new.req_id,
                slot=slot,
                token_ids=tokens,
                num_computed=int(new.num_computed_tokens),
                params=new.sampling_params,
            )
            self.requests[new.req_id] = state
            if new.sampling_params is not None:
                self.sampler.add_request(slot, prompt_len, tokens, new.sampling_params)

    def _update_cached(self, cached: CachedRequestData) -> None:
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            state.num_computed = int(cached.num_computed_tokens[i])
            new_tokens = cached.new_token_ids[i] if i < len(cached.new_token_ids) else []
            if new_tokens:
                # Only sent when the runner did not sample them itself (pipeline parallel).
                state.token_ids.extend(t for t in new_tokens if t is not None)

    def update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._remove(req_id)
        for req_id in so.preempted_req_ids or ():
            self._remove(req_id)
        self._add_new(so.scheduled_new_reqs)
        self._update_cached(so.scheduled_cached_reqs)

    # -- planning and running ---------------------------------------------------------------
    def plan(self, so: SchedulerOutput) -> StepPlan:
        plan = StepPlan()
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed
            end = start + int(n)
            if end > len(state.token_ids):
                raise RuntimeError(
                    f"request {req_id}: scheduled up to token {end} but only {len(state.token_ids)} are known"
                )
            if end > self.ctx_len:
                raise RuntimeError(f"request {req_id} would pass ctx_len {self.ctx_len}")
            if n == 1 and end == len(state.token_ids) and start > 0:
                plan.decode[state.slot] = (state.token_ids[start], start)
                plan.decode_reqs.append(req_id)
            else:
                for off in range(start, end, self.prefill_seq_len):
                    stop = min(off + self.prefill_seq_len, end)
                    plan.prefill.append((req_id, state.token_ids[off:stop], off))
            if end == len(state.token_ids):
                plan.sample_reqs.append(req_id)
        return plan

    def run(self, plan: StepPlan) -> dict[str, np.ndarray]:
        """Run the step on the device; returns the logits row of each request that samples."""
        logits: dict[str, np.ndarray] = {}
        decode_handle: Pending[dict[int, np.ndarray]] | None = None
        if plan.decode:
            decode_handle = self.model.submit_decode(plan.decode)
            if not (self.overlap and plan.prefill):
                self._take_decode(plan, decode_handle.wait(), logits)
                decode_handle = None
        for req_id, tokens, start in plan.prefill:
            row = self.model.submit_prefill_chunk(self.requests[req_id].slot, tokens, start).wait()
            if row is not None:
                logits[req_id] = np.asarray(row)
        if decode_handle is not None:
            self._take_decode(plan, decode_handle.wait(), logits)
        return logits

    def _take_decode(
        self, plan: StepPlan, rows: Mapping[int, np.ndarray], out: dict[str, np.ndarray]
    ) -> None:
        for req_id in plan.decode_reqs:
            out[req_id] = np.asarray(rows[self.requests[req_id].slot])

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step; None when structured output needs the grammar first (then ``sample_tokens``)."""
        if not self.observers:
            return self._execute(so)
        start = time.perf_counter()
        try:
            return self._execute(so)
        finally:
            self.observers.phase("runner", time.perf_counter() - start)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[])
        plan = self.plan(so)
        logits = self.run(plan)
        if self.observers:
            prefill_tokens = sum(len(tokens) for _, tokens, _ in plan.prefill)
            self.observers.step(StepRecord(len(plan.decode), prefill_tokens, len(self.requests)))
        for req_id, n in so.num_scheduled_tokens.items():
            self.requests[req_id].num_computed += int(n)
        if so.has_structured_output_requests:
            self._pending = (req_ids, plan, logits)
            return None
        return self._output(req_ids, plan, logits, None)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step ``execute_model`` left pending, under the grammar's token bitmask."""
        if self._pending is None:
            raise RuntimeError("sample_tokens() called without a pending execute_model() step")
        req_ids, plan, logits = self._pending
        self._pending = None
        return self._output(req_ids, plan, logits, grammar_output)

    def _output(
        self,
        req_ids: list[str],
        plan: StepPlan,
        logits: dict[str, np.ndarray],
        grammar: GrammarOutput | None,
    ) -> ModelRunnerOutput:
        if self.observers:
            start = time.perf_counter()
            sampled = self._sample(plan, logits, grammar)
            self.observers.phase("sampling", time.perf_counter() - start)
        else:
            sampled = self._sample(plan, logits, grammar)
        index = {r: i for i, r in enumerate(req_ids)}
        tokens: list[list[int]] = [[] for _ in req_ids]
        for req_id, token in sampled[0].items():
            tokens[index[req_id]] = [token]
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=tokens, logprobs=self._logprobs(req_ids, sampled[1])
        )

    def _sample(
        self, plan: StepPlan, logits: dict[str, np.ndarray], grammar: GrammarOutput | None = None
    ) -> tuple[dict[str, int], dict[str, tuple[np.ndarray, np.ndarray, int]]]:
        reqs = [r for r in plan.sample_reqs if self.requests[r].params is not None]
        if not reqs:
            return {}, {}
        batch = torch.from_numpy(np.stack([logits[r].reshape(-1)[: self.vocab_size] for r in reqs]))
        if grammar is not None:
            apply_grammar_bitmask(batch, reqs, grammar)
        slots = [self.requests[r].slot for r in reqs]
        positions = [len(self.requests[r].token_ids) for r in reqs]
        tokens, lp = self.sampler.sample(batch, slots, positions)
        out: dict[str, int] = {}
        lp_rows: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        for i, req_id in enumerate(reqs):
            state = self.requests[req_id]
            state.token_ids.append(tokens[i])
            self.sampler.append_token(state.slot, tokens[i])
            out[req_id] = tokens[i]
            if lp is not None:
                lp_rows[req_id] = (lp.logprob_token_ids[i], lp.logprobs[i], int(lp.sampled_token_ranks[i]))
        return out, lp_rows

    def _logprobs(
        self, req_ids: list[str], rows: dict[str, tuple[np.ndarray, np.ndarray, int]]
    ) -> LogprobsLists | None:
        if not rows:
            return None
        width = max(len(ids) for ids, _, _ in rows.values())
        ids = np.zeros((len(req_ids), width), dtype=np.int64)
        vals = np.full((len(req_ids), width), float("-inf"), dtype=np.float32)
        ranks = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            if req_id in rows:
                tok, lp, rank = rows[req_id]
                ids[i, : len(tok)] = tok
                vals[i, : len(lp)] = lp
                ranks[i] = rank
        return LogprobsLists(ids, vals, ranks)


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], grammar: GrammarOutput) -> None:
    """Mask (to -inf) every token the request's grammar forbids; rows follow ``req_ids``.

    The bitmask has one row of int32 words per structured-output request (bit ``t % 32`` of word
    ``t // 32`` allows token ``t``), in ``grammar.structured_output_request_ids`` order.
    """
    rows = {req_id: i for i, req_id in enumerate(grammar.structured_output_request_ids)}
    bitmask = torch.from_numpy(np.asarray(grammar.grammar_bitmask))
    token_ids = torch.arange(logits.shape[1], dtype=torch.int64)
    for row, req_id in enumerate(req_ids):
        mask_row = rows.get(req_id)
        if mask_row is None:
            continue
        words = bitmask[mask_row, token_ids // 32]
        allowed = ((words >> (token_ids % 32)) & 1).bool()
        logits[row].masked_fill_(~allowed, float("-inf"))
