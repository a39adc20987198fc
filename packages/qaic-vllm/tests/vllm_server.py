"""A real ``vllm serve`` process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from qaic_core.host import free_ports


def vllm_command() -> list[str]:
    """The ``vllm`` CLI of the running interpreter's environment."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (see ``qaic_core.host.free_ports``)."""
    return free_ports(1)


class ServeProcess:
    """``vllm serve MODEL ARGS`` with its output in a log file, in a process group of its own."""

    def __init__(
        self, model: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        environ = dict(os.environ) | (env or {})
        environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        environ.setdefault("QAIC_BACKEND", "sim")
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [*vllm_command(), "serve", str(model), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
        )

    def log_tail(self, lines: int = 120) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Stop the whole process group (the API server and its engine cores)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


class VllmServer(ServeProcess):
    """``vllm serve`` on a free port of 127.0.0.1, returned once ``/health`` answers."""

    def __init__(
        self,
        model: Path,
        args: list[str],
        log_path: Path,
        *,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(model, ["--host", "127.0.0.1", "--port", str(self.port), *args], log_path, env)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vllm serve did not become healthy in {timeout:.0f}s:\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        """The value of a gauge or counter from /metrics (summed over label sets)."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def settled_metric(self, name: str, expected: float, timeout: float = 60.0) -> float:
        """``metric(name)`` once it equals ``expected`` or ``timeout`` passed: the gauges update after a step."""
        deadline = time.monotonic() + timeout
        value = self.metric(name)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.2)
            value = self.metric(name)
        return value
