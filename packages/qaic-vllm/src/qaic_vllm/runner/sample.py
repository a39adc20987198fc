"""Sampling a step's logits on the host, the grammar's bitmask, and vLLM's logprobs layout: once for every runner."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists

from qaic_vllm.runner.logits import SampleRows, StepLogits
from qaic_vllm.runner.plan import StepPlan
from qaic_vllm.runner.requests import SlotRequests
from qaic_vllm.sampling import HostSampler

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput

Sampled = tuple[dict[str, list[int]], dict[str, LogprobsLists]]
"""Tokens drawn per request, and the logprobs rows of the requests that asked for them."""


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


def row_logprobs(lp: LogprobsLists, i: int) -> LogprobsLists:
    """Row ``i`` of a batch's logprobs, as the logprobs of one request."""
    return LogprobsLists(
        lp.logprob_token_ids[i : i + 1], lp.logprobs[i : i + 1], lp.sampled_token_ranks[i : i + 1]
    )


def logprobs_layout(
    req_ids: list[str], tokens: list[list[int]], rows: dict[str, LogprobsLists]
) -> LogprobsLists | None:
    """vLLM's layout: one row per generated token, requests in order, with each request's first row.

    The offsets (``cu_num_generated_tokens``, one per request and the total) are always given, so a
    request that sampled nothing this step (a prefill chunk) or several (verified drafts) does not
    shift the rows of the requests after it.
    """
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
    offsets.append(row)
    return LogprobsLists(ids, vals, ranks, offsets)


class SlotSampler:
    """Samples a slot step: its plain rows in one batch, its verified rows one request at a time."""

    def __init__(self, requests: SlotRequests, sampler: HostSampler, vocab_size: int) -> None:
        self.requests = requests
        self.sampler = sampler
        self.vocab_size = vocab_size

    def rows(self, plan: StepPlan) -> SampleRows:
        """The step's rows sampled in one batch (all but verified ones), known before its logits are."""
        requests = self.requests
        plain = [r for r in plan.sample_reqs if r not in plan.verify and requests[r].params is not None]
        states = [requests[r] for r in plain]
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

    def sample(
        self,
        plan: StepPlan,
        logits: StepLogits,
        grammar: GrammarOutput | None = None,
        rows: SampleRows | None = None,
        history: bool = True,
        hand_off: Callable[[np.ndarray], None] | None = None,
    ) -> Sampled:
        """Sample the step's tokens and add them to each request; ``rows`` when worked out at launch.

        ``history=False`` leaves the sampler's token history to ``record_history`` (after the next
        launch, when no request came or went in between). ``hand_off`` gets the batch's tokens (in
        ``rows`` order) as soon as they are drawn, before any request has them.
        """
        out: dict[str, list[int]] = {}
        lp_rows: dict[str, LogprobsLists] = {}
        if rows is None:
            rows = self.rows(plan)
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
                    lp_rows[req_id] = row_logprobs(lp, i)
        for req_id in plan.verify:
            self._verify(req_id, plan.verify[req_id], logits, grammar, out, lp_rows)
        return out, lp_rows

    def _verify(
        self,
        req_id: str,
        drafts: list[int],
        logits: StepLogits,
        grammar: GrammarOutput | None,
        out: dict[str, list[int]],
        lp_rows: dict[str, LogprobsLists],
    ) -> None:
        state = self.requests[req_id]
        if state.params is None:
            return
        scored = torch.from_numpy(np.ascontiguousarray(logits[req_id][:, : self.vocab_size]))
        if grammar is not None:
            apply_grammar_bitmask(
                scored, [req_id] * scored.shape[0], grammar, positions=range(scored.shape[0])
            )
        verified, lp = self.sampler.verify(scored, state.slot, len(state.token_ids), drafts)
        out[req_id] = verified
        if lp is not None:
            lp_rows[req_id] = lp
        for token in verified:
            state.token_ids.append(token)
            self.sampler.append_token(state.slot, token)

    def record_history(self, slots: list[int], tokens: list[int]) -> None:
        """Add tokens a step sampled with ``history=False`` to the sampler's history."""
        self.sampler.append_tokens(slots, tokens)
