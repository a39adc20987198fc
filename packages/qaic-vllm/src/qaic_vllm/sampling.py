"""Host sampling of the device's logits with vLLM's own CPU sampling pieces (no vllm._C needed).

vLLM 0.34's CPU sampler calls ``vllm._C`` kernels for the Gumbel draw and the logit bias; this
module keeps vLLM's pure-torch parts (sampling states, penalties, bad words, top-k/top-p, min-p,
logprobs) and does those two steps in torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
from vllm.v1.worker.cpu.logits_processors import (
    CPUBadWords,
    CPUPenalties,
    LogitsContext,
    LogitsProcRequestState,
)
from vllm.v1.worker.cpu.sampler import NO_LOGPROBS, CPUSamplingStates

_SEED_MIX = 1_000_003


@dataclass
class _Bias:
    """Per-request logit bias, allowed tokens and min_tokens (vLLM does these in a C kernel)."""

    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed: torch.Tensor | None
    min_len: int
    stop_ids: torch.Tensor | None


class HostSampler:
    """Samples one token per request row from [rows, vocab] logits, with vLLM's semantics.

    Rows are split by what they need: greedy rows without penalties take an argmax of the raw
    logits; rows with penalties, bias, bad words, a temperature other than 0 or 1, top-k, top-p or
    min-p go through vLLM's processors (only those rows); every unseeded random row is drawn in one
    vectorised inverse-CDF draw from the sampler's generator; a seeded row draws from its own
    ``(seed, position)`` stream, so its output does not depend on the batch it ran in.
    """

    def __init__(self, vllm_config: object, max_num_reqs: int, max_model_len: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        cpu = torch.device("cpu")
        self.all_token_ids = torch.zeros((max_num_reqs, max_model_len + 1), dtype=torch.int32)
        self.prompt_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.prefill_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.total_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        # numpy views of the same memory: the per-step history updates stay out of torch's dispatcher.
        self._tokens_np: np.ndarray = self.all_token_ids.numpy()
        self._total_np: np.ndarray = self.total_len.numpy()
        self._prompt_len_np: np.ndarray = self.prompt_len.numpy()
        self._prefill_len_np: np.ndarray = self.prefill_len.numpy()
        lp_state = LogitsProcRequestState(
            device=cpu,
            max_num_reqs=max_num_reqs,
            vocab_size=vocab_size,
            all_token_ids=self.all_token_ids,
            prompt_len=self.prompt_len,
            prompt_len_np=self._prompt_len_np,
            prefill_len=self.prefill_len,
            prefill_len_np=self._prefill_len_np,
            total_len=self.total_len,
        )
        self.states = CPUSamplingStates(max_num_reqs, vocab_size, cpu)
        self.processors = [CPUPenalties(vllm_config, lp_state), CPUBadWords(vllm_config, lp_state)]  # type: ignore[arg-type]
        self.needs_processing = np.zeros(max_num_reqs, dtype=bool)
        # Rows whose token is the argmax of the raw logits and that want no logprobs (the fast path).
        self.plain_greedy = np.zeros(max_num_reqs, dtype=bool)
        self.bias: dict[int, _Bias] = {}
        seed = int(np.random.randint(0, 2**62))
        self.rng = torch.Generator().manual_seed(seed)
        self.np_rng = np.random.default_rng(seed)

    # -- request state --------------------------------------------------------------------
    def add_request(
        self, idx: int, prompt_len: int, token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Record a request in row ``idx``: its prompt, any earlier output, and its parameters."""
        n = min(len(token_ids), self._tokens_np.shape[1])
        self._tokens_np[idx, :n] = np.asarray(token_ids[:n], dtype=np.int32)
        self._prompt_len_np[idx] = prompt_len
        self._prefill_len_np[idx] = n
        self._total_np[idx] = n
        needs = self.states.add_request(idx, params)
        for proc in self.processors:
            needs |= proc.add_request(idx, params)
        self.bias.pop(idx, None)
        bias = _bias_of(params, prompt_len, self.vocab_size)
        if bias is not None:
            self.bias[idx] = bias
            needs = True
        self.needs_processing[idx] = needs
        self.plain_greedy[idx] = (
            not needs
            and self.states.temperature_np[idx] == 0.0
            and self.states.num_logprobs[idx] == NO_LOGPROBS
        )

    def append_token(self, idx: int, token_id: int) -> None:
        n = int(self._total_np[idx])
        if n < self._tokens_np.shape[1]:
            self._tokens_np[idx, n] = token_id
            self._total_np[idx] = n + 1

    def append_tokens(self, idxs: Sequence[int] | np.ndarray, token_ids: Sequence[int] | np.ndarray) -> None:
        """One token appended to each row in ``idxs`` (distinct rows), in one array operation."""
        rows = np.asarray(idxs, dtype=np.int64)
        if rows.size == 0:
            return
        lens = self._total_np[rows].astype(np.int64)
        room = lens < self._tokens_np.shape[1]
        if not room.all():
            rows, lens, token_ids = rows[room], lens[room], np.asarray(token_ids)[room]
        self._tokens_np[rows, lens] = np.asarray(token_ids, dtype=np.int32)
        self._total_np[rows] = lens + 1

    def remove_request(self, idx: int) -> None:
        self.bias.pop(idx, None)
        self.needs_processing[idx] = False
        self.plain_greedy[idx] = False

    # -- sampling -------------------------------------------------------------------------
    def all_plain_greedy(self, idxs: np.ndarray) -> bool:
        """Every row in ``idxs`` samples the argmax of its raw logits and wants no logprobs."""
        return bool(self.plain_greedy[idxs].all())

    def sample(
        self, logits: torch.Tensor | np.ndarray, idxs: Sequence[int], positions: Sequence[int]
    ) -> tuple[list[int], LogprobsLists | None]:
        """One token per row; ``positions`` are the sampled tokens' positions (for seeded draws)."""
        raw = _float32(logits)
        idx_np = np.asarray(idxs, dtype=np.int64)
        if self.all_plain_greedy(idx_np):
            return raw.argmax(axis=1).tolist(), None
        n = len(idx_np)
        temps = self.states.temperature_np[idx_np]
        needs = self.needs_processing[idx_np]
        processed: np.ndarray = raw
        if needs.any():
            # Only the rows that need it go through vLLM's processors; the others keep the raw logits.
            rows = np.flatnonzero(needs)
            processed = raw.copy()
            sub = torch.from_numpy(raw[rows].copy())
            pos_t = torch.as_tensor(np.asarray(positions, dtype=np.int64)[rows])
            processed[rows] = self._process(sub, idx_np[rows], pos_t).numpy()
        random_rows = np.flatnonzero(temps != 0.0)
        if random_rows.size == 0:
            sampled = processed.argmax(axis=1)
        else:
            sampled = np.empty(n, dtype=np.int64)
            greedy_rows = np.flatnonzero(temps == 0.0)
            if greedy_rows.size:
                sampled[greedy_rows] = processed[greedy_rows].argmax(axis=1)
            sampled[random_rows] = self._draw(processed, idx_np, positions, random_rows)
        logprobs = self._logprobs(raw, sampled, idx_np)
        return sampled.tolist(), logprobs

    def verify(
        self, logits: torch.Tensor, idx: int, position: int, drafts: Sequence[int]
    ) -> tuple[list[int], LogprobsLists | None]:
        """Accept a prefix of ``drafts`` and add one token, so the output follows the target's distribution.

        ``logits`` has one row per verified position (``len(drafts) + 1``): row ``j`` scores the
        token at ``position + j`` given the drafts before it. Greedy rows accept a draft when it is
        the argmax, so the output equals non-speculative greedy decoding. Random rows use rejection
        sampling with a deterministic proposal (the proposers draft one token, not a distribution):
        a draft ``d`` is kept with probability ``p(d)``; a rejected one is replaced by a draw from
        ``p`` without ``d`` (renormalised); after every draft is kept, one more token is drawn from
        the last row. Accepted tokens join the row's history before the next position is scored,
        so penalties see them as they would without speculation.
        """
        logits = torch.as_tensor(logits).to(torch.float32)
        idx_np = np.asarray([idx], dtype=np.int64)
        temperature = float(self.states.temperature_np[idx])
        out: list[int] = []
        raw_rows: list[torch.Tensor] = []
        history_len = int(self._total_np[idx])
        for j in range(len(drafts) + 1):
            pos_t = torch.tensor([position + j], dtype=torch.int64)
            raw = logits[j : j + 1]
            processed = self._process(raw, idx_np, pos_t)[0]
            raw_rows.append(raw[0])
            draft = int(drafts[j]) if j < len(drafts) else None
            if temperature == 0.0:
                token = int(processed.argmax())
            else:
                probs = torch.softmax(processed, dim=-1)
                gen = self._generator(idx, position + j)
                if draft is not None and float(torch.rand((), generator=gen)) < float(probs[draft]):
                    token = draft
                else:
                    if draft is not None:
                        probs = probs.clone()
                        probs[draft] = 0.0
                    noise = torch.empty_like(probs).exponential_(generator=gen)
                    token = int(torch.argmax(probs / noise))
            out.append(token)
            self.append_token(idx, token)
            if token != draft:
                break
        self._total_np[idx] = history_len  # the runner appends the output tokens itself
        sampled = torch.tensor(out, dtype=torch.int64)
        max_n = int(self.states.num_logprobs[idx])
        logprobs = None
        if max_n != NO_LOGPROBS:
            logprobs = topk_logprobs(torch.stack(raw_rows[: len(out)]), min(max_n, self.vocab_size), sampled)
        return out, logprobs

    def _generator(self, idx: int, position: int) -> torch.Generator:
        """The request's own stream at ``position`` when seeded, else the sampler's shared one."""
        if self.states.seeds_set[idx]:
            seed = (int(self.states.seeds_np[idx]) + _SEED_MIX * position) % (2**63 - 1)
            return torch.Generator().manual_seed(seed)
        return self.rng

    def _process(self, logits: torch.Tensor, idx_np: np.ndarray, pos_t: torch.Tensor) -> torch.Tensor:
        """vLLM's processors, temperature, min-p, top-k and top-p on rows that need them."""
        if not np.any(self.needs_processing[idx_np]):
            return logits
        idx_t = torch.from_numpy(idx_np)
        logits = logits.clone()
        if self.bias:
            for row, idx in enumerate(idx_np.tolist()):
                bias = self.bias.get(idx)
                if bias is not None:
                    _apply_bias(logits[row], bias, int(self._total_np[idx]))
        ctx = LogitsContext(
            expanded_idx_mapping=idx_t,
            idx_mapping=idx_t,
            idx_mapping_np=idx_np,
            expanded_local_pos=torch.zeros_like(idx_t),
            input_ids=torch.zeros_like(idx_t),
            pos=pos_t,
            seq_lens_upper_bound_np=self._total_np[idx_np],
        )
        for proc in self.processors:
            logits = proc.apply(logits, ctx)
        self.states.apply_temperature(logits, idx_t, idx_np)
        self.states.apply_min_p(logits, idx_t, idx_np)
        top_k, top_p, _ = self.states.get_top_k_top_p(idx_t, idx_np, logits.shape[-1])
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p_pytorch(logits, top_k, top_p, allow_cpu_sync=True)
        return logits

    def _draw(
        self, processed: np.ndarray, idx_np: np.ndarray, positions: Sequence[int], rows: np.ndarray
    ) -> np.ndarray:
        """Random draws for ``rows`` of the processed logits (temperature already applied).

        Unseeded rows: one inverse-CDF draw for all of them from the sampler's generator. A seeded
        request: an exponential race (Gumbel-max) from its ``(seed, position)`` stream.
        """
        out = np.empty(len(rows), dtype=np.int64)
        seeded = self.states.seeds_set[idx_np[rows]]
        plain = np.flatnonzero(~seeded)
        if plain.size:
            out[plain] = _inverse_cdf(processed[rows[plain]], self.np_rng)
        for i in np.flatnonzero(seeded).tolist():
            row = int(rows[i])
            probs = torch.softmax(torch.from_numpy(processed[row]), dim=-1)
            gen = self._generator(int(idx_np[row]), int(positions[row]))
            noise = torch.empty_like(probs).exponential_(generator=gen)
            out[i] = int(torch.argmax(probs / noise))
        return out

    def _logprobs(self, raw: np.ndarray, sampled: np.ndarray, idx_np: np.ndarray) -> LogprobsLists | None:
        max_n = int(np.max(self.states.num_logprobs[idx_np])) if idx_np.size else NO_LOGPROBS
        if max_n == NO_LOGPROBS:
            return None
        return topk_logprobs(torch.from_numpy(raw), min(max_n, self.vocab_size), torch.from_numpy(sampled))


def _float32(logits: torch.Tensor | np.ndarray) -> np.ndarray:
    """The logits as a C-contiguous float32 numpy array (a view when they already are one)."""
    arr = logits.detach().numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits)
    return np.ascontiguousarray(arr, dtype=np.float32)


def _inverse_cdf(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of softmax(``logits``), from one uniform per row.

    The first token whose cumulative probability exceeds the row's uniform; a token of
    probability zero (masked to -inf) is never chosen.
    """
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted, out=shifted)
    cum = np.cumsum(probs, axis=1, dtype=np.float64)
    u = rng.random(len(cum)) * cum[:, -1]
    picked = (cum <= u[:, None]).sum(axis=1)
    return np.minimum(picked, logits.shape[1] - 1)


def _bias_of(params: SamplingParams, prompt_len: int, vocab_size: int) -> _Bias | None:
    bias_ids = bias_values = allowed = stop_ids = None
    if params.logit_bias:
        bias_ids = torch.tensor([int(k) for k in params.logit_bias], dtype=torch.int64)
        bias_values = torch.tensor([float(v) for v in params.logit_bias.values()], dtype=torch.float32)
    if params.allowed_token_ids:
        allowed = torch.tensor(list(params.allowed_token_ids), dtype=torch.int64)
    if params.min_tokens and params.all_stop_token_ids:
        stop_ids = torch.tensor(sorted(params.all_stop_token_ids), dtype=torch.int64)
        stop_ids = stop_ids[stop_ids < vocab_size]
    if bias_ids is None and allowed is None and stop_ids is None:
        return None
    return _Bias(bias_ids, bias_values, allowed, prompt_len + int(params.min_tokens or 0), stop_ids)


def _apply_bias(row: torch.Tensor, bias: _Bias, total_len: int) -> None:
    if bias.allowed is not None:
        keep = row[bias.allowed].clone()
        row.fill_(float("-inf"))
        row[bias.allowed] = keep
    if bias.bias_ids is not None and bias.bias_values is not None:
        row.index_add_(0, bias.bias_ids, bias.bias_values)
    if bias.stop_ids is not None and total_len < bias.min_len:
        row[bias.stop_ids] = float("-inf")


def topk_logprobs(logits: torch.Tensor, k: int, sampled: torch.Tensor) -> LogprobsLists:
    """vLLM's logprobs layout: column 0 the sampled token, then the top ``k``; plus the sampled rank.

    Same math as vLLM's ``compute_topk_scores`` (which is torch.compile'd; eager here).
    """
    logprobs_all = torch.log_softmax(logits.to(torch.float32), dim=-1)
    ids = sampled.to(torch.int64).unsqueeze(-1)
    if k > 0:
        ids = torch.cat((ids, torch.topk(logits, k, dim=-1).indices), dim=1)
    values = logprobs_all.gather(-1, ids)
    chosen = logits.gather(-1, sampled.to(torch.int64).unsqueeze(-1))
    ranks = (logits >= chosen).sum(-1)
    return LogprobsLists(ids.numpy(), values.numpy(), ranks.numpy())
