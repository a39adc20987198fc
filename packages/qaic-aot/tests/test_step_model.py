"""The ``aot`` execution path through qaic-core's contract: a StepModel that moves a slot's KV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import sample_prompts

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError
from qaic_core.execution import OVERLAP, SLOT_KV_TRANSFER, ExecutionConfig, SlotKV, StepModel
from qaic_core.settings import CompileSettings

SETTINGS = CompileSettings(
    prefill_seq_len=8, ctx_len=64, full_batch_size=3, num_cores=1, convert_to_fp16=False
)


@pytest.fixture(scope="module")
def model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StepModel]:
    pm = get_plugin_manager()
    config = ExecutionConfig(
        model_dir=tiny_llama, settings=SETTINGS, device=pm.select_device_backend(), progress=False
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QEFF_HOME", str(tmp_path_factory.mktemp("qeff")))
        opened = pm.select_execution_path("aot").open(config)
    assert isinstance(opened, StepModel)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def prompt(tiny_llama: Path) -> list[int]:
    from transformers import AutoTokenizer

    return sample_prompts(AutoTokenizer.from_pretrained(str(tiny_llama)))[3]


@pytest.fixture(scope="module")
def hf_next(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    def next_logits(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0, -1].numpy()

    return next_logits


def _prefill(model: StepModel, slot: int, tokens: list[int]) -> np.ndarray:
    chunk = model.shape.prefill_seq_len
    logits = None
    for start in range(0, len(tokens), chunk):
        logits = model.submit_prefill_chunk(slot, tokens[start : start + chunk], start).wait()
    assert logits is not None
    return logits


def test_the_shape_and_capabilities_come_from_the_program(model: StepModel) -> None:
    assert model.shape.num_slots == 3 and model.shape.ctx_len == 64 and model.shape.prefill_seq_len == 8
    assert {OVERLAP, SLOT_KV_TRANSFER} <= model.capabilities


def test_a_slot_moved_to_another_decodes_as_the_original(
    model: StepModel, prompt: list[int], hf_next: Any
) -> None:
    assert len(prompt) > model.shape.prefill_seq_len  # several chunks
    first = _prefill(model, 0, prompt)
    np.testing.assert_allclose(first, hf_next(prompt), rtol=1e-4, atol=1e-4)
    token = int(np.argmax(first))
    kv = model.read_slot_kv(0, len(prompt))
    assert kv.num_tokens == len(prompt) and kv.dtype == "float32"
    assert kv.tensors["past_key.0"].shape[2] == len(prompt)
    model.write_slot_kv(2, kv)
    again = model.read_slot_kv(2, len(prompt))
    for name, value in kv.tensors.items():
        np.testing.assert_array_equal(again.tensors[name], value)
    rows = model.submit_decode({0: (token, len(prompt)), 2: (token, len(prompt))}).wait()
    np.testing.assert_allclose(rows[2], rows[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows[2], hf_next([*prompt, token]), rtol=1e-4, atol=1e-4)


def test_a_mismatched_kv_cache_is_refused_with_the_fix(model: StepModel, prompt: list[int]) -> None:
    kv = model.read_slot_kv(0, 4)
    with pytest.raises(QaicConfigError, match="mxint8 but this program keeps float32"):
        model.write_slot_kv(1, SlotKV(kv.num_tokens, kv.tensors, "mxint8"))
    short = {name: value[:, :, :2] for name, value in kv.tensors.items()}
    with pytest.raises(QaicConfigError, match="same model"):
        model.write_slot_kv(1, SlotKV(4, short, "float32"))
    with pytest.raises(QaicConfigError, match="full-batch-size"):
        model.read_slot_kv(3, 4)


def test_a_decode_prepared_before_its_tokens_are_known_equals_transformers(
    model: StepModel, prompt: list[int], hf_next: Any
) -> None:
    first = _prefill(model, 1, prompt)
    token = int(np.argmax(first))
    # Built while another run is in flight on the decode's exec object: a prepared run holds none.
    other = model.submit_decode({0: (token, 3)})
    prepared = model.prepare_decode({1: len(prompt)})
    other.wait()
    rows = prepared.submit([token]).wait()
    assert list(rows) == [1]
    np.testing.assert_allclose(rows[1], hf_next([*prompt, token]), rtol=1e-4, atol=1e-4)
    with pytest.raises(QaicConfigError, match="give one per slot"):
        model.prepare_decode({1: len(prompt) + 1}).submit([token, token])
    with pytest.raises(QaicConfigError, match="ctx_len"):
        model.prepare_decode({1: model.shape.ctx_len})
