"""How long a program run takes on a device group: a roofline over DDR bandwidth and tensor-unit compute."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qaic_core.types import SKUS, SkuType
from qaic_sim.timing_cost import ProgramCost
from qaic_sim.timing_shape import DecoderShape

__all__ = [
    "DecoderShape",
    "DeviceTime",
    "HardwareModel",
    "ProgramCost",
    "decode_tokens_per_s",
    "device_breakdown",
    "device_time_s",
]

log = logging.getLogger("qaic.sim.timing")

BANDWIDTH_EFFICIENCY = 0.658
"""Achieved / nominal DDR bandwidth. One global fit over every published row (``fidelity.fit_constants``)."""

BATCH1_COMPUTE_EFFICIENCY = 0.00213
"""Achieved / peak fp16 rate of a matmul with one row. Same global fit; rows M give M / (M + 1/e - 1)."""

PCIE_GEN4_X8_BYTES_PER_S = 16e9 * 128 / 130
"""8 lanes x 16 GT/s with 128b/130b coding: each SoC's host and peer-to-peer link (product brief)."""

LAUNCH_OVERHEAD_S = 0.0
"""Per-run fixed cost. The global fit including it lands on 0 (the decode rows cannot resolve it)."""

P2P_LATENCY_S = 0.0
"""Per-collective latency between SoCs. The global fit including it lands on 0 as well."""


@dataclass(frozen=True)
class HardwareModel:
    """A device group's figures (totals over its devices) and the model's efficiency constants."""

    sku: SkuType
    num_devices: int
    num_cores: int
    ddr_bytes_per_s: float
    peak_flops: float
    peak_int8_ops: float
    host_bytes_per_s: float = PCIE_GEN4_X8_BYTES_PER_S
    p2p_bytes_per_s: float = PCIE_GEN4_X8_BYTES_PER_S
    launch_overhead_s: float = LAUNCH_OVERHEAD_S
    p2p_latency_s: float = P2P_LATENCY_S
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    batch1_compute_efficiency: float = BATCH1_COMPUTE_EFFICIENCY

    @classmethod
    def for_device_group(
        cls, sku: SkuType | str, num_devices: int = 1, num_cores: int | None = 16
    ) -> HardwareModel:
        """Figures for ``num_devices`` SoCs using ``num_cores`` NSPs each (None: every NSP of the SoC)."""
        try:
            spec = SKUS[SkuType(sku)]
        except ValueError:
            known = ", ".join(s.value for s in SkuType)
            raise ValueError(f"unknown SKU {sku!r}: use one of {known}") from None
        cores = spec.nsp_per_soc if num_cores is None else num_cores
        if not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
        if not isinstance(cores, int) or not 1 <= cores <= spec.nsp_per_soc:
            raise ValueError(
                f"num_cores={num_cores!r} does not fit a {spec.sku.value} SoC with {spec.nsp_per_soc} NSP cores; "
                f"set num_cores between 1 and {spec.nsp_per_soc}"
            )
        nsp_per_card = spec.socs * spec.nsp_per_soc
        return cls(
            sku=spec.sku,
            num_devices=num_devices,
            num_cores=cores,
            ddr_bytes_per_s=spec.ddr_gbps_per_soc * 1e9 * num_devices,
            peak_flops=spec.fp16_tflops_card * 1e12 / nsp_per_card * cores * num_devices,
            peak_int8_ops=spec.int8_tops_card * 1e12 / nsp_per_card * cores * num_devices,
        )

    def compute_utilisation(self, rows: int) -> float:
        """Fraction of peak a matmul with ``rows`` rows reaches: M / (M + M_half), one row = the fitted rate."""
        half = 1.0 / self.batch1_compute_efficiency - 1.0
        return rows / (rows + half)


@dataclass(frozen=True)
class DeviceTime:
    """Where a run's modelled time goes."""

    memory_s: float
    compute_s: float
    p2p_s: float
    host_s: float
    launch_s: float

    @property
    def total_s(self) -> float:
        """DDR streaming and compute overlap (roofline max); the rest adds."""
        return max(self.memory_s, self.compute_s) + self.p2p_s + self.host_s + self.launch_s


def device_breakdown(cost: ProgramCost, hw: HardwareModel) -> DeviceTime:
    """Split a run's time into memory, compute, collectives, host I/O and launch."""
    n = hw.num_devices
    collective = 0.0
    if n > 1:
        ring = 2 * (n - 1) / n  # ring all-reduce: each device sends and receives this share of the payload
        collective = cost.allreduces * hw.p2p_latency_s + cost.allreduce_bytes * ring / hw.p2p_bytes_per_s
    return DeviceTime(
        memory_s=cost.ddr_bytes / (hw.ddr_bytes_per_s * hw.bandwidth_efficiency),
        compute_s=cost.flops / (hw.peak_flops * hw.compute_utilisation(max(cost.tokens, 1))),
        p2p_s=collective,
        host_s=cost.activation_bytes / hw.host_bytes_per_s,
        launch_s=hw.launch_overhead_s,
    )


def device_time_s(cost: ProgramCost, hw: HardwareModel) -> float:
    """Modelled seconds for one run: max(DDR time, compute time) + collectives + host I/O + launch."""
    return device_breakdown(cost, hw).total_s


def decode_tokens_per_s(
    config: Mapping[str, Any] | Any,
    *,
    sku: SkuType | str,
    num_devices: int = 1,
    num_cores: int | None = 16,
    batch: int = 1,
    ctx_len: int,
    prompt_len: int,
    gen_len: int,
    weight_precision: str = "float16",
    kv_precision: str = "float16",
    hardware: HardwareModel | None = None,
) -> float:
    """Modelled decode throughput (tokens/s over all ``batch`` rows), averaged over the decode positions."""
    if prompt_len < 1 or gen_len < 1:
        raise ValueError(f"prompt_len and gen_len must be positive, got {prompt_len} and {gen_len}")
    if prompt_len + gen_len > ctx_len:
        raise ValueError(
            f"prompt_len {prompt_len} + gen_len {gen_len} exceeds ctx_len {ctx_len}; compile a longer ctx_len"
        )
    hw = hardware or HardwareModel.for_device_group(sku, num_devices, num_cores)
    # The first new token comes from prefill; each later one is one run of the (batch, 1, ctx_len) program.
    # The program's shapes are static, so every position reads the whole ctx_len window and costs the same.
    positions = range(prompt_len, prompt_len + max(gen_len - 1, 1))
    step = device_time_s(
        ProgramCost.for_decoder(
            config,
            batch=batch,
            seq_len=1,
            ctx_len=ctx_len,
            weight_precision=weight_precision,
            kv_precision=kv_precision,
        ),
        hw,
    )
    total = step * len(positions)
    log.debug("decode: %d positions, %.3f ms per step", len(positions), step * 1e3)
    return batch * len(positions) / total
