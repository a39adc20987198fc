"""Progress display and timing of the long pipeline steps (export, compile), so users see what runs."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from qaic_core import env

PROGRESS_ENV = "QAIC_PROGRESS"
"""Set to 1 for progress bars also when stderr is no terminal (e.g. in CI logs)."""


@contextmanager
def stage(description: str, *, enabled: bool = True, logger: logging.Logger | None = None) -> Iterator[None]:
    """Show a spinner-like tqdm bar with elapsed seconds while a step of unknown length runs."""
    log = logger or logging.getLogger("qaic.aot")
    log.info("%s ...", description)
    start = time.monotonic()
    bar = tqdm(
        total=None,
        desc=description,
        bar_format="{desc}: {elapsed}",
        disable=not enabled or (not sys.stderr.isatty() and not env.env_flag(PROGRESS_ENV)),
        leave=False,
    )
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="qaic-aot-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.close()
    log.info("%s done in %.1f s", description, time.monotonic() - start)
