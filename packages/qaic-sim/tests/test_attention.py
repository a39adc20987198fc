"""Decode attention on the fused kernel: the same values as the exported nodes, the cache updated in place.

The simulated compiler gives a grouped-query attention block written as our exporter writes it
(``gqa_models``) a fused kernel for decode runs (one token per row, rows in cache order) and keeps
the exported nodes for every other run. Checked here against a numpy reference, and against the same
program compiled with the fused kernel off (``QAIC_SIM_FUSED_ATTENTION=0``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from gqa_models import KV_HEADS, VOCAB, GqaReference, GqaWeights, write_gqa_model
from qeff_session import QeffStyleSession
from sim_programs import ccl_specs, compile_program

from qaic_core.types import Specialization
from qaic_sim import aicapi, attention, qaicrt, qpcfile
from qaic_sim.machine import reset_machine

CTX, SLOTS, CHUNK, HEAD_DIM = 16, 3, 4, 8
CCLS = (8, 16)
KV = ["past_key.0", "past_value.0"]
OUT_KV = [f"{name}_RetainedState" for name in KV]


def specs() -> list[Specialization]:
    return ccl_specs(SLOTS, CTX, CHUNK, CCLS)


@pytest.fixture(scope="module")
def weights() -> GqaWeights:
    return GqaWeights.random(seed=5)


def _compile(
    root: Path, weights: GqaWeights, *, fp16: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> Path:
    onnx_path = write_gqa_model(root / "model.onnx", weights)
    monkeypatch.setenv("QAIC_SIM_FUSED_ATTENTION", "1" if fused else "0")
    reset_machine()
    flags = ("-retained-state", "-convert-to-fp16") if fp16 else ("-retained-state",)
    qpc = compile_program(root / f"qpc-{fp16}-{fused}", onnx_path, specs(), flags=flags)
    monkeypatch.delenv("QAIC_SIM_FUSED_ATTENTION")
    reset_machine()
    return qpc


def _fused_layers(qpc: Path) -> int:
    model = onnx.load_from_string(qpcfile.read_member(qpcfile.find_program(qpc), qpcfile.MODEL))
    return sum(
        any(inner.op_type == "GroupQueryAttention" for inner in attr.g.node)
        for node in model.graph.node
        if node.op_type == "If"
        for attr in node.attribute
        if attr.name == "then_branch"
    )


class Driver:
    """One program held by a QEfficient-style session; runs return the logits and the whole cache."""

    def __init__(self, qpc: Path) -> None:
        self.s = QeffStyleSession(qaicrt, aicapi, str(qpc), device_ids=[0])
        self.s.skip_buffers(KV)

    def run(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray, ccl: int) -> dict[str, np.ndarray]:
        b, s = ids.shape
        kv = np.zeros((SLOTS, KV_HEADS, CTX, HEAD_DIM), np.float32)
        out: dict[str, np.ndarray] = self.s.run(
            {
                "input_ids": ids,
                "position_ids": pos,
                "batch_index": rows.reshape(-1, 1).astype(np.int64),
                "comp_ctx_lengths": np.zeros(ccl, np.int64),
                "logits": np.zeros((b, s, VOCAB), np.float32),
                **{name: kv.copy() for name in OUT_KV},
            }
        )
        return out


def _prefill_args(prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A one-chunk prompt from position 0: its ids and positions, padded with position -1."""
    ids = np.zeros((1, CHUNK), np.int64)
    pos = np.full((1, CHUNK), -1, np.int64)
    ids[0, : len(prompt)] = prompt
    pos[0, : len(prompt)] = np.arange(len(prompt))
    return ids, pos


def _prefill(d: Driver, slot: int, prompt: list[int]) -> dict[str, np.ndarray]:
    return d.run(*_prefill_args(prompt), np.array([slot]), CCLS[0])


def _decode(
    d: Driver, tokens: list[int], positions: list[int], ccl: int, rows: list[int] | None = None
) -> dict[str, np.ndarray]:
    order = np.arange(SLOTS) if rows is None else np.array(rows)
    return d.run(np.array(tokens, np.int64)[:, None], np.array(positions, np.int64)[:, None], order, ccl)


@pytest.fixture
def programs(
    tmp_path: Path, weights: GqaWeights, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[tuple[bool, bool], Path]]:
    yield {
        (fp16, fused): _compile(tmp_path, weights, fp16=fp16, fused=fused, monkeypatch=monkeypatch)
        for fp16 in (False, True)
        for fused in (False, True)
    }


def test_decode_runs_the_fused_kernel_as_the_reference(
    programs: dict[tuple[bool, bool], Path], weights: GqaWeights
) -> None:
    """float32: decode steps with an idle row match numpy; the idle row's cache is left as it was."""
    assert attention.fused_kernel_available()
    qpc = programs[(False, True)]
    assert _fused_layers(qpc) == 1 and _fused_layers(programs[(False, False)]) == 0
    d, ref = Driver(qpc), GqaReference(weights, SLOTS, CTX)
    for slot, prompt in ((1, [5, 9, 2]), (2, [7, 1, 30, 4])):
        out = _prefill(d, slot, prompt)
        expected = ref.run(*_prefill_args(prompt), np.array([slot]), CCLS[0])
        n = len(prompt)
        np.testing.assert_allclose(out["logits"][0, :n], expected[0, :n], rtol=1e-5, atol=1e-5)
    before = out["past_key.0_RetainedState"][0].copy()
    tokens, positions = [0, 11, 12], [-1, 3, 4]
    for _ in range(6):  # crosses from the 8-position to the 16-position compute context
        ccl = next(c for c in CCLS if max(positions) < c)
        out = _decode(d, tokens, positions, ccl)
        expected = ref.run(np.array(tokens)[:, None], np.array(positions)[:, None], np.arange(SLOTS), ccl)
        np.testing.assert_allclose(out["logits"][1:], expected[1:], rtol=1e-5, atol=1e-5)
        for name, cache in zip(OUT_KV, (ref.k, ref.v), strict=True):
            np.testing.assert_allclose(out[name][1:], cache[1:], rtol=1e-6, atol=1e-6)
        tokens = [0, *(int(t) for t in out["logits"][1:, 0].argmax(-1))]
        positions = [-1, positions[1] + 1, positions[2] + 1]
    np.testing.assert_array_equal(out["past_key.0_RetainedState"][0], before)  # the idle slot wrote nothing


@pytest.mark.parametrize("fp16", [False, True])
def test_fused_and_exported_attention_agree(programs: dict[tuple[bool, bool], Path], fp16: bool) -> None:
    """Prefill takes the exported nodes in both programs (bit-identical); decode writes the same
    cache, bit for bit, and its logits differ only by the fused kernel's rounding (fp16: it rounds
    once where the exported nodes round after every op, so some logits do differ)."""
    fused, plain = Driver(programs[(fp16, True)]), Driver(programs[(fp16, False)])
    for slot, prompt in ((0, [3, 8, 21]), (2, [6, 6, 1, 9])):
        a, b = _prefill(fused, slot, prompt), _prefill(plain, slot, prompt)
        for name in ("logits", *OUT_KV):
            np.testing.assert_array_equal(a[name], b[name])
    tokens, positions = [4, 0, 17], [3, -1, 4]
    differ = False
    for _ in range(5):
        a, b = _decode(fused, tokens, positions, CCLS[0]), _decode(plain, tokens, positions, CCLS[0])
        for name in OUT_KV:
            np.testing.assert_array_equal(a[name], b[name])
        live = [0, 2]
        np.testing.assert_allclose(a["logits"][live], b["logits"][live], rtol=0, atol=3e-2 if fp16 else 1e-5)
        differ |= not np.array_equal(a["logits"][live], b["logits"][live])
        tokens = [int(t) for t in b["logits"][:, 0].argmax(-1)]
        positions = [positions[0] + 1, -1, positions[2] + 1]
    assert differ or not fp16


def test_runs_off_the_fast_path_take_the_exported_nodes(programs: dict[tuple[bool, bool], Path]) -> None:
    """Rows out of cache order, or a position past the compute-context length: the fused program
    computes exactly what the exported nodes do (fp16, where the fused kernel would round otherwise)."""
    fused, plain = Driver(programs[(True, True)]), Driver(programs[(True, False)])
    for slot, prompt in ((0, [3, 8, 21, 2]), (1, [6, 6, 1, 9]), (2, [12, 5])):
        _prefill(fused, slot, prompt), _prefill(plain, slot, prompt)
    cases = [
        ([2, 7, 9], [4, 4, 2], CCLS[0], [2, 0, 1]),  # rows out of order
        ([5, 7, 1], [4, 9, 3], CCLS[0], None),  # position 9 beyond the 8-position context
    ]
    for tokens, positions, ccl, rows in cases:
        a, b = _decode(fused, tokens, positions, ccl, rows), _decode(plain, tokens, positions, ccl, rows)
        for name in ("logits", *OUT_KV):
            np.testing.assert_array_equal(a[name], b[name])


def test_a_supplied_cache_is_copied_not_written(programs: dict[tuple[bool, bool], Path]) -> None:
    """A cache the caller hands in is read, left as it was, and the run's cache equals the plain program's."""
    rng = np.random.default_rng(2)
    kv = rng.standard_normal((SLOTS, KV_HEADS, CTX, HEAD_DIM)).astype(np.float32)
    results = []
    for fused in (True, False):
        s = QeffStyleSession(qaicrt, aicapi, str(programs[(False, fused)]), device_ids=[0])
        given = {name: kv.copy() for name in KV}
        out = s.run(
            {
                "input_ids": np.array([[3], [4], [5]], np.int64),
                "position_ids": np.array([[6], [-1], [2]], np.int64),
                "batch_index": np.arange(SLOTS, dtype=np.int64).reshape(-1, 1),
                "comp_ctx_lengths": np.zeros(CCLS[0], np.int64),
                "logits": np.zeros((SLOTS, 1, VOCAB), np.float32),
                **given,
                **{name: np.zeros_like(kv) for name in OUT_KV},
            }
        )
        for name in KV:
            np.testing.assert_array_equal(given[name], kv)
        results.append(out)
        s.deactivate()
    for name in OUT_KV:
        np.testing.assert_array_equal(results[0][name], results[1][name])
    np.testing.assert_allclose(results[0]["logits"][[0, 2]], results[1]["logits"][[0, 2]], rtol=0, atol=1e-5)
