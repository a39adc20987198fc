"""KV ops whose index work is shared across layers (qaic_sim.kv_shared) against a numpy reference."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qaic_sim import kv_ops, kv_shared

INT32_MAX = 2**31 - 1
F, H, C, D = 4, 2, 12, 3
QC = kv_ops.KV_OPS_DOMAIN
LAYERS = 2
CACHE_DIMS = ["full_batch_size", H, "ctx_len", D]


def _placeholder(name: str, inputs: list[str]) -> onnx.FunctionProto:
    return helper.make_function(QC, name, inputs, ["out"], [], [helper.make_opsetid("", 17)])


def _model(cb: bool, declared: bool = True, window_layer: int | None = None) -> onnx.ModelProto:
    """LAYERS layers, each writing then reading a key and a value cache with the same indices.

    The caches of ``window_layer`` have a context of their own (``window``, as a sliding-window layer).
    """
    index = ["batch_index"] if cb else []
    suffix = "CB" if cb else ""
    f = helper.make_tensor_value_info
    inputs = [
        *([f("batch_index", TensorProto.INT64, ["batch_size", 1])] if cb else []),
        f("position_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
        f("ctx_indices", TensorProto.INT64, ["batch_size", 1, "n"]),
    ]
    nodes, outputs = [], []
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            cache, upd = f"past_{kind}.{layer}", f"{kind}_update.{layer}"
            dims = CACHE_DIMS if layer != window_layer else ["full_batch_size", H, "window", D]
            inputs.append(f(cache, TensorProto.FLOAT, dims if declared else None))
            inputs.append(f(upd, TensorProto.FLOAT, ["batch_size", H, "seq_len", D]))
            written, read = f"{cache}_RetainedState", f"{kind}_read.{layer}"
            nodes.append(
                helper.make_node(
                    f"CtxScatter{suffix}", [cache, *index, "position_ids", upd], [written], domain=QC
                )
            )
            nodes.append(
                helper.make_node(f"CtxGather{suffix}", [written, *index, "ctx_indices"], [read], domain=QC)
            )
            outputs += [f(written, TensorProto.FLOAT, None), f(read, TensorProto.FLOAT, None)]
    functions = [
        _placeholder(f"CtxScatter{suffix}", ["data", *index, "position_ids", "updates"]),
        _placeholder(f"CtxGather{suffix}", ["data", *index, "ctx_indices"]),
    ]
    return helper.make_model(
        helper.make_graph(nodes, "layers", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(QC, 1)],
        functions=functions,
    )  # fmt: skip


def _run(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], onnx.ModelProto]:
    """The program as the simulated compiler serializes it, run on ``feeds``; and that program."""
    with kv_ops.device_kernels(model), kv_shared.shared_indices(model):
        program = onnx.ModelProto()
        program.CopyFrom(model)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(program.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True)), program


def _feeds(
    rows: list[int], pos: list[list[int]], ci: np.ndarray, cb: bool, window: dict[int, int] | None = None
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    b, s = len(pos), len(pos[0])
    feeds = {"position_ids": np.array(pos, np.int64), "ctx_indices": ci.astype(np.int64)}
    if cb:
        feeds["batch_index"] = np.array(rows, np.int64).reshape(-1, 1)
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            ctx = (window or {}).get(layer, C)
            feeds[f"past_{kind}.{layer}"] = rng.standard_normal((F, H, ctx, D)).astype(np.float32)
            feeds[f"{kind}_update.{layer}"] = rng.standard_normal((b, H, s, D)).astype(np.float32)
    return feeds


def _check(feeds: dict[str, np.ndarray], got: dict[str, np.ndarray], rows: list[int]) -> None:
    """Valid positions written, nothing else changed; every valid index reads its row and position."""
    pos, ci = feeds["position_ids"], feeds["ctx_indices"]
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            cache = f"past_{kind}.{layer}"
            want = feeds[cache].copy()
            ctx = want.shape[2]
            upd = feeds[f"{kind}_update.{layer}"]
            for b, row in enumerate(rows):
                for s, p in enumerate(pos[b]):
                    if 0 <= p < ctx:
                        want[row, :, p] = upd[b, :, s]
            np.testing.assert_array_equal(got[f"{cache}_RetainedState"], want)
            read = got[f"{kind}_read.{layer}"]
            assert read.shape == (len(rows), H, ci.shape[-1], D)
            for b, row in enumerate(rows):
                for n, i in enumerate(ci[b, 0]):
                    if 0 <= i < ctx:
                        np.testing.assert_array_equal(read[b, :, n], want[row, :, i])


def _ctx(rows: int, lengths: list[int]) -> np.ndarray:
    grid = np.arange(C)[None, :]
    return np.where(grid >= np.array(lengths)[:, None], INT32_MAX, grid)[:, None, :][:rows]


CASES = {
    # rows, position_ids, ctx_indices
    "decode in order": ([0, 1, 2], [[5], [3], [7]], _ctx(3, [6, 4, 8])),
    "decode, rows out of order and a padded slot": ([2, 0, 3], [[5], [INT32_MAX], [-1]], _ctx(3, [6, 1, 1])),
    "prefill padded": ([1], [[0, 1, 2, 3, INT32_MAX, INT32_MAX]], _ctx(1, [4])),
    "prefill padded first": ([3], [[-1, -1, 7, 8, 9, 10]], _ctx(1, [11])),
    "indices not in place": (
        [0, 1],
        [[4, 5], [0, INT32_MAX]],
        np.array([[[5, 3, 0, 11]], [[INT32_MAX, 2, 2, -1]]]),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_cb_ops_write_and_read_as_the_reference(case: str) -> None:
    rows, pos, ci = CASES[case]
    feeds = _feeds(rows, pos, ci, cb=True)
    got, program = _run(_model(cb=True), feeds)
    _check(feeds, got, rows)
    ops = collections.Counter(n.op_type for n in program.graph.node)
    # One scatter group and one gather group: their masks are computed once, not per op.
    assert ops["ArgMax"] == 1 and ops["ReduceMin"] == 3
    assert ops["ScatterND"] == ops["If"] == 2 * LAYERS
    assert not any(n.domain == QC for n in program.graph.node)


def test_shared_ops_without_batch_index_write_each_row() -> None:
    """Without ``batch_index`` the batch is the cache's rows in order."""
    pos = [[1, 2], [INT32_MAX, 0], [-1, -1], [3, 4]]
    ci = np.broadcast_to(np.arange(C), (F, 1, C)).copy()
    feeds = _feeds(list(range(F)), pos, ci, cb=False)
    got, program = _run(_model(cb=False), feeds)
    _check(feeds, got, list(range(F)))
    assert sum(n.op_type == "ArgMax" for n in program.graph.node) == 1


def test_caches_of_another_context_length_form_their_own_group() -> None:
    """A sliding-window layer's cache (8 positions, not 12): its masks use its own context length."""
    rows, pos, ci = [0, 1], [[9], [INT32_MAX]], _ctx(2, [10, 1])
    feeds = _feeds(rows, pos, ci, cb=True, window={1: 8})
    got, program = _run(_model(cb=True, window_layer=1), feeds)
    _check(feeds, got, rows)
    ops = collections.Counter(n.op_type for n in program.graph.node)
    assert ops["ArgMax"] == 2 and ops["ReduceMin"] == 6  # two scatter groups, two gather groups


def test_a_cache_without_declared_dims_keeps_its_function() -> None:
    rows, pos, ci = CASES["decode in order"]
    feeds = _feeds(rows, pos, ci, cb=True)
    model = _model(cb=True, declared=False)
    got, program = _run(model, feeds)
    _check(feeds, got, rows)
    assert sum(n.domain == QC for n in program.graph.node) == 4 * LAYERS


def test_the_exported_graph_comes_back_after_the_block() -> None:
    """The timing model and the in-place analysis read the exported graph."""
    model = _model(cb=True)
    before = model.SerializeToString()
    with kv_shared.shared_indices(model) as rewritten:
        assert rewritten == 4 * LAYERS
    assert model.SerializeToString() == before
