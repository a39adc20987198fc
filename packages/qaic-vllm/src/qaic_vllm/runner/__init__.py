"""Runners by role: each turns vLLM's scheduler output into device runs of one kind of model.

- :class:`~qaic_vllm.runner.slot.SlotModelRunner`: a slot-layout step model (``aot``), planned by
  :func:`~qaic_vllm.runner.plan.plan_step`, launched by :class:`~qaic_vllm.runner.launch.Launcher`,
  its steps in flight owned by :class:`~qaic_vllm.runner.pipeline.SlotPipeline`;
- :class:`~qaic_vllm.runner.paged.PagedModelRunner`: a paged-KV step model (``pyt``);
- :class:`~qaic_vllm.runner.pooling.PoolingModelRunner`: a pooling model (``--runner pooling``).

Sampling, the grammar's bitmask and vLLM's logprobs layout are :mod:`qaic_vllm.runner.sample`'s;
a device fault is contained the same way by all three (:mod:`qaic_vllm.runner.containment`).
"""

from qaic_vllm.runner.paged import PagedModelRunner
from qaic_vllm.runner.pooling import PoolingModelRunner
from qaic_vllm.runner.slot import SlotModelRunner

__all__ = ["PagedModelRunner", "PoolingModelRunner", "SlotModelRunner"]
