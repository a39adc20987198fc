"""The traced route's ONNX: the same IO contract and custom ops as the hand-built graph, and its refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import VOCAB_SIZE, HFReference

from qaic_aot.export import export_onnx
from qaic_aot.export.families import GRAPH_ARCHITECTURES, SUPPORTED_ARCHITECTURES, export_route
from qaic_aot.export.ops import DOMAIN
from qaic_aot.export.traced.families import TRACED_FAMILIES, check_traceable
from qaic_aot.memory import dims_from_config
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

CTX = 32


def _dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_traced_onnx_keeps_the_contract(tiny_model_factory: Callable[[str], Path], tmp_path: Path) -> None:
    settings = CompileSettings(prefill_seq_len=8, ctx_len=CTX, full_batch_size=4)
    result = export_onnx(tiny_model_factory("falcon-mq"), tmp_path / "m.onnx", settings, progress=False)
    assert result.exporter == "qaic-traced"
    assert (result.num_layers, result.num_kv_heads, result.head_dim) == (2, 1, 16)  # multi-query: 1 KV head
    model = onnx.load(str(result.onnx_path))
    inputs = {v.name: _dims(v) for v in model.graph.input}
    outputs = {v.name: _dims(v) for v in model.graph.output}
    assert list(inputs) == result.input_names and list(outputs) == result.output_names
    assert inputs["input_ids"] == ["batch_size", "seq_len"]
    assert inputs["batch_index"] == ["batch_size", 1]
    assert inputs["past_key.1"] == ["full_batch_size", 1, "ctx_len", 16]
    assert outputs["past_value.0_RetainedState"] == ["full_batch_size", 1, "ctx_len", 16]
    assert outputs["logits"] == ["batch_size", 1, VOCAB_SIZE]
    custom = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    assert custom == {"CtxScatterCB", "CtxGatherCB"}
    assert {f.name for f in model.functions} == custom
    onnx.checker.check_model(model, full_check=True)


def test_traced_num_logits_to_keep_returns_the_last_k_plus_one(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("gemma2")
    settings = CompileSettings(prefill_seq_len=8, ctx_len=CTX, full_batch_size=2, num_speculative_tokens=3)
    result = export_onnx(model_dir, tmp_path / "m.onnx", settings, progress=False)
    session = ort.InferenceSession(str(result.onnx_path), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].shape == ["batch_size", "num_logits_to_keep", VOCAB_SIZE]
    tokens = [21, 22, 23, 24, 25, 26]
    shape = (2, result.num_kv_heads, CTX, result.head_dim)
    feeds = {
        "input_ids": np.array([[*tokens, 0, 0]], np.int64),
        "position_ids": np.array([[0, 1, 2, 3, 4, 5, -1, -1]], np.int64),
        "batch_index": np.array([[1]], np.int64),
        "num_logits_to_keep": np.zeros((4, 1), np.int64),
        **{n: np.zeros(shape, np.float32) for n in result.input_names if n.startswith("past_")},
    }
    logits = session.run(["logits"], feeds)[0]
    assert logits.shape == (1, 4, VOCAB_SIZE)
    np.testing.assert_allclose(logits[0], HFReference(model_dir).logits(tokens)[2:6], atol=1e-4)


def test_route_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(GRAPH_ARCHITECTURES) <= set(TRACED_FAMILIES) == set(SUPPORTED_ARCHITECTURES)
    assert export_route("LlamaForCausalLM") == "graph"
    assert export_route("GraniteForCausalLM") == "traced"
    monkeypatch.setenv("QAIC_AOT_ROUTE", "traced")
    assert export_route("LlamaForCausalLM") == "traced"
    monkeypatch.setenv("QAIC_AOT_ROUTE", "graph")
    with pytest.raises(QaicConfigError, match="no hand-built graph"):
        export_route("GraniteForCausalLM")
    monkeypatch.setenv("QAIC_AOT_ROUTE", "onnxscript")
    with pytest.raises(QaicConfigError, match="QAIC_AOT_ROUTE"):
        export_route("LlamaForCausalLM")


def test_traced_route_refuses_what_a_program_cannot_follow() -> None:
    settings = CompileSettings(prefill_seq_len=8, ctx_len=512)
    with pytest.raises(QaicConfigError, match="ALiBi"):
        check_traceable(TRACED_FAMILIES["FalconForCausalLM"], SimpleNamespace(alibi=True), settings)
    with pytest.raises(QaicConfigError, match=r"n_positions=256.*--ctx-len to at most 256"):
        check_traceable(TRACED_FAMILIES["GPTBigCodeForCausalLM"], SimpleNamespace(n_positions=256), settings)
    longrope = SimpleNamespace(
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 128}
    )
    with pytest.raises(QaicConfigError, match="original_max_position_embeddings"):
        check_traceable(TRACED_FAMILIES["Phi3ForCausalLM"], longrope, settings)
    check_traceable(TRACED_FAMILIES["MixtralForCausalLM"], SimpleNamespace(), settings)


@pytest.mark.parametrize("arch", ["falcon-mq", "gpt_bigcode", "mpt", "mixtral", "qwen2_moe"])
def test_memory_reads_traced_configs(arch: str, tiny_model_factory: Callable[[str], Path]) -> None:
    config = json.loads((tiny_model_factory(arch) / "config.json").read_text())
    dims = dims_from_config(config)
    assert dims.num_layers == 2 and dims.vocab_size == VOCAB_SIZE
    assert dims.num_kv_heads == (
        1 if arch in ("falcon-mq", "gpt_bigcode") else config.get("num_key_value_heads", 4)
    )
    assert dims.matmul_params > 0


@pytest.mark.parametrize(
    ("arch", "norms"),
    [("gemma2", 4 * 2 + 1), ("qwen3_moe", 2 * 4 + 1), ("gptj", 0)],
)
def test_traced_rms_norms_export_as_custom_rms_norm(
    arch: str, norms: int, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """Each RMSNorm module (Gemma's ``1 + w`` folded into its weight) is QEfficient's compiler-known
    ``CustomRMSNorm`` and LayerNorm stays (the parity tests show the values are transformers')."""
    from qaic_aot.export.norm_op import CUSTOM_OPS_DOMAIN, RMS_NORM

    settings = CompileSettings(prefill_seq_len=8, ctx_len=CTX, full_batch_size=2)
    result = export_onnx(tiny_model_factory(arch), tmp_path / "m.onnx", settings, progress=False)
    model = onnx.load(str(result.onnx_path))
    found = [n for n in model.graph.node if (n.domain, n.op_type) == (CUSTOM_OPS_DOMAIN, RMS_NORM)]
    assert len(found) == norms
    assert ({f.name for f in model.functions if f.domain == CUSTOM_OPS_DOMAIN} == {RMS_NORM}) == bool(norms)
    onnx.checker.check_model(model, full_check=True)


def test_only_modules_that_compute_rms_norm_are_replaced() -> None:
    """The swap checks what a module computes, not only its class name: an ``RMSNorm`` that does
    something else, or one without an epsilon, keeps its own code; Gemma's form gets ``1 + w``."""
    import torch

    from qaic_aot.export.traced.norm import CustomRMSNorm, replace_rms_norms

    class PlainRMSNorm(torch.nn.Module):
        def __init__(self, one_plus: bool) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))
            self.eps, self.one_plus = 1e-6, one_plus

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = 1.0 + self.weight if self.one_plus else self.weight
            return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class ScaledRMSNorm(PlainRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2.0 * super().forward(x)

    class NoEpsRMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x

    model = torch.nn.ModuleDict(
        {
            "plain": PlainRMSNorm(False),
            "gemma": PlainRMSNorm(True),
            "odd": ScaledRMSNorm(False),
            "bare": NoEpsRMSNorm(),
        }
    )
    x = torch.randn(2, 3, 8)
    before = {name: module(x) for name, module in model.items()}
    assert replace_rms_norms(model) == 2
    assert isinstance(model["plain"], CustomRMSNorm) and isinstance(model["gemma"], CustomRMSNorm)
    assert isinstance(model["odd"], ScaledRMSNorm) and isinstance(model["bare"], NoEpsRMSNorm)
    for name, module in model.items():
        torch.testing.assert_close(module(x), before[name], rtol=1e-5, atol=1e-5)
