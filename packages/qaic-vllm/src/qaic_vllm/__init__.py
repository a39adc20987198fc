"""vLLM platform plugin for Qualcomm Cloud AI 100 (simulated or real)."""

from __future__ import annotations

import functools
import logging

__version__ = "0.1.0"

PLATFORM_CLS = "qaic_vllm.platform.QaicPlatform"
log = logging.getLogger("qaic.vllm")


@functools.lru_cache(maxsize=1)
def _available_backends() -> tuple[str, ...]:
    from qaic_core import get_plugin_manager

    try:
        return tuple(b.name for b in get_plugin_manager().available_device_backends())
    except Exception as exc:
        log.warning("qaic: cannot list device backends (%s); the qaic platform stays off", exc)
        return ()


def register() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the platform class path when a qaic backend is available."""
    backends = _available_backends()
    if not backends:
        return None
    try:
        from qaic_vllm import envs

        envs.register_with_vllm()
    except ImportError:
        pass
    from qaic_vllm.metrics import serve_card_metrics

    serve_card_metrics()  # the card's series on the API server's /metrics
    return PLATFORM_CLS
