"""The session surface every backend offers: QEfficient's ``QAICInferenceSession``.

:class:`QaicSession` is QEfficient's surface; :class:`DeviceSession` adds what the ``aot`` path
drives (overlapping runs, slices, reload), and :class:`SessionRequest` is what a session factory
(hook ``qaic_session_factories``) gets to open one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from qaic_core.types import Binding

if TYPE_CHECKING:
    from qaic_core.descriptors import DeviceBackend


@runtime_checkable
class QaicSession(Protocol):
    """A loaded program on one device group; inputs and outputs are numpy arrays by name."""

    @property
    def input_names(self) -> list[str]: ...

    @property
    def output_names(self) -> list[str]: ...

    @property
    def bindings(self) -> list[Binding]: ...

    @property
    def binding_index_map(self) -> dict[str, int]: ...

    @property
    def allowed_shapes(self) -> list[list[tuple[int, list[int]]]]: ...

    def activate(self) -> None: ...

    def deactivate(self) -> None: ...

    def set_buffers(self, buffers: Mapping[str, np.ndarray]) -> None: ...

    def skip_buffers(self, names: Iterable[str]) -> None: ...

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class RunInFlight(Protocol):
    """One run handed to the device; ``wait()`` blocks and returns its outputs by name."""

    def wait(self) -> dict[str, np.ndarray]: ...


class PreparedProgramRun(Protocol):
    """A run whose buffers are ready and not yet handed over (inputs may still be written)."""

    def array(self, name: str) -> np.ndarray:
        """The buffer bound for binding ``name``: the device reads it when the run starts."""
        ...

    def submit(self) -> RunInFlight: ...


@runtime_checkable
class DeviceSession(QaicSession, Protocol):
    """What the ``aot`` path drives a program through: a :class:`QaicSession` with runs that overlap.

    A session factory (:class:`qaic_core.descriptors.SessionFactory`) opens one; ``qaic-aot``'s
    ``QAICInferenceSession`` is the default. Runs go to one of ``num_exec_objects`` exec objects;
    runs on different ones may be in flight together.
    """

    @property
    def device_backend(self) -> DeviceBackend: ...

    @property
    def num_exec_objects(self) -> int: ...

    @property
    def is_active(self) -> bool: ...

    def binding_index(self, name: str) -> int: ...

    def submit(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> RunInFlight: ...

    def prepare(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> PreparedProgramRun: ...

    def run_with_slices(
        self,
        inputs: Mapping[str, np.ndarray],
        slices: Mapping[str, np.ndarray],
        spec_json: str,
        params: Sequence[tuple[str, int]],
        exec_index: int = 0,
    ) -> dict[str, np.ndarray]:
        """Run once with ``slices`` read from or written to regions of the retained state (``slicing``)."""
        ...

    def reload(self) -> None:
        """Load and activate the program again after a device fault (its retained state is lost)."""
        ...


@dataclass(frozen=True)
class SessionRequest:
    """What a session factory needs to open a :class:`DeviceSession` on one program."""

    program: Path
    """The program directory (holding ``programqpc.bin``)."""
    backend: DeviceBackend
    device_ids: tuple[int, ...] | None = None
    """The device group (None: the backend's first device)."""
    enable_debug_logs: bool = False
    num_exec_objects: int = 2
