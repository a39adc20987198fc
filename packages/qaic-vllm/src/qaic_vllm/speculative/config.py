"""``--speculative-config`` on Cloud AI: which methods run, the target's layout and the draft's program."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings
from qaic_vllm.overrides import OVERRIDE_KEY, PARTIAL_PREFILLS, draft_override
from qaic_vllm.sizing import device_cores, group_devices

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from qaic_vllm.config import EngineSettings

METHODS = ("ngram", "suffix", "draft_model")
"""Methods served on Cloud AI (vllm-qaic's three): host proposers and a draft model compiled to its own QPC."""
DRAFT_OVERRIDE_KEY = "draft_override_qaic_config"
"""vllm-qaic's ``additional_config`` key with the draft program's compile settings."""
DRAFT_KEYS = frozenset(
    {"num_cores", "aic_num_cores", "device_group", "num_devices", "mos", "mxfp6", "mxfp6_matmul", "mxint8"}
    | {"mxint8_kv_cache", "aic_enable_depth_first", "dfs", "compiler_args", "qpc_path"}
)
"""Keys a draft program takes; shapes (batch, context, prefill chunk) always follow the target's."""


@dataclass(frozen=True)
class SpecSettings:
    """The speculative method and its parameters, checked at configuration time."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    suffix_max_depth: int = 24
    suffix_max_cached: int = 10000
    draft_model_dir: Path | None = None
    draft: CompileSettings | None = None
    draft_qpc_path: Path | None = None


def spec_settings(
    vllm_config: VllmConfig, engine: EngineSettings, *, with_draft: bool = True
) -> SpecSettings | None:
    """The speculative settings of ``--speculative-config``, or None when it is not given.

    ``with_draft=False`` leaves a draft model's program out (it depends on the target's cores).
    """
    sc = vllm_config.speculative_config
    if sc is None:
        return None
    method = str(sc.method)
    if method not in METHODS:
        raise QaicConfigError(
            f"--speculative-config method {method!r} is not supported on Cloud AI: use one of "
            f"{', '.join(METHODS)}"
        )
    k = int(sc.num_speculative_tokens or 0)
    if k < 1:
        raise QaicConfigError(
            "--speculative-config needs num_speculative_tokens >= 1 (the tokens proposed per step)"
        )
    ctx_len = engine.compile.ctx_len
    if k + 1 > engine.compile.ctx_len:
        raise QaicConfigError(
            f"num_speculative_tokens {k} needs {k + 1} positions per step but ctx_len (--max-model-len) is "
            f"{ctx_len}: lower num_speculative_tokens or raise --max-model-len"
        )
    if method == "ngram":
        return SpecSettings(
            method,
            k,
            prompt_lookup_min=int(sc.prompt_lookup_min or 1),
            prompt_lookup_max=int(sc.prompt_lookup_max or sc.prompt_lookup_min or 1),
        )
    if method == "suffix":
        return SpecSettings(
            method,
            k,
            suffix_max_depth=int(sc.suffix_decoding_max_tree_depth),
            suffix_max_cached=int(sc.suffix_decoding_max_cached_requests),
        )
    if not with_draft:
        return SpecSettings(method, k)
    return _draft_settings(vllm_config, engine, k)


def _draft_settings(vllm_config: VllmConfig, engine: EngineSettings, k: int) -> SpecSettings:
    sc = vllm_config.speculative_config
    assert sc is not None
    draft_config = sc.draft_model_config
    if draft_config is None:
        raise QaicConfigError(
            '--speculative-config method draft_model needs a draft model: add "model": "<local directory>"'
        )
    from qaic_vllm.config import model_dir_of

    draft_dir = model_dir_of(str(draft_config.model))
    target_dir = model_dir_of(str(vllm_config.model_config.model))
    check_same_vocabulary(target_dir, draft_dir)
    raw = draft_override(_additional(vllm_config), DRAFT_OVERRIDE_KEY)
    shapes = sorted(set(raw) & {"prefill_seq_len", PARTIAL_PREFILLS})
    if shapes:
        raise QaicConfigError(
            f"--additional-config {DRAFT_OVERRIDE_KEY} sets {shapes}: a draft's shapes and scheduling follow "
            f"the target's (set them in {OVERRIDE_KEY})"
        )
    qpc_raw = raw.pop("qpc_path", None)
    target = engine.compile
    soc_cores = device_cores(group_devices(target.device_group, target.num_devices))
    cores = raw.get("num_cores")
    if cores is None:
        cores = max(soc_cores - target.num_cores, 1)
    values: dict[str, Any] = {
        "prefill_seq_len": target.prefill_seq_len,
        "ctx_len": target.ctx_len,
        "batch_size": target.batch_size,
        "full_batch_size": target.full_batch_size,
        "convert_to_fp16": target.convert_to_fp16,
        "device_group": target.device_group,
        "num_devices": target.num_devices,
        **{key: value for key, value in raw.items() if key != "num_cores"},
        "num_cores": int(cores),
        # Two tokens per row: the draft catches up on the token it has not seen and the new one at once.
        "num_speculative_tokens": 1,
    }
    if raw.get("device_group") is not None and "num_devices" not in raw:
        values["num_devices"] = len(raw["device_group"])
    try:
        draft = CompileSettings.from_mapping(values)
    except QaicConfigError as exc:
        raise QaicConfigError(f"invalid --additional-config {DRAFT_OVERRIDE_KEY}: {exc}") from exc
    if draft.num_cores + target.num_cores > soc_cores and draft.device_group == target.device_group:
        raise QaicConfigError(
            f"the target takes {target.num_cores} NSP cores and the draft {draft.num_cores}, more than the "
            f"{soc_cores} of a SoC they share: lower override_qaic_config num_cores or "
            f"{DRAFT_OVERRIDE_KEY} num_cores (the default split is {(soc_cores + 1) // 2}/{soc_cores // 2})"
        )
    return SpecSettings(
        "draft_model",
        k,
        draft_model_dir=draft_dir,
        draft=draft,
        draft_qpc_path=Path(str(qpc_raw)).expanduser() if qpc_raw else None,
    )


def target_settings(
    vllm_config: VllmConfig, engine: EngineSettings, spec: SpecSettings | None
) -> EngineSettings:
    """The target program's settings: K+1 tokens per decode row; 8 of 16 cores when a draft shares the SoC."""
    if spec is None:
        return engine
    changes: dict[str, Any] = {"num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "draft_model" and not _cores_given(vllm_config):
        soc_cores = device_cores(group_devices(engine.compile.device_group, engine.compile.num_devices))
        changes["num_cores"] = (soc_cores + 1) // 2  # vllm-qaic: the target takes the larger half
    return dataclasses.replace(engine, compile=engine.compile.replace(**changes))


def with_speculation(
    vllm_config: VllmConfig, engine: EngineSettings
) -> tuple[EngineSettings, SpecSettings | None]:
    """Both at once, in the order they depend on each other (the draft's cores follow the target's)."""
    spec = spec_settings(vllm_config, engine, with_draft=False)
    target = target_settings(vllm_config, engine, spec)
    if spec is not None and spec.method == "draft_model":
        spec = _draft_settings(vllm_config, target, spec.num_speculative_tokens)
    return target, spec


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """A draft must share the target's tokenizer: the same token ids mean the same text."""
    from transformers import AutoTokenizer

    target = AutoTokenizer.from_pretrained(str(target_dir))
    draft = AutoTokenizer.from_pretrained(str(draft_dir))
    if target.get_vocab() != draft.get_vocab():
        raise QaicConfigError(
            f"the draft model {draft_dir} has a different tokenizer from the target {target_dir} "
            f"({len(draft.get_vocab())} and {len(target.get_vocab())} tokens): choose a draft of the same "
            "model family, or use method ngram or suffix"
        )
    import json

    sizes = []
    for path in (target_dir, draft_dir):
        config = json.loads((path / "config.json").read_text())
        sizes.append(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    if sizes[0] != sizes[1]:
        raise QaicConfigError(
            f"the draft model's vocabulary ({sizes[1]} logits) differs from the target's ({sizes[0]}): choose a "
            "draft of the same model family"
        )


def _additional(vllm_config: VllmConfig) -> dict[str, Any]:
    additional = vllm_config.additional_config or {}
    return additional if isinstance(additional, dict) else {}


def _cores_given(vllm_config: VllmConfig) -> bool:
    override = _additional(vllm_config).get("override_qaic_config") or {}
    named = isinstance(override, dict) and ("num_cores" in override or "aic_num_cores" in override)
    env = ("VLLM_QAIC_NUM_CORES", "VLLM_QAIC_SPEC_TARGET_NUM_CORES")
    return named or any(os.environ.get(name, "").strip() for name in env)
