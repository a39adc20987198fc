"""Asynchronous scheduling: the next step is scheduled while the device runs this one; the output is the same."""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_vllm_offline import TEXTS, as_prompts, worker_of

from qaic_core import get_plugin_manager, hookimpl
from qaic_core.observe import Observer

ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 128,
    "max_num_seqs": 3,
    "long_prefill_token_threshold": 16,
    "dtype": "float32",
    "additional_config": {"override_qaic_config": {"num_cores": 4}},
}


class InFlightAtUpdate(Observer):
    """At each of vLLM's ``update_from_output`` calls: how many device runs were handed over and not yet waited for."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.seen: list[int] = []

    def run_submitted(self, inputs: Any, exec_index: int, seconds: float) -> None:
        self.in_flight += 1

    def run_waited(self, exec_index: int, seconds: float) -> None:
        self.in_flight -= 1

    def phase(self, name: str, seconds: float) -> None:
        if name == "update":
            self.seen.append(self.in_flight)

    @hookimpl
    def qaic_observers(self) -> list[Observer]:
        return [self]


def _generate(
    model: Path,
    async_scheduling: bool,
    prompts: list[Any],
    params: list[Any],
    runs: InFlightAtUpdate | None = None,
) -> list[Any]:
    import vllm.envs
    from vllm import LLM

    pm = get_plugin_manager()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("QAIC_ASYNC_SCHEDULING", raising=False)  # the engine argument alone decides
        if runs is not None:
            pm.register(runs, name="test-in-flight")
        try:
            llm = LLM(model=str(model), seed=0, async_scheduling=async_scheduling, **ENGINE_ARGS)
        finally:
            if runs is not None:
                pm.unregister(name="test-in-flight")
        try:
            assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
            assert worker_of(llm).runner.async_scheduling is async_scheduling
            outs = llm.generate(prompts, params)
        finally:
            del llm
            gc.collect()
    vllm.envs.disable_envs_cache()
    return [[(list(o.token_ids), o.text, o.finish_reason) for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def workload(tiny_model: Path) -> Iterator[tuple[list[Any], list[Any]]]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    prompts = as_prompts([*ids, (ids[1] * 3)[:70], ids[0]])
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),  # finishes while others decode
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[5, 6, 7]),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(  # structured output: vLLM defers the step's sampling until the grammar is known
            temperature=1.0,
            seed=2,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex=r"(red|green|blue) [0-9]{2}"),
        ),
    ]
    yield prompts, params


def test_async_scheduling_gives_the_same_output(
    tiny_model: Path, workload: tuple[list[Any], list[Any]]
) -> None:
    prompts, params = workload
    sync = _generate(tiny_model, False, prompts, params)
    overlapped = _generate(tiny_model, True, prompts, params)
    assert overlapped == sync
    assert all(len(tokens) > 0 for out in sync for tokens, _, _ in out)


def test_the_device_runs_the_next_step_while_vllm_updates_from_the_last(tiny_model: Path) -> None:
    """With asynchronous scheduling the next step's run is on the device (handed over, not yet waited
    for) when vLLM's scheduler takes in the previous step's output; one step at a time, never."""
    from vllm import SamplingParams

    prompts = as_prompts([list(range(5, 5 + n)) for n in (6, 9, 4)])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    counts = {}
    for async_scheduling in (False, True):
        runs = InFlightAtUpdate()
        _generate(tiny_model, async_scheduling, prompts, [params] * len(prompts), runs)
        counts[async_scheduling] = np.asarray(runs.seen)
    assert counts[False].size > 20 and not counts[False].any()
    # Every update but the last few (the queue drains at the end) finds the next run on the device.
    overlapped = counts[True]
    assert overlapped.size > 20 and (overlapped >= 1).mean() > 0.8, overlapped.tolist()


def test_a_full_batch_of_greedy_rows_gives_the_same_output(tiny_model: Path) -> None:
    """Every slot busy and greedy: the next decode takes the argmax of the device's logits as they
    are (no copy of the rows) and starts before the requests have their tokens; same output."""
    from vllm import SamplingParams

    prompts = as_prompts([list(range(7, 7 + n)) for n in (5, 11, 8)])  # max_num_seqs is 3
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 26, 33)]
    sync = _generate(tiny_model, False, prompts, params)
    assert _generate(tiny_model, True, prompts, params) == sync
    assert [len(out[0][0]) for out in sync] == [30, 26, 33]


# -- when it is on ---------------------------------------------------------------------------------------
def _config(model: Path, *cli: str, **kwargs: Any) -> Any:
    """Engine arguments as ``vllm serve`` parses them, through the platform's config check."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    argv = ["--model", str(model), "--max-model-len", "256", "--max-num-seqs", "4", "--dtype", "float32"]
    argv += cli
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    for key, value in kwargs.items():
        setattr(args, key, value)
    return args.create_engine_config()


def test_on_by_default_and_off_with_no_async_scheduling(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("QAIC_ASYNC_SCHEDULING", raising=False)
    assert _config(tiny_model).scheduler_config.async_scheduling is True  # vLLM's default
    assert _config(tiny_model, "--async-scheduling").scheduler_config.async_scheduling is True
    assert _config(tiny_model, "--no-async-scheduling").scheduler_config.async_scheduling is False
    monkeypatch.setenv("QAIC_ASYNC_SCHEDULING", "1")  # the old opt-in still works, and changes nothing
    assert _config(tiny_model).scheduler_config.async_scheduling is True
    monkeypatch.setenv("QAIC_ASYNC_SCHEDULING", "0")  # the variable only turns it off
    with caplog.at_level(logging.INFO, logger="qaic.vllm"):
        assert _config(tiny_model, "--async-scheduling").scheduler_config.async_scheduling is False
    assert "qaic: async scheduling is off: QAIC_ASYNC_SCHEDULING=0" in caplog.text


def test_what_turns_it_off_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_vllm.platform import async_scheduling_blocker

    monkeypatch.delenv("QAIC_ASYNC_SCHEDULING", raising=False)

    def config(runner: str = "generate", kv: Any = None) -> Any:
        return SimpleNamespace(kv_transfer_config=kv, model_config=SimpleNamespace(runner_type=runner))

    assert async_scheduling_blocker(config(), False) is None
    assert "speculative decoding" in str(async_scheduling_blocker(config(), True))
    assert "KV connector" in str(async_scheduling_blocker(config(kv=object()), False))
    assert "pooling models" in str(async_scheduling_blocker(config("pooling"), False))


def test_the_eager_mode_turns_it_off(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("VLLM_QAIC_EXECUTION_MODE", raising=False)
    with caplog.at_level(logging.INFO, logger="qaic.vllm"):
        cfg = _config(tiny_model, additional_config={"execution_mode": "pyt"})
    assert cfg.scheduler_config.async_scheduling is False
    assert "async scheduling is off: not supported in the pyt (eager) execution mode" in caplog.text


class RecordingModel:
    """A step model that delegates to the runner's own and records when decodes are built, started and waited for."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.events: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def prepare_decode(self, positions: Any) -> Any:
        self.events.append("prepare")
        return RecordingPrepared(self, self.model.prepare_decode(positions))

    def submit_decode(self, rows: Any) -> Any:
        self.events.append("submit")
        return RecordingPending(self, self.model.submit_decode(rows))


class RecordingPrepared:
    def __init__(self, owner: RecordingModel, prepared: Any) -> None:
        self.owner, self.prepared = owner, prepared

    def submit(self, token_ids: Any) -> Any:
        self.owner.events.append("submit")
        return RecordingPending(self.owner, self.prepared.submit(token_ids))


class RecordingPending:
    def __init__(self, owner: RecordingModel, pending: Any) -> None:
        self.owner, self.pending = owner, pending

    def wait(self) -> Any:
        self.owner.events.append("wait")
        return self.pending.wait()


def test_the_next_decode_is_built_before_the_device_finishes_the_last(tiny_model: Path) -> None:
    """Under asynchronous scheduling a steady decode's inputs are built while the decode before it is
    still in flight, so only its tokens are written after that run ends; one step at a time, never.
    The tokens are those of one step at a time."""
    from vllm import LLM, SamplingParams

    prompts = as_prompts([list(range(5, 5 + n)) for n in (6, 9, 4)])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    events: dict[bool, list[str]] = {}
    tokens: dict[bool, list[list[int]]] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("QAIC_ASYNC_SCHEDULING", raising=False)
        for async_scheduling in (False, True):
            llm = LLM(model=str(tiny_model), seed=0, async_scheduling=async_scheduling, **ENGINE_ARGS)
            try:
                runner = worker_of(llm).runner
                recording = RecordingModel(runner.model)
                runner.model = recording  # any StepModel: the runner is typed against the contract only
                outs = llm.generate(prompts, [params] * len(prompts))
            finally:
                del llm
                gc.collect()
            events[async_scheduling] = recording.events
            tokens[async_scheduling] = [list(out.outputs[0].token_ids) for out in outs]
    assert tokens[True] == tokens[False]
    # A decode built ahead: "prepare" directly before the wait for the decode in flight.
    ahead = {
        mode: sum(a == "prepare" and b == "wait" for a, b in itertools.pairwise(ev))
        for mode, ev in events.items()
    }
    decodes = events[True].count("submit")
    assert ahead[False] == 0 and "prepare" not in events[False]
    assert decodes > 20 and ahead[True] > 0.8 * decodes, events[True]
