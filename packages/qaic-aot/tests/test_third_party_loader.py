"""A model loader and a session factory from outside this repository serve a model on the ``aot`` path.

This builds a throwaway distribution the way a vendor would (see docs/plugins.md, "Writing a model
loader" and "Writing a session factory"): a hatchling ``pyproject.toml`` with an entry point in the
``qaic`` group and a module whose hooks return a ``ModelLoader`` (``acme-store``: prebuilt programs
kept in a store folder, one per model) and a ``SessionFactory`` (``acme-counting``: the ``qaicrt``
session wrapped so that it counts the runs it hands to the device). It is installed with pip into a
folder of its own; fresh interpreters then open the tiny model through the real plugin manager with
the two selected by name (configuration, then environment), and greedy generation must equal
transformers'.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models import sample_prompts

from qaic_aot.compile import compile_model
from qaic_core.settings import CompileSettings

SETTINGS = CompileSettings(
    prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1, convert_to_fp16=False
)
NEW_TOKENS = 6

PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[project]
name = "acme-qaic-store"
version = "0.2.0"
description = "Acme's program store and counting sessions for the qaic stack."
requires-python = ">=3.11"
dependencies = ["qaic-core", "qaic-aot"]

[project.entry-points."qaic"]
acme-store = "acme_store.plugin"

[tool.hatch.build.targets.wheel]
packages = ["src/acme_store"]
"""

PLUGIN = '''\
"""Acme's prebuilt-program store (model loader ``acme-store``) and counting sessions (``acme-counting``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qaic_core import get_plugin_manager, hookimpl
from qaic_core.descriptors import QPC, ModelLoader, SessionFactory
from qaic_core.execution import ExecutionConfig
from qaic_core.session import DeviceSession, PreparedProgramRun, RunInFlight, SessionRequest

STORE = "ACME_QAIC_STORE"
LOADED: list[str] = []
"""Every program this loader gave, for the test to read."""
SESSIONS: list[CountingSession] = []
"""Every session this factory opened."""


def entry(config: ExecutionConfig) -> Path:
    """The store's program for the model: ``$ACME_QAIC_STORE/<model folder name>``."""
    return Path(os.environ.get(STORE, "/nonexistent")) / Path(config.model_dir).name


def in_store(config: ExecutionConfig) -> bool:
    return (entry(config) / "qpc").is_dir()


def load(config: ExecutionConfig) -> Path:
    program = entry(config)
    LOADED.append(str(program))
    return program


class CountedRun:
    """A prepared run that counts itself when it is handed over."""

    def __init__(self, run: PreparedProgramRun, session: CountingSession) -> None:
        self._run = run
        self._session = session

    def array(self, name: str) -> np.ndarray:
        return self._run.array(name)

    def submit(self) -> RunInFlight:
        self._session.runs += 1
        return self._run.submit()


class CountingSession:
    """The runtime session of another factory, counting every run it hands to the device."""

    def __init__(self, inner: DeviceSession) -> None:
        self.inner = inner
        self.runs = 0

    def __getattr__(self, name: str) -> object:  # bindings, shapes, activate, reload, ...
        return getattr(self.inner, name)

    def submit(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> RunInFlight:
        self.runs += 1
        return self.inner.submit(inputs, exec_index)

    def prepare(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> PreparedProgramRun:
        return CountedRun(self.inner.prepare(inputs, exec_index), self)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.submit(inputs, 0).wait()

    def run_with_slices(
        self,
        inputs: Mapping[str, np.ndarray],
        slices: Mapping[str, np.ndarray],
        spec_json: str,
        params: Sequence[tuple[str, int]],
        exec_index: int = 0,
    ) -> dict[str, np.ndarray]:
        self.runs += 1
        return self.inner.run_with_slices(inputs, slices, spec_json, params, exec_index)


def open_counting(request: SessionRequest) -> CountingSession:
    session = CountingSession(get_plugin_manager().select_session_factory("qaicrt").open(request))
    SESSIONS.append(session)
    return session


@hookimpl
def qaic_model_loaders() -> list[ModelLoader]:
    return [
        ModelLoader(
            name="acme-store",
            package="acme-qaic-store",
            kind=QPC,
            load=load,
            applies=in_store,
            description="prebuilt programs from the folder $ACME_QAIC_STORE, one per model",
        )
    ]


@hookimpl
def qaic_session_factories() -> list[SessionFactory]:
    return [
        SessionFactory(
            name="acme-counting",
            package="acme-qaic-store",
            open=open_counting,
            description="the qaicrt session, counting the runs it hands to the device",
        )
    ]
'''

GENERATE = """
import dataclasses, json, sys
from pathlib import Path

from acme_store import plugin as acme
from qaic_core import get_plugin_manager
from qaic_core.descriptors import PROGRAM_KINDS
from qaic_core.execution import ExecutionConfig
from qaic_core.settings import CompileSettings

model_dir, how, prompts, new_tokens = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
pm = get_plugin_manager()
settings = CompileSettings(**json.loads(sys.argv[5]))
base = ExecutionConfig(model_dir=model_dir, settings=settings, device=pm.select_device_backend(), progress=False)
names = {"loader": "acme-store", "session": "acme-counting"} if how == "config" else {}
config = dataclasses.replace(base, **names)
model = pm.select_execution_path("aot").open(config)
try:
    tokens = model.lm.generate(prompts, new_tokens)
finally:
    model.close()
json.dump(
    {
        "tokens": tokens,
        "loaded": acme.LOADED,
        "runs": [s.runs for s in acme.SESSIONS],
        "session": type(model.lm.session).__name__,
        "default_loader": pm.select_model_loader(base, PROGRAM_KINDS, "aot").name if how == "config" else None,
        "default_session": pm.select_session_factory().name if how == "config" else None,
        "errors": pm.load_errors,
    },
    sys.stdout,
)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The acme-qaic-store package built and installed with pip into a folder of its own."""
    root = tmp_path_factory.mktemp("acme-store")
    pkg = root / "acme-qaic-store"
    (pkg / "src" / "acme_store").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "src" / "acme_store" / "__init__.py").write_text('"""Acme\'s program store for qaic."""\n')
    (pkg / "src" / "acme_store" / "plugin.py").write_text(PLUGIN)
    target = root / "site"
    env = os.environ | {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip, "--target", str(target), str(pkg)], check=True, env=env, timeout=240)
    assert (target / "acme_store" / "plugin.py").is_file()
    return target


@pytest.fixture(scope="module")
def store(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Acme's store: the tiny model's program compiled once and kept under the model's folder name."""
    root = tmp_path_factory.mktemp("store")
    qpc = compile_model(tiny_llama, SETTINGS, qeff_home=root / "build", progress=False)
    shutil.copytree(qpc, root / "programs" / tiny_llama.name)
    shutil.rmtree(root / "build")
    return root / "programs"


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts spanning several prefill chunks over two slots, and transformers' greedy tokens for each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = sample_prompts(AutoTokenizer.from_pretrained(str(tiny_llama)))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = [
            hf.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    return prompts, tokens


def _generate(site: Path, model: Path, how: str, prompts: list[list[int]], **extra: str) -> dict[str, Any]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path, "QAIC_STRICT_PLUGINS": "1"} | extra
    for name in ("QAIC_MODEL_LOADER", "QAIC_SESSION_FACTORY"):
        if name not in extra:
            env.pop(name, None)
    settings = {
        "prefill_seq_len": SETTINGS.prefill_seq_len,
        "ctx_len": SETTINGS.ctx_len,
        "full_batch_size": SETTINGS.full_batch_size,
        "num_cores": SETTINGS.num_cores,
        "convert_to_fp16": SETTINGS.convert_to_fp16,
    }
    args = [str(model), how, json.dumps(prompts), str(NEW_TOKENS), json.dumps(settings)]
    result = subprocess.run(
        [sys.executable, "-c", GENERATE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=site,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found: dict[str, Any] = json.loads(result.stdout)
    return found


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["config", "env"])
def test_a_third_party_loader_and_session_serve_the_model(
    site: Path,
    store: Path,
    tiny_llama: Path,
    tmp_path: Path,
    expected: tuple[list[list[int]], list[list[int]]],
    how: str,
) -> None:
    prompts, tokens = expected
    extra = {"QEFF_HOME": str(tmp_path / "qeff"), "ACME_QAIC_STORE": str(store)}
    if how == "env":
        extra |= {"QAIC_MODEL_LOADER": "acme-store", "QAIC_SESSION_FACTORY": "acme-counting"}
    found = _generate(site, tiny_llama, how, prompts, **extra)
    assert found["errors"] == {}
    assert found["tokens"] == tokens  # transformers' greedy tokens, through the store's program
    assert found["loaded"] == [str(store / tiny_llama.name)]  # the store's loader gave the program
    assert not (tmp_path / "qeff").exists() or not any((tmp_path / "qeff").rglob("programqpc.bin"))
    assert found["session"] == "CountingSession"
    assert len(found["runs"]) == 1 and found["runs"][0] >= len(
        prompts
    )  # every prefill and decode went through
    if how == "config":
        # Installed but not named, neither displaces the aot path's own defaults.
        assert (found["default_loader"], found["default_session"]) == ("hf", "qaicrt")
