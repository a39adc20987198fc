"""A tiny Llama's eager device on the simulator, for the eager device layer's tests."""

from __future__ import annotations

from qaic_core.eager import EagerDevice, EagerDeviceRequest
from qaic_core.manager import get_plugin_manager

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
}
MB = 2**20


def open_device(**kwargs: object) -> EagerDevice:
    """The sim backend's eager device for the tiny Llama (``kwargs``: more of ``EagerDeviceRequest``)."""
    backend = get_plugin_manager().select_device_backend("sim")
    assert backend.eager is not None
    return backend.eager(EagerDeviceRequest(model_config=CONFIG, label="tiny", **kwargs))  # type: ignore[arg-type]
