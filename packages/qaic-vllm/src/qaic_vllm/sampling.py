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
    """Samples one token per request row from [rows, vocab] logits, with vLLM's semantics."""

    def __init__(self, vllm_config: object, max_num_reqs: int, max_model_len: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        cpu = torch.device("cpu")
        self.all_token_ids = torch.zeros((max_num_reqs, max_model_len + 1), dtype=torch.int32)
        self.prompt_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.prefill_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.total_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        lp_state = LogitsProcRequestState(
            device=cpu,
            max_num_reqs=max_num_reqs,
            vocab_size=vocab_size,
            all_token_ids=self.all_token_ids,
            prompt_len=self.prompt_len,
            prompt_len_np=self.prompt_len.numpy(),
            prefill_len=self.prefill_len,
            prefill_len_np=self.prefill_len.numpy(),
            total_len=self.total_len,
        )
        self.states = CPUSamplingStates(max_num_reqs, vocab_size, cpu)
        self.processors = [CPUPenalties(vllm_config, lp_state), CPUBadWords(vllm_config, lp_state)]  # type: ignore[arg-type]
        self.needs_processing = np.zeros(max_num_reqs, dtype=bool)
        self.bias: dict[int, _Bias] = {}
        self.rng = torch.Generator().manual_seed(int(np.random.randint(0, 2**62)))

    # -- request state --------------------------------------------------------------------
    def add_request(
        self, idx: int, prompt_len: int, token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Record a request in row ``idx``: its prompt, any earlier output, and its parameters."""
        n = len(token_ids)
        self.all_token_ids[idx, :n] = torch.tensor(list(token_ids), dtype=torch.int32)
        self.prompt_len[idx] = prompt_len
        self.prefill_len[idx] = n
        self.total_len[idx] = n
        needs = self.states.add_request(idx, params)
        for proc in self.processors:
            needs |= proc.add_request(idx, params)
        self.bias.pop(idx, None)
        bias = _bias_of(params, prompt_len, self.vocab_size)
        if bias is not None:
            self.bias[idx] = bias
            needs = True
        self.needs_processing[idx] = needs

    def append_token(self, idx: int, token_id: int) -> None:
        n = int(self.total_len[idx])
        if n < self.all_token_ids.shape[1]:
            self.all_token_ids[idx, n] = token_id
            self.total_len[idx] = n + 1

    def remove_request(self, idx: int) -> None:
        self.bias.pop(idx, None)
        self.needs_processing[idx] = False

    # -- sampling -------------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor, idxs: Sequence[int], positions: Sequence[int]
    ) -> tuple[list[int], LogprobsLists | None]:
        """One token per row; ``positions`` are the sampled tokens' positions (for seeded draws)."""
        logits = logits.to(torch.float32)
        idx_np = np.asarray(idxs, dtype=np.int64)
        idx_t = torch.from_numpy(idx_np)
        pos_t = torch.as_tensor(list(positions), dtype=torch.int64)
        processed = self._process(logits, idx_t, idx_np, pos_t)
        temps = self.states.temperature_np[idx_np]
        sampled = processed.argmax(dim=-1)
        random_rows = np.nonzero(temps != 0.0)[0]
        if random_rows.size:
            sampled[torch.from_numpy(random_rows)] = self._draw(processed, idx_np, pos_t, random_rows)
        logprobs = self._logprobs(logits, processed, sampled, idx_np)
        return [int(t) for t in sampled.tolist()], logprobs

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
        logits = logits.to(torch.float32)
        idx_np = np.asarray([idx], dtype=np.int64)
        idx_t = torch.from_numpy(idx_np)
        temperature = float(self.states.temperature_np[idx])
        out: list[int] = []
        raw_rows: list[torch.Tensor] = []
        history_len = int(self.total_len[idx])
        for j in range(len(drafts) + 1):
            pos_t = torch.tensor([position + j], dtype=torch.int64)
            raw = logits[j : j + 1]
            processed = self._process(raw, idx_t, idx_np, pos_t)[0]
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
        self.total_len[idx] = history_len  # the runner appends the output tokens itself
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

    def _process(
        self, logits: torch.Tensor, idx_t: torch.Tensor, idx_np: np.ndarray, pos_t: torch.Tensor
    ) -> torch.Tensor:
        if not np.any(self.needs_processing[idx_np]):
            return logits
        logits = logits.clone()
        for row, idx in enumerate(idx_np.tolist()):
            bias = self.bias.get(idx)
            if bias is not None:
                _apply_bias(logits[row], bias, int(self.total_len[idx]))
        ctx = LogitsContext(
            expanded_idx_mapping=idx_t,
            idx_mapping=idx_t,
            idx_mapping_np=idx_np,
            expanded_local_pos=torch.zeros_like(idx_t),
            input_ids=torch.zeros_like(idx_t),
            pos=pos_t,
            seq_lens_upper_bound_np=self.total_len.numpy()[idx_np],
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
        self, processed: torch.Tensor, idx_np: np.ndarray, pos_t: torch.Tensor, rows: np.ndarray
    ) -> torch.Tensor:
        """Exponential-race (Gumbel-max) draws; a seeded request draws from (seed, position)."""
        out = torch.empty(len(rows), dtype=torch.int64)
        for i, row in enumerate(rows.tolist()):
            idx = int(idx_np[row])
            probs = torch.softmax(processed[row], dim=-1)
            gen = self._generator(idx, int(pos_t[row]))
            noise = torch.empty_like(probs).exponential_(generator=gen)
            out[i] = int(torch.argmax(probs / noise))
        return out

    def _logprobs(
        self, raw: torch.Tensor, processed: torch.Tensor, sampled: torch.Tensor, idx_np: np.ndarray
    ) -> LogprobsLists | None:
        max_n = int(np.max(self.states.num_logprobs[idx_np])) if idx_np.size else NO_LOGPROBS
        if max_n == NO_LOGPROBS:
            return None
        return topk_logprobs(raw, min(max_n, self.vocab_size), sampled)


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
