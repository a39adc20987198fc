"""The backend conformance suite, written once and run against any installed device backend.

Run it with ``python -m qaic_core.testing --backend NAME``. A backend declares capabilities
(:data:`qaic_core.descriptors.CAPABILITIES`); tests for capabilities it does not claim are skipped.
"""

from __future__ import annotations

from pathlib import Path

SUITE_DIR = Path(__file__).parent
SUITE_FILE = SUITE_DIR / "conformance.py"


def run_suite(backend: str, extra_args: list[str] | None = None) -> int:
    """Run the conformance suite against ``backend``; returns pytest's exit code."""
    import pytest

    args = [str(SUITE_FILE), "-p", "qaic_core.testing.fixtures", f"--qaic-backend={backend}", "-q"]
    return int(pytest.main(args + list(extra_args or [])))
