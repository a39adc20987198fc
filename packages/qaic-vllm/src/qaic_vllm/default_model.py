"""The default model: a small random-weight Llama with a locally trained tokenizer, built on first use.

Nothing is downloaded: the weights come from a fixed seed and the tokenizer is trained on text
shipped in this package, so ``qaic-vllm serve-default`` works on an offline machine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger("qaic.vllm.model")

DEFAULT_MODEL_NAME = "qaic-tiny-llama"
BUILD_VERSION = 1
MARKER = "qaic_model.json"
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}
TOKENIZER_VOCAB = 4000


def models_home() -> Path:
    """``$QAIC_HOME/models`` or ``~/.cache/qaic/models``."""
    raw = os.environ.get("QAIC_HOME", "").strip()
    base = Path(raw).expanduser() if raw else Path.home() / ".cache" / "qaic"
    return base / "models"


def default_model_dir() -> Path:
    return models_home() / DEFAULT_MODEL_NAME


def corpus_lines() -> list[str]:
    """The training text shipped with the package."""
    text = resources.files("qaic_vllm").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def build_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """Train a byte-level BPE on the shipped text; saved as a fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    out_dir: Path | str, *, seed: int = 0, tokenizer_vocab: int = TOKENIZER_VOCAB, **config: Any
) -> Path:
    """Write a random-weight Llama (``DEFAULT_CONFIG`` updated by ``config``) and its tokenizer to ``out_dir``."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("training the tokenizer on the shipped text")
    tokenizer = build_tokenizer(out, tokenizer_vocab)
    values = {**DEFAULT_CONFIG, **config}
    values.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    log.info(
        "building a random Llama: hidden %d, %d layers, vocab %d, seed %d",
        values["hidden_size"],
        values["num_hidden_layers"],
        values["vocab_size"],
        seed,
    )
    model_config = transformers.LlamaConfig(**values)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(model_config)
    with torch.no_grad():
        # Non-trivial norm weights, so a mis-loaded scale changes the output.
        for _name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.eval()
    model.save_pretrained(out)
    gen = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    gen.save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps({"name": DEFAULT_MODEL_NAME, "version": BUILD_VERSION, "seed": seed})
    )
    return out


def ensure_default_model(directory: Path | None = None) -> Path:
    """The default model's directory, building it first when it is missing or from an older build."""
    from filelock import FileLock

    target = Path(directory) if directory is not None else default_model_dir()
    if _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_current(target):
            return target
        log.info("building the default model %s in %s (first use only)", DEFAULT_MODEL_NAME, target)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            build_model(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(path: Path) -> bool:
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("version") == BUILD_VERSION and (path / "config.json").exists()
