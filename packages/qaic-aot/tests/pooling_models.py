"""Tiny random-weight pooling models (encoders, classifiers, decoders used as embedders) for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

COMMON = {"vocab_size": 160, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
ENCODER = {**COMMON, "intermediate_size": 64, "max_position_embeddings": 130}
DECODER = {**COMMON, "intermediate_size": 64, "num_key_value_heads": 2, "max_position_embeddings": 256}

BUILDERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "BertModel": (transformers.BertConfig, transformers.BertModel, ENCODER),
    "RobertaModel": (transformers.RobertaConfig, transformers.RobertaModel, {**ENCODER, "pad_token_id": 1}),
    "XLMRobertaModel": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaModel,
        {**ENCODER, "pad_token_id": 1},
    ),
    "XLMRobertaForSequenceClassification": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaForSequenceClassification,
        {**ENCODER, "pad_token_id": 1, "num_labels": 1},
    ),
    "BertForSequenceClassification": (
        transformers.BertConfig,
        transformers.BertForSequenceClassification,
        {**ENCODER, "num_labels": 3},
    ),
    "MistralModel": (
        transformers.MistralConfig,
        transformers.MistralModel,
        {**DECODER, "sliding_window": None},
    ),
    "Qwen2Model": (transformers.Qwen2Config, transformers.Qwen2Model, DECODER),
}


def build_pooling_model(arch: str, root: Path, *, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Save a random ``arch`` under ``root/arch``; returns its folder and the transformers model (eval)."""
    config_cls, model_cls, kwargs = BUILDERS[arch]
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = (
        model_cls(config, add_pooling_layer=False)
        if arch in ("BertModel", "RobertaModel", "XLMRobertaModel")
        else model_cls(config)
    )
    model.eval()
    out = root / arch
    model.save_pretrained(out)
    return out, model
