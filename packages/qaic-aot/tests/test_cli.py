"""The ``qaic-aot`` command, run as a real process on a tiny model."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qaic_aot.cli import build_parser, main, settings_from_args
from qaic_core.settings import SETTINGS, CompileSettings

FLAGS = ["--ctx-len", "64", "--prefill-seq-len", "8", "--full-batch-size", "2", "--num-cores", "1", "--fp32"]
PROMPTS = ["Hello world!", "Once upon a time there was a small decoder that predicted"]


def qaic_aot(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QEFF_HOME": str(home), "QAIC_BACKEND": os.environ.get("QAIC_BACKEND", "sim")}
    # The installed console script when there is one (it proves the entry point), else the module.
    script = Path(sys.executable).parent / "qaic-aot"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "qaic_aot.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=600)


def test_compile_then_generate_reuses_the_program(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home = tmp_path / "home"
    compiled = qaic_aot("compile", str(tiny_llama), *FLAGS, "--no-progress", home=home)
    assert compiled.returncode == 0, compiled.stderr
    qpc = Path(compiled.stdout.strip())
    assert qpc.parent.parent.parent == home and (qpc / "qpc" / "programqpc.bin").is_file()
    program_mtime = (qpc / "qpc" / "programqpc.bin").stat().st_mtime_ns

    args = ["generate", str(tiny_llama), *FLAGS, "--generation-len", "5", "--json", "-v"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    generated = qaic_aot(*args, home=home)
    assert generated.returncode == 0, generated.stderr
    assert "reusing compiled program" in generated.stderr
    assert (qpc / "qpc" / "programqpc.bin").stat().st_mtime_ns == program_mtime
    results = json.loads(generated.stdout)

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = hf.generate(
                ids, max_new_tokens=5, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0
            )
        expected = ref[0, ids.shape[1] :].tolist()
        assert result["prompt"] == prompt
        assert result["token_ids"] == expected
        assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)

    # The same program given by path is checked against the model and reused as is (in process).
    monkeypatch.setenv("QEFF_HOME", str(tmp_path / "unused"))
    assert main([*args, "--qpc-path", str(qpc)]) == 0
    assert [r["token_ids"] for r in json.loads(capsys.readouterr().out)] == [r["token_ids"] for r in results]
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compile", "{missing}"], "does not exist"),
        (["compile", "{empty}"], "config.json is missing"),
        (["generate", "{model}", "--prompt", "hi", "--generation-len", "100", *FLAGS], "--ctx-len"),
        (["compile", "{model}", "--ctx-len", "8", "--prefill-seq-len", "16"], "--prefill-seq-len"),
    ],
)
def test_errors_name_the_problem(
    tiny_llama: Path,
    tmp_path: Path,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("QEFF_HOME", str(tmp_path / "home"))
    (tmp_path / "empty").mkdir()
    paths = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty"), "model": str(tiny_llama)}
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qaic-aot: error: ") and message in err
    # Nothing was exported or compiled for a refused command.
    assert not (tmp_path / "home").exists()


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_every_compile_setting_is_a_flag_described_by_the_settings_table() -> None:
    for command in ("compile", "generate"):
        actions = {opt: a for a in _subparser(command)._actions for opt in a.option_strings}
        for name, spec in SETTINGS.items():
            if spec.flag is None:
                assert not spec.override, name  # only a setting vLLM fixes itself may lack a flag
                continue
            action = actions[spec.flag]
            assert action.dest == name and action.help is not None
            assert action.help.startswith(spec.help) and action.default == spec.default
            if spec.off_flag:
                assert actions[spec.off_flag].dest == name
    assert settings_from_args(build_parser().parse_args(["compile", "m"])) == CompileSettings()
    out = io.StringIO()
    _subparser("compile").print_help(out)
    shown = " ".join(out.getvalue().split())
    for flag, default in (("--ctx-len", 128), ("--prefill-seq-len", 32), ("--num-cores", 16)):
        assert flag in shown and f"(default {default})" in shown


def test_bad_values_on_the_command_line_read_like_other_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QEFF_HOME", str(tmp_path / "home"))
    assert main(["compile", str(tmp_path), "--mos", "two"]) == 2
    assert "qaic-aot: error: --mos='two' is not an integer: give a whole number" in capsys.readouterr().err
    assert main(["compile", str(tmp_path), "--device-group", "0,a", "--num-devices", "2"]) == 2
    assert "--device-group '0,a' is not a list of device ids" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()
