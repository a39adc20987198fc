"""The slot runner's side of vLLM's KV connector API (``--kv-transfer-config``).

vLLM's own runners call the worker-side connector hooks around each forward; the slot runner
has no forward context or attention layers, so the worker calls them around each step through
:class:`ConnectorDriver`: bind the step's connector metadata and start loads before the step,
then ``wait_for_save`` and collect finished transfers after it. The connector is reached only
through vLLM's API (``ensure_kv_transfer_initialized`` / ``get_kv_transfer_group``); it gets the
step model through qaic-core's :class:`~qaic_core.kv_transfer.StepModelConsumer` seam.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qaic_core.errors import QaicConfigError
from qaic_core.execution import StepModel
from qaic_core.kv_transfer import StepModelConsumer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

log = logging.getLogger("qaic.vllm.kv_transfer")


class ConnectorDriver:
    """Calls the worker-side connector hooks around each step of the slot runner."""

    def __init__(self, vllm_config: VllmConfig, connector: Any) -> None:
        self.vllm_config = vllm_config
        self.connector = connector
        self._pending: KVConnectorOutput | None = None

    def step(
        self, so: SchedulerOutput, run: Callable[[SchedulerOutput], ModelRunnerOutput | None]
    ) -> ModelRunnerOutput | None:
        """``run(so)`` between the hooks; the transfers' outcome rides on the step's output.

        A step that leaves sampling to ``sample_tokens`` (structured output) returns None: its
        outcome waits for :meth:`attach`.
        """
        self.before_step(so)
        output = run(so)
        kv_output = self.after_step(so)
        if output is None:
            self._pending = kv_output
            return None
        output.kv_connector_output = kv_output
        return output

    def attach(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Put the outcome of the step that left sampling pending on its output."""
        output.kv_connector_output, self._pending = self._pending, None
        return output

    def before_step(self, so: SchedulerOutput) -> None:
        """Bind the step's metadata and start its loads (nothing runs on the device yet)."""
        from vllm.forward_context import get_forward_context, set_forward_context

        meta = so.kv_connector_metadata
        if meta is None:
            return
        self.connector.handle_preemptions(meta)
        self.connector.bind_connector_metadata(meta)
        with set_forward_context(None, self.vllm_config):
            self.connector.start_load_kv(get_forward_context())

    def after_step(self, so: SchedulerOutput) -> KVConnectorOutput | None:
        """Finish the step's saves and report transfers that completed (the step's device work is done)."""
        from vllm.v1.outputs import KVConnectorOutput

        if not self.connector.has_connector_metadata():
            return None
        try:
            self.connector.wait_for_save()
            results = self.connector.get_transfer_results(set(so.finished_req_ids))
            output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=set(results.failed_recving),
                invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
                kv_connector_stats=self.connector.get_kv_connector_stats(),
            )
        finally:
            self.connector.clear_connector_metadata()
        return None if output.is_empty() else output


def open_connector(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model: StepModel
) -> ConnectorDriver | None:
    """Create the worker-side connector ``--kv-transfer-config`` selects and hand it the step model.

    None when no connector is configured. A connector that cannot take a slot step model (vLLM's
    own connectors move paged blocks) is refused with the reason.
    """
    config = vllm_config.kv_transfer_config
    if config is None or not config.is_kv_transfer_instance:
        return None
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        get_kv_transfer_group,
    )

    ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
    connector = get_kv_transfer_group()
    if not isinstance(connector, StepModelConsumer):
        raise QaicConfigError(
            f"--kv-transfer-config kv_connector {config.kv_connector} moves vLLM's paged KV blocks, which a "
            "Cloud AI card does not have: use kv_connector QaicConnector (qaic-kvconnector)"
        )
    connector.bind_step_model(model)
    log.info("qaic: KV connector %s bound (%s)", config.kv_connector, config.kv_role)
    return ConnectorDriver(vllm_config, connector)


def handshake_metadata(driver: ConnectorDriver | None) -> dict[tuple[int, int], Any] | None:
    """What vLLM's engine hands the scheduler-side connector at start-up (one worker: rank 0, 0)."""
    if driver is None:
        return None
    meta = driver.connector.get_handshake_metadata()
    return None if meta is None else {(0, 0): meta}


def close_connector(driver: ConnectorDriver | None) -> None:
    if driver is None:
        return
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
