"""What the compiler is told: specializations, custom IO, flag mapping and cache keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qaic_aot import cache, model_files, program_config
from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

SYMBOLS = frozenset({"batch_size", "seq_len", "ctx_len", "full_batch_size"})


def test_continuous_batching_specializations_follow_qefficient() -> None:
    settings = CompileSettings(prefill_seq_len=128, ctx_len=2048, full_batch_size=8)
    specs = program_config.specializations(settings, SYMBOLS)
    assert [(s.name, s.symbols) for s in specs] == [
        ("Prefill", {"batch_size": 1, "seq_len": 128, "ctx_len": 2048, "full_batch_size": 8}),
        ("Decode", {"batch_size": 8, "seq_len": 1, "ctx_len": 2048, "full_batch_size": 8}),
    ]


def test_specializations_file_has_the_current_string_form(tmp_path: Path) -> None:
    settings = CompileSettings(prefill_seq_len=128, ctx_len=2048, full_batch_size=8)
    layout.write_specializations(tmp_path / "s.json", program_config.specializations(settings, SYMBOLS))
    raw = json.loads((tmp_path / "s.json").read_text())
    assert raw["specializations"][0] == {
        "name": "Prefill",
        "symbols": {"batch_size": "1", "seq_len": "128", "ctx_len": "2048", "full_batch_size": "8"},
    }


def test_fixed_batch_and_speculative_specializations() -> None:
    plain = program_config.specializations(CompileSettings(prefill_seq_len=16, ctx_len=64, batch_size=2))
    assert [s.symbols for s in plain] == [
        {"batch_size": 2, "seq_len": 16, "ctx_len": 64},
        {"batch_size": 2, "seq_len": 1, "ctx_len": 64},
    ]
    spec = program_config.specializations(
        CompileSettings(prefill_seq_len=16, ctx_len=64, full_batch_size=4, num_speculative_tokens=3), SYMBOLS
    )
    # QEfficient's speculative target layout: the prefill and a K+1-token decode, no one-token decode.
    assert [s.symbols["seq_len"] for s in spec] == [16, 4]
    assert [s.symbols["batch_size"] for s in spec] == [1, 4]


def test_speculative_target_specializations_are_qefficients_tlm_layout() -> None:
    """build_prefill_specialization / build_decode_specialization with is_tlm, num_speculative_tokens 3."""
    symbols = SYMBOLS | {"num_logits_to_keep"}
    cb = CompileSettings(prefill_seq_len=16, ctx_len=64, full_batch_size=4, num_speculative_tokens=3)
    assert [(s.name, s.symbols) for s in program_config.specializations(cb, symbols)] == [
        ("Prefill", {"batch_size": 1, "seq_len": 16, "ctx_len": 64, "num_logits_to_keep": 1, "full_batch_size": 4}),
        ("Decode", {"batch_size": 4, "seq_len": 4, "ctx_len": 64, "num_logits_to_keep": 4, "full_batch_size": 4}),
    ]  # fmt: skip
    fixed = CompileSettings(prefill_seq_len=16, ctx_len=64, batch_size=2, num_speculative_tokens=3)
    assert [(s.name, s.symbols) for s in program_config.specializations(fixed, symbols)] == [
        ("Prefill", {"batch_size": 2, "seq_len": 16, "ctx_len": 64, "num_logits_to_keep": 1}),
        ("Decode", {"batch_size": 2, "seq_len": 4, "ctx_len": 64, "num_logits_to_keep": 4}),
    ]


def test_symbols_the_graph_lacks_are_left_out() -> None:
    specs = program_config.specializations(
        CompileSettings(full_batch_size=4), frozenset({"batch_size", "seq_len", "ctx_len"})
    )
    assert all("full_batch_size" not in s.symbols for s in specs)


@pytest.mark.parametrize(
    ("changes", "precision"),
    [({}, "float16"), ({"mxint8": True}, "mxint8"), ({"convert_to_fp16": False}, "float32")],
)
def test_custom_io_sets_kv_precision(changes: dict[str, bool], precision: str, tmp_path: Path) -> None:
    settings = CompileSettings(**changes)
    entries = program_config.custom_io(settings, num_layers=2)
    assert set(entries) == {
        f"{kind}.{i}{suffix}"
        for kind in ("past_key", "past_value")
        for i in (0, 1)
        for suffix in ("", "_RetainedState")
    }
    assert set(entries.values()) == {precision}
    layout.write_custom_io(tmp_path / "custom_io.yaml", entries)
    assert layout.read_custom_io(tmp_path / "custom_io.yaml") == entries


def test_compiler_flags_map_every_setting(tmp_path: Path) -> None:
    settings = CompileSettings(
        num_cores=14,
        mxfp6=True,
        mos=2,
        aic_enable_depth_first=True,
        num_devices=4,
        full_batch_size=4,
        compiler_args=("-stats-level=70",),
    )
    argv = program_config.compiler_argv(tmp_path / "m.onnx", tmp_path, settings)
    assert argv == [
        "-aic-hw",
        "-aic-hw-version=ai100",
        f"-m={tmp_path / 'm.onnx'}",
        "-retained-state",
        "-convert-to-fp16",
        "-mxfp6-matmul",
        "-aic-num-cores=14",
        "-mos=2",
        "-aic-enable-depth-first",
        f"-network-specialization-config={tmp_path / 'specializations.json'}",
        f"-custom-IO-list-file={tmp_path / 'custom_io.yaml'}",
        f"-mdp-load-partition-config={tmp_path / 'mdp_ts_4.json'}",
        f"-aic-binary-dir={tmp_path / 'qpc'}",
        "-stats-level=70",
    ]
    minimal = program_config.compiler_argv(
        tmp_path / "m.onnx", tmp_path, CompileSettings(convert_to_fp16=False)
    )
    assert "-convert-to-fp16" not in minimal and "-mxfp6-matmul" not in minimal
    assert not any(a.startswith(("-mos", "-mdp")) for a in minimal)


def _model_dir(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 10}))
    (root / "model.safetensors").write_bytes(b"weights-1")
    return root


def test_fingerprint_changes_with_weights_and_config(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    first = cache.hash_params({"files": cache.model_fingerprint(model)})
    assert first == cache.hash_params({"files": cache.model_fingerprint(model)})
    (model / "model.safetensors").write_bytes(b"weights-2")
    second = cache.hash_params({"files": cache.model_fingerprint(model)})
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 11}))
    third = cache.hash_params({"files": cache.model_fingerprint(model)})
    assert len({first, second, third}) == 3
    # Files that are not part of the model (notes, caches) do not change the key.
    (model / "README.md").write_text("notes")
    assert cache.hash_params({"files": cache.model_fingerprint(model)}) == third


def test_huge_files_are_keyed_by_size_and_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_dir(tmp_path / "m")
    monkeypatch.setattr(cache, "CONTENT_HASH_LIMIT", 4)
    before = cache.model_fingerprint(model)["model.safetensors"]
    assert before.startswith("size:9:")
    os.utime(model / "model.safetensors", ns=(1, 1))
    assert cache.model_fingerprint(model)["model.safetensors"] != before


def test_missing_model_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(QaicConfigError, match="does not exist"):
        model_files.check_model_dir(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    with pytest.raises(QaicConfigError, match=r"config\.json"):
        model_files.check_model_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(QaicConfigError, match=r"model\.safetensors"):
        model_files.check_model_dir(tmp_path / "m")


def test_progress_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_aot.progress import stage

    monkeypatch.setenv("QAIC_PROGRESS", "maybe")
    with pytest.raises(QaicConfigError, match="QAIC_PROGRESS='maybe' is not a boolean"), stage("step"):
        pass
    monkeypatch.setenv("QAIC_PROGRESS", "1")
    with stage("step"):
        pass


def test_shorter_and_batched_prefills_follow_the_decodes() -> None:
    settings = CompileSettings(
        prefill_seq_len=128, ctx_len=2048, full_batch_size=8, prefill_seq_lens=(32, 64), prefill_batch_size=4
    )
    specs = program_config.specializations(settings, SYMBOLS)
    assert [(s.name, s.symbols["batch_size"], s.symbols["seq_len"]) for s in specs] == [
        ("Prefill", 1, 128),
        ("Decode", 8, 1),
        ("Prefill", 1, 64),
        ("Prefill", 1, 32),
        ("Prefill", 2, 32),
        ("Prefill", 4, 32),
    ]
    assert settings.prefill_lengths == (32, 64, 128) and settings.batched_prefill_seq_len == 32
    # Fewer prompts than prefill_batch_size run on 2, 4, ... rows: no padding rows.
    assert settings.batched_prefill_rows == (2, 4)
    assert [settings.replace(prefill_batch_size=n).batched_prefill_rows for n in (2, 3, 6, 8)] == [
        (2,),
        (2, 3),
        (2, 4, 6),
        (2, 4, 8),
    ]
    assert CompileSettings(full_batch_size=8).batched_prefill_rows == ()


def test_a_batched_prefill_of_long_rows() -> None:
    settings = CompileSettings(
        prefill_seq_len=128,
        ctx_len=2048,
        full_batch_size=8,
        prefill_seq_lens=(32, 64),
        prefill_batch_size=2,
        prefill_batch_seq_len=128,
    )
    specs = program_config.specializations(settings, SYMBOLS)
    assert [(s.name, s.symbols["batch_size"], s.symbols["seq_len"]) for s in specs][-1] == ("Prefill", 2, 128)
    assert settings.batched_prefill_seq_len == 128
    assert (
        CompileSettings.from_mapping(
            {**settings.to_dict(), "prefill_batch_seq_len": "64"}
        ).prefill_batch_seq_len
        == 64
    )
    with pytest.raises(
        QaicConfigError, match=r"prefill_batch_seq_len \(256\) must be 1 \.\. prefill_seq_len \(128\)"
    ):
        settings.replace(prefill_batch_seq_len=256)
    with pytest.raises(QaicConfigError, match="set --prefill-batch-size 2 or more"):
        settings.replace(prefill_batch_size=1)


def test_prefill_shapes_are_checked_and_keep_old_cache_keys() -> None:
    from qaic_aot.compile import compile_params
    from qaic_core import get_plugin_manager

    with pytest.raises(QaicConfigError, match=r"each must be 1 \.\. prefill_seq_len"):
        CompileSettings(prefill_seq_len=32, prefill_seq_lens=(64,))
    with pytest.raises(QaicConfigError, match="needs continuous batching"):
        CompileSettings(prefill_batch_size=2)
    with pytest.raises(QaicConfigError, match="must not exceed full_batch_size"):
        CompileSettings(full_batch_size=2, prefill_batch_size=4)
    assert CompileSettings.from_mapping({"prefill_seq_lens": "16, 8,16"}).prefill_seq_lens == (8, 16)
    backend = get_plugin_manager().select_device_backend()
    plain = compile_params(CompileSettings(full_batch_size=4), backend)
    assert "prefill_seq_lens" not in plain["settings"] and "prefill_batch_size" not in plain["settings"]
    assert "prefill_batch_seq_len" not in plain["settings"]
    batched = compile_params(
        CompileSettings(full_batch_size=4, prefill_seq_lens=(16,), prefill_batch_size=2), backend
    )
    assert batched["settings"]["prefill_seq_lens"] == [16] and batched["settings"]["prefill_batch_size"] == 2
    # A 2-row batched prefill is the program it always was; 4 rows now add a 2-row one: a new key.
    assert "batched_prefill_rows" not in batched
    four = compile_params(
        CompileSettings(full_batch_size=4, prefill_seq_lens=(16,), prefill_batch_size=4), backend
    )
    assert four["batched_prefill_rows"] == [2, 4]
