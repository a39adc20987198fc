"""Compute-context lengths on both export routes: exported, honoured by the program, charged by the simulator.

Granite is traced; Llama, Mistral and GPT-2 take the hand-built graph. The program gets QEfficient's
``comp_ctx_lengths`` input; a run reads only as many KV positions as that input is long. Compiled with one prefill and one decode specialization per length (QEfficient's
CCL layout), a chunked prefill and decode that move to the longer length when the sequence outgrows the
shorter one give transformers' logits, and the shorter specialization costs less device time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from models import HFReference, more_prompts

from qaic_aot import program_config
from qaic_aot.export import export_onnx
from qaic_aot.export.families import export_route
from qaic_aot.session import QAICInferenceSession
from qaic_core import qpc as layout
from qaic_core.manager import get_plugin_manager
from qaic_core.settings import CompileSettings
from qaic_core.types import Specialization

CCLS = (16, 64)
SETTINGS = CompileSettings(
    prefill_seq_len=8, ctx_len=64, full_batch_size=2, convert_to_fp16=False, num_cores=1
)


def ccl_specs() -> list[Specialization]:
    common = {"ctx_len": SETTINGS.ctx_len, "full_batch_size": 2}
    return [
        *(Specialization("Prefill", {"batch_size": 1, "seq_len": 8, "comp_ctx_lengths": c, **common})
          for c in CCLS),
        *(Specialization("Decode", {"batch_size": 2, "seq_len": 1, "comp_ctx_lengths": c, **common})
          for c in CCLS),
    ]  # fmt: skip


ROUTES = {
    "granite": ("GraniteForCausalLM", "traced"),
    "llama": ("LlamaForCausalLM", "graph"),
    "mistral": ("MistralForCausalLM", "graph"),  # a 12-token sliding window inside the short context
    "gpt2": ("GPT2LMHeadModel", "graph"),  # learned positions
}


@pytest.fixture(scope="module", params=sorted(ROUTES))
def arch(request: pytest.FixtureRequest) -> str:
    architecture, route = ROUTES[request.param]
    assert export_route(architecture) == route
    return str(request.param)


@pytest.fixture(scope="module")
def ccl_program(
    arch: str, tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    root = tmp_path_factory.mktemp(f"ccl-{arch}")
    result = export_onnx(tiny_model_factory(arch), root / "model.onnx", SETTINGS, progress=False, ccl=True)
    assert result.input_names[-2:] == ["comp_ctx_lengths", "batch_index"]  # QEfficient's order
    out = root / "qpc-ccl"
    out.mkdir()
    layout.write_specializations(out / layout.SPECIALIZATIONS_FILE, ccl_specs())
    layout.write_custom_io(out / layout.CUSTOM_IO_FILE, program_config.custom_io(SETTINGS, result.num_layers))
    backend = get_plugin_manager().select_device_backend("sim")
    assert backend.compiler is not None
    backend.compiler(program_config.compiler_argv(result.onnx_path, out, SETTINGS))
    return out


def ccl_for(last_position: int) -> int:
    """QEfficient's rule: the shortest compute-context length that holds the position."""
    return next(c for c in CCLS if last_position < c)


def test_ccl_program_matches_transformers(
    arch: str, ccl_program: Path, tiny_model_factory: Callable[[str], Path]
) -> None:
    ref = HFReference(tiny_model_factory(arch))
    prompt = more_prompts(ref.tokenizer)[1][:12]
    tokens = ref.greedy(prompt, 8)
    expected = ref.logits(prompt + tokens)
    session = QAICInferenceSession(ccl_program / "qpc")
    try:
        names = session.input_names + session.output_names
        session.skip_buffers([n for n in names if n.startswith("past_")])
        used: set[int] = set()
        for start in range(0, len(prompt), 8):
            chunk = prompt[start : start + 8]
            ids = np.zeros((1, 8), np.int64)
            pos = np.full((1, 8), -1, np.int64)
            ids[0, : len(chunk)] = chunk
            pos[0, : len(chunk)] = np.arange(start, start + len(chunk))
            ccl = ccl_for(start + 7)
            used.add(ccl)
            out = session.run(
                {"input_ids": ids, "position_ids": pos, "batch_index": np.array([[1]]),
                 "comp_ctx_lengths": np.zeros(ccl, np.int64)}
            )  # fmt: skip
        np.testing.assert_allclose(out["logits"][0, -1], expected[len(prompt) - 1], atol=1e-4)
        for step, token in enumerate(tokens[:-1]):
            position = len(prompt) + step
            ccl = ccl_for(position)
            used.add(ccl)
            out = session.run(
                {
                    "input_ids": np.array([[0], [token]], np.int64),
                    "position_ids": np.array([[-1], [position]], np.int64),
                    "batch_index": np.arange(2, dtype=np.int64).reshape(2, 1),
                    "comp_ctx_lengths": np.zeros(ccl, np.int64),
                }
            )
            np.testing.assert_allclose(out["logits"][1, -1], expected[position], atol=1e-4)
        assert used == set(CCLS)  # the sequence outgrew the short context and moved on
    finally:
        session.deactivate()


def test_shorter_context_costs_less(ccl_program: Path) -> None:
    from qaic_sim import qpcfile

    manifest, _ = qpcfile.read_manifest(qpcfile.find_program(ccl_program / "qpc"))
    costs = {(s.name, s.symbols["comp_ctx_lengths"]): s.cost for s in manifest.specs}
    for phase in ("Prefill", "Decode"):
        short, full = costs[(phase, CCLS[0])], costs[(phase, CCLS[1])]
        assert short is not None and full is not None
        assert 0 < short["kv_read_bytes"] < full["kv_read_bytes"]
        assert 0 < short["flops"] < full["flops"]
