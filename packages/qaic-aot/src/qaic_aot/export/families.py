"""Per-family switches of the one decoder graph, read from a Hugging Face config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from qaic_aot.export.traced.families import TRACED_FAMILIES
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

# HF architecture class name -> family handled by the hand-built decoder graph (decoder.py).
GRAPH_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GemmaForCausalLM": "gemma",
    "GPT2LMHeadModel": "gpt2",
}
TRACED = "traced"
# Every architecture the exporter takes -> its graph family, or "traced" (transformers' code, traced).
SUPPORTED_ARCHITECTURES: dict[str, str] = {**{a: TRACED for a in TRACED_FAMILIES}, **GRAPH_ARCHITECTURES}

ROUTE_ENV = "QAIC_AOT_ROUTE"
ROUTES = ("graph", TRACED)
"""``graph``: the hand-built decoder graph; ``traced``: transformers' own code traced with KV replacements."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the graph builder needs to know about one model, as plain values."""

    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float
    activation: str
    norm: str  # "rms" | "layer"
    norm_weight_offset: float  # Gemma stores w and scales by (1 + w)
    embed_scale: float | None  # Gemma multiplies embeddings by sqrt(hidden)
    positions: str  # "rope" | "learned"
    rotary_dim: int
    qkv: str  # "separate" | "phi3" | "gpt2"
    mlp: str  # "gated" | "gated_fused" | "gpt2"
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    attn_scale: float  # multiplies q @ k^T
    attn_scale_divisor_by_layer: bool  # GPT-2 scale_attn_by_inverse_layer_idx
    weight_prefix: str  # "model." or "transformer."

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def architecture_of(config: Any) -> str:
    """The first architecture class named by a config, or an error saying it names none."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        raise QaicConfigError(
            "config.json lists no 'architectures'; add the model class name, one of: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return str(archs[0])


def check_architecture(config: Any) -> str:
    """Return the family of a config's architecture; unsupported ones raise listing the supported."""
    arch = architecture_of(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise QaicConfigError(
            f"architecture {arch!r} is not supported by the qaic-aot exporter; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return SUPPORTED_ARCHITECTURES[arch]


def export_route(architecture: str) -> str:
    """``graph`` for the hand-built families unless ``QAIC_AOT_ROUTE=traced``; ``traced`` for the others."""
    wanted = os.environ.get(ROUTE_ENV, "").strip().lower()
    if wanted and wanted not in ROUTES:
        raise QaicConfigError(f"{ROUTE_ENV}={wanted!r} is not one of {', '.join(ROUTES)}")
    if architecture in GRAPH_ARCHITECTURES and wanted != TRACED:
        return "graph"
    if wanted == "graph":
        raise QaicConfigError(
            f"{ROUTE_ENV}=graph but {architecture} has no hand-built graph (only "
            f"{', '.join(GRAPH_ARCHITECTURES)}); unset {ROUTE_ENV} to trace it"
        )
    return TRACED


def model_facts(config: Any) -> dict[str, Any]:
    """Layer count, KV geometry and vocabulary of any decoder config (GPT-2 names included)."""
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    return {
        "architecture": architecture_of(config),
        "num_layers": int(getattr(config, "num_hidden_layers", None) or config.n_layer),
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or hidden // heads),
        "vocab_size": int(config.vocab_size),
    }


def rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings in transformers 5 form (``rope_parameters``), also from older ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise QaicConfigError(
            f"activation {name!r} is not supported by the exporter; supported: {', '.join(ACTIVATIONS)}"
        )
    return name


def decoder_spec(config: Any, settings: CompileSettings) -> DecoderSpec:
    """Read a transformers config into a DecoderSpec, rejecting what the graph cannot express."""
    family = check_architecture(config)
    arch = architecture_of(config)
    if family == TRACED:
        raise QaicConfigError(
            f"{arch} has no hand-built decoder graph (only {', '.join(GRAPH_ARCHITECTURES)}); it is exported "
            "by tracing transformers' code"
        )
    if family == "gpt2":
        return _gpt2_spec(config, arch, settings)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise QaicConfigError(
            f"{arch}: rope type {rope_type!r} is not supported by the exporter (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint without it or install QEfficient"
        )
    max_pos = int(getattr(config, "max_position_embeddings", 0) or 0)
    if rope_type == "dynamic" and max_pos and settings.ctx_len > max_pos:
        raise QaicConfigError(
            f"{arch}: dynamic rope scaling changes the frequencies beyond max_position_embeddings "
            f"({max_pos}); lower --ctx-len ({settings.ctx_len}) to at most {max_pos}"
        )
    partial = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    window = _sliding_window(config, family)
    hidden_act = getattr(config, "hidden_activation", None) or config.hidden_act
    return DecoderSpec(
        architecture=arch,
        family=family,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        norm_eps=float(config.rms_norm_eps),
        activation=_activation(str(hidden_act)),
        norm="rms",
        norm_weight_offset=1.0 if family == "gemma" else 0.0,
        embed_scale=float(config.hidden_size) ** 0.5 if family == "gemma" else None,
        positions="rope",
        rotary_dim=int(head_dim * partial),
        qkv="phi3" if family == "phi3" else "separate",
        mlp="gated_fused" if family == "phi3" else "gated",
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window,
        attn_scale=head_dim**-0.5,
        attn_scale_divisor_by_layer=False,
        weight_prefix="model.",
    )


def _sliding_window(config: Any, family: str) -> int | None:
    """The attention window, if the model uses one (Qwen only when ``use_sliding_window``)."""
    if family in {"qwen2", "qwen3"} and not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        raise QaicConfigError(
            f"{family}: mixed sliding/full attention layers ({sorted(set(layer_types))}) are not supported "
            "by the exporter; install QEfficient for this checkpoint"
        )
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def _gpt2_spec(config: Any, arch: str, settings: CompileSettings) -> DecoderSpec:
    n_positions = int(config.n_positions)
    if settings.ctx_len > n_positions:
        raise QaicConfigError(
            f"{arch}: ctx_len ({settings.ctx_len}) exceeds the learned position table (n_positions="
            f"{n_positions}); lower --ctx-len to at most {n_positions}"
        )
    if getattr(config, "add_cross_attention", False):
        raise QaicConfigError(f"{arch}: cross-attention GPT-2 variants are not supported by the exporter")
    hidden = int(config.n_embd)
    heads = int(config.n_head)
    return DecoderSpec(
        architecture=arch,
        family="gpt2",
        num_layers=int(config.n_layer),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(config.n_inner or 4 * hidden),
        vocab_size=int(config.vocab_size),
        norm_eps=float(config.layer_norm_epsilon),
        activation=_activation(str(config.activation_function)),
        norm="layer",
        norm_weight_offset=0.0,
        embed_scale=None,
        positions="learned",
        rotary_dim=0,
        qkv="gpt2",
        mlp="gpt2",
        qk_norm=False,
        tie_word_embeddings=True,
        sliding_window=None,
        attn_scale=(hidden // heads) ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0,
        attn_scale_divisor_by_layer=bool(getattr(config, "scale_attn_by_inverse_layer_idx", False)),
        weight_prefix="transformer.",
    )
