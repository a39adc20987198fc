"""What the slot runner keeps per request between steps: its slot, its tokens, its sampler row.

State persists per request (keyed by req_id) as in vLLM's V1 runners: the scheduler sends new
requests whole once and afterwards only what changed. Each request owns KV slot ``block_id - 1``
(one block of ``max_model_len`` tokens per sequence).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qaic_core.execution import StepModel
from qaic_vllm.sampling import HostSampler
from qaic_vllm.speculative.proposers import Proposer

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class RequestState:
    """What the runner keeps per request between steps."""

    req_id: str
    slot: int
    token_ids: list[int]
    num_computed: int
    params: SamplingParams | None


class SlotRequests:
    """The requests a slot runner holds, kept in step with the scheduler's diff.

    A request that leaves (finished, preempted, lost to a device fault) gives its slot back to the
    step model, its row back to the sampler and its history to the proposer.
    """

    def __init__(
        self, num_slots: int, model: StepModel, sampler: HostSampler, proposer: Proposer | None
    ) -> None:
        self.num_slots = num_slots
        self.model = model
        self.sampler = sampler
        self.proposer = proposer
        self.states: dict[str, RequestState] = {}

    def __getitem__(self, req_id: str) -> RequestState:
        return self.states[req_id]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.states

    def __iter__(self) -> Iterator[str]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def get(self, req_id: str) -> RequestState | None:
        return self.states.get(req_id)

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.sampler.remove_request(state.slot)
            self.model.release_slot(state.slot)
            if self.proposer is not None:
                self.proposer.finish(req_id, state.token_ids)

    def add_new(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            self.remove(new.req_id)
            block_ids = new.block_ids[0] if new.block_ids else []
            if not block_ids:
                raise RuntimeError(f"request {new.req_id} came without a KV block; cannot pick a slot")
            slot = int(block_ids[0]) - 1
            if not 0 <= slot < self.num_slots:
                raise RuntimeError(
                    f"request {new.req_id} got block {block_ids[0]}, outside the {self.num_slots} KV slots"
                )
            tokens = list(new.prefill_token_ids or new.prompt_token_ids or [])
            prompt_len = len(new.prompt_token_ids or tokens)
            self.states[new.req_id] = RequestState(
                req_id=new.req_id,
                slot=slot,
                token_ids=tokens,
                num_computed=int(new.num_computed_tokens),
                params=new.sampling_params,
            )
            if new.sampling_params is not None:
                self.sampler.add_request(slot, prompt_len, tokens, new.sampling_params)

    def update_cached(self, cached: CachedRequestData) -> None:
        for i, req_id in enumerate(cached.req_ids):
            state = self.states.get(req_id)
            if state is None:
                continue
            state.num_computed = int(cached.num_computed_tokens[i])
            new_tokens = cached.new_token_ids[i] if i < len(cached.new_token_ids) else []
            if new_tokens:
                # Only sent when the runner did not sample them itself (pipeline parallel).
                state.token_ids.extend(t for t in new_tokens if t is not None)

    def update(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diff: requests that left, new ones, and what changed of the others."""
        self.drop_finished(so)
        for req_id in so.preempted_req_ids or ():
            self.remove(req_id)
        self.add_new(so.scheduled_new_reqs)
        self.update_cached(so.scheduled_cached_reqs)

    def drop_finished(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.remove(req_id)

    def advance(self, num_scheduled_tokens: dict[str, int]) -> None:
        """The scheduled tokens of each request are on the device now."""
        for req_id, n in num_scheduled_tokens.items():
            self.states[req_id].num_computed += int(n)
