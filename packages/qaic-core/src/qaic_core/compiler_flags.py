"""The ``qaic-compile`` flags the stack knows, by kind: one table for the simulator and vLLM's overrides."""

from __future__ import annotations

BOOL_FLAGS = frozenset(
    {
        "aic-hw",
        "retained-state",
        "convert-to-fp16",
        "mxfp6-matmul",
        "aic-enable-depth-first",
        "compile-only",
        "aic-perf-warnings",
        "aic-perf-metrics",
        "mxint8-mdp-io",
        "multicast-weights",
        "enable-debug",
        "aic-include-sampler",
        "aic-pmu-recipe-enabled",
    }
)
"""Flags that take no value (``-aic-perf-metrics``)."""
VALUE_FLAGS = frozenset(
    {
        "aic-hw-version",
        "m",
        "aic-num-cores",
        "mos",
        "network-specialization-config",
        "custom-IO-list-file",
        "mdp-load-partition-config",
        "aic-binary-dir",
        "stats-batchsize",
        "ols",
        "onnx-define-symbol",
        "aic-pmu-recipe",
        "node-precision-info",
        "allocator-dealloc-delay",
        "size-split-granularity",
        "vtcm-working-set-limit-ratio",
        "mdts-mos",
        "aic-num-of-instances",
        "aic-hw-cfg",
        "io-crc",
        "time-passes",
    }
)
"""Flags written ``-name=value``."""
