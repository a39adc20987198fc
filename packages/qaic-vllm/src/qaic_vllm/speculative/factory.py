"""Builds the proposer of a speculative method, checking the target program can verify its drafts."""

from __future__ import annotations

import dataclasses
import logging

from qaic_core.descriptors import ExecutionPath
from qaic_core.errors import QaicConfigError
from qaic_core.execution import SPECULATIVE_VERIFY, ExecutionConfig, StepModel
from qaic_vllm.speculative.config import DRAFT_OVERRIDE_KEY, SpecSettings
from qaic_vllm.speculative.draft import DraftModelProposer
from qaic_vllm.speculative.proposers import NgramProposer, Proposer, SuffixProposer

log = logging.getLogger("qaic.vllm.speculative")


def open_proposer(
    spec: SpecSettings, target: StepModel, path: ExecutionPath, config: ExecutionConfig
) -> Proposer:
    """The proposer for ``spec`` once ``target`` is known to verify ``num_speculative_tokens`` drafts."""
    k = spec.num_speculative_tokens
    if SPECULATIVE_VERIFY not in target.capabilities or target.shape.decode_seq_len < k + 1:
        raise QaicConfigError(
            f"the target program verifies {target.shape.decode_seq_len - 1} draft tokens per step but "
            f"num_speculative_tokens is {k}: compile it with num_speculative_tokens {k} (unset qpc_path to let "
            "the server compile) or lower num_speculative_tokens"
        )
    if spec.method == "ngram":
        log.info(
            "qaic: speculative decoding with n-gram lookup (n %d..%d, k=%d)",
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            k,
        )
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        log.info("qaic: speculative decoding with suffix matching (depth %d, k=%d)", spec.suffix_max_depth, k)
        return SuffixProposer(spec.suffix_max_depth, spec.suffix_max_cached)
    assert spec.draft is not None and spec.draft_model_dir is not None
    log.info(
        "qaic: speculative decoding with draft model %s on %d cores (target: %d cores, k=%d)",
        spec.draft_model_dir,
        spec.draft.num_cores,
        config.settings.num_cores,
        k,
    )
    draft_config = dataclasses.replace(
        config, model_dir=spec.draft_model_dir, settings=spec.draft, qpc_path=spec.draft_qpc_path
    )
    opened = path.open(draft_config)
    if not isinstance(opened, StepModel):
        opened.close()
        raise QaicConfigError(f"execution path {path.name!r} cannot run a draft model (it keeps paged KV)")
    return _draft_proposer(opened, target)


def _draft_proposer(draft: StepModel, target: StepModel) -> DraftModelProposer:
    """Check the draft program against the target before drafting with it."""
    problem = None
    if SPECULATIVE_VERIFY not in draft.capabilities:
        problem = (
            "the draft program must take two tokens per row (compiled with num_speculative_tokens 1): "
            f"unset {DRAFT_OVERRIDE_KEY} qpc_path to let the server compile it"
        )
    elif draft.shape.vocab_size != target.shape.vocab_size:
        problem = (
            f"the draft model has {draft.shape.vocab_size} logits per token and the target "
            f"{target.shape.vocab_size}: choose a draft of the same model family"
        )
    if problem is not None:
        draft.close()
        raise QaicConfigError(problem)
    return DraftModelProposer(draft)
