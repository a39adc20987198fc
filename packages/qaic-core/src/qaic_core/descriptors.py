"""Frozen descriptors that plugins return from the hooks in :mod:`qaic_core.hookspecs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class DeviceBackend:
    """A source of Cloud AI devices: the real ``qaicrt`` runtime or the simulator.

    ``runtime`` returns a module with the real ``qaicrt`` names (QIDList, Context, Queue, Qpc,
    Program, ExecObj, Util, QStatus, ...); ``aicapi`` returns the module whose ``IoDesc``
    parses ``Qpc.getIoDescriptor()`` bytes; ``compiler`` takes ``qaic-compile`` argv
    (without the program name) and raises on failure.
    """

    name: str
    package: str
    runtime: Callable[[], ModuleType]
    aicapi: Callable[[], ModuleType]
    is_available: Callable[[], bool] = lambda: True
    compiler: Callable[[Sequence[str]], None] | None = None
    priority: int = 0
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""


@dataclass(frozen=True)
class SessionBackend:
    """A factory of sessions over a compiled program directory."""

    name: str
    package: str
    factory: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation for the eager path, given as a dotted class path."""

    name: str
    package: str
    class_path: str
    description: str = ""


@dataclass(frozen=True)
class ModelLoader:
    """Loads models of the listed Hugging Face architectures for one execution path."""

    name: str
    package: str
    architectures: frozenset[str]
    load: Callable[..., Any]
    description: str = ""


CAPABILITIES = frozenset(
    {
        "compile",  # has a compiler taking qaic-compile flags
        "retained_state",  # keeps KV on device between runs
        "multi_device",  # programs spanning several QIDs (devMapping / mdp partition)
        "mxfp6",  # -mxfp6-matmul weights
        "mxint8",  # mxint8 KV cache through custom_io.yaml
        "fp16",  # -convert-to-fp16
        "slicing",  # createSlicingSpecHandle / setDataWithSlices
        "faults",  # fault injection for tests
        "traces",  # per-run traces
        "timing",  # modelled device time in getPerformanceInfo
    }
)
"""Capability names a backend may claim; the conformance suite skips tests for unclaimed ones."""
