"""The compiled-program (QPC) directory layout shared with QEfficient and the real compiler.

::

    $QEFF_HOME/<arch>/<model>-<export_hash>/
      <model>.onnx, hashed_export_params.json
      qpc-<compile_hash>/
        specializations.json, custom_io.yaml, hashed_compile_params.json, qconfig.json,
        [mdp_ts_<N>.json]
        qpc/programqpc.bin
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from qaic_core.errors import QaicConfigError
from qaic_core.types import Specialization

PROGRAM_FILE = "programqpc.bin"
SPECIALIZATIONS_FILE = "specializations.json"
CUSTOM_IO_FILE = "custom_io.yaml"
QCONFIG_FILE = "qconfig.json"
COMPILE_PARAMS_FILE = "hashed_compile_params.json"
EXPORT_PARAMS_FILE = "hashed_export_params.json"


def program_path(qpc_dir: Path) -> Path:
    """Path of ``programqpc.bin`` for a ``qpc-<hash>`` directory or its inner ``qpc`` folder."""
    qpc_dir = Path(qpc_dir)
    if (qpc_dir / PROGRAM_FILE).exists() or qpc_dir.name == "qpc":
        return qpc_dir / PROGRAM_FILE
    return qpc_dir / "qpc" / PROGRAM_FILE


def qpc_exists(qpc_dir: Path) -> bool:
    """A QPC exists when its ``qpc/programqpc.bin`` exists."""
    return program_path(qpc_dir).exists()


def params_hash(params: Mapping[str, Any], length: int = 16) -> str:
    """Stable hash of a parameter mapping (sorted JSON), used in cache directory names."""
    text = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def write_specializations(path: Path, specs: Sequence[Specialization], *, legacy: bool = False) -> None:
    """Write ``specializations.json`` in the current form, or the older flat list when ``legacy``."""
    if legacy:
        data: Any = {"specializations": [{k: str(v) for k, v in s.symbols.items()} for s in specs]}
    else:
        data = {
            "specializations": [
                {"name": s.name, "symbols": {k: str(v) for k, v in s.symbols.items()}} for s in specs
            ]
        }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def read_specializations(path: Path) -> list[Specialization]:
    """Read either form of ``specializations.json``; symbol values become integers."""
    raw = json.loads(Path(path).read_text())
    entries = raw.get("specializations") if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise QaicConfigError(f"{path}: expected a non-empty 'specializations' list")
    specs: list[Specialization] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise QaicConfigError(f"{path}: specialization {i} is not an object")
        if "symbols" in entry:
            name = str(entry.get("name", f"spec{i}"))
            symbols = entry["symbols"]
        else:
            name, symbols = f"spec{i}", entry
        try:
            values = {str(k): int(v) for k, v in symbols.items()}
        except (TypeError, ValueError) as exc:
            raise QaicConfigError(f"{path}: specialization {name!r} has a non-integer symbol: {exc}") from exc
        specs.append(Specialization(name, values))
    return specs


def write_custom_io(path: Path, precisions: Mapping[str, str]) -> None:
    """Write ``custom_io.yaml``: a list of ``{IOName, Precision}`` entries."""
    entries = [{"IOName": name, "Precision": prec} for name, prec in precisions.items()]
    Path(path).write_text(yaml.safe_dump(entries, sort_keys=False))


def read_custom_io(path: Path) -> dict[str, str]:
    data = yaml.safe_load(Path(path).read_text()) or []
    if not isinstance(data, list):
        raise QaicConfigError(f"{path}: expected a list of {{IOName, Precision}} entries")
    out: dict[str, str] = {}
    for entry in data:
        if not isinstance(entry, dict) or "IOName" not in entry or "Precision" not in entry:
            raise QaicConfigError(f"{path}: each entry needs IOName and Precision, got {entry!r}")
        out[str(entry["IOName"])] = str(entry["Precision"])
    return out


def kv_custom_io(num_layers: int, precision: str) -> dict[str, str]:
    """custom_io entries for every KV input and its retained-state output."""
    out: dict[str, str] = {}
    for i in range(num_layers):
        for kind in ("past_key", "past_value"):
            out[f"{kind}.{i}"] = precision
            out[f"{kind}.{i}_RetainedState"] = precision
    return out


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise QaicConfigError(f"{path}: expected a JSON object")
    return data


def mdp_partition(devices: Sequence[int], num_cores: int) -> dict[str, Any]:
    """The mdp load-partition config for tensor slicing over ``devices`` (``mdp_ts_<N>.json``)."""
    n = len(devices)
    return {
        "connections": [{"devices": list(range(n)), "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [{"deviceId": i, "numCores": num_cores} for i in range(n)],
            }
        ],
    }
