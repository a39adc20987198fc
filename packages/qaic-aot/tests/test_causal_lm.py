"""The CausalLM driver against Hugging Face transformers' own greedy generation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import sample_prompts

from qaic_aot import CausalLM, QAICInferenceSession, compile_model
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

# fp32 end to end so greedy tokens match transformers exactly; 8-token chunks, 2 KV slots.
SETTINGS = CompileSettings(
    prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1, convert_to_fp16=False
)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CausalLM]:
    qpc = compile_model(tiny_llama, SETTINGS, qeff_home=tmp_path_factory.mktemp("qeff"), progress=False)
    session = QAICInferenceSession(qpc)
    yield CausalLM(session, SETTINGS)
    session.deactivate()


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    return sample_prompts(AutoTokenizer.from_pretrained(str(tiny_llama)))


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _hf_last_logits(hf: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].numpy()


def test_geometry_comes_from_the_program(lm: CausalLM) -> None:
    assert (lm.prefill_seq_len, lm.ctx_len, lm.full_batch_size, lm.vocab_size) == (8, 64, 2, 320)


def test_generate_matches_transformers_with_slot_reuse(
    lm: CausalLM, hf: Any, prompts: list[list[int]]
) -> None:
    # Four prompts over two slots: slots are reused, and some prompts span several prefill chunks.
    assert max(len(p) for p in prompts) > 2 * SETTINGS.prefill_seq_len
    ours = lm.generate(prompts, NEW_TOKENS)
    assert ours == [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_chunked_prefill_logits_match(lm: CausalLM, hf: Any, prompts: list[list[int]]) -> None:
    prompt = prompts[3]
    logits = lm.prefill(1, prompt)
    np.testing.assert_allclose(logits, _hf_last_logits(hf, prompt), atol=1e-4)
    # One chunk at a time, the caller keeping the last result, gives the same logits.
    last = None
    for start in range(0, len(prompt), 8):
        last = lm.prefill_chunk(0, prompt[start : start + 8], start)
    np.testing.assert_allclose(last, logits, atol=1e-5)


def test_decode_rows_are_independent_slots(lm: CausalLM, hf: Any, prompts: list[list[int]]) -> None:
    a, b = prompts[0], prompts[2]
    ta = int(np.argmax(lm.prefill(0, a)))
    tb = int(np.argmax(lm.prefill(1, b)))
    both = lm.decode({0: (ta, len(a)), 1: (tb, len(b))})
    np.testing.assert_allclose(both[0], _hf_last_logits(hf, [*a, ta]), atol=1e-4)
    np.testing.assert_allclose(both[1], _hf_last_logits(hf, [*b, tb]), atol=1e-4)
    # A decode of slot 1 alone (row 0 padded with position -1) neither reads nor writes slot 0.
    ub = int(np.argmax(both[1]))
    only = lm.decode({1: (ub, len(b) + 1)})
    assert list(only) == [1]
    np.testing.assert_allclose(only[1], _hf_last_logits(hf, [*b, tb, ub]), atol=1e-4)
    ua = int(np.argmax(both[0]))
    np.testing.assert_allclose(
        lm.decode({0: (ua, len(a) + 1)})[0], _hf_last_logits(hf, [*a, ta, ua]), atol=1e-4
    )


def test_prefill_and_decode_in_flight_together(lm: CausalLM, hf: Any, prompts: list[list[int]]) -> None:
    a, b = prompts[1], prompts[3]
    ta = int(np.argmax(lm.prefill(0, a)))
    decode = lm.submit_decode({0: (ta, len(a))})
    chunk = lm.submit_prefill_chunk(1, b[:8], 0)
    np.testing.assert_allclose(decode.wait()[0], _hf_last_logits(hf, [*a, ta]), atol=1e-4)
    np.testing.assert_allclose(chunk.wait(), _hf_last_logits(hf, b[:8]), atol=1e-4)


def test_too_long_prompts_name_ctx_len(lm: CausalLM) -> None:
    with pytest.raises(QaicConfigError, match=r"ctx_len=64.*--ctx-len"):
        lm.generate([[5] * 65], 1)
    with pytest.raises(QaicConfigError, match=r"--ctx-len"):
        lm.generate([[5] * 60], 10)
    with pytest.raises(QaicConfigError, match=r"--ctx-len"):
        lm.prefill(0, [5] * 65)
    with pytest.raises(QaicConfigError, match="prefill_seq_len=8"):
        lm.prefill_chunk(0, [5] * 9, 0)
    with pytest.raises(QaicConfigError, match=r"full_batch_size is 2 .*--full-batch-size"):
        lm.decode({2: (5, 0)})


SPEC_SETTINGS = SETTINGS.replace(num_speculative_tokens=2)


@pytest.fixture(scope="module")
def spec_qpc(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A speculative target program (K = 2)."""
    return compile_model(tiny_llama, SPEC_SETTINGS, qeff_home=tmp_path_factory.mktemp("qeff"), progress=False)


def test_speculative_target_program_has_qefficients_layout(
    spec_qpc: Path, hf: Any, prompts: list[list[int]]
) -> None:
    """QEfficient's TLM layout: a prefill keeping one logits row, a decode of K+1 tokens keeping K+1."""
    from qaic_core import qpc as layout

    specs = layout.read_specializations(spec_qpc / layout.SPECIALIZATIONS_FILE)
    assert [(s.name, s.symbols) for s in specs] == [
        ("Prefill", {"batch_size": 1, "seq_len": 8, "ctx_len": 64, "num_logits_to_keep": 1, "full_batch_size": 2}),
        ("Decode", {"batch_size": 2, "seq_len": 3, "ctx_len": 64, "num_logits_to_keep": 3, "full_batch_size": 2}),
    ]  # fmt: skip
    session = QAICInferenceSession(spec_qpc / "qpc")
    try:
        session.skip_buffers([n for n in session.input_names + session.output_names if n.startswith("past_")])
        prompt = prompts[0][:8]
        ids = np.zeros((1, 8), np.int64)
        pos = np.full((1, 8), -1, np.int64)
        ids[0, : len(prompt)] = prompt
        pos[0, : len(prompt)] = np.arange(len(prompt))
        out = session.run(
            {"input_ids": ids, "position_ids": pos, "batch_index": np.array([[0]], np.int64),
             "num_logits_to_keep": np.zeros((1, 1), np.int64)}
        )  # fmt: skip
        assert out["logits"].shape == (1, 1, 320)  # one logits row: the last real token's
        np.testing.assert_allclose(out["logits"][0, 0], _hf_last_logits(hf, prompt), atol=1e-4)
        with pytest.raises(Exception, match="No matching dimension"):  # the prefill keeps no K+1 rows
            session.run(
                {"input_ids": ids, "position_ids": pos, "batch_index": np.array([[0]], np.int64),
                 "num_logits_to_keep": np.zeros((3, 1), np.int64)}
            )  # fmt: skip
    finally:
        session.deactivate()


def test_speculative_decode_returns_one_logits_row_per_token(
    spec_qpc: Path, hf: Any, prompts: list[list[int]]
) -> None:
    settings = SPEC_SETTINGS
    session = QAICInferenceSession(spec_qpc)
    try:
        spec = CausalLM(session, settings)
        a, b = prompts[0], prompts[2]
        ta = int(np.argmax(spec.prefill(0, a)))
        tb = int(np.argmax(spec.prefill(1, b)))
        drafts_a, drafts_b = [ta, 7, 9], [tb]
        out = spec.decode_tokens({0: (drafts_a, len(a)), 1: (drafts_b, len(b))})
        assert out[0].shape == (3, 320) and out[1].shape == (1, 320)
        with torch.no_grad():
            ref_a = hf(torch.tensor([[*a, *drafts_a]])).logits[0, -3:].numpy()
        np.testing.assert_allclose(out[0], ref_a, atol=1e-4)
        np.testing.assert_allclose(out[1][0], _hf_last_logits(hf, [*b, tb]), atol=1e-4)
        # The single-token decode still runs on the same program.
        ub = int(np.argmax(out[1][0]))
        np.testing.assert_allclose(
            spec.decode({1: (ub, len(b) + 1)})[1], _hf_last_logits(hf, [*b, tb, ub]), atol=1e-4
        )
        with pytest.raises(QaicConfigError, match="1 to 3"):
            spec.decode_tokens({0: ([1, 2, 3, 4], 0)})
    finally:
        session.deactivate()


def test_settings_that_disagree_with_the_program_are_refused(lm: CausalLM) -> None:
    session = lm.session
    with pytest.raises(QaicConfigError, match="--full-batch-size 2"):
        CausalLM(session, SETTINGS.replace(full_batch_size=None))
    with pytest.raises(QaicConfigError, match=r"--prefill-seq-len to one of \[8\]"):
        CausalLM(session, SETTINGS.replace(prefill_seq_len=16))
    with pytest.raises(QaicConfigError, match="--ctx-len 64"):
        CausalLM(session, SETTINGS.replace(ctx_len=128))


def _compiled_lm(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, **changes: Any
) -> Iterator[CausalLM]:
    """A CausalLM on a program compiled for SETTINGS with ``changes``; its session ends after use."""
    settings = SETTINGS.replace(**changes)
    qpc = compile_model(tiny_llama, settings, qeff_home=tmp_path_factory.mktemp("qeff"), progress=False)
    session = QAICInferenceSession(qpc)
    yield CausalLM(session, settings)
    session.deactivate()


@pytest.fixture(scope="module")
def batched_lm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CausalLM]:
    """Chunks of 16 with a 4-token prefill and a batched prefill of 3 rows x 4 tokens, 4 slots."""
    yield from _compiled_lm(
        tiny_llama,
        tmp_path_factory,
        prefill_seq_len=16,
        full_batch_size=4,
        prefill_seq_lens=(4, 8),
        prefill_batch_size=3,
    )


@contextmanager
def _input_shapes(lm: CausalLM) -> Iterator[list[tuple[int, ...]]]:
    """The ``input_ids`` shape of every run ``lm`` submits while the block runs."""
    from qaic_core.observe import Observer

    seen: list[tuple[int, ...]] = []

    class Shapes(Observer):
        def run_submitted(self, inputs: Any, exec_index: int, seconds: float) -> None:
            seen.append(tuple(inputs["input_ids"].shape))

    lm.session._observer = Shapes()
    try:
        yield seen
    finally:
        lm.session._observer = None


def test_a_chunk_runs_on_the_shortest_prefill_that_holds_it(
    batched_lm: CausalLM, hf: Any, prompts: list[list[int]]
) -> None:
    with _input_shapes(batched_lm) as seen:
        for n in (3, 6, 11):
            prompt = prompts[3][:n]
            np.testing.assert_allclose(batched_lm.prefill(0, prompt), _hf_last_logits(hf, prompt), atol=1e-4)
    assert seen == [(1, 4), (1, 8), (1, 16)]
    assert batched_lm.prefill_length(5) == 8 and batched_lm.prefill_length(16) == 16


def test_a_batched_prefill_gives_each_slot_its_own_logits(
    batched_lm: CausalLM, hf: Any, prompts: list[list[int]]
) -> None:
    short = [p[:4] for p in prompts[:3]]
    out = batched_lm.submit_prefill_chunks([(2, short[0], 0), (0, short[1], 0), (3, short[2], 0)]).wait()
    for prompt, logits in zip(short, out, strict=True):
        np.testing.assert_allclose(logits, _hf_last_logits(hf, prompt), atol=1e-4)
    # Each slot holds its own prompt: decoding one more token continues it as transformers would.
    rows = batched_lm.decode({2: (5, 4), 0: (7, 4), 3: (9, 4)})
    for slot, prompt, token in ((2, short[0], 5), (0, short[1], 7), (3, short[2], 9)):
        np.testing.assert_allclose(rows[slot], _hf_last_logits(hf, [*prompt, token]), atol=1e-4)
    # Fewer chunks than rows leave the other slots alone; a long chunk or a repeated slot is refused.
    assert batched_lm.submit_prefill_chunks([(1, short[0][:2], 0)]).wait()[0] is not None
    with pytest.raises(QaicConfigError, match="at most 4 tokens"):
        batched_lm.submit_prefill_chunks([(1, prompts[3][:5], 0)])
    with pytest.raises(QaicConfigError, match="different slots"):
        batched_lm.submit_prefill_chunks([(1, short[0], 0), (1, short[1], 0)])


def test_a_batched_prefill_runs_on_the_fewest_rows_that_hold_it(
    batched_lm: CausalLM, hf: Any, prompts: list[list[int]]
) -> None:
    # prefill_batch_size 3 compiles batched prefills of 2 and 3 rows.
    assert batched_lm.prefill_batch_sizes == (2, 3)
    short = [p[:4] for p in prompts[:3]]
    with _input_shapes(batched_lm) as seen:
        two = batched_lm.submit_prefill_chunks([(1, short[0], 0), (2, short[1], 0)]).wait()
        three = batched_lm.submit_prefill_chunks(
            [(0, short[0], 0), (1, short[1], 0), (3, short[2], 0)]
        ).wait()
    assert seen == [(2, 4), (3, 4)]
    for prompt, logits in zip(short[:2], two, strict=True):
        np.testing.assert_allclose(logits, _hf_last_logits(hf, prompt), atol=1e-4)
    for prompt, logits in zip(short, three, strict=True):
        np.testing.assert_allclose(logits, _hf_last_logits(hf, prompt), atol=1e-4)
    with pytest.raises(
        QaicConfigError, match="4 chunks in one batched prefill, the program takes 3: submit at most 3"
    ):
        batched_lm.submit_prefill_chunks([(s, short[0], 0) for s in range(4)])


@pytest.fixture(scope="module")
def long_rows_lm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CausalLM]:
    """Chunks of 16 and a batched prefill of 2 rows x 16 tokens (prefill_batch_seq_len), 4 slots."""
    yield from _compiled_lm(
        tiny_llama,
        tmp_path_factory,
        prefill_seq_len=16,
        full_batch_size=4,
        prefill_batch_size=2,
        prefill_batch_seq_len=16,
    )


def test_a_batched_prefill_of_long_rows_matches_transformers(
    long_rows_lm: CausalLM, hf: Any, prompts: list[list[int]]
) -> None:
    assert (long_rows_lm.prefill_batch_size, long_rows_lm.prefill_batch_seq_len) == (2, 16)
    first, second = prompts[0][:16], prompts[1][:11]
    out = long_rows_lm.submit_prefill_chunks([(3, first, 0), (1, second, 0)]).wait()
    np.testing.assert_allclose(out[0], _hf_last_logits(hf, first), atol=1e-4)
    np.testing.assert_allclose(out[1], _hf_last_logits(hf, second), atol=1e-4)
    # A second chunk continues each prompt at its position: greedy tokens then match transformers.
    more = prompts[2][:7]
    out = long_rows_lm.submit_prefill_chunks([(1, more, len(second))]).wait()
    np.testing.assert_allclose(out[0], _hf_last_logits(hf, [*second, *more]), atol=1e-4)
    token = int(np.argmax(_hf_last_logits(hf, first)))
    rows = long_rows_lm.decode({3: (token, len(first))})
    np.testing.assert_allclose(rows[3], _hf_last_logits(hf, [*first, token]), atol=1e-4)
    with pytest.raises(QaicConfigError, match="at most 16 tokens"):
        long_rows_lm.submit_prefill_chunks([(0, prompts[3][:17], 0)])
