"""The timing model: hardware figures, the roofline arithmetic, decoder costs and monotone behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from qaic_core.types import SkuType
from qaic_sim import timing
from qaic_sim.fidelity import MODELS
from qaic_sim.timing import DecoderShape, HardwareModel, ProgramCost, decode_tokens_per_s, device_time_s

LLAMA_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def test_device_group_figures() -> None:
    ultra = HardwareModel.for_device_group(SkuType.ULTRA, num_devices=4)
    assert ultra.ddr_bytes_per_s == pytest.approx(548e9)
    assert ultra.peak_flops == pytest.approx(290e12) and ultra.peak_int8_ops == pytest.approx(870e12)
    one_soc = HardwareModel.for_device_group("ultra")
    assert one_soc.ddr_bytes_per_s == pytest.approx(137e9) and one_soc.peak_flops == pytest.approx(290e12 / 4)
    std14 = HardwareModel.for_device_group(SkuType.STANDARD, num_cores=14)
    assert std14.peak_flops == pytest.approx(110e12 * 14 / 16) and std14.ddr_bytes_per_s == pytest.approx(
        137e9
    )
    assert HardwareModel.for_device_group(SkuType.AI080_ULTRA, num_cores=None).num_cores == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sku": "standard", "num_cores": 17}, "set num_cores between 1 and 16"),
        ({"sku": SkuType.AI080_ULTRA, "num_cores": 16}, "set num_cores between 1 and 8"),
        ({"sku": "standard", "num_devices": 0}, "num_devices must be a positive integer"),
        ({"sku": "ultra-max"}, "unknown SKU 'ultra-max'"),
    ],
)
def test_bad_device_group_is_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HardwareModel.for_device_group(**kwargs)


def test_roofline_arithmetic() -> None:
    hw = HardwareModel.for_device_group(SkuType.STANDARD)
    bw = 137e9 * timing.BANDWIDTH_EFFICIENCY
    memory_only = ProgramCost(flops=0.0, weight_bytes=1e9)
    assert device_time_s(memory_only, hw) == pytest.approx(1e9 / bw)
    rows = 512
    compute_only = ProgramCost(flops=1e12, weight_bytes=0.0, tokens=rows)
    half = 1 / timing.BATCH1_COMPUTE_EFFICIENCY - 1
    assert device_time_s(compute_only, hw) == pytest.approx(1e12 / (110e12 * rows / (rows + half)))
    both = dataclasses.replace(compute_only, weight_bytes=1e9)
    assert device_time_s(both, hw) == pytest.approx(
        max(device_time_s(memory_only, hw), device_time_s(compute_only, hw))
    )
    assert hw.compute_utilisation(1) == pytest.approx(timing.BATCH1_COMPUTE_EFFICIENCY)
    # Collectives cost only across devices: ring all-reduce sends 2(n-1)/n of the payload over PCIe.
    sliced = ProgramCost(
        flops=0.0, weight_bytes=0.0, allreduces=10, allreduce_bytes=1e6, activation_bytes=1e3
    )
    assert device_time_s(sliced, hw) == pytest.approx(1e3 / timing.PCIE_GEN4_X8_BYTES_PER_S)
    four = HardwareModel.for_device_group(SkuType.ULTRA, num_devices=4)
    assert device_time_s(sliced, four) == pytest.approx((1e3 + 1e6 * 1.5) / timing.PCIE_GEN4_X8_BYTES_PER_S)


def test_decoder_parameter_counts_match_published_totals() -> None:
    """fp16 storage / 2 is the model's published parameter count (GQA included for 70B)."""
    for config, params in [(MODELS["Llama-2-7B"], 6_738_415_616), (LLAMA_70B, 68_976_648_192)]:
        cost = ProgramCost.for_decoder(config, batch=1, seq_len=1, ctx_len=4096)
        assert cost.weight_storage_bytes == 2 * params


def test_decode_cost_hand_computed() -> None:
    cost = ProgramCost.for_decoder(MODELS["Llama-2-7B"], batch=1, seq_len=1, ctx_len=2048)
    assert cost.kv_read_bytes == 2 * 32 * 4096 * 2 * 2048 == 2**30  # K and V, 32 layers, fp16, whole window
    assert cost.kv_write_bytes == 2 * 32 * 4096 * 2
    matmul = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 4096 * 32000
    assert cost.flops == 2 * matmul + 32 * 4 * 4096 * 2048
    assert cost.weight_bytes == 2 * matmul + 2 * (32 * 2 * 4096 + 4096 + 4096)  # norms and one embedding row
    mx = ProgramCost.for_decoder(
        MODELS["Llama-2-7B"], batch=1, seq_len=1, ctx_len=2048, weight_precision="mxfp6"
    )
    assert mx.weight_bytes == pytest.approx(0.78125 * matmul + 2 * (32 * 2 * 4096 + 2 * 4096))
    gqa = ProgramCost.for_decoder(LLAMA_70B, batch=4, seq_len=1, ctx_len=1024, kv_precision="mxint8")
    assert gqa.kv_read_bytes == pytest.approx(4 * 1024 * 2 * 80 * 8 * 128 * 1.03125)


def test_hf_config_objects_read_like_dicts() -> None:
    transformers = pytest.importorskip("transformers")
    gptj = DecoderShape.from_config(transformers.GPTJConfig())
    assert gptj == DecoderShape.from_config(MODELS["GPT-J-6B"])
    assert not gptj.gated_mlp and gptj.intermediate_size == 4 * 4096 and gptj.mlp_bias
    opt = DecoderShape.from_config(
        transformers.OPTConfig(hidden_size=2560, ffn_dim=10240, num_attention_heads=32, num_hidden_layers=32)
    )
    assert opt == DecoderShape.from_config(MODELS["OPT-2.7B"])
    llama = DecoderShape.from_config(
        transformers.LlamaConfig(**{k: v for k, v in LLAMA_70B.items() if k != "model_type"})
    )
    assert llama.gated_mlp and llama.num_kv_heads == 8 and llama.head_dim == 128


def test_moe_reads_only_routed_experts() -> None:
    moe = {**MODELS["Llama-2-7B"], "num_local_experts": 8, "num_experts_per_tok": 2}
    one = ProgramCost.for_decoder(moe, batch=1, seq_len=1, ctx_len=128)
    many = ProgramCost.for_decoder(moe, batch=8, seq_len=1, ctx_len=128)
    expert = 3 * 4096 * 11008 * 2
    assert many.weight_bytes - one.weight_bytes == pytest.approx(32 * 6 * expert + 7 * 4096 * 2)
    assert one.weight_storage_bytes - one.weight_bytes == pytest.approx(32 * 6 * expert + 31999 * 4096 * 2)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="seq_len 64 exceeds ctx_len 32"):
        ProgramCost.for_decoder(MODELS["OPT-2.7B"], batch=1, seq_len=64, ctx_len=32)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        ProgramCost.for_decoder(MODELS["OPT-2.7B"], batch=0, seq_len=1, ctx_len=32)
    with pytest.raises(ValueError, match="lacks num_hidden_layers"):
        ProgramCost.for_decoder(
            {"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10}, batch=1, seq_len=1, ctx_len=8
        )
    with pytest.raises(ValueError, match="exceeds ctx_len 2048; compile a longer ctx_len"):
        decode_tokens_per_s(MODELS["OPT-2.7B"], sku="standard", ctx_len=2048, prompt_len=1024, gen_len=1025)


def _tok_s(model: str = "Llama-2-7B", **overrides: object) -> float:
    kwargs: dict = {"sku": "standard", "ctx_len": 2048, "prompt_len": 1024, "gen_len": 1024} | overrides
    return decode_tokens_per_s(MODELS[model], **kwargs)


def test_decode_rate_is_the_decode_program_rate() -> None:
    hw = HardwareModel.for_device_group(SkuType.STANDARD)
    step = device_time_s(ProgramCost.for_decoder(MODELS["Llama-2-7B"], batch=4, seq_len=1, ctx_len=2048), hw)
    assert _tok_s(batch=4) == pytest.approx(4 / step)


def test_monotone_in_sensible_ways() -> None:
    hw = HardwareModel.for_device_group(SkuType.STANDARD)
    faster_ddr = dataclasses.replace(hw, ddr_bytes_per_s=2 * hw.ddr_bytes_per_s)
    more_flops = dataclasses.replace(hw, peak_flops=2 * hw.peak_flops)
    for model in MODELS:
        fp16, mx = _tok_s(model), _tok_s(model, weight_precision="mxfp6")
        assert mx > fp16  # fewer weight bytes per token
        assert _tok_s(model, hardware=faster_ddr) > fp16  # fp16 decode is DDR-bound
        assert _tok_s(model, hardware=more_flops) >= fp16
        assert _tok_s(model, weight_precision="mxfp6", hardware=more_flops) >= mx
        assert _tok_s(model, sku="ultra", num_devices=4) > _tok_s(model, sku="ultra", num_devices=2) > fp16
        assert _tok_s(model, kv_precision="mxint8") >= fp16
        assert _tok_s(model, batch=8) > fp16  # throughput grows with batch
        assert _tok_s(model, ctx_len=4096) < fp16  # a longer static window is read every step


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    hw = HardwareModel.for_device_group(SkuType.STANDARD)
    prefill = timing.device_breakdown(
        ProgramCost.for_decoder(MODELS["Llama-2-7B"], batch=1, seq_len=1024, ctx_len=2048), hw
    )
    decode = timing.device_breakdown(
        ProgramCost.for_decoder(MODELS["Llama-2-7B"], batch=1, seq_len=1, ctx_len=2048), hw
    )
    assert prefill.compute_s > prefill.memory_s and decode.memory_s > decode.compute_s
    assert 0.1 < prefill.total_s < 2.0  # 14 TFLOP at a large share of 110 TF


def test_a_program_is_timed_on_its_own_cores() -> None:
    """A 1B draft decoding on 6 of a SoC's 16 cores is modelled slower than on all 16."""
    cost = ProgramCost.for_decoder(_llama_1b_config(), batch=1, seq_len=1, ctx_len=2048)
    times = {
        cores: device_time_s(cost, HardwareModel.for_device_group(SkuType.ULTRA, 1, cores))
        for cores in (6, 10, 16)
    }
    assert times[6] > times[10] > times[16]


def _llama_1b_config() -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }


def test_pace_as_can_name_a_model_per_program() -> None:
    from qaic_core.errors import QaicConfigError
    from qaic_sim.config import pace_as_entries, pace_as_for

    value = "target=llama-3.1-8b, draft=llama-3.2-1b"
    assert pace_as_for(value, "/cache/LlamaForCausalLM/tiny-target-1a2b/qpc-3c4d/qpc") == "llama-3.1-8b"
    assert pace_as_for(value, "/cache/LlamaForCausalLM/tiny-draft-1a2b/qpc-3c4d/qpc") == "llama-3.2-1b"
    assert pace_as_for(value, "/cache/other/qpc") is None
    assert pace_as_for("qwen2.5-0.5b,draft=llama-3.2-1b", "/x/other/qpc") == "qwen2.5-0.5b"
    assert pace_as_for("llama-2-7b", "/anything") == "llama-2-7b"
    assert pace_as_entries("llama-2-7b") == {"": "llama-2-7b"}
    with pytest.raises(QaicConfigError, match="MATCH=model"):
        pace_as_entries("=llama-2-7b")
