"""The export/compile cache under ``QEFF_HOME``: keys, directory layout and safe concurrent filling.

Layout (QEfficient's)::

    $QEFF_HOME/<arch>/<model>-<export_hash>/
      <model>.onnx, hashed_export_params.json, qaic_manifest.json
      qpc-<compile_hash>/
        specializations.json, custom_io.yaml, hashed_compile_params.json, qconfig.json, [mdp_ts_<N>.json]
        qaic_manifest.json
        qpc/programqpc.bin

Each entry is built in a temporary directory next to its final place and moved there with one
``rename`` while a file lock is held, so a reader sees either nothing or a complete entry.
``qaic_manifest.json`` (:mod:`qaic_aot.integrity`), written last, holds the checksums of the
entry's files; a damaged entry is moved aside to ``<entry>.corrupt-<timestamp>``, never deleted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from qaic_core import qpc as layout
from qaic_core.errors import QaicError

log = logging.getLogger("qaic.aot.cache")

MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".py")
"""Files of a model directory that make up its identity (config, weights, remote code)."""

CONTENT_HASH_LIMIT = 256 * 1024 * 1024
"""Files up to this size are hashed by content; larger ones by name, size and mtime (fast)."""

LOCK_TIMEOUT_S = 6 * 3600.0
"""A real compile can take hours; waiting on another process's compile is bounded by this."""


def model_fingerprint(model_dir: Path) -> dict[str, str]:
    """Per-file identity of a model directory: sha256 of small files, size+mtime of huge ones."""
    model_dir = Path(model_dir)
    out: dict[str, str] = {}
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or not path.name.endswith(MODEL_FILE_SUFFIXES):
            continue
        stat = path.stat()
        if stat.st_size <= CONTENT_HASH_LIMIT:
            digest = hashlib.sha256()
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            out[path.name] = "sha256:" + digest.hexdigest()
        else:
            out[path.name] = f"size:{stat.st_size}:mtime:{stat.st_mtime_ns}"
    return out


def export_dir(home: Path, architecture: str, model_name: str, export_hash: str) -> Path:
    return Path(home) / architecture / f"{model_name}-{export_hash}"


def compile_dir(export_root: Path, compile_hash: str) -> Path:
    return Path(export_root) / f"qpc-{compile_hash}"


def hash_params(params: dict[str, Any]) -> str:
    return layout.params_hash(params)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an inter-process lock named ``<path>.lock`` (next to the entry it guards).

    The lock is an OS file lock, released by the kernel if its holder dies, so it never goes stale.
    """
    lock_path = Path(str(path) + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process building %s", path)
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout as exc:
            raise QaicError(
                f"gave up after {LOCK_TIMEOUT_S:.0f} s waiting for another process to build {path} "
                f"(lock {lock_path})"
            ) from exc
    try:
        yield
    finally:
        lock.release()


def temporary_dir(final: Path) -> Path:
    """A fresh hidden folder next to ``final`` (same filesystem, so moving out of it is a rename)."""
    tmp = Path(final).parent / f".{Path(final).name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def build_dir_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """Run ``build(tmp)`` in a fresh temporary directory, then rename it to ``final``.

    The caller holds the lock of ``final`` and has moved a damaged ``final`` aside; one that
    appeared anyway (made by a tool that takes no lock) is moved aside too. A failed build
    leaves nothing behind.
    """
    final = Path(final)
    tmp = temporary_dir(final)
    try:
        build(tmp)
        if final.exists():
            log.warning("cache entry %s appeared during the build: moved it to %s", final, move_aside(final))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def move_files_into(src: Path, dest: Path, last: tuple[str, ...] = ()) -> None:
    """Move every file of ``src`` into ``dest`` (renames on one filesystem); ``last`` names go last."""
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in src.iterdir())
    ordered = [n for n in names if n not in last] + [n for n in last if n in names]
    for name in ordered:
        os.replace(src / name, dest / name)


def aside_path(entry: Path) -> Path:
    """A free name ``<entry>.corrupt-<timestamp>`` next to ``entry``."""
    entry = Path(entry)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = entry.with_name(f"{entry.name}.corrupt-{stamp}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = entry.with_name(f"{entry.name}.corrupt-{stamp}-{n}")
    return candidate


def move_aside(entry: Path) -> Path:
    """Rename a damaged entry to ``<entry>.corrupt-<timestamp>`` (kept for inspection); returns it."""
    target = aside_path(entry)
    try:
        os.rename(entry, target)
    except OSError as exc:
        raise QaicError(
            f"cannot move the damaged cache entry {entry} aside ({exc}): delete it by hand"
        ) from exc
    return target


def move_files_aside(folder: Path, names: list[str]) -> Path:
    """Move the named files of ``folder`` into a new ``<folder>.corrupt-<timestamp>`` next to it.

    For an export entry, whose folder also holds the compiled programs (left in place).
    """
    target = aside_path(folder)
    try:
        target.mkdir(parents=True)
        for name in names:
            os.replace(Path(folder) / name, target / name)
    except OSError as exc:
        raise QaicError(
            f"cannot move the damaged files {names} of {folder} aside ({exc}): delete them by hand"
        ) from exc
    return target
