"""A real ``vllm serve`` process for the benchmarks, and ``vllm bench serve`` run against it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from qaic_core.host import free_ports

log = logging.getLogger("qaic.bench")


def vllm_command() -> list[str]:
    """The ``vllm`` CLI of the running interpreter's environment."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (see ``qaic_core.host.free_ports``)."""
    return free_ports(1)


@dataclass(frozen=True)
class ServeShape:
    """The engine arguments that decide the compiled program and its prefill scheduling: batch, context,
    prefill chunk, the ``override_qaic_config`` prefill keys (0: the plugin's default) and the
    compute-context lengths of both prefill and decode (empty: none)."""

    max_num_seqs: int
    max_model_len: int
    prefill_seq_len: int
    prefill_batch_size: int = 0
    prefill_batch_seq_len: int = 0
    max_num_partial_prefills: int = 0
    comp_ctx_lengths: tuple[int, ...] = ()

    def overrides(self) -> dict[str, Any]:
        """The ``override_qaic_config`` keys this shape sets."""
        keys: dict[str, Any] = {
            "prefill_batch_size": self.prefill_batch_size,
            "prefill_batch_seq_len": self.prefill_batch_seq_len,
            "max_num_partial_prefills": self.max_num_partial_prefills,
            "comp_ctx_lengths_prefill": list(self.comp_ctx_lengths),
            "comp_ctx_lengths_decode": list(self.comp_ctx_lengths),
        }
        return {key: value for key, value in keys.items() if value}

    def additional_config(self) -> dict[str, Any] | None:
        """``--additional-config`` for the overrides, or None without any."""
        overrides = self.overrides()
        return {"override_qaic_config": overrides} if overrides else None

    def args(self) -> list[str]:
        args = [
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--long-prefill-token-threshold",
            str(self.prefill_seq_len),
        ]
        additional = self.additional_config()
        if additional:
            args += ["--additional-config", json.dumps(additional)]
        return args


@dataclass
class VllmServer:
    """``vllm serve MODEL`` in its own process group; ``start()`` returns seconds until /health answered."""

    model: Path
    shape: ServeShape
    env: Mapping[str, str]
    log_path: Path
    timeout_s: float = 900.0
    extra_args: Sequence[str] = field(default_factory=tuple)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    command: Sequence[str] = ()
    """The ``vllm`` command to run (another environment's); this environment's when empty."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Launch the server and wait until /health and /v1/models both answer; the elapsed seconds."""
        cmd = [
            *(self.command or vllm_command()),
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.shape.args(),
            *self.extra_args,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s (log: %s)", " ".join(cmd), self.log_path)
        handle = self.log_path.open("wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=handle, stderr=subprocess.STDOUT, env=dict(self.env), start_new_session=True
        )
        handle.close()
        while True:
            elapsed = time.perf_counter() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.proc.returncode} before answering /health; "
                    f"see {self.log_path}:\n{tail(self.log_path)}"
                )
            if elapsed > self.timeout_s:
                self.stop()
                raise TimeoutError(
                    f"vllm serve did not answer /health within {self.timeout_s:.0f} s; see {self.log_path}"
                )
            if _ok(f"{self.base_url}/health") and _ok(f"{self.base_url}/v1/models"):
                return time.perf_counter() - t0
            time.sleep(0.1)

    def served_model(self) -> str:
        """The model id the server lists first (what requests must name)."""
        with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=10) as resp:
            return str(json.load(resp)["data"][0]["id"])

    def _signal_group(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the server's process group; False when the server is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            os.killpg(os.getpgid(self.proc.pid), sig)
        except ProcessLookupError:
            return False
        return True

    def pause(self) -> None:
        """Freeze every process of the server (SIGSTOP to its group): an idle server that polls
        (vLLM's CPU backend busy-polls part of a core) then takes no processor time from a
        benchmark of another server on the same machine. Connections stay open; :meth:`resume`."""
        if self._signal_group(signal.SIGSTOP):
            log.info("paused vllm serve on port %d", self.port)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT to its group); harmless on a running one."""
        self._signal_group(signal.SIGCONT)

    def stop(self) -> None:
        """SIGINT the server's process group, then SIGKILL it if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()  # a paused process would hold SIGINT pending
        pgid = os.getpgid(self.proc.pid)
        for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                log.warning("vllm serve (pid %d) ignored %s", self.proc.pid, sig.name)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True)
class Workload:
    """Requests of the throughput runs: fixed prompt and output lengths, ``concurrency`` in flight."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    seed: int = 0


def bench_serve(
    server: VllmServer,
    workload: Workload,
    result_dir: Path,
    name: str,
    env: Mapping[str, str],
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run ``vllm bench serve`` (random dataset, ignore EOS) against ``server``; its saved JSON result."""
    result_dir.mkdir(parents=True, exist_ok=True)
    filename = f"bench-{name}.json"
    cmd = [
        *vllm_command(),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        server.base_url,
        "--model",
        server.served_model(),
        "--tokenizer",
        str(server.model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(workload.num_prompts),
        "--max-concurrency",
        str(workload.concurrency),
        "--num-warmups",
        str(workload.concurrency),
        "--ignore-eos",
        "--seed",
        str(workload.seed),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]
    log_path = result_dir / f"bench-{name}.log"
    log.info(
        "running vllm bench serve: %d prompts, %d in flight (log: %s)",
        workload.num_prompts,
        workload.concurrency,
        log_path,
    )
    with log_path.open("wb") as handle:
        proc = subprocess.run(
            cmd, stdout=handle, stderr=subprocess.STDOUT, env=dict(env), timeout=timeout_s, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed with code {proc.returncode}; see {log_path}:\n{tail(log_path)}"
        )
    result: dict[str, Any] = json.loads((result_dir / filename).read_text())
    if result.get("completed") != workload.num_prompts or result.get("failed"):
        raise RuntimeError(
            f"vllm bench serve completed {result.get('completed')} of {workload.num_prompts} requests "
            f"({result.get('failed')} failed); see {server.log_path}"
        )
    return result
