"""Export through QEfficient when it is installed, exactly as its users call it."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from qaic_core.settings import CompileSettings

logger = logging.getLogger("qaic.aot.export")


def qefficient_available() -> bool:
    """Whether ``QEfficient`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("QEfficient") is not None


def export_with_qefficient(model_dir: Path, out_dir: Path, settings: CompileSettings) -> Path:
    """``QEFFAutoModelForCausalLM.from_pretrained(...).export(export_dir)``; returns the ONNX path."""
    from QEfficient import QEFFAutoModelForCausalLM

    kwargs: dict[str, object] = {"continuous_batching": settings.full_batch_size is not None}
    if settings.num_speculative_tokens is not None:
        kwargs["is_tlm"] = True
    logger.info("exporting %s with QEfficient (%s)", model_dir, kwargs)
    model = QEFFAutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    return Path(model.export(export_dir=str(out_dir)))
