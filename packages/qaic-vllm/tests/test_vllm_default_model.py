"""The default model builder and the serve-default command line (no server started)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from qaic_vllm import cli
from qaic_vllm.default_model import DEFAULT_MODEL_NAME, build_model, ensure_default_model


@pytest.fixture(scope="module")
def qaic_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qaic-home")


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
