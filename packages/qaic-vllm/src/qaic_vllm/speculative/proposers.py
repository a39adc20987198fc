"""Host proposers: draft tokens from the request's own history (n-gram) or from suffix matches.

Both read only token ids and run in plain Python/numpy on the host; neither needs a second program.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol


class Proposer(Protocol):
    """Drafts up to ``k`` tokens for each request from what it has generated so far.

    ``histories`` holds each request's prompt and output (its last token not yet verified);
    ``slots`` the KV slot each request holds, for a proposer with a device program of its own.
    """

    def propose(
        self, histories: Mapping[str, Sequence[int]], slots: Mapping[str, int], k: int
    ) -> dict[str, list[int]]: ...

    def finish(self, req_id: str, history: Sequence[int]) -> None:
        """The request finished (or was preempted); ``history`` is its prompt and output."""
        ...

    def close(self) -> None:
        """Release whatever the proposer holds on the device."""
        ...


def _continuation(history: Sequence[int], end: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed a match ending before index ``end``."""
    return list(history[end : end + k])


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens.

    n goes from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the longest n that occurs
    earlier wins (vLLM's ``ngram`` method and its two settings).
    """

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(
        self, histories: Mapping[str, Sequence[int]], slots: Mapping[str, int], k: int
    ) -> dict[str, list[int]]:
        return {req_id: self.propose_one(list(tokens), k) for req_id, tokens in histories.items()}

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        size = len(tokens)
        for n in range(min(self.lookup_max, size - 1), self.lookup_min - 1, -1):
            pattern = tokens[size - n :]
            for start in range(size - n - 1, -1, -1):
                if tokens[start : start + n] == pattern:
                    return _continuation(tokens, start + n, k)
        return []

    def finish(self, req_id: str, history: Sequence[int]) -> None:
        return None

    def close(self) -> None:
        return None


class SuffixProposer:
    """Suffix matching over the request's prompt and output and over finished requests' sequences.

    The draft continues the earlier occurrence whose preceding tokens match the longest suffix of
    the request's history (at most ``max_depth`` tokens); the request's own history is searched
    first, then the cache of the last ``max_cached`` finished sequences (vLLM's ``suffix`` method
    settings ``suffix_decoding_max_tree_depth`` and ``suffix_decoding_max_cached_requests``).
    """

    def __init__(self, max_depth: int, max_cached: int) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached
        self.cache: OrderedDict[str, list[int]] = OrderedDict()

    def propose(
        self, histories: Mapping[str, Sequence[int]], slots: Mapping[str, int], k: int
    ) -> dict[str, list[int]]:
        return {req_id: self.propose_one(list(tokens), k) for req_id, tokens in histories.items()}

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        if not tokens:
            return []
        best_len, best = 0, []
        own = (tokens, len(tokens) - 1)  # a match must end before the request's last token
        for corpus, limit in [own, *((seq, len(seq)) for seq in reversed(self.cache.values()))]:
            length, end = _longest_suffix_match(corpus, limit, tokens, self.max_depth)
            if length > best_len:
                cont = _continuation(corpus, end, k)
                if cont:
                    best_len, best = length, cont
        return best

    def finish(self, req_id: str, history: Sequence[int]) -> None:
        if self.max_cached <= 0 or not history:
            return
        self.cache.pop(req_id, None)
        self.cache[req_id] = list(history)
        while len(self.cache) > self.max_cached:
            self.cache.popitem(last=False)

    def close(self) -> None:
        self.cache.clear()


def _longest_suffix_match(
    corpus: Sequence[int], limit: int, tokens: Sequence[int], max_depth: int
) -> tuple[int, int]:
    """(length, end) of the latest occurrence in ``corpus[:limit]`` matching the longest suffix of ``tokens``."""
    last = tokens[-1]
    best_len, best_end = 0, 0
    for i in range(limit - 1, -1, -1):
        if corpus[i] != last:
            continue
        length = 1
        while (
            length < max_depth
            and i - length >= 0
            and length < len(tokens)
            and corpus[i - length] == tokens[-1 - length]
        ):
            length += 1
        if length > best_len:
            best_len, best_end = length, i + 1
            if length >= max_depth:
                break
    return best_len, best_end
