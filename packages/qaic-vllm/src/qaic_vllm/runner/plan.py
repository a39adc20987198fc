"""A slot step planned: a pure function of the scheduler's output and the runner's request state.

A step runs every decoding request as ONE full-batch decode (unused rows get position -1) and its
prefill chunks of at most ``prefill_seq_len`` tokens; short chunks of different requests are
batched into one run when the program has a batched prefill.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from qaic_core.execution import StepShape
from qaic_core.observe import StepRecord
from qaic_vllm.runner.requests import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class PrefillChunk(NamedTuple):
    """Tokens ``start .. start + len(token_ids)`` of a request, written to its slot."""

    req_id: str
    slot: int
    token_ids: list[int]
    start: int


@dataclass
class StepPlan:
    """One step's device work: decode rows (slot -> token, position) and prefill chunks."""

    decode: dict[int, tuple[int, int]] = field(default_factory=dict)
    decode_reqs: list[str] = field(default_factory=list)
    """The decoding requests, in the order of ``decode``'s slots."""
    prefill: list[PrefillChunk] = field(default_factory=list)
    sample_reqs: list[str] = field(default_factory=list)
    verify: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens to verify, per decoding request (speculative decoding)."""


@dataclass(frozen=True)
class SlotLimits:
    """What bounds a slot step: the program's shapes and whether it batches short prefill chunks."""

    shape: StepShape
    prefill_batch: int
    """Chunks one batched prefill run takes (1: every chunk runs alone)."""


def plan_step(so: SchedulerOutput, requests: Mapping[str, RequestState], limits: SlotLimits) -> StepPlan:
    """The step's decode rows, prefill chunks and sampled requests for the scheduler's output."""
    plan = StepPlan()
    chunk_len = limits.shape.prefill_seq_len
    ctx_len = limits.shape.ctx_len
    spec_tokens = so.scheduled_spec_decode_tokens
    for req_id, n in so.num_scheduled_tokens.items():
        state = requests[req_id]
        start = state.num_computed
        spec = spec_tokens.get(req_id) if spec_tokens else None
        if spec:
            _plan_verify(plan, state, int(n), spec, ctx_len)
            continue
        end = start + int(n)
        if end > len(state.token_ids):
            raise RuntimeError(
                f"request {req_id}: scheduled up to token {end} but only {len(state.token_ids)} are known"
            )
        if end > ctx_len:
            raise RuntimeError(f"request {req_id} would pass ctx_len {ctx_len}")
        if n == 1 and end == len(state.token_ids) and start > 0:
            plan.decode[state.slot] = (state.token_ids[start], start)
            plan.decode_reqs.append(req_id)
        else:
            for off in range(start, end, chunk_len):
                stop = min(off + chunk_len, end)
                plan.prefill.append(PrefillChunk(req_id, state.slot, state.token_ids[off:stop], off))
        if end == len(state.token_ids):
            plan.sample_reqs.append(req_id)
    return plan


def _plan_verify(plan: StepPlan, state: RequestState, n: int, spec: list[int], ctx_len: int) -> None:
    """A decode row that also checks the drafts proposed after the request's last token."""
    start = state.num_computed
    if start + 1 != len(state.token_ids) or n != 1 + len(spec):
        raise RuntimeError(
            f"request {state.req_id}: {n} tokens scheduled with {len(spec)} drafts from position {start}, "
            f"but it holds {len(state.token_ids)} tokens"
        )
    drafts = list(itertools.takewhile(lambda t: t >= 0, spec))  # -1 pads drafts the grammar dropped
    if start + len(drafts) >= ctx_len:
        raise RuntimeError(f"request {state.req_id} would pass ctx_len {ctx_len}")
    plan.decode[state.slot] = (state.token_ids[start], start)
    plan.decode_reqs.append(state.req_id)
    plan.verify[state.req_id] = drafts
    plan.sample_reqs.append(state.req_id)


def prefill_runs(plan: StepPlan, limits: SlotLimits) -> list[list[PrefillChunk]]:
    """The step's prefill chunks as device runs: short chunks of different requests batched together.

    A chunk is batched when it fits the batched prefill's length and is its request's only chunk
    in the step (a request's chunks run in order, one at a time); the rest run alone, each on the
    shortest compiled length that holds it. A batch runs on compiled row counts that it fills
    (``StepShape.split_batch``: 3 chunks on 2 rows and then 1), so no padding rows are computed.
    """
    if limits.prefill_batch < 2 or len(plan.prefill) < 2:
        return [[chunk] for chunk in plan.prefill]
    per_request: dict[str, int] = {}
    for chunk in plan.prefill:
        per_request[chunk.req_id] = per_request.get(chunk.req_id, 0) + 1
    width = limits.shape.prefill_batch_seq_len
    runs: list[list[PrefillChunk]] = []
    batch: list[PrefillChunk] = []
    for chunk in plan.prefill:
        if per_request[chunk.req_id] == 1 and len(chunk.token_ids) <= width:
            batch.append(chunk)
            if len(batch) == limits.prefill_batch:
                runs.append(batch)
                batch = []
        else:
            runs.append([chunk])
    if batch:
        runs.append(batch)
    split: list[list[PrefillChunk]] = []
    for run in runs:
        start = 0
        for count in limits.shape.split_batch(len(run)):
            split.append(run[start : start + count])
            start += count
    return split


def step_record(plan: StepPlan, limits: SlotLimits, running: int) -> StepRecord:
    """What the step asked of the device, and what the device computed (padding included)."""
    shape = limits.shape
    runs = prefill_runs(plan, limits)
    prefill_computed = 0
    for run in runs:
        if len(run) == 1:
            prefill_computed += shape.prefill_length(len(run[0].token_ids))
        else:
            prefill_computed += shape.batched_rows(len(run)) * shape.prefill_batch_seq_len
    decode_tokens = sum(1 + len(plan.verify.get(r, ())) for r in plan.decode_reqs)
    width = shape.decode_seq_len if plan.verify else 1
    return StepRecord(
        decode_rows=len(plan.decode),
        prefill_tokens=sum(len(chunk.token_ids) for chunk in plan.prefill),
        running=running,
        decode_tokens=decode_tokens,
        decode_computed=shape.num_slots * width if plan.decode else 0,
        prefill_computed=prefill_computed,
        prefill_runs=len(runs),
    )
