"""The simulated device's KV kernels (qaic_sim.kv_ops) against a numpy reference of the ops' meaning."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qaic_sim import kv_ops

INT32_MAX = 2**31 - 1
F, H, C, D = 4, 2, 12, 3
QC = kv_ops.KV_OPS_DOMAIN


def _run(function: onnx.FunctionProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """One graph that calls ``function`` on ``feeds`` (named as its formal inputs)."""
    inputs = [
        helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(feeds[name].dtype), list(feeds[name].shape)
        )
        for name in function.input
    ]
    graph = helper.make_graph(
        [helper.make_node(function.name, list(function.input), ["y"], domain=QC)],
        "kv",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(QC, 1)],
        functions=[function],
    )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def _device(name: str, inputs: list[str]) -> onnx.FunctionProto:
    """The device body, installed by native_kv_functions into a model holding a placeholder."""
    model = helper.make_model(
        helper.make_graph([], "empty", [], []),
        functions=[helper.make_function(QC, name, inputs, ["out"], [], [helper.make_opsetid("", 17)])],
    )
    assert kv_ops.native_kv_functions(model) == {name}
    return model.functions[0]


def _scatter_ref(data: np.ndarray, rows: np.ndarray, pos: np.ndarray, upd: np.ndarray) -> np.ndarray:
    out = data.copy()
    for b in range(pos.shape[0]):
        for s in range(pos.shape[1]):
            p = int(pos[b, s])
            if 0 <= p < data.shape[2]:
                out[rows[b], :, p] = upd[b, :, s]
    return out


SCATTER_CASES = {
    # rows, position_ids: decode with a padded slot, a -1 and an out-of-context position
    "decode": ([2, 0, 3], [[5], [INT32_MAX], [-1]]),
    "prefill padded": ([1], [[0, 1, 2, 3, INT32_MAX, INT32_MAX]]),
    "prefill padded first": ([3], [[-1, -1, 7, 8, 9, 10]]),
    "row without a valid position": ([0, 1], [[INT32_MAX, 12], [4, INT32_MAX]]),
}


@pytest.mark.parametrize("case", sorted(SCATTER_CASES))
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
def test_scatter_cb_writes_valid_positions_only(case: str, index_dtype: type) -> None:
    rows_list, pos_list = SCATTER_CASES[case]
    rng = np.random.default_rng(0)
    rows = np.array(rows_list, np.int64)
    pos: np.ndarray = np.array(pos_list, index_dtype)
    data = rng.standard_normal((F, H, C, D)).astype(np.float32)
    upd = rng.standard_normal((len(rows), H, pos.shape[1], D)).astype(np.float32)
    inputs = ["data", "batch_index", "position_ids", "updates"]
    got = _run(
        _device("CtxScatterCB", inputs),
        {
            "data": data,
            "batch_index": rows.reshape(-1, 1).astype(index_dtype),
            "position_ids": pos,
            "updates": upd,
        },
    )
    np.testing.assert_array_equal(got, _scatter_ref(data, rows, pos, upd))


def test_scatter_without_batch_index_writes_each_row() -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((3, H, C, D)).astype(np.float32)
    pos = np.array([[1, 2], [INT32_MAX, 0], [-1, -1]], np.int64)
    upd = rng.standard_normal((3, H, 2, D)).astype(np.float32)
    got = _run(
        _device("CtxScatter", ["data", "position_ids", "updates"]),
        {"data": data, "position_ids": pos, "updates": upd},
    )
    np.testing.assert_array_equal(got, _scatter_ref(data, np.arange(3), pos, upd))


def _gather_check(data: np.ndarray, rows: np.ndarray, ci: np.ndarray, got: np.ndarray) -> None:
    """Every valid index reads its row and position; invalid ones are free (the model masks them)."""
    assert got.shape == (len(rows), data.shape[1], ci.shape[-1], data.shape[3])
    for b, row in enumerate(rows):
        for n in range(ci.shape[-1]):
            i = int(ci[b if ci.shape[0] > 1 else 0, 0, n])
            if 0 <= i < data.shape[2]:
                np.testing.assert_array_equal(got[b, :, n], data[row, :, i])


GATHER_CASES = {
    # rows, ctx_indices per row (None: arange(C) with INT32_MAX beyond each row's last position)
    "in order, masked tails": ([0, 1, 2], None),
    "rows out of order": ([3, 1], None),
    "one row, not the first": ([2], None),
    "indices not in place": ([0, 1], [[5, 3, 0, 11], [INT32_MAX, 2, 2, -1]]),
}


@pytest.mark.parametrize("case", sorted(GATHER_CASES))
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
def test_gather_cb_reads_rows_at_indices(case: str, index_dtype: type) -> None:
    rows_list, ci_list = GATHER_CASES[case]
    rng = np.random.default_rng(2)
    data = rng.standard_normal((F, H, C, D)).astype(np.float32)
    rows = np.array(rows_list, np.int64)
    if ci_list is None:
        last = np.arange(len(rows)) * 3 + 2
        grid = np.arange(C)[None, :]
        ci: np.ndarray = np.where(grid > last[:, None], INT32_MAX, grid)[:, None, :].astype(index_dtype)
    else:
        ci = np.array(ci_list, index_dtype)[:, None, :]
    got = _run(
        _device("CtxGatherCB", ["data", "batch_index", "ctx_indices"]),
        {"data": data, "batch_index": rows.reshape(-1, 1).astype(index_dtype), "ctx_indices": ci},
    )
    _gather_check(data, rows, ci, got)


def test_gather_with_compute_context_length_reads_the_shorter_context() -> None:
    """QEfficient's CCL form: a fourth input, and indices as long as the compute-context length."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((F, H, C, D)).astype(np.float32)
    rows = np.array([0, 1], np.int64)
    ci = np.where(np.arange(5)[None, :] > np.array([[4], [1]]), INT32_MAX, np.arange(5))[:, None, :]
    got = _run(
        _device("CtxGatherCB", ["data", "batch_index", "ctx_indices", "comp_ctx_len"]),
        {
            "data": data,
            "batch_index": rows.reshape(-1, 1),
            "ctx_indices": ci.astype(np.int32),
            "comp_ctx_len": np.zeros(5, np.int64),
        },
    )
    _gather_check(data, rows, ci, got)


def test_gather_without_batch_index_broadcasts_indices() -> None:
    rng = np.random.default_rng(4)
    data = rng.standard_normal((3, H, C, D)).astype(np.float32)
    for ci in (np.arange(C)[None, None, :], np.array([[[7, 0, INT32_MAX, 3]]])):
        got = _run(_device("CtxGather", ["data", "ctx_indices"]), {"data": data, "ctx_indices": ci})
        _gather_check(data, np.arange(3), ci, got)


def test_unknown_signatures_keep_their_bodies() -> None:
    """A function of a known name but other formal inputs is not the device op: left alone."""
    body = [helper.make_node("Identity", ["data"], ["out"])]
    model = helper.make_model(
        helper.make_graph([], "empty", [], []),
        functions=[
            helper.make_function(QC, "CtxGather", ["data", "batch_index"], ["out"], body, []),
            helper.make_function(QC, "CtxScatterCB3D", ["data", "batch_index", "position_ids", "updates"],
                                 ["out"], body, []),
        ],
    )  # fmt: skip
    assert kv_ops.native_kv_functions(model) == set()
    assert [f.node[0].op_type for f in model.functions] == ["Identity", "Identity"]


def test_device_kernels_restore_the_exported_bodies() -> None:
    """The timing model reads the exporter's bodies: device_kernels swaps them only inside its block."""
    original = helper.make_function(
        QC,
        "CtxGather",
        ["data", "ctx_indices"],
        ["out"],
        [helper.make_node("Identity", ["data"], ["out"])],
        [],
    )
    model = helper.make_model(helper.make_graph([], "empty", [], []), functions=[original])
    with kv_ops.device_kernels(model) as replaced:
        assert replaced == {"CtxGather"}
        assert model.functions[0].node[-1].op_type == "If"
    assert model.functions[0] == original


def test_more_indices_than_the_context_read_every_index() -> None:
    """Indices past a shorter cache (a sliding-window layer's) are invalid, not a shorter result."""
    rng = np.random.default_rng(5)
    data = rng.standard_normal((F, H, 8, D)).astype(np.float32)
    rows = np.array([0, 1], np.int64)
    ci = np.broadcast_to(np.arange(C), (2, 1, C)).copy()
    got = _run(
        _device("CtxGatherCB", ["data", "batch_index", "ctx_indices"]),
        {"data": data, "batch_index": rows.reshape(-1, 1), "ctx_indices": ci},
    )
    _gather_check(data, rows, ci, got)
