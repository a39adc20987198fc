"""The ``pyt`` path's model loader ``vllm``: vLLM's own model class, loaded by vLLM's loader.

:func:`qaic_pyt.step_model.open_step_model` calls the selected loader (kind ``vllm_classes``) once
the eager device is open and ``load_config.device`` points at it; the loader returns the module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from qaic_core.execution import ExecutionConfig

VLLM_LOADER = "vllm"


def load_vllm_model(config: ExecutionConfig) -> torch.nn.Module:
    """The architecture's vLLM model class with its weights, on ``vllm_config.load_config.device``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    from qaic_pyt.step_model import vllm_config_of

    vllm_config = vllm_config_of(config)
    with set_current_vllm_config(vllm_config):
        model: torch.nn.Module = get_model(vllm_config=vllm_config)
    return model


def reload_vllm_weights(config: ExecutionConfig, model: object) -> None:
    """Read the checkpoint into ``model`` again, in place, with vLLM's loader for its load format."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from qaic_pyt.step_model import vllm_config_of

    vllm_config = vllm_config_of(config)
    assert isinstance(model, torch.nn.Module)
    loader = get_model_loader(vllm_config.load_config)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        loader.load_weights(model, vllm_config.model_config)
