"""Read a checkpoint's tensors as float32 numpy arrays, with errors that name the missing file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from qaic_aot.model_files import SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX
from qaic_core.errors import QaicConfigError

logger = logging.getLogger("qaic.aot.export")


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of a model dir, preferring safetensors; a clear error when there are none."""
    for index_name in (SAFETENSORS_INDEX, TORCH_INDEX):
        index = model_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise QaicConfigError(
                    f"{index} lists weight shards that are missing from {model_dir}: {', '.join(missing)}; "
                    "download the complete checkpoint"
                )
            return [model_dir / s for s in shards]
    for name in (SAFETENSORS_FILE, TORCH_FILE):
        if (model_dir / name).is_file():
            return [model_dir / name]
    raise QaicConfigError(
        f"no model weights in {model_dir}: expected {SAFETENSORS_FILE} (or {SAFETENSORS_INDEX} with its "
        f"shards, or {TORCH_FILE}); download the checkpoint's weight files into that directory"
    )


def _iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()


def load_weights(model_dir: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """All floating-point tensors of the checkpoint as float32 arrays, keyed by their HF names."""
    weights: dict[str, np.ndarray] = {}
    files = weight_files(model_dir)
    for path in tqdm(files, desc="export: weight files", unit="file", disable=not progress or len(files) < 2):
        logger.info("reading weights from %s", path)
        for name, tensor in _iter_tensors(path):
            if tensor.is_floating_point():
                weights[name] = tensor.to(torch.float32).numpy()
    return weights


class WeightSource:
    """Looks tensors up by their name without the model prefix, so ``h.0`` and ``transformer.h.0`` both work."""

    def __init__(self, weights: dict[str, np.ndarray], prefix: str, model_dir: Path) -> None:
        self._weights = weights
        self._prefix = prefix
        self._model_dir = model_dir

    def has(self, name: str) -> bool:
        return self.find(name) is not None

    def find(self, name: str) -> np.ndarray | None:
        for key in (self._prefix + name, name):
            if key in self._weights:
                return self._weights[key]
        return None

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name``, released from the source: the graph holds the only copy from now on."""
        for key in (self._prefix + name, name):
            if key in self._weights:
                return self._weights.pop(key)
        raise QaicConfigError(
            f"tensor {self._prefix}{name} is missing from the weights in {self._model_dir}; "
            "the checkpoint does not match its config.json"
        )
