"""Architectures the ``aot`` path serves as pooling models; cheap to import (no onnx, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qaic_core.errors import QaicConfigError
from qaic_core.execution import CLASSIFY, EMBED

ENCODER, CLASSIFIER, DECODER = "encoder", "classifier", "decoder"


@dataclass(frozen=True)
class PoolingArchitecture:
    """How one Hugging Face architecture is exported as a pooling model."""

    kind: str
    """``encoder`` (bidirectional), ``classifier`` (encoder with a sequence-classification head) or
    ``decoder`` (a causal LM's body used as an embedder)."""
    family: str
    """``bert`` or ``roberta`` for encoders; the causal-LM architecture whose layers a decoder reuses."""

    @property
    def task(self) -> str:
        return CLASSIFY if self.kind == CLASSIFIER else EMBED


POOLING_ARCHITECTURES: dict[str, PoolingArchitecture] = {
    "BertModel": PoolingArchitecture(ENCODER, "bert"),
    "RobertaModel": PoolingArchitecture(ENCODER, "roberta"),
    "XLMRobertaModel": PoolingArchitecture(ENCODER, "roberta"),
    "BertForSequenceClassification": PoolingArchitecture(CLASSIFIER, "bert"),
    "RobertaForSequenceClassification": PoolingArchitecture(CLASSIFIER, "roberta"),
    "XLMRobertaForSequenceClassification": PoolingArchitecture(CLASSIFIER, "roberta"),
    "MistralModel": PoolingArchitecture(DECODER, "MistralForCausalLM"),
    "Qwen2Model": PoolingArchitecture(DECODER, "Qwen2ForCausalLM"),
    "LlamaModel": PoolingArchitecture(DECODER, "LlamaForCausalLM"),
}
"""Architectures served as pooling models (embedding, classification, scoring)."""


def pooling_architecture(config: Any, task: str | None = None) -> tuple[str, PoolingArchitecture]:
    """The config's architecture as a pooling model; an unsupported one or a task it lacks raises."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = str(archs[0]) if archs else "unknown"
    found = POOLING_ARCHITECTURES.get(arch)
    if found is None:
        raise QaicConfigError(
            f"architecture {arch!r} is not supported as a pooling model by the qaic-aot exporter; "
            f"supported: {', '.join(POOLING_ARCHITECTURES)}"
        )
    if task is not None and task != found.task:
        raise QaicConfigError(
            f"{arch} is {'a classifier' if found.kind == CLASSIFIER else 'an embedding model'}: it serves the "
            f"{found.task} task, not {task} (a cross-encoder scores through classify)"
        )
    return arch, found
