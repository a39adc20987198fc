"""The draft-model proposer: a small model's own program on the same devices, drafting greedily.

Each request keeps the slot it has in the target. The draft's KV holds the tokens it was fed;
after verification only the prefix that the target kept is valid (later positions are simply
overwritten, since attention reads positions up to the current one). Each step feeds the tokens
the draft has not seen (one or two in one run: its program takes two tokens per row), then
decodes greedily until it has ``k`` drafts, all requests in one full-batch run per token.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from qaic_core.execution import StepModel

log = logging.getLogger("qaic.vllm.speculative")


class DraftModelProposer:
    """Drafts ``k`` tokens per request with a draft program (a :class:`StepModel`)."""

    def __init__(self, model: StepModel) -> None:
        self.model = model
        self.fed: dict[str, list[int]] = {}
        """Tokens each request's draft slot holds, in position order."""

    def propose(
        self, histories: Mapping[str, Sequence[int]], slots: Mapping[str, int], k: int
    ) -> dict[str, list[int]]:
        if not histories or k < 1:
            return {}
        rows: dict[int, tuple[list[int], int]] = {}
        for req_id, tokens in histories.items():
            history = list(tokens)
            slot = slots[req_id]
            valid = min(_common_prefix(self.fed.get(req_id, []), history), len(history) - 1)
            missing = history[valid:]
            if len(missing) > 2:
                self._prefill(slot, missing[:-1], valid)
                valid += len(missing) - 1
                missing = missing[-1:]
            rows[slot] = (missing, valid)
            self.fed[req_id] = history
        by_slot = {slots[req_id]: req_id for req_id in histories}
        drafts: dict[str, list[int]] = {req_id: [] for req_id in histories}
        logits = self.model.submit_decode_tokens(rows).wait()
        for slot, row in logits.items():
            drafts[by_slot[slot]].append(int(np.argmax(row[-1])))
        positions = {slot: start + len(tokens) for slot, (tokens, start) in rows.items()}
        ctx_len = self.model.shape.ctx_len
        for _ in range(k - 1):
            step = {
                slot: (drafts[by_slot[slot]][-1], positions[slot])
                for slot in rows
                if positions[slot] < ctx_len
            }
            if not step:
                break
            out = self.model.submit_decode(step).wait()
            for slot, row in out.items():
                req_id = by_slot[slot]
                self.fed[req_id].append(drafts[req_id][-1])
                drafts[req_id].append(int(np.argmax(row)))
                positions[slot] += 1
        return drafts

    def _prefill(self, slot: int, tokens: list[int], start: int) -> None:
        chunk = self.model.shape.prefill_seq_len
        for offset in range(0, len(tokens), chunk):
            self.model.submit_prefill_chunk(slot, tokens[offset : offset + chunk], start + offset).wait()

    def finish(self, req_id: str, history: Sequence[int]) -> None:
        self.fed.pop(req_id, None)

    def close(self) -> None:
        self.fed.clear()
        self.model.close()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
