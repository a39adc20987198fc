"""Registers the eager (``pyt``) execution path, its model loader and its attention backend with qaic-core."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from qaic_core import hookimpl
from qaic_core.descriptors import VLLM_CLASSES, AttentionBackend, ExecutionPath, ModelLoader
from qaic_core.execution import PAGED_KV, PREFIX_CACHING
from qaic_pyt.loader import VLLM_LOADER, load_vllm_model, reload_vllm_weights

if TYPE_CHECKING:
    from qaic_core.execution import ExecutionConfig
    from qaic_pyt.step_model import EagerStepModel

ATTENTION_BACKEND = "qaic-paged-sdpa"
ATTENTION_CLASS = "qaic_pyt.attention.QaicPagedAttentionBackend"

ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Phi3ForCausalLM",
        "GPT2LMHeadModel",
        "GraniteForCausalLM",
        "Olmo2ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)
"""Decoder architectures whose vLLM classes run eagerly here, each checked against transformers."""

LOADER_KINDS = frozenset({VLLM_CLASSES})
"""What the pyt path loads a model as (its model loaders' kind)."""


def open_step_model(config: ExecutionConfig) -> EagerStepModel:
    """Imported on use: loading the plugin stays free of vLLM and torch."""
    from qaic_pyt import step_model

    return step_model.open_step_model(config)


def check(config: ExecutionConfig) -> None:
    """The loader the configuration names exists and loads vLLM's classes; then the path's own checks."""
    from qaic_core import get_plugin_manager
    from qaic_pyt import check as checks

    get_plugin_manager().select_model_loader(config, LOADER_KINDS, "pyt")

    checks.check(config)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


@hookimpl
def qaic_execution_paths() -> list[ExecutionPath]:
    return [
        ExecutionPath(
            name="pyt",
            package="qaic-pyt",
            architectures=ARCHITECTURES,
            open=open_step_model,
            check=check,
            capabilities=frozenset({PAGED_KV, PREFIX_CACHING}),
            attention_backend=ATTENTION_BACKEND,
            is_available=vllm_installed,
            description="vLLM's model classes run eagerly (torch_qaic on a card, accounted CPU tensors on "
            "the simulator) over a paged KV cache; needs vLLM",
            loader_kinds=LOADER_KINDS,
        )
    ]


@hookimpl
def qaic_model_loaders() -> list[ModelLoader]:
    return [
        ModelLoader(
            name=VLLM_LOADER,
            package="qaic-pyt",
            kind=VLLM_CLASSES,
            load=load_vllm_model,
            reload=reload_vllm_weights,
            description="vLLM's own model class for the architecture, weights read by vLLM's loader",
            priority=10,
        )
    ]


@hookimpl
def qaic_attention_backends() -> list[AttentionBackend]:
    return [
        AttentionBackend(
            name=ATTENTION_BACKEND,
            package="qaic-pyt",
            class_path=ATTENTION_CLASS,
            description="plain-torch SDPA over vLLM's paged KV blocks (sliding windows, soft-capping, GQA)",
        )
    ]
