"""Export through QEfficient when it is installed, exactly as its users call it."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx

from qaic_core.settings import CompileSettings

logger = logging.getLogger("qaic.aot.export")


def qefficient_available() -> bool:
    """Whether ``QEfficient`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("QEfficient") is not None


def export_with_qefficient(model_dir: Path, out_dir: Path, settings: CompileSettings) -> Path:
    """``QEFFAutoModelForCausalLM.from_pretrained(...).export(export_dir)``; returns the ONNX path.

    QEfficient picks its own file name (``<export_dir>/<model>-<hash>/<Model>.onnx``); the caller
    moves it where it wants it with :func:`relocate_onnx`.
    """
    from QEfficient import QEFFAutoModelForCausalLM

    kwargs: dict[str, object] = {"continuous_batching": settings.full_batch_size is not None}
    if settings.num_speculative_tokens is not None:
        # Newer QEfficient takes qaic_config={"speculative_model_type": "target"}, older is_tlm=True.
        accepts = inspect.signature(QEFFAutoModelForCausalLM.from_pretrained).parameters
        if "qaic_config" in accepts:
            kwargs["qaic_config"] = {"speculative_model_type": "target"}
        else:
            kwargs["is_tlm"] = True
    logger.info("exporting %s with QEfficient (%s)", model_dir, kwargs)
    model = QEFFAutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    return Path(model.export(export_dir=str(out_dir)))


def relocate_onnx(produced: Path, out_path: Path, save: Callable[[onnx.ModelProto, Path, int], None]) -> Path:
    """Re-save an ONNX written elsewhere (with any external data) at ``out_path``."""
    if produced.resolve() == out_path.resolve():
        return out_path
    model = onnx.load(str(produced))
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    save(model, out_path, weight_bytes)
    logger.info("moved QEfficient's export %s to %s", produced, out_path)
    return out_path


def discard_export(produced: Path, out_path: Path) -> None:
    """Remove QEfficient's own export folder once its ONNX is re-saved at ``out_path``.

    It holds a second copy of the weights (and QEfficient's hashed parameters), which would otherwise
    stay in the cache entry next to ``out_path``. Only a folder inside ``out_path``'s folder is removed.
    """
    folder, home = produced.resolve().parent, out_path.resolve().parent
    if folder == home or home not in folder.parents:
        return
    shutil.rmtree(folder, ignore_errors=True)
    logger.info("removed QEfficient's export folder %s", folder)
