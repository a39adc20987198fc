"""A model loader and a session factory chosen by name from the engine's arguments, checked at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError


def engine_config(model: Path, additional: dict[str, Any]) -> Any:
    args = {"model": str(model), "max_model_len": 256, "max_num_seqs": 4, "dtype": "float32"}
    return EngineArgs(**args, additional_config=additional).create_engine_config()


def test_named_loader_and_session_reach_the_execution_config(tiny_model: Path) -> None:
    from qaic_vllm.config import engine_settings

    cfg = engine_config(tiny_model, {"model_loader": "hf", "session_factory": "qaicrt"})
    settings = engine_settings(cfg)
    config = settings.execution_config(str(tiny_model), get_plugin_manager().select_device_backend())
    assert (config.loader, config.session) == ("hf", "qaicrt")
    plain = engine_settings(engine_config(tiny_model, {}))
    assert (plain.model_loader, plain.session_factory) == (None, None)  # the path's own


@pytest.mark.parametrize(
    ("additional", "needle"),
    [
        ({"model_loader": "no-such-loader"}, "no-such-loader"),
        ({"session_factory": "no-such-session"}, "no-such-session"),
        ({"model_loader": 7}, "--additional-config model_loader must name a registered plugin"),
    ],
)
def test_an_unknown_name_fails_at_start_up(tiny_model: Path, additional: dict[str, Any], needle: str) -> None:
    with pytest.raises((QaicConfigError, ValueError)) as info:
        engine_config(tiny_model, additional)
    assert needle in str(info.value)
