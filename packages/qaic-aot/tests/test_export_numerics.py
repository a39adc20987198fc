"""Every family's exported ONNX, run directly in onnxruntime, computes what transformers computes.

This isolates the exporter from the compiler and runtime: the test feeds the retained KV state back by
hand (chunked prefill into one slot, then decode steps with other rows padded) and compares the logits
with one fp32 forward pass of the Hugging Face model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from models import TINY_ARCHS, HFReference, more_prompts

from qaic_aot.export import export_onnx
from qaic_core.settings import CompileSettings

SETTINGS = CompileSettings(prefill_seq_len=8, ctx_len=64, full_batch_size=3, convert_to_fp16=False)
ATOL = 1e-4


class OrtDecoder:
    """Runs an exported program in onnxruntime, keeping the KV cache between calls as the device would."""

    def __init__(self, onnx_path: Path) -> None:
        self.session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.cache: dict[str, np.ndarray] = {}
        for value in self.session.get_inputs():
            if value.name.startswith("past_"):
                _, heads, _, head_dim = value.shape
                shape = (SETTINGS.full_batch_size, heads, SETTINGS.ctx_len, head_dim)
                self.cache[value.name] = np.zeros(shape, np.float32)

    def run(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": ids, "position_ids": pos, "batch_index": rows[:, None], **self.cache}
        out = dict(zip(self.outputs, self.session.run(self.outputs, feeds), strict=True))
        self.cache = {name: out[f"{name}_RetainedState"] for name in self.cache}
        return out["logits"][:, 0]

    def prefill(self, slot: int, tokens: list[int]) -> np.ndarray:
        step = SETTINGS.prefill_seq_len
        logits = np.empty(0)
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            ids = np.zeros((1, step), np.int64)
            pos = np.full((1, step), -1, np.int64)
            ids[0, : len(chunk)] = chunk
            pos[0, : len(chunk)] = np.arange(start, start + len(chunk))
            logits = self.run(ids, pos, np.array([slot]))[0]
        return logits


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_exported_onnx_matches_transformers(
    arch: str, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(arch)
    ref = HFReference(model_dir)
    long_prompt, short_prompt = more_prompts(ref.tokenizer)[3], more_prompts(ref.tokenizer)[0]
    # Continue each prompt with fixed tokens: teacher forcing needs no generation.
    long_tokens = [*long_prompt, 17, 200, 5, 31]
    short_tokens = [*short_prompt, 44, 45, 46, 47]
    long_ref, short_ref = ref.logits(long_tokens), ref.logits(short_tokens)

    result = export_onnx(model_dir, tmp_path / "model.onnx", SETTINGS, progress=False)
    decoder = OrtDecoder(result.onnx_path)
    np.testing.assert_allclose(decoder.prefill(2, long_prompt), long_ref[len(long_prompt) - 1], atol=ATOL)
    np.testing.assert_allclose(decoder.prefill(0, short_prompt), short_ref[len(short_prompt) - 1], atol=ATOL)
    for step in range(4):
        p_long, p_short = len(long_prompt) + step, len(short_prompt) + step
        ids = np.array([[short_tokens[p_short]], [0], [long_tokens[p_long]]], np.int64)
        pos = np.array([[p_short], [-1], [p_long]], np.int64)  # row 1 is an unused slot
        logits = decoder.run(ids, pos, np.arange(3))
        np.testing.assert_allclose(logits[2], long_ref[p_long], atol=ATOL)
        np.testing.assert_allclose(logits[0], short_ref[p_short], atol=ATOL)
    assert not decoder.cache["past_key.0"][1].any()  # the unused slot was never written


def test_mistral_reference_depends_on_its_sliding_window(tiny_model_factory: Callable[[str], Path]) -> None:
    """The Mistral parity above exercises the window: without it transformers' logits change."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("mistral")
    ref = HFReference(model_dir)
    window = ref.model.config.sliding_window
    tokens = more_prompts(ref.tokenizer)[3]
    assert len(tokens) > 2 * window
    unwindowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, sliding_window=None)
    with torch.no_grad():
        full = unwindowed(torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(full[-1] - ref.logits(tokens)[-1]).max() > 1e-2


ROPE_VARIANTS = {
    # Older config.json files spell rope settings as rope_scaling; transformers converts them.
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "phi3-partial": (
        "phi3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants(variant: str, tiny_model_factory: Callable[[str], Path], tmp_path: Path) -> None:
    arch, changes = ROPE_VARIANTS[variant]
    base = tiny_model_factory(arch)
    model_dir = tmp_path / variant
    shutil.copytree(base, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if "rope_scaling" in changes:
        config.pop("rope_parameters", None)
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    ref = HFReference(model_dir)
    tokens = more_prompts(ref.tokenizer)[3]
    expected = ref.logits(tokens)
    if variant != "llama-dynamic":  # the change reaches the reference (dynamic only acts past max)
        assert np.abs(expected - HFReference(base).logits(tokens)).max() > 1e-3
    result = export_onnx(model_dir, tmp_path / "model.onnx", SETTINGS, progress=False)
    decoder = OrtDecoder(result.onnx_path)
    np.testing.assert_allclose(decoder.prefill(1, tokens[:-1]), expected[-2], atol=ATOL)
    ids, pos = np.array([[0], [tokens[-1]], [0]]), np.array([[-1], [len(tokens) - 1], [-1]])
    np.testing.assert_allclose(decoder.run(ids, pos, np.arange(3))[1], expected[-1], atol=ATOL)


def test_large_graphs_keep_weights_in_an_external_file(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qaic_aot.export import onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    result = export_onnx(tiny_llama, tmp_path / "model.onnx", SETTINGS, progress=False)
    data = tmp_path / "model.onnx.data"
    assert data.stat().st_size > result.onnx_path.stat().st_size
    tokens = [9, 8, 7, 6, 5]
    np.testing.assert_allclose(
        OrtDecoder(result.onnx_path).prefill(0, tokens), HFReference(tiny_llama).logits(tokens)[-1], atol=ATOL
    )


def _write_layout(layout: str, source: Path, target: Path) -> None:
    """Re-save a tiny checkpoint in another on-disk layout found on the hub."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(source / "model.safetensors"))
    if (
        layout == "unprefixed"
    ):  # original GPT-2 checkpoints name tensors "h.0..." rather than "transformer.h.0..."
        save_file(
            {k.removeprefix("transformer."): v for k, v in tensors.items()}, str(target / "model.safetensors")
        )
    elif layout == "sharded":
        names = sorted(tensors)
        shards = {
            "model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2],
        }
        weight_map = {}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(target / shard))
            weight_map.update(dict.fromkeys(keys, shard))
        index = {"metadata": {}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    else:  # a bf16 pytorch_model.bin
        torch.save({k: v.to(torch.bfloat16) for k, v in tensors.items()}, target / "pytorch_model.bin")


@pytest.mark.parametrize(
    ("arch", "layout"), [("gpt2", "unprefixed"), ("qwen2", "sharded"), ("llama", "torch-bf16")]
)
def test_checkpoint_layouts(
    arch: str, layout: str, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    source = tiny_model_factory(arch)
    target = tmp_path / layout
    _write_layout(layout, source, target)
    ref = HFReference(source)
    tokens = more_prompts(ref.tokenizer)[1]
    expected = ref.logits(tokens)[-1]
    result = export_onnx(target, tmp_path / "model.onnx", SETTINGS, progress=False)
    got = OrtDecoder(result.onnx_path).prefill(0, tokens)
    # bf16 weights round the model (about 3 significant digits); the others are exact copies.
    np.testing.assert_allclose(got, expected, atol=0.1 if layout == "torch-bf16" else ATOL)
    if layout == "torch-bf16":
        assert np.abs(got - expected).max() > ATOL  # the bf16 weights were really read
