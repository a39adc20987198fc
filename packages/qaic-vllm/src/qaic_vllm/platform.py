"""The ``qaic`` platform: vLLM's view of a Cloud AI card (real or simulated), AOT path."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from qaic_core import get_plugin_manager
from qaic_core.descriptors import AttentionBackend, ExecutionPath
from qaic_core.env import QAIC_VISIBLE_DEVICES, env_flag
from qaic_core.errors import QaicConfigError
from qaic_core.execution import PAGED_KV
from qaic_vllm import envs
from qaic_vllm.compat import probe_all
from qaic_vllm.compat.arguments import accept_option_value
from qaic_vllm.compat.engine_args import install_batch_default_probe
from qaic_vllm.config import engine_settings, execution_path_of
from qaic_vllm.data_parallel import assign_device_groups
from qaic_vllm.faults import FaultSettings, check_devices, config_reported, install_exit_report
from qaic_vllm.overrides import adopt_engine_args
from qaic_vllm.prefill import prefill_budget
from qaic_vllm.quantization import register_mxfp6, register_mxint8_kv_cache
from qaic_vllm.sizing import apply_shape
from qaic_vllm.speculative.config import with_speculation
from qaic_vllm.torch_device import neutralise_accelerator

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

ASYNC_SCHEDULING_VAR = "QAIC_ASYNC_SCHEDULING"
"""``0`` turns vLLM's asynchronous scheduling off on the aot path, as ``--no-async-scheduling`` does.

Unset (or ``1``), vLLM decides: on unless ``--no-async-scheduling`` or a combination that needs it off.
"""

log = logging.getLogger("qaic.vllm")


def configure_logging() -> None:
    """Show the ``qaic`` loggers' INFO messages beside vLLM's when nobody configured logging."""
    root = logging.getLogger("qaic")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("(qaic) %(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO)


WORKER_CLS = "qaic_vllm.worker.QaicWorker"
SCHEDULER_CLS = "qaic_vllm.scheduler.QaicScheduler"
ATTN_BACKEND_CLS = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
"""vLLM asks for an attention backend path; the slot runner never builds vLLM attention layers."""


def attention_backend_class(path: ExecutionPath, backends: Mapping[str, AttentionBackend]) -> str:
    """The class path of the attention backend ``path`` runs with; paths without one get the placeholder."""
    if path.attention_backend is None:
        return ATTN_BACKEND_CLS
    backend = backends.get(path.attention_backend)
    if backend is None:
        raise QaicConfigError(
            f"execution path {path.name!r} ({path.package}) runs with attention backend "
            f"{path.attention_backend!r}, which no installed qaic plugin provides (installed: "
            f"{', '.join(sorted(backends)) or 'none'}): reinstall {path.package}"
        )
    return backend.class_path


class QaicPlatform(Platform):
    """Qualcomm Cloud AI 100 through the AOT path (QPC programs run by the qaic runtime)."""

    _enum = PlatformEnum.OOT
    device_name: str = "qaic"
    device_type: str = "cpu"
    dispatch_key: str = "PrivateUse1"
    device_control_env_var: str = QAIC_VISIBLE_DEVICES
    dist_backend: str = "gloo"
    ray_device_key: str = ""
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = ["mxfp6"]  # noqa: RUF012 - vLLM's own class attribute
    additional_env_vars: list[str] = list(envs.ENV_VARS)  # noqa: RUF012

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "Cloud AI 100"

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"qaic-{device_id}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 32 * 1024**3

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls) -> Any:
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def import_kernels(cls) -> None:
        return None

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
    ) -> str:
        """The attention backend the execution path names (qaic_attention_backends), else a placeholder."""
        from vllm.config import get_current_vllm_config

        pm = get_plugin_manager()
        path = pm.select_execution_path(execution_path_of(get_current_vllm_config()))
        return attention_backend_class(path, pm.attention_backends())

    @classmethod
    def is_aot_inference(cls) -> bool:
        """Whether the engine runs compiled programs (vllm-qaic's name); False on the eager path.

        Outside an engine (no current config, as in vllm-qaic's test collection) the variable and
        ``torch_qaic`` decide.
        """
        from vllm.config.vllm import get_current_vllm_config_or_none

        return execution_path_of(get_current_vllm_config_or_none()) == "aot"

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        """Keep block_size = max_model_len: one KV slot per sequence."""
        return None

    @classmethod
    def get_current_memory_usage(cls, device: Any = None) -> float:
        return 0.0

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """Accept ``--kv-cache-dtype mxint8`` on the command line (vLLM's fp8 value carries it); a pooling
        server answers generation endpoints with a 400 (``--middleware``'s default, see pooling_server)."""
        register_mxfp6()
        register_mxint8_kv_cache()
        install_batch_default_probe()
        if parser is None:
            return
        from qaic_vllm.metrics import claim_metrics_dir
        from qaic_vllm.pooling_server import add_to_parser

        claim_metrics_dir()  # this server's card-metrics folder, before its engine cores start
        add_to_parser(parser)
        accept_option_value(parser, "--kv-cache-dtype", "mxint8", _kv_cache_dtype_type)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Check everything that needs no model here, in the API process, before an engine starts."""
        with config_reported():
            cls._check_and_update_config(vllm_config)

    @classmethod
    def _check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        configure_logging()
        probe_all()  # a vLLM or torch release that moved a private name fails here, naming it
        neutralise_accelerator()
        envs.register_with_vllm()
        model_config = vllm_config.model_config
        if model_config is None:
            return
        from qaic_vllm.validation import validate_model

        adopt_engine_args(vllm_config)
        install_exit_report()
        FaultSettings.from_env()  # a bad fault setting fails here, not at the first fault
        pm = get_plugin_manager()
        check_devices(pm.select_device_backend())  # backend name, visible devices, simulator settings
        assign_device_groups(vllm_config)  # one group per local DP rank
        path = pm.select_execution_path(execution_path_of(vllm_config))
        if PAGED_KV in path.capabilities:  # the eager mode: vLLM's own scheduler and KV block layout
            from qaic_vllm.paged_config import configure_paged

            configure_paged(vllm_config, path)
            return
        validate_model(vllm_config, path)
        settings, spec = with_speculation(vllm_config, engine_settings(vllm_config, choose_shape=True))
        apply_shape(vllm_config, settings.compile)
        if path.check is not None:
            path.check(settings.execution_config(model_config.model, pm.select_device_backend()))
        prefill = settings.compile.prefill_seq_len
        full_batch = settings.compile.decode_batch_size
        decode_tokens = full_batch * settings.compile.decode_seq_len  # 1 + K per row with speculation
        batch_tokens = settings.compile.prefill_batch_size * (settings.compile.batched_prefill_seq_len or 0)
        budget = decode_tokens + prefill_budget(prefill, settings.max_num_partial_prefills, batch_tokens)

        parallel = vllm_config.parallel_config
        if parallel.worker_cls in ("auto", "", None):
            parallel.worker_cls = WORKER_CLS
        sched = vllm_config.scheduler_config
        sched.scheduler_cls = SCHEDULER_CLS
        if sched.async_scheduling:  # vLLM's default, or --async-scheduling
            blocker = async_scheduling_blocker(vllm_config, spec is not None)
            if blocker:
                log.info("qaic: async scheduling is off: %s", blocker)
                sched.async_scheduling = False
        sched.enable_chunked_prefill = True
        sched.long_prefill_token_threshold = prefill
        sched.max_num_batched_tokens = max(int(sched.max_num_batched_tokens), budget)
        if sched.max_num_scheduled_tokens is not None:
            sched.max_num_scheduled_tokens = max(int(sched.max_num_scheduled_tokens), budget)

        from qaic_vllm.paged_config import run_eagerly

        run_eagerly(vllm_config)

        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            log.warning(
                "qaic: prefix caching is not supported on Cloud AI (one KV slot per sequence); turning it off"
            )
        cache.enable_prefix_caching = False
        cache.block_size = int(model_config.max_model_len)
        cache.num_gpu_blocks_override = full_batch + 1
        log.info(
            "qaic: full_batch_size=%d ctx_len=%d prefill_seq_len=%d (%s)%s",
            full_batch,
            settings.compile.ctx_len,
            prefill,
            settings.dtype,
            f"; speculative {spec.method} with {spec.num_speculative_tokens} tokens" if spec else "",
        )
        if model_config.runner_type == "pooling":  # whole prompts in batches, the pooling worker
            from qaic_vllm.pooling_config import configure_pooling

            configure_pooling(vllm_config, settings.compile)

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: SamplingParams | Any) -> None:
        """Reject what the AOT runner cannot do, with the reason and the alternative."""
        from qaic_vllm.validation import validate_sampling

        validate_sampling(params, processed_inputs)

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        if quant != "mxfp6":
            raise QaicConfigError(
                f"--quantization {quant} is not supported on Cloud AI: use --quantization mxfp6 or none"
            )

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def use_all_gather(cls) -> bool:
        return False


def async_scheduling_blocker(vllm_config: VllmConfig, speculative: bool) -> str | None:
    """Why asynchronous scheduling cannot run with this configuration on the aot path; None when it can.

    The runner starts a step in ``execute_model`` and finishes it when vLLM reads the output, so vLLM
    schedules the next step while the device runs this one. Not with a proposer that drafts from the
    sampled tokens, a KV connector that reports per step, or the pooling worker (whole prompts per step).
    """
    if not env_flag(ASYNC_SCHEDULING_VAR, True):
        return f"{ASYNC_SCHEDULING_VAR}=0"
    if speculative:
        return "not supported with speculative decoding on Cloud AI (the proposer drafts from sampled tokens)"
    if vllm_config.kv_transfer_config is not None:
        return "not supported with a KV connector on Cloud AI (it reports per step)"
    model_config = vllm_config.model_config
    if model_config is not None and model_config.runner_type == "pooling":
        return "not supported for pooling models on Cloud AI (each step runs to the end)"
    return None


def _kv_cache_dtype_type(inner: Any) -> Any:
    """``mxint8`` travels through vLLM as ``fp8`` (vllm-qaic's mapping); other values go to vLLM's parser."""

    def convert(value: str) -> Any:
        if value == "mxint8":
            return "fp8"
        return inner(value) if callable(inner) else value

    return convert
