"""Device memory as the compiler counts it, the shapes that fit each SKU, and the advice a refusal carries."""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from qaic_aot import memory
from qaic_aot.compile import compile_model
from qaic_aot.session import QAICInferenceSession
from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.resources import DeviceResources
from qaic_core.settings import CompileSettings
from qaic_core.types import SKUS, QStatus

LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


def _sim_only() -> None:
    if get_plugin_manager().select_device_backend().name != "sim":
        pytest.skip("compares with the simulator's own accounting")


def _sku_devices(sku: str, count: int = 1) -> list[DeviceResources]:
    spec = next(s for s in SKUS.values() if s.sku.value == sku)
    mb = spec.dram_mb_per_soc
    return [DeviceResources(q, spec.nsp_per_soc, spec.nsp_per_soc, mb, mb, sku) for q in range(count)]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"mxfp6": True, "mxint8": True, "full_batch_size": 8, "ctx_len": 128, "prefill_seq_len": 64},
        {"convert_to_fp16": False, "full_batch_size": 2, "ctx_len": 256},
        {"num_speculative_tokens": 3},
        {"num_devices": 2, "device_group": (0, 1)},
    ],
)
def test_the_estimate_is_what_the_simulated_compiler_counts(
    tiny_llama: Path, tmp_path: Path, changes: dict[str, object]
) -> None:
    _sim_only()
    from qaic_sim.qpcfile import read_manifest

    values: dict[str, object] = {"prefill_seq_len": 32, "ctx_len": 128, "full_batch_size": 4, **changes}
    settings = CompileSettings(**values)  # type: ignore[arg-type]
    qpc = compile_model(tiny_llama, settings, progress=False, qeff_home=tmp_path)
    manifest, _ = read_manifest(qpc / "qpc")
    estimate = memory.program_memory(memory.model_dims(tiny_llama), settings)
    assert estimate.retained == manifest.retained_bytes
    assert estimate.activations == manifest.activation_bytes
    assert 0 <= estimate.weights - manifest.weights_bytes <= memory.CONSTANT_SLACK
    assert estimate.per_device >= -(-manifest.dram_bytes // settings.num_devices)
    # A cached program's record gives the same figure (what the load-failure advice uses).
    recorded = memory.recorded_settings(qpc / "qpc")
    assert recorded is not None and recorded[0] == settings.replace(device_group=None)  # chosen at load time
    assert memory.program_memory(memory.dims_from_config(recorded[1]), settings).total == estimate.total


def test_config_counts_match_the_weight_files(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    for arch in ("llama", "llama3", "qwen2", "qwen3", "phi3", "gemma", "gpt2", "mistral"):
        model = tiny_model_factory(arch)
        config = json.loads((model / "config.json").read_text())
        from_files = memory.model_dims(model)
        from_config = memory.dims_from_config(config)
        assert from_config.matmul_params == from_files.matmul_params, arch
        assert from_config.other_params == from_files.other_params, arch


@pytest.mark.parametrize("sku", ["standard", "pro", "ultra", "ai080-ultra"])
def test_the_chosen_shape_fits_each_sku(sku: str) -> None:
    dims = memory.dims_from_config(LLAMA_2_7B)
    devices = _sku_devices(sku)
    base = CompileSettings(prefill_seq_len=128, ctx_len=4096, full_batch_size=1)
    choice = memory.choose_shape(dims, base, devices, batch=None, ctx=None)
    chosen = memory.with_shape(base, choice.batch, choice.ctx)
    budget = memory.budget_of(devices)
    assert memory.program_memory(dims, chosen).per_device <= budget * (1 - memory.AUTO_HEADROOM)
    assert 1 <= choice.batch <= memory.AUTO_MAX_BATCH and 128 <= choice.ctx <= 4096
    assert choice.reason and sku in choice.reason
    if choice.batch < memory.AUTO_MAX_BATCH:  # the most that fit: one more does not
        bigger = memory.with_shape(base, choice.batch + 1, choice.ctx)
        assert memory.program_memory(dims, bigger).per_device > budget * (1 - memory.AUTO_HEADROOM)


def test_a_16gb_card_gets_a_shorter_context_than_a_32gb_one() -> None:
    dims = memory.dims_from_config(LLAMA_2_7B)
    base = CompileSettings(prefill_seq_len=128, ctx_len=4096, full_batch_size=1)
    std = memory.choose_shape(dims, base, _sku_devices("standard"), batch=None, ctx=None)
    pro = memory.choose_shape(dims, base, _sku_devices("pro"), batch=None, ctx=None)
    assert (std.ctx, std.batch) < (pro.ctx, pro.batch) or std.ctx < pro.ctx
    four = memory.choose_shape(
        dims, base.replace(num_devices=4), _sku_devices("ultra", 4), batch=None, ctx=None
    )
    assert four.ctx == 4096 and four.batch == memory.AUTO_MAX_BATCH  # a whole Ultra card holds it all


def test_a_request_too_large_names_the_largest_that_fit() -> None:
    dims = memory.dims_from_config(LLAMA_2_7B)
    devices = _sku_devices("pro")
    asked = CompileSettings(prefill_seq_len=128, ctx_len=4096, full_batch_size=64)
    budget = memory.budget_of(devices)
    assert not memory.fits(dims, asked, budget)
    message = memory.too_large(dims, asked, devices)
    b = memory.largest_batch(dims, asked, budget)
    c = memory.largest_ctx(dims, asked, budget)
    assert f"--max-num-seqs {b} at --max-model-len 4096" in message
    assert f"--max-model-len {c} at --max-num-seqs 64" in message
    assert memory.fits(dims, memory.with_shape(asked, b, 4096), budget)
    assert not memory.fits(dims, memory.with_shape(asked, b + 1, 4096), budget)
    assert memory.fits(dims, memory.with_shape(asked, 64, c), budget)
    with pytest.raises(QaicConfigError, match="mxfp6"):
        memory.choose_shape(dims, asked, _sku_devices("standard"), batch=64, ctx=4096)


# -- the advice a refused load or activation carries, the same on every backend --------------------
@pytest.fixture
def ai080_machine() -> Iterator[None]:
    _sim_only()
    from qaic_core.types import SkuType
    from qaic_sim.config import SimConfig
    from qaic_sim.machine import SimMachine, reset_machine

    reset_machine(SimMachine(SimConfig(cards=(SkuType.AI080_ULTRA,))))
    yield
    reset_machine()


def _bare(backend):  # type: ignore[no-untyped-def]
    """The backend as a real card answers: a status without the simulator's explanation."""
    rt = backend.runtime()

    class BareProgram:
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self._program = rt.Program(*args, **kwargs)

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            if name == "lastError":
                raise AttributeError(name)
            return getattr(self._program, name)

    module = types.SimpleNamespace(**{k: getattr(rt, k) for k in dir(rt) if not k.startswith("__")})
    module.Program = BareProgram
    return dataclasses.replace(backend, name="bare", runtime=lambda: module)


def test_too_few_cores_reads_the_same_on_a_bare_runtime(
    tiny_llama: Path, tmp_path: Path, ai080_machine: None
) -> None:
    settings = CompileSettings(prefill_seq_len=32, ctx_len=128, full_batch_size=2, num_cores=16)
    qpc = compile_model(tiny_llama, settings, progress=False, qeff_home=tmp_path)
    sim = get_plugin_manager().select_device_backend()
    messages = []
    for backend in (sim, _bare(sim)):
        with pytest.raises(QaicRuntimeError) as info:
            QAICInferenceSession(qpc, backend=backend)
        assert info.value.status == QStatus.NOSPC
        messages.append(str(info.value))
    advice = (
        "the program was compiled for 16 NSP cores but QID 0 has 8 of 8 NSP cores free: compile with num_cores=8 "
        '(vLLM: --additional-config \'{"override_qaic_config": {"num_cores": 8}}\' or VLLM_QAIC_NUM_CORES=8; '
        "qaic-aot: --num-cores 8)"
    )
    assert messages[1].startswith("Program.activate failed with status NOSPC (7); " + advice)
    assert "not enough NSP cores on QID 0" in messages[0]  # the simulator's own words come first
    assert messages[0].endswith(messages[1].split("; ", 1)[1])


def test_a_failed_load_names_the_memory_settings(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sim_only()
    from qaic_sim.machine import reset_machine

    settings = CompileSettings(prefill_seq_len=32, ctx_len=128, full_batch_size=2, num_cores=4)
    qpc = compile_model(tiny_llama, settings, progress=False, qeff_home=tmp_path)
    monkeypatch.setenv("QAIC_SIM_FAULTS", "nomem@0:load=1")
    reset_machine()
    try:
        with pytest.raises(QaicRuntimeError) as info:
            QAICInferenceSession(qpc)
    finally:
        monkeypatch.delenv("QAIC_SIM_FAULTS")
        reset_machine()
    text = str(info.value)
    assert info.value.status == QStatus.NOMEM
    assert "the program needs 0 MB on each device but QID 0 has" in text
    assert "lower --max-num-seqs (full_batch_size) or --max-model-len (ctx_len)" in text
    assert "--quantization mxfp6 and --kv-cache-dtype mxint8" in text
