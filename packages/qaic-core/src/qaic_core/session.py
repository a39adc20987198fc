"""The session surface every backend offers: QEfficient's ``QAICInferenceSession``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from qaic_core.types import Binding


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
