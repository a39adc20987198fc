"""Part 4: the simulator's timing model against published figures, from ``qaic-sim fidelity --json``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qaic_bench.report import TIMING_ROW_KEYS


def qaic_sim_command() -> list[str]:
    """The ``qaic-sim`` CLI of the running interpreter's environment, else the one on PATH."""
    script = Path(sys.executable).parent / "qaic-sim"
    if script.exists():
        return [str(script)]
    found = shutil.which("qaic-sim")
    if found is None:
        raise RuntimeError("the qaic-sim command is not installed: pip install qaic-sim")
    return [found]


def timing_model_rows(env: Mapping[str, str] | None = None, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every published decode figure with the simulator's modelled rate, the report's fields only.

    The command prints more fields per row (devices, cores); only ``TIMING_ROW_KEYS`` are kept.
    """
    cmd = [*qaic_sim_command(), "fidelity", "--json"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=dict(env) if env is not None else None,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed with code {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        )
    rows = json.loads(proc.stdout)
    if not isinstance(rows, list):
        raise RuntimeError(f"{' '.join(cmd)} printed {type(rows).__name__}, not a list of rows")
    return [{k: row[k] for k in TIMING_ROW_KEYS} for row in rows]
