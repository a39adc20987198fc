"""The custom ONNX ops of a Cloud AI program, as QEfficient exports them and the compiler knows them.

One table for the exporter that writes them (qaic-aot) and the compiler that runs them (qaic-sim).
"""

from __future__ import annotations

KV_OPS_DOMAIN = "com.qualcomm.cloud"
"""Domain of the KV-cache ops: ``CtxScatter``, ``CtxGather`` and their ``CB`` variants."""

CUSTOM_OPS_DOMAIN = "com.qti.aisw.onnx"
"""Domain of the compiler-known ops QEfficient substitutes for model modules."""

RMS_NORM = "CustomRMSNorm"
"""``CustomRMSNorm(hidden_states, weight, epsilon=eps)``: RMSNorm over the last axis, one kernel."""

FUSED_KERNELS = frozenset({(CUSTOM_OPS_DOMAIN, RMS_NORM)})
"""(domain, op) of the custom ops the compiler runs as one kernel."""
