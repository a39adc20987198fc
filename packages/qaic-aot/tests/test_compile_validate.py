"""validate_qpc: a prebuilt program checked against the model and the serving settings."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from qaic_aot import compile_model, validate_qpc
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

SETTINGS = CompileSettings(prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1)


@pytest.fixture(scope="module")
def llama_qpc(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_model(tiny_llama, SETTINGS, qeff_home=tmp_path_factory.mktemp("qeff"), progress=False)


def test_matching_program_passes(llama_qpc: Path, tiny_llama: Path) -> None:
    validate_qpc(llama_qpc, tiny_llama, SETTINGS)
    validate_qpc(llama_qpc / "qpc", tiny_llama, SETTINGS)


def test_every_setting_mismatch_is_named_with_its_flag(llama_qpc: Path, tiny_llama: Path) -> None:
    wrong = SETTINGS.replace(ctx_len=128, prefill_seq_len=16, full_batch_size=4)
    with pytest.raises(QaicConfigError) as err:
        validate_qpc(llama_qpc, tiny_llama, wrong)
    message = str(err.value)
    assert "ctx_len: program [64], requested 128" in message and "--ctx-len" in message
    assert "prefill_seq_len: program [8], requested 16" in message and "--prefill-seq-len" in message
    assert "full_batch_size: program [2], requested 4" in message and "--full-batch-size" in message


def test_a_program_without_speculative_decode_is_refused(llama_qpc: Path, tiny_llama: Path) -> None:
    with pytest.raises(QaicConfigError, match="--num-speculative-tokens 3"):
        validate_qpc(llama_qpc, tiny_llama, SETTINGS.replace(num_speculative_tokens=3))


def test_another_models_program_is_refused(
    llama_qpc: Path, tiny_model_factory: Callable[[str], Path]
) -> None:
    # The tiny GPT-2 has the same vocabulary, layers and head_dim but 4 KV heads instead of 2.
    with pytest.raises(QaicConfigError, match=r"KV heads: program 2, model 4") as err:
        validate_qpc(llama_qpc, tiny_model_factory("gpt2"), SETTINGS)
    assert "vocabulary" not in str(err.value) and "ctx_len" not in str(err.value)


def test_missing_program_is_named(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(QaicConfigError, match=r"programqpc\.bin is missing"):
        validate_qpc(tmp_path, tiny_llama, SETTINGS)


def test_without_specializations_json_the_allowed_shapes_are_used(
    llama_qpc: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    program = shutil.copytree(llama_qpc / "qpc", tmp_path / "program-only")
    assert not (program / "specializations.json").exists()
    validate_qpc(program, tiny_llama, SETTINGS)
    with pytest.raises(QaicConfigError) as err:
        validate_qpc(
            program, tiny_llama, SETTINGS.replace(ctx_len=128, prefill_seq_len=16, full_batch_size=4)
        )
    message = str(err.value)
    assert "ctx_len: program [64], requested 128" in message
    assert "prefill_seq_len: program [8], requested 16" in message
    assert "full_batch_size: program [2], requested 4" in message
