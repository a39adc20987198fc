"""Tiny random-weight Hugging Face models and a locally trained tokenizer, so tests need no hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# One entry per family the hand-built exporter supports; "llama3" exercises the Llama 3 rope scaling.
TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2")
# One entry per architecture (and attention layout) exported by tracing transformers' own code.
TRACED_ARCHS = (
    "llama3.2",
    "gemma2",
    "gemma3",
    "granite",
    "olmo2",
    "falcon",
    "falcon-mq",
    "gptj",
    "gpt_bigcode",
    "starcoder2",
    "phi",
    "mpt",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
)

VOCAB_SIZE = 320
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A tiny model learns nothing, but it computes.
Accelerators run programs compiled ahead of time; the cache keeps every key and value.
Once upon a time there was a small decoder that predicted the next token greedily.
Continuous batching lets several prompts share one program, each in its own slot.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text, and so do symbols: + - * / = ( ) [ ].
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
"""

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_GPT_STYLE = {
    "vocab_size": VOCAB_SIZE,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "initializer_range": 0.1,
    **_TOKENS,
}
_FALCON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "parallel_attn": True,
    "bias": False,
    "alibi": False,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    **_TOKENS,
}
_SLIDING_THEN_FULL = {"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]}

# Tiny configs of the traced architectures: 2 layers, hidden 64, each family's own features switched on.
TRACED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3.2": (
        "LlamaConfig",
        {
            **_COMMON,
            "head_dim": 32,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            **_COMMON,
            **_SLIDING_THEN_FULL,
            "head_dim": 32,
            "tie_word_embeddings": True,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            **_COMMON,
            **_SLIDING_THEN_FULL,
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 32,
            "tie_word_embeddings": True,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 3.0,
        },
    ),
    "granite": (
        "GraniteConfig",
        {
            **_COMMON,
            "embedding_multiplier": 6.0,
            "logits_scaling": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.05,
        },
    ),
    "olmo2": ("Olmo2Config", {**_COMMON}),
    # Falcon's two attention layouts: grouped KV heads (40B/180B) and one shared KV head (7B).
    "falcon": ("FalconConfig", {**_FALCON, "num_kv_heads": 2, "new_decoder_architecture": True}),
    "falcon-mq": ("FalconConfig", {**_FALCON, "new_decoder_architecture": False, "multi_query": True}),
    "gptj": ("GPTJConfig", {**_GPT_STYLE, "rotary_dim": 8}),
    "gpt_bigcode": ("GPTBigCodeConfig", {**_GPT_STYLE, "multi_query": True}),
    "starcoder2": ("Starcoder2Config", {**_COMMON, "sliding_window": 12, "use_bias": True}),
    "phi": (
        "PhiConfig",
        {
            **_COMMON,
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    "mpt": (
        "MptConfig",
        {
            "vocab_size": VOCAB_SIZE,
            "d_model": 64,
            "n_heads": 4,
            "n_layers": 2,
            "expansion_ratio": 2,
            "max_seq_len": 256,
            "initializer_range": 0.1,
            **_TOKENS,
        },
    ),
    "mixtral": ("MixtralConfig", {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            **_COMMON,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "qkv_bias": True,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**_COMMON, "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            **_COMMON,
            **_SLIDING_THEN_FULL,
            "head_dim": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            # YaRN as the checkpoints use it, scaled to the tiny model's 256 positions.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 8,
            },
        },
    ),
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_COMMON, "rope_theta": 10000.0}),
    "llama3": (
        "LlamaConfig",
        {
            **_COMMON,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "tie_word_embeddings": True,
        },
    ),
    "mistral": ("MistralConfig", {**_COMMON, "sliding_window": 12, "head_dim": 32}),
    "qwen2": ("Qwen2Config", {**_COMMON, "use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {**_COMMON, "head_dim": 32, "use_sliding_window": False}),
    "phi3": ("Phi3Config", {**_COMMON, "original_max_position_embeddings": 256}),
    "gemma": ("GemmaConfig", {**_COMMON, "head_dim": 32, "tie_word_embeddings": True}),
    "gpt2": (
        "GPT2Config",
        {
            "vocab_size": VOCAB_SIZE,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 256,
            "initializer_range": 0.1,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
    ),
    **TRACED_CONFIGS,
}


def build_tokenizer(out_dir: Path) -> Any:
    """Train a byte-level BPE on a built-in text and save it as a fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 16,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(arch: str, tmp_dir: Path | str, *, seed: int = 0) -> Path:
    """Write a random-weight tiny HF model of ``arch`` (one of TINY_ARCHS) and a tokenizer; return its dir."""
    import transformers

    if arch not in CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(CONFIGS)}")
    config_cls, kwargs = CONFIGS[arch]
    out_dir = Path(tmp_dir) / f"tiny-{arch}"
    out_dir.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Non-trivial norms and biases, so a mis-loaded scale or bias changes the tokens.
        for _name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.eval()
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    (out_dir / "tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return out_dir


def build_unsupported_model(tmp_dir: Path | str) -> Path:
    """A model dir whose config names an architecture no exporter path supports."""
    out_dir = Path(tmp_dir) / "tiny-unsupported"
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["FalconMambaForCausalLM"],
        "model_type": "falcon_mamba",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 2,
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def sample_prompts(tokenizer: Any) -> list[list[int]]:
    """Prompts of different lengths (some spanning several 8-token prefill chunks)."""
    texts = [
        "Hello world!",
        "Once upon a time there was a small decoder that predicted",
        "The quick brown fox",
        "Continuous batching lets several prompts share one program, each in its own slot, and",
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def more_prompts(tokenizer: Any) -> list[list[int]]:
    """Six prompts: more than four slots, so finished slots are reused with stale KV left in them."""
    extra = ["Paris.", "Numbers like 0 1 2 3 appear in text, and so do symbols"]
    return sample_prompts(tokenizer) + [tokenizer(t, add_special_tokens=False)["input_ids"] for t in extra]


class HFReference:
    """transformers' fp32 greedy generation and logits for one tiny model: the independent reference."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_id = int(self.model.config.eos_token_id)
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """``generate(do_sample=False)``: stops after the eos token or max_new_tokens (memoized)."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = self._generate(prompt, max_new_tokens)
        return list(self._greedy[key])

    def _generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, len(prompt) :]]

    def logits(self, tokens: list[int]) -> Any:
        """Logits [len(tokens), vocab] of one forward pass over ``tokens``."""
        with torch.no_grad():
            return self.model(torch.tensor([tokens])).logits[0].numpy()
