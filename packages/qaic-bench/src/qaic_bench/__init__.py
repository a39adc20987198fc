"""Benchmarks of the serving stack on the simulator: ``python -m qaic_bench --out DIR``.

Every figure in one report comes from one run: stack overhead of ``vllm serve`` against a raw
session loop, host overhead per decode step, a transformers baseline, timing-model fidelity and
start-up time. ``docs/performance.md`` explains each figure.
"""

from __future__ import annotations

__version__ = "0.1.0"
