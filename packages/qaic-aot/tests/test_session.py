"""QAICInferenceSession on a small retained-state program compiled by the selected backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from qaic_aot import QAICInferenceSession
from qaic_core import get_plugin_manager, hookimpl
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.observe import Observer
from qaic_core.session import QaicSession
from qaic_core.testing.models import compile_accumulator
from qaic_core.types import QStatus

WIDTH, SLOTS = 4, 2


@pytest.fixture(scope="module")
def accumulator_qpc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``state[batch_index] += x`` compiled for batch 1 and batch 2 (the layout compile_model writes)."""
    backend = get_plugin_manager().select_device_backend()
    if backend.compiler is None:
        pytest.skip(f"backend {backend.name!r} has no compiler")
    return compile_accumulator(
        backend.compiler, tmp_path_factory.mktemp("accumulator"), width=WIDTH, slots=SLOTS
    )


@pytest.fixture
def session(accumulator_qpc: Path) -> Iterator[QAICInferenceSession]:
    s = QAICInferenceSession(accumulator_qpc)
    # Start every test from a zero state (device memory is not cleared between loads).
    s.run({"x": _x(0, rows=SLOTS), "batch_index": [[0], [1]], "state": np.zeros((SLOTS, WIDTH), np.float32)})
    yield s
    s.deactivate()


def _x(value: float, rows: int = 1) -> np.ndarray:
    return np.full((rows, WIDTH), value, np.float32)


def test_surface_matches_qefficient(session: QAICInferenceSession) -> None:
    assert isinstance(session, QaicSession)
    assert session.input_names == ["x", "batch_index", "state"]
    assert session.output_names == ["y", "state_RetainedState"]
    assert session.binding_index_map == {b.name: b.index for b in session.bindings}
    assert len(session.allowed_shapes) == 2
    x_index = session.binding_index_map["x"]
    assert sorted(shape[x_index][1] for shape in session.allowed_shapes) == [[1, WIDTH], [2, WIDTH]]


def test_skipped_state_stays_on_the_device(session: QAICInferenceSession) -> None:
    out = session.run({"x": _x(1), "batch_index": [[1]], "state": np.zeros((SLOTS, WIDTH), np.float32)})
    np.testing.assert_array_equal(out["y"], _x(1))
    np.testing.assert_array_equal(out["state_RetainedState"], [[0] * WIDTH, [1] * WIDTH])
    session.skip_buffers(["state", "state_RetainedState"])
    out = session.run({"x": _x(2), "batch_index": [[1]]})
    np.testing.assert_array_equal(out["y"], _x(3))
    assert "state_RetainedState" not in out
    out = session.run({"x": _x(1, rows=2), "batch_index": [[0], [1]]})
    np.testing.assert_array_equal(out["y"], np.array([[1] * WIDTH, [4] * WIDTH], np.float32))


def test_set_buffers_are_kept_for_later_runs(session: QAICInferenceSession) -> None:
    session.skip_buffers(["state", "state_RetainedState"])
    session.set_buffers({"batch_index": np.array([[0]])})
    first = session.run({"x": _x(5)})
    second = session.run({"x": _x(5)})
    np.testing.assert_array_equal(second["y"] - first["y"], _x(5))
    # An output buffer given with set_buffers fixes that output's shape.
    session.set_buffers({"y": np.zeros((1, WIDTH), np.float32)})
    np.testing.assert_array_equal(session.run({"x": _x(0)})["y"], _x(10))


def test_two_runs_in_flight_on_separate_exec_objects(session: QAICInferenceSession) -> None:
    session.skip_buffers(["state", "state_RetainedState"])
    decode = session.submit({"x": _x(1, rows=2), "batch_index": [[0], [1]]}, exec_index=0)
    prefill = session.submit({"x": _x(10), "batch_index": [[1]]}, exec_index=1)
    with pytest.raises(QaicRuntimeError, match="in flight") as busy:
        session.submit({"x": _x(1), "batch_index": [[0]]}, exec_index=0)
    assert busy.value.status == QStatus.BUSY
    first, second = decode.wait(), prefill.wait()
    assert first["y"].shape == (2, WIDTH) and second["y"].shape == (1, WIDTH)
    # Both runs landed in the retained state, whichever ran first.
    total = session.run({"x": _x(0, rows=2), "batch_index": [[0], [1]]})["y"]
    np.testing.assert_array_equal(total, np.array([[1] * WIDTH, [11] * WIDTH], np.float32))
    assert decode.wait() is first  # waiting again returns the same result


def test_unmatched_shape_lists_the_allowed_shapes(session: QAICInferenceSession) -> None:
    session.skip_buffers(["state", "state_RetainedState"])
    with pytest.raises(QaicRuntimeError, match="No matching dimension found") as err:
        session.run({"x": _x(1, rows=3), "batch_index": [[0], [1], [0]]})
    assert "Allowed shapes" in str(err.value) and "[3, 4]" in str(err.value)
    # The session keeps working after the refused run.
    assert session.run({"x": _x(1), "batch_index": [[0]]})["y"].shape == (1, WIDTH)


def test_bad_names_and_paths_are_reported(session: QAICInferenceSession, tmp_path: Path) -> None:
    with pytest.raises(QaicConfigError, match="'nope' is not a binding"):
        session.run({"nope": _x(1)})
    with pytest.raises(QaicConfigError, match="missing input buffers"):
        session.run({"x": _x(1)})
    with pytest.raises(QaicConfigError, match=r"programqpc\.bin"):
        QAICInferenceSession(tmp_path)


def test_deactivated_session_refuses_runs_until_activated(session: QAICInferenceSession) -> None:
    session.deactivate()
    with pytest.raises(QaicRuntimeError, match="not active"):
        session.run({"x": _x(1), "batch_index": [[0]], "state": np.zeros((SLOTS, WIDTH), np.float32)})
    session.activate()
    out = session.run({"x": _x(1), "batch_index": [[0]], "state": np.zeros((SLOTS, WIDTH), np.float32)})
    np.testing.assert_array_equal(out["y"], _x(1))


class RunRecorder(Observer):
    """Keeps what a session reports: ("submitted", input names, exec index) and ("waited", exec index)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.seconds: list[float] = []

    def run_submitted(self, inputs: Mapping[str, np.ndarray], exec_index: int, seconds: float) -> None:
        self.calls.append(("submitted", sorted(inputs), exec_index))
        self.seconds.append(seconds)

    def run_waited(self, exec_index: int, seconds: float) -> None:
        self.calls.append(("waited", exec_index))
        self.seconds.append(seconds)

    @hookimpl
    def qaic_observers(self) -> list[Observer]:
        return [self]


def test_observer_sees_every_run_handed_over_and_waited_for(accumulator_qpc: Path) -> None:
    recorder = RunRecorder()
    with QAICInferenceSession(accumulator_qpc, observer=recorder) as session:
        session.skip_buffers(["state", "state_RetainedState"])
        handle = session.submit({"x": _x(1), "batch_index": [[0]]}, exec_index=1)
        first = handle.wait()
        assert handle.wait() is first  # waiting again reports nothing: the run already finished
        session.run({"x": _x(1), "batch_index": [[1]]})
        with pytest.raises(QaicConfigError):
            session.submit({"nope": _x(1)})  # a refused run is not reported
    assert recorder.calls == [
        ("submitted", ["batch_index", "x"], 1),
        ("waited", 1),
        ("submitted", ["batch_index", "x"], 0),
        ("waited", 0),
    ]
    assert all(s >= 0.0 for s in recorder.seconds)


def test_sessions_report_to_the_registered_observers(accumulator_qpc: Path) -> None:
    inputs = {"x": _x(1), "batch_index": [[0]], "state": np.zeros((SLOTS, WIDTH), np.float32)}
    with QAICInferenceSession(accumulator_qpc) as plain:
        assert plain._observer is None  # no observer registered: runs are not timed at all
    recorder = RunRecorder()
    pm = get_plugin_manager()
    pm.register(recorder, name="test-run-recorder")
    try:
        with QAICInferenceSession(accumulator_qpc) as session:
            session.run(inputs)
    finally:
        pm.unregister(recorder)
    assert recorder.calls == [("submitted", ["batch_index", "state", "x"], 0), ("waited", 0)]


def test_plugin_registers_the_aot_execution_path() -> None:
    from qaic_aot import plugin

    path = get_plugin_manager().select_execution_path("aot")
    assert path.package == "qaic-aot"
    assert path.open is plugin.open_step_model
    assert {"LlamaForCausalLM", "GPT2LMHeadModel"} <= path.architectures


def test_the_plugin_loads_without_torch_or_onnx() -> None:
    code = (
        "import sys\n"
        "from qaic_aot import plugin\n"
        "print(sorted(plugin.qaic_execution_paths()[0].architectures))\n"
        "print(sorted(m for m in ('torch', 'onnx', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    architectures, heavy = done.stdout.splitlines()
    assert "LlamaForCausalLM" in architectures
    assert heavy == "[]"


FAULT_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from qaic_aot import QAICInferenceSession
    from qaic_core.errors import QaicRuntimeError

    session = QAICInferenceSession(sys.argv[1])
    inputs = {"x": np.ones((1, 4), np.float32), "batch_index": [[0]], "state": np.zeros((2, 4), np.float32)}
    session.run(inputs)
    try:
        session.run(inputs)
    except QaicRuntimeError as exc:
        print("status", exc.status)
        print(str(exc).splitlines()[0])
    session.run(inputs)  # the fault fires once; the next run works again
    print("recovered")
    """
)


def test_device_timeout_raises_with_the_status_name(accumulator_qpc: Path) -> None:
    backend = get_plugin_manager().select_device_backend()
    if "faults" not in backend.capabilities:
        pytest.skip(f"backend {backend.name!r} cannot inject faults")
    env = {**os.environ, "QAIC_SIM_FAULTS": "timeout@0:run=2"}
    done = subprocess.run(
        [sys.executable, "-c", FAULT_CHILD, str(accumulator_qpc)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "status 9"
    assert lines[1].startswith("run failed with status TIMEDOUT (9)")
    assert lines[2] == "recovered"
