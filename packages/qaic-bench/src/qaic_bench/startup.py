"""Part 5 helper: how much of a server start was the QPC step, read from the server's own log."""

from __future__ import annotations

import re
from pathlib import Path

_QPC_READY = re.compile(r"QPC ready in ([0-9]+(?:\.[0-9]+)?)\s*s")


def qpc_ready_seconds(log_path: Path) -> float | None:
    """Seconds the worker logged for export + compile (or the cache lookup); None when not logged."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    match = _QPC_READY.search(text)
    return float(match.group(1)) if match else None
