"""vLLM's scheduler shaped for a static-shape device: prefill chunks of one token budget beside all decodes.

Each step schedules every running decode (one full-batch decode run on the device) and prefill
chunks of at most ``prefill_seq_len`` tokens each, so a long new prompt is fed in chunks between
decode steps instead of freezing the running streams. By default one prompt is in prefill at a
time, except that a burst of short prompts (each fitting the batched prefill's length) starts
together, up to the batched prefill's rows, when the program has one. ``override_qaic_config``
``max_num_partial_prefills`` N lets up to N prompts be in prefill at once (a chunk each per step):
free slots fill sooner, and the running streams wait for those prefills. When observers are
registered (the ``qaic_observers`` hook), each ``schedule()`` reports its time as the ``schedule``
phase.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.outputs import RequestError
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from qaic_core import get_plugin_manager
from qaic_vllm.compat.scheduler import ModeMatchedScheduler, fail_request, preempt, step_limits
from qaic_vllm.overrides import partial_prefills, read_overrides
from qaic_vllm.prefill import engine_prefill_shapes, prefill_budget
from qaic_vllm.runner_output import QaicRunnerOutput

log = logging.getLogger("qaic.vllm.scheduler")


class QaicScheduler(ModeMatchedScheduler):
    """Chunks of at most ``prefill_seq_len`` tokens; ``max_num_partial_prefills`` prompts in prefill at once
    (default one), and a burst of short prompts together when the program has a batched prefill.

    Under asynchronous scheduling it is vLLM's AsyncScheduler: the tokens the step in flight will
    sample are placeholders, so the next step's decodes are scheduled before that step's output comes
    back (the runner finishes the step in flight before it plans the next). Otherwise it steps as
    vLLM's plain Scheduler.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observers = get_plugin_manager().observers()
        values = read_overrides(self.vllm_config)  # checked at start-up (qaic_vllm.config.engine_settings)
        shapes = engine_prefill_shapes(self.vllm_config, values)
        self.prefill_batch = shapes.batch_size
        self.prefill_batch_seq_len = shapes.batch_seq_len
        self.max_num_partial_prefills = partial_prefills(values)
        # Prefill tokens per step: a chunk per prompt in prefill, or a full batched prefill.
        self.prefill_tokens = prefill_budget(
            self._prefill_seq_len(), self.max_num_partial_prefills, shapes.batch_tokens
        )

    def _prefill_seq_len(self) -> int:
        return int(self.scheduler_config.long_prefill_token_threshold) or int(self.max_model_len)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        with self.observers.timed("schedule"):
            return self._schedule(throttle_prefills)

    def _schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        decode_tokens = 0
        prefilling = 0
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                prefilling += 1
            else:
                decode_tokens += 1 + len(request.spec_token_ids)  # drafts are verified in the same row
        # Up to max_num_partial_prefills prompts in prefill (or a batch of short ones when none is).
        admit = max(0, self.max_num_partial_prefills - prefilling)
        if not prefilling:
            admit = max(admit, self._admissible())
        # Budget: one token (and its drafts) per decode plus the prefill chunks.
        with step_limits(
            self, max_active=len(self.running) + admit, max_tokens=decode_tokens + self.prefill_tokens
        ):
            return super().schedule(throttle_prefills)

    def _admissible(self) -> int:
        """Waiting requests one step may start: one, or up to the batched prefill's rows of short prompts."""
        if self.prefill_batch < 2:
            return 1
        count = 0
        for queue in (self.kv_holding_waiting, self.waiting):
            for request in queue:
                if request.num_tokens - request.num_computed_tokens > self.prefill_batch_seq_len:
                    return max(count, 1)
                count += 1
                if count == self.prefill_batch:
                    return count
        return max(count, 1)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """vLLM's update (the observers' ``update`` phase); a step the device failed: its requests
        end with the cause, or go back to be computed again."""
        failed = model_runner_output.failed if isinstance(model_runner_output, QaicRunnerOutput) else {}
        recompute = isinstance(model_runner_output, QaicRunnerOutput) and model_runner_output.recompute
        if failed and not recompute:
            for req_id, message in failed.items():
                request = self.requests.get(req_id)
                if request is not None and not request.is_finished():
                    fail_request(
                        self, req_id, RequestError(code="device_fault", message=message, retryable=True)
                    )
        with self.observers.timed("update"):
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        if failed and recompute:
            self._recompute(failed)
        # The fault lost every block's KV: no later request may reuse a cached prefix. The requests that
        # held blocks were failed or preempted above; any other still holding one lost its KV too and
        # goes back to be computed again.
        if failed and self.cache_config.enable_prefix_caching and not self.reset_prefix_cache():
            self.reset_prefix_cache(reset_running_requests=True)
        return outputs

    def _recompute(self, failed: dict[str, str]) -> None:
        """Preempt the requests whose KV the fault lost: they are computed again from their tokens."""
        now = time.monotonic()
        for req_id in failed:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            preempt(self, request, now)  # back to the waiting queue, KV blocks freed


class QaicPoolingScheduler(QaicScheduler):
    """For ``--runner pooling``: vLLM's own scheduling (whole prompts, up to the batch), no one-prefill-at-a-time limit."""

    def _schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        return Scheduler.schedule(self, throttle_prefills)


class QaicPagedScheduler(QaicPoolingScheduler):
    """For the eager (pyt) mode: vLLM's own scheduling over paged KV blocks, with the device-fault policy."""
