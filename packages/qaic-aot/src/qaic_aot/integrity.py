"""Checksums of cache entries, and checks that a compiled program can be read before it is loaded.

Every cache entry (an export or a ``qpc-<hash>`` folder) gets ``qaic_manifest.json``, written
last, so it also marks the entry complete. It records the size and sha256 of each of the entry's
files and the ``mtime_ns`` at which that checksum was last confirmed: a file whose size and mtime
still match is trusted without hashing it again, so an unchanged multi-GB program costs no
reading on each start; any other file is hashed and compared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qaic_aot.iodesc import load_program_io, program_dir
from qaic_core import qpc as layout
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError

log = logging.getLogger("qaic.aot.cache")

MANIFEST_FILE = "qaic_manifest.json"
FORMAT = "qaic-cache-entry"
VERSION = 1
SLOW_HASH_S = 2.0
"""Hashing that takes longer than this is logged (a multi-GB program takes seconds)."""

PROGRAM_MEMBER = f"qpc/{layout.PROGRAM_FILE}"
"""Where a ``qpc-<hash>`` entry keeps its program, relative to the entry."""

REBUILD_HINT = (
    "rebuild it with `qaic-aot compile <model> <the same settings>` (it prints the new QPC folder) or unset "
    "qpc_path (override_qaic_config / VLLM_QAIC_QPC_PATH) to let the server compile and cache the program"
)


@dataclass(frozen=True)
class FileRecord:
    """One file of an entry: its size and sha256, and the mtime at which they were last confirmed."""

    size: int
    sha256: str
    mtime_ns: int


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks; slow hashing is logged."""
    started = time.monotonic()
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    took = time.monotonic() - started
    if took > SLOW_HASH_S:
        size = Path(path).stat().st_size
        log.info("checksum of %s (%.1f GiB) took %.1f s", path, size / 2**30, took)
    return digest.hexdigest()


def entry_files(root: Path, *, recursive: bool) -> list[str]:
    """The entry's files relative to ``root``: all regular files but the manifest and lock files.

    ``recursive=False`` is for an export entry, whose folder also holds the ``qpc-*`` entries.
    """
    root = Path(root)
    paths = root.rglob("*") if recursive else root.iterdir()
    names = [
        p.relative_to(root).as_posix()
        for p in paths
        if p.is_file() and not p.is_symlink() and p.name != MANIFEST_FILE and not p.name.endswith(".lock")
    ]
    return sorted(names)


def record(root: Path, names: list[str]) -> dict[str, FileRecord]:
    """Size, sha256 and mtime of each named file under ``root``."""
    out: dict[str, FileRecord] = {}
    for name in names:
        path = Path(root) / name
        st = path.stat()
        out[name] = FileRecord(size=st.st_size, sha256=sha256_file(path), mtime_ns=st.st_mtime_ns)
    return out


def write_manifest(root: Path, kind: str, files: dict[str, FileRecord]) -> None:
    """Write ``root/qaic_manifest.json`` atomically (a reader sees the old one or the new one)."""
    data: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "files": {
            name: {"size": r.size, "sha256": r.sha256, "mtime_ns": r.mtime_ns}
            for name, r in sorted(files.items())
        },
    }
    target = Path(root) / MANIFEST_FILE
    tmp = target.with_name(f".{MANIFEST_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def seal(root: Path, kind: str, *, recursive: bool) -> None:
    """Checksum every file of a finished entry and write its manifest (the completion marker)."""
    write_manifest(root, kind, record(root, entry_files(root, recursive=recursive)))


def read_manifest(root: Path) -> tuple[str, dict[str, FileRecord]]:
    """The kind of entry and the files ``root``'s manifest records; ``ValueError`` when unreadable."""
    path = Path(root) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
        files = {
            str(name): FileRecord(int(r["size"]), str(r["sha256"]), int(r["mtime_ns"]))
            for name, r in data["files"].items()
        }
        return str(data.get("kind", "")), files
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{MANIFEST_FILE} cannot be read ({exc})") from exc


def verify(root: Path, required: tuple[str, ...], *, update: bool) -> str | None:
    """What is wrong with the files ``root``'s manifest records (None: every one matches).

    ``required`` names files the manifest must record. With ``update``, checksums confirmed on a
    file whose mtime changed are stamped with the new mtime so the next check skips the hashing.
    """
    try:
        kind, files = read_manifest(root)
    except ValueError as exc:
        return str(exc)
    missing = [name for name in required if name not in files]
    if missing:
        return f"{MANIFEST_FILE} does not record {', '.join(missing)}"
    restamped: dict[str, FileRecord] = {}
    for name, rec in files.items():
        path = Path(root) / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{name} is missing"
        if st.st_size != rec.size:
            kind = "truncated" if st.st_size < rec.size else "grown"
            return f"{name} has {st.st_size} bytes where {MANIFEST_FILE} records {rec.size} ({kind})"
        if st.st_mtime_ns == rec.mtime_ns:
            continue
        if sha256_file(path) != rec.sha256:
            return f"{name} does not match the sha256 in {MANIFEST_FILE} (overwritten or corrupt)"
        restamped[name] = FileRecord(rec.size, rec.sha256, st.st_mtime_ns)
    if restamped and update:
        try:
            write_manifest(root, kind, {**files, **restamped})
        except OSError as exc:
            log.debug("could not update %s: %s", Path(root) / MANIFEST_FILE, exc)
    return None


def header_problem(program: Path, backend: DeviceBackend) -> str | None:
    """Whether ``backend`` can read the program's header (its IO descriptor), as a load would."""
    try:
        if Path(program).stat().st_size == 0:
            return f"{program} is empty"
        load_program_io(backend.runtime(), backend.aicapi(), program.parent)
    except Exception as exc:  # the real runtime raises its own types
        return f"the {backend.name} backend cannot read it: {exc}"
    return None


def onnx_problem(onnx_path: Path) -> str | None:
    """Whether the ONNX graph parses (weights in external data files are not read)."""
    from qaic_aot.program_config import read_signature

    try:
        read_signature(onnx_path)
    except Exception as exc:  # onnx raises DecodeError and others
        return f"{onnx_path.name} does not parse as ONNX: {exc}"
    return None


def damaged(program: Path, problem: str) -> QaicConfigError:
    """The error for a prebuilt program that cannot be served, naming the file and the fix."""
    return QaicConfigError(
        f"the compiled program {program} is truncated, corrupt or unreadable ({problem}): {REBUILD_HINT}"
    )


def check_prebuilt(qpc_path: Path, backend: DeviceBackend, *, read_header: bool = True) -> Path:
    """Check a user-given program (never moved or rebuilt here); returns the folder holding it.

    A program inside a ``qpc-<hash>`` entry with a manifest is checked against its checksums;
    any other one by reading its header through ``backend`` (skipped with ``read_header=False``
    when the caller reads it next anyway).
    """
    folder = program_dir(qpc_path)
    program = folder / layout.PROGRAM_FILE
    entry = folder.parent
    if folder.name == "qpc" and (entry / MANIFEST_FILE).is_file():
        problem = verify(entry, (PROGRAM_MEMBER,), update=False)
        if problem is not None:
            raise damaged(program, problem)
        return folder
    if read_header:
        problem = header_problem(program, backend)
        if problem is not None:
            raise damaged(program, problem)
    return folder
