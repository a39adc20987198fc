"""Reading a Hugging Face model directory: early, clear errors for missing files, and its geometry."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qaic_core.errors import QaicConfigError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX)


@dataclass(frozen=True)
class ModelGeometry:
    """What a compiled program must agree with: vocabulary, layers and KV head shape."""

    architecture: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


def config_path(model_dir: Path) -> Path:
    """The model's config.json, after checking that the folder and the file exist."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise QaicConfigError(
            f"model directory {model_dir} does not exist: give a local Hugging Face model folder"
        )
    config = model_dir / "config.json"
    if not config.is_file():
        raise QaicConfigError(f"model file {config} is missing: the model folder needs its config.json")
    return config


def check_model_dir(model_dir: Path) -> Path:
    """The model directory, after checking that config.json and a weights file are there."""
    model_dir = config_path(model_dir).parent
    if not any((model_dir / name).is_file() for name in WEIGHT_FILES):
        raise QaicConfigError(
            f"model weights are missing in {model_dir}: expected one of {', '.join(WEIGHT_FILES)}"
        )
    return model_dir


def read_config(model_dir: Path) -> dict[str, Any]:
    """The raw config.json of a checked model directory."""
    path = config_path(model_dir)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QaicConfigError(f"model file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise QaicConfigError(f"model file {path} must hold a JSON object")
    return data


def architecture(config: dict[str, Any], model_dir: Path) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise QaicConfigError(
            f"{Path(model_dir) / 'config.json'} has no 'architectures' entry: save the model with "
            "save_pretrained so its class name is recorded"
        )
    return str(archs[0])


def geometry(model_dir: Path) -> ModelGeometry:
    """Vocabulary size, layer count and KV head shape, read with transformers' config classes."""
    from transformers import AutoConfig

    raw = read_config(model_dir)
    cfg = AutoConfig.from_pretrained(str(model_dir))
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(text_cfg.num_attention_heads)
    kv_heads = int(getattr(text_cfg, "num_key_value_heads", None) or heads)
    head_dim = getattr(text_cfg, "head_dim", None) or int(text_cfg.hidden_size) // heads
    return ModelGeometry(
        architecture=architecture(raw, model_dir),
        vocab_size=int(text_cfg.vocab_size),
        num_layers=int(text_cfg.num_hidden_layers),
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
    )
