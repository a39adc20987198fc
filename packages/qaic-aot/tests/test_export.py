"""The exported ONNX: QEfficient's IO contract, KV padding semantics, logits placement, clear errors."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import TINY_ARCHS, VOCAB_SIZE, HFReference

from qaic_aot.export import SUPPORTED_ARCHITECTURES, ExportResult, check_architecture, export_onnx
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

CTX = 32
CB = CompileSettings(prefill_seq_len=8, ctx_len=CTX, full_batch_size=4, convert_to_fp16=False)


def _export(
    model_dir: Path, out_dir: Path, settings: CompileSettings
) -> tuple[ExportResult, ort.InferenceSession]:
    result = export_onnx(model_dir, out_dir / "model.onnx", settings, progress=False)
    session = ort.InferenceSession(str(result.onnx_path), providers=["CPUExecutionProvider"])
    return result, session


@pytest.fixture(scope="module")
def llama_cb(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ExportResult, ort.InferenceSession]:
    return _export(tiny_llama, tmp_path_factory.mktemp("export-cb"), CB)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> HFReference:
    return HFReference(tiny_llama)


def _dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _empty_cache(
    result: ExportResult, rows: int, fill: Callable[[tuple[int, ...]], np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    shape = (rows, result.num_kv_heads, CTX, result.head_dim)
    make = fill or (lambda s: np.zeros(s, np.float32))
    return {n: make(shape).astype(np.float32) for n in result.input_names if n.startswith("past_")}


def test_io_contract_names_dtypes_and_symbolic_dims(
    llama_cb: tuple[ExportResult, ort.InferenceSession],
) -> None:
    result, _ = llama_cb
    model = onnx.load(str(result.onnx_path))
    onnx.checker.check_model(model, full_check=True)
    kv_in = [f"past_{kind}.{i}" for i in range(2) for kind in ("key", "value")]
    assert [i.name for i in model.graph.input] == ["input_ids", "position_ids", *kv_in, "batch_index"]
    assert [o.name for o in model.graph.output] == ["logits"] + [f"{n}_RetainedState" for n in kv_in]
    assert result.input_names == [i.name for i in model.graph.input]
    assert result.output_names == [o.name for o in model.graph.output]
    by_name = {v.name: v for v in [*model.graph.input, *model.graph.output]}
    int64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    for name in ("input_ids", "position_ids"):
        assert by_name[name].type.tensor_type.elem_type == int64
        assert _dims(by_name[name]) == ["batch_size", "seq_len"]
    assert _dims(by_name["batch_index"]) == ["batch_size", 1]
    assert by_name["batch_index"].type.tensor_type.elem_type == int64
    for name in kv_in:
        for full in (name, f"{name}_RetainedState"):
            assert by_name[full].type.tensor_type.elem_type == f32
            assert _dims(by_name[full]) == ["full_batch_size", 2, "ctx_len", 16]
    assert _dims(by_name["logits"]) == ["batch_size", 1, VOCAB_SIZE]
    assert (result.num_layers, result.num_kv_heads, result.head_dim, result.vocab_size) == (
        2,
        2,
        16,
        VOCAB_SIZE,
    )
    assert result.architecture == "LlamaForCausalLM"
    functions = {(f.domain, f.name) for f in model.functions}
    assert functions == {
        ("com.qualcomm.cloud", "CtxScatterCB"),
        ("com.qualcomm.cloud", "CtxGatherCB"),
        ("com.qti.aisw.onnx", "CustomRMSNorm"),  # QEfficient's compiler-known RMSNorm
    }
    imports = {(o.domain, o.version) for o in model.opset_import}
    assert imports >= {("com.qualcomm.cloud", 1), ("com.qti.aisw.onnx", 1)}
    kv_ops = [n for n in model.graph.node if n.domain == "com.qualcomm.cloud"]
    assert len(kv_ops) == 8  # a scatter and a gather per K and V per layer
    norms = [n for n in model.graph.node if (n.domain, n.op_type) == ("com.qti.aisw.onnx", "CustomRMSNorm")]
    assert len(norms) == 5  # two per layer and the final norm


def test_io_contract_without_continuous_batching(tiny_llama: Path, tmp_path: Path) -> None:
    result, session = _export(tiny_llama, tmp_path, CompileSettings(prefill_seq_len=8, ctx_len=CTX))
    names = [i.name for i in session.get_inputs()]
    assert "batch_index" not in names
    assert session.get_inputs()[2].shape == ["batch_size", 2, "ctx_len", 16]
    model = onnx.load(str(result.onnx_path))
    assert {f.name for f in model.functions} == {"CtxScatter", "CtxGather", "CustomRMSNorm"}
    ids = np.array([[5, 6, 7, 8]], np.int64)
    out = _run(session, {"input_ids": ids, "position_ids": np.arange(4)[None], **_empty_cache(result, 1)})
    ref = HFReference(tiny_llama).logits([5, 6, 7, 8])
    np.testing.assert_allclose(out["logits"][0, 0], ref[-1], atol=1e-4)


def test_padding_positions_are_neither_written_nor_read(
    llama_cb: tuple[ExportResult, ort.InferenceSession], reference: HFReference
) -> None:
    result, session = llama_cb
    rng = np.random.default_rng(0)
    garbage = _empty_cache(result, 4, lambda s: rng.normal(0.0, 50.0, s))
    tokens = [11, 42, 7, 99, 150]
    ids = np.array([[*tokens, 0, 0, 0]], np.int64)
    pos = np.array([[0, 1, 2, 3, 4, -1, -1, -1]], np.int64)
    out = _run(session, {"input_ids": ids, "position_ids": pos, "batch_index": np.array([[1]]), **garbage})
    # Stale cache beyond the last real position is not read: logits match a clean forward pass.
    np.testing.assert_allclose(out["logits"][0, 0], reference.logits(tokens)[-1], atol=1e-4)
    for name, before in garbage.items():
        after = out[f"{name}_RetainedState"]
        assert not np.allclose(after[1, :, :5], before[1, :, :5])  # the real positions were written
        np.testing.assert_array_equal(
            after[1, :, 5:], before[1, :, 5:]
        )  # padding wrote nothing (not even ctx-1)
        for other in (0, 2, 3):
            np.testing.assert_array_equal(after[other], before[other])


def test_logits_at_argmax_position_per_row(
    llama_cb: tuple[ExportResult, ort.InferenceSession], reference: HFReference
) -> None:
    result, session = llama_cb
    first, second = [3, 14, 15, 92, 65, 35, 89, 79], [27, 18, 28]
    ids = np.array([first, [*second, 0, 0, 0, 0, 0]], np.int64)
    pos = np.array([list(range(8)), [0, 1, 2, -1, -1, -1, -1, -1]], np.int64)
    feeds = {
        "input_ids": ids,
        "position_ids": pos,
        "batch_index": np.array([[0], [3]]),
        **_empty_cache(result, 4),
    }
    out = _run(session, feeds)
    assert out["logits"].shape == (2, 1, VOCAB_SIZE)
    np.testing.assert_allclose(out["logits"][0, 0], reference.logits(first)[-1], atol=1e-4)
    np.testing.assert_allclose(out["logits"][1, 0], reference.logits(second)[-1], atol=1e-4)
    # A decode step continues each row from its own cache slot.
    feeds = {
        "input_ids": np.array([[7], [0], [0], [8]], np.int64),
        "position_ids": np.array([[8], [-1], [-1], [3]], np.int64),
        "batch_index": np.arange(4)[:, None],
        **{n: out[f"{n}_RetainedState"] for n in result.input_names if n.startswith("past_")},
    }
    step = _run(session, feeds)
    np.testing.assert_allclose(step["logits"][0, 0], reference.logits([*first, 7])[-1], atol=1e-4)
    np.testing.assert_allclose(step["logits"][3, 0], reference.logits([*second, 8])[-1], atol=1e-4)


def test_num_logits_to_keep_returns_the_last_k_plus_one(
    tiny_llama: Path, tmp_path: Path, reference: HFReference
) -> None:
    settings = CompileSettings(prefill_seq_len=8, ctx_len=CTX, full_batch_size=2, num_speculative_tokens=3)
    result, session = _export(tiny_llama, tmp_path, settings)
    assert result.input_names[-1] == "num_logits_to_keep"
    assert session.get_inputs()[-1].shape == ["num_logits_to_keep", 1]
    assert session.get_outputs()[0].shape == ["batch_size", "num_logits_to_keep", VOCAB_SIZE]
    tokens = [21, 22, 23, 24, 25, 26]
    ids = np.array([[*tokens, 0, 0]], np.int64)
    pos = np.array([[0, 1, 2, 3, 4, 5, -1, -1]], np.int64)
    feeds = {
        "input_ids": ids,
        "position_ids": pos,
        "batch_index": np.array([[1]]),
        "num_logits_to_keep": np.zeros((4, 1), np.int64),
        **_empty_cache(result, 2),
    }
    out = _run(session, feeds)
    assert out["logits"].shape == (1, 4, VOCAB_SIZE)
    np.testing.assert_allclose(out["logits"][0], reference.logits(tokens)[2:6], atol=1e-4)


def test_unsupported_architecture_lists_the_supported_ones(
    unsupported_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(QaicConfigError, match="FalconMambaForCausalLM") as info:
        export_onnx(unsupported_model_dir, tmp_path / "m.onnx", CB, progress=False)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(info.value)
    config = json.loads((unsupported_model_dir / "config.json").read_text())
    with pytest.raises(QaicConfigError, match="supported architectures"):
        check_architecture(type("Config", (), config))


def test_missing_files_are_named(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(QaicConfigError, match=r"config\.json"):
        export_onnx(tmp_path, tmp_path / "m.onnx", CB, progress=False)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama / "config.json", no_weights / "config.json")
    with pytest.raises(QaicConfigError, match=r"model\.safetensors"):
        export_onnx(no_weights, tmp_path / "m.onnx", CB, progress=False)
    with pytest.raises(QaicConfigError, match="does not exist"):
        export_onnx(tmp_path / "nowhere", tmp_path / "m.onnx", CB, progress=False)


def _edited_copy(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unsupported_settings_are_rejected_clearly(
    tiny_llama: Path, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    yarn = _edited_copy(tiny_llama, tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(QaicConfigError, match="rope type 'yarn'"):
        export_onnx(yarn, tmp_path / "m.onnx", CB, progress=False)
    long_ctx = CompileSettings(prefill_seq_len=8, ctx_len=512)
    with pytest.raises(QaicConfigError, match="n_positions"):
        export_onnx(tiny_model_factory("gpt2"), tmp_path / "m.onnx", long_ctx, progress=False)
    with pytest.raises(QaicConfigError, match="float16"):
        export_onnx(tiny_llama, tmp_path / "m.onnx", CB, dtype="float16", progress=False)


def test_export_logs_its_stages(tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="qaic.aot.export"):
        export_onnx(tiny_llama, tmp_path / "m.onnx", CB, progress=False)
    messages = " ".join(r.getMessage() for r in caplog.records if r.name == "qaic.aot.export")
    assert "building llama decoder graph" in messages
    assert "exported" in messages


def test_exporter_choice_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_aot.export.onnx_export import choose_exporter
    from qaic_aot.export.qeff import qefficient_available

    monkeypatch.setenv("QAIC_AOT_EXPORTER", "qaic")
    assert choose_exporter() == "qaic"
    monkeypatch.setenv("QAIC_AOT_EXPORTER", "torchscript")
    with pytest.raises(QaicConfigError, match="qefficient, qaic"):
        choose_exporter()
    monkeypatch.delenv("QAIC_AOT_EXPORTER")
    assert choose_exporter() == ("qefficient" if qefficient_available() else "qaic")
    if not qefficient_available():
        monkeypatch.setenv("QAIC_AOT_EXPORTER", "qefficient")
        with pytest.raises(QaicConfigError, match="pip install QEfficient"):
            choose_exporter()


def test_an_export_written_elsewhere_is_moved_to_the_requested_path(
    llama_cb: tuple[ExportResult, ort.InferenceSession], tmp_path: Path
) -> None:
    from qaic_aot.export.onnx_export import _save
    from qaic_aot.export.qeff import relocate_onnx

    result, _ = llama_cb
    target = tmp_path / "moved" / "model.onnx"
    target.parent.mkdir()
    assert relocate_onnx(result.onnx_path, target, _save) == target
    original, moved = onnx.load(str(result.onnx_path)), onnx.load(str(target))
    assert moved.SerializeToString() == original.SerializeToString()


def test_qefficients_export_folder_is_removed_once_moved(tmp_path: Path) -> None:
    from qaic_aot.export.qeff import discard_export

    entry = tmp_path / "entry"
    produced = entry / "qefficient-export-0123" / "LlamaForCausalLM.onnx"
    produced.parent.mkdir(parents=True)
    produced.write_bytes(b"onnx")
    (produced.parent / "hashed_export_params.json").write_text("{}")
    outside = tmp_path / "elsewhere" / "model.onnx"
    outside.parent.mkdir()
    outside.write_bytes(b"onnx")
    discard_export(outside, entry / "model.onnx")  # not inside the entry: left alone
    assert outside.exists()
    discard_export(produced, entry / "model.onnx")
    assert not produced.parent.exists() and entry.exists()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "gpt2"])
def test_model_facts_agree_with_the_decoder_spec(
    arch: str, tiny_model_factory: Callable[[str], Path]
) -> None:
    from qaic_aot.export import decoder_spec, load_config
    from qaic_aot.export.families import model_facts

    config = load_config(tiny_model_factory(arch))
    spec = decoder_spec(config, CB)
    facts = model_facts(config)
    assert facts == {
        "architecture": spec.architecture,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
    }


def _specialized(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """The model with every symbolic dim fixed, as a compiler sees one specialization."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in [*fixed.graph.input, *fixed.graph.output]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param:
                size = dims[d.dim_param]
                d.ClearField("dim_param")
                d.dim_value = size
    return fixed


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("variant", ["ctx", "ccl", "speculative"])
def test_every_specialization_is_a_valid_static_graph(
    arch: str, variant: str, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """Fixed to a specialization's dims, as a compiler sees it, the graph passes ONNX's strict shape
    inference and loads in onnxruntime, which checks every node with every shape known (``Range``
    takes scalars: a one-element constant fails here, not with symbolic dims)."""
    settings = CompileSettings(
        prefill_seq_len=8,
        ctx_len=CTX,
        full_batch_size=4,
        convert_to_fp16=False,
        num_speculative_tokens=3 if variant == "speculative" else None,
    )
    result = export_onnx(
        tiny_model_factory(arch), tmp_path / "model.onnx", settings, progress=False, ccl=variant == "ccl"
    )
    model = onnx.load(str(result.onnx_path))
    for batch, seq in ((1, 8), (4, settings.decode_seq_len)):
        dims = {"batch_size": batch, "seq_len": seq, "ctx_len": CTX, "full_batch_size": 4,
                "comp_ctx_lengths": 16, "num_logits_to_keep": settings.decode_seq_len}  # fmt: skip
        static = _specialized(model, dims)
        onnx.shape_inference.infer_shapes(static, strict_mode=True, data_prop=True)
        ort.InferenceSession(static.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("speculative", [False, True])
def test_last_layer_computes_only_the_rows_whose_logits_leave(
    tiny_llama: Path, tmp_path: Path, speculative: bool
) -> None:
    """Every row's keys and values are written to the cache, but after the last layer only the
    rows the logits come from are used, so that layer's queries, attention output and MLP run on
    those rows alone: in an 8-token prefill, 1 row (K + 1 with speculative decoding) against 8."""
    settings = CompileSettings(
        prefill_seq_len=8,
        ctx_len=CTX,
        full_batch_size=4,
        convert_to_fp16=False,
        num_speculative_tokens=3 if speculative else None,
    )
    result = export_onnx(tiny_llama, tmp_path / "model.onnx", settings, progress=False)
    model = onnx.load(str(result.onnx_path))
    dims = {"batch_size": 1, "seq_len": 8, "ctx_len": CTX, "full_batch_size": 4, "num_logits_to_keep": 4}
    static = onnx.shape_inference.infer_shapes(_specialized(model, dims), strict_mode=True, data_prop=True)
    shapes = {v.name: _dims(v) for v in static.graph.value_info}
    last = result.num_layers - 1

    def rows_of(layer: int, weight: str) -> int | str:
        (name,) = [n for n in shapes if n.startswith(f"layers.{layer}.{weight}_")]
        return shapes[name][1]

    for weight in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        assert rows_of(0, weight) == 8 and rows_of(last, weight) == 8
    for weight in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert rows_of(0, weight) == 8
        # The K + 1 kept rows come from a Range that shape inference does not evaluate.
        assert rows_of(last, weight) != 8 if speculative else rows_of(last, weight) == 1
