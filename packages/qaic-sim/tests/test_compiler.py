"""The qaic-compile front end: the QPC layout it writes, what it rejects, fp16 and MX FP6 numerics."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sim_programs import D, compile_program, kv_specs, run_once, write_kv_model, write_matmul_model

from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError
from qaic_core.manager import get_plugin_manager
from qaic_core.types import Specialization
from qaic_sim import aicapi, mx, qaicrt, qpcfile
from qaic_sim.compiler import compile_argv
from qaic_sim.qaicrt import QStatus


def test_layout_and_iodesc(tmp_path: Path) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    specs = kv_specs(fbs=3, ctx=32, prefill=8)
    qpc = compile_program(tmp_path / "qpc-abc", onnx_path, specs)
    assert layout.qpc_exists(tmp_path / "qpc-abc")
    assert (qpc / layout.PROGRAM_FILE).is_file()
    with zipfile.ZipFile(qpc / layout.PROGRAM_FILE) as zf:
        names = set(zf.namelist())
        assert {"manifest.json", "model.onnx", "iodesc.pb", "specializations.json"} <= names
        assert json.loads(zf.read("manifest.json"))["format"] == qpcfile.FORMAT
    status, data = qaicrt.Qpc(str(qpc)).getIoDescriptor()
    assert status == QStatus.SUCCESS
    desc = aicapi.IoDesc()
    desc.ParseFromString(bytes(data))
    assert [s.name for s in desc.io_sets] == ["default"]
    b = {x.name: x for x in desc.selected_set.bindings}
    assert list(b) == ["x", "position_ids", "batch_index", "past_key.0", "y", "past_key.0_RetainedState"]
    assert [b[n].dir for n in b] == [0, 0, 0, 0, 1, 1]
    assert b["position_ids"].type == aicapi.INT64_I_TYPE and b["x"].type == aicapi.FLOAT_TYPE
    assert list(b["x"].dims) == [3, 8, D]  # the largest of each dimension over the specializations
    assert b["past_key.0"].size == 3 * 32 * D * 4 and b["past_key.0"].is_partial_buf_allowed
    shapes = [[list(s.dims) for s in a.shapes] for a in desc.allowed_shapes]
    assert shapes[0][0] == [1, 8, D] and shapes[1][0] == [3, 1, D]
    assert shapes[0][4] == [1, D] and shapes[1][4] == [3, D]
    assert shapes[0][3] == shapes[1][3] == [3, 1, 32, D]


def test_backend_compiler_and_onnx_define_symbol(tmp_path: Path) -> None:
    backend = get_plugin_manager().select_device_backend("sim")
    onnx_path, w = write_matmul_model(tmp_path / "mm.onnx", width=16)
    out = tmp_path / "qpc"
    assert backend.compiler is not None
    backend.compiler(
        ["-aic-hw", f"-m={onnx_path}", "-onnx-define-symbol=batch_size,2", f"-aic-binary-dir={out}"]
    )
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(run_once(out, x), np.tanh(x @ w), rtol=1e-5, atol=1e-6)


def test_convert_to_fp16_rounds_weights_inputs_and_activations(tmp_path: Path) -> None:
    onnx_path, w = write_matmul_model(tmp_path / "mm.onnx")
    spec = [Specialization("b4", {"batch_size": 4})]
    qpc32 = compile_program(tmp_path / "f32", onnx_path, spec, flags=())
    qpc16 = compile_program(tmp_path / "f16", onnx_path, spec, flags=("-convert-to-fp16",))
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    y32, y16 = run_once(qpc32, x), run_once(qpc16, x)
    r16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    expected = r16(np.tanh(r16(r16(x) @ r16(w))))
    np.testing.assert_array_equal(y16, r16(y16))  # every output is an fp16 value
    np.testing.assert_allclose(y16, expected, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(y32, np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    assert np.abs(y16 - y32).max() > 0  # the datapath really is narrower


def _write_rms_norm_model(path: Path, width: int, eps: float) -> tuple[Path, np.ndarray]:
    """y = CustomRMSNorm(x, w): QEfficient's compiler-known op, defined as a model-local function."""
    w = np.random.default_rng(3).uniform(0.5, 1.5, width).astype(np.float32)
    eps_node = helper.make_node("Constant", [], ["eps"])
    eps_node.attribute.append(
        onnx.AttributeProto(name="value_float", ref_attr_name="epsilon", type=onnx.AttributeProto.FLOAT)
    )
    body = [
        eps_node,
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["normed"]),
        helper.make_node("Mul", ["normed", "w"], ["out"]),
    ]
    domain = "com.qti.aisw.onnx"
    function = helper.make_function(
        domain, "CustomRMSNorm", ["x", "w"], ["out"], body, [helper.make_opsetid("", 17)], ["epsilon"]
    )
    graph = helper.make_graph(
        [helper.make_node("CustomRMSNorm", ["x", "W"], ["y"], domain=domain, epsilon=eps)],
        "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", width])],
        [numpy_helper.from_array(w, "W")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path, w


def test_fp16_rounds_a_compiler_known_kernel_once(tmp_path: Path) -> None:
    """CustomRMSNorm is one kernel on the device: computed at full precision, its output rounded to
    fp16 once, not after each of the steps its ONNX definition spells out."""
    eps = 1e-5
    onnx_path, w = _write_rms_norm_model(tmp_path / "rms.onnx", width=256, eps=eps)
    qpc = compile_program(
        tmp_path / "f16", onnx_path, [Specialization("b8", {"batch_size": 8})], flags=("-convert-to-fp16",)
    )
    x = (np.random.default_rng(4).standard_normal((8, 256)) * 3).astype(np.float32)
    y = run_once(qpc, x)
    r16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)  # noqa: E731
    x16 = r16(x).astype(np.float64)
    once = r16(x16 / np.sqrt((x16 * x16).mean(-1, keepdims=True) + eps) * r16(w))
    step = r16(r16(r16(x16) / r16(np.sqrt(r16(r16(r16(x16 * x16).mean(-1, keepdims=True)) + eps)))) * r16(w))
    np.testing.assert_array_equal(y, r16(y))  # fp16 values
    ulp = np.spacing(np.abs(once).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(y - once) <= ulp)  # at most a tie broken the other way
    assert np.mean(y == once) > 0.99
    assert np.mean(y == once) > np.mean(y == step)  # not rounded step by step


def test_mxfp6_matmul_stores_mx_weights(tmp_path: Path) -> None:
    onnx_path, w = write_matmul_model(tmp_path / "mm.onnx")
    qpc = compile_program(
        tmp_path / "mx", onnx_path, [Specialization("b2", {"batch_size": 2})], flags=("-mxfp6-matmul",)
    )
    model = onnx.load_from_string(qpcfile.read_member(qpc, qpcfile.MODEL))
    stored = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
    np.testing.assert_array_equal(stored, mx.quantize_mxfp6(w, axis=0))
    assert not np.array_equal(stored, w)
    manifest, _ = qpcfile.read_manifest(qpc)
    assert manifest.weights_bytes == int(np.ceil(w.size * mx.bytes_per_element("mxfp6")))
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(run_once(qpc, x), np.tanh(x @ stored), rtol=1e-5, atol=1e-6)


def _argv(
    tmp_path: Path, onnx_path: Path, *extra: str, specs: list[Specialization] | None = None
) -> list[str]:
    spec_path = tmp_path / "specializations.json"
    layout.write_specializations(spec_path, specs if specs is not None else kv_specs())
    return [
        "-aic-hw",
        f"-m={onnx_path}",
        f"-network-specialization-config={spec_path}",
        f"-aic-binary-dir={tmp_path / 'qpc'}",
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "specs", "message"),
    [
        (("-retained-state", "-aic-foo"), None, "unknown qaic-compile flag '-aic-foo'"),
        (("-retained-state", "-aic-num-cores=17"), None, "aic-num-cores=17 is out of range"),
        (("-retained-state", "-aic-hw-version=ai200"), None, "aic-hw-version"),
        (("-retained-state", "-mos"), None, "-mos needs a value"),
        (("-retained-state", "-mos=0"), None, "-mos=0 is out of range: must be >= 1"),
        (("-retained-state", "-stats-batchsize=x"), None, "-stats-batchsize='x' is not an integer"),
        (
            ("-retained-state",),
            [Specialization("P", {"batch_size": 1, "seq_len": 4, "full_batch_size": 2})],
            "does not set \\['ctx_len'\\]",
        ),
        (
            ("-retained-state",),
            [Specialization("P", {"batch_size": 1, "seq_len": 64, "ctx_len": 32, "full_batch_size": 2})],
            "seq_len=64 > ctx_len=32",
        ),
    ],
)
def test_rejections(
    tmp_path: Path, extra: tuple[str, ...], specs: list[Specialization] | None, message: str
) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    with pytest.raises(QaicConfigError, match=message):
        compile_argv(_argv(tmp_path, onnx_path, *extra, specs=specs))
    assert not (tmp_path / "qpc" / layout.PROGRAM_FILE).exists()


@pytest.mark.parametrize(
    ("mdp", "message"),
    [
        ("not json", "expected \\{connections, partitions"),
        ({"connections": []}, "expected \\{connections, partitions"),
        ({**layout.mdp_partition([0, 1], 1), "partitions": []}, "expected \\{connections, partitions"),
        (
            {"partitions": layout.mdp_partition([0, 1], 1)["partitions"] * 2},
            "supports one partition, found 2; list every device",
        ),
        ({"partitions": [{"name": "P0", "devices": []}]}, "lists no devices"),
    ],
)
def test_bad_mdp_partition_is_rejected(tmp_path: Path, mdp: object, message: str) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    path = tmp_path / "mdp.json"
    path.write_text(mdp if isinstance(mdp, str) else json.dumps(mdp))
    argv = _argv(tmp_path, onnx_path, "-retained-state", f"-mdp-load-partition-config={path}")
    with pytest.raises(QaicConfigError, match=message):
        compile_argv(argv)
    assert not (tmp_path / "qpc" / layout.PROGRAM_FILE).exists()


def test_rejects_missing_hw_model_and_retained_outputs(tmp_path: Path) -> None:
    onnx_path, _ = write_matmul_model(tmp_path / "mm.onnx")
    spec = [Specialization("b", {"batch_size": 1})]
    argv = _argv(tmp_path, onnx_path, "-retained-state", specs=spec)
    with pytest.raises(QaicConfigError, match="no output named '<input>_RetainedState'"):
        compile_argv(argv)
    with pytest.raises(QaicConfigError, match="-aic-hw is required"):
        compile_argv(argv[1:])
    with pytest.raises(QaicConfigError, match="no such ONNX file"):
        compile_argv(["-aic-hw", f"-m={tmp_path / 'none.onnx'}", f"-aic-binary-dir={tmp_path}"])
    with pytest.raises(QaicConfigError, match="symbolic dimensions \\['batch_size'\\]"):
        compile_argv(["-aic-hw", f"-m={onnx_path}", f"-aic-binary-dir={tmp_path / 'q'}"])


def test_rejects_bad_custom_io(tmp_path: Path) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    cases = [
        ({"past_key.9": "float16"}, "is not an input or output"),
        ({"past_key.0": "float16"}, "retained-state pair must use one precision"),
        ({"past_key.0": "int4", "past_key.0_RetainedState": "int4"}, "precision 'int4'"),
        ({"y": "mxint8"}, "mxint8 applies to retained state only"),
        ({"position_ids": "float16"}, "not a float tensor"),
    ]
    for entries, message in cases:
        layout.write_custom_io(tmp_path / "custom_io.yaml", entries)
        with pytest.raises(QaicConfigError, match=message):
            compile_argv(
                _argv(
                    tmp_path,
                    onnx_path,
                    "-retained-state",
                    f"-custom-IO-list-file={tmp_path / 'custom_io.yaml'}",
                )
            )


def test_accepts_flags_qefficient_passes(tmp_path: Path) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    flags = (
        "-retained-state",
        "-convert-to-fp16",
        "-mos=1",
        "-aic-enable-depth-first",
        "-aic-perf-warnings",
        "-aic-perf-metrics",
        "-stats-batchsize=2",
        "-compile-only",
        "-aic-hw-version=ai100",
    )
    compile_argv(_argv(tmp_path, onnx_path, *flags))
    manifest, _ = qpcfile.read_manifest(tmp_path / "qpc")
    assert manifest.convert_to_fp16 and list(manifest.argv[-len(flags) :]) == list(flags)


def test_graph_the_executor_cannot_run_fails_at_compile(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    from qaic_core.errors import QaicError

    graph = helper.make_graph(
        [helper.make_node("Mystery", ["x"], ["y"], domain="com.example")],
        "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    onnx.save(model, str(tmp_path / "bad.onnx"))
    with pytest.raises(QaicError, match="cannot be compiled for the simulator"):
        compile_argv(["-aic-hw", f"-m={tmp_path / 'bad.onnx'}", f"-aic-binary-dir={tmp_path / 'qpc'}"])
    assert not (tmp_path / "qpc" / layout.PROGRAM_FILE).exists()


def test_output_with_wrong_declared_dims_fails_the_run_clearly(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["ax"], value=numpy_helper.from_array(np.array([1], np.int64), "ax")
            ),
            helper.make_node("ReduceSum", ["x", "ax"], ["y"], keepdims=1),
        ],
        "liar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "seq_len"])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "seq_len"])
        ],  # really [batch, 1]
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "liar.onnx")
    )
    qpc = compile_program(
        tmp_path / "p",
        tmp_path / "liar.onnx",
        [Specialization("s", {"batch_size": 1, "seq_len": 4})],
        flags=(),
    )
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    exe.setData([(0, np.ones((1, 4), np.float32)), (1, np.zeros((1, 4), np.float32))])
    qaicrt.Queue(ctx, 0).enqueue(exe)
    assert exe.waitForCompletion() == QStatus.ERROR
    assert "output 'y' came out as [1, 1] but specialization 's' declares [1, 4]" in exe.lastError
    program.unload()
