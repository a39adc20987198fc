"""Compute-context lengths (CCL): the context lengths a program is specialized for besides ``ctx_len``.

A run reads only as many KV positions as its compute-context length, so a short sequence on a long
``ctx_len`` program pays for its own length. The program has one prefill specialization per
prefill length and one decode specialization per decode length (QEfficient's layout); every run
takes the shortest length that holds the furthest position any of its rows reaches.

The lists follow QEfficient's ``process_ccl_specializations``: with neither list given they are
generated from ``ctx_len`` (``automatic_lists``); a missing list is ``[ctx_len]``; ``ctx_len`` is
appended to a list that stops short of it, so every position can run; with ``prefill_seq_len`` 1
both lists are their union. Two choices differ from QEfficient, which sizes real-card programs:
``ctx_len`` is never rounded up to a multiple of 1024 (it is the KV cache the user asked for, vLLM's
``--max-model-len``), and lengths below 1024 are kept rather than raised to 1024. QEfficient also
moves prefill lengths that equal a decode length down by 32, saying the compiler needs the two
lists disjoint; that is unverified (the prefill and decode specializations already differ in
``seq_len``) and not done here.
"""

from __future__ import annotations

from collections.abc import Sequence

START_CTX_LEN = 4096
"""Contexts up to this get one length (QEfficient's ``CCL_START_CTX_LEN``)."""
START_MAP: tuple[tuple[float, int, int], ...] = (
    (32768, 4096, 4000),
    (65536, 8192, 8000),
    (float("inf"), 16384, 16000),
)
"""``(ctx_len up to, first decode length, first prefill length)`` (QEfficient's ``CCL_START_MAP``)."""
MAX_ELEMENTS = 5
"""Lengths per generated list (QEfficient's ``CCL_MAX_ELEMENTS_LISTS``)."""


def doubling(start: int, limit: int, max_elements: int, last: int | None = None) -> list[int]:
    """``start, 2*start, 4*start, ...`` up to ``limit``, at most ``max_elements``; ending in ``last`` if given."""
    values: list[int] = []
    value = start
    while value <= limit and len(values) < max_elements:
        values.append(value)
        value *= 2
    if last is not None and (not values or values[-1] != last):
        if len(values) < max_elements:
            values.append(last)
        else:
            values[-1] = last
    return values


def automatic_lists(ctx_len: int, prefill_seq_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """QEfficient's generated ``(prefill, decode)`` lists for ``ctx_len`` (``ccl_enabled`` alone)."""
    if ctx_len <= START_CTX_LEN:
        return (ctx_len,), (ctx_len,)
    if prefill_seq_len == 1:  # prefill and decode share the specializations: one longer list
        elements = 2 * MAX_ELEMENTS
        limit = min(ctx_len, START_CTX_LEN * 2 ** (elements - 1))
        both = tuple(doubling(START_CTX_LEN, limit, elements, last=ctx_len))
        return both, both
    decode_start, prefill_start = next((d, p) for bound, d, p in START_MAP if ctx_len <= bound)
    decode = doubling(decode_start, ctx_len, MAX_ELEMENTS, last=ctx_len)
    prefill = doubling(prefill_start, ctx_len, MAX_ELEMENTS) or [ctx_len]
    prefill[-1] = ctx_len  # the last prefill length takes any prompt
    return tuple(prefill), tuple(decode)


def resolve(
    prefill: Sequence[int], decode: Sequence[int], ctx_len: int, prefill_seq_len: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(prefill, decode)`` lengths a program is compiled for, from the lists given (maybe empty)."""
    if not prefill and not decode:
        return automatic_lists(ctx_len, prefill_seq_len)
    full_p = _reaching(prefill or [ctx_len], ctx_len)
    full_d = _reaching(decode or [ctx_len], ctx_len)
    if prefill_seq_len == 1:
        union = tuple(sorted({*full_p, *full_d}))
        return union, union
    return full_p, full_d


def _reaching(lengths: Sequence[int], ctx_len: int) -> tuple[int, ...]:
    values = list(lengths)
    if values[-1] < ctx_len:
        values.append(ctx_len)
    return tuple(values)


def covering(lengths: Sequence[int], last_position: int) -> int:
    """The shortest of the ascending ``lengths`` that holds ``last_position`` (the longest if none does)."""
    for length in lengths:
        if last_position < length:
            return length
    return lengths[-1]
