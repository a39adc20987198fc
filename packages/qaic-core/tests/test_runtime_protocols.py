"""The simulator's modules carry every member of the runtime contract; gaps are reported by name."""

from __future__ import annotations

import types

import pytest

from qaic_core import runtime as contract
from qaic_core.runtime import AicApiModule, QaicrtModule, missing_members, protocol_members
from qaic_core.testing import conformance

qaicrt = pytest.importorskip("qaic_sim.qaicrt")
aicapi = pytest.importorskip("qaic_sim.aicapi")


def test_protocol_members_come_from_the_protocol() -> None:
    assert protocol_members(contract.QAicProgramProperties) == ["dataPathTimeoutMs", "devMapping"]
    assert "QStatus" in protocol_members(QaicrtModule) and "Util" in protocol_members(QaicrtModule)
    assert protocol_members(contract.QBuffer) == ["size"]  # dunders are left to mypy


def test_simulator_modules_follow_the_contract() -> None:
    assert missing_members(qaicrt, QaicrtModule) == []
    assert missing_members(aicapi, AicApiModule) == []
    assert missing_members(qaicrt.QStatus, contract.StatusCodes) == []
    assert missing_members(qaicrt.QLogLevel, contract.LogLevels) == []


def test_simulator_objects_follow_the_contract() -> None:
    util = qaicrt.Util()
    _, ids = util.getDeviceIds()
    objects: list[tuple[object, type]] = [
        (util, contract.Util),
        (util.getResourceInfo(ids[0])[1], contract.QResourceInfo),
        (util.getDeviceInfo(ids[0])[1], contract.QDevInfo),
        (util.getPerformanceInfo(ids[0])[1], contract.QPerformanceInfo),
        (qaicrt.Context(qaicrt.QIDList(ids[:1])), contract.Context),
        (qaicrt.QAicProgramProperties(), contract.QAicProgramProperties),
        (qaicrt.QBuffer(bytes(4)), contract.QBuffer),
        (qaicrt.BufferDimensionsVecRef([(4, [1])]), contract.BufferDimensionsVecRef),
        (aicapi.IoDesc(), contract.IoDesc),
        (aicapi.IoSet(), contract.IoSet),
        (aicapi.IoBinding(), contract.IoBinding),
        (aicapi.AllowedShapes(), contract.AllowedShapes),
        (aicapi.Shape(), contract.Shape),
    ]
    for obj, protocol in objects:
        assert missing_members(obj, protocol) == [], protocol.__name__
    for cls, protocol in [
        (qaicrt.Queue, contract.Queue),
        (qaicrt.Qpc, contract.Qpc),
        (qaicrt.Program, contract.Program),
        (qaicrt.ExecObj, contract.ExecObj),
    ]:
        assert missing_members(cls, protocol) == [], protocol.__name__


def test_a_missing_member_is_reported_by_name() -> None:
    names = [n for n in dir(qaicrt) if not n.startswith("_") and n != "Util"]
    partial = types.SimpleNamespace(**{n: getattr(qaicrt, n) for n in names})
    assert missing_members(partial, QaicrtModule) == ["Util"]
    with pytest.raises(AssertionError, match=r"^QaicrtModule: a SimpleNamespace lacks Util$"):
        conformance.assert_follows(partial, QaicrtModule)
    with pytest.raises(AssertionError, match="lacks Util"):
        conformance.test_runtime_has_qaicrt_names(partial, aicapi)  # type: ignore[arg-type]


def test_a_missing_method_of_a_runtime_object_is_reported_by_name() -> None:
    class Program:
        def load(self) -> int:
            return 0

    missing = missing_members(Program(), contract.Program)
    assert missing == ["activate", "createSlicingSpecHandle", "deactivate", "unload"]


def test_a_batch_of_chunks_runs_on_rows_it_fills() -> None:
    from qaic_core.execution import StepShape

    shape = StepShape(
        num_slots=8,
        prefill_seq_len=128,
        ctx_len=256,
        vocab_size=100,
        prefill_batch_size=4,
        prefill_batch_seq_len=32,
        prefill_batch_sizes=(2, 4),
    )
    assert [shape.batched_rows(n) for n in (1, 2, 3, 4)] == [2, 2, 4, 4]
    assert [shape.split_batch(n) for n in (1, 2, 3, 4, 7)] == [[1], [2], [2, 1], [4], [4, 2, 1]]
    # A program with only the full batch (compiled before fewer rows were added) pads.
    old = StepShape(8, 128, 256, 100, prefill_batch_size=4, prefill_batch_seq_len=32)
    assert old.batched_rows(2) == 4 and old.split_batch(3) == [3] and old.split_batch(5) == [4, 1]
