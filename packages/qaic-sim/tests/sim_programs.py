"""Tiny hand-built ONNX programs, their compiles with qaic-compile flags, and a numpy reference."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qaic_core import qpc as layout
from qaic_core.types import Specialization
from qaic_sim import qaicrt
from qaic_sim.compiler import compile_argv
from qaic_sim.qaicrt import QStatus

QC = "com.qualcomm.cloud"
D = 8  # feature width of the test programs


def _const(name: str, values: Sequence[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name)
    )


def ctx_functions() -> list[onnx.FunctionProto]:
    """CtxScatter(data, batch_index, position_ids, updates) and CtxGather(data, batch_index) as ONNX functions.

    data [slots, 1, ctx, D]; updates [b, 1, s, D]; writes updates[i, 0, j] at data[batch_index[i], 0,
    position_ids[i, j]]. CtxGather returns the rows data[batch_index].
    """
    scatter = helper.make_function(
        QC,
        "CtxScatter",
        ["data", "batch_index", "position_ids", "updates"],
        ["out"],
        [
            _const("ax13", [1, 3]),
            _const("ax123", [1, 2, 3]),
            helper.make_node("Unsqueeze", ["position_ids", "ax13"], ["pos"]),
            helper.make_node("Shape", ["pos"], ["shape"]),
            helper.make_node("Unsqueeze", ["batch_index", "ax13"], ["bi4"]),
            helper.make_node("Reshape", ["bi4", "bshape"], ["bi"]),
            _const("bshape", [-1, 1, 1, 1]),
            helper.make_node("Expand", ["bi", "shape"], ["bix"]),
            helper.make_node("Sub", ["pos", "pos"], ["zero"]),
            helper.make_node("Concat", ["bix", "zero", "pos"], ["idx"], axis=3),
            helper.make_node("ScatterND", ["data", "idx", "updates"], ["out"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    # Constant must come before its use inside a function body.
    nodes = list(scatter.node)
    nodes.insert(4, nodes.pop(6))
    del scatter.node[:]
    scatter.node.extend(nodes)
    gather = helper.make_function(
        QC,
        "CtxGather",
        ["data", "batch_index"],
        ["rows"],
        [
            _const("flat", [-1]),
            helper.make_node("Reshape", ["batch_index", "flat"], ["bflat"]),
            helper.make_node("Gather", ["data", "bflat"], ["rows"], axis=0),
        ],
        [helper.make_opsetid("", 17)],
    )
    return [scatter, gather]


def write_kv_model(path: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """A retained-KV program built on CtxScatter/CtxGather functions; returns (path, weight).

    Inputs: x [batch_size, seq_len, D] f32, position_ids [batch_size, seq_len] i64,
    batch_index [batch_size, 1] i64, past_key.0 [full_batch_size, 1, ctx_len, D] f32.
    k = x @ W is written into the slot's cache at the positions; y [batch_size, D] is the sum of
    the slot's whole cache after the write.
    """
    w = np.random.default_rng(seed).standard_normal((D, D)).astype(np.float32)
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "seq_len", D]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
        helper.make_tensor_value_info("batch_index", TensorProto.INT64, ["batch_size", 1]),
        helper.make_tensor_value_info("past_key.0", TensorProto.FLOAT, ["full_batch_size", 1, "ctx_len", D]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", D]),
        helper.make_tensor_value_info(
            "past_key.0_RetainedState", TensorProto.FLOAT, ["full_batch_size", 1, "ctx_len", D]
        ),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["k"]),
        _const("ax1", [1]),
        helper.make_node("Unsqueeze", ["k", "ax1"], ["k4"]),
        helper.make_node(
            "CtxScatter",
            ["past_key.0", "batch_index", "position_ids", "k4"],
            ["past_key.0_RetainedState"],
            domain=QC,
        ),
        helper.make_node("CtxGather", ["past_key.0_RetainedState", "batch_index"], ["rows"], domain=QC),
        _const("ax12", [1, 2]),
        helper.make_node("ReduceSum", ["rows", "ax12"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "kv", inputs, outputs, [numpy_helper.from_array(w, "W")])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(QC, 1)],
        functions=ctx_functions(),
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path, w


def write_matmul_model(path: Path, width: int = 64, seed: int = 1) -> tuple[Path, np.ndarray]:
    """y = tanh(x @ W) for x [batch_size, width]; no retained state."""
    w = np.random.default_rng(seed).standard_normal((width, width)).astype(np.float32) * 0.37
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", width])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path, w


def kv_specs(fbs: int = 2, ctx: int = 16, prefill: int = 4) -> list[Specialization]:
    return [
        Specialization(
            "Prefill", {"batch_size": 1, "seq_len": prefill, "ctx_len": ctx, "full_batch_size": fbs}
        ),
        Specialization("Decode", {"batch_size": fbs, "seq_len": 1, "ctx_len": ctx, "full_batch_size": fbs}),
    ]


def ccl_specs(slots: int, ctx: int, chunk: int, ccls: Sequence[int]) -> list[Specialization]:
    """QEfficient's CCL layout: one prefill and one decode specialization per compute-context length."""
    common = {"ctx_len": ctx, "full_batch_size": slots}
    return [
        *(Specialization("Prefill", {"batch_size": 1, "seq_len": chunk, "comp_ctx_lengths": c, **common})
          for c in ccls),
        *(Specialization("Decode", {"batch_size": slots, "seq_len": 1, "comp_ctx_lengths": c, **common})
          for c in ccls),
    ]  # fmt: skip


def compile_program(
    root: Path,
    onnx_path: Path,
    specs: Sequence[Specialization],
    *,
    flags: Sequence[str] = ("-retained-state",),
    custom_io: dict[str, str] | None = None,
    num_cores: int = 4,
    mdp_devices: int = 0,
) -> Path:
    """Compile with the qaic-compile flags QEfficient passes; returns the ``qpc`` folder."""
    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / layout.SPECIALIZATIONS_FILE
    layout.write_specializations(spec_path, specs)
    argv = [
        "-aic-hw",
        "-aic-hw-version=ai100",
        f"-m={onnx_path}",
        *flags,
        f"-aic-num-cores={num_cores}",
        f"-network-specialization-config={spec_path}",
        "-compile-only",
        f"-aic-binary-dir={root / 'qpc'}",
    ]
    if custom_io:
        layout.write_custom_io(root / layout.CUSTOM_IO_FILE, custom_io)
        argv.append(f"-custom-IO-list-file={root / layout.CUSTOM_IO_FILE}")
    if mdp_devices:
        mdp = root / f"mdp_ts_{mdp_devices}.json"
        mdp.write_text(json.dumps(layout.mdp_partition(list(range(mdp_devices)), num_cores)))
        argv.append(f"-mdp-load-partition-config={mdp}")
    compile_argv(argv)
    return root / "qpc"


class KvReference:
    """numpy model of write_kv_model: the cache a device should hold, slot by slot."""

    def __init__(self, w: np.ndarray, slots: int, ctx: int) -> None:
        self.w = w
        self.cache = np.zeros((slots, 1, ctx, D), np.float32)

    def run(self, x: np.ndarray, pos: np.ndarray, bidx: np.ndarray) -> np.ndarray:
        k = x @ self.w
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                self.cache[bidx[i, 0], 0, pos[i, j]] = k[i, j]
        return self.cache[bidx[:, 0]].sum(axis=(1, 2))


def run_once(qpc: Path, x: np.ndarray) -> np.ndarray:
    """Load the program, run it once on ``x`` (binding 0) into an output shaped like it (binding 1), unload."""
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    y = np.zeros_like(x)
    exe.setData([(0, x), (1, y)])
    qaicrt.Queue(ctx, 0).enqueue(exe)
    assert exe.waitForCompletion() == QStatus.SUCCESS, exe.lastError
    program.unload()
    return y
