"""Speculative decoding's drafts: proposed after each step for the requests that decode next."""

from __future__ import annotations

from vllm.v1.outputs import DraftTokenIds

from qaic_vllm.runner.requests import SlotRequests
from qaic_vllm.speculative.proposers import Proposer


class DraftBook:
    """Asks the proposer for the next step's drafts and keeps them until vLLM's scheduler takes them."""

    def __init__(
        self, proposer: Proposer, num_speculative_tokens: int, ctx_len: int, requests: SlotRequests
    ) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.ctx_len = ctx_len
        self.requests = requests
        self.drafts: DraftTokenIds | None = None

    def propose(self, req_ids: list[str]) -> None:
        """Drafts for the next step of every request that just sampled (so is decoding)."""
        histories = {r: self.requests[r].token_ids for r in req_ids}
        slots = {r: self.requests[r].slot for r in req_ids}
        k = self.num_speculative_tokens
        room = {r: max(self.ctx_len - len(histories[r]), 0) for r in req_ids}
        drafts = self.proposer.propose({r: h for r, h in histories.items() if room[r]}, slots, k)
        self.drafts = DraftTokenIds(req_ids, [drafts.get(r, [])[: min(k, room[r])] for r in req_ids])

    def take(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (vLLM's scheduler puts them in the next one)."""
        drafts, self.drafts = self.drafts, None
        return drafts
