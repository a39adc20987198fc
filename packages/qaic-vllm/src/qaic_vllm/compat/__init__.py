"""vLLM's, torch's and argparse's private names, reached only through this package.

Each seam is one small function (or base class) in a submodule, and one :class:`Seam` in :data:`SEAMS`
naming what it reaches, the version it was checked with and a ``probe()`` that fails, naming the seam,
when an upgrade moved the name. The platform runs :func:`probe_all` when it starts, so a vLLM release
that moved one fails there rather than inside a step.

- :mod:`qaic_vllm.compat.scheduler`: the step limits, the step update, preemption and failing a request
- :mod:`qaic_vllm.compat.engine_args`: whether vLLM filled in ``max_num_seqs`` itself
- :mod:`qaic_vllm.compat.arguments`: the ``--kv-cache-dtype`` option of the ``vllm serve`` parser
- :mod:`qaic_vllm.compat.torch_device`: torch's accelerator calls and the PrivateUse1 device
- :mod:`qaic_vllm.compat.models`: vLLM's Sentence Transformers projector loader
"""

from __future__ import annotations

from qaic_vllm.compat.seams import (
    ARGPARSE_CHECKED,
    SEAMS,
    TORCH_CHECKED,
    VLLM_CHECKED,
    Seam,
    SeamMovedError,
    probe_all,
)

__all__ = [
    "ARGPARSE_CHECKED",
    "SEAMS",
    "TORCH_CHECKED",
    "VLLM_CHECKED",
    "Seam",
    "SeamMovedError",
    "probe_all",
]
