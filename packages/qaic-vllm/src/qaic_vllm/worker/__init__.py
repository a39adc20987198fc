"""vLLM workers for Cloud AI, one per role: slot KV (``aot``), paged KV (``pyt``) and pooling.

:class:`~qaic_vllm.worker.base.QaicWorkerBase` holds what they share; each role implements
``open_model()``, which opens its kind of model through the selected execution path and returns
the runner (:mod:`qaic_vllm.runner`) that steps it.
"""

from qaic_vllm.worker.base import QaicWorkerBase
from qaic_vllm.worker.paged import QaicPagedWorker
from qaic_vllm.worker.pooling import QaicPoolingWorker
from qaic_vllm.worker.slot import QaicWorker

__all__ = ["QaicPagedWorker", "QaicPoolingWorker", "QaicWorker", "QaicWorkerBase"]
