"""The slot model runner: vLLM's scheduler diff in, one static-shape step of a step model out.

The runner is typed against qaic-core's :class:`~qaic_core.execution.StepModel` and never knows
which execution path opened it. State persists per request (keyed by req_id) as in vLLM's V2
runners. Each request owns KV slot ``block_id - 1`` (one block of ``max_model_len`` tokens per
sequence). A step runs all decoding requests as ONE full-batch decode (unused rows get position
-1) and its prefill chunks; when the model claims ``overlap`` the decode is in flight while the
chunks run.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, LogprobsLists, ModelRunnerOutput

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicRuntimeError
from qaic_core.execution import BATCHED_PREFILL, OVERLAP, LogitRows, Pending, PreparedDecode, StepModel
from qaic_core.observe import StepRecord
from qaic_vllm.faults import FaultBudget, FaultSettings, QaicFatalError
from qaic_vllm.runner_output import QaicRunnerOutput
from qaic_vllm.sampling import HostSampler
from qaic_vllm.speculative.proposers import Proposer

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
    verify: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens to verify, per decoding request (speculative decoding)."""


class SlotModelRunner:
    """Drives a slot-layout :class:`StepModel` from SchedulerOutputs and samples on the host."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        model: StepModel,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.drafts: DraftTokenIds | None = None
        shape = model.shape
        self.full_batch_size = shape.num_slots
        self.prefill_seq_len = shape.prefill_seq_len
        self.ctx_len = shape.ctx_len
        self.vocab_size = shape.vocab_size
        self.overlap = OVERLAP in model.capabilities
        self.shape = shape
        self.prefill_batch = shape.prefill_batch_size if BATCHED_PREFILL in model.capabilities else 1
        self.requests: dict[str, RequestState] = {}
        self.sampler = HostSampler(vllm_config, self.full_batch_size, self.ctx_len, self.vocab_size)
        self.observers = get_plugin_manager().observers()
        self._pending: tuple[list[str], StepPlan, StepLogits] | QaicRunnerOutput | None = None
        self.async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._inflight: InflightStep | None = None
        self.fault_budget = FaultBudget(FaultSettings.from_env())

    # -- request bookkeeping ----------------------------------------------------------------
    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.sampler.remove_request(state.slot)
            self.model.release_slot(state.slot)
            if self.proposer is not None:
                self.proposer.finish(req_id, state.token_ids)

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
        spec_tokens = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed
            spec = spec_tokens.get(req_id) if spec_tokens else None
            if spec:
                self._plan_verify(plan, state, int(n), spec)
                continue
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

    def _plan_verify(self, plan: StepPlan, state: RequestState, n: int, spec: list[int]) -> None:
        """A decode row that also checks the drafts proposed after the request's last token."""
        start = state.num_computed
        if start + 1 != len(state.token_ids) or n != 1 + len(spec):
            raise RuntimeError(
                f"request {state.req_id}: {n} tokens scheduled with {len(spec)} drafts from position {start}, "
                f"but it holds {len(state.token_ids)} tokens"
            )
        drafts = list(itertools.takewhile(lambda t: t >= 0, spec))  # -1 pads drafts the grammar dropped
        if start + len(drafts) >= self.ctx_len:
            raise RuntimeError(f"request {state.req_id} would pass ctx_len {self.ctx_len}")
        plan.decode[state.slot] = (state.token_ids[start], start)
        plan.decode_reqs.append(state.req_id)
        plan.verify[state.req_id] = drafts
        plan.sample_reqs.append(state.req_id)

    def _submit_decode(self, plan: StepPlan) -> Pending[dict[int, np.ndarray]]:
        if not plan.verify:
            return self.model.submit_decode(plan.decode)
        rows: dict[int, tuple[Sequence[int], int]] = {}
        for req_id in plan.decode_reqs:
            slot = self.requests[req_id].slot
            token, position = plan.decode[slot]
            rows[slot] = ([token, *plan.verify.get(req_id, ())], position)
        return self.model.submit_decode_tokens(rows)

    def run(self, plan: StepPlan) -> StepLogits:
        """Run the step on the device; the logits of each request that samples.

        A plain row gives one logits row; a request with drafts gives ``[1 + drafts, vocab]``.
        """
        return self.launch(plan).finish()

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Start the step's device work; the last run is left in flight (``finish()`` waits for it).

        The decode goes first and stays in flight: while the prefill runs go out one after another
        on the other exec object when the model claims ``overlap``, and while the host goes on (a
        decode-only step under asynchronous scheduling returns with its run on the device).
        Without ``overlap`` it is waited for before the first prefill run.
        """
        step = LaunchedStep(self, plan)
        if plan.decode:
            step.decode = self._submit_decode(plan)
            if plan.prefill and not self.overlap:
                step.take_decode()
        runs = self.prefill_runs(plan)
        try:
            for i, group in enumerate(runs):
                if len(group) == 1:
                    req_id, tokens, start = group[0]
                    handle: Pending[Any] = self.model.submit_prefill_chunk(
                        self.requests[req_id].slot, tokens, start
                    )
                else:
                    chunks = [(self.requests[r].slot, tokens, start) for r, tokens, start in group]
                    handle = self.model.submit_prefill_chunks(chunks)
                step.prefill = (group, handle)
                if i + 1 < len(runs):
                    step.take_prefill()
        except BaseException:
            step.drain()
            raise
        return step

    def prefill_runs(self, plan: StepPlan) -> list[list[tuple[str, list[int], int]]]:
        """The step's prefill chunks as device runs: short chunks of different requests batched together.

        A chunk is batched when it fits the batched prefill's length and is its request's only chunk
        in the step (a request's chunks run in order, one at a time); the rest run alone, each on the
        shortest compiled length that holds it. A batch runs on compiled row counts that it fills
        (``StepShape.split_batch``: 3 chunks on 2 rows and then 1), so no padding rows are computed.
        """
        if self.prefill_batch < 2 or len(plan.prefill) < 2:
            return [[chunk] for chunk in plan.prefill]
        per_request: dict[str, int] = {}
        for req_id, _, _ in plan.prefill:
            per_request[req_id] = per_request.get(req_id, 0) + 1
        width = self.shape.prefill_batch_seq_len
        runs: list[list[tuple[str, list[int], int]]] = []
        batch: list[tuple[str, list[int], int]] = []
        for chunk in plan.prefill:
            if per_request[chunk[0]] == 1 and len(chunk[1]) <= width:
                batch.append(chunk)
                if len(batch) == self.prefill_batch:
                    runs.append(batch)
                    batch = []
            else:
                runs.append([chunk])
        if batch:
            runs.append(batch)
        split: list[list[tuple[str, list[int], int]]] = []
        for run in runs:
            start = 0
            for count in self.shape.split_batch(len(run)):
                split.append(run[start : start + count])
                start += count
        return split

    def _take_decode(
        self, plan: StepPlan, rows: Mapping[int, np.ndarray], out: dict[str, np.ndarray]
    ) -> None:
        for req_id in plan.decode_reqs:
            row = np.asarray(rows[self.requests[req_id].slot])
            if plan.verify:
                row = row if req_id in plan.verify else row[-1]
            out[req_id] = row

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step; None when structured output needs the grammar first (then ``sample_tokens``).

        With asynchronous scheduling the step is only started: it returns None and ``sample_tokens``
        gives an output that waits for the device when read, so vLLM schedules the next step while
        the device runs this one. The next ``execute_model`` first finishes this step (its sampled
        tokens are the next decode's inputs).
        """
        with self.observers.timed("runner"):
            return self._step(so)

    def _step(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if not self.async_scheduling:
            return self._execute(so)
        fault: QaicRunnerOutput | None = None
        prepared: NextDecode | None = None
        previous = self._inflight
        if previous is not None:
            # The next decode is built while the device still runs the step in flight; after it,
            # only what the next step needs (the device's logits, the sampled tokens) comes before
            # its launch. The sampler's history and the output vLLM reads follow the launch.
            prepared = self._prepare_next_decode(so, previous)
            self._inflight = None
            # The sampled tokens go into the prepared decode, and it starts, as soon as they are
            # drawn: adding them to the requests and the step's output follow the launch.
            hand_off = None if prepared is None else partial(self._launch_prepared, prepared)
            known = previous.settle(history=prepared is None, hand_off=hand_off)
            if isinstance(known, QaicRunnerOutput) and known.failed:
                fault = known
        if fault is not None and so.num_scheduled_tokens:
            # This step was scheduled before the fault was reported, so nothing of it runs: the
            # requests the fault already covers get no tokens (the scheduler fails or requeues them
            # with the fault's output); any other goes the same way as they do.
            req_ids = list(so.num_scheduled_tokens)
            message = next(iter(fault.failed.values()))
            failed = QaicRunnerOutput(
                req_ids=req_ids,
                sampled_token_ids=[[] for _ in req_ids],
                failed={r: message for r in req_ids if r not in fault.failed},
                recompute=fault.recompute,
            )
            for req_id in so.finished_req_ids:
                self._remove(req_id)
            self._inflight = InflightStep(self, req_ids, StepPlan(), None, failed)
            return None
        if not so.num_scheduled_tokens:
            self.update_states(so)
            return ModelRunnerOutput(req_ids=[])  # vLLM reads no sampled output for an empty step
        if prepared is not None:
            if not prepared.launched:
                self._launch_prepared(prepared)
            self._adopt_launch(prepared)
            assert previous is not None
            previous.record_history()
        else:
            self._execute_async(so)
        return None

    def _prepare_next_decode(self, so: SchedulerOutput, inflight: InflightStep) -> NextDecode | None:
        """The step's decode built before the step in flight ends, when that is all the step is.

        That holds in vLLM's steady state: the same requests decode their next token, each one the
        step in flight samples, and none arrives, finishes or is preempted. Anything else (None)
        takes the general path once the step in flight is sampled.
        """
        rows = inflight.rows
        if inflight.launched is None or inflight.output is not None or inflight.plan.verify or rows is None:
            return None
        if not so.num_scheduled_tokens:
            return None
        if (
            so.scheduled_new_reqs
            or so.finished_req_ids
            or so.preempted_req_ids
            or so.scheduled_spec_decode_tokens
        ):
            return None
        cached = so.scheduled_cached_reqs
        if len(cached.req_ids) != len(so.num_scheduled_tokens):
            return None
        order = {req_id: i for i, req_id in enumerate(rows.reqs)}  # the rows the step in flight samples
        states: list[RequestState] = []
        positions: list[int] = []
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None or state.params is None or req_id not in order:
                return None
            if so.num_scheduled_tokens.get(req_id) != 1 or (
                i < len(cached.new_token_ids) and cached.new_token_ids[i]
            ):
                return None
            position = int(cached.num_computed_tokens[i])
            if position != len(state.token_ids) or position >= self.ctx_len:
                return None  # not the token the step in flight samples
            states.append(state)
            positions.append(position)
        take = np.array([order[req_id] for req_id in cached.req_ids], dtype=np.int64)
        prepared = self.model.prepare_decode({s.slot: p for s, p in zip(states, positions, strict=True)})
        for state, position in zip(states, positions, strict=True):
            state.num_computed = position  # the scheduler's count; the decode adds one once started
        return NextDecode(
            list(so.num_scheduled_tokens), list(cached.req_ids), states, positions, prepared, take
        )

    def _launch_prepared(self, nxt: NextDecode, sampled: np.ndarray | None = None) -> None:
        """Write the tokens the last step sampled into the prepared decode and start it.

        ``sampled``: the last step's tokens in its sampling order, as soon as they are drawn (before
        its requests have them); else each request's newest token. ``_adopt_launch`` then makes
        the run the step in flight.
        """
        tokens: list[int] | np.ndarray = (
            [state.token_ids[-1] for state in nxt.states] if sampled is None else sampled[nxt.take]
        )
        nxt.launched = True
        try:
            nxt.handle = nxt.prepared.submit(tokens)
        except QaicRuntimeError as exc:
            nxt.failed = self._contain(exc, nxt.req_ids)
            return
        nxt.tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens

    def _adopt_launch(self, nxt: NextDecode) -> None:
        """The launched decode becomes the step in flight (its plan and the rows it samples)."""
        if nxt.handle is None:
            assert nxt.failed is not None
            self._inflight = InflightStep(self, nxt.req_ids, StepPlan(), None, nxt.failed)
            return
        plan = StepPlan(
            decode={
                state.slot: (token, position)
                for state, token, position in zip(nxt.states, nxt.tokens, nxt.positions, strict=True)
            },
            decode_reqs=nxt.order,
            sample_reqs=list(nxt.order),
        )
        step = LaunchedStep(self, plan)
        step.decode = nxt.handle
        for state in nxt.states:
            state.num_computed += 1
        self._inflight = InflightStep(self, nxt.req_ids, plan, step, None, self._sample_rows(plan))

    def _execute_async(self, so: SchedulerOutput) -> None:
        self.update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        plan = self.plan(so)
        try:
            launched: LaunchedStep | None = self.launch(plan)
        except QaicRuntimeError as exc:
            self._inflight = InflightStep(self, req_ids, plan, None, self._contain(exc, req_ids))
            return
        for req_id, n in so.num_scheduled_tokens.items():
            self.requests[req_id].num_computed += int(n)
        self._inflight = InflightStep(self, req_ids, plan, launched, None, self._sample_rows(plan))

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[])
        plan = self.plan(so)
        try:
            logits = self.run(plan)
        except QaicRuntimeError as exc:
            failed = self._contain(exc, req_ids)
            if so.has_structured_output_requests:
                self._pending = failed
                return None
            return failed
        if self.observers:
            self.observers.step(self._record(plan))
        for req_id, n in so.num_scheduled_tokens.items():
            self.requests[req_id].num_computed += int(n)
        if so.has_structured_output_requests:
            self._pending = (req_ids, plan, logits)
            return None
        return self._output(req_ids, plan, logits, None)

    def _record(self, plan: StepPlan) -> StepRecord:
        """What the step asked of the device, and what the device computed (padding included)."""
        shape = self.shape
        prefill_computed = 0
        for run in self.prefill_runs(plan):
            if len(run) == 1:
                prefill_computed += shape.prefill_length(len(run[0][1]))
            else:
                prefill_computed += shape.batched_rows(len(run)) * shape.prefill_batch_seq_len
        decode_tokens = sum(1 + len(plan.verify.get(r, ())) for r in plan.decode_reqs)
        width = shape.decode_seq_len if plan.verify else 1
        return StepRecord(
            decode_rows=len(plan.decode),
            prefill_tokens=sum(len(tokens) for _, tokens, _ in plan.prefill),
            running=len(self.requests),
            decode_tokens=decode_tokens,
            decode_computed=shape.num_slots * width if plan.decode else 0,
            prefill_computed=prefill_computed,
            prefill_runs=len(self.prefill_runs(plan)),
        )

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the step ``execute_model`` left pending, under the grammar's token bitmask.

        With asynchronous scheduling: an output that finishes the step when vLLM reads it.
        """
        if self.async_scheduling:
            if self._inflight is None or self._inflight.sampled:
                raise RuntimeError("sample_tokens() called without a pending execute_model() step")
            self._inflight.grammar = grammar_output
            self._inflight.sampled = True
            return self._inflight
        if self._pending is None:
            raise RuntimeError("sample_tokens() called without a pending execute_model() step")
        pending, self._pending = self._pending, None
        if isinstance(pending, QaicRunnerOutput):
            return pending  # the step failed on the device
        req_ids, plan, logits = pending
        return self._output(req_ids, plan, logits, grammar_output)

    def _contain(self, exc: QaicRuntimeError, req_ids: list[str]) -> QaicRunnerOutput:
        """A run failed: count it, reload the program, and hand the cost to the requests that held KV.

        Reloading loses every slot's KV, so every request the runner holds is affected, not only
        the step's; the scheduler fails them with the cause or computes them again (the policy).
        """
        cause = str(exc).splitlines()[0]
        log.error("qaic: device fault: %s; %d request(s) affected", cause, len(self.requests))
        self.fault_budget.record(cause)
        try:
            self.model.recover()
        except Exception as again:
            raise QaicFatalError(f"the device did not come back after '{cause}': {again}") from again
        affected = list(dict.fromkeys([*req_ids, *self.requests]))
        for req_id in affected:
            self._remove(req_id)
        recompute = self.fault_budget.settings.policy == "recompute"
        message = f"Cloud AI device fault: {cause}; the device was reloaded and the server keeps serving" + (
            "; this request is computed again" if recompute else "; retry the request"
        )
        log.warning(
            "qaic: program reloaded; %s %d request(s)",
            "recomputing" if recompute else "failing",
            len(affected),
        )
        return QaicRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            failed={req_id: message for req_id in affected},
            recompute=recompute,
        )

    def _output(
        self,
        req_ids: list[str],
        plan: StepPlan,
        logits: StepLogits,
        grammar: GrammarOutput | None,
    ) -> ModelRunnerOutput:
        with self.observers.timed("sampling"):
            sampled = self._sample(plan, logits, grammar)
        return self._build_output(req_ids, sampled)

    def _build_output(
        self, req_ids: list[str], sampled: tuple[dict[str, list[int]], dict[str, LogprobsLists]]
    ) -> ModelRunnerOutput:
        """vLLM's output of a sampled step: tokens and logprobs in ``req_ids`` order, drafts proposed."""
        index = {r: i for i, r in enumerate(req_ids)}
        tokens: list[list[int]] = [[] for _ in req_ids]
        for req_id, row in sampled[0].items():
            tokens[index[req_id]] = row
        if self.proposer is not None:
            self.drafts = self._propose(list(sampled[0]))
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=tokens, logprobs=self._logprobs(req_ids, tokens, sampled[1])
        )

    def _propose(self, req_ids: list[str]) -> DraftTokenIds:
        """Drafts for the next step of every request that just sampled (so is decoding)."""
        assert self.proposer is not None
        histories = {r: self.requests[r].token_ids for r in req_ids}
        slots = {r: self.requests[r].slot for r in req_ids}
        k = self.num_speculative_tokens
        room = {r: max(self.ctx_len - len(histories[r]), 0) for r in req_ids}
        drafts = self.proposer.propose({r: h for r, h in histories.items() if room[r]}, slots, k)
        return DraftTokenIds(req_ids, [drafts.get(r, [])[: min(k, room[r])] for r in req_ids])

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (vLLM's scheduler puts them in the next one)."""
        drafts, self.drafts = self.drafts, None
        return drafts

    def _sample_rows(self, plan: StepPlan) -> SampleRows:
        """The step's rows sampled in one batch (all but verified ones), known before its logits are."""
        plain = [r for r in plan.sample_reqs if r not in plan.verify and self.requests[r].params is not None]
        states = [self.requests[r] for r in plain]
        slots = [state.slot for state in states]
        index = np.array(slots, dtype=np.int64)
        return SampleRows(
            reqs=plain,
            states=states,
            slots=slots,
            positions=[len(state.token_ids) for state in states],
            slot_index=index,
            greedy=self.sampler.all_plain_greedy(index),
            decoded=set(plain) <= set(plan.decode_reqs),
        )

    def _sample(
        self,
        plan: StepPlan,
        logits: StepLogits,
        grammar: GrammarOutput | None = None,
        rows: SampleRows | None = None,
        history: bool = True,
        hand_off: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[dict[str, list[int]], dict[str, LogprobsLists]]:
        """Sample the step's tokens and add them to each request; ``rows`` when worked out at launch.

        ``history=False`` leaves the sampler's token history to ``record_history`` (after the next
        launch, when no request came or went in between). ``hand_off`` gets the batch's tokens (in
        ``rows`` order) as soon as they are drawn, before any request has them.
        """
        out: dict[str, list[int]] = {}
        lp_rows: dict[str, LogprobsLists] = {}
        if rows is None:
            rows = self._sample_rows(plan)
        if rows.reqs:
            lp: LogprobsLists | None = None
            if rows.greedy and grammar is None:  # the sampler's own fast path, decided at launch
                drawn = logits.argmax(rows, self.vocab_size)
            else:
                batch = logits.batch(rows)[:, : self.vocab_size]
                if grammar is not None:
                    apply_grammar_bitmask(torch.from_numpy(batch), rows.reqs, grammar)
                if rows.greedy:
                    drawn = batch.argmax(axis=1)
                else:
                    sampled, lp = self.sampler.sample(batch, rows.slots, rows.positions)
                    drawn = np.asarray(sampled, dtype=np.int64)
            if hand_off is not None:
                hand_off(drawn)
            tokens: list[int] = drawn.tolist()
            if history:
                self.sampler.append_tokens(rows.slots, tokens)
            for i, req_id in enumerate(rows.reqs):
                out[req_id] = [tokens[i]]
                rows.states[i].token_ids.append(tokens[i])
                if lp is not None:
                    lp_rows[req_id] = LogprobsLists(
                        lp.logprob_token_ids[i : i + 1],
                        lp.logprobs[i : i + 1],
                        lp.sampled_token_ranks[i : i + 1],
                    )
        for req_id in plan.verify:
            state = self.requests[req_id]
            if state.params is None:
                continue
            scored = torch.from_numpy(np.ascontiguousarray(logits[req_id][:, : self.vocab_size]))
            if grammar is not None:
                apply_grammar_bitmask(
                    scored, [req_id] * scored.shape[0], grammar, positions=range(scored.shape[0])
                )
            verified, lp = self.sampler.verify(scored, state.slot, len(state.token_ids), plan.verify[req_id])
            out[req_id] = verified
            if lp is not None:
                lp_rows[req_id] = lp
            for token in verified:
                state.token_ids.append(token)
                self.sampler.append_token(state.slot, token)
        return out, lp_rows

    def _logprobs(
        self, req_ids: list[str], tokens: list[list[int]], rows: dict[str, LogprobsLists]
    ) -> LogprobsLists | None:
        """vLLM's layout: one row per generated token, requests in order, with their offsets."""
        if not rows:
            return None
        width = max(lp.logprob_token_ids.shape[1] for lp in rows.values())
        total = sum(len(t) for t in tokens)
        ids = np.zeros((total, width), dtype=np.int64)
        vals = np.full((total, width), float("-inf"), dtype=np.float32)
        ranks = np.zeros(total, dtype=np.int64)
        offsets: list[int] = []
        row = 0
        for req_id, generated in zip(req_ids, tokens, strict=True):
            offsets.append(row)
            lp = rows.get(req_id)
            if lp is not None:
                n = len(generated)
                ids[row : row + n, : lp.logprob_token_ids.shape[1]] = lp.logprob_token_ids[:n]
                vals[row : row + n, : lp.logprobs.shape[1]] = lp.logprobs[:n]
                ranks[row : row + n] = lp.sampled_token_ranks[:n]
            row += len(generated)
        multi = any(len(t) != 1 for t in tokens)  # a prefill chunk samples nothing: rows need offsets
        return LogprobsLists(ids, vals, ranks, offsets if multi else None)


def apply_grammar_bitmask(
    logits: torch.Tensor,
    req_ids: list[str],
    grammar: GrammarOutput,
    positions: Iterable[int] | None = None,
) -> None:
    """Mask (to -inf) every token the request's grammar forbids; rows follow ``req_ids``.

    The bitmask has rows of int32 words (bit ``t % 32`` of word ``t // 32`` allows token ``t``),
    a block of ``1 + num_speculative_tokens`` rows per structured-output request in
    ``grammar.structured_output_request_ids`` order; ``positions`` picks the row of each logits
    row within its request's block (0 without speculation).
    """
    order = {req_id: i for i, req_id in enumerate(grammar.structured_output_request_ids)}
    bitmask = torch.from_numpy(np.asarray(grammar.grammar_bitmask))
    stride = max(bitmask.shape[0] // max(len(order), 1), 1)
    token_ids = torch.arange(logits.shape[1], dtype=torch.int64)
    offsets = list(positions) if positions is not None else [0] * len(req_ids)
    for row, (req_id, offset) in enumerate(zip(req_ids, offsets, strict=True)):
        block = order.get(req_id)
        if block is None:
            continue
        words = bitmask[block * stride + offset, token_ids // 32]
        allowed = ((words >> (token_ids % 32)) & 1).bool()
        logits[row].masked_fill_(~allowed, float("-inf"))


@dataclass
class NextDecode:
    """A decode prepared while the step before it is on the device; its tokens come from that step."""

    req_ids: list[str]
    """The step's requests in the scheduler's order."""
    order: list[str]
    states: list[RequestState]
    positions: list[int]
    prepared: PreparedDecode
    take: np.ndarray
    """Row of each request (in ``order``) among the rows the step before it samples."""
    launched: bool = False
    handle: Pending[dict[int, np.ndarray]] | None = None
    tokens: list[int] = field(default_factory=list)
    failed: QaicRunnerOutput | None = None
    """The launch failed on the device: the output that reports it."""


@dataclass
class SampleRows:
    """The rows of a step sampled in one batch: requests, their slots and the sampled positions."""

    reqs: list[str]
    states: list[RequestState]
    slots: list[int]
    positions: list[int]
    slot_index: np.ndarray
    greedy: bool
    """Every row is greedy without processors or logprobs: its token is the argmax of its logits."""
    decoded: bool
    """Every row is a decode row (not a prefill's last chunk): its logits are the decode's."""


class StepLogits:
    """A finished step's logits: a prefill's (or a verified decode's) by request, the decode's by slot."""

    def __init__(self) -> None:
        self.rows: dict[str, np.ndarray] = {}
        self.decode: Mapping[int, np.ndarray] | None = None
        self.decode_slots: dict[str, int] = {}

    def __getitem__(self, req_id: str) -> np.ndarray:
        row = self.rows.get(req_id)
        if row is not None:
            return row
        if self.decode is None or req_id not in self.decode_slots:
            raise KeyError(req_id)
        return np.asarray(self.decode[self.decode_slots[req_id]])

    def argmax(self, rows: SampleRows, vocab_size: int) -> np.ndarray:
        """Each row's most likely token (of the first ``vocab_size``), in ``rows`` order.

        When the rows are most of a decode's slots, the device's array is read as it is (no copy of
        the rows first) and the rows' tokens picked from all slots' argmax.
        """
        decode = self.decode
        if rows.decoded and isinstance(decode, LogitRows) and 2 * len(rows.slots) >= len(decode.matrix):
            drawn: np.ndarray = decode.matrix[:, :vocab_size].argmax(axis=1)[rows.slot_index]
        else:
            drawn = self.batch(rows)[:, :vocab_size].argmax(axis=1)
        return drawn

    def batch(self, rows: SampleRows) -> np.ndarray:
        """The logits of the rows, stacked: one take when all are the decode's."""
        decode = self.decode
        if rows.decoded and isinstance(decode, LogitRows):
            return decode.take(rows.slot_index)
        return np.stack([self[r].reshape(-1) for r in rows.reqs])


class LaunchedStep:
    """A step's device work in flight: at most a decode and one prefill run not yet waited for."""

    def __init__(self, runner: SlotModelRunner, plan: StepPlan) -> None:
        self.runner = runner
        self.plan = plan
        self.logits = StepLogits()
        self.decode: Pending[dict[int, np.ndarray]] | None = None
        self.prefill: tuple[list[tuple[str, list[int], int]], Pending[Any]] | None = None

    def take_decode(self) -> None:
        handle, self.decode = self.decode, None
        if handle is None:
            return
        rows = handle.wait()
        if self.plan.verify:
            self.runner._take_decode(self.plan, rows, self.logits.rows)
        else:
            self.logits.decode = rows
            self.logits.decode_slots = dict(zip(self.plan.decode_reqs, self.plan.decode, strict=True))

    def take_prefill(self) -> None:
        pending, self.prefill = self.prefill, None
        if pending is None:
            return
        group, handle = pending
        result = handle.wait()
        rows = [result] if len(group) == 1 else result
        for (req_id, _, _), row in zip(group, rows, strict=True):
            if row is not None:
                self.logits.rows[req_id] = np.asarray(row)

    def finish(self) -> StepLogits:
        """Wait for what is in flight; the logits of each request that samples."""
        try:
            self.take_prefill()
        except BaseException:
            self.drain()
            raise
        self.take_decode()
        return self.logits

    def drain(self) -> None:
        """After a failure: let the runs in flight finish before the device is touched again."""
        for pending in (self.prefill[1] if self.prefill else None, self.decode):
            if pending is not None:
                try:
                    pending.wait()
                except Exception as exc:
                    log.debug("a run in flight failed too: %s", exc)
        self.prefill = self.decode = None


class InflightStep(AsyncModelRunnerOutput):
    """A step started under asynchronous scheduling; reading its output finishes and samples it."""

    def __init__(
        self,
        runner: SlotModelRunner,
        req_ids: list[str],
        plan: StepPlan,
        launched: LaunchedStep | None,
        output: ModelRunnerOutput | None,
        rows: SampleRows | None = None,
    ) -> None:
        self.runner = runner
        self.rows = rows
        self._history: tuple[list[int], list[int]] | None = None
        self.req_ids = req_ids
        self.plan = plan
        self.launched = launched
        self.output = output
        self.grammar: GrammarOutput | None = None
        self.sampled = False
        self.tokens: tuple[dict[str, list[int]], dict[str, LogprobsLists]] | None = None

    def settle(
        self, history: bool = True, hand_off: Callable[[np.ndarray], None] | None = None
    ) -> ModelRunnerOutput | None:
        """Wait for the device and sample the step's tokens (once): what the next step's inputs need.

        Returns the output when it is already known (a contained device fault), else None; the
        output itself is built by ``resolve``. ``history=False``: the sampler's token history waits
        for ``record_history``. ``hand_off``: given the sampled tokens first (``_sample``).
        """
        if self.output is not None or self.tokens is not None:
            return self.output
        runner = self.runner
        assert self.launched is not None
        try:
            logits = self.launched.finish()
        except QaicRuntimeError as exc:
            self.output = runner._contain(exc, self.req_ids)
            return self.output
        with runner.observers.timed("sampling"):
            self.tokens = runner._sample(self.plan, logits, self.grammar, self.rows, history, hand_off)
        if not history and self.rows is not None and self.rows.reqs:
            sampled = self.tokens[0]
            self._history = (self.rows.slots, [sampled[r][0] for r in self.rows.reqs])
        return None

    def record_history(self) -> None:
        """Add the sampled tokens to the sampler's history (once), when ``settle`` left it."""
        history, self._history = self._history, None
        if history is not None:
            self.runner.sampler.append_tokens(*history)

    def resolve(self) -> ModelRunnerOutput:
        """The step's output: waits for the device and samples first if that has not happened yet."""
        known = self.settle()
        if known is not None:
            return known
        runner = self.runner
        assert self.tokens is not None
        if runner.observers:
            runner.observers.step(runner._record(self.plan))
        self.output = runner._build_output(self.req_ids, self.tokens)
        return self.output

    def get_output(self) -> ModelRunnerOutput:
        return self.resolve()

    def get_kv_connector_output(self) -> None:
        return None
