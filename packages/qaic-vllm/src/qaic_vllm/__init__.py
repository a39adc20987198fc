"""vLLM platform plugin for Qualcomm Cloud AI 100 (simulated or real)."""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the platform class path, or None."""
    return None
