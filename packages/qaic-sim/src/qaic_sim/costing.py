"""A program's modelled cost per specialization: the compiler computes it once, the runtime reads it back.

A program whose cost cannot be modelled is an error (at compile time, or for a program compiled without
costs, at its first run), never a silent zero device time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qaic_core.errors import QaicError
from qaic_sim import mx
from qaic_sim.config import QAIC_SIM_TIMING
from qaic_sim.qpcfile import ProgramManifest
from qaic_sim.timing_cost import ProgramCost

if TYPE_CHECKING:
    import onnx

TIMING_OFF_HINT = (
    f"or set {QAIC_SIM_TIMING}=0 to run without modelled device time (runs report 0 s, no pacing)"
)


class TimingModelError(QaicError):
    """The timing model cannot give a program's device time; the message names the cause and the fix."""


def precisions(manifest: ProgramManifest) -> tuple[str, str]:
    """Weight and KV precision names of a program, as ``qaic_sim.mx.bytes_per_element`` takes them."""
    weights = "mxfp6" if manifest.mxfp6_matmul else ("float16" if manifest.convert_to_fp16 else "float32")
    kv_prec = next((manifest.precisions[n] for n in manifest.retained if n in manifest.precisions), None)
    if kv_prec is None:
        kv = "float16" if manifest.convert_to_fp16 else "float32"
    else:
        kv = "float32" if kv_prec == "float" else kv_prec
    return weights, kv


def program_costs(model: onnx.ModelProto, manifest: ProgramManifest, where: str) -> tuple[ProgramCost, ...]:
    """The cost of one run of every specialization of the (compiled) graph ``model``."""
    weights, kv = precisions(manifest)
    weight_bytes, kv_bytes = mx.bytes_per_element(weights), mx.bytes_per_element(kv)
    costs = []
    for spec in manifest.specs:
        try:
            cost = ProgramCost.from_onnx(
                model, spec.symbols, weight_bytes_per_param=weight_bytes, kv_bytes_per_elem=kv_bytes
            )
        except Exception as exc:  # shape inference and the graph walk raise many types
            raise TimingModelError(
                f"{where}: cannot model the device time of specialization {spec.name!r}: "
                f"{type(exc).__name__}: {exc}. Fix the graph so the timing model can size it, {TIMING_OFF_HINT}"
            ) from exc
        costs.append(cost)
    return tuple(costs)
