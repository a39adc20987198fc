"""``--runner pooling`` on Cloud AI: vllm-qaic's pooling keys, the task, and the engine shaped for whole-prompt batches.

vllm-qaic's ``override_qaic_config`` keys for pooling models are read here: ``embed_seq_len`` (the
sequence-length specializations, which must include ``--max-model-len``), ``pooling_device``
(``cpu``: the program returns hidden states and vLLM's pooler runs on the host; ``qaic``: pooling is
compiled in), ``pooling_method`` and ``normalize`` (compiled in with ``qaic``), ``softmax`` (vLLM's
classifier activation already applies it) and ``task`` (their rows in ``qaic_vllm.vendor``). They
are moved out of ``override_qaic_config``, keys and ``compiler_args`` pieces alike
(``"compiler_args": "embed_seq_len=32,256"``, as vllm-qaic reads them), into
``additional_config["qaic_pooling"]`` so that the compile settings never see them; this module parses
and checks them (:func:`pooling_settings`, :func:`pooling_task`), at start-up and in the worker.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qaic_core.env import parse_bool
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    CLASSIFY,
    EMBED,
    POOL_ON_DEVICE,
    POOL_ON_HOST,
    POOLING_DEVICES,
    POOLING_METHODS,
    PoolingSettings,
)
from qaic_core.settings import split_arguments
from qaic_vllm import vendor

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from qaic_core.descriptors import ExecutionPath
    from qaic_core.settings import CompileSettings

log = logging.getLogger("qaic.vllm.pooling")

OVERRIDE_KEY = "override_qaic_config"
POOLING_KEY = "qaic_pooling"
"""``additional_config`` entry holding the pooling keys once they are set aside."""
POOLING_KEYS = ("embed_seq_len", "pooling_device", "pooling_method", "normalize", "softmax", "task")
"""vllm-qaic's ``override_qaic_config`` keys of pooling models."""
TASKS = {"embed": EMBED, "classify": CLASSIFY, "score": CLASSIFY}
"""vllm-qaic's ``task`` values -> the task the program serves (vLLM maps ``score`` onto ``classify``)."""
SEQ_POOLING = {"MEAN": "mean", "CLS": "cls", "LAST": "last"}
"""vLLM's sequence pooling types -> the method compiled in when ``pooling_method`` is unset."""
SIZED_KEY = "qaic_sized_shape"
"""``additional_config`` entry of the checked batch and context (the device sizing skips a recorded shape)."""
WORKER_CLS = "qaic_vllm.worker.QaicPoolingWorker"
SCHEDULER_CLS = "qaic_vllm.scheduler.QaicPoolingScheduler"


@dataclass(frozen=True)
class PoolingEngine:
    """What the API process remembers to check pooling requests (``Platform.validate_request``)."""

    task: str
    max_seq_len: int
    normalized_on_device: bool


_engine: PoolingEngine | None = None


def engine() -> PoolingEngine | None:
    """The pooling engine configured last in this process (None: a generation engine)."""
    return _engine


def is_pooling(vllm_config: VllmConfig) -> bool:
    model_config = vllm_config.model_config
    return model_config is not None and model_config.runner_type == "pooling"


def set_aside(vllm_config: VllmConfig) -> dict[str, Any]:
    """Move the pooling keys out of ``override_qaic_config`` (idempotent); returns them.

    A generation engine given pooling keys (other than values that leave pooling off) is refused.
    """
    additional = vllm_config.additional_config
    if not isinstance(additional, dict):
        return {}
    override = additional.get(OVERRIDE_KEY)
    kept = dict(additional.get(POOLING_KEY) or {})
    if isinstance(override, Mapping):
        rest = {}
        pieces: dict[str, Any] = {}
        for key, value in override.items():
            name = _name(key)
            if name in POOLING_KEYS:
                kept[name] = value
            elif name == "compiler_args" and isinstance(value, str):
                args = _pooling_pieces(value, pieces)
                if args:
                    rest[key] = args
            else:
                rest[key] = value
        kept.update(pieces)  # a compiler_args piece wins over the key, as it does for the compile settings
        additional[OVERRIDE_KEY] = rest
    given = {k: v for k, v in kept.items() if v not in (None, False, "", [], ())}
    if given and not is_pooling(vllm_config):
        raise QaicConfigError(
            f"--additional-config {OVERRIDE_KEY} {sorted(given)} configure a pooling model: serve it with "
            "--runner pooling, or remove them"
        )
    additional[POOLING_KEY] = kept
    return kept


def _name(key: object) -> str:
    return str(key).strip().lower().replace("-", "_")


def _pooling_pieces(compiler_args: str, into: dict[str, Any]) -> str:
    """vllm-qaic's ``key=value`` pieces of ``compiler_args`` that name pooling keys go into ``into``;
    returns the rest (``compiler_args`` unchanged when it names none)."""
    pieces = split_arguments(compiler_args, f"--additional-config {OVERRIDE_KEY} compiler_args")
    rest = []
    for piece in pieces:
        key, eq, value = piece.partition("=")
        if not piece.startswith("-") and _name(key) in POOLING_KEYS:
            into[_name(key)] = value if eq else True
        else:
            rest.append(piece)
    return compiler_args if len(rest) == len(pieces) else shlex.join(rest)


def _seq_lens(raw: Any, max_model_len: int) -> tuple[int, ...]:
    what = f"--additional-config {OVERRIDE_KEY} embed_seq_len"
    if raw is None:
        return (max_model_len,)
    values = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list | tuple) else [raw]
    try:
        lens = sorted({int(str(v).strip()) for v in values if str(v).strip()})
    except ValueError:
        raise QaicConfigError(
            f"{what} {raw!r} is not a list of sequence lengths: write it as [32, 256]"
        ) from None
    if not lens or lens[0] < 1:
        raise QaicConfigError(
            f"{what} {raw!r} must list positive sequence lengths, e.g. [32, {max_model_len}]"
        )
    if lens[-1] > max_model_len:
        raise QaicConfigError(
            f"{what} {lens} has {lens[-1]}, longer than --max-model-len {max_model_len}: raise --max-model-len "
            "or drop it"
        )
    if max_model_len not in lens:
        raise QaicConfigError(
            f"{what} {lens} must include --max-model-len {max_model_len} (as in vllm-qaic): add it, so the "
            "longest prompt vLLM admits has a specialization"
        )
    return tuple(lens)


def pooling_task(vllm_config: VllmConfig) -> str:
    """``classify`` for sequence classifiers (cross-encoders score with it), ``embed`` otherwise."""
    model_config = vllm_config.model_config
    archs = list(getattr(model_config.hf_config, "architectures", None) or model_config.architectures or [])
    task = CLASSIFY if any(a.endswith("ForSequenceClassification") for a in archs) else EMBED
    given = _keys(vllm_config).get("task")
    if given is not None:
        wanted = TASKS.get(str(given).strip().lower())
        if wanted is None:
            raise QaicConfigError(
                f"--additional-config {OVERRIDE_KEY} task {given!r} is not one of {', '.join(TASKS)}"
            )
        if wanted != task:
            raise QaicConfigError(
                f"--additional-config {OVERRIDE_KEY} task {given!r}: {archs[0] if archs else 'the model'} serves "
                f"{task}; a cross-encoder (…ForSequenceClassification) serves classify and score, other models embed"
            )
    return task


def _keys(vllm_config: VllmConfig) -> dict[str, Any]:
    additional = vllm_config.additional_config
    return dict(additional.get(POOLING_KEY) or {}) if isinstance(additional, dict) else {}


def pooling_settings(vllm_config: VllmConfig) -> PoolingSettings:
    """The program's ``embed_seq_len`` lengths and pooling, from the keys and vLLM's pooler config."""
    keys = _keys(vllm_config)
    max_model_len = int(vllm_config.model_config.max_model_len)
    seq_lens = _seq_lens(keys.get("embed_seq_len"), max_model_len)
    device = str(keys.get("pooling_device") or POOL_ON_HOST).strip().lower()
    if device not in POOLING_DEVICES:
        raise QaicConfigError(
            f"--additional-config {OVERRIDE_KEY} pooling_device {device!r} is not one of "
            f"{', '.join(POOLING_DEVICES)} (cpu: vLLM pools the hidden states on the host; qaic: in the program)"
        )
    method = keys.get("pooling_method")
    if method is None:
        method = SEQ_POOLING.get(_seq_pooling_type(vllm_config), "mean")
    method = str(method).strip().lower()
    if method not in POOLING_METHODS:
        raise QaicConfigError(
            f"--additional-config {OVERRIDE_KEY} pooling_method {method!r} is not one of {', '.join(POOLING_METHODS)}"
        )
    normalize = parse_bool(keys.get("normalize", False), f"--additional-config {OVERRIDE_KEY} normalize")
    if device == POOL_ON_HOST and (keys.get("pooling_method") is not None or normalize):
        log.info(
            "qaic: pooling_method and normalize are compiled in only with pooling_device qaic; with cpu "
            "vLLM's pooler pools (%s) and normalizes as each request asks",
            _seq_pooling_type(vllm_config),
        )
    return PoolingSettings(seq_lens=seq_lens, device=device, method=method, normalize=normalize)


def _seq_pooling_type(vllm_config: VllmConfig) -> str:
    pooler = vllm_config.model_config.pooler_config
    try:
        return str(pooler.get_seq_pooling_type()) if pooler is not None else "MEAN"
    except Exception:  # older or newer PoolerConfig spellings
        return str(
            getattr(pooler, "seq_pooling_type", None) or getattr(pooler, "pooling_type", None) or "MEAN"
        )


def check_pooling(vllm_config: VllmConfig, path: ExecutionPath) -> None:
    """Configuration-time checks of ``--runner pooling``; sets the pooling keys aside (see the module)."""
    global _engine
    set_aside(vllm_config)
    if not is_pooling(vllm_config):
        _engine = None
        return
    model_config = vllm_config.model_config
    archs = list(getattr(model_config.hf_config, "architectures", None) or model_config.architectures or [])
    supported = path.pooling_architectures
    if not supported:
        raise QaicConfigError(
            f"--runner pooling is not supported on the qaic {path.name} path: use the aot execution path"
        )
    if not archs or not any(a in supported for a in archs):
        raise QaicConfigError(
            f"model architecture {archs or 'unknown'} is not supported as a pooling model on Cloud AI "
            f"({path.name} path); supported: {', '.join(sorted(supported))}"
        )
    keys = _keys(vllm_config)
    table = {k: v for k, v in vendor.OVERRIDE_KEYS.items() if k in POOLING_KEYS}
    for note in vendor.check_keys(keys, table, f"--additional-config {OVERRIDE_KEY}"):
        log.info("qaic: %s", note)  # softmax
    pooling_task(vllm_config)
    pooling_settings(vllm_config)
    if isinstance(vllm_config.additional_config, dict):
        # The device sizing of --max-num-seqs / --max-model-len counts a causal LM's KV cache; a pooling
        # program keeps none, so its shape is the one given (or vLLM's default) and is not sized again.
        shape = [int(vllm_config.scheduler_config.max_num_seqs), int(model_config.max_model_len)]
        vllm_config.additional_config.setdefault(SIZED_KEY, shape)


def configure_pooling(vllm_config: VllmConfig, settings: CompileSettings) -> None:
    """Engine settings of a pooling model: whole prompts, as many as the compiled batch, per step."""
    global _engine
    if settings.ccl:
        raise QaicConfigError(
            "compute-context lengths (override_qaic_config ccl_enabled / comp_ctx_lengths_prefill / "
            "comp_ctx_lengths_decode) apply to a causal LM's KV cache; a pooling model keeps none: "
            "drop those keys, and size the sequences with embed_seq_len"
        )
    pooling = pooling_settings(vllm_config)
    task = pooling_task(vllm_config)
    parallel = vllm_config.parallel_config
    if parallel.worker_cls in ("auto", "", None, "qaic_vllm.worker.QaicWorker"):
        parallel.worker_cls = WORKER_CLS
    sched = vllm_config.scheduler_config
    sched.scheduler_cls = SCHEDULER_CLS
    sched.enable_chunked_prefill = False  # a sequence runs whole, on one specialization
    sched.long_prefill_token_threshold = 0
    budget = settings.decode_batch_size * pooling.max_seq_len
    sched.max_num_batched_tokens = max(int(sched.max_num_batched_tokens), budget)
    if sched.max_num_scheduled_tokens is not None:
        sched.max_num_scheduled_tokens = max(int(sched.max_num_scheduled_tokens), budget)
    _engine = PoolingEngine(
        task=task,
        max_seq_len=pooling.max_seq_len,
        normalized_on_device=pooling.device == POOL_ON_DEVICE and pooling.normalize and task == EMBED,
    )
    log.info(
        "qaic: pooling model (%s): %d sequences per run, embed_seq_len %s, pooling on %s%s",
        task,
        settings.decode_batch_size,
        list(pooling.seq_lens),
        pooling.device,
        f" ({pooling.method}{', normalized' if pooling.normalize else ''})"
        if pooling.device == POOL_ON_DEVICE and task == EMBED
        else "",
    )
