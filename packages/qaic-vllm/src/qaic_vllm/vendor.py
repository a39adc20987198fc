"""vllm-qaic's (v0.23) configuration surface: every key, variable and engine argument it documents or reads,
and what each does here.

Each entry is honoured (it sets a compile setting or a qaic-compile flag), has no effect here as it
has none in vllm-qaic's AOT mode, or belongs to a feature this plugin lacks and is refused at start-up
with a message saying it is recognised. A value that leaves the feature off (``False``, ``None``,
an empty list) is accepted. The tables are data (``data/vendor_keys.json``: name, meaning, handling,
what it becomes here, and the values that leave an unsupported feature off when not the usual ones);
docs/configuration.md carries the same tables.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from qaic_core.compiler_flags import BOOL_FLAGS, VALUE_FLAGS
from qaic_core.errors import QaicConfigError

HONOURED = "honoured"
NO_EFFECT = "no effect"
UNSUPPORTED = "not supported"


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


def _table(name: str) -> dict[str, VendorKey]:
    """One table of ``data/vendor_keys.json``; an ``inert`` list that holds ``[]`` also accepts ``()``."""
    rows = json.loads(
        resources.files("qaic_vllm").joinpath("data/vendor_keys.json").read_text(encoding="utf-8")
    )
    keys: dict[str, VendorKey] = {}
    for row in rows[name]:
        inert = row.pop("inert", None)
        if inert is not None:
            row["inert"] = (*inert, ()) if [] in inert else tuple(inert)
        keys[row["name"]] = VendorKey(**row)
    return keys


OVERRIDE_KEYS: dict[str, VendorKey] = _table("override_keys")
"""``override_qaic_config`` (and ``draft_override_qaic_config``) keys vllm-qaic documents or reads.

vllm-qaic ignores ``ctx_len``, ``batch_size``, ``full_batch_size`` and ``num_speculative_tokens``
there; this plugin refuses them naming the engine argument that sets them. Any other key that names
a qaic-compile flag (``aic_perf_metrics``) becomes that flag, as QEfficient passes compile options on.
"""

ADDITIONAL_KEYS: dict[str, VendorKey] = _table("additional_keys")
"""Top-level ``additional_config`` keys. Others are logged and ignored (other plugins may read them)."""

ENV_VARS: dict[str, VendorKey] = _table("env_vars")
"""``VLLM_QAIC_*`` and related variables vllm-qaic documents or reads at run time."""

ENGINE_ARGS: dict[str, VendorKey] = _table("engine_args")
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
