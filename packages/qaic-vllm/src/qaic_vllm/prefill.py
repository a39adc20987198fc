"""Which prefill shapes a served program is compiled with, so short prompts compute little padding.

Besides ``prefill_seq_len`` (``--long-prefill-token-threshold``), the engine compiles shorter
prefill chunks (halves of it, down to ``MIN_PREFILL_SEQ_LEN``): a chunk runs on the shortest that
holds it. With continuous batching it also compiles a batched prefill of the shortest chunk, with
as many rows as fit the same token budget, so a burst of short prompts is prefilled together
instead of one by one. ``override_qaic_config`` ``prefill_seq_lens`` / ``prefill_batch_size`` /
``prefill_batch_seq_len`` (the batched prefill's row length) choose them instead; a prebuilt
program (``qpc_path``) keeps what it was compiled with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qaic_vllm.overrides import read_overrides

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MIN_PREFILL_SEQ_LEN = 32
"""Shorter chunks than this are not compiled on their own (a chunk's fixed cost would dominate)."""
MAX_EXTRA_LENGTHS = 2
"""Shorter prefill lengths compiled besides ``prefill_seq_len`` (each adds a specialization)."""


@dataclass(frozen=True)
class PrefillShapes:
    """The extra prefill lengths, the batched prefill's rows (1: no batched prefill) and its row length
    (0 without one)."""

    seq_lens: tuple[int, ...]
    batch_size: int
    batch_seq_len: int = 0
    given_batch_seq_len: int | None = None
    """``prefill_batch_seq_len`` as given (None: the shortest chunk), for the compile settings."""

    @property
    def batch_tokens(self) -> int:
        """Tokens one batched prefill run takes (0 without one)."""
        return self.batch_size * self.batch_seq_len


def auto_lengths(prefill_seq_len: int) -> tuple[int, ...]:
    """Halves of ``prefill_seq_len`` down to ``MIN_PREFILL_SEQ_LEN``: 128 gives (32, 64)."""
    lengths: list[int] = []
    n = prefill_seq_len // 2
    while n >= MIN_PREFILL_SEQ_LEN and len(lengths) < MAX_EXTRA_LENGTHS:
        lengths.append(n)
        n //= 2
    return tuple(sorted(lengths))


def prefill_shapes(
    values: Mapping[str, Any], prefill_seq_len: int, full_batch_size: int, prebuilt: bool
) -> PrefillShapes:
    """What ``values`` (the overrides) ask for, else the automatic choice; nothing extra for a prebuilt QPC."""
    if "prefill_seq_lens" in values:
        lengths = tuple(n for n in values["prefill_seq_lens"] if n != prefill_seq_len)
    else:
        lengths = () if prebuilt else auto_lengths(prefill_seq_len)
    given = values.get("prefill_batch_seq_len")
    given_width = int(given) if given is not None else None
    width = given_width or min(lengths, default=prefill_seq_len)
    if "prefill_batch_size" in values:
        batch = int(values["prefill_batch_size"])
    elif prebuilt or not lengths:
        batch = 1
    else:
        batch = max(1, min(prefill_seq_len // width, full_batch_size))
    return PrefillShapes(lengths, batch, width if batch > 1 else 0, given_width)


def engine_prefill_shapes(vllm_config: VllmConfig, values: Mapping[str, Any] | None = None) -> PrefillShapes:
    """The shapes the engine's program has, from its configuration (the scheduler plans with them);
    ``values``: the engine's overrides when already read."""
    if values is None:
        values = read_overrides(vllm_config)
    sched = vllm_config.scheduler_config
    prefill = int(values.get("prefill_seq_len") or sched.long_prefill_token_threshold or 0)
    prefill = min(
        prefill or int(vllm_config.model_config.max_model_len), int(vllm_config.model_config.max_model_len)
    )
    return prefill_shapes(values, prefill, int(sched.max_num_seqs), bool(values.get("qpc_path")))


def prefill_budget(prefill_seq_len: int, partial: int, batch_tokens: int) -> int:
    """Prefill tokens one step may schedule: a chunk for each of ``partial`` prompts in prefill, or a
    full batched prefill (``batch_tokens``: rows x row length), whichever is more."""
    return max(partial * prefill_seq_len, batch_tokens)
