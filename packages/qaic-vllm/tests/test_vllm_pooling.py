"""Pooling on qaic without an engine: run planning, vllm-qaic's pooling keys, per-request checks."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams

from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings
from qaic_vllm import pooling_config
from qaic_vllm.overrides import read_override
from qaic_vllm.pooling_config import PoolingEngine, pooling_settings, pooling_task, set_aside
from qaic_vllm.runner.pooling import plan_runs
from qaic_vllm.validation import validate_pooling


def engine_config(override: dict[str, Any], *, runner: str = "pooling", arch: str = "BertModel") -> Any:
    """The parts of a VllmConfig the pooling configuration reads."""
    model_config = SimpleNamespace(
        runner_type=runner,
        max_model_len=128,
        hf_config=SimpleNamespace(architectures=[arch]),
        architectures=[arch],
        pooler_config=SimpleNamespace(get_seq_pooling_type=lambda: "CLS"),
    )
    return SimpleNamespace(
        model_config=model_config,
        additional_config={"override_qaic_config": dict(override)},
        scheduler_config=SimpleNamespace(max_num_seqs=4),
    )


def test_each_request_runs_on_the_smallest_length_that_holds_it() -> None:
    plan = plan_runs([3, 100, 16, 17, 1, 2, 40, 5, 6], [16, 64, 128], 4)
    assert plan == [(16, [0, 2, 4, 5]), (16, [7, 8]), (64, [3, 6]), (128, [1])]
    with pytest.raises(QaicConfigError, match="longest embed_seq_len 128"):
        plan_runs([129], [16, 128], 4)


def test_pooling_keys_are_set_aside_from_the_compile_settings() -> None:
    config = engine_config({"embed_seq_len": [32, 128], "pooling_device": "qaic", "num_cores": 4})
    assert set_aside(config) == {"embed_seq_len": [32, 128], "pooling_device": "qaic"}
    assert config.additional_config["override_qaic_config"] == {"num_cores": 4}
    assert set_aside(config) == {"embed_seq_len": [32, 128], "pooling_device": "qaic"}  # idempotent
    settings = pooling_settings(config)
    assert (settings.seq_lens, settings.device, settings.method, settings.normalize) == (
        (32, 128),
        "qaic",
        "cls",
        False,
    )


def test_pooling_keys_in_compiler_args_pieces_are_set_aside() -> None:
    """vllm-qaic reads ``key=value`` pieces of compiler_args as keys; a piece wins over the key."""
    override = {
        "compiler_args": "embed_seq_len=32,128|pooling_device=qaic -aic-perf-metrics",
        "pooling_device": "cpu",
        "num_cores": 4,
    }
    config = engine_config(override)
    assert set_aside(config) == {"embed_seq_len": "32,128", "pooling_device": "qaic"}
    rest = config.additional_config["override_qaic_config"]
    assert rest == {"compiler_args": "-aic-perf-metrics", "num_cores": 4}
    assert read_override(rest, "override")["compiler_args"] == ("-aic-perf-metrics",)
    settings = pooling_settings(config)
    assert (settings.seq_lens, settings.device) == ((32, 128), "qaic")
    config = engine_config({"compiler_args": "mos=2 -v"})
    assert set_aside(config) == {}
    assert config.additional_config["override_qaic_config"] == {"compiler_args": "mos=2 -v"}
    with pytest.raises(QaicConfigError, match="--runner pooling"):
        set_aside(engine_config({"compiler_args": "embed_seq_len=128"}, runner="generate"))


def test_softmax_is_noted_as_having_no_effect(caplog: pytest.LogCaptureFixture) -> None:
    path = SimpleNamespace(name="aot", pooling_architectures=frozenset({"BertModel"}))
    with caplog.at_level(logging.INFO, logger="qaic.vllm.pooling"):
        pooling_config.check_pooling(engine_config({"softmax": True}), path)  # type: ignore[arg-type]
    assert "softmax has no effect here" in caplog.text


def test_a_generation_engine_refuses_pooling_keys() -> None:
    with pytest.raises(QaicConfigError, match="--runner pooling"):
        set_aside(engine_config({"pooling_device": "cpu"}, runner="generate"))
    set_aside(engine_config({"pooling_device": None}, runner="generate"))  # left off: accepted


def test_a_pooling_engine_refuses_compute_context_lengths() -> None:
    """CCL sizes a causal LM's KV reads; a pooling program has no KV cache, so the keys are refused."""
    config = engine_config({"embed_seq_len": [128]})
    set_aside(config)
    for settings in (CompileSettings(ccl_enabled=True), CompileSettings(comp_ctx_lengths_decode=(64, 128))):
        with pytest.raises(QaicConfigError, match=r"ccl_enabled .*drop those keys"):
            pooling_config.configure_pooling(config, settings)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([32, 64], "must include --max-model-len 128"),
        ([32, 256], "longer than --max-model-len 128"),
        ("a,b", "not a list of sequence lengths"),
        ([0, 128], "positive sequence lengths"),
    ],
)
def test_embed_seq_len_is_checked(value: Any, message: str) -> None:
    config = engine_config({"embed_seq_len": value})
    set_aside(config)
    with pytest.raises(QaicConfigError, match=message):
        pooling_settings(config)


def test_embed_seq_len_forms_and_default() -> None:
    for value, expected in (("16, 128", (16, 128)), (128, (128,)), (None, (128,))):
        config = engine_config({"embed_seq_len": value})
        set_aside(config)
        assert pooling_settings(config).seq_lens == expected


def test_task_follows_the_architecture() -> None:
    config = engine_config({"task": "score"}, arch="XLMRobertaForSequenceClassification")
    set_aside(config)
    assert pooling_task(config) == "classify"
    config = engine_config({"task": "classify"}, arch="BertModel")
    set_aside(config)
    with pytest.raises(QaicConfigError, match="serves embed"):
        pooling_task(config)
    config = engine_config({"pooling_device": "gpu"})
    set_aside(config)
    with pytest.raises(QaicConfigError, match="pooling_device 'gpu'"):
        pooling_settings(config)


def test_requests_to_a_pooling_model_are_checked() -> None:
    engine = PoolingEngine(task="embed", max_seq_len=64, normalized_on_device=True)
    with pytest.raises(VLLMValidationError, match="does not generate text"):
        validate_pooling(SamplingParams(max_tokens=4), {"prompt_token_ids": [1, 2]}, engine)
    with pytest.raises(VLLMValidationError, match=r"65 tokens.*longest compiled sequence length 64"):
        validate_pooling(PoolingParams(task="embed"), {"prompt_token_ids": list(range(65))}, engine)
    with pytest.raises(
        VLLMValidationError, match=r"use_activation=false .no normalization. cannot be honoured"
    ):
        validate_pooling(PoolingParams(task="embed", use_activation=False), {"prompt_token_ids": [1]}, engine)
    validate_pooling(PoolingParams(task="embed"), {"prompt_token_ids": list(range(64))}, engine)


def test_engine_is_forgotten_by_a_generation_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pooling_config, "_engine", PoolingEngine("embed", 64, False))
    path = SimpleNamespace(name="aot", pooling_architectures=frozenset({"BertModel"}))
    pooling_config.check_pooling(engine_config({}, runner="generate"), path)  # type: ignore[arg-type]
    assert pooling_config.engine() is None


def pooling_app(runner: str = "pooling") -> Any:
    """A FastAPI app with vLLM's state of a server and one pooling route, behind the middleware."""
    from fastapi import FastAPI

    from qaic_vllm.pooling_server import PoolingServerMiddleware

    app = FastAPI()
    app.state.vllm_config = engine_config({}, runner=runner)

    @app.post("/v1/embeddings")
    async def embeddings() -> dict[str, str]:
        return {"object": "list"}

    app.add_middleware(PoolingServerMiddleware)
    return app


def test_a_pooling_server_refuses_generation_naming_what_it_serves() -> None:
    from fastapi.testclient import TestClient

    client = TestClient(pooling_app())
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        reply = client.post(path, json={"model": "m", "prompt": "Hi"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["message"] == (
            f"this server runs a pooling model (task embed): it serves /v1/embeddings; start a generation "
            f"model for {path}"
        )
        assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert client.post("/v1/embeddings", json={}).status_code == 200
    assert client.post("/v1/unknown", json={}).status_code == 404  # other paths keep vLLM's answer
    generation = TestClient(pooling_app(runner="generate"))
    assert generation.post("/v1/completions", json={}).status_code == 404  # not a pooling server


def test_the_middleware_is_a_default_of_vllm_serve() -> None:
    import argparse

    from qaic_vllm.pooling_server import MIDDLEWARE, add_to_parser

    parser = argparse.ArgumentParser()
    parser.add_argument("--middleware", action="append", type=str, default=[])
    add_to_parser(parser)
    add_to_parser(parser)
    assert parser.parse_args([]).middleware == [MIDDLEWARE]
    assert parser.parse_args(["--middleware", "a.b"]).middleware == [MIDDLEWARE, "a.b"]
    assert parser.parse_args([]).middleware == [MIDDLEWARE]
