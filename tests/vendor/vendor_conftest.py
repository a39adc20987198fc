"""Root conftest for running vllm-qaic's own end-to-end tests on the qaic simulator, their code unchanged.

``run_vendor_e2e.py`` copies this file to the root of a tree exported from vllm-qaic's repository (it
is not loaded by this repository's own test runs). It does only three things:

- swaps the model name of every ``qaic_test_config`` marker for the local model in ``QAIC_VENDOR_MODEL``
  (their tests name ``TinyLlama/TinyLlama-1.1B-Chat-v1.0``; there is no model hub here);
- puts a small ShareGPT-format file (``QAIC_VENDOR_SHAREGPT``) where their conftest looks for the
  dataset before downloading it;
- runs ``async def`` tests in an event loop when pytest-asyncio is not installed (their
  ``@pytest.mark.asyncio`` test).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

MODEL_ENV = "QAIC_VENDOR_MODEL"
SHAREGPT_ENV = "QAIC_VENDOR_SHAREGPT"
SHAREGPT_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
"""The file vllm-qaic's tests/e2e/conftest.py reads, next to itself."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "asyncio: an async test (run in a fresh event loop)")
    source = os.environ.get(SHAREGPT_ENV)
    target = Path(str(config.rootpath)) / "tests" / "e2e" / SHAREGPT_NAME
    if source and target.parent.is_dir() and not target.exists():
        shutil.copyfile(source, target)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    model = os.environ.get(MODEL_ENV)
    if not model:
        raise pytest.UsageError(f"set {MODEL_ENV} to a local model directory")
    for item in items:
        for node in item.listchain():
            for i, mark in enumerate(node.own_markers):
                if mark.name == "qaic_test_config" and "model_name" in mark.kwargs:
                    kwargs = {**mark.kwargs, "model_name": model}
                    node.own_markers[i] = pytest.mark.qaic_test_config(*mark.args, **kwargs).mark


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    test = pyfuncitem.obj
    if not inspect.iscoroutinefunction(test) or pyfuncitem.config.pluginmanager.hasplugin("asyncio"):
        return None
    names = inspect.signature(test).parameters
    asyncio.run(test(**{name: pyfuncitem.funcargs[name] for name in names}))
    return True
