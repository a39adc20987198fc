"""Architectures exported by tracing transformers' own modelling code: one line each.

Kept free of torch so the architecture list stays cheap to read (the vLLM plugin reads it at start-up).
An entry names the architecture class and, where the family needs one, the setting that makes its
code traceable (``experts``: a transformers experts implementation without data-dependent loops) and
what the route refuses (``position_limit``: the config field bounding ``ctx_len``; ``refuse``: config
values it cannot express).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

TRACEABLE_EXPERTS = "batched_mm"
"""Gathers each token's chosen experts' weights and multiplies in one batch: a static graph."""


@dataclass(frozen=True)
class TracedFamily:
    """How one architecture is traced."""

    architecture: str
    experts: str | None = None
    position_limit: str | None = None
    refuse: tuple[tuple[str, Any, str], ...] = ()


MOE = TRACEABLE_EXPERTS

TRACED_FAMILIES: dict[str, TracedFamily] = {
    f.architecture: f
    for f in (
        TracedFamily("LlamaForCausalLM"),
        TracedFamily("MistralForCausalLM"),
        TracedFamily("Qwen2ForCausalLM"),
        TracedFamily("Qwen3ForCausalLM"),
        TracedFamily("Phi3ForCausalLM"),
        TracedFamily("GemmaForCausalLM"),
        TracedFamily("GPT2LMHeadModel", position_limit="n_positions"),
        TracedFamily("Gemma2ForCausalLM"),
        TracedFamily("Gemma3ForCausalLM"),
        TracedFamily("GraniteForCausalLM"),
        TracedFamily("Olmo2ForCausalLM"),
        TracedFamily(
            "FalconForCausalLM",
            refuse=(("alibi", True, "ALiBi Falcon checkpoints (falcon-rw) are not supported"),),
        ),
        TracedFamily("GPTJForCausalLM", position_limit="n_positions"),
        TracedFamily("GPTBigCodeForCausalLM", position_limit="n_positions"),
        TracedFamily("Starcoder2ForCausalLM"),
        TracedFamily("PhiForCausalLM"),
        TracedFamily("MptForCausalLM", position_limit="max_seq_len"),
        TracedFamily("MixtralForCausalLM", experts=MOE),
        TracedFamily("Qwen2MoeForCausalLM", experts=MOE),
        TracedFamily("Qwen3MoeForCausalLM", experts=MOE),
        TracedFamily("GptOssForCausalLM", experts=MOE),
    )
}


def check_traceable(family: TracedFamily, config: Any, settings: CompileSettings) -> None:
    """Refuse, naming the setting to change, what the traced route cannot export for this config."""
    arch = family.architecture
    for field, value, why in family.refuse:
        if getattr(config, field, None) == value:
            raise QaicConfigError(f"{arch}: {why} ({field}={value!r} in config.json)")
    if family.position_limit is not None:
        limit = int(getattr(config, family.position_limit, 0) or 0)
        if limit and settings.ctx_len > limit:
            raise QaicConfigError(
                f"{arch}: ctx_len ({settings.ctx_len}) exceeds the model's position table "
                f"({family.position_limit}={limit}); lower --ctx-len to at most {limit}"
            )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in ("dynamic", "longrope"):
        return
    # Both switch frequencies on the longest position seen, which a compiled program cannot follow.
    field = "original_max_position_embeddings" if rope_type == "longrope" else "max_position_embeddings"
    limit = int(rope.get(field) or getattr(config, field, 0) or 0)
    if limit and settings.ctx_len > limit:
        raise QaicConfigError(
            f"{arch}: {rope_type} rope scaling changes the frequencies beyond {field} ({limit}), which a "
            f"compiled program cannot follow; lower --ctx-len ({settings.ctx_len}) to at most {limit}"
        )
