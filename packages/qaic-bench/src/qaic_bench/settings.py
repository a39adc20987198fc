"""What each benchmark part runs: shapes, request counts and the pacing target, quick or full."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from qaic_bench.server import ServeShape, Workload

DEFAULT_PACE_AS = "llama-2-7b"
"""The realistic shape the simulator is paced to by default (QAIC_SIM_PACE_AS)."""

_PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    # BenchSettings' first seven fields in order: batch, input_len, output_len, num_prompts,
    # prefill_seq_len, host_input_len, host_output_len
    "quick": (4, 64, 24, 8, 64, 16, 48),
    "full": (8, 96, 64, 32, 128, 32, 64),
}
"""What differs between ``--quick`` and a full run; everything else is a field default."""


@dataclass(frozen=True)
class BenchSettings:
    """One run's choices; ``quick()`` fits a 2-core laptop in minutes, ``full()`` in well under 20."""

    batch: int
    input_len: int
    output_len: int
    num_prompts: int
    prefill_seq_len: int
    host_input_len: int
    host_output_len: int
    max_model_len: int = 256
    host_batches: tuple[int, ...] = (1, 8, 32)
    pace_as: str = DEFAULT_PACE_AS
    topology: str = "ultra"
    spec_ks: tuple[int, ...] = (1, 2, 4)
    spec_input_len: int = 48
    spec_output_len: int = 48
    serve_prefill_batch: int = 2
    """Rows of the served program's batched prefill, each of ``prefill_seq_len`` tokens (parts 1, 5, 10)."""
    serve_partial_prefills: int | None = None
    """``max_num_partial_prefills`` of the served engine; None: the batch (every free slot starts a
    prompt in the next step, as the raw loop refills its slots)."""

    @classmethod
    def preset(cls, name: str, pace_as: str = DEFAULT_PACE_AS) -> BenchSettings:
        """The ``quick`` or ``full`` settings, paced to ``pace_as``."""
        settings = cls(*_PRESETS[name], pace_as=pace_as)
        if name == "quick":
            settings = replace(settings, spec_ks=(2, 4))
        return settings

    @classmethod
    def quick(cls, pace_as: str = DEFAULT_PACE_AS) -> BenchSettings:
        return cls.preset("quick", pace_as)

    @classmethod
    def full(cls, pace_as: str = DEFAULT_PACE_AS) -> BenchSettings:
        return cls.preset("full", pace_as)

    @property
    def serve_shape(self) -> ServeShape:
        return ServeShape(
            self.batch,
            self.max_model_len,
            self.prefill_seq_len,
            prefill_batch_size=self.serve_prefill_batch,
            prefill_batch_seq_len=self.prefill_seq_len if self.serve_prefill_batch > 1 else 0,
            max_num_partial_prefills=self.serve_partial_prefills or self.batch,
        )

    @property
    def workload(self) -> Workload:
        return Workload(self.input_len, self.output_len, self.num_prompts, self.batch)

    def host_shape(self, batch: int) -> ServeShape:
        return ServeShape(batch, self.max_model_len, self.prefill_seq_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
