"""Environment variables understood by the whole stack, parsed in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from qaic_core.errors import QaicConfigError

QAIC_BACKEND = "QAIC_BACKEND"
QAIC_STRICT_PLUGINS = "QAIC_STRICT_PLUGINS"
QAIC_TRACE_PLUGINS = "QAIC_TRACE_PLUGINS"
QAIC_VISIBLE_DEVICES = "QAIC_VISIBLE_DEVICES"
QAIC_MODEL_LOADER = "QAIC_MODEL_LOADER"
QAIC_SESSION_FACTORY = "QAIC_SESSION_FACTORY"
QEFF_HOME = "QEFF_HOME"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
BOOLEAN_WORDS = "1/0, true/false, yes/no or on/off"


def parse_bool(value: object, what: str) -> bool:
    """The stack's one yes/no parser (variables, override keys, settings); errors name ``what``."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise QaicConfigError(f"{what}={value!r} is not a boolean: use {BOOLEAN_WORDS}")


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """Read a boolean variable (blank is no); anything but a clear yes/no is an error naming it."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    return parse_bool(raw, name) if raw.strip() else False


def strict_plugins(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a plugin that fails to load is fatal (``QAIC_STRICT_PLUGINS=1``)."""
    return env_flag(QAIC_STRICT_PLUGINS, False, environ)


def trace_plugins(environ: Mapping[str, str] | None = None) -> bool:
    """Whether pluggy traces every hook call to the ``qaic.plugins`` log (``QAIC_TRACE_PLUGINS=1``)."""
    return env_flag(QAIC_TRACE_PLUGINS, False, environ)


def requested_backend(environ: Mapping[str, str] | None = None) -> str | None:
    """The backend named by ``QAIC_BACKEND``, or None for the best available."""
    env = os.environ if environ is None else environ
    value = env.get(QAIC_BACKEND, "").strip()
    return value or None


def requested_model_loader(environ: Mapping[str, str] | None = None) -> str | None:
    """The model loader named by ``QAIC_MODEL_LOADER``, or None for the execution path's default."""
    env = os.environ if environ is None else environ
    return env.get(QAIC_MODEL_LOADER, "").strip() or None


def requested_session_factory(environ: Mapping[str, str] | None = None) -> str | None:
    """The session factory named by ``QAIC_SESSION_FACTORY``, or None for the best available."""
    env = os.environ if environ is None else environ
    return env.get(QAIC_SESSION_FACTORY, "").strip() or None


def parse_visible_devices(value: str | None, available: list[int]) -> list[int]:
    """Filter and order the physical QIDs by ``QAIC_VISIBLE_DEVICES``.

    The result lists physical QIDs in the order given; position ``i`` is visible device ``i``.
    ``None`` or an empty value keeps every device.
    """
    if value is None or not value.strip():
        return list(available)
    ids: list[int] = []
    for part in value.split(","):
        token = part.strip()
        if not token:
            raise QaicConfigError(
                f"{QAIC_VISIBLE_DEVICES}={value!r} has an empty entry: give a comma-separated "
                "list of device ids such as '0,1'"
            )
        if not token.isdigit():
            raise QaicConfigError(
                f"{QAIC_VISIBLE_DEVICES}={value!r}: {token!r} is not a device id; give a "
                "comma-separated list of non-negative integers such as '0,1'"
            )
        qid = int(token)
        if qid not in available:
            raise QaicConfigError(
                f"{QAIC_VISIBLE_DEVICES}={value!r}: device {qid} does not exist; "
                f"devices present: {', '.join(map(str, available)) or 'none'}"
            )
        if qid in ids:
            raise QaicConfigError(f"{QAIC_VISIBLE_DEVICES}={value!r} lists device {qid} twice")
        ids.append(qid)
    return ids


def visible_devices(available: list[int], environ: Mapping[str, str] | None = None) -> list[int]:
    """Physical QIDs visible to this process, from ``QAIC_VISIBLE_DEVICES``."""
    env = os.environ if environ is None else environ
    return parse_visible_devices(env.get(QAIC_VISIBLE_DEVICES), available)


def qeff_home(environ: Mapping[str, str] | None = None) -> Path:
    """Root of the export/compile cache: ``$QEFF_HOME`` or ``~/.cache/qeff_models``."""
    env = os.environ if environ is None else environ
    raw = env.get(QEFF_HOME)
    if raw:
        return Path(raw).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "qeff_models"
