"""Slot steps started and not yet read: a decode prepared ahead, and a step under asynchronous scheduling."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from qaic_core.errors import QaicRuntimeError
from qaic_core.execution import Pending, PreparedDecode
from qaic_vllm.runner.launch import LaunchedStep
from qaic_vllm.runner.logits import SampleRows
from qaic_vllm.runner.plan import StepPlan
from qaic_vllm.runner.requests import RequestState
from qaic_vllm.runner.sample import Sampled
from qaic_vllm.runner_output import QaicRunnerOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput

    from qaic_vllm.runner.pipeline import SlotPipeline


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
    handle: Pending[Mapping[int, np.ndarray]] | None = None
    tokens: list[int] = field(default_factory=list)
    failed: QaicRunnerOutput | None = None
    """The launch failed on the device: the output that reports it."""

    def launch(self, pipeline: SlotPipeline, sampled: np.ndarray | None = None) -> None:
        """Write the tokens the last step sampled into the prepared decode and start it.

        ``sampled``: the last step's tokens in its sampling order, as soon as they are drawn (before
        its requests have them); else each request's newest token.
        """
        tokens: list[int] | np.ndarray = (
            [state.token_ids[-1] for state in self.states] if sampled is None else sampled[self.take]
        )
        self.launched = True
        try:
            self.handle = self.prepared.submit(tokens)
        except QaicRuntimeError as exc:
            self.failed = pipeline.contain(exc, self.req_ids)
            return
        self.tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens

    def plan(self) -> StepPlan:
        """The plan of the launched decode: one row per request, each sampled."""
        return StepPlan(
            decode={
                state.slot: (token, position)
                for state, token, position in zip(self.states, self.tokens, self.positions, strict=True)
            },
            decode_reqs=self.order,
            sample_reqs=list(self.order),
        )


class InflightStep(AsyncModelRunnerOutput):
    """A step started under asynchronous scheduling; reading its output finishes and samples it."""

    def __init__(
        self,
        pipeline: SlotPipeline,
        req_ids: list[str],
        plan: StepPlan,
        launched: LaunchedStep | None,
        output: ModelRunnerOutput | None,
        rows: SampleRows | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.rows = rows
        self.history: tuple[list[int], list[int]] | None = None
        self.req_ids = req_ids
        self.plan = plan
        self.launched = launched
        self.output = output
        self.grammar: GrammarOutput | None = None
        self.sampled = False
        self.tokens: Sampled | None = None

    def settle(
        self, history: bool = True, hand_off: Callable[[np.ndarray], None] | None = None
    ) -> ModelRunnerOutput | None:
        """Wait for the device and sample the step's tokens (once): what the next step's inputs need.

        Returns the output when it is already known (a contained device fault), else None; the
        output itself is built by ``resolve``. ``history=False``: the sampler's token history waits
        for ``record_history``. ``hand_off``: given the sampled tokens first (``SlotSampler.sample``).
        """
        if self.output is not None or self.tokens is not None:
            return self.output
        pipeline = self.pipeline
        assert self.launched is not None
        try:
            logits = self.launched.finish()
        except QaicRuntimeError as exc:
            self.output = pipeline.contain(exc, self.req_ids)
            return self.output
        with pipeline.observers.timed("sampling"):
            self.tokens = pipeline.sampler.sample(
                self.plan, logits, self.grammar, self.rows, history, hand_off
            )
        if not history and self.rows is not None and self.rows.reqs:
            sampled = self.tokens[0]
            self.history = (self.rows.slots, [sampled[r][0] for r in self.rows.reqs])
        return None

    def record_history(self) -> None:
        """Add the sampled tokens to the sampler's history (once), when ``settle`` left it."""
        history, self.history = self.history, None
        if history is not None:
            self.pipeline.sampler.record_history(*history)

    def resolve(self) -> ModelRunnerOutput:
        """The step's output: waits for the device and samples first if that has not happened yet."""
        known = self.settle()
        if known is not None:
            return known
        pipeline = self.pipeline
        assert self.tokens is not None
        if pipeline.observers:
            pipeline.observers.step(pipeline.record(self.plan))
        self.output = pipeline.output(self.req_ids, self.tokens)
        return self.output

    def get_output(self) -> ModelRunnerOutput:
        """vLLM reads the output (on the multiprocess worker's output thread): after any step running now."""
        with self.pipeline.lock:
            return self.resolve()

    def get_kv_connector_output(self) -> None:
        return None
