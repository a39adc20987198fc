"""A failed device run contained: counted, the model reloaded, its cost handed to the requests that held state.

Every runner (slot, paged, pooling) follows the same policy (``VLLM_QAIC_FAULT_POLICY``): the
requests that lost their state fail with the cause (``fail``) or go back to be computed again
from their tokens (``recompute``); past ``VLLM_QAIC_MAX_DEVICE_FAULTS`` the engine stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicRuntimeError
from qaic_core.types import QStatus
from qaic_vllm.faults import FaultBudget, FaultSettings, QaicFatalError
from qaic_vllm.runner_output import QaicRunnerOutput

log = logging.getLogger("qaic.vllm.runner")


class FaultContainment:
    """Turns a device fault into a step output that names the requests it cost."""

    def __init__(self, recover: Callable[[], None], what: str = "request") -> None:
        self.recover = recover
        self.what = what
        self.budget = FaultBudget(FaultSettings.from_env())
        self.observers = get_plugin_manager().observers()

    @property
    def recompute(self) -> bool:
        return self.budget.settings.policy == "recompute"

    def contain(self, exc: QaicRuntimeError, req_ids: list[str], held: Iterable[str]) -> QaicRunnerOutput:
        """Count the fault, reload the model, and report ``req_ids`` (the step's) and ``held`` (every
        request whose state on the device the reload loses) as failed or to be recomputed.

        The caller forgets the affected requests (``output.failed``) afterwards.
        """
        cause = str(exc).splitlines()[0]
        affected = list(dict.fromkeys([*req_ids, *held]))
        log.error("qaic: device fault: %s; %d %s(s) affected", cause, len(affected), self.what)
        self.observers.device_fault(fault_kind(exc))
        self.budget.record(cause)
        try:
            self.recover()
        except Exception as again:
            raise QaicFatalError(
                f"the device did not come back after '{cause}': {again}; check the card (qaic-util) "
                "and start the server again"
            ) from again
        self.observers.program_reloaded()
        recompute = self.recompute
        message = f"Cloud AI device fault: {cause}; the device was reloaded and the server keeps serving" + (
            "; this request is computed again" if recompute else "; retry the request"
        )
        log.warning(
            "qaic: program reloaded; %s %d %s(s)",
            "recomputing" if recompute else "failing",
            len(affected),
            self.what,
        )
        return QaicRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            failed=dict.fromkeys(affected, message),
            recompute=recompute,
        )


def fault_kind(exc: QaicRuntimeError) -> str:
    """The fault's kind for metrics: the runtime status' name in lower case, ``unknown`` without one."""
    try:
        return QStatus(exc.status).name.lower() if exc.status is not None else "unknown"
    except ValueError:
        return f"status_{exc.status}"
