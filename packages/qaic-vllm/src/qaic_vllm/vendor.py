"""vllm-qaic's (v0.23) configuration surface: every key, variable and engine argument it documents or reads,
and what each does here.

Each entry is honoured (it sets a compile setting or a qaic-compile flag), has no effect here as it
has none in vllm-qaic's AOT mode, or belongs to a feature this plugin lacks and is refused at start-up
with a message saying it is recognised. A value that leaves the feature off (``False``, ``None``,
an empty list) is accepted. docs/configuration.md carries the same tables.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qaic_core.compiler_flags import BOOL_FLAGS, VALUE_FLAGS
from qaic_core.errors import QaicConfigError

HONOURED = "honoured"
NO_EFFECT = "no effect"
UNSUPPORTED = "not supported"

DISAGG = "disaggregated prefill/decode serving"
SAMPLER = "on-device sampling"
POOLING = "pooling (embedding, classify, score) models"
MULTIMODAL = "vision-language and audio models"
LORA = "LoRA adapters"


@dataclass(frozen=True)
class VendorKey:
    """One vllm-qaic name: what it means there and what happens to it here."""

    name: str
    meaning: str
    handling: str
    here: str
    """The setting or flag it becomes, why it has no effect, or the feature it belongs to."""
    inert: tuple[Any, ...] = (None, False, "false", "False", 0, "0", "", (), [], {})
    """Values that leave the feature off: accepted even when the feature is not supported."""


def _unsupported(name: str, meaning: str, feature: str, inert: tuple[Any, ...] | None = None) -> VendorKey:
    if inert is None:
        return VendorKey(name, meaning, UNSUPPORTED, feature)
    return VendorKey(name, meaning, UNSUPPORTED, feature, inert)


OVERRIDE_KEYS: dict[str, VendorKey] = {
    k.name: k
    for k in (
        VendorKey(
            "num_cores", "NSP cores per device", HONOURED, "num_cores; default: the device's (nspTotal)"
        ),
        VendorKey("aic_num_cores", "same as num_cores", HONOURED, "num_cores"),
        VendorKey(
            "dfs", "depth-first scheduling, default on", HONOURED, "aic_enable_depth_first (default on)"
        ),
        VendorKey("aic_enable_depth_first", "same as dfs", HONOURED, "aic_enable_depth_first (default on)"),
        VendorKey(
            "mos", "weight splitting across cores, -1 = compiler's choice", HONOURED, "mos (-1: unset)"
        ),
        VendorKey("num_devices", "devices to slice the model over", HONOURED, "num_devices"),
        VendorKey("device_group", "device ids", HONOURED, "device_group"),
        VendorKey("device_ids", "same as device_group", HONOURED, "device_group"),
        VendorKey("device_id", "same as device_group (one id or a list)", HONOURED, "device_group"),
        VendorKey("mxfp6", "MX FP6 matmul weights", HONOURED, "mxfp6 (prefer --quantization mxfp6)"),
        VendorKey("mxfp6_matmul", "same as mxfp6", HONOURED, "mxfp6"),
        VendorKey("mxfp6_en", "same as mxfp6", HONOURED, "mxfp6"),
        VendorKey("mxint8", "MX INT8 KV cache", HONOURED, "mxint8 (prefer --kv-cache-dtype mxint8)"),
        VendorKey("mxint8_kv_cache", "same as mxint8", HONOURED, "mxint8"),
        VendorKey("mxint8_en", "same as mxint8", HONOURED, "mxint8"),
        VendorKey(
            "compiler_args",
            "extra compiler options as key=value pieces",
            HONOURED,
            "compiler_args (both forms)",
        ),
        VendorKey("qpc_path", "a prebuilt QPC to serve", HONOURED, "qpc_path"),
        VendorKey(
            "prefill_seq_len",
            "the prefill chunk",
            HONOURED,
            "prefill_seq_len (wins over --long-prefill-token-threshold)",
        ),
        VendorKey("mdts_mos", "weight splitting across tensor slices", HONOURED, "-mdts-mos=N"),
        VendorKey("aic_pmu_recipe", "PMU profiling recipe", HONOURED, "-aic-pmu-recipe=NAME"),
        VendorKey(
            "node_precision_info",
            "a node precision file (path)",
            HONOURED,
            "-node-precision-info=PATH; true (generate one, QEfficient) is not supported",
        ),
        _unsupported(
            "continuous_batching",
            "continuous batching, default on",
            "batching without KV slots (continuous batching is always on here)",
            (True, "true", "True", 1, "1", None),
        ),
        _unsupported("compile_only", "compile, then stop", "compile-only runs (use qaic-aot compile)"),
        _unsupported(
            "mdp_load_partition_config",
            "a hand-written device partition",
            "hand-written partitions (device_group and num_cores write it)",
            (None, ""),
        ),
        _unsupported("mdp_dump_partition_config", "dump the device partition", "partition dumps", (None, "")),
        _unsupported("mdp_compiler_dump_path", "compiler dump folder", "partition dumps", (None, "")),
        _unsupported("stages", "prefill pipeline stages", DISAGG, (None, 1, "1")),
        VendorKey(
            "ccl_enabled",
            "CCL with generated lists",
            HONOURED,
            "ccl_enabled: QEfficient's lists from --max-model-len (one length up to 4096)",
        ),
        VendorKey("comp_ctx_lengths_prefill", "CCL prefill lengths", HONOURED, "comp_ctx_lengths_prefill"),
        VendorKey("comp_ctx_lengths_decode", "CCL decode lengths", HONOURED, "comp_ctx_lengths_decode"),
        _unsupported("prefill_only", "compile the prefill (true) or decode (false) half", DISAGG, (None,)),
        _unsupported("split_retained_state_io", "separate KV input/output buffers", DISAGG),
        _unsupported("kv_cache_batch_size", "KV slots for prefix caching", "prefix caching", (None,)),
        _unsupported("aic_include_sampler", "sample on the device", SAMPLER),
        VendorKey(
            "aic_return_pdfs",
            "return probabilities from the device sampler",
            NO_EFFECT,
            "read only with aic_include_sampler",
        ),
        VendorKey(
            "max_top_k_ids",
            "top-k width of the device sampler",
            NO_EFFECT,
            "read only with aic_include_sampler",
        ),
        VendorKey(
            "aic_include_guided_decoding",
            "guided decoding in the device sampler",
            NO_EFFECT,
            "read only with aic_include_sampler",
        ),
        VendorKey(
            "pooling_device",
            "where pooling runs (qaic or cpu)",
            HONOURED,
            "cpu (default): the program returns hidden states, vLLM's pooler runs on the host; qaic: pooling "
            "compiled into the program (--runner pooling)",
        ),
        VendorKey(
            "pooling_method",
            "mean, avg, cls, max",
            HONOURED,
            "compiled in with pooling_device qaic (also last); default: the model's pooling type",
        ),
        VendorKey(
            "normalize",
            "normalize pooled outputs",
            HONOURED,
            "L2 normalization compiled in with pooling_device qaic; requests then cannot ask "
            "use_activation=false",
        ),
        VendorKey(
            "softmax",
            "softmax on pooled outputs",
            NO_EFFECT,
            "vLLM's classifier activation (softmax, or sigmoid for one label) applies to classify requests",
        ),
        VendorKey(
            "task",
            "pooling task (embed, classify, score)",
            HONOURED,
            "checked against the model: classify or score for …ForSequenceClassification, embed otherwise",
        ),
        VendorKey(
            "embed_seq_len",
            "sequence lengths of an embedding QPC",
            HONOURED,
            "one specialization per length, which must include --max-model-len; a batch runs on the smallest "
            "that fits",
        ),
        _unsupported("kv_offload", "vision and language in two QPCs", MULTIMODAL),
        _unsupported("num_patches", "image patches", MULTIMODAL, (None,)),
        _unsupported("height", "image heights", MULTIMODAL, (None,)),
        _unsupported("width", "image widths", MULTIMODAL, (None,)),
        _unsupported("img_size", "image size", MULTIMODAL, (None,)),
        _unsupported("max_num_tiles", "image tiles", MULTIMODAL, (None,)),
        _unsupported("vision_size", "vision tokens", MULTIMODAL, (None,)),
        _unsupported("encoder_ctx_len", "audio encoder length", MULTIMODAL, (None,)),
        _unsupported("skip_lang", "compile only the vision QPC", MULTIMODAL),
        _unsupported("skip_vision", "compile only the language QPC", MULTIMODAL),
        _unsupported("mm_processor_kwargs", "image processor pixels", MULTIMODAL, (None, {})),
        _unsupported("qaic_config", "QEfficient model options", "QEfficient model options", (None, {})),
        _unsupported(
            "pretrained_extra_args",
            "QEfficient from_pretrained arguments",
            "QEfficient model options",
            (None, {}),
        ),
    )
}
"""``override_qaic_config`` (and ``draft_override_qaic_config``) keys vllm-qaic documents or reads.

vllm-qaic ignores ``ctx_len``, ``batch_size``, ``full_batch_size`` and ``num_speculative_tokens``
there; this plugin refuses them naming the engine argument that sets them. Any other key that names
a qaic-compile flag (``aic_perf_metrics``) becomes that flag, as QEfficient passes compile options on.
"""

ADDITIONAL_KEYS: dict[str, VendorKey] = {
    k.name: k
    for k in (
        VendorKey("override_qaic_config", "compile settings of the model", HONOURED, "see the override keys"),
        VendorKey(
            "draft_override_qaic_config",
            "compile settings of a draft model",
            HONOURED,
            "the draft_model program's settings",
        ),
        VendorKey(
            "device_group", "device ids (override_qaic_config.device_group wins)", HONOURED, "device_group"
        ),
        _unsupported("lora_modules", "LoRA adapters compiled in", LORA, (None, [], ())),
        _unsupported("height", "image heights", MULTIMODAL, (None,)),
        _unsupported("width", "image widths", MULTIMODAL, (None,)),
    )
}
"""Top-level ``additional_config`` keys. Others are logged and ignored (other plugins may read them)."""

ENV_VARS: dict[str, VendorKey] = {
    k.name: k
    for k in (
        VendorKey("VLLM_QAIC_QPC_PATH", "a prebuilt QPC", HONOURED, "qpc_path"),
        VendorKey("VLLM_QAIC_NUM_CORES", "NSP cores (wins over additional_config)", HONOURED, "num_cores"),
        VendorKey("VLLM_QAIC_MOS", "-mos (-1: unset)", HONOURED, "mos"),
        VendorKey(
            "VLLM_QAIC_DFS_EN", "depth-first scheduling, default on", HONOURED, "aic_enable_depth_first"
        ),
        VendorKey(
            "VLLM_QAIC_COMPILER_ARGS", "extra compiler options", HONOURED, "compiler_args (both forms)"
        ),
        VendorKey("VLLM_QAIC_MAX_CPU_THREADS", "host torch threads", HONOURED, "torch.set_num_threads"),
        VendorKey(
            "VLLM_QAIC_SPEC_TARGET_QPC_PATH", "target QPC under speculation", HONOURED, "target qpc_path"
        ),
        VendorKey("VLLM_QAIC_SPEC_TARGET_MOS", "target -mos", HONOURED, "target mos"),
        VendorKey(
            "VLLM_QAIC_SPEC_TARGET_DFS_EN", "target depth-first", HONOURED, "target aic_enable_depth_first"
        ),
        VendorKey("VLLM_QAIC_SPEC_TARGET_QID", "target device ids", HONOURED, "target device_group"),
        VendorKey("VLLM_QAIC_SPEC_TARGET_NUM_CORES", "target NSP cores", HONOURED, "target num_cores"),
        VendorKey(
            "VLLM_QAIC_SPEC_TARGET_COMPILER_ARGS", "target compiler options", HONOURED, "target compiler_args"
        ),
        VendorKey("VLLM_QAIC_SPEC_DRAFT_QPC_PATH", "draft QPC", HONOURED, "draft qpc_path"),
        VendorKey("VLLM_QAIC_SPEC_DRAFT_MOS", "draft -mos", HONOURED, "draft mos"),
        VendorKey(
            "VLLM_QAIC_SPEC_DRAFT_DFS_EN", "draft depth-first", HONOURED, "draft aic_enable_depth_first"
        ),
        VendorKey("VLLM_QAIC_SPEC_DRAFT_KV_COMPRESSION", "draft MX INT8 KV", HONOURED, "draft mxint8"),
        VendorKey("VLLM_QAIC_SPEC_DRAFT_QID", "draft device ids", HONOURED, "draft device_group"),
        VendorKey("VLLM_QAIC_SPEC_DRAFT_NUM_CORES", "draft NSP cores", HONOURED, "draft num_cores"),
        VendorKey(
            "VLLM_QAIC_SPEC_DRAFT_COMPILER_ARGS", "draft compiler options", HONOURED, "draft compiler_args"
        ),
        VendorKey(
            "VLLM_QAIC_ENABLE_LRT_DEBUG", "runtime debug logs", HONOURED, "the session's enable_debug_logs"
        ),
        VendorKey(
            "VLLM_TORCH_QAIC_PROFILER_DIR",
            "device trace folder",
            HONOURED,
            "per-iteration device traces (as VLLM_TORCH_PROFILER_DIR)",
        ),
        VendorKey(
            "VLLM_QAIC_PREFILL_QUEUE_LEN",
            "prefill exec objects in flight",
            NO_EFFECT,
            "one prefill run is in flight at a time; short prompts share a batched prefill run",
        ),
        VendorKey(
            "VLLM_QAIC_ASYNC_SCHEDULING_EXEC_TIMEOUT",
            "async scheduling wait",
            NO_EFFECT,
            "a step waits for its device runs without a timeout of its own (dataPathTimeoutMs applies)",
        ),
        VendorKey(
            "VLLM_QAIC_USE_LEGACY_SLICING_SPEC",
            "disaggregated KV slicing format",
            NO_EFFECT,
            f"read only for {DISAGG}",
        ),
        VendorKey(
            "VLLM_QAIC_USE_FULL_KV_TRANSFER",
            "disaggregated KV transfer size",
            NO_EFFECT,
            f"read only for {DISAGG}",
        ),
        VendorKey(
            "VLLM_QAIC_LORA_MAX_ID_SUPPORTED", "LoRA adapter ids", NO_EFFECT, "read only with --enable-lora"
        ),
        VendorKey(
            "VLLM_DISABLE_LD_PRELOAD_OPT",
            "skip vllm-qaic's OpenMP tuning",
            NO_EFFECT,
            "this plugin does no OpenMP tuning",
        ),
        VendorKey(
            "VLLM_TORCH_QAIC_BASE_PATH", "torch_qaic wheels (PYT mode)", NO_EFFECT, "PYT (eager) mode only"
        ),
    )
}
"""``VLLM_QAIC_*`` and related variables vllm-qaic documents or reads at run time."""

ENGINE_ARGS: dict[str, VendorKey] = {
    k.name: k
    for k in (
        VendorKey("--quantization", "mxfp6", HONOURED, "mxfp6"),
        VendorKey(
            "--kv-cache-dtype",
            "mxint8 (fp8 maps to mxint8)",
            HONOURED,
            "mxint8, on the command line and in LLM()",
        ),
        VendorKey("--max-num-seqs", "decode batch", HONOURED, "full_batch_size; unset: sized to the device"),
        VendorKey("--max-model-len", "context length", HONOURED, "ctx_len; unset: sized to the device"),
        VendorKey(
            "--long-prefill-token-threshold", "prefill chunk, default 128", HONOURED, "prefill_seq_len"
        ),
        VendorKey(
            "--additional-config",
            "QAIC settings",
            HONOURED,
            "a JSON object (a string holding JSON or a Python dict is parsed too)",
        ),
        VendorKey(
            "--gpu-memory-utilization",
            "KV share of memory (PYT only)",
            NO_EFFECT,
            "the program fixes its memory",
        ),
        VendorKey(
            "--tensor-parallel-size", "QIDs to slice over", HONOURED, "num_devices (vLLM sees one device)"
        ),
        VendorKey(
            "--enforce-eager", "required for PYT; no effect in AOT", NO_EFFECT, "always eager on the host"
        ),
        VendorKey(
            "--async-scheduling",
            "AOT supports it",
            HONOURED,
            "on by default as in vLLM: the next step is scheduled while the device runs this one; "
            "--no-async-scheduling turns it off; off with speculative decoding, a KV connector, pooling and in PYT mode",
        ),
        VendorKey("--speculative-config", "ngram, suffix, draft_model", HONOURED, "speculative decoding"),
        VendorKey(
            "--runner",
            "pooling for embedding and reranker models",
            HONOURED,
            "pooling: embed, classify, score and rerank (docs/pooling.md)",
        ),
        _unsupported("--enable-mm-embeds", "multimodal embedding input", MULTIMODAL),
    )
}
"""The engine arguments vllm-qaic documents as QAIC-relevant."""


def refusal(where: str, key: VendorKey) -> QaicConfigError:
    """The start-up error for a recognised name whose feature this plugin lacks."""
    return QaicConfigError(
        f"{where} {key.name} is recognised (vllm-qaic: {key.meaning}) but not supported by this plugin yet: "
        f"{key.here} is missing here; remove it"
    )


def is_inert(key: VendorKey, value: Any) -> bool:
    """Whether ``value`` leaves ``key``'s feature off."""
    try:
        return any(value == off and type(value) is type(off) for off in key.inert) or value is None
    except TypeError:
        return False


def compiler_flag_key(key: str) -> bool:
    """Whether an override key names a qaic-compile flag (``aic_perf_metrics`` -> ``-aic-perf-metrics``)."""
    name = key.strip().lower().replace("_", "-")
    return name in BOOL_FLAGS or name in VALUE_FLAGS


def parse_additional_config(raw: Any) -> dict[str, Any]:
    """``additional_config`` as a dict: vllm-qaic also takes a JSON or Python-literal string."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            try:
                raw = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                raise QaicConfigError(
                    f"--additional-config {raw!r} is neither a JSON object nor a Python dict literal: "
                    'write it as \'{"override_qaic_config": {"num_cores": 16}}\''
                ) from None
    if not isinstance(raw, Mapping):
        raise QaicConfigError("--additional-config must be a JSON object")
    return dict(raw)


def check_keys(values: Mapping[str, Any], table: Mapping[str, VendorKey], where: str) -> list[str]:
    """Refuse keys whose feature is missing (unless off); return notes for keys that have no effect."""
    notes = []
    for name, value in values.items():
        key = table.get(name)
        if key is None:
            continue
        if key.handling == UNSUPPORTED and not is_inert(key, value):
            raise refusal(where, key)
        if key.handling == NO_EFFECT and value not in (None, ""):
            notes.append(f"{where} {name} has no effect here ({key.here}), as in vllm-qaic's AOT mode")
    return notes


def vendor_tables() -> str:
    """The Markdown tables docs/configuration.md carries for users of vllm-qaic (a test keeps them equal)."""

    def table(title: str, keys: Mapping[str, VendorKey]) -> str:
        rows = [f"**{title}**", "", "| vllm-qaic | its meaning | here | what happens |", "|---|---|---|---|"]
        for key in keys.values():
            rows.append(f"| `{key.name}` | {key.meaning} | {key.handling} | {key.here} |")
        return "\n".join(rows) + "\n"

    return "\n".join(
        [
            table("Engine arguments", ENGINE_ARGS),
            table("`additional_config` keys", ADDITIONAL_KEYS),
            table("`override_qaic_config` / `draft_override_qaic_config` keys", OVERRIDE_KEYS),
            table("Environment variables", ENV_VARS),
        ]
    )
