"""Hands a planned slot step to the step model, and holds its runs in flight until they are waited for."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qaic_core.execution import OVERLAP, Pending, StepModel
from qaic_vllm.runner.logits import StepLogits
from qaic_vllm.runner.plan import PrefillChunk, SlotLimits, StepPlan, prefill_runs

log = logging.getLogger("qaic.vllm.runner")


class LaunchedStep:
    """A step's device work in flight: at most a decode and one prefill run not yet waited for."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan
        self.logits = StepLogits()
        self.decode: Pending[Mapping[int, np.ndarray]] | None = None
        self.prefill: tuple[list[PrefillChunk], Pending[Any]] | None = None

    def take_decode(self) -> None:
        handle, self.decode = self.decode, None
        if handle is None:
            return
        rows = handle.wait()
        plan = self.plan
        if plan.verify:
            for req_id, slot in zip(plan.decode_reqs, plan.decode, strict=True):
                row = np.asarray(rows[slot])
                self.logits.rows[req_id] = row if req_id in plan.verify else row[-1]
        else:
            self.logits.decode = rows
            self.logits.decode_slots = dict(zip(plan.decode_reqs, plan.decode, strict=True))

    def take_prefill(self) -> None:
        pending, self.prefill = self.prefill, None
        if pending is None:
            return
        group, handle = pending
        result = handle.wait()
        rows = [result] if len(group) == 1 else result
        for chunk, row in zip(group, rows, strict=True):
            if row is not None:
                self.logits.rows[chunk.req_id] = np.asarray(row)

    def finish(self) -> StepLogits:
        """Wait for what is in flight; the logits of each request that samples."""
        try:
            self.take_prefill()
        except BaseException:
            self.drain()
            raise
        self.take_decode()
        return self.logits

    def drain(self) -> None:
        """After a failure: let the runs in flight finish before the device is touched again."""
        for pending in (self.prefill[1] if self.prefill else None, self.decode):
            if pending is not None:
                try:
                    pending.wait()
                except Exception as exc:
                    log.debug("a run in flight failed too: %s", exc)
        self.prefill = self.decode = None


class Launcher:
    """Starts a planned step's runs on a :class:`StepModel`: the decode first, then the prefill runs."""

    def __init__(self, model: StepModel, limits: SlotLimits) -> None:
        self.model = model
        self.limits = limits
        self.overlap = OVERLAP in model.capabilities

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Start the step's device work; the last run is left in flight (``finish()`` waits for it).

        The decode goes first and stays in flight: while the prefill runs go out one after another
        on the other exec object when the model claims ``overlap``, and while the host goes on (a
        decode-only step under asynchronous scheduling returns with its run on the device).
        Without ``overlap`` it is waited for before the first prefill run.
        """
        step = LaunchedStep(plan)
        if plan.decode:
            step.decode = self.submit_decode(plan)
            if plan.prefill and not self.overlap:
                step.take_decode()
        runs = prefill_runs(plan, self.limits)
        try:
            for i, group in enumerate(runs):
                handle: Pending[Any]
                if len(group) == 1:
                    chunk = group[0]
                    handle = self.model.submit_prefill_chunk(chunk.slot, chunk.token_ids, chunk.start)
                else:
                    handle = self.model.submit_prefill_chunks([(c.slot, c.token_ids, c.start) for c in group])
                step.prefill = (group, handle)
                if i + 1 < len(runs):
                    step.take_prefill()
        except BaseException:
            step.drain()
            raise
        return step

    def submit_decode(self, plan: StepPlan) -> Pending[Mapping[int, np.ndarray]]:
        if not plan.verify:
            return self.model.submit_decode(plan.decode)
        rows: dict[int, tuple[Sequence[int], int]] = {}
        for req_id, slot in zip(plan.decode_reqs, plan.decode, strict=True):
            token, position = plan.decode[slot]
            rows[slot] = ([token, *plan.verify.get(req_id, ())], position)
        return self.model.submit_decode_tokens(rows)

    def adopt(self, plan: StepPlan, decode: Pending[Mapping[int, np.ndarray]]) -> LaunchedStep:
        """A decode started elsewhere (prepared ahead) as the launched step of ``plan``."""
        step = LaunchedStep(plan)
        step.decode = decode
        return step
