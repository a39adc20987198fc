"""Where the eager path runs: the device backend's eager layer, else the card through ``torch_qaic``."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from qaic_core.descriptors import DeviceBackend
from qaic_core.eager import DeviceMemoryError, EagerDevice, EagerDeviceRequest, EagerStep
from qaic_core.errors import QaicConfigError

log = logging.getLogger("qaic.pyt")

TORCH_QAIC = "torch_qaic"


def torch_qaic_installed() -> bool:
    """Whether ``torch_qaic`` (the card's PyTorch device, from the Apps SDK) can be imported."""
    return importlib.util.find_spec(TORCH_QAIC) is not None


def open_device(backend: DeviceBackend, request: EagerDeviceRequest) -> EagerDevice:
    """The backend's own eager layer (the simulator's), else ``torch_qaic``'s ``qaic`` device."""
    if backend.eager is not None:
        return backend.eager(request)
    if torch_qaic_installed():
        return TorchQaicDevice(request)
    raise QaicConfigError(
        f"the pyt (eager) execution mode needs {TORCH_QAIC} (the Cloud AI Apps SDK installed with "
        f"--install-torch-qaic) or a device backend with an eager device layer; the {backend.name!r} "
        f"backend ({backend.package}) has none: install {TORCH_QAIC}, use QAIC_BACKEND=sim, or choose the "
        "aot execution mode"
    )


class TorchQaicDevice:
    """One SoC through ``torch_qaic``: tensors on ``qaic:N``, memory from the device, real step time.

    Runs only where a card and ``torch_qaic`` are present; the simulator supplies its own layer.
    """

    def __init__(self, request: EagerDeviceRequest) -> None:
        ids = request.device_group or (0,)
        if len(ids) != 1:
            raise QaicConfigError(
                f"the pyt (eager) execution mode runs on one SoC, not on device_group {list(ids)}"
            )
        self.qid = int(ids[0])
        importlib.import_module(TORCH_QAIC)  # registers the ``qaic`` torch device (PrivateUse1)
        try:
            self._module: Any = importlib.import_module(f"{TORCH_QAIC}.qaic")
        except ImportError:
            import torch

            self._module = getattr(torch, "qaic", None)
        if self._module is None:
            raise QaicConfigError(f"{TORCH_QAIC} is installed but offers no qaic device module")
        set_device = getattr(self._module, "set_device", None)
        if callable(set_device):
            set_device(self.qid)
        self._held: dict[str, int] = {}

    @property
    def torch_device(self) -> str:
        return f"qaic:{self.qid}"

    @property
    def device_ids(self) -> tuple[int, ...]:
        return (self.qid,)

    @property
    def name(self) -> str:
        return f"QID {self.qid}"

    def _mem_info(self) -> tuple[int, int]:
        free, total = self._module.mem_get_info(self.qid)
        return int(free), int(total)

    def total_bytes(self) -> int:
        return self._mem_info()[1]

    def free_bytes(self) -> int:
        """Free device memory less what this layer has promised but not yet allocated."""
        return self._mem_info()[0]

    def reserve(self, what: str, nbytes: int) -> None:
        free, total = self._mem_info()
        if nbytes > free:
            raise DeviceMemoryError(what, nbytes, free, total, self.name)
        self._held[what] = self._held.get(what, 0) + nbytes

    def settle(self, what: str, nbytes: int) -> None:
        """The allocation already happened on the device (and would have failed there): record it."""
        self._held[what] = nbytes

    def release(self, what: str) -> None:
        self._held.pop(what, None)

    @contextmanager
    def step(self, work: EagerStep) -> Iterator[None]:
        yield
        synchronize = getattr(self._module, "synchronize", None)
        if callable(synchronize):
            synchronize()

    def close(self) -> None:
        self._held.clear()
