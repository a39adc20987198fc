"""The eager device layer: where the eager (``pyt``) path keeps its tensors and how a device accounts for them.

The eager path runs model classes through PyTorch. On a card its tensors live on the ``qaic`` torch
device that ``torch_qaic`` registers; on the simulator they are CPU tensors, and a device backend
supplies an :class:`EagerDevice` that accounts them against the simulated card instead: weights
and KV cache are reserved from the SoC's DDR (a model that does not fit fails when it reserves),
and each step's device time comes from the timing model (so traces and pacing work as they do for
compiled programs). A :class:`qaic_core.descriptors.DeviceBackend` offers one through its ``eager``
member; the eager path uses ``torch_qaic`` when the backend offers none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from qaic_core.errors import QaicConfigError


@dataclass(frozen=True)
class EagerDeviceRequest:
    """What the eager path asks a device backend for: a device group for one model.

    ``model_config`` is the model's Hugging Face configuration as a dict (the timing model sizes
    each step from it); ``weight_dtype`` and ``kv_dtype`` name the storage formats (``float32``,
    ``float16``, ``bfloat16``); ``label`` names the model in traces.
    """

    model_config: Mapping[str, Any]
    device_group: tuple[int, ...] | None = None
    weight_dtype: str = "float32"
    kv_dtype: str = "float32"
    label: str = "eager"


@dataclass(frozen=True)
class EagerStep:
    """The shape of one eager step: a flattened batch of prefill chunks and decodes.

    ``query_lens[i]`` tokens of sequence ``i`` run this step; ``seq_lens[i]`` counts its tokens
    after the step (so its attention reads that many positions); ``num_logits`` rows of logits
    come out.
    """

    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    num_logits: int

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


class DeviceMemoryError(QaicConfigError):
    """A reservation does not fit the device; the caller re-raises it naming the settings to change."""

    def __init__(
        self,
        what: str,
        needed_bytes: int,
        free_bytes: int,
        total_bytes: int,
        device: str,
        details: Mapping[str, int] | None = None,
    ) -> None:
        self.what = what
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.device = device
        self.details = dict(details or {})
        super().__init__(self.summary())

    def summary(self) -> str:
        mb = 2**20
        parts = ", ".join(f"{name} {value / mb:.1f} MB" for name, value in self.details.items())
        return (
            f"not enough device memory on {self.device} for the {self.what}: it needs "
            f"{self.needed_bytes / mb:.1f} MB{f' ({parts})' if parts else ''} but "
            f"{self.free_bytes / mb:.1f} of {self.total_bytes / mb:.0f} MB are free"
        )


@runtime_checkable
class EagerDevice(Protocol):
    """A device group the eager path runs on (see the module docstring)."""

    @property
    def torch_device(self) -> str:
        """Where tensors go: ``cpu`` on the simulator, ``qaic:N`` on a card."""
        ...

    @property
    def device_ids(self) -> tuple[int, ...]:
        """The (visible) device ids of the group."""
        ...

    @property
    def name(self) -> str:
        """The group in messages, such as ``QID 0 (simulated ultra)``."""
        ...

    def total_bytes(self) -> int:
        """DDR of the group."""
        ...

    def free_bytes(self) -> int:
        """DDR not yet reserved by anyone (this model's reservations included)."""
        ...

    def reserve(self, what: str, nbytes: int) -> None:
        """Hold ``nbytes`` more for ``what`` (``weights``, ``kv cache``); raises :class:`DeviceMemoryError`."""
        ...

    def settle(self, what: str, nbytes: int) -> None:
        """Hold exactly ``nbytes`` for ``what`` now that it is allocated (a reservation was an estimate).

        Raises :class:`DeviceMemoryError` when the growth does not fit.
        """
        ...

    def release(self, what: str) -> None:
        """Give back everything held for ``what``."""
        ...

    def step(self, work: EagerStep) -> AbstractContextManager[None]:
        """Wrap one step's host work: records its device time, trace and pacing."""
        ...

    def close(self) -> None:
        """Release every reservation."""
        ...
