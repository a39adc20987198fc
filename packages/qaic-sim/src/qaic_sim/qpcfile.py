"""The simulator's ``programqpc.bin``: a zip of a manifest, the compiled ONNX and its inputs.

Members (stored uncompressed so loading is a plain read):

- ``manifest.json``: format name and version, compiler flags, bindings, specializations with
  every binding's shape and the run's modelled cost, retained-state pairs, device memory needs,
  device count and cores.
- ``model.onnx``: the graph as the simulator executes it (fp16 rounding and MX FP6 weights
  already applied).
- ``iodesc.pb``: the serialized :class:`qaic_sim.aicapi.IoDesc` returned by ``getIoDescriptor``.
- ``specializations.json``, and when given ``custom_io.yaml`` and ``mdp.json``: copies of the
  compiler's inputs.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError
from qaic_core.types import Binding, BufferType, Direction, Specialization

FORMAT = "qaic-sim-programqpc"
VERSION = 1
MANIFEST = "manifest.json"
MODEL = "model.onnx"
IODESC = "iodesc.pb"


@dataclass(frozen=True)
class SpecShapes:
    """One specialization: its symbols and the dims of every binding, in binding order."""

    name: str
    symbols: dict[str, int]
    dims: tuple[tuple[int, ...], ...]
    cost: dict[str, float] | None = None
    """The run's modelled cost (``ProgramCost.to_json``); None when compiled with timing off."""

    @property
    def specialization(self) -> Specialization:
        return Specialization(self.name, dict(self.symbols))


@dataclass(frozen=True)
class ProgramManifest:
    """What ``manifest.json`` holds, typed."""

    bindings: tuple[Binding, ...]
    specs: tuple[SpecShapes, ...]
    retained: dict[str, str]
    precisions: dict[str, str]
    num_cores: int
    num_devices: int
    convert_to_fp16: bool
    mxfp6_matmul: bool
    weights_bytes: int
    retained_bytes: int
    activation_bytes: int
    argv: tuple[str, ...]
    source_model: str
    in_place: tuple[str, ...] = ()
    """Retained-state inputs whose runs may write the new state into the old one's memory."""

    @property
    def dram_bytes(self) -> int:
        """Device memory the whole program needs, over all devices of its group."""
        return self.weights_bytes + self.retained_bytes + self.activation_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "bindings": [
                {
                    "name": b.name,
                    "index": b.index,
                    "type": int(b.type),
                    "dir": int(b.dir),
                    "dims": list(b.dims),
                    "size": b.size,
                    "is_partial_buf_allowed": b.is_partial_buf_allowed,
                }
                for b in self.bindings
            ],
            "specializations": [
                {"name": s.name, "symbols": s.symbols, "dims": [list(d) for d in s.dims]}
                | ({"cost": s.cost} if s.cost is not None else {})
                for s in self.specs
            ],
            "retained": self.retained,
            "precisions": self.precisions,
            "num_cores": self.num_cores,
            "num_devices": self.num_devices,
            "convert_to_fp16": self.convert_to_fp16,
            "mxfp6_matmul": self.mxfp6_matmul,
            "memory": {
                "weights_bytes": self.weights_bytes,
                "retained_bytes": self.retained_bytes,
                "activation_bytes": self.activation_bytes,
            },
            "argv": list(self.argv),
            "source_model": self.source_model,
            "in_place": list(self.in_place),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> ProgramManifest:
        if data.get("format") != FORMAT:
            raise QaicConfigError(f"{where} is not a qaic-sim program (format {data.get('format')!r})")
        if data.get("version") != VERSION:
            raise QaicConfigError(
                f"{where} has program format version {data.get('version')}; this simulator reads "
                f"version {VERSION}: compile the program again"
            )
        bindings = tuple(
            Binding(
                name=b["name"],
                index=b["index"],
                type=BufferType(b["type"]),
                dir=Direction(b["dir"]),
                dims=tuple(b["dims"]),
                size=b["size"],
                is_partial_buf_allowed=b.get("is_partial_buf_allowed", False),
            )
            for b in data["bindings"]
        )
        specs = tuple(
            SpecShapes(
                s["name"],
                {k: int(v) for k, v in s["symbols"].items()},
                tuple(tuple(d) for d in s["dims"]),
                s.get("cost"),
            )
            for s in data["specializations"]
        )
        mem = data["memory"]
        return cls(
            bindings=bindings,
            specs=specs,
            retained=dict(data["retained"]),
            precisions=dict(data.get("precisions", {})),
            num_cores=int(data["num_cores"]),
            num_devices=int(data["num_devices"]),
            convert_to_fp16=bool(data["convert_to_fp16"]),
            mxfp6_matmul=bool(data["mxfp6_matmul"]),
            weights_bytes=int(mem["weights_bytes"]),
            retained_bytes=int(mem["retained_bytes"]),
            activation_bytes=int(mem["activation_bytes"]),
            argv=tuple(data.get("argv", ())),
            source_model=str(data.get("source_model", "")),
            in_place=tuple(data.get("in_place", ())),
        )


def write_program(
    binary_dir: Path,
    manifest: ProgramManifest,
    model_bytes: bytes,
    iodesc_bytes: bytes,
    extra: dict[str, bytes],
) -> Path:
    """Write ``<binary_dir>/programqpc.bin`` atomically (a partial file never looks compiled)."""
    binary_dir.mkdir(parents=True, exist_ok=True)
    target = binary_dir / layout.PROGRAM_FILE
    tmp = target.with_suffix(".bin.partial")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(MANIFEST, json.dumps(manifest.to_json(), indent=1))
        zf.writestr(IODESC, iodesc_bytes)
        for name, data in extra.items():
            zf.writestr(name, data)
        zf.writestr(MODEL, model_bytes)
        zf.comment = f"{FORMAT} v{VERSION}".encode()
    tmp.replace(target)
    return target


def find_program(path: str | Path) -> Path:
    """``programqpc.bin`` for a path to the file, its ``qpc`` folder or the ``qpc-<hash>`` folder."""
    p = Path(path)
    if p.is_file():
        return p
    candidate = layout.program_path(p)
    if not candidate.is_file():
        raise FileNotFoundError(f"no {layout.PROGRAM_FILE} under {p}: compile the program first")
    return candidate


def read_manifest(path: str | Path) -> tuple[ProgramManifest, bytes]:
    """The manifest and IoDesc bytes of a program, without reading the model."""
    program = find_program(path)
    try:
        with zipfile.ZipFile(program) as zf:
            manifest = ProgramManifest.from_json(json.loads(zf.read(MANIFEST)), str(program))
            return manifest, zf.read(IODESC)
    except QaicConfigError:
        raise  # a readable program of another format or version: its own message says so
    except UNREADABLE as exc:
        raise unreadable(program, exc) from exc


def read_member(path: str | Path, member: str) -> bytes:
    program = find_program(path)
    try:
        with zipfile.ZipFile(program) as zf:
            return zf.read(member)
    except UNREADABLE as exc:
        raise unreadable(program, exc) from exc


UNREADABLE = (zipfile.BadZipFile, KeyError, EOFError, ValueError)
"""What reading a truncated, overwritten or foreign ``programqpc.bin`` raises (ValueError: bad JSON)."""


def unreadable(program: Path, exc: BaseException) -> QaicConfigError:
    """The error for a program file that cannot be read, naming the file and the fix."""
    return QaicConfigError(
        f"cannot read the compiled program {program}: the file may be truncated or corrupt, or it was not "
        f"compiled by qaic-sim ({type(exc).__name__}: {exc}); delete it and compile it again (`qaic-aot "
        "compile`, or `qaic-sim compile` for an ONNX), or select the backend that produced it"
    )
