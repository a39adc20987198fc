"""KV connector for disaggregated prefill/decode serving on Cloud AI 100."""

from __future__ import annotations

__version__ = "0.1.0"

CONNECTOR_MODULE = "qaic_kvconnector.connector"
CONNECTOR_CLASS = "QaicConnector"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: make ``QaicConnector`` known to vLLM's connector factory.

    vLLM calls general plugins in every process it starts (API server, engine core, workers),
    sometimes more than once: registering is skipped when the name is already known, and the
    connector module is imported only when an engine selects it.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent: nothing to register with
        return
    if CONNECTOR_CLASS in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_CLASS)
