"""Simulator settings: the card topology, faults, tracing and pacing, from env vars or a file.

Precedence: built-in defaults < ``QAIC_SIM_CONFIG`` file (YAML or JSON) < single env vars
(``QAIC_SIM_TOPOLOGY``, ``QAIC_SIM_FAULTS``, ``QAIC_SIM_TRACE_DIR``, ``QAIC_SIM_PACE``,
``QAIC_SIM_PACE_AS``, ``QAIC_SIM_THREADS``, ``QAIC_SIM_TIMING``, ``QAIC_SIM_FUSED_ATTENTION``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qaic_core.env import env_flag
from qaic_core.errors import QaicConfigError
from qaic_core.host import usable_cpus
from qaic_core.types import SkuType

QAIC_SIM_CONFIG = "QAIC_SIM_CONFIG"
QAIC_SIM_TOPOLOGY = "QAIC_SIM_TOPOLOGY"
QAIC_SIM_FAULTS = "QAIC_SIM_FAULTS"
QAIC_SIM_TRACE_DIR = "QAIC_SIM_TRACE_DIR"
QAIC_SIM_PACE = "QAIC_SIM_PACE"
QAIC_SIM_PACE_AS = "QAIC_SIM_PACE_AS"
QAIC_SIM_THREADS = "QAIC_SIM_THREADS"
QAIC_SIM_TIMING = "QAIC_SIM_TIMING"
QAIC_SIM_FUSED_ATTENTION = "QAIC_SIM_FUSED_ATTENTION"

DEFAULT_TOPOLOGY = "ultra"
_SKU_ALIASES = {
    "standard": SkuType.STANDARD,
    "std": SkuType.STANDARD,
    "pro": SkuType.PRO,
    "ultra": SkuType.ULTRA,
    "ai080-ultra": SkuType.AI080_ULTRA,
    "ai080_ultra": SkuType.AI080_ULTRA,
    "ai080ultra": SkuType.AI080_ULTRA,
    "080-ultra": SkuType.AI080_ULTRA,
}
PACE_PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
                   "tie_word_embeddings": False},
    "llama-2-13b": {"model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
                    "num_key_value_heads": 40, "intermediate_size": 13824, "vocab_size": 32000,
                    "tie_word_embeddings": False},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                   "tie_word_embeddings": False},
    "gpt-j-6b": {"model_type": "gptj", "n_embd": 4096, "n_layer": 28, "n_head": 16, "n_inner": 16384,
                 "vocab_size": 50400, "tie_word_embeddings": False},
    "opt-2.7b": {"model_type": "opt", "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "ffn_dim": 10240, "vocab_size": 50272, "tie_word_embeddings": True},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                     "tie_word_embeddings": True},
}  # fmt: skip
"""Model shapes ``pace_as`` accepts by name (public Hugging Face configs, sizes only)."""

_FILE_KEYS = {"cards", "faults", "trace_dir", "pace", "pace_as", "threads", "timing", "fused_attention"}


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator reads from its environment, resolved once per topology."""

    cards: tuple[SkuType, ...] = (SkuType.ULTRA,)
    faults: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    trace_dir: Path | None = None
    pace: bool = False
    pace_as: str | None = None
    threads: int = 0
    """onnxruntime intra-op threads per program; 0: every usable core but one (:func:`onnx_threads`)."""
    timing: bool = True
    """Model each run's device time; off, runs report 0 s and cannot be paced."""
    fused_attention: bool = True
    """Compile decode attention to one fused kernel (``qaic_sim.attention``); off, programs compiled
    from then on run the exported attention nodes in every run."""
    source: str = "defaults"


def parse_sku(name: str, where: str) -> SkuType:
    """A SKU by name (standard, pro, ultra, ai080-ultra), with the choices in the error."""
    key = str(name).strip().lower()
    if key not in _SKU_ALIASES:
        raise QaicConfigError(
            f"{where}: unknown card type {name!r}; use one of standard, pro, ultra, ai080-ultra"
        )
    return _SKU_ALIASES[key]


def parse_topology(text: str, where: str = QAIC_SIM_TOPOLOGY) -> tuple[SkuType, ...]:
    """``"ultra"``, ``"standard:2,pro"``: comma-separated cards, ``sku:count`` repeats a card."""
    cards: list[SkuType] = []
    for part in text.split(","):
        token = part.strip()
        if not token:
            raise QaicConfigError(
                f"{where}={text!r} has an empty entry; write e.g. 'ultra' or 'standard:2,pro'"
            )
        name, _, count = token.partition(":")
        sku = parse_sku(name, f"{where}={text!r}")
        n = _count(count or "1", f"{where}={text!r}")
        cards.extend([sku] * n)
    return tuple(cards)


def _count(raw: Any, where: str) -> int:
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise QaicConfigError(f"{where}: card count {raw!r} is not an integer") from None
    if n < 1:
        raise QaicConfigError(f"{where}: card count must be >= 1, got {n}")
    return n


def _cards_from_file(value: Any, where: str) -> tuple[SkuType, ...]:
    if isinstance(value, str):
        return parse_topology(value, where)
    if not isinstance(value, list) or not value:
        raise QaicConfigError(
            f"{where}: 'cards' must be a non-empty list such as [ultra, {{sku: pro, count: 2}}]"
        )
    cards: list[SkuType] = []
    for entry in value:
        if isinstance(entry, str):
            cards.append(parse_sku(entry, where))
        elif isinstance(entry, dict) and "sku" in entry:
            extra = set(entry) - {"sku", "count"}
            if extra:
                raise QaicConfigError(
                    f"{where}: card entry has unknown keys {sorted(extra)}; use sku and count"
                )
            cards.extend([parse_sku(entry["sku"], where)] * _count(entry.get("count", 1), where))
        else:
            raise QaicConfigError(f"{where}: card entry {entry!r} must be a SKU name or {{sku, count}}")
    return tuple(cards)


def parse_faults_text(text: str, where: str = QAIC_SIM_FAULTS) -> tuple[Mapping[str, Any], ...]:
    """Faults as JSON (a list of objects) or ``kind@qid:key=value`` entries separated by commas."""
    text = text.strip()
    if not text:
        return ()
    if text.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise QaicConfigError(f"{where}: invalid JSON: {exc}") from exc
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise QaicConfigError(f"{where}: expected a JSON list of objects")
        return tuple(data)
    faults: list[dict[str, Any]] = []
    for part in text.split(","):
        token = part.strip()
        head, *opts = token.split(":")
        kind, _, qid = head.partition("@")
        entry: dict[str, Any] = {"kind": kind.strip()}
        if qid:
            entry["qid"] = qid.strip()
        for opt in opts:
            key, eq, value = opt.partition("=")
            if not eq:
                raise QaicConfigError(f"{where}: {token!r}: option {opt!r} must be key=value (e.g. run=3)")
            entry[key.strip()] = value.strip()
        faults.append(entry)
    return tuple(faults)


def load_config(environ: Mapping[str, str] | None = None) -> SimConfig:
    """Read the file named by ``QAIC_SIM_CONFIG`` (if any), then the single env overrides."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: list[str] = []
    path = env.get(QAIC_SIM_CONFIG, "").strip()
    if path:
        values.update(_read_file(Path(path)))
        sources.append(path)
    if env.get(QAIC_SIM_TOPOLOGY, "").strip():
        values["cards"] = parse_topology(env[QAIC_SIM_TOPOLOGY])
        sources.append(QAIC_SIM_TOPOLOGY)
    if env.get(QAIC_SIM_FAULTS, "").strip():
        values["faults"] = parse_faults_text(env[QAIC_SIM_FAULTS])
    if env.get(QAIC_SIM_TRACE_DIR, "").strip():
        values["trace_dir"] = Path(env[QAIC_SIM_TRACE_DIR]).expanduser()
    if QAIC_SIM_PACE in env:
        values["pace"] = env_flag(QAIC_SIM_PACE, False, env)
    if env.get(QAIC_SIM_PACE_AS, "").strip():
        values["pace_as"] = env[QAIC_SIM_PACE_AS].strip()
    if env.get(QAIC_SIM_THREADS, "").strip():
        values["threads"] = _threads(env[QAIC_SIM_THREADS], QAIC_SIM_THREADS)
    if env.get(QAIC_SIM_TIMING, "").strip():
        values["timing"] = env_flag(QAIC_SIM_TIMING, True, env)
    if env.get(QAIC_SIM_FUSED_ATTENTION, "").strip():
        values["fused_attention"] = env_flag(QAIC_SIM_FUSED_ATTENTION, True, env)
    if values.get("timing") is False and (values.get("pace") or values.get("pace_as")):
        raise QaicConfigError(
            f"pacing ({QAIC_SIM_PACE} / {QAIC_SIM_PACE_AS}) sleeps for the modelled device time, but "
            f"{QAIC_SIM_TIMING}=0 turns the timing model off: turn pacing off or timing on"
        )
    if values.get("pace_as"):
        for entry in pace_as_entries(values["pace_as"]).values():
            pace_as_config(entry)  # fail at start-up, not at the first run
    return SimConfig(**values, source=", ".join(sources) or "defaults")


def pace_as_entries(value: str) -> dict[str, str]:
    """``pace_as`` as ``{match: model}``: ``model`` alone applies to every program (match ``""``).

    ``MATCH=model`` entries, comma separated, time each program whose QPC path contains ``MATCH`` as
    that model (the first entry that matches wins), so a target and its draft on one card can be
    paced as the models they stand for: ``target=llama-3.1-8b,draft=llama-3.2-1b``.
    """
    entries: dict[str, str] = {}
    for part in value.split(","):
        match, sep, model = part.strip().rpartition("=")
        if not model.strip() or (sep and not match.strip()):
            raise QaicConfigError(
                f"{QAIC_SIM_PACE_AS}={value!r}: each entry is a model (a preset or a config.json path) or "
                "MATCH=model, comma separated"
            )
        entries.setdefault(match.strip(), model.strip())
    return entries


def pace_as_for(value: str | None, program: str = "") -> str | None:
    """The model that ``program`` (its QPC path) is timed as under ``pace_as``, or None."""
    if not value:
        return None
    entries = pace_as_entries(value)
    for match, model in entries.items():
        if match and match in program:
            return model
    return entries.get("")


def pace_as_config(value: str) -> dict[str, Any]:
    """The model shape named by ``pace_as``: a preset name or a path to a HF-config-like JSON file."""
    key = value.strip().lower()
    if key in PACE_PRESETS:
        return dict(PACE_PRESETS[key])
    path = Path(value).expanduser()
    if not path.is_file():
        raise QaicConfigError(
            f"{QAIC_SIM_PACE_AS}={value!r} is neither a preset ({', '.join(sorted(PACE_PRESETS))}) "
            "nor a JSON file with a Hugging Face config"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QaicConfigError(f"{QAIC_SIM_PACE_AS}={value!r}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise QaicConfigError(f"{QAIC_SIM_PACE_AS}={value!r}: expected a JSON object (a config.json)")
    return data


def _threads(raw: Any, where: str) -> int:
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise QaicConfigError(f"{where}={raw!r} is not an integer (0: every usable core but one)") from None
    if n < 0:
        raise QaicConfigError(f"{where}={raw!r} must be >= 0 (0: every usable core but one)")
    return n


def onnx_threads(threads: int, cpus: int | None = None) -> int:
    """onnxruntime intra-op threads for the ``threads`` setting: itself when set, else every usable core
    but one, at least one.

    The core left over runs the host beside the program: vLLM's engine loop, its API server and their
    clients, as vLLM's CPU backend reserves a core for them. A pool over every core makes the program's
    own threads and the host take turns on the same cores.
    """
    if threads > 0:
        return threads
    return max(1, (usable_cpus() if cpus is None else cpus) - 1)


def _read_file(path: Path) -> dict[str, Any]:
    where = f"{QAIC_SIM_CONFIG}={path}"
    if not path.is_file():
        raise QaicConfigError(f"{where}: no such file; point {QAIC_SIM_CONFIG} at a YAML or JSON file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise QaicConfigError(f"{where}: not valid YAML/JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise QaicConfigError(f"{where}: expected a mapping with keys {sorted(_FILE_KEYS)}")
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise QaicConfigError(f"{where}: unknown keys {sorted(unknown)}; known keys: {sorted(_FILE_KEYS)}")
    out: dict[str, Any] = {}
    if "cards" in data:
        out["cards"] = _cards_from_file(data["cards"], where)
    if "faults" in data:
        faults = data["faults"] or []
        if isinstance(faults, str):
            out["faults"] = parse_faults_text(faults, where)
        elif isinstance(faults, list) and all(isinstance(f, dict) for f in faults):
            out["faults"] = tuple(faults)
        else:
            raise QaicConfigError(
                f"{where}: 'faults' must be a list of objects such as {{kind: reset, qid: 0, run: 3}}"
            )
    if data.get("trace_dir"):
        out["trace_dir"] = Path(str(data["trace_dir"])).expanduser()
    if "pace" in data:
        if not isinstance(data["pace"], bool):
            raise QaicConfigError(f"{where}: 'pace' must be true or false")
        out["pace"] = data["pace"]
    if data.get("pace_as"):
        out["pace_as"] = str(data["pace_as"])
    if "threads" in data:
        out["threads"] = _threads(data["threads"], where)
    for key in ("timing", "fused_attention"):
        if key in data:
            if not isinstance(data[key], bool):
                raise QaicConfigError(f"{where}: '{key}' must be true or false")
            out[key] = data[key]
    return out
