"""Subnormal flushing around a run: only inside it, only for fp16 programs, values unchanged."""

from __future__ import annotations

import platform
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from sim_programs import compile_program, run_once

from qaic_core.types import Specialization
from qaic_sim import execobj, fpenv

TINY = np.float32(2.0**-126)
"""The smallest normal float32: half of it is a subnormal, or zero when flushed."""


def _keeps_subnormals() -> bool:
    return bool(TINY * np.float32(0.5) != 0)


def test_flushing_sets_the_bits_only_inside_the_block() -> None:
    if sys.platform == "linux" and platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc":
        assert fpenv.available()
    if not fpenv.available():
        pytest.skip("subnormal flushing is x86-64 glibc only")
    assert _keeps_subnormals()
    with fpenv.flushing():
        assert not _keeps_subnormals()
        with fpenv.flushing():  # nested: the inner block restores the outer one's flushing
            pass
        assert not _keeps_subnormals()
    assert _keeps_subnormals()
    with pytest.raises(RuntimeError), fpenv.flushing():
        raise RuntimeError("a failed run")
    assert _keeps_subnormals()


def _softmax_model(path: Path, width: int) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)],
        "softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", width])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def run_states(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """For each onnxruntime run: the thread it ran on and whether that thread kept subnormals then.

    The flushing cannot show in an fp16 program's values (every node's output is rounded to fp16,
    which has no float32 subnormals), so the state is read where the run starts; the run itself is
    the real one."""
    states: list[tuple[str, bool]] = []
    real = execobj.run_session

    def spy(*args: Any, **kwargs: Any) -> Any:
        states.append((threading.current_thread().name, _keeps_subnormals()))
        return real(*args, **kwargs)

    monkeypatch.setattr(execobj, "run_session", spy)
    return states


def test_masked_softmax_in_fp16_keeps_its_values_and_the_callers_thread(
    tmp_path: Path, run_states: list[tuple[str, bool]]
) -> None:
    """A masked row (scores at fp16's lowest value) sends exp into float32 subnormals: the fp16 program
    runs flushed and its results are what the fp16 datapath gives; the float32 program runs unflushed
    and keeps its subnormal results; the calling thread still has subnormals after both runs."""
    width = 64
    onnx_path = _softmax_model(tmp_path / "softmax.onnx", width)
    spec = [Specialization("b4", {"batch_size": 4})]
    qpc16 = compile_program(tmp_path / "f16", onnx_path, spec, flags=("-convert-to-fp16",))
    qpc32 = compile_program(tmp_path / "f32", onnx_path, spec, flags=())
    x = np.random.default_rng(3).standard_normal((4, width)).astype(np.float32)
    x[:, 40:] = -65504.0  # masked positions, as an attention mask writes them
    x[1, 10:] = -90.0  # exp(-90 - max) is a float32 subnormal, so fp16 rounds it to 0
    y16, y32 = run_once(qpc16, x), run_once(qpc32, x)
    assert _keeps_subnormals()
    caller = threading.current_thread().name  # unpaced, each run executes inline in this thread
    assert run_states == [(caller, not fpenv.available()), (caller, True)]
    r16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    z = r16(x).astype(np.float64)
    reference = np.exp(z - z.max(axis=1, keepdims=True))
    reference /= reference.sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(y16, r16(y16))
    np.testing.assert_allclose(y16, r16(reference.astype(np.float32)), rtol=1e-3, atol=0)
    assert (y16[:, 40:] == 0).all() and (y16[1, 10:] == 0).all()
    # The float32 program is not flushed: the subnormal results stay.
    assert (y32[1, 10:40] > 0).all() and (y32[1, 10:40] < np.float32(2.0**-126)).all()
