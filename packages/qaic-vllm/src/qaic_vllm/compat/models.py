"""vLLM's loader of a Sentence Transformers projection head (the embedding models' ``Dense`` layers).

vLLM keeps it private in ``vllm.model_executor.models.adapters``; the pooling runner builds its
embedding head with it (seam ``models.st_projector``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def load_st_projector(model_config: Any) -> torch.nn.Module | None:
    """The model's Sentence Transformers projector, or None when its checkpoint has none."""
    from vllm.model_executor.models.adapters import _load_st_projector

    return _load_st_projector(model_config)
