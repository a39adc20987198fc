"""The ``aot`` execution path: a compiled program (cached QPC) driven as a :class:`StepModel`."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qaic_aot import compose, integrity
from qaic_aot.causal_lm import CausalLM
from qaic_aot.iodesc import program_dir
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    BATCHED_PREFILL,
    OVERLAP,
    SLOT_KV_TRANSFER,
    SPECULATIVE_VERIFY,
    ExecutionConfig,
    Pending,
    PreparedDecode,
    SlotKV,
    StepShape,
)

log = logging.getLogger("qaic.aot")

_NO_KV_TRANSFER = (
    "this program's KV cache cannot be moved slot by slot: the device backend does not claim 'slicing' "
    "or the program keeps no retained-state KV (past_key.N / past_value.N)"
)
KV_INPUT = re.compile(r"past_(key|value)\.\d+")


class AotStepModel:
    """One compiled causal LM on its device group, stepped by a serving runner."""

    def __init__(self, lm: CausalLM, qpc_dir: Path | None = None) -> None:
        self.lm = lm
        self.qpc_dir = qpc_dir
        self._shape = StepShape(
            num_slots=lm.full_batch_size,
            prefill_seq_len=lm.prefill_seq_len,
            ctx_len=lm.ctx_len,
            vocab_size=lm.vocab_size,
            decode_seq_len=lm.decode_seq_len,
            prefill_seq_lens=lm.prefill_lens,
            prefill_batch_size=lm.prefill_batch_size,
            prefill_batch_seq_len=lm.prefill_batch_seq_len,
            prefill_batch_sizes=lm.prefill_batch_sizes,
        )
        caps = set()
        if lm.prefill_batch_size > 1:
            caps.add(BATCHED_PREFILL)
        if lm.prefill_exec != lm.decode_exec:
            caps.add(OVERLAP)
        if lm.decode_seq_len > 1:
            caps.add(SPECULATIVE_VERIFY)
        bindings = {b.name: b for b in lm.session.bindings}
        self._kv_names = sorted(n for n in bindings if KV_INPUT.fullmatch(n))
        if self._kv_names and "slicing" in lm.session.device_backend.capabilities:
            caps.add(SLOT_KV_TRANSFER)
            item = bindings[self._kv_names[0]].dtype.itemsize
            self._kv_dtype = "mxint8" if lm.settings.mxint8 else str(bindings[self._kv_names[0]].dtype)
            self._kv_shapes = {n: tuple(int(d) for d in bindings[n].dims) for n in self._kv_names}
            self._write_spec = _slice_spec(r"past_(key|value)\.\d+", item)
            self._read_spec = _slice_spec(r"past_(key|value)\.\d+_RetainedState", item)
        self._capabilities = frozenset(caps)

    @property
    def shape(self) -> StepShape:
        return self._shape

    @property
    def capabilities(self) -> frozenset[str]:
        return self._capabilities

    def submit_prefill_chunk(
        self, slot: int, token_ids: Sequence[int], start_pos: int
    ) -> Pending[np.ndarray | None]:
        return self.lm.submit_prefill_chunk(slot, token_ids, start_pos)

    def submit_prefill_chunks(
        self, chunks: Sequence[tuple[int, Sequence[int], int]]
    ) -> Pending[list[np.ndarray | None]]:
        return self.lm.submit_prefill_chunks(chunks)

    def submit_decode(self, rows: Mapping[int, tuple[int, int]]) -> Pending[Mapping[int, np.ndarray]]:
        return self.lm.submit_decode(rows)

    def prepare_decode(self, positions: Mapping[int, int]) -> PreparedDecode:
        return self.lm.prepare_decode(positions)

    def submit_decode_tokens(
        self, rows: Mapping[int, tuple[Sequence[int], int]]
    ) -> Pending[Mapping[int, np.ndarray]]:
        if SPECULATIVE_VERIFY not in self._capabilities:
            raise QaicConfigError(
                "this program decodes one token per sequence: compile it with --num-speculative-tokens K "
                "(override_qaic_config num_speculative_tokens) to verify K proposed tokens per step"
            )
        return self.lm.submit_decode_tokens(rows)

    def release_slot(self, slot: int) -> None:
        """Nothing to free: the next sequence's prefill overwrites the slot's positions in order."""
        self.lm.check_slot(slot)

    def read_slot_kv(self, slot: int, num_tokens: int) -> SlotKV:
        """A no-op decode (every row at position -1) whose retained-state outputs are sliced to the slot."""
        self._check_transfer(slot, num_tokens)
        out = {}
        for name in self._kv_names:
            _, heads, _, dim = self._kv_shapes[name]
            out[f"{name}_RetainedState"] = np.zeros((1, heads, num_tokens, dim), self._binding_dtype(name))
        self.lm.session.run_with_slices(
            self._idle_inputs(), out, self._read_spec, [("batch_index", slot), ("ctx_start", 0)]
        )
        tensors = {name: out[f"{name}_RetainedState"] for name in self._kv_names}
        return SlotKV(num_tokens=num_tokens, tensors=tensors, dtype=self._kv_dtype)

    def write_slot_kv(self, slot: int, kv: SlotKV) -> None:
        """Write KV read elsewhere into ``slot`` (positions 0 to ``kv.num_tokens - 1``) with a no-op decode."""
        self._check_transfer(slot, kv.num_tokens)
        if kv.dtype != self._kv_dtype:
            raise QaicConfigError(
                f"the KV cache arrives as {kv.dtype} but this program keeps {self._kv_dtype}: compile both "
                "programs with the same dtype and kv-cache dtype"
            )
        missing = sorted(set(self._kv_names) - set(kv.tensors))
        if missing:
            raise QaicConfigError(f"the KV cache lacks {missing}: both programs must be the same model")
        slices = {}
        for name in self._kv_names:
            _, heads, _, dim = self._kv_shapes[name]
            arr = np.asarray(kv.tensors[name])
            if arr.shape != (1, heads, kv.num_tokens, dim):
                raise QaicConfigError(
                    f"{name} arrives as {list(arr.shape)} but this program needs "
                    f"{[1, heads, kv.num_tokens, dim]}: both programs must be the same model"
                )
            slices[name] = arr
        self.lm.session.run_with_slices(
            self._idle_inputs(), slices, self._write_spec, [("batch_index", slot), ("ctx_start", 0)]
        )

    def _check_transfer(self, slot: int, num_tokens: int) -> None:
        if SLOT_KV_TRANSFER not in self._capabilities:
            raise QaicConfigError(_NO_KV_TRANSFER)
        self.lm.check_slot(slot)
        if not 0 < num_tokens <= self.lm.ctx_len:
            raise QaicConfigError(
                f"{num_tokens} KV positions cannot be moved: a slot holds 1 to ctx_len={self.lm.ctx_len}"
            )

    def _binding_dtype(self, name: str) -> np.dtype:
        session = self.lm.session
        return session.bindings[session.binding_index_map[name]].dtype

    def _idle_inputs(self) -> dict[str, np.ndarray]:
        """A decode that computes nothing into the cache: every row at position -1."""
        fbs, width = self.lm.full_batch_size, self.lm.decode_seq_len
        inputs = {
            "input_ids": np.zeros((fbs, width), np.int64),
            "position_ids": np.full((fbs, width), -1, np.int64),
        }
        if self.lm.continuous_batching:
            inputs["batch_index"] = np.arange(fbs, dtype=np.int64).reshape(fbs, 1)
        return inputs

    def recover(self) -> None:
        """Reload the program; the session keeps its buffers (skipped KV, ``num_logits_to_keep``)."""
        self.lm.session.reload()

    def close(self) -> None:
        if self.lm.session.is_active:
            self.lm.session.deactivate()  # frees the NSP cores for the next program


def _slice_spec(pattern: str, item_size: int) -> str:
    """A slicing spec for one slot (``batch_index``) from position ``ctx_start`` of every KV buffer."""
    dims = [{"start": "batch_index"}, {"start": 0}, {"start": "ctx_start"}, {"start": 0}]
    return json.dumps({"BufferSpecs": [{"Name": pattern, "ElemSize": item_size, "DimSpecs": dims}]})


def check(config: ExecutionConfig) -> None:
    """Configuration-time checks: a prebuilt program must exist and be readable (not truncated or corrupt).

    Its checksums are compared when it is a cache entry with a manifest; otherwise the device
    backend reads its header, as loading it would.
    """
    if config.qpc_path is None:
        return
    path = Path(config.qpc_path)
    try:
        integrity.check_prebuilt(path, config.device)
    except QaicConfigError as exc:
        raise QaicConfigError(f"qpc_path {path}: {exc}") from exc


def open_step_model(config: ExecutionConfig) -> AotStepModel:
    """Load the program with the selected model loader (compiled and cached, or prebuilt and checked)
    and open it with the selected session factory (:mod:`qaic_aot.compose`)."""
    qpc_dir = compose.load_program(config)
    log.info("qaic: program ready: %s", program_dir(qpc_dir))
    session = compose.open_session(config, qpc_dir)
    try:
        lm = CausalLM(session, config.settings)
    except Exception:
        session.deactivate()
        raise
    return AotStepModel(lm, qpc_dir)
