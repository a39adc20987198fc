"""The plugin's environment variables: parsing, registration with vLLM, documentation."""

from __future__ import annotations

from pathlib import Path

import pytest

from qaic_core.errors import QaicConfigError
from qaic_vllm import envs

DOCS = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def test_max_cpu_threads_parses_and_rejects_nonsense() -> None:
    assert envs.max_cpu_threads({}) is None
    assert envs.max_cpu_threads({"VLLM_QAIC_MAX_CPU_THREADS": " 2 "}) == 2
    for bad in ("0", "two", "-1"):
        with pytest.raises(QaicConfigError, match="VLLM_QAIC_MAX_CPU_THREADS"):
            envs.max_cpu_threads({"VLLM_QAIC_MAX_CPU_THREADS": bad})


def test_every_variable_is_registered_with_vllm_and_documented() -> None:
    import vllm.envs as venvs

    envs.register_with_vllm()
    text = DOCS.read_text()
    for name in envs.ENV_VARS:
        assert name in venvs.environment_variables, name
        assert f"`{name}`" in text, f"docs/vllm.md does not document {name}"


def test_dfs_flag_parses_like_every_other_boolean_variable() -> None:
    assert "aic_enable_depth_first" not in envs.overrides_from_env({})
    assert "aic_enable_depth_first" not in envs.overrides_from_env({"VLLM_QAIC_DFS_EN": " "})
    assert envs.overrides_from_env({"VLLM_QAIC_DFS_EN": "On"})["aic_enable_depth_first"] is True
    assert envs.overrides_from_env({"VLLM_QAIC_DFS_EN": "0"})["aic_enable_depth_first"] is False
    with pytest.raises(QaicConfigError, match="VLLM_QAIC_DFS_EN='maybe' is not a boolean"):
        envs.overrides_from_env({"VLLM_QAIC_DFS_EN": "maybe"})


def test_compile_variables_are_parsed_and_described_by_the_settings_table() -> None:
    from qaic_core.settings import SETTINGS

    for var, name in envs.ENV_SETTINGS.items():
        assert SETTINGS[name].override, name
        assert envs.ENV_VARS[var].startswith(SETTINGS[name].help)
    parsed = envs.overrides_from_env(
        {"VLLM_QAIC_NUM_CORES": " 8 ", "VLLM_QAIC_COMPILER_ARGS": "-a '-b c'", "VLLM_QAIC_QPC_PATH": "/q"}
    )
    assert parsed == {"num_cores": 8, "compiler_args": ("-a", "-b c"), "qpc_path": "/q"}
    with pytest.raises(QaicConfigError, match="VLLM_QAIC_MOS='two' is not an integer: give a whole number"):
        envs.overrides_from_env({"VLLM_QAIC_MOS": "two"})
