"""The slot model runner: vLLM's scheduler diff in, one static-shape step of a step model out.

Typed against qaic-core's :class:`~qaic_core.execution.StepModel`, it never knows which execution
path opened the model. It composes the parts of a step by role: the requests it holds
(:class:`~qaic_vllm.runner.requests.SlotRequests`), the planner (:func:`~qaic_vllm.runner.plan.plan_step`),
the launcher that hands a plan to the model (:class:`~qaic_vllm.runner.launch.Launcher`), the
sampler (:class:`~qaic_vllm.runner.sample.SlotSampler`) and the pipeline that owns the steps in
flight (:class:`~qaic_vllm.runner.pipeline.SlotPipeline`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput

from qaic_core import get_plugin_manager
from qaic_core.execution import BATCHED_PREFILL, StepModel
from qaic_vllm.runner.containment import FaultContainment
from qaic_vllm.runner.drafts import DraftBook
from qaic_vllm.runner.launch import Launcher
from qaic_vllm.runner.pipeline import SlotPipeline
from qaic_vllm.runner.plan import SlotLimits
from qaic_vllm.runner.requests import SlotRequests
from qaic_vllm.runner.sample import SlotSampler
from qaic_vllm.sampling import HostSampler
from qaic_vllm.speculative.proposers import Proposer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput


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
        self.proposer = proposer
        shape = model.shape
        prefill_batch = shape.prefill_batch_size if BATCHED_PREFILL in model.capabilities else 1
        self.limits = SlotLimits(shape, prefill_batch)
        host_sampler = HostSampler(vllm_config, shape.num_slots, shape.ctx_len, shape.vocab_size)
        self.requests = SlotRequests(shape.num_slots, model, host_sampler, proposer)
        self.drafts = (
            DraftBook(proposer, num_speculative_tokens, shape.ctx_len, self.requests)
            if proposer is not None
            else None
        )
        self.observers = get_plugin_manager().observers()
        self.launcher = Launcher(model, self.limits)
        self.containment = FaultContainment(model.recover)
        self.pipeline = SlotPipeline(
            requests=self.requests,
            limits=self.limits,
            launcher=self.launcher,
            sampler=SlotSampler(self.requests, host_sampler, shape.vocab_size),
            containment=self.containment,
            observers=self.observers,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            drafts=self.drafts,
        )

    @property
    def model(self) -> StepModel:
        """The step model every part of a step runs on."""
        return self.launcher.model

    @model.setter
    def model(self, model: StepModel) -> None:
        """Step another :class:`StepModel` of the same shape (one that wraps this one, for instance)."""
        self.launcher.model = model
        self.requests.model = model
        self.containment.recover = model.recover

    @property
    def async_scheduling(self) -> bool:
        return self.pipeline.async_scheduling

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run (or, under asynchronous scheduling, start) the step; None when ``sample_tokens`` follows."""
        with self.observers.timed("runner"):
            return self.pipeline.execute(so)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self.pipeline.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (vLLM's scheduler puts them in the next one)."""
        return self.drafts.take() if self.drafts is not None else None

    def close(self) -> None:
        """Close the proposer (a draft's program) and the step model (frees the device's cores)."""
        if self.proposer is not None:
            self.proposer.close()
        self.model.close()
