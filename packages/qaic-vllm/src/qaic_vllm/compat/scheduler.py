"""The scheduler's seams: one step's limits, the step update of the scheduling mode, preempting, failing.

vLLM's scheduler interface has no public way to cap one step, to preempt one request or to finish one
with an error message; these reach its internals, as checked with the version in
:data:`~qaic_vllm.compat.seams.SEAMS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.outputs import RequestError
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


@contextmanager
def step_limits(scheduler: Scheduler, *, max_active: int, max_tokens: int) -> Iterator[None]:
    """Within the block, ``schedule()`` runs at most ``max_active`` requests and ``max_tokens`` tokens.

    Each is capped by vLLM's own limit, which is back in place when the block ends (seam
    ``scheduler.step_limits``).
    """
    saved_active = scheduler.max_num_active_reqs
    saved_tokens = scheduler.max_num_scheduled_tokens
    scheduler.max_num_active_reqs = min(saved_active, max_active)
    scheduler.max_num_scheduled_tokens = min(saved_tokens, max_tokens)
    try:
        yield
    finally:
        scheduler.max_num_active_reqs = saved_active
        scheduler.max_num_scheduled_tokens = saved_tokens


class ModeMatchedScheduler(AsyncScheduler):
    """vLLM's AsyncScheduler under asynchronous scheduling; the plain Scheduler's step update otherwise.

    One class serves both modes, as the platform names one scheduler class (seam ``scheduler.step_update``).
    """

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        if self.scheduler_config.async_scheduling:
            super()._update_after_schedule(scheduler_output)
        else:
            Scheduler._update_after_schedule(self, scheduler_output)


def preempt(scheduler: Scheduler, request: Request, now: float) -> None:
    """Take a running request off the running queue and back to waiting, its KV blocks freed.

    It is computed again from its tokens (seam ``scheduler.preempt``).
    """
    scheduler.running = [r for r in scheduler.running if r is not request]
    scheduler._preempt_request(request, now)


def fail_request(scheduler: Scheduler, req_id: str, error: RequestError) -> None:
    """The next ``update_from_output()`` finishes ``req_id`` with ``error`` (seam ``scheduler.fail_request``)."""
    scheduler.grammar_compile_error_reqs[req_id] = error
