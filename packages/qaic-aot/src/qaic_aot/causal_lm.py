"""Drives a compiled causal LM through QEfficient's IO contract: chunked prefill, full-batch decode.

Prefill runs one sequence at a time (batch 1, ``batch_index=[[slot]]``) in chunks of
``prefill_seq_len`` padded with position -1, each on the shortest compiled prefill length that
holds it; a program with a batched prefill also runs up to ``prefill_batch_size`` short chunks of
different slots in one run. Decode runs all ``full_batch_size`` rows at once with unused rows at
position -1. The KV cache never leaves the device: KV inputs and their
``_RetainedState`` outputs are skipped (zero-size buffers).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from qaic_core import ccl
from qaic_core.errors import QaicConfigError
from qaic_core.execution import LogitRows, fewest_rows
from qaic_core.session import DeviceSession, PreparedProgramRun, RunInFlight
from qaic_core.settings import CompileSettings

log = logging.getLogger("qaic.aot.causal_lm")

PAD_POSITION = -1
COMP_CTX_LENGTHS = "comp_ctx_lengths"
DECODE_EXEC = 0
PREFILL_EXEC = 1

T = TypeVar("T")


class LogitsHandle(Generic[T]):
    """A prefill chunk or decode in flight; ``wait()`` returns its logits as ``pick`` takes them."""

    def __init__(self, run: RunInFlight | None, pick: Callable[[dict[str, np.ndarray]], T]) -> None:
        self._run = run
        self._pick = pick

    def wait(self) -> T:
        return self._pick(self._run.wait() if self._run is not None else {})


class PreparedDecodeRun:
    """A full-batch decode with its positions set; ``submit(token_ids)`` writes the tokens and starts it."""

    def __init__(self, run: PreparedProgramRun, index: np.ndarray | None, slots: list[int]) -> None:
        self._run = run
        self._index = index
        self._ids = run.array("input_ids")
        self.slots = slots

    def submit(self, token_ids: Sequence[int] | np.ndarray) -> LogitsHandle[LogitRows]:
        """One token per slot, in the order the positions were given; wait() gives slot -> logits."""
        if len(token_ids) != len(self.slots):
            raise QaicConfigError(
                f"{len(token_ids)} tokens for a decode prepared for {len(self.slots)} slots: give one per slot"
            )
        if self._index is not None:
            self._ids[self._index, -1] = token_ids
        return LogitsHandle(self._run.submit(), _decode_pick(self.slots))


class CausalLM:
    """Greedy generation and the per-step calls a serving runner needs, on one session."""

    def __init__(self, session: DeviceSession, settings: CompileSettings) -> None:
        self.session = session
        self.settings = settings
        names = set(session.input_names)
        for required in ("input_ids", "position_ids"):
            if required not in names:
                raise QaicConfigError(
                    f"the program has no {required!r} input: it was not exported as a causal LM"
                )
        self.continuous_batching = "batch_index" in names
        self.prefill_seq_len = settings.prefill_seq_len
        self.ctx_len = settings.ctx_len
        self.full_batch_size = settings.decode_batch_size
        if not self.continuous_batching and self.full_batch_size != 1:
            raise QaicConfigError(
                "this program has no batch_index input, so it cannot run one sequence per KV slot: "
                "compile it with --full-batch-size for continuous batching"
            )
        bindings = {b.name: b for b in session.bindings}
        if "logits" not in bindings:
            raise QaicConfigError("the program has no 'logits' output: it was not exported as a causal LM")
        self.vocab_size = int(bindings["logits"].dims[-1])
        self.prefill_lens = settings.prefill_lengths
        self.prefill_batch_size = settings.prefill_batch_size
        self.prefill_batch_seq_len = settings.batched_prefill_seq_len or 0
        self._check_kv_geometry(bindings)
        self._check_prefill_shape(session)
        self.prefill_batch_sizes = self._batched_rows(session)
        self.decode_exec = DECODE_EXEC
        self.prefill_exec = PREFILL_EXEC if session.num_exec_objects > 1 else DECODE_EXEC
        retained = [n for n in session.output_names if n.endswith("_RetainedState")]
        kv_inputs = [n for n in session.input_names if n.startswith("past_")]
        session.skip_buffers(kv_inputs + retained)
        self.decode_seq_len = settings.decode_seq_len
        # Index arrays every run reuses (read-only: a run in flight may still be reading them).
        self._decode_batch_index = _frozen(np.arange(self.full_batch_size, dtype=np.int64).reshape(-1, 1))
        self._slot_index = [_frozen(np.array([[s]], np.int64)) for s in range(self.full_batch_size)]
        # num_logits_to_keep: an integer that travels as a shape; logits come back for that many tokens
        # of each row, up to its last real one. QEfficient's speculative target layout keeps 1 in a
        # prefill and K+1 in the decode; the shapes are read off the program where it lists them.
        self._keep_by_shape: dict[tuple[int, int], np.ndarray] = {}
        self._keeps_logits = "num_logits_to_keep" in names
        if self._keeps_logits:
            self._keep_by_shape = _keep_shapes(session)
            self._keep_prefill = _frozen(np.zeros((1, 1), np.int64))
            self._keep_decode = _frozen(np.zeros((self.decode_seq_len, 1), np.int64))
            session.set_buffers({"num_logits_to_keep": self._keep_decode})  # for callers' own decodes
        # comp_ctx_lengths: the compute-context length, an integer that travels as the length of an
        # array; each shape's lengths are read off the program.
        self._ccl_by_shape: dict[tuple[int, int], tuple[int, ...]] = {}
        if COMP_CTX_LENGTHS in names:
            self._ccl_by_shape = _ccl_shapes(session)
            self._all_ccls = tuple(sorted({c for cs in self._ccl_by_shape.values() for c in cs}))
            self._ccl_arrays = {c: _frozen(np.zeros(c, np.int64)) for c in self._all_ccls}
            longest = self._ccl_by_shape.get((self.full_batch_size, self.decode_seq_len), self._all_ccls)[-1]
            session.set_buffers({COMP_CTX_LENGTHS: self._ccl_arrays[longest]})  # for callers' own decodes

    def _check_kv_geometry(self, bindings: Mapping[str, Any]) -> None:
        kv = bindings.get("past_key.0")
        if kv is None or len(kv.dims) != 4:
            return
        slots, _, ctx, _ = kv.dims
        if ctx != self.ctx_len:
            raise QaicConfigError(
                f"the program's KV cache holds {ctx} positions but ctx_len is {self.ctx_len}: set --ctx-len {ctx} "
                "or recompile"
            )
        if slots != self.full_batch_size:
            raise QaicConfigError(
                f"the program has {slots} KV slots but full_batch_size is {self.full_batch_size}: set "
                f"--full-batch-size {slots} or recompile"
            )

    def _check_prefill_shape(self, session: DeviceSession) -> None:
        index = session.binding_index_map["input_ids"]
        shapes = [list(shape[index][1]) for shape in session.allowed_shapes]
        if shapes and [1, self.prefill_seq_len] not in shapes:
            chunks = sorted({s[1] for s in shapes if len(s) == 2 and s[0] == 1 and s[1] > 1})
            raise QaicConfigError(
                f"the program has no prefill of {self.prefill_seq_len} tokens (input_ids shapes {shapes}): "
                f"set --prefill-seq-len to one of {chunks} or recompile"
            )
        if not shapes:
            return
        missing = [n for n in self.prefill_lens if [1, n] not in shapes]
        if self.prefill_batch_seq_len and [self.prefill_batch_size, self.prefill_batch_seq_len] not in shapes:
            raise QaicConfigError(
                f"the program has no prefill of {self.prefill_batch_size} x {self.prefill_batch_seq_len} "
                f"tokens (input_ids shapes {shapes}): set --prefill-batch-size 1 or recompile"
            )
        if missing:
            raise QaicConfigError(
                f"the program has no prefill of {missing} tokens (input_ids shapes {shapes}): "
                "leave out --prefill-seq-lens or recompile"
            )

    def _batched_rows(self, session: DeviceSession) -> tuple[int, ...]:
        """The batched prefill's row counts, read off the program (a program compiled before fewer rows
        were added has only ``prefill_batch_size``)."""
        if not self.prefill_batch_seq_len:
            return ()
        index = session.binding_index_map["input_ids"]
        width = self.prefill_batch_seq_len
        rows = {
            int(shape[index][1][0])
            for shape in session.allowed_shapes
            if list(shape[index][1])[1:] == [width]
        }
        return tuple(sorted(r for r in rows | {self.prefill_batch_size} if 1 < r <= self.prefill_batch_size))

    def _complete(self, inputs: dict[str, np.ndarray], decode: bool) -> dict[str, np.ndarray]:
        """Add the run's ``num_logits_to_keep`` (K+1 rows for a decode, 1 for a prefill) and its
        compute-context length: the shortest of its specialization's that holds the furthest position."""
        if self._keeps_logits or self._ccl_by_shape:
            rows, width = inputs["input_ids"].shape
            if self._keeps_logits:
                default = self._keep_decode if decode else self._keep_prefill
                inputs["num_logits_to_keep"] = self._keep_by_shape.get((rows, width), default)
            length = self.compute_context_length(rows, width, int(inputs["position_ids"].max()))
            if length is not None:
                inputs[COMP_CTX_LENGTHS] = self._ccl_arrays[length]
        return inputs

    def compute_context_length(self, rows: int, width: int, last_position: int) -> int | None:
        """The compute-context length a run of ``rows`` x ``width`` tokens reaching ``last_position``
        takes (None for a program without compute-context lengths)."""
        if not self._ccl_by_shape:
            return None
        return ccl.covering(self._ccl_by_shape.get((rows, width), self._all_ccls), last_position)

    def prefill_length(self, num_tokens: int) -> int:
        """The shortest compiled prefill length that holds ``num_tokens`` tokens."""
        for n in self.prefill_lens:
            if num_tokens <= n:
                return n
        return self.prefill_seq_len

    # -- prefill --------------------------------------------------------------------------
    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.full_batch_size:
            raise QaicConfigError(
                f"KV slot {slot} is out of range: full_batch_size is {self.full_batch_size} (slots 0 to "
                f"{self.full_batch_size - 1}); compile with a larger --full-batch-size for more slots"
            )

    def _check_positions(self, last_position: int, what: str) -> None:
        if last_position >= self.ctx_len:
            raise QaicConfigError(
                f"{what} reaches position {last_position} but the program holds ctx_len={self.ctx_len} "
                "positions: shorten the prompt or generation, or compile with a larger --ctx-len"
            )

    def submit_prefill_chunk(
        self, slot: int, token_ids: Sequence[int], start_pos: int
    ) -> LogitsHandle[np.ndarray | None]:
        """Start one chunk of at most ``prefill_seq_len`` tokens for ``slot``; wait() gives logits [vocab]."""
        self.check_slot(slot)
        n = len(token_ids)
        if n > self.prefill_seq_len:
            raise QaicConfigError(
                f"a prefill chunk holds at most prefill_seq_len={self.prefill_seq_len} tokens, got {n}: "
                "split the prompt (prefill() does) or raise --prefill-seq-len"
            )
        if n == 0:
            return LogitsHandle(None, lambda _: None)
        self._check_positions(start_pos + n - 1, f"the prompt ({start_pos + n} tokens)")
        length = self.prefill_length(n)
        ids = np.zeros((1, length), np.int64)
        ids[0, :n] = token_ids
        pos = np.full((1, length), PAD_POSITION, np.int64)
        pos[0, :n] = np.arange(start_pos, start_pos + n)
        inputs = {"input_ids": ids, "position_ids": pos}
        if self.continuous_batching:
            inputs["batch_index"] = self._slot_index[slot]
        run = self.session.submit(self._complete(inputs, decode=False), self.prefill_exec)
        return LogitsHandle(run, lambda out: out["logits"][0, -1])

    def submit_prefill_chunks(
        self, chunks: Sequence[tuple[int, Sequence[int], int]]
    ) -> LogitsHandle[list[np.ndarray | None]]:
        """Start up to ``prefill_batch_size`` chunks ``(slot, token_ids, start_pos)`` of different slots in
        one batched prefill run; wait() gives each chunk's last-token logits [vocab] (None if empty).

        The run takes the fewest compiled rows that hold the chunks (``prefill_batch_sizes``); rows
        beyond the chunks are padding (every position -1: nothing is written to any slot).
        """
        width = self.prefill_batch_seq_len
        rows = fewest_rows(self.prefill_batch_sizes, len(chunks), self.prefill_batch_size)
        if not width:
            raise QaicConfigError(
                "this program has no batched prefill: compile it with --prefill-batch-size > 1 "
                "(override_qaic_config prefill_batch_size)"
            )
        if len(chunks) > rows:
            raise QaicConfigError(
                f"{len(chunks)} chunks in one batched prefill, the program takes {rows}: submit at most {rows}"
            )
        slots = [slot for slot, _, _ in chunks]
        if len(set(slots)) != len(slots):
            raise QaicConfigError(f"a batched prefill needs chunks of different slots, got slots {slots}")
        ids = np.zeros((rows, width), np.int64)
        pos = np.full((rows, width), PAD_POSITION, np.int64)
        batch_index = np.zeros((rows, 1), np.int64)
        counts = []
        for row, (slot, tokens, start) in enumerate(chunks):
            self.check_slot(slot)
            n = len(tokens)
            if n > width:
                raise QaicConfigError(
                    f"a batched prefill chunk holds at most {width} tokens, got {n}: run it with "
                    "submit_prefill_chunk"
                )
            if n:
                self._check_positions(start + n - 1, f"the prompt in slot {slot} ({start + n} tokens)")
                ids[row, :n] = tokens
                pos[row, :n] = np.arange(start, start + n)
            batch_index[row, 0] = slot
            counts.append(n)
        inputs = {"input_ids": ids, "position_ids": pos, "batch_index": batch_index}
        run = self.session.submit(self._complete(inputs, decode=False), self.prefill_exec)

        def pick(out: dict[str, np.ndarray]) -> list[np.ndarray | None]:
            logits = out["logits"]
            return [logits[row, -1] if n else None for row, n in enumerate(counts)]

        return LogitsHandle(run, pick)

    def prefill_chunk(self, slot: int, token_ids: Sequence[int], start_pos: int) -> np.ndarray | None:
        """Run one chunk; the logits of its last real token (None for an empty chunk)."""
        return self.submit_prefill_chunk(slot, token_ids, start_pos).wait()

    def prefill(self, slot: int, token_ids: Sequence[int], start_pos: int = 0) -> np.ndarray:
        """Prefill a whole prompt chunk by chunk; the logits [vocab] of its last token."""
        if not token_ids:
            raise QaicConfigError("cannot prefill an empty prompt: give at least one token")
        self._check_positions(
            start_pos + len(token_ids) - 1, f"the prompt ({start_pos + len(token_ids)} tokens)"
        )
        logits: np.ndarray | None = None
        step = self.prefill_seq_len
        for offset in range(0, len(token_ids), step):
            logits = self.prefill_chunk(slot, token_ids[offset : offset + step], start_pos + offset)
        assert logits is not None
        return logits

    # -- decode ---------------------------------------------------------------------------
    def submit_decode(self, rows: Mapping[int, tuple[int, int]]) -> LogitsHandle[LogitRows]:
        """Start one full-batch decode; rows maps slot -> (token_id, position); wait() gives slot -> logits.

        A speculative target program has only the K+1-token decode: each token goes in its row's last
        column and the rest is padding (position -1), so its logits are the last row whichever way the
        program picks its K+1 rows (QEfficient's start at 0 when the last real token is in column <= K,
        ours end at the last real token).
        """
        inputs, index, slots = self._decode_inputs({slot: position for slot, (_, position) in rows.items()})
        if index is not None:
            inputs["input_ids"][index, -1] = [token for token, _ in rows.values()]
        return LogitsHandle(self.session.submit(inputs, self.decode_exec), _decode_pick(slots))

    def prepare_decode(self, positions: Mapping[int, int]) -> PreparedDecodeRun:
        """Make a full-batch decode ready before its tokens are known; positions maps slot -> position.

        Everything of the run but its tokens is built here (positions, compute-context length,
        buffers, specialization), so a caller can do it while the device still computes the step
        that samples those tokens; ``submit(token_ids)`` writes them and starts the run.
        """
        inputs, index, slots = self._decode_inputs(positions)
        return PreparedDecodeRun(self.session.prepare(inputs, self.decode_exec), index, slots)

    def _decode_inputs(
        self, positions: Mapping[int, int]
    ) -> tuple[dict[str, np.ndarray], np.ndarray | None, list[int]]:
        """A full-batch decode's inputs with every token 0; the row index of the listed slots, and the slots."""
        fbs = self.full_batch_size
        ids = np.zeros((fbs, self.decode_seq_len), np.int64)
        pos = np.full((fbs, self.decode_seq_len), PAD_POSITION, np.int64)
        slots = list(positions)
        index: np.ndarray | None = None
        if slots:
            index = np.array(slots, np.int64)
            at = np.fromiter(positions.values(), np.int64, len(slots))
            if index.min() < 0 or index.max() >= fbs or at.max() >= self.ctx_len:
                for slot, position in positions.items():  # the first offender, named
                    self.check_slot(slot)
                    self._check_positions(position, f"the sequence in slot {slot}")
            pos[index, -1] = at
        inputs = {"input_ids": ids, "position_ids": pos}
        if self.continuous_batching:
            inputs["batch_index"] = self._decode_batch_index
        return self._complete(inputs, decode=True), index, slots

    def decode(self, rows: Mapping[int, tuple[int, int]]) -> LogitRows:
        return self.submit_decode(rows).wait()

    def submit_decode_tokens(
        self, rows: Mapping[int, tuple[Sequence[int], int]]
    ) -> LogitsHandle[dict[int, np.ndarray]]:
        """Start a full-batch run of up to K+1 tokens per row (speculative verification).

        rows maps slot -> (token_ids, position of the first); wait() gives slot -> logits
        [len(token_ids), vocab], one row per token. Needs a program compiled with
        ``num_speculative_tokens`` K. The tokens end in the last column, padding (position -1) before
        them, as in :meth:`submit_decode`.
        """
        fbs, width = self.full_batch_size, self.decode_seq_len
        ids = np.zeros((fbs, width), np.int64)
        pos = np.full((fbs, width), PAD_POSITION, np.int64)
        counts: dict[int, int] = {}
        for slot, (tokens, start) in rows.items():
            self.check_slot(slot)
            n = len(tokens)
            if not 1 <= n <= width:
                raise QaicConfigError(
                    f"slot {slot}: {n} tokens in one decode, the program takes 1 to {width} "
                    f"(num_speculative_tokens + 1): compile with a larger --num-speculative-tokens"
                )
            self._check_positions(start + n - 1, f"the sequence in slot {slot}")
            ids[slot, width - n :] = tokens
            pos[slot, width - n :] = np.arange(start, start + n)
            counts[slot] = n
        inputs = {"input_ids": ids, "position_ids": pos}
        if self.continuous_batching:
            inputs["batch_index"] = self._decode_batch_index
        run = self.session.submit(self._complete(inputs, decode=True), self.decode_exec)
        return LogitsHandle(run, lambda out: {s: out["logits"][s, -n:] for s, n in counts.items()})

    def decode_tokens(self, rows: Mapping[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        return self.submit_decode_tokens(rows).wait()

    # -- generation -----------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | Sequence[int] | None = None
    ) -> list[list[int]]:
        """Greedy generation with continuous batching over the KV slots; one token list per prompt."""
        check_lengths(prompts, max_new_tokens, self.ctx_len)
        stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        results: list[list[int]] = [[] for _ in prompts]
        pending = deque(range(len(prompts)))
        free = list(range(self.full_batch_size))
        active: dict[int, tuple[int, int, int]] = {}  # slot -> (request, last token, its position)

        def accept(slot: int, request: int, token: int, position: int) -> None:
            results[request].append(token)
            if token in stops or len(results[request]) >= max_new_tokens:
                active.pop(slot, None)
                free.append(slot)
            else:
                active[slot] = (request, token, position)

        while pending or active:
            while pending and free:
                slot, request = free.pop(0), pending.popleft()
                logits = self.prefill(slot, prompts[request])
                log.debug("prefilled request %d in slot %d", request, slot)
                accept(slot, request, int(np.argmax(logits)), len(prompts[request]))
            if active:
                rows = {slot: (token, position) for slot, (_, token, position) in active.items()}
                out = self.decode(rows)
                for slot, (request, _, position) in list(active.items()):
                    accept(slot, request, int(np.argmax(out[slot])), position + 1)
        return results


def _decode_pick(slots: list[int]) -> Callable[[dict[str, np.ndarray]], LogitRows]:
    """A decode's logits by slot: the last column's row of each listed slot."""

    def pick(out: dict[str, np.ndarray]) -> LogitRows:
        return LogitRows(out["logits"][:, -1], slots)

    return pick


def _ccl_shapes(session: DeviceSession) -> dict[tuple[int, int], tuple[int, ...]]:
    """``input_ids`` shape -> the compute-context lengths its specializations take, ascending."""
    index = session.binding_index_map
    found: dict[tuple[int, int], set[int]] = {}
    shapes = session.allowed_shapes or [
        [(b.dtype.itemsize, list(b.dims)) for b in session.bindings]  # one specialization: the bindings
    ]
    for shape in shapes:
        ids, dims = shape[index["input_ids"]][1], shape[index[COMP_CTX_LENGTHS]][1]
        if len(ids) == 2 and len(dims) == 1 and dims[0] > 0:
            found.setdefault((int(ids[0]), int(ids[1])), set()).add(int(dims[0]))
    if not found:
        raise QaicConfigError(
            f"the program's {COMP_CTX_LENGTHS} input has no fixed length in any specialization: recompile "
            "it with compute-context lengths (ccl_enabled / comp_ctx_lengths_prefill / comp_ctx_lengths_decode)"
        )
    return {shape: tuple(sorted(lengths)) for shape, lengths in found.items()}


def _keep_shapes(session: DeviceSession) -> dict[tuple[int, int], np.ndarray]:
    """``input_ids`` shape -> the ``num_logits_to_keep`` buffer its specialization takes."""
    index = session.binding_index_map
    keep: dict[tuple[int, int], np.ndarray] = {}
    for shape in session.allowed_shapes:
        ids = shape[index["input_ids"]][1]
        dims = shape[index["num_logits_to_keep"]][1]
        if len(ids) == 2 and dims:
            keep.setdefault((int(ids[0]), int(ids[1])), _frozen(np.zeros(tuple(dims), np.int64)))
    return keep


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def check_lengths(prompts: Sequence[Sequence[int]], max_new_tokens: int, ctx_len: int) -> None:
    """Refuse prompts that, with their generation, would not fit the ``ctx_len`` KV positions."""
    if max_new_tokens < 1:
        raise QaicConfigError(
            f"max_new_tokens must be at least 1, got {max_new_tokens}: set --generation-len"
        )
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise QaicConfigError(f"prompt {i} is empty: give at least one token")
        if len(prompt) + max_new_tokens > ctx_len:
            raise QaicConfigError(
                f"prompt {i} has {len(prompt)} tokens and {max_new_tokens} are to be generated, more than "
                f"ctx_len={ctx_len}: shorten the prompt or --generation-len, or compile with a larger --ctx-len"
            )
