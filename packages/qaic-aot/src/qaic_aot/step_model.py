"""The ``aot`` execution path: a compiled program (cached QPC) driven as a :class:`StepModel`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qaic_aot.causal_lm import CausalLM, LogitsHandle
from qaic_aot.compile import compile_model
from qaic_aot.iodesc import program_dir
from qaic_aot.session import QAICInferenceSession
from qaic_aot.validate import validate_qpc
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    OVERLAP,
    SPECULATIVE_VERIFY,
    ExecutionConfig,
    Pending,
    SlotKV,
    StepShape,
)

log = logging.getLogger("qaic.aot")

_NO_KV_TRANSFER = (
    "moving one slot's KV cache between host and device is not available on the aot path yet "
    "(the step model does not claim 'slot_kv_transfer'): serve without --kv-transfer-config"
)


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
        )
        caps = set()
        if lm.prefill_exec != lm.decode_exec:
            caps.add(OVERLAP)
        if lm.decode_seq_len > 1:
            caps.add(SPECULATIVE_VERIFY)
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
        handle: LogitsHandle = self.lm.submit_prefill_chunk(slot, token_ids, start_pos)
        return handle

    def submit_decode(self, rows: Mapping[int, tuple[int, int]]) -> Pending[dict[int, np.ndarray]]:
        handle: LogitsHandle = self.lm.submit_decode(rows)
        return handle

    def submit_decode_tokens(
        self, rows: Mapping[int, tuple[Sequence[int], int]]
    ) -> Pending[dict[int, np.ndarray]]:
        if SPECULATIVE_VERIFY not in self._capabilities:
            raise QaicConfigError(
                "this program decodes one token per sequence: compile it with --num-speculative-tokens K "
                "(override_qaic_config num_speculative_tokens) to verify K proposed tokens per step"
            )
        handle: LogitsHandle = self.lm.submit_decode_tokens(rows)
        return handle

    def release_slot(self, slot: int) -> None:
        """Nothing to free: the next sequence's prefill overwrites the slot's positions in order."""
        self.lm.check_slot(slot)

    def read_slot_kv(self, slot: int, num_tokens: int) -> SlotKV:
        raise QaicConfigError(_NO_KV_TRANSFER)

    def write_slot_kv(self, slot: int, kv: SlotKV) -> None:
        raise QaicConfigError(_NO_KV_TRANSFER)

    def close(self) -> None:
        if self.lm.session.is_active:
            self.lm.session.deactivate()  # frees the NSP cores for the next program


def check(config: ExecutionConfig) -> None:
    """Configuration-time checks: a prebuilt program must exist and hold a compiled program."""
    if config.qpc_path is None:
        return
    path = Path(config.qpc_path)
    try:
        program_dir(path)
    except QaicConfigError as exc:
        raise QaicConfigError(f"qpc_path {path}: {exc}") from exc


def open_step_model(config: ExecutionConfig) -> AotStepModel:
    """Compile the model for the configured shapes (cached), or check a prebuilt QPC, and load it."""
    settings = config.settings
    if config.qpc_path is not None:
        qpc_dir = Path(config.qpc_path)
        log.info("qaic: checking the prebuilt QPC %s against %s", qpc_dir, config.model_dir)
        validate_qpc(qpc_dir, config.model_dir, settings, backend=config.device)
    else:
        log.info(
            "qaic: compiling %s for full_batch_size=%d ctx_len=%d prefill_seq_len=%d (cached after the first time)",
            config.model_dir,
            settings.decode_batch_size,
            settings.ctx_len,
            settings.prefill_seq_len,
        )
        qpc_dir = Path(
            compile_model(config.model_dir, settings, backend=config.device, progress=config.progress)
        )
    program = program_dir(qpc_dir)
    log.info("qaic: program ready: %s", program)
    session = QAICInferenceSession(
        program,
        device_ids=list(settings.device_group) if settings.device_group else None,
        backend=config.device,
    )
    try:
        lm = CausalLM(session, settings)
    except Exception:
        session.deactivate()
        raise
    return AotStepModel(lm, qpc_dir)
