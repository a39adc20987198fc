"""torch on a host-only device: what vLLM expects of ``torch`` when the card is not a torch device."""

from __future__ import annotations

import logging

from qaic_vllm.compat import torch_device as torch_seams
from qaic_vllm.compat.torch_device import neutralise_accelerator

__all__ = ["name_device_type", "neutralise_accelerator"]

log = logging.getLogger("qaic.vllm")


def name_device_type() -> None:
    """Name torch's PrivateUse1 device ``qaic`` so vLLM's process groups can say ``qaic:0``.

    No tensor is ever placed on it: the AOT runner keeps host tensors on the CPU. A device module
    that reports no usable device keeps ``torch.accelerator`` answering "not available".
    """
    import torch

    current = torch_seams.privateuse1_name()
    if current == "privateuseone":
        torch.utils.rename_privateuse1_backend("qaic")
    elif current != "qaic":
        log.warning("torch's PrivateUse1 device is already named %r; vLLM groups may not start", current)
        return
    torch_seams.register_host_only_device("qaic")
