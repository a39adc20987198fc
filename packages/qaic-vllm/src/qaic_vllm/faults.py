"""Device faults while serving: which requests pay, when the server gives up, and the last word.

A failed run (timeout, device error, reset) costs the requests of that step, never the server:
the runner reports them (:class:`QaicRunnerOutput`), the step model reloads its program, and the
scheduler fails those requests with the cause (``fail``, the default) or puts them back to be
computed again from their tokens (``recompute``). More than ``VLLM_QAIC_MAX_DEVICE_FAULTS``
faults within ``FAULT_WINDOW_S`` seconds stop the engine; the API process then exits with status 1
and repeats the reason as its last line (:func:`install_exit_report`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qaic_core import env
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError, QaicError
from qaic_vllm.envs import VLLM_QAIC_FAULT_POLICY, VLLM_QAIC_MAX_DEVICE_FAULTS

log = logging.getLogger("qaic.vllm.faults")

QAIC_ENGINE_REPORT = "QAIC_ENGINE_REPORT"
"""Set by the API process for its engine: the file where a fatal engine error is written."""
POLICIES = ("fail", "recompute")
DEFAULT_MAX_FAULTS = 3
FAULT_WINDOW_S = 600.0


class QaicFatalError(QaicError):
    """The device cannot be trusted any more: the engine stops."""


@dataclass(frozen=True)
class FaultSettings:
    """What to do after a device fault, from the environment (checked at configuration time)."""

    policy: str = "fail"
    max_faults: int = DEFAULT_MAX_FAULTS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultSettings:
        env = os.environ if environ is None else environ
        policy = env.get(VLLM_QAIC_FAULT_POLICY, "").strip().lower() or "fail"
        if policy not in POLICIES:
            raise QaicConfigError(
                f"{VLLM_QAIC_FAULT_POLICY}={policy!r}: use 'fail' (fail the faulted step's requests) or "
                "'recompute' (compute them again from their tokens)"
            )
        raw = env.get(VLLM_QAIC_MAX_DEVICE_FAULTS, "").strip()
        if raw and (not raw.isdigit() or int(raw) < 1):
            raise QaicConfigError(
                f"{VLLM_QAIC_MAX_DEVICE_FAULTS}={raw!r} is not a positive integer: give the number of faults "
                f"to tolerate within {FAULT_WINDOW_S:.0f} s, such as {DEFAULT_MAX_FAULTS}"
            )
        return cls(policy, int(raw) if raw else DEFAULT_MAX_FAULTS)


class FaultBudget:
    """Counts faults in a sliding window; past the bound the next one is fatal."""

    def __init__(self, settings: FaultSettings) -> None:
        self.settings = settings
        self.times: deque[float] = deque()

    def record(self, cause: str) -> None:
        now = time.monotonic()
        self.times.append(now)
        while self.times and now - self.times[0] > FAULT_WINDOW_S:
            self.times.popleft()
        if len(self.times) > self.settings.max_faults:
            raise QaicFatalError(
                f"{len(self.times)} device faults within {FAULT_WINDOW_S:.0f} s (the last: {cause}); the "
                f"device cannot be trusted, stopping the server. Raise {VLLM_QAIC_MAX_DEVICE_FAULTS} "
                f"(now {self.settings.max_faults}) to tolerate more, or check the card (qaic-util)"
            )


@contextmanager
def fatal_reported(what: str) -> Iterator[None]:
    """Leave the reason of an error that stops the engine for the API process's last line."""
    try:
        yield
    except Exception as exc:
        detail = str(exc) if isinstance(exc, QaicError) else f"{type(exc).__name__}: {exc}"
        report_fatal(f"the engine stopped while {what}: {detail}")
        raise


@contextmanager
def config_reported() -> Iterator[None]:
    """A configuration error in the API process is also the last line ``vllm serve`` prints."""
    try:
        yield
    except QaicError as exc:
        report_fatal(f"invalid configuration: {exc}")
        raise


def check_devices(backend: DeviceBackend) -> None:
    """The backend lists its devices now, so a bad device setting fails at configuration time."""
    runtime = backend.runtime()
    status, ids = runtime.Util().getDeviceIds()
    if int(status) != 0:
        raise QaicConfigError(
            f"the {backend.name} backend cannot list its devices (status {int(status)}): check the cards "
            f"(qaic-util) and {env.QAIC_VISIBLE_DEVICES}"
        )
    if not ids:
        raise QaicConfigError(
            f"no Cloud AI device is visible to the {backend.name} backend: check {env.QAIC_VISIBLE_DEVICES} "
            "and the cards (qaic-util)"
        )


def report_fatal(message: str) -> None:
    """Leave ``message`` for the API process to repeat as its last line (see :func:`install_exit_report`)."""
    target = os.environ.get(QAIC_ENGINE_REPORT, "").strip()
    if not target:
        return
    try:
        Path(target).write_text(message.strip() + "\n")
    except OSError as exc:
        log.debug("cannot write the engine report %s: %s", target, exc)


def serving_from_cli() -> bool:
    """Whether this process is ``vllm serve`` (a script using ``LLM`` handles its own errors)."""
    return "vllm.entrypoints.cli.serve" in sys.modules and "serve" in sys.argv[1:3]


def install_exit_report() -> None:
    """In the API process: if the engine left a fatal report, print it last and exit with status 1.

    vLLM's server returns normally when its engine dies, so without this a supervisor would see
    status 0 and the reason would be buried under the shutdown log.
    """
    if os.environ.get(QAIC_ENGINE_REPORT) or not serving_from_cli():
        return
    fd, name = tempfile.mkstemp(prefix="qaic-engine-report-", suffix=".txt")
    os.close(fd)
    os.environ[QAIC_ENGINE_REPORT] = name

    def repeat_and_exit() -> None:
        path = Path(name)
        try:
            text = path.read_text().strip()
        except OSError:
            return
        finally:
            path.unlink(missing_ok=True)
        if not text:
            return
        sys.stdout.flush()
        sys.stderr.write(f"\nqaic: {text}\n")
        sys.stderr.flush()
        os._exit(1)

    atexit.register(repeat_and_exit)
