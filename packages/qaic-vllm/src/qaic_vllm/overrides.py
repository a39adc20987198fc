"""``--additional-config`` and ``VLLM_QAIC_*`` read with vllm-qaic's keys, forms and precedence.

Precedence, as in vllm-qaic: the top-level ``device_group``, then ``override_qaic_config``, then the
``VLLM_QAIC_*`` variables (and, under ``--speculative-config``, ``VLLM_QAIC_SPEC_TARGET_*``); the
later one wins. ``compiler_args`` takes raw flags (``-mos=1 -v``) and vllm-qaic's ``k=v|k`` pieces;
a piece naming an override key (``mos=2``) sets that key, as vllm-qaic does, the rest become flags.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from qaic_core.env import parse_bool
from qaic_core.errors import QaicConfigError
from qaic_core.settings import (
    SETTING_KEYS,
    SETTINGS,
    parse_arguments,
    parse_int,
    split_arguments,
    vendor_flag,
)
from qaic_vllm import envs, vendor
from qaic_vllm.pooling_config import POOLING_KEYS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("qaic.vllm")

OVERRIDE_KEY = "override_qaic_config"
QPC_PATH = "qpc_path"
PREFILL_SEQ_LEN = "prefill_seq_len"
PARTIAL_PREFILLS = "max_num_partial_prefills"
"""How many prompts may be in prefill at once (the scheduler's admission; not a compile setting)."""
FLAG_KEYS = frozenset({"mdts_mos", "aic_pmu_recipe"})
"""vllm-qaic keys that QEfficient passes to the compiler as flags of the same name."""


def additional_config(vllm_config: VllmConfig) -> dict[str, Any]:
    """``additional_config`` as a dict (vllm-qaic also takes a JSON or Python-literal string)."""
    return vendor.parse_additional_config(vllm_config.additional_config)


def overridable(key: str) -> bool:
    spec = SETTING_KEYS.get(key)
    return spec is not None and spec.override


def partial_prefills(values: Mapping[str, Any]) -> int:
    """``max_num_partial_prefills`` from :func:`read_overrides` values (checked there); 1 when not given."""
    return int(values.get(PARTIAL_PREFILLS, 1))


def known_keys() -> list[str]:
    """Every key ``override_qaic_config`` takes (for error messages)."""
    ours = {key for spec in SETTINGS.values() if spec.override for key in spec.keys}
    return sorted(ours | set(vendor.OVERRIDE_KEYS) | {QPC_PATH, PREFILL_SEQ_LEN, PARTIAL_PREFILLS})


def read_override(raw: Any, where: str) -> dict[str, Any]:
    """One ``override_qaic_config``-style dict -> setting values by name, plus ``qpc_path``,
    ``prefill_seq_len``, ``max_num_partial_prefills`` and the extra flags in ``compiler_args``.
    Unsupported features are refused."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise QaicConfigError(
            f'{where} must be a JSON object such as \'{{"{OVERRIDE_KEY}": {{"num_cores": 16}}}}\''
        )
    cfg = {str(k).strip().lower().replace("-", "_"): v for k, v in raw.items()}
    flags: list[str] = []
    args = cfg.pop("compiler_args", None)
    if isinstance(args, str):
        for piece in split_arguments(args, f"{where} compiler_args"):
            key, eq, value = piece.partition("=")
            name = key.strip().lower().replace("-", "_")
            if not piece.startswith("-") and (overridable(name) or name in vendor.OVERRIDE_KEYS):
                cfg[name] = value if eq else True
            else:
                flag = vendor_flag(piece)
                if flag:
                    flags.append(flag)
    elif args is not None:
        flags.extend(parse_arguments(args, f"{where} compiler_args"))

    pooling = sorted(k for k in cfg if k in POOLING_KEYS and cfg[k] not in (None, False, "", [], ()))
    if pooling:  # a pooling engine sets these aside before its compile settings are read
        raise QaicConfigError(
            f"{where} {pooling} configure a pooling model: serve it with --runner pooling, or remove them"
        )
    engine = sorted(k for k in cfg if k in SETTINGS and not SETTINGS[k].override and k != PREFILL_SEQ_LEN)
    unknown = sorted(
        k
        for k in cfg
        if not (
            overridable(k) or k in vendor.OVERRIDE_KEYS or k in (QPC_PATH, PREFILL_SEQ_LEN, PARTIAL_PREFILLS)
        )
        and not vendor.compiler_flag_key(k)
    )
    if engine or unknown:
        bad = sorted(set(engine) | set(unknown))
        hints = [
            f"{k} with {SETTINGS[k].engine_arg}" for k in bad if k in SETTINGS and SETTINGS[k].engine_arg
        ]
        hint = f"; set {', '.join(hints)}" if hints else ""
        raise QaicConfigError(
            f"{where} has unknown keys {bad}; known keys: {', '.join(known_keys())}, or any qaic-compile flag "
            f"name (aic_perf_metrics){hint}"
        )
    for note in vendor.check_keys(
        cfg, {k: v for k, v in vendor.OVERRIDE_KEYS.items() if not overridable(k)}, where
    ):
        log.info("qaic: %s", note)

    values: dict[str, Any] = {}
    by_name: dict[str, bool] = {}

    def what(key: str) -> str:
        return f"{where} {key}"

    for key, raw_value in cfg.items():
        if raw_value is None:
            continue
        if overridable(key):
            spec = SETTING_KEYS[key]
            named = key == spec.name
            if spec.name in by_name and (by_name[spec.name] or not named):
                continue  # the setting's own name wins over an alias
            values[spec.name] = spec.value(raw_value, what(key))
            by_name[spec.name] = named
        elif key == QPC_PATH:
            values[QPC_PATH] = str(raw_value)
        elif key in (PREFILL_SEQ_LEN, PARTIAL_PREFILLS):
            values[key] = _positive(raw_value, what(key))
        elif key == "node_precision_info":
            flags.extend(_node_precision(raw_value, what(key)))
        elif key in FLAG_KEYS or (key not in vendor.OVERRIDE_KEYS and vendor.compiler_flag_key(key)):
            flag = vendor_flag(f"{key}={_word(raw_value)}")
            if flag:
                flags.append(flag)
    if flags:
        values["compiler_args"] = (*values.get("compiler_args", ()), *flags)
    return values


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _positive(value: Any, what: str) -> int:
    n = parse_int(value, what)
    if n < 1:
        raise QaicConfigError(f"{what}={n} must be >= 1")
    return n


def _node_precision(value: Any, what: str) -> list[str]:
    """A precision file is passed on; ``true`` (QEfficient generates one) is not supported here."""
    word = _word(value).strip()
    if word.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        if parse_bool(word, what):
            raise vendor.refusal(what.rsplit(" ", 1)[0], vendor.OVERRIDE_KEYS["node_precision_info"])
        return []
    return [f"-node-precision-info={word}"]


def read_overrides(vllm_config: VllmConfig, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compile overrides of an engine: top-level keys, ``override_qaic_config``, then the variables."""
    additional = additional_config(vllm_config)
    unknown = sorted(set(additional) - set(vendor.ADDITIONAL_KEYS))
    if unknown:
        log.debug("qaic: --additional-config keys %s are not this plugin's; ignored here", unknown)
    for note in vendor.check_keys(additional, vendor.ADDITIONAL_KEYS, "--additional-config"):
        log.info("qaic: %s", note)
    merged: dict[str, Any] = {}
    top = additional.get("device_group")
    if top is not None:
        merged["device_group"] = SETTINGS["device_group"].value(top, "--additional-config device_group")
    merged.update(read_override(additional.get(OVERRIDE_KEY), f"--additional-config {OVERRIDE_KEY}"))
    _merge_flags(merged, envs.overrides_from_env(environ))
    if vllm_config.speculative_config is not None:
        _merge_flags(merged, envs.target_overrides_from_env(environ))
    for note in envs.no_effect_notes(environ):
        log.info("qaic: %s", note)
    return merged


def _merge_flags(into: dict[str, Any], later: dict[str, Any]) -> None:
    """``later`` wins, except that compiler flags from both are kept (the later ones last)."""
    args = (*into.get("compiler_args", ()), *later.get("compiler_args", ()))
    into.update(later)
    if args:
        into["compiler_args"] = args


def draft_override(
    additional: Mapping[str, Any], key: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``draft_override_qaic_config`` read like the target's, then ``VLLM_QAIC_SPEC_DRAFT_*``."""
    values = read_override(additional.get(key), f"--additional-config {key}")
    _merge_flags(values, envs.draft_overrides_from_env(environ))
    return values


def adopt_engine_args(vllm_config: VllmConfig) -> None:
    """vllm-qaic's engine arguments in vLLM's config, before anything reads it.

    ``additional_config`` becomes a dict; ``--tensor-parallel-size N`` becomes ``num_devices`` N (the
    compiler slices the model; vLLM keeps one worker); ``VLLM_TORCH_QAIC_PROFILER_DIR`` names the
    trace folder when vLLM's own is unset; ``--enable-mm-embeds`` is refused. The worker sees the result.
    """
    additional = additional_config(vllm_config)
    vllm_config.additional_config = additional
    model_config = vllm_config.model_config
    multimodal = model_config.multimodal_config  # None for a text-only model
    if multimodal is not None and multimodal.enable_mm_embeds:
        raise vendor.refusal("--enable-mm-embeds", vendor.ENGINE_ARGS["--enable-mm-embeds"])
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    if tp > 1 and int(parallel.pipeline_parallel_size) == 1:
        override = additional.get(OVERRIDE_KEY)
        override = dict(override) if isinstance(override, Mapping) else {}
        given = override.get("num_devices")
        if given is not None and parse_int(given, f"--additional-config {OVERRIDE_KEY} num_devices") != tp:
            raise QaicConfigError(
                f"--tensor-parallel-size {tp} and {OVERRIDE_KEY} num_devices {given} disagree: both count the "
                "devices the compiler slices the model over; give one of them"
            )
        override["num_devices"] = tp
        additional[OVERRIDE_KEY] = override
        parallel.tensor_parallel_size = 1
        parallel.world_size = 1
        if parallel.distributed_executor_backend in ("mp", None):
            parallel.distributed_executor_backend = "uni"
        log.info(
            "qaic: --tensor-parallel-size %d: the compiler slices the model over %d devices (num_devices); "
            "vLLM runs one worker",
            tp,
            tp,
        )
    profiler = vllm_config.profiler_config
    qaic_dir = os.environ.get(envs.VLLM_TORCH_QAIC_PROFILER_DIR, "").strip()
    if qaic_dir and not profiler.torch_profiler_dir:
        profiler.torch_profiler_dir = qaic_dir
