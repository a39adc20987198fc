"""Parsing of ``qaic-compile`` argv (``-flag`` and ``-flag=value``), as QEfficient passes it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qaic_core.compiler_flags import BOOL_FLAGS, VALUE_FLAGS
from qaic_core.errors import QaicConfigError
from qaic_core.settings import MAX_CORES_PER_SOC

log = logging.getLogger("qaic.sim.compiler")

HW_VERSIONS = {"ai100", "2.0"}
AFFECTS_PROGRAM = {
    "aic-hw",
    "aic-hw-version",
    "m",
    "retained-state",
    "convert-to-fp16",
    "mxfp6-matmul",
    "aic-num-cores",
    "network-specialization-config",
    "custom-IO-list-file",
    "mdp-load-partition-config",
    "aic-binary-dir",
    "onnx-define-symbol",
}
"""Flags the simulator acts on; the rest are accepted because the compiler takes them."""


@dataclass
class CompileOptions:
    """The parsed command line."""

    model: Path
    binary_dir: Path
    specializations: Path | None = None
    custom_io: Path | None = None
    mdp_config: Path | None = None
    num_cores: int = 1
    retained_state: bool = False
    convert_to_fp16: bool = False
    mxfp6_matmul: bool = False
    define_symbols: dict[str, int] = field(default_factory=dict)
    argv: tuple[str, ...] = ()


def _int(name: str, value: str, low: int, high: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        raise QaicConfigError(f"-{name}={value!r} is not an integer") from None
    if n < low or (high is not None and n > high):
        limit = f"between {low} and {high}" if high is not None else f">= {low}"
        raise QaicConfigError(f"-{name}={n} is out of range: must be {limit}")
    return n


def parse_argv(argv: Sequence[str]) -> CompileOptions:
    """Read qaic-compile flags; an unknown flag or a missing value is an error naming it."""
    values: dict[str, str] = {}
    flags: set[str] = set()
    symbols: dict[str, int] = {}
    ignored: list[str] = []
    for arg in argv:
        if not arg.startswith("-"):
            raise QaicConfigError(
                f"unexpected argument {arg!r}: qaic-compile takes only -flag or -flag=value"
            )
        name, eq, value = arg.lstrip("-").partition("=")
        if name in BOOL_FLAGS:
            if eq:
                raise QaicConfigError(f"-{name} takes no value (got {arg!r})")
            flags.add(name)
        elif name in VALUE_FLAGS:
            if not eq or not value:
                raise QaicConfigError(f"-{name} needs a value: write -{name}=VALUE")
            if name == "onnx-define-symbol":
                sym, comma, num = value.partition(",")
                if not comma:
                    raise QaicConfigError(
                        f"-onnx-define-symbol={value!r}: write -onnx-define-symbol=NAME,VALUE"
                    )
                symbols[sym.strip()] = _int(f"onnx-define-symbol {sym}", num.strip(), 1)
                continue
            values[name] = value
        else:
            raise QaicConfigError(
                f"unknown qaic-compile flag {arg!r}; the simulator accepts: "
                + ", ".join(f"-{f}" for f in sorted(BOOL_FLAGS | VALUE_FLAGS))
            )
        if name not in AFFECTS_PROGRAM:
            ignored.append(arg)
    if "aic-hw" not in flags:
        raise QaicConfigError("-aic-hw is required: the simulator compiles for the device only")
    hw = values.get("aic-hw-version", "ai100")
    if hw not in HW_VERSIONS:
        raise QaicConfigError(f"-aic-hw-version={hw!r} is not supported; use -aic-hw-version=ai100")
    if "m" not in values:
        raise QaicConfigError("no model given: pass -m=path/to/model.onnx")
    if "aic-binary-dir" not in values:
        raise QaicConfigError("no output directory given: pass -aic-binary-dir=<dir>/qpc")
    model = Path(values["m"])
    if not model.is_file():
        raise QaicConfigError(f"-m={model}: no such ONNX file")
    opts = CompileOptions(model=model, binary_dir=Path(values["aic-binary-dir"]), argv=tuple(argv))
    for key, attr in (
        ("network-specialization-config", "specializations"),
        ("custom-IO-list-file", "custom_io"),
        ("mdp-load-partition-config", "mdp_config"),
    ):
        if key in values:
            path = Path(values[key])
            if not path.is_file():
                raise QaicConfigError(f"-{key}={path}: no such file")
            setattr(opts, attr, path)
    if "aic-num-cores" in values:
        opts.num_cores = _int("aic-num-cores", values["aic-num-cores"], 1, MAX_CORES_PER_SOC)
    for name in ("mos", "stats-batchsize"):  # checked like the real compiler, no effect here
        if name in values:
            _int(name, values[name], 1)
    opts.retained_state = "retained-state" in flags
    opts.convert_to_fp16 = "convert-to-fp16" in flags
    opts.mxfp6_matmul = "mxfp6-matmul" in flags
    opts.define_symbols = symbols
    if ignored:
        log.info("accepted without effect in the simulator: %s", " ".join(ignored))
    return opts
