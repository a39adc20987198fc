"""Compile settings of a causal-LM program, validated with messages that name the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qaic_core.errors import QaicConfigError

MAX_CORES_PER_SOC = 16
MAX_DEVICES = 64


@dataclass(frozen=True)
class CompileSettings:
    """What a program is compiled for; names follow QEfficient's ``compile`` arguments."""

    prefill_seq_len: int = 32
    ctx_len: int = 128
    batch_size: int = 1
    full_batch_size: int | None = None
    num_cores: int = 16
    num_devices: int = 1
    device_group: tuple[int, ...] | None = None
    mxfp6: bool = False
    mxint8: bool = False
    mos: int | None = None
    aic_enable_depth_first: bool = False
    num_speculative_tokens: int | None = None
    convert_to_fp16: bool = True
    compiler_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CompileSettings:
        """Build from a dict (for example ``override_qaic_config``), rejecting unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        aliases = {"mxfp6_matmul": "mxfp6", "mxint8_kv_cache": "mxint8", "dfs": "aic_enable_depth_first"}
        clean: dict[str, Any] = {}
        for key, value in values.items():
            name = aliases.get(key, key)
            if name not in known:
                raise QaicConfigError(
                    f"unknown compile setting {key!r}; known settings: {', '.join(sorted(known))}"
                )
            if name in {"device_group", "compiler_args"} and value is not None:
                value = tuple(
                    value.split(",") if isinstance(value, str) and name == "device_group" else value
                )
                if name == "device_group":
                    try:
                        value = tuple(int(v) for v in value)
                    except ValueError:
                        raise QaicConfigError(
                            f"device_group {values[key]!r} is not a list of device ids: "
                            "write it as '0,1' or [0, 1] (--device-group)"
                        ) from None
            clean[name] = value
        return cls(**clean)

    def replace(self, **changes: Any) -> CompileSettings:
        return dataclasses.replace(self, **changes)

    @property
    def decode_batch_size(self) -> int:
        """Rows of a decode run: ``full_batch_size`` with continuous batching, else batch_size."""
        return self.full_batch_size or self.batch_size

    @property
    def decode_seq_len(self) -> int:
        return (self.num_speculative_tokens or 0) + 1

    def validate(self) -> None:
        _positive("prefill_seq_len", self.prefill_seq_len, "--prefill-seq-len")
        _positive("ctx_len", self.ctx_len, "--ctx-len")
        _positive("batch_size", self.batch_size, "--batch-size")
        if self.full_batch_size is not None:
            _positive("full_batch_size", self.full_batch_size, "--full-batch-size")
        if self.prefill_seq_len > self.ctx_len:
            raise QaicConfigError(
                f"prefill_seq_len ({self.prefill_seq_len}) must not exceed ctx_len ({self.ctx_len}): "
                "lower --prefill-seq-len or raise --ctx-len"
            )
        if not 1 <= self.num_cores <= MAX_CORES_PER_SOC:
            raise QaicConfigError(
                f"num_cores ({self.num_cores}) must be between 1 and {MAX_CORES_PER_SOC} "
                "(NSP cores per SoC): set --num-cores accordingly"
            )
        if not 1 <= self.num_devices <= MAX_DEVICES:
            raise QaicConfigError(
                f"num_devices ({self.num_devices}) must be between 1 and {MAX_DEVICES}: "
                "list the SoCs with --device-group"
            )
        if self.device_group is not None:
            if len(self.device_group) != self.num_devices:
                raise QaicConfigError(
                    f"device_group {list(self.device_group)} has {len(self.device_group)} devices but "
                    f"num_devices is {self.num_devices}: make them agree (--device-group)"
                )
            if len(set(self.device_group)) != len(self.device_group):
                raise QaicConfigError(
                    f"device_group {list(self.device_group)} lists a device twice: fix --device-group"
                )
            if any(d < 0 for d in self.device_group):
                raise QaicConfigError(
                    f"device_group {list(self.device_group)} has a negative device id: fix --device-group"
                )
        if self.mos is not None and self.mos < 1:
            raise QaicConfigError(f"mos ({self.mos}) must be >= 1 or unset: fix --mos")
        if self.num_speculative_tokens is not None:
            if self.num_speculative_tokens < 1:
                raise QaicConfigError(
                    f"num_speculative_tokens ({self.num_speculative_tokens}) must be >= 1 or unset: "
                    "fix --num-speculative-tokens"
                )
            if self.num_speculative_tokens + 1 > self.ctx_len:
                raise QaicConfigError(
                    f"num_speculative_tokens + 1 ({self.num_speculative_tokens + 1}) exceeds ctx_len "
                    f"({self.ctx_len}): lower --num-speculative-tokens or raise --ctx-len"
                )
        if self.full_batch_size is not None and self.batch_size > self.full_batch_size:
            raise QaicConfigError(
                f"batch_size ({self.batch_size}) must not exceed full_batch_size ({self.full_batch_size}): "
                "lower --batch-size or raise --full-batch-size"
            )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["device_group"] = list(self.device_group) if self.device_group is not None else None
        data["compiler_args"] = list(self.compiler_args)
        return data


def _positive(name: str, value: int, flag: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QaicConfigError(f"{name} must be a positive integer, got {value!r}: set {flag}")
