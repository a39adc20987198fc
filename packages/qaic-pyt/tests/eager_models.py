"""Tiny random-weight models of every architecture the eager path runs, built locally (no hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 384
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
_CORPUS = """
The quick brown fox jumps over the lazy dog. A tiny model learns nothing, but it computes.
Accelerators run models eagerly or from programs compiled ahead of time; a cache keeps every key and value.
Once upon a time there was a small decoder that predicted the next token greedily, block after block.
Prefix caching lets requests that share a system prompt reuse its blocks instead of computing them again.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text, and so do symbols: + - * / = ( ) [ ].
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
"""

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_COMMON, "rope_theta": 10000.0}),
    "mistral": ("MistralConfig", {**_COMMON, "head_dim": 32, "sliding_window": 24}),
    "qwen2": ("Qwen2Config", {**_COMMON, "use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {**_COMMON, "head_dim": 32, "use_sliding_window": False}),
    "gemma": ("GemmaConfig", {**_COMMON, "head_dim": 32, "tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2Config",
        {
            **_COMMON,
            "head_dim": 32,
            "tie_word_embeddings": True,
            "sliding_window": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    "phi3": ("Phi3Config", {**_COMMON, "original_max_position_embeddings": 512}),
    "gpt2": (
        "GPT2Config",
        {
            "vocab_size": VOCAB_SIZE,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 512,
            "initializer_range": 0.1,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
    ),
    "granite": (
        "GraniteConfig",
        {
            **_COMMON,
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    ),
    "olmo2": ("Olmo2Config", {**_COMMON}),
    "mixtral": ("MixtralConfig", {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **_COMMON,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def build_tokenizer(out_dir: Path) -> Any:
    """A byte-level BPE trained on a built-in text, with a chat template (ids 0..2 are pad, bos, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 16,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = (
        "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(arch: str, root: Path | str, *, seed: int = 0) -> Path:
    """Write a random-weight tiny model of ``arch`` (a key of CONFIGS) and a tokenizer; return its dir."""
    import transformers

    config_cls, kwargs = CONFIGS[arch]
    out = Path(root) / f"tiny-{arch}"
    if (out / "tiny_model.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Non-trivial norms and biases, so a mis-loaded scale or bias changes the tokens.
        for _name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.eval()
    model.save_pretrained(out)
    build_tokenizer(out)
    (out / "tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return out


class HFGreedy:
    """transformers' fp32 greedy continuation (eager attention, no cache): the independent reference."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
        return ids[len(prompt) :]
