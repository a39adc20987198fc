"""vLLM's scheduler shaped for a static-shape device: one prefill chunk per step beside all decodes.

Each step schedules every running decode (one full-batch decode run on the device) and at most one
prefill chunk of ``prefill_seq_len`` tokens, so a long new prompt is fed in chunks between decode
steps instead of freezing the running streams.
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

log = logging.getLogger("qaic.vllm.scheduler")


class QaicScheduler(Scheduler):
    """At most one request in prefill at a time, at most ``prefill_seq_len`` of its tokens per step."""

    def _prefill_seq_len(self) -> int:
        return int(self.scheduler_config.long_prefill_token_threshold) or int(self.max_model_len)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        prefill_seq_len = self._prefill_seq_len()
        decodes = 0
        prefilling = False
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                prefilling = True
            else:
                decodes += 1
        saved_active = self.max_num_active_reqs
        saved_budget = self.max_num_scheduled_tokens
        # One prefill at a time: admit a waiting request only when nobody is in prefill.
        limit = len(self.running) if prefilling else len(self.running) + 1
        self.max_num_active_reqs = min(saved_active, limit)
        # Budget: one token per decode plus one prefill chunk.
        self.max_num_scheduled_tokens = min(saved_budget, decodes + prefill_seq_len)
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_active_reqs = saved_active
            self.max_num_scheduled_tokens = saved_budget
