"""What a runner keeps per request between steps: its row (a KV slot, or a sampler row), tokens, KV blocks.

State persists per request (keyed by req_id) as in vLLM's V1 runners: the scheduler sends new
requests whole once and afterwards only what changed. In the slot layout each request owns KV slot
``block_id - 1`` (one block of ``max_model_len`` tokens per sequence); in the paged layout its KV
lives in the blocks vLLM's KV cache manager lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qaic_core.execution import StepModel
from qaic_vllm.sampling import HostSampler
from qaic_vllm.speculative.proposers import Proposer

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class RequestState:
    """What a runner keeps per request between steps."""

    req_id: str
    row: int
    """The request's row in the host sampler; in the slot layout also its KV slot."""
    token_ids: list[int]
    num_computed: int
    params: SamplingParams | None
    block_ids: list[int] = field(default_factory=list)
    """Its KV blocks as vLLM's KV cache manager hands them out (paged layout)."""

    @property
    def slot(self) -> int:
        """The KV slot of a slot-layout request (its row)."""
        return self.row


class RequestBook:
    """The requests a runner holds, kept in step with the scheduler's diff; a role decides rows and releases."""

    def __init__(self, sampler: HostSampler) -> None:
        self.sampler = sampler
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

    def take_row(self, new: NewRequestData) -> int:
        """The row (and, for slots, the KV slot) a new request takes."""
        raise NotImplementedError

    def release(self, state: RequestState) -> None:
        """A request left: its row is free again."""
        self.sampler.remove_request(state.row)

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.release(state)

    def add_new(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            self.remove(new.req_id)
            row = self.take_row(new)
            tokens = list(new.prefill_token_ids or new.prompt_token_ids or [])
            prompt_len = len(new.prompt_token_ids or tokens)
            self.states[new.req_id] = RequestState(
                req_id=new.req_id,
                row=row,
                token_ids=tokens,
                num_computed=int(new.num_computed_tokens),
                params=new.sampling_params,
                block_ids=list(new.block_ids[0]) if new.block_ids else [],
            )
            if new.sampling_params is not None:
                self.sampler.add_request(row, prompt_len, tokens, new.sampling_params)

    def update_cached(self, cached: CachedRequestData) -> None:
        for i, req_id in enumerate(cached.req_ids):
            state = self.states.get(req_id)
            if state is None:
                continue
            state.num_computed = int(cached.num_computed_tokens[i])
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_blocks:
                state.block_ids.extend(new_blocks[0])
            new_tokens = cached.new_token_ids[i] if i < len(cached.new_token_ids) else []
            if new_tokens:  # only sent when the runner did not sample them itself (pipeline parallel)
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


class SlotRequests(RequestBook):
    """Slot layout: each request owns KV slot ``block_id - 1``; a request that leaves gives its slot back
    to the step model and its history to the proposer."""

    def __init__(
        self, num_slots: int, model: StepModel, sampler: HostSampler, proposer: Proposer | None
    ) -> None:
        super().__init__(sampler)
        self.num_slots = num_slots
        self.model = model
        self.proposer = proposer

    def take_row(self, new: NewRequestData) -> int:
        block_ids = new.block_ids[0] if new.block_ids else []
        if not block_ids:
            raise RuntimeError(f"request {new.req_id} came without a KV block; cannot pick a slot")
        slot = int(block_ids[0]) - 1
        if not 0 <= slot < self.num_slots:
            raise RuntimeError(
                f"request {new.req_id} got block {block_ids[0]}, outside the {self.num_slots} KV slots"
            )
        return slot

    def release(self, state: RequestState) -> None:
        super().release(state)
        self.model.release_slot(state.slot)
        if self.proposer is not None:
            self.proposer.finish(state.req_id, state.token_ids)


class PagedRequests(RequestBook):
    """Paged layout: a request takes any free sampler row; its KV lives in the blocks it lists."""

    def __init__(self, max_num_reqs: int, sampler: HostSampler) -> None:
        super().__init__(sampler)
        self.max_num_reqs = max_num_reqs
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def take_row(self, new: NewRequestData) -> int:
        if not self.free_rows:
            raise RuntimeError(
                f"request {new.req_id} arrived with {self.max_num_reqs} requests already held (more than --max-num-seqs)"
            )
        return self.free_rows.pop()

    def release(self, state: RequestState) -> None:
        super().release(state)
        self.free_rows.append(state.row)
