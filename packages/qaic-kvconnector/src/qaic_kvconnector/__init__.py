"""KV connector for disaggregated prefill/decode serving on Cloud AI 100."""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: registers the connector with vLLM when present."""
