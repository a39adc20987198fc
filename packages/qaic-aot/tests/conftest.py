"""Shared fixtures: tiny random-weight models built once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from models import TINY_ARCHS, build_tiny_model, build_unsupported_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests check our exporter (QEfficient, when installed, is exercised by its own suite).
os.environ.setdefault("QAIC_AOT_EXPORTER", "qaic")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Return ``build(arch) -> model dir``, building each architecture at most once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, root)
        return built[arch]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[[str], Path]) -> Path:
    """The default tiny model (Llama family)."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def unsupported_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir with an architecture no exporter supports."""
    return build_unsupported_model(tmp_path_factory.mktemp("unsupported"))


__all__ = ["TINY_ARCHS"]
