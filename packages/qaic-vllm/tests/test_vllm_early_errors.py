"""Settings checkable without the model fail in ``vllm serve``'s own process, before an engine starts.

Each case starts a real ``vllm serve``; the process must exit with a failing status, start no
engine, and end its output with the problem and the fix.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from vllm_server import free_port, vllm_command

pytestmark = pytest.mark.serve

CASES = {
    "visible-devices": ({"QAIC_VISIBLE_DEVICES": "9"}, "QAIC_VISIBLE_DEVICES='9': device 9 does not exist"),
    "backend": ({"QAIC_BACKEND": "nope"}, "unknown qaic backend 'nope' (from QAIC_BACKEND)"),
    "fault-spec": ({"QAIC_SIM_FAULTS": "melt@0:run=1"}, "QAIC_SIM_FAULTS"),
    "fault-policy": ({"VLLM_QAIC_FAULT_POLICY": "ignore"}, "VLLM_QAIC_FAULT_POLICY='ignore': use 'fail'"),
}


def last_lines(text: str) -> list[str]:
    """Output lines, less the multiprocessing resource tracker's own shutdown warning."""
    return [
        line
        for line in text.splitlines()
        if line.strip() and "resource_tracker" not in line and "warnings.warn" not in line
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_setting_fails_before_the_engine_with_the_fix_last(
    tiny_model: Path, tmp_path: Path, case: str
) -> None:
    import os

    env_changes, expected = CASES[case]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(env_changes)
    command = [
        *vllm_command(),
        "serve",
        str(tiny_model),
        "--port",
        str(free_port()),
        "--max-model-len",
        "128",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Initializing a V1 LLM engine" not in output  # failed in the API process
    lines = last_lines(done.stderr)
    assert lines[-1].startswith("qaic: invalid configuration: ") and expected in lines[-1], lines[-3:]
