"""The backend conformance suite of qaic-core passes on the simulator, run as users run it."""

from __future__ import annotations

import os
import subprocess
import sys

from qaic_core.testing import conformance


def test_conformance_suite_passes_on_sim() -> None:
    env = os.environ | {"QAIC_BACKEND": "sim", "QAIC_STRICT_PLUGINS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "qaic_core.testing", "--backend", "sim", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    # The simulator claims every capability, so no conformance test may skip.
    count = sum(name.startswith("test_") for name in vars(conformance))
    assert f"{count} passed" in result.stdout and "skipped" not in result.stdout
