"""torch's accelerator calls and its PrivateUse1 device, for a card that is not a torch device.

CPU-only torch raises from ``torch.accelerator.empty_cache`` / ``synchronize``, which vLLM calls;
naming the PrivateUse1 device and registering its module has no public torch API (seams
``torch.accelerator`` and ``torch.privateuse1``).
"""

from __future__ import annotations

from types import ModuleType

import torch

_NEUTRALISED = "qaic_neutralised"


def neutralise_accelerator() -> None:
    """Make ``torch.accelerator.empty_cache/synchronize/empty_host_cache`` no-ops when no accelerator is available."""
    acc = torch.accelerator
    if getattr(acc, _NEUTRALISED, False):  # set only here
        return
    try:
        available = bool(acc.is_available())
    except Exception:
        available = False
    if available:
        return
    for name in ("empty_cache", "synchronize", "empty_host_cache"):
        if hasattr(acc, name):  # empty_host_cache is newer than the other two
            setattr(acc, name, lambda *args, **kwargs: None)
    setattr(acc, _NEUTRALISED, True)


def privateuse1_name() -> str:
    """The name torch's PrivateUse1 device goes by (``privateuseone`` until renamed)."""
    return str(torch._C._get_privateuse1_backend_name())


def register_host_only_device(name: str) -> None:
    """Register ``torch.<name>`` as a device module that reports no usable device (nothing runs on it)."""
    if not hasattr(torch, name):
        torch._register_device_module(name, _host_only_device_module(name))


def _host_only_device_module(name: str) -> ModuleType:
    module = ModuleType(f"qaic_vllm.torch_{name}")
    module.is_available = lambda: False  # type: ignore[attr-defined]
    module.device_count = lambda: 0  # type: ignore[attr-defined]
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    module.synchronize = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    module.empty_cache = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    module._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    return module
