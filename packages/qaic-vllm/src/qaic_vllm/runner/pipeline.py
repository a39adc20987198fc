"""The slot runner's steps from scheduler output to vLLM's output, synchronous and asynchronous alike.

Under synchronous scheduling a step runs to its logits at once; with structured output the
sampling waits for the grammar (``sample_tokens``). Under asynchronous scheduling a step is only
started: ``sample_tokens`` gives an output that waits for the device when read, so vLLM schedules
the next step while the device runs this one; the next ``execute`` first finishes the step in
flight (its sampled tokens are the next decode's inputs). In vLLM's steady state (the same requests
decode again) the next decode is prepared before the step in flight ends and started as soon as
its tokens are drawn.

vLLM's multiprocess executor (data parallelism, or ``--distributed-executor-backend mp``) reads an
asynchronous output on its own thread while the next ``execute_model`` runs: :attr:`SlotPipeline.lock`
makes the two take turns, as they do in one thread under the single-process executor.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from qaic_core.errors import QaicRuntimeError
from qaic_core.observe import Observers, StepRecord
from qaic_vllm.runner.containment import FaultContainment
from qaic_vllm.runner.drafts import DraftBook
from qaic_vllm.runner.inflight import InflightStep, NextDecode
from qaic_vllm.runner.launch import Launcher
from qaic_vllm.runner.logits import StepLogits
from qaic_vllm.runner.plan import SlotLimits, StepPlan, plan_step, step_record
from qaic_vllm.runner.requests import RequestState, SlotRequests
from qaic_vllm.runner.sample import Sampled, SlotSampler, logprobs_layout
from qaic_vllm.runner_output import QaicRunnerOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput


class SlotPipeline:
    """Owns the slot runner's steps in flight: the one waiting for its grammar, the one on the device."""

    def __init__(
        self,
        requests: SlotRequests,
        limits: SlotLimits,
        launcher: Launcher,
        sampler: SlotSampler,
        containment: FaultContainment,
        observers: Observers,
        async_scheduling: bool,
        drafts: DraftBook | None = None,
    ) -> None:
        self.requests = requests
        self.limits = limits
        self.launcher = launcher
        self.sampler = sampler
        self.containment = containment
        self.observers = observers
        self.async_scheduling = async_scheduling
        self.drafts = drafts
        self.pending: tuple[list[str], StepPlan, StepLogits] | QaicRunnerOutput | None = None
        """A synchronous step waiting for ``sample_tokens`` (structured output), or its fault."""
        self.inflight: InflightStep | None = None
        """The step started under asynchronous scheduling and not yet read."""
        self.lock = threading.RLock()
        """Held by each step and by reading a step's output: vLLM's multiprocess worker reads outputs
        on another thread than the one that runs the next step."""

    # -- what the steps in flight call back ----------------------------------------------------
    def contain(self, exc: QaicRuntimeError, req_ids: list[str]) -> QaicRunnerOutput:
        """A run failed: reloading loses every slot's KV, so every request held pays, not only the step's."""
        output = self.containment.contain(exc, req_ids, list(self.requests))
        for req_id in output.failed:
            self.requests.remove(req_id)
        return output

    def record(self, plan: StepPlan) -> StepRecord:
        return step_record(plan, self.limits, len(self.requests))

    def output(self, req_ids: list[str], sampled: Sampled) -> ModelRunnerOutput:
        """vLLM's output of a sampled step: tokens and logprobs in ``req_ids`` order, drafts proposed."""
        index = {r: i for i, r in enumerate(req_ids)}
        tokens: list[list[int]] = [[] for _ in req_ids]
        for req_id, row in sampled[0].items():
            tokens[index[req_id]] = row
        if self.drafts is not None:
            self.drafts.propose(list(sampled[0]))
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=tokens, logprobs=logprobs_layout(req_ids, tokens, sampled[1])
        )

    # -- steps ---------------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        with self.lock:
            return self._execute(so) if not self.async_scheduling else self._execute_next(so)

    def _execute_next(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """An asynchronous step: finish the step in flight (its tokens are this one's inputs), start this one."""
        fault: QaicRunnerOutput | None = None
        prepared: NextDecode | None = None
        previous = self.inflight
        if previous is not None:
            # The next decode is built while the device still runs the step in flight; after it,
            # only what the next step needs (the device's logits, the sampled tokens) comes before
            # its launch. The sampler's history and the output vLLM reads follow the launch.
            prepared = self._prepare_next_decode(so, previous)
            self.inflight = None
            # The sampled tokens go into the prepared decode, and it starts, as soon as they are
            # drawn: adding them to the requests and the step's output follow the launch.
            hand_off = None if prepared is None else partial(prepared.launch, self)
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
            self.requests.drop_finished(so)
            self.inflight = InflightStep(self, req_ids, StepPlan(), None, failed)
            return None
        if not so.num_scheduled_tokens:
            self.requests.update(so)
            return ModelRunnerOutput(req_ids=[])  # vLLM reads no sampled output for an empty step
        if prepared is not None:
            if not prepared.launched:
                prepared.launch(self)
            self._adopt(prepared)
            assert previous is not None
            previous.record_history()
        else:
            self._execute_async(so)
        return None

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the step ``execute`` left pending, under the grammar's token bitmask.

        With asynchronous scheduling: an output that finishes the step when vLLM reads it.
        """
        with self.lock:
            return self._sample_tokens(grammar_output)

    def _sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        if self.async_scheduling:
            if self.inflight is None or self.inflight.sampled:
                raise RuntimeError("sample_tokens() called without a pending execute_model() step")
            self.inflight.grammar = grammar_output
            self.inflight.sampled = True
            return self.inflight
        if self.pending is None:
            raise RuntimeError("sample_tokens() called without a pending execute_model() step")
        pending, self.pending = self.pending, None
        if isinstance(pending, QaicRunnerOutput):
            return pending  # the step failed on the device
        req_ids, plan, logits = pending
        return self._sampled_output(req_ids, plan, logits, grammar_output)

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
            if position != len(state.token_ids) or position >= self.limits.shape.ctx_len:
                return None  # not the token the step in flight samples
            states.append(state)
            positions.append(position)
        take = np.array([order[req_id] for req_id in cached.req_ids], dtype=np.int64)
        prepared = self.launcher.model.prepare_decode(
            {s.slot: p for s, p in zip(states, positions, strict=True)}
        )
        for state, position in zip(states, positions, strict=True):
            state.num_computed = position  # the scheduler's count; the decode adds one once started
        return NextDecode(
            list(so.num_scheduled_tokens), list(cached.req_ids), states, positions, prepared, take
        )

    def _adopt(self, nxt: NextDecode) -> None:
        """The launched decode becomes the step in flight (its plan and the rows it samples)."""
        if nxt.handle is None:
            assert nxt.failed is not None
            self.inflight = InflightStep(self, nxt.req_ids, StepPlan(), None, nxt.failed)
            return
        plan = nxt.plan()
        step = self.launcher.adopt(plan, nxt.handle)
        for state in nxt.states:
            state.num_computed += 1
        self.inflight = InflightStep(self, nxt.req_ids, plan, step, None, self.sampler.rows(plan))

    def _execute_async(self, so: SchedulerOutput) -> None:
        self.requests.update(so)
        req_ids = list(so.num_scheduled_tokens)
        plan = plan_step(so, self.requests.states, self.limits)
        try:
            launched = self.launcher.launch(plan)
        except QaicRuntimeError as exc:
            self.inflight = InflightStep(self, req_ids, plan, None, self.contain(exc, req_ids))
            return
        self.requests.advance(so.num_scheduled_tokens)
        self.inflight = InflightStep(self, req_ids, plan, launched, None, self.sampler.rows(plan))

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.requests.update(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[])
        plan = plan_step(so, self.requests.states, self.limits)
        try:
            logits = self.launcher.launch(plan).finish()
        except QaicRuntimeError as exc:
            failed = self.contain(exc, req_ids)
            if so.has_structured_output_requests:
                self.pending = failed
                return None
            return failed
        if self.observers:
            self.observers.step(self.record(plan))
        self.requests.advance(so.num_scheduled_tokens)
        if so.has_structured_output_requests:
            self.pending = (req_ids, plan, logits)
            return None
        return self._sampled_output(req_ids, plan, logits, None)

    def _sampled_output(
        self, req_ids: list[str], plan: StepPlan, logits: StepLogits, grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        with self.observers.timed("sampling"):
            sampled = self.sampler.sample(plan, logits, grammar)
        return self.output(req_ids, sampled)
