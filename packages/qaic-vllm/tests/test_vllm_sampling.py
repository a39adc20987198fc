"""Host sampling against hand-computed references (no engine, no device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams

from qaic_vllm.sampling import HostSampler

VOCAB = 8


def make(rows: int = 4) -> HostSampler:
    return HostSampler(None, rows, 64, VOCAB)


def test_greedy_is_argmax() -> None:
    s = make()
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    for i in range(3):
        s.add_request(i, 2, [1, 2], SamplingParams(temperature=0.0))
    tokens, lp = s.sample(logits, [0, 1, 2], [2, 2, 2])
    assert tokens == logits.argmax(-1).tolist()
    assert lp is None


def test_top_k_one_is_argmax_even_when_sampling() -> None:
    s = make()
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.9, 0.0, 0.0, 0.0, 0.0]])
    s.add_request(0, 1, [1], SamplingParams(temperature=1.0, top_k=1))
    for pos in range(20):
        assert s.sample(logits, [0], [pos])[0] == [1]


def test_random_draws_follow_softmax() -> None:
    s = make()
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]]))
    s.add_request(0, 1, [1], SamplingParams(temperature=1.0))
    counts = np.zeros(VOCAB)
    n = 3000
    for pos in range(n):
        counts[s.sample(logits, [0], [pos])[0][0]] += 1
    assert np.allclose(counts[:4] / n, [0.4, 0.3, 0.2, 0.1], atol=0.03)


def test_temperature_sharpens() -> None:
    s = make()
    logits = torch.log(torch.tensor([[0.6, 0.4] + [1e-9] * 6]))
    s.add_request(0, 1, [1], SamplingParams(temperature=0.5))
    n = 2000
    zeros = sum(s.sample(logits, [0], [p])[0][0] == 0 for p in range(n))
    expected = 0.36 / (0.36 + 0.16)  # p^(1/T) normalised, T = 0.5
    assert abs(zeros / n - expected) < 0.04


def test_top_p_keeps_the_nucleus() -> None:
    s = make()
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9]]))
    s.add_request(0, 1, [1], SamplingParams(temperature=1.0, top_p=0.6))
    seen = {s.sample(logits, [0], [p])[0][0] for p in range(400)}
    assert seen == {0, 1}


def test_seed_makes_draws_reproducible() -> None:
    logits = torch.zeros(1, VOCAB)
    runs = []
    for seed in (7, 7, 8):
        s = make()
        s.add_request(0, 1, [1], SamplingParams(temperature=1.0, seed=seed))
        runs.append([s.sample(logits, [0], [p])[0][0] for p in range(30)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_repetition_penalty_divides_seen_positive_logits() -> None:
    s = make()
    # Token 3 wins at 2.0 but is in the prompt; penalty 2 makes it 1.0 < token 5's 1.5.
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 1.5, 0.0, 0.0]])
    s.add_request(0, 2, [3, 4], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert s.sample(logits, [0], [2])[0] == [5]
    s.add_request(1, 2, [3, 4], SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert s.sample(logits, [1], [2])[0] == [3]  # 2.0 / 1.2 = 1.67 still beats 1.5


def test_frequency_and_presence_penalties_count_outputs() -> None:
    s = make()
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 1.5, 0.0, 0.0]])
    s.add_request(0, 1, [1], SamplingParams(temperature=0.0, frequency_penalty=0.3))
    assert s.sample(logits, [0], [1])[0] == [3]  # nothing generated yet
    s.append_token(0, 3)
    s.append_token(0, 3)
    assert s.sample(logits, [0], [3])[0] == [5]  # 2.0 - 2 * 0.3 = 1.4 < 1.5
    s.add_request(1, 1, [1], SamplingParams(temperature=0.0, presence_penalty=0.4))
    s.append_token(1, 3)
    assert s.sample(logits, [1], [2])[0] == [3]  # 2.0 - 0.4 = 1.6 > 1.5


def test_logit_bias_allowed_tokens_and_min_tokens() -> None:
    s = make()
    logits = torch.tensor([[0.0, 0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.5]])
    s.add_request(0, 1, [1], SamplingParams(temperature=0.0, logit_bias={7: 10.0}))
    assert s.sample(logits, [0], [1])[0] == [7]
    s.add_request(1, 1, [1], SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]))
    assert s.sample(logits, [1], [1])[0] == [3]
    s.add_request(2, 1, [1], SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]))
    assert s.sample(logits, [2], [1])[0] == [3]  # stop token 2 blocked: 0 outputs so far
    s.append_token(2, 3)
    assert s.sample(logits, [2], [2])[0] == [3]  # 1 output so far, still blocked
    s.append_token(2, 3)
    assert s.sample(logits, [2], [3])[0] == [2]  # min_tokens reached


def test_logprobs_match_log_softmax_and_rank() -> None:
    s = make()
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    s.add_request(0, 1, [1], SamplingParams(temperature=0.0, logprobs=3))
    s.add_request(1, 1, [1], SamplingParams(temperature=0.0, top_k=2, logprobs=3))
    tokens, lp = s.sample(logits, [0, 1], [1, 1])
    assert lp is not None
    ref = torch.log_softmax(logits, -1)
    for row in range(2):
        ids = lp.logprob_token_ids[row]
        assert ids[0] == tokens[row]
        assert list(ids[1:]) == torch.topk(logits[row], 3).indices.tolist()
        assert np.allclose(lp.logprobs[row], ref[row, ids].numpy(), atol=1e-6)
        assert lp.sampled_token_ranks[row] == 1


@pytest.mark.parametrize("rows", [[0, 2], [3]])
def test_rows_are_independent(rows: list[int]) -> None:
    s = make()
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(5))
    for r in rows:
        s.add_request(r, 1, [1], SamplingParams(temperature=0.0))
    assert s.sample(logits, rows, [1] * len(rows))[0] == logits.argmax(-1).tolist()


def test_a_batch_of_unseeded_rows_follows_each_rows_softmax() -> None:
    s = make(rows=3)
    probs = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25]]
    logits = torch.log(torch.tensor([p + [1e-9] * 4 for p in probs]))
    for row in range(3):
        s.add_request(row, 1, [1], SamplingParams(temperature=1.0))
    counts = np.zeros((3, VOCAB))
    n = 3000
    for pos in range(n):
        for row, token in enumerate(s.sample(logits, [0, 1, 2], [pos] * 3)[0]):
            counts[row, token] += 1
    assert np.allclose(counts[:, :4] / n, probs, atol=0.03)
    assert counts[:, 4:].sum() == 0


def test_masked_tokens_are_never_drawn() -> None:
    s = make()
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")] + [float("-inf")] * 4])
    s.add_request(0, 1, [1], SamplingParams(temperature=1.0))
    assert {s.sample(logits, [0], [p])[0][0] for p in range(300)} == {0, 2}


def test_only_rows_that_need_processing_are_processed() -> None:
    s = make()
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 1.5, 0.0, 0.0]] * 3)
    s.add_request(0, 2, [3, 4], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    s.add_request(1, 2, [3, 4], SamplingParams(temperature=0.0))
    s.add_request(2, 2, [3, 4], SamplingParams(temperature=1.0, top_k=1))
    assert s.sample(logits, [0, 1, 2], [2, 2, 2])[0] == [5, 3, 3]
    assert logits[0, 3] == 2.0  # the caller's logits are left as they were


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    logits = torch.zeros(3, VOCAB)
    alone, batched = make(), make()
    alone.add_request(1, 1, [1], SamplingParams(temperature=1.0, seed=3))
    for row, seed in enumerate((None, 3, None)):
        batched.add_request(row, 1, [1], SamplingParams(temperature=1.0, seed=seed))
    one = [alone.sample(logits[:1], [1], [p])[0][0] for p in range(20)]
    many = [batched.sample(logits, [0, 1, 2], [p] * 3)[0][1] for p in range(20)]
    assert one == many


def test_append_tokens_extends_each_rows_history() -> None:
    s = make()
    for row in range(3):
        s.add_request(row, 2, [1, 2], SamplingParams(temperature=0.0, frequency_penalty=1.0))
    s.append_tokens([0, 2], [5, 6])
    assert s.total_len.tolist()[:3] == [3, 2, 3]
    assert s.all_token_ids[0, :3].tolist() == [1, 2, 5]
    assert s.all_token_ids[2, :3].tolist() == [1, 2, 6]
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.5, 1.0, 0.0]])
    assert s.sample(logits, [0], [3])[0] == [6]  # 1.5 - 1.0 for the token generated once
