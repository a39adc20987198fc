"""The default model builder, its training and the serve-default command line (no server started)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from qaic_vllm import cli
from qaic_vllm.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_RECIPE,
    TrainingRecipe,
    build_model,
    default_model_dir,
    ensure_default_model,
    train_model,
)

TINY_RECIPE = TrainingRecipe(
    steps=3,
    batch_size=2,
    seq_len=16,
    warmup_steps=1,
    vocab_size=300,
    modules=("json",),
    config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 64},
)  # fmt: skip
"""A recipe that trains in a second: for the properties of training, not the quality of the model."""


@pytest.fixture(scope="module")
def qaic_home() -> Path:
    """This machine's qaic home: the default model is trained once per machine and tests reuse it."""
    return default_model_dir().parent.parent


@pytest.fixture(scope="module")
def default_dir(qaic_home: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QAIC_HOME", str(qaic_home))
        return ensure_default_model()


def test_default_model_is_a_small_llama_with_a_chat_tokenizer(default_dir: Path, qaic_home: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assert default_dir == qaic_home / "models" / DEFAULT_MODEL_NAME
    config = AutoConfig.from_pretrained(default_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.max_position_embeddings) == (256, 4, 2048)
    tok = AutoTokenizer.from_pretrained(default_dir)
    assert config.vocab_size == len(tok) > 500
    assert tok.eos_token == "</s>" and config.eos_token_id == tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<s>user\nHi</s>\n<s>assistant\n"
    ids = tok("What is the capital of France?", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "What is the capital of France?"


def test_second_call_reuses_the_build(
    default_dir: Path, monkeypatch: pytest.MonkeyPatch, qaic_home: Path
) -> None:
    weights = default_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    monkeypatch.setenv("QAIC_HOME", str(qaic_home))
    assert ensure_default_model() == default_dir
    assert weights.stat().st_mtime_ns == stamp
    marker = json.loads((default_dir / "qaic_model.json").read_text())
    assert marker["name"] == DEFAULT_MODEL_NAME


def test_build_is_deterministic(tmp_path: Path) -> None:
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    digests = []
    for name in ("a", "b"):
        out = build_model(tmp_path / name, seed=3, **small)
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
        digests.append(hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest())
    assert digests[0] == digests[2] and digests[1] == digests[3]


def test_serve_default_command(
    default_dir: Path, qaic_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QAIC_HOME", str(qaic_home))
    assert cli.main(["serve-default", "--dry-run", "--port", "8123", "--max-num-seqs", "2"]) == 0
    out = capsys.readouterr().out
    command = next(line for line in out.splitlines() if line.startswith("qaic-vllm: ")).split()[1:]
    assert command[1:3] == ["serve", str(default_dir)]
    assert command[command.index("--served-model-name") + 1] == DEFAULT_MODEL_NAME
    assert command.count("--max-num-seqs") == 1 and command[command.index("--max-num-seqs") + 1] == "2"
    assert command[command.index("--max-model-len") + 1] == "1024"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == "8123"
    assert "curl http://127.0.0.1:8123/v1/completions" in out and "from openai import OpenAI" in out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_training_is_deterministic(tmp_path: Path) -> None:
    first = train_model(tmp_path / "a", TINY_RECIPE, progress=False)
    second = train_model(tmp_path / "b", TINY_RECIPE, progress=False)
    other = train_model(tmp_path / "c", replace(TINY_RECIPE, seed=1), progress=False)
    for name in ("model.safetensors", "tokenizer.json"):
        assert sha256(first / name) == sha256(second / name)
    assert sha256(first / "model.safetensors") != sha256(other / "model.safetensors")


def test_the_build_is_keyed_by_the_recipe(tmp_path: Path) -> None:
    target = tmp_path / "model"
    assert ensure_default_model(target, TINY_RECIPE) == target
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(target, TINY_RECIPE) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    longer = replace(TINY_RECIPE, steps=4)
    assert longer.key() != TINY_RECIPE.key()
    ensure_default_model(target, longer)
    assert json.loads((target / "qaic_model.json").read_text())["recipe"] == longer.key()


def test_the_default_model_keeps_the_benchmarked_shape(default_dir: Path) -> None:
    """The shape the bench figures were measured with: 4 layers of 256, 8 heads (4 KV), 1099 tokens."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_dir)
    shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size)
    assert shape == (4, 256, 768)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (8, 4, 1099)
    marker = json.loads((default_dir / "qaic_model.json").read_text())
    assert marker["recipe"] == DEFAULT_RECIPE.key() and marker["steps"] == DEFAULT_RECIPE.steps


def test_the_default_model_predicts_python_docs_far_better_than_chance(default_dir: Path) -> None:
    """Its loss on the language reference is far below a uniform guess (ln 1099 = 7.0 nats)."""
    import math
    from pydoc_data.topics import topics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_dir)
    model = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()
    text = " ".join(topics["for"].split()[:120])
    ids = torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert loss < math.log(len(tok)) - 3.0, loss


def test_the_end_of_text_token_ends_the_chat_answers_it_learned(default_dir: Path) -> None:
    """After a chat prompt the model's greedy answer ends with ``</s>``, the generation config's EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(default_dir)
    gen = GenerationConfig.from_pretrained(default_dir)
    assert gen.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("</s>")
    model = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=64, do_sample=False, generation_config=gen)
    answer = out[0, ids.shape[1] :].tolist()
    assert answer[-1] == tok.eos_token_id and len(answer) < 64, tok.decode(answer)
