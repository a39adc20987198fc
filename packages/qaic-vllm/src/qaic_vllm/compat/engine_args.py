"""Whether vLLM filled in ``max_num_seqs`` itself: the value the platform sees looks given either way.

vLLM has no public record of which engine arguments the user gave, so the step that fills in the
batch default (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``) is wrapped once and
marks the model config it filled the batch for (seam ``engine_args.batch_defaults``).
"""

from __future__ import annotations

import functools
from typing import Any

from qaic_vllm.compat.seams import SEAMS

DEFAULTED_MARK = "qaic_max_num_seqs_defaulted"
"""Attribute set on a ModelConfig whose engine's ``max_num_seqs`` vLLM chose (the user gave none)."""
_DEFAULTS_STEP = "_set_default_max_num_seqs_and_batched_tokens_args"
_WRAPPED = "qaic_batch_default_probe"


def install_batch_default_probe() -> None:
    """Wrap vLLM's batch-default step once, so :func:`batch_defaulted` can tell a chosen batch from a given one."""
    from vllm.engine.arg_utils import EngineArgs

    SEAMS["engine_args.batch_defaults"].probe()
    original = getattr(EngineArgs, _DEFAULTS_STEP)
    if getattr(original, _WRAPPED, False):  # only our wrapper carries the flag
        return

    @functools.wraps(original)
    def probe(self: Any, usage_context: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
        defaulted = self.max_num_seqs is None
        original(self, usage_context, model_config, *args, **kwargs)
        if defaulted:
            setattr(model_config, DEFAULTED_MARK, True)

    setattr(probe, _WRAPPED, True)
    setattr(EngineArgs, _DEFAULTS_STEP, probe)


def batch_defaulted(model_config: Any) -> bool:
    """vLLM chose this model config's ``max_num_seqs`` (installed probe; the user passed no batch)."""
    return bool(getattr(model_config, DEFAULTED_MARK, False))  # the mark exists only where vLLM chose
