"""A decoder's size read from a Hugging Face config alone, so timing needs no weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GATED_MLP_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
    }
    | {"phi3", "granite", "olmo", "olmo2", "cohere", "starcoder2_gated", "internlm2", "deepseek_v2", "exaone"}
)
"""Families whose MLP is gate * up -> down (three matrices); others use up -> down (two)."""

BIASED_ATTENTION_TYPES = frozenset(
    {"gpt2", "opt", "gpt_neox", "bloom", "phi", "starcoder2", "qwen2", "falcon"}
)
BIASED_MLP_TYPES = frozenset({"gpt2", "opt", "gptj", "gpt_neox", "bloom", "phi", "starcoder2", "falcon"})
"""Families whose projections carry biases (a few bytes per layer; read at fp16)."""

_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "head_dim": ("head_dim",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_topk"),
    "moe_intermediate_size": ("moe_intermediate_size",),
}


def _get(config: Any, key: str) -> Any:
    """First non-None value among a field's known spellings in a dict or a PretrainedConfig."""
    for name in _ALIASES[key]:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class DecoderShape:
    """The sizes that set a decoder's bytes and FLOPs per token."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> DecoderShape:
        """Read a dict or ``transformers.PretrainedConfig``; an ``mlp`` key ("gated"/"plain") overrides the family."""
        missing = [
            k for k in ("hidden_size", "num_layers", "num_heads", "vocab_size") if _get(config, k) is None
        ]
        if missing:
            names = ", ".join(_ALIASES[k][0] for k in missing)
            raise ValueError(f"decoder config lacks {names}; pass a Hugging Face causal-LM config")
        hidden, heads = int(_get(config, "hidden_size")), int(_get(config, "num_heads"))
        field = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        model_type = str(field("model_type", "") or "")
        mlp = field("mlp", None)
        if mlp not in (None, "gated", "plain"):
            raise ValueError(f"config 'mlp' must be 'gated' or 'plain', got {mlp!r}")
        experts = int(_get(config, "num_experts") or 0)
        inter = _get(config, "moe_intermediate_size") if experts else None
        inter = inter or _get(config, "intermediate_size") or 4 * hidden
        bias = bool(field("attention_bias", False) or field("enable_bias", False) or field("bias", False))
        bias = bias or model_type in BIASED_ATTENTION_TYPES
        return cls(
            hidden_size=hidden,
            num_layers=int(_get(config, "num_layers")),
            num_heads=heads,
            num_kv_heads=int(_get(config, "num_kv_heads") or heads),
            head_dim=int(_get(config, "head_dim") or hidden // heads),
            intermediate_size=int(inter),
            vocab_size=int(_get(config, "vocab_size")),
            gated_mlp=(mlp == "gated") if mlp else model_type in GATED_MLP_TYPES,
            attention_bias=bias,
            mlp_bias=bool(field("mlp_bias", False) or field("enable_bias", False))
            or model_type in BIASED_MLP_TYPES,
            num_experts=experts,
            experts_per_token=int(_get(config, "experts_per_token") or (1 if experts else 0)),
        )

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projection weights of one layer."""
        q_out = self.num_heads * self.head_dim
        return 2 * self.hidden_size * q_out + 2 * self.hidden_size * self.num_kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """Weights of one MLP (one expert for mixture-of-experts models)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
