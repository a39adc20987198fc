"""The step model: what a serving runner drives, whatever the execution path behind it.

An execution path (``aot``: a compiled program; ``pyt``: model classes run eagerly) opens a
:class:`StepModel` for an :class:`ExecutionConfig`. A runner (the vLLM worker's, or any other)
is typed against these Protocols only, so it never imports the package that implements a path.

Two KV layouts exist:

- **slots** (``aot``): each sequence owns one KV slot of ``ctx_len`` positions on the device;
  a step is at most one prefill chunk per call plus one full-batch decode.
- **paged** (``pyt``, capability ``paged_kv``): the KV lives in blocks as vLLM lays them out;
  a step is one flattened batch with block tables (:class:`PagedStepModel`).

A pooling model (``ExecutionConfig.task`` ``embed`` or ``classify``) keeps no KV at all: a run
takes a batch of whole token sequences and returns hidden states, pooled vectors or class logits
(:class:`PoolingModel`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from qaic_core.settings import CompileSettings

if TYPE_CHECKING:
    from qaic_core.descriptors import DeviceBackend
    from qaic_core.resources import DeviceResources

T_co = TypeVar("T_co", covariant=True)

OVERLAP = "overlap"
"""A decode and a prefill chunk may be in flight together (separate exec objects)."""
SPECULATIVE_VERIFY = "speculative_verify"
"""``submit_decode_tokens`` takes up to ``decode_seq_len`` tokens per row and returns a logit row each."""
SLOT_KV_TRANSFER = "slot_kv_transfer"
"""``read_slot_kv`` / ``write_slot_kv`` move one sequence's KV between host and device."""
PAGED_KV = "paged_kv"
"""The model keeps its KV in vLLM's paged block layout (:class:`PagedStepModel`)."""
PREFIX_CACHING = "prefix_caching"
"""Blocks computed for one request can be reused by another with the same prefix."""
BATCHED_PREFILL = "batched_prefill"
"""``submit_prefill_chunks`` runs up to ``prefill_batch_size`` short chunks of different slots at once."""

STEP_CAPABILITIES = frozenset(
    {OVERLAP, SPECULATIVE_VERIFY, SLOT_KV_TRANSFER, PAGED_KV, PREFIX_CACHING, BATCHED_PREFILL}
)

GENERATE = "generate"
"""Task of a causal LM stepped token by token (:class:`StepModel` or :class:`PagedStepModel`)."""
EMBED = "embed"
"""Task of an embedding model: a sequence in, hidden states or one pooled vector out."""
CLASSIFY = "classify"
"""Task of a sequence classifier (a cross-encoder scores with it): a sequence in, class logits out."""
TASKS = (GENERATE, EMBED, CLASSIFY)
POOLING_TASKS = (EMBED, CLASSIFY)

POOL_ON_HOST = "cpu"
"""``pooling_device`` value: the program returns every token's hidden state; the host pools."""
POOL_ON_DEVICE = "qaic"
"""``pooling_device`` value: pooling (and normalization, when asked) is compiled into the program."""
POOLING_DEVICES = (POOL_ON_HOST, POOL_ON_DEVICE)
POOLING_METHODS = ("mean", "avg", "cls", "max", "last")
"""Pooling a program can compile in (QEfficient's names; ``avg`` is ``mean``, ``last`` the last real token)."""


@dataclass(frozen=True)
class PoolingSettings:
    """How a pooling model is compiled: its sequence-length specializations and where it pools.

    ``seq_lens`` are the ``embed_seq_len`` specializations in ascending order; a batch runs on the
    smallest that holds its longest sequence, padding masked. ``method`` and ``normalize`` apply
    when ``device`` is ``qaic`` (pooling compiled into the program) and are ignored on the host,
    where the serving framework pools; a classifier's head always runs in the program.
    """

    seq_lens: tuple[int, ...]
    device: str = POOL_ON_HOST
    method: str = "mean"
    normalize: bool = False

    def __post_init__(self) -> None:
        from qaic_core.errors import QaicConfigError

        if not self.seq_lens or any(not isinstance(n, int) or n < 1 for n in self.seq_lens):
            raise QaicConfigError(
                f"embed_seq_len {list(self.seq_lens)} must list positive sequence lengths, e.g. [32, 256]"
            )
        if list(self.seq_lens) != sorted(set(self.seq_lens)):
            object.__setattr__(self, "seq_lens", tuple(sorted(set(self.seq_lens))))
        if self.device not in POOLING_DEVICES:
            raise QaicConfigError(
                f"pooling_device {self.device!r} is not one of {', '.join(POOLING_DEVICES)}: cpu pools on "
                "the host, qaic compiles pooling into the program"
            )
        if self.method not in POOLING_METHODS:
            raise QaicConfigError(
                f"pooling_method {self.method!r} is not one of {', '.join(POOLING_METHODS)}"
            )

    @property
    def max_seq_len(self) -> int:
        return self.seq_lens[-1]

    def bucket(self, num_tokens: int) -> int:
        """The smallest compiled sequence length that holds ``num_tokens`` tokens."""
        for n in self.seq_lens:
            if num_tokens <= n:
                return n
        from qaic_core.errors import QaicConfigError

        raise QaicConfigError(
            f"a sequence of {num_tokens} tokens is longer than the largest embed_seq_len {self.max_seq_len}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_lens": list(self.seq_lens),
            "device": self.device,
            "method": self.method,
            "normalize": self.normalize,
        }


"""Capability names a step model may claim; a runner checks them instead of probing attributes."""


@dataclass(frozen=True)
class OpenOptions:
    """What a serving framework hands an execution path beyond the shapes: read by one path or another."""

    vllm_config: Any = None
    """vLLM's ``VllmConfig``: the eager (``pyt``) path builds vLLM's own model classes from it."""
    enable_debug_logs: bool = False
    """The runtime's debug logs on the program's sessions (``VLLM_QAIC_ENABLE_LRT_DEBUG``)."""


@dataclass(frozen=True)
class ExecutionConfig:
    """What an execution path needs to open a step model on a device group.

    ``settings`` gives the shapes (``full_batch_size`` slots, ``ctx_len``, ``prefill_seq_len``,
    ``device_group``) whichever path runs them; ``options`` carries what only one path reads
    (for the eager path, the serving framework's own configuration object).
    """

    model_dir: Path
    settings: CompileSettings
    device: DeviceBackend
    qpc_path: Path | None = None
    dtype: str = "float32"
    progress: bool = True
    options: OpenOptions = field(default_factory=OpenOptions)
    task: str = GENERATE
    """``generate`` opens a step model; ``embed`` / ``classify`` a :class:`PoolingModel`."""
    pooling: PoolingSettings | None = None
    """Sequence lengths and pooling of a pooling task (``settings.decode_batch_size`` rows per run)."""
    loader: str | None = None
    """The model loader by name (hook ``qaic_model_loaders``); None: ``QAIC_MODEL_LOADER``, else the path's default."""
    session: str | None = None
    """The session factory by name (hook ``qaic_session_factories``); None: ``QAIC_SESSION_FACTORY``, else the
    best available (``qaicrt``). Read by paths that run programs (``aot``)."""


def fewest_rows(row_counts: Sequence[int], num_chunks: int, largest: int) -> int:
    """The fewest of the ascending ``row_counts`` that hold ``num_chunks``; ``largest`` when none does
    (or none is listed: a program compiled with one row count)."""
    return next((rows for rows in row_counts if num_chunks <= rows), largest)


@dataclass(frozen=True)
class StepShape:
    """The static shape a step model runs: what the serving runner must plan around."""

    num_slots: int
    """KV slots (``full_batch_size``); a decode runs all of them at once."""
    prefill_seq_len: int
    """Most tokens of one prefill chunk."""
    ctx_len: int
    """Positions each slot holds."""
    vocab_size: int
    """Width of a logits row."""
    decode_seq_len: int = 1
    """Tokens per row of a decode (``num_speculative_tokens + 1`` for speculative verification)."""
    prefill_seq_lens: tuple[int, ...] = ()
    """Every compiled prefill chunk length, ascending (empty: only ``prefill_seq_len``); a chunk
    runs on the shortest that holds it, so the device computes little padding."""
    prefill_batch_size: int = 1
    """Chunks of different slots one ``submit_prefill_chunks`` runs together (``BATCHED_PREFILL``)."""
    prefill_batch_seq_len: int = 0
    """Most tokens of a chunk in a batched prefill (0 without ``BATCHED_PREFILL``)."""
    prefill_batch_sizes: tuple[int, ...] = ()
    """Every compiled row count of the batched prefill, ascending, ``prefill_batch_size`` the largest
    (empty: only ``prefill_batch_size``); a batch runs on the fewest rows that hold it."""

    def batched_rows(self, num_chunks: int) -> int:
        """Rows the device computes for a batched prefill of ``num_chunks``: the fewest compiled that hold them."""
        return fewest_rows(self.prefill_batch_sizes, num_chunks, self.prefill_batch_size)

    def split_batch(self, num_chunks: int) -> list[int]:
        """Chunks per run for ``num_chunks`` batchable chunks: the most that fill a compiled row count,
        again and again; a single chunk left runs on its own, a few more than one on the fewest rows
        that hold them (padded, when no compiled row count is that small)."""
        counts = sorted({*self.prefill_batch_sizes, self.prefill_batch_size}, reverse=True)
        out: list[int] = []
        left = num_chunks
        while left > 0:
            take = next((r for r in counts if r <= left), min(left, self.prefill_batch_size))
            out.append(take)
            left -= take
        return out

    def prefill_length(self, num_tokens: int) -> int:
        """Tokens the device computes for a chunk of ``num_tokens``: the shortest compiled length that holds it."""
        for n in self.prefill_seq_lens:
            if num_tokens <= n:
                return n
        return self.prefill_seq_len


@dataclass(frozen=True)
class SlotKV:
    """One sequence's KV cache on the host, as read from (or written to) its slot.

    ``tensors`` maps the program's KV input names (``past_key.0``, ``past_value.0``, ...) to
    arrays of shape ``[1, num_kv_heads, num_tokens, head_dim]``; ``dtype`` names the device's
    storage format (``float32``, ``float16`` or ``mxint8``) so a receiver can refuse a mismatch.
    """

    num_tokens: int
    tensors: Mapping[str, np.ndarray]
    dtype: str


class Pending(Protocol[T_co]):
    """Work in flight on the device; ``wait()`` blocks and returns its result."""

    def wait(self) -> T_co: ...


class LogitRows(Mapping[int, np.ndarray]):
    """A decode's logits by slot, as rows of the one ``[num_slots, vocab]`` array the device wrote.

    A step model may return it from a decode (it is a plain ``slot -> row`` mapping); a runner that
    samples many rows at once takes them with one ``take`` instead of one lookup per row.
    """

    def __init__(self, matrix: np.ndarray, slots: Sequence[int]) -> None:
        self.matrix = matrix
        self.slots = list(slots)
        self._listed: frozenset[int] | None = None

    def __getitem__(self, slot: int) -> np.ndarray:
        if self._listed is None:
            self._listed = frozenset(self.slots)
        if slot not in self._listed:
            raise KeyError(slot)
        return self.matrix[slot]  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[int]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of ``slots``, in that order, as one ``[len(slots), vocab]`` array."""
        return self.matrix[np.asarray(slots, dtype=np.int64)]  # type: ignore[no-any-return]


class PreparedDecode(Protocol):
    """A full-batch decode made ready before its tokens are known (``StepModel.prepare_decode``)."""

    def submit(self, token_ids: Sequence[int] | np.ndarray) -> Pending[Mapping[int, np.ndarray]]:
        """Write one token per prepared slot (in the order the positions were given) and start the run."""
        ...


@runtime_checkable
class StepModel(Protocol):
    """A model on a device group that a serving runner steps (slot KV layout).

    Rows of a decode map ``slot -> (token_id, position)``; logits come back as numpy rows of
    ``vocab_size`` (or wider: a runner slices to the vocabulary it samples from).
    """

    @property
    def shape(self) -> StepShape: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    def submit_prefill_chunk(
        self, slot: int, token_ids: Sequence[int], start_pos: int
    ) -> Pending[np.ndarray | None]:
        """Start one chunk of at most ``prefill_seq_len`` tokens; the last token's logits (None if empty)."""
        ...

    def submit_prefill_chunks(
        self, chunks: Sequence[tuple[int, Sequence[int], int]]
    ) -> Pending[list[np.ndarray | None]]:
        """Start up to ``prefill_batch_size`` chunks ``(slot, token_ids, start_pos)`` in one run (``BATCHED_PREFILL``).

        Each chunk holds at most ``prefill_batch_seq_len`` tokens and the slots differ; the result
        has the last token's logits of each chunk, in order.
        """
        ...

    def submit_decode(self, rows: Mapping[int, tuple[int, int]]) -> Pending[Mapping[int, np.ndarray]]:
        """Start one full-batch decode of one token per listed slot; slot -> logits row."""
        ...

    def prepare_decode(self, positions: Mapping[int, int]) -> PreparedDecode:
        """Build a full-batch decode of one token per listed slot (slot -> position) without starting it.

        Under asynchronous scheduling a runner prepares the next decode while the device still
        computes the step whose sampled tokens it takes, so only writing those tokens and handing
        the run over are left between the two runs. ``submit_decode(rows)`` is
        ``prepare_decode(positions).submit(tokens)``.
        """
        ...

    def submit_decode_tokens(
        self, rows: Mapping[int, tuple[Sequence[int], int]]
    ) -> Pending[Mapping[int, np.ndarray]]:
        """Start a decode of up to ``decode_seq_len`` tokens per slot (``SPECULATIVE_VERIFY``).

        ``rows`` maps slot -> (token ids, position of the first); the result maps slot -> logits
        ``[len(token_ids), vocab]``, one row per token.
        """
        ...

    def release_slot(self, slot: int) -> None:
        """The sequence in ``slot`` finished or was preempted; its KV may be overwritten."""
        ...

    def read_slot_kv(self, slot: int, num_tokens: int) -> SlotKV:
        """Copy the first ``num_tokens`` positions of a slot's KV to the host (``SLOT_KV_TRANSFER``)."""
        ...

    def write_slot_kv(self, slot: int, kv: SlotKV) -> None:
        """Place KV read elsewhere into ``slot`` so decoding continues without a prefill."""
        ...

    def recover(self) -> None:
        """Bring the device back after a failed run (reload and reactivate the program).

        Every slot's KV is lost: the runner fails or recomputes the sequences that held one.
        Raises when the device cannot be brought back.
        """
        ...

    def close(self) -> None:
        """Release the device (deactivate programs, free memory)."""
        ...


@dataclass(frozen=True)
class PagedKVSpec:
    """The paged KV cache a ``PAGED_KV`` model wants, for the serving framework to allocate."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str


@dataclass(frozen=True)
class PagedBatch:
    """One step of a ``PAGED_KV`` model: prefill chunks and decodes flattened into one batch.

    ``query_lens[i]`` tokens of sequence ``i`` run at ``positions``; its KV goes to the blocks in
    ``block_tables[i]``; ``seq_lens[i]`` counts its tokens after the step. Logits come back for
    the flattened rows listed in ``logits_indices``.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    block_tables: Sequence[Sequence[int]]
    logits_indices: Sequence[int]
    block_copies: Sequence[tuple[int, int]] = ()
    """``(source, destination)`` blocks to copy before the step (the framework's copy-on-write)."""


@dataclass(frozen=True)
class DeviceMemory:
    """A ``PAGED_KV`` model's view of its device memory, for the framework to size the KV cache."""

    total_bytes: int
    """DDR of the device group."""
    model_bytes: int
    """Held by this model (weights)."""
    free_bytes: int
    """Not held by anyone now."""


@runtime_checkable
class PagedStepModel(Protocol):
    """A model whose KV lives in paged blocks; a step is one :class:`PagedBatch`."""

    @property
    def shape(self) -> StepShape: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    @property
    def kv_spec(self) -> PagedKVSpec: ...

    @property
    def memory(self) -> DeviceMemory: ...

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on the device (after the framework sized the cache).

        Raises :class:`qaic_core.eager.DeviceMemoryError` when they do not fit.
        """
        ...

    def submit_batch(self, batch: PagedBatch) -> Pending[np.ndarray]:
        """Run one step; logits ``[len(logits_indices), vocab]``."""
        ...

    def recover(self) -> None:
        """Bring the device back after a failed run; every block's KV is lost.

        The runner fails or recomputes the requests that held blocks, and the scheduler forgets
        its cached prefixes. Raises when the device cannot be brought back.
        """
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PoolingShape:
    """The static shape of a pooling model: rows per run, compiled lengths and what a row returns."""

    batch_size: int
    """Sequences per run; a batch with fewer is padded with masked rows."""
    seq_lens: tuple[int, ...]
    """Compiled sequence lengths, ascending; a run uses the smallest that holds its longest sequence."""
    hidden_size: int
    output: str
    """``hidden`` (every token's hidden state), ``pooled`` (one vector) or ``logits`` (class logits)."""
    width: int
    """Length of a returned row: ``hidden_size`` for hidden and pooled output, the labels for logits."""


HIDDEN_OUTPUT = "hidden"
POOLED_OUTPUT = "pooled"
LOGITS_OUTPUT = "logits"


@runtime_checkable
class PoolingModel(Protocol):
    """A pooling model on a device group: whole sequences in, one result per sequence out (no KV)."""

    @property
    def pooling_shape(self) -> PoolingShape: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    def submit(self, sequences: Sequence[Sequence[int]]) -> Pending[list[np.ndarray]]:
        """Run up to ``batch_size`` token sequences, each at most the largest compiled length.

        The result has one array per sequence, in order: hidden states ``[num_tokens, hidden]``
        (output ``hidden``), a pooled vector ``[hidden]`` (``pooled``) or logits ``[num_labels]``
        (``logits``), as float32.
        """
        ...

    def recover(self) -> None:
        """Bring the device back after a failed run (reload the program)."""
        ...

    def close(self) -> None: ...


def check_capabilities(claimed: frozenset[str], who: str) -> None:
    """Refuse capability names that are not in :data:`STEP_CAPABILITIES` (a plugin's typo)."""
    unknown = sorted(claimed - STEP_CAPABILITIES)
    if unknown:
        from qaic_core.errors import QaicPluginError

        raise QaicPluginError(
            f"{who} claims unknown step capabilities {unknown}; known: {', '.join(sorted(STEP_CAPABILITIES))}"
        )


@dataclass(frozen=True)
class ShapeRequest:
    """Which batch and context to compile for, asked of an execution path before anything is built.

    ``settings`` holds the shape asked for; ``batch`` / ``ctx`` are None where the user gave no value
    (the path chooses one that fits), ``max_positions`` bounds the context.
    """

    model_dir: Path
    settings: CompileSettings
    devices: Sequence[DeviceResources]
    """The device group's free and total resources."""
    batch: int | None
    ctx: int | None
    max_positions: int


@dataclass(frozen=True)
class ShapeChoice:
    """The settings to compile for, and in words why and what the program will take."""

    settings: CompileSettings
    reason: str = ""
    memory: str = ""
