"""Checks of models and requests against what the AOT runner supports, failing early and clearly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qaic_core.errors import QaicConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from qaic_core.descriptors import ExecutionPath
    from qaic_vllm.pooling_config import PoolingEngine


def validate_model(vllm_config: VllmConfig, path: ExecutionPath) -> None:
    """Reject models and engine options the execution path cannot serve; each message names the fix.

    ``--runner pooling`` is checked by :func:`qaic_vllm.pooling_config.check_pooling`, which also sets
    vllm-qaic's pooling keys aside from the compile settings.
    """
    model_config = vllm_config.model_config
    assert model_config is not None
    from qaic_vllm.pooling_config import check_pooling

    check_pooling(vllm_config, path)
    pooling = model_config.runner_type == "pooling"
    if model_config.runner_type not in ("generate", "pooling"):
        raise QaicConfigError(
            f"--runner {model_config.runner_type} is not supported on the qaic {path.name} path: "
            "text generation (--runner generate) and pooling models (--runner pooling) are served"
        )
    if model_config.use_mla:
        raise QaicConfigError("MLA attention models (DeepSeek V2/V3 style) are not supported on Cloud AI")
    # A Hugging Face config may have no ``architectures`` (or no position limit below): read with a default.
    archs = list(getattr(model_config.hf_config, "architectures", None) or model_config.architectures or [])
    supported = path.pooling_architectures if pooling else path.architectures
    if not pooling and (not archs or not any(a in supported for a in archs)):
        raise QaicConfigError(
            f"model architecture {archs or 'unknown'} is not supported on Cloud AI ({path.name} path); "
            f"supported: {', '.join(sorted(supported))}"
        )
    if model_config.is_multimodal_model:
        raise QaicConfigError(f"multimodal models are not supported on the qaic {path.name} path yet")
    max_pos = getattr(model_config.hf_text_config, "max_position_embeddings", None) or getattr(
        model_config.hf_text_config, "n_positions", None
    )
    if max_pos is not None and model_config.max_model_len > int(max_pos):
        raise QaicConfigError(
            f"--max-model-len {model_config.max_model_len} exceeds the model's maximum position "
            f"({max_pos}): lower --max-model-len to at most {max_pos}"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise QaicConfigError(
            f"--tensor-parallel-size {parallel.tensor_parallel_size} / --pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size}: vLLM sees one device on Cloud AI; the compiler slices the "
            'model across SoCs instead: use --additional-config \'{"override_qaic_config": {"num_devices": N}}\''
        )
    if vllm_config.speculative_config is not None and "speculative_verify" not in path.capabilities:
        raise QaicConfigError(
            f"speculative decoding is not supported on the qaic {path.name} path: drop --speculative-config"
        )
    if vllm_config.lora_config is not None:
        raise QaicConfigError(
            f"LoRA adapters are not supported on the qaic {path.name} path yet: drop --enable-lora"
        )


def validate_sampling(params: Any, processed_inputs: Any = None) -> None:
    """Per-request check (``Platform.validate_request``): unsupported options get a 400 with the reason."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from qaic_vllm.pooling_config import engine

    pooling = engine()
    if pooling is not None:
        validate_pooling(params, processed_inputs, pooling)
        return
    if not isinstance(params, SamplingParams):
        raise VLLMValidationError(
            "this server generates text: pooling requests (embeddings, classification, scores) need a "
            "pooling model served with --runner pooling"
        )
    if params.prompt_logprobs is not None:
        raise VLLMValidationError(
            "prompt_logprobs is not supported on the qaic AOT path: the compiled program returns only the "
            "last position's logits; remove prompt_logprobs (logprobs of generated tokens work)",
            parameter="prompt_logprobs",
            value=params.prompt_logprobs,
        )


def validate_pooling(params: Any, processed_inputs: Any, engine: PoolingEngine) -> None:
    """Requests to a pooling model: no generation, no prompt past the longest ``embed_seq_len``."""
    from vllm.exceptions import VLLMValidationError
    from vllm.pooling_params import PoolingParams

    if not isinstance(params, PoolingParams):
        raise VLLMValidationError(
            f"this model is served as a pooling model ({engine.task}) with --runner pooling: it does not "
            "generate text; use the embeddings, classify, score or rerank endpoints"
        )
    ids = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
    if ids is not None and len(ids) > engine.max_seq_len:
        raise VLLMValidationError(
            f"the prompt has {len(ids)} tokens, more than the longest compiled sequence length "
            f"{engine.max_seq_len} (embed_seq_len, --max-model-len): shorten it or set truncate_prompt_tokens",
            parameter="input",
            value=len(ids),
        )
    if engine.normalized_on_device and params.use_activation is False:
        raise VLLMValidationError(
            "this model's program normalizes the embeddings (override_qaic_config normalize: true with "
            "pooling_device qaic), so use_activation=false (no normalization) cannot be honoured: drop it, "
            "or serve with normalize off",
            parameter="use_activation",
            value=False,
        )
