"""What each benchmark part runs: shapes, request counts and the pacing target, quick or full."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qaic_vllm.bench.server import ServeShape, Workload

DEFAULT_PACE_AS = "llama-2-7b"
"""The realistic shape the simulator is paced to by default (QAIC_SIM_PACE_AS)."""


@dataclass(frozen=True)
class BenchSettings:
    """One run's choices; ``quick()`` fits a 2-core laptop in minutes, ``full()`` in well under 20."""

    batch: int
    input_len: int
    output_len: int
    num_prompts: int
    max_model_len: int
    prefill_seq_len: int
    host_batches: tuple[int, ...]
    host_input_len: int
    host_output_len: int
    pace_as: str = DEFAULT_PACE_AS
    topology: str = "ultra"

    @classmethod
    def quick(cls, pace_as: str = DEFAULT_PACE_AS) -> BenchSettings:
        return cls(
            batch=4,
            input_len=64,
            output_len=24,
            num_prompts=8,
            max_model_len=256,
            prefill_seq_len=64,
            host_batches=(1, 8, 32),
            host_input_len=16,
            host_output_len=48,
            pace_as=pace_as,
        )

    @classmethod
    def full(cls, pace_as: str = DEFAULT_PACE_AS) -> BenchSettings:
        return cls(
            batch=8,
            input_len=96,
            output_len=64,
            num_prompts=32,
            max_model_len=256,
            prefill_seq_len=128,
            host_batches=(1, 8, 32),
            host_input_len=32,
            host_output_len=64,
            pace_as=pace_as,
        )

    @property
    def serve_shape(self) -> ServeShape:
        return ServeShape(self.batch, self.max_model_len, self.prefill_seq_len)

    @property
    def workload(self) -> Workload:
        return Workload(self.input_len, self.output_len, self.num_prompts, self.batch)

    def host_shape(self, batch: int) -> ServeShape:
        return ServeShape(batch, self.max_model_len, self.prefill_seq_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
