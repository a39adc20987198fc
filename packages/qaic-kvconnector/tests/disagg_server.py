"""A real ``qaic-disagg`` (its vLLM instances and router) on 127.0.0.1 for the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from qaic_core.host import free_ports


def free_port() -> int:
    return free_ports(1)


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports that nothing listens on right now."""
    return free_ports(count)


def disagg_command() -> list[str]:
    script = Path(sys.executable).parent / "qaic-disagg"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "qaic_kvconnector.disagg"]


class Disagg:
    """Starts ``qaic-disagg`` with its instances' logs in ``log_dir``; stops its whole process group."""

    def __init__(
        self,
        model: Path,
        args: list[str],
        log_dir: Path,
        prefills: int = 1,
        decodes: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "qaic-disagg.log"
        command = [
            *disagg_command(),
            "--model", str(model),
            "--port", str(self.port),
            "--log-dir", str(log_dir),
            "--kv-port", str(free_port_range(prefills + decodes)),
            "--prefill-port", ",".join(str(free_port()) for _ in range(prefills)),
            "--decode-port", ",".join(str(free_port()) for _ in range(decodes)),
            *args,
        ]  # fmt: skip
        env = dict(os.environ) | (env or {})
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.setdefault("QAIC_BACKEND", "sim")
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout: float = 600.0) -> Disagg:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qaic-disagg exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"qaic-disagg did not become ready in {timeout:.0f}s:\n{self.tail()}")

    def wait_exit(self, timeout: float = 600.0) -> int:
        return self.proc.wait(timeout=timeout)

    def instances(self) -> dict[str, dict[str, Any]]:
        data = json.loads((self.log_dir / "instances.json").read_text())
        return {entry["name"]: entry for entry in data}

    def instance_url(self, name: str) -> str:
        return str(self.instances()[name]["url"])

    def instance_log(self, name: str) -> str:
        return Path(self.instances()[name]["log"]).read_text(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL one instance (its API server and engine) as a crash would."""
        os.killpg(int(self.instances()[name]["pid"]), signal.SIGKILL)

    def router_stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/qaic/router", timeout=10).json())

    def tail(self, lines: int = 80) -> str:
        self._log.flush()
        out = ["== qaic-disagg", *self.log_path.read_text(errors="replace").splitlines()[-lines:]]
        for path in sorted(self.log_dir.glob("*-*.log")):
            out += [f"== {path.name}", *path.read_text(errors="replace").splitlines()[-lines // 2 :]]
        return "\n".join(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for entry in self._instances_or_empty().values():  # whatever the launcher could not stop
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.killpg(int(entry["pid"]), signal.SIGKILL)
        self._log.close()

    def _instances_or_empty(self) -> dict[str, dict[str, Any]]:
        try:
            return self.instances()
        except (OSError, ValueError):
            return {}


class VllmInstance:
    """One ``vllm serve`` on 127.0.0.1 with its output in a log file."""

    def __init__(self, model: Path, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        vllm = Path(sys.executable).parent / "vllm"
        command = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.setdefault("QAIC_BACKEND", "sim")
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout: float = 600.0) -> VllmInstance:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve did not become ready in {timeout:.0f}s")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
