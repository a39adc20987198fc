"""The exported program's IO contract (QEfficient's names, dtypes and symbolic dims)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qaic_core.settings import CompileSettings

BATCH_SIZE = "batch_size"
SEQ_LEN = "seq_len"
CTX_LEN = "ctx_len"
FULL_BATCH_SIZE = "full_batch_size"
NUM_LOGITS_TO_KEEP = "num_logits_to_keep"
# Compute-context length: an input (and symbol) whose length is how many KV positions attention reads.
COMP_CTX_LENGTHS = "comp_ctx_lengths"
# Attention scores of masked keys; finite so that a float16 compile keeps it representable.
MASKED_SCORE = -10000.0


def kv_names(num_layers: int, suffix: str = "") -> list[str]:
    """``past_key.0, past_value.0, past_key.1, ...`` (with ``_RetainedState`` for outputs)."""
    return [f"past_{kind}.{i}{suffix}" for i in range(num_layers) for kind in ("key", "value")]


def input_names(num_layers: int, settings: CompileSettings, *, ccl: bool = False) -> list[str]:
    """Program inputs in QEfficient's order (``comp_ctx_lengths`` after the KV cache when ``ccl``)."""
    names = ["input_ids", "position_ids", *kv_names(num_layers)]
    if ccl:
        names.append(COMP_CTX_LENGTHS)
    if settings.full_batch_size is not None:
        names.append("batch_index")
    if settings.num_speculative_tokens is not None:
        names.append("num_logits_to_keep")
    return names


def output_names(num_layers: int) -> list[str]:
    """Program outputs: logits then every retained KV state."""
    return ["logits", *kv_names(num_layers, "_RetainedState")]


def kv_batch_dim(settings: CompileSettings) -> str:
    """Leading dim of the KV cache: full_batch_size with continuous batching, else batch_size."""
    return FULL_BATCH_SIZE if settings.full_batch_size is not None else BATCH_SIZE


@dataclass(frozen=True)
class ExportResult:
    """What an export produced and the model facts the compiler and runtime need."""

    onnx_path: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    architecture: str
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    exporter: str = "qaic"
