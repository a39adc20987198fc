"""A finished slot step's logits, and the rows of it that are sampled in one batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from qaic_core.execution import LogitRows
from qaic_vllm.runner.requests import RequestState


@dataclass
class SampleRows:
    """The rows of a step sampled in one batch: requests, their slots and the sampled positions."""

    reqs: list[str]
    states: list[RequestState]
    slots: list[int]
    positions: list[int]
    slot_index: np.ndarray
    greedy: bool
    """Every row is greedy without processors or logprobs: its token is the argmax of its logits."""
    decoded: bool
    """Every row is a decode row (not a prefill's last chunk): its logits are the decode's."""


class StepLogits:
    """A finished step's logits: a prefill's (or a verified decode's) by request, the decode's by slot."""

    def __init__(self) -> None:
        self.rows: dict[str, np.ndarray] = {}
        self.decode: Mapping[int, np.ndarray] | None = None
        self.decode_slots: dict[str, int] = {}

    def __getitem__(self, req_id: str) -> np.ndarray:
        row = self.rows.get(req_id)
        if row is not None:
            return row
        if self.decode is None or req_id not in self.decode_slots:
            raise KeyError(req_id)
        return np.asarray(self.decode[self.decode_slots[req_id]])

    def argmax(self, rows: SampleRows, vocab_size: int) -> np.ndarray:
        """Each row's most likely token (of the first ``vocab_size``), in ``rows`` order.

        When the rows are most of a decode's slots, the device's array is read as it is (no copy of
        the rows first) and the rows' tokens picked from all slots' argmax.
        """
        decode = self.decode
        if rows.decoded and isinstance(decode, LogitRows) and 2 * len(rows.slots) >= len(decode.matrix):
            drawn: np.ndarray = decode.matrix[:, :vocab_size].argmax(axis=1)[rows.slot_index]
        else:
            drawn = self.batch(rows)[:, :vocab_size].argmax(axis=1)
        return drawn

    def batch(self, rows: SampleRows) -> np.ndarray:
        """The logits of the rows, stacked: one take when all are the decode's."""
        decode = self.decode
        if rows.decoded and isinstance(decode, LogitRows):
            return decode.take(rows.slot_index)
        return np.stack([self[r].reshape(-1) for r in rows.reqs])
