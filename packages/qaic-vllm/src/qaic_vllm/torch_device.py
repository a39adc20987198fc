"""torch on a host-only device: what vLLM expects of ``torch`` when the card is not a torch device."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

log = logging.getLogger("qaic.vllm")


def neutralise_accelerator() -> None:
    """Make ``torch.accelerator.empty_cache/synchronize`` no-ops on CPU-only torch (they raise there)."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or getattr(acc, "_qaic_neutralised", False):
        return
    try:
        available = bool(acc.is_available())
    except Exception:
        available = False
    if available:
        return
    for name in ("empty_cache", "synchronize", "empty_host_cache"):
        if hasattr(acc, name):
            setattr(acc, name, lambda *args, **kwargs: None)
    acc._qaic_neutralised = True  # type: ignore[attr-defined]


def name_device_type() -> None:
    """Name torch's PrivateUse1 device ``qaic`` so vLLM's process groups can say ``qaic:0``.

    No tensor is ever placed on it: the AOT runner keeps host tensors on the CPU. A device module
    that reports no usable device keeps ``torch.accelerator`` answering "not available".
    """
    current = torch._C._get_privateuse1_backend_name()
    if current == "privateuseone":
        torch.utils.rename_privateuse1_backend("qaic")
    elif current != "qaic":
        log.warning("torch's PrivateUse1 device is already named %r; vLLM groups may not start", current)
        return
    if not hasattr(torch, "qaic"):
        torch._register_device_module("qaic", _host_only_device_module())


def _host_only_device_module() -> ModuleType:
    module = ModuleType("qaic_vllm.torch_qaic")
    module.is_available = lambda: False  # type: ignore[attr-defined]
    module.device_count = lambda: 0  # type: ignore[attr-defined]
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    module.synchronize = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    module.empty_cache = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    module._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    return module
