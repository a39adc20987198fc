"""Offline ``LLM.generate`` on the simulator against transformers' greedy output (engine in-process)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from qaic_core import get_plugin_manager, hookimpl
from qaic_core.observe import Observer, StepRecord

FULL_BATCH = 4
CTX = 256
CHUNK = 16
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": CTX,
    "max_num_seqs": FULL_BATCH,
    "long_prefill_token_threshold": CHUNK,
    "dtype": "float32",
    # Several engines live in this module at once: each program takes 4 of the SoC's 16 NSP cores.
    "additional_config": {"override_qaic_config": {"num_cores": 4}},
}
TEXTS = [
    "Hello world, what is",
    "Once upon a time there was a small language model. It lived on a tiny card in a quiet rack, "
    "and every morning it woke up, read the prompts that were waiting in the queue",
    "The weather",
    "A",
    "Questions and answers. What is the capital of France?",
    "A recipe for bread: mix five hundred grams of flour with ten grams of salt",
    "Rivers flow from the mountains to the sea.",
]


def worker_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


class StepRecorder(Observer):
    """Keeps every serving step the runner reports through the qaic_observers hook."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def step(self, record: StepRecord) -> None:
        self.steps.append(record)

    @hookimpl
    def qaic_observers(self) -> list[Observer]:
        return [self]


@contextmanager
def registered_recorder(name: str) -> Iterator[StepRecorder]:
    """A StepRecorder registered with the process's plugin manager while the block runs."""
    recorder = StepRecorder()
    pm = get_plugin_manager()
    pm.register(recorder, name=name)
    try:
        yield recorder
    finally:
        pm.unregister(name=name)


@contextmanager
def in_process_llm(model: Path, engine_args: dict[str, Any]) -> Iterator[Any]:
    """An in-process engine (no engine-core subprocess); its runner reports to registered observers."""
    import vllm.envs
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = LLM(model=str(model), seed=0, **engine_args)
        yield engine
        del engine
        gc.collect()
    vllm.envs.disable_envs_cache()  # the engine froze vLLM's env reads; later tests set their own


@pytest.fixture(scope="module")
def steps() -> Iterator[StepRecorder]:
    with registered_recorder("test-step-recorder") as recorder:
        yield recorder


@pytest.fixture(scope="module")
def llm(tiny_model: Path, steps: StepRecorder) -> Iterator[Any]:
    """An in-process engine whose runner reports to ``steps``."""
    with in_process_llm(tiny_model, ENGINE_ARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(llm: Any) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def as_prompts(ids: list[list[int]]) -> list[Any]:
    return [{"prompt_token_ids": p} for p in ids]


def test_greedy_matches_transformers_beyond_the_batch(
    llm: Any, prompts: list[list[int]], hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    assert len(prompts) > FULL_BATCH and max(len(p) for p in prompts) > 2 * CHUNK
    outs = llm.generate(as_prompts(prompts), greedy(16))
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 16)
    assert max(record.running for record in steps.steps) == FULL_BATCH


def test_long_prefill_interleaves_with_decodes(
    llm: Any, prompts: list[list[int]], hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    long_prompt = (prompts[1] * 4)[:150]
    batch = [prompts[0], prompts[2], prompts[4], long_prompt]
    steps.steps.clear()
    outs = llm.generate(as_prompts(batch), greedy(30))
    for prompt, out in zip(batch, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 30)
    log = [(record.decode_rows, record.prefill_tokens) for record in steps.steps]
    assert max(prefill for _, prefill in log) <= CHUNK
    both = [step for step in log if step[0] > 0 and step[1] > 0]
    # The long prompt's ten chunks each ran beside the decodes of the three running streams.
    assert len(both) >= len(long_prompt) // CHUNK
    assert all(decode == 3 for decode, _ in both[-(len(long_prompt) // CHUNK) :])


def test_seeded_sampling_and_n(llm: Any, prompts: list[list[int]]) -> None:
    from vllm import SamplingParams

    params = SamplingParams(
        n=3, temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=8, ignore_eos=True
    )
    first = llm.generate(as_prompts(prompts[:2]), params)
    second = llm.generate(as_prompts(prompts[:2]), params)
    for a, b in zip(first, second, strict=True):
        assert len(a.outputs) == 3
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert all(len(o.token_ids) == 8 for o in a.outputs)


def test_stop_string_and_logprobs(
    llm: Any, prompts: list[list[int]], hf_greedy: Callable[..., list[int]], hf_logprobs: Callable[..., Any]
) -> None:
    prompt = prompts[4]
    full = llm.generate(as_prompts([prompt]), greedy(12, logprobs=2))[0].outputs[0]
    ids = list(full.token_ids)
    assert ids == hf_greedy(prompt, 12)
    ref = hf_logprobs(prompt + ids)
    for i, (token, step) in enumerate(zip(ids, full.logprobs, strict=True)):
        expected = ref[len(prompt) - 1 + i]
        assert abs(step[token].logprob - float(expected[token])) < 1e-3
        assert step[token].rank == 1
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    stopped = llm.generate(as_prompts([prompt]), greedy(12, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_profile_writes_per_iteration_traces(
    llm: Any, prompts: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    llm.start_profile()
    llm.generate(as_prompts([prompts[0], (prompts[1] * 2)[:60]]), greedy(8))
    llm.stop_profile()
    dirs = sorted(
        (p for p in tmp_path.iterdir() if p.name.startswith("lrt_trace_iter")),
        key=lambda p: p.stat().st_mtime,
    )
    assert dirs and dirs[0].name == f"lrt_trace_iter0_pid{os.getpid()}"
    assert len(dirs) >= 8  # one per engine step: 4 prefill chunks, then decodes
    runs = [[json.loads(f.read_text()) for f in sorted(d.glob("lrt_trace_*/summary.json"))] for d in dirs]
    assert all(step for step in runs)
    mixed = [step for step in runs if {r["specialization"] for r in step} == {"Prefill", "Decode"}]
    assert mixed, "a prefill chunk ran in the same step as the decode of the first request"
    for step in mixed:
        # The decode and the prefill chunk went out on separate exec objects, both in flight.
        assert len({(r["queue"], r["exec_obj"]) for r in step}) == 2
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    before = set(tmp_path.iterdir())
    llm.start_profile()
    llm.generate(as_prompts(prompts[:1]), greedy(2))
    llm.stop_profile()
    assert set(tmp_path.iterdir()) == before  # unset: nothing is written


def test_qpc_is_cached_and_prebuilt_qpc_is_checked(
    llm: Any, tiny_model: Path, prompts: list[list[int]], hf_greedy: Callable[..., list[int]]
) -> None:
    from vllm import LLM

    qpc_dir = Path(worker_of(llm).step_model.qpc_dir)
    program = qpc_dir / "qpc" / "programqpc.bin"
    stamp = program.stat().st_mtime_ns
    again = LLM(model=str(tiny_model), **ENGINE_ARGS)
    assert Path(worker_of(again).step_model.qpc_dir) == qpc_dir and program.stat().st_mtime_ns == stamp
    del again
    gc.collect()

    prebuilt = LLM(
        model=str(tiny_model),
        **{
            **ENGINE_ARGS,
            "additional_config": {"override_qaic_config": {"qpc_path": str(qpc_dir), "num_cores": 4}},
        },
    )
    out = prebuilt.generate(as_prompts(prompts[:1]), greedy(6))[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(prompts[0], 6)
    del prebuilt
    gc.collect()

    with pytest.raises(Exception, match=r"full_batch_size: program \[4\], requested 2.*--max-num-seqs"):
        LLM(
            model=str(tiny_model),
            **{
                **ENGINE_ARGS,
                "max_num_seqs": 2,
                "additional_config": {"override_qaic_config": {"qpc_path": str(qpc_dir), "num_cores": 4}},
            },
        )


def test_structured_output_follows_the_grammar(llm: Any, prompts: list[list[int]]) -> None:
    import re

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    choice = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    )
    outs = llm.generate(as_prompts(prompts[:3]), choice)
    assert all(o.outputs[0].text in {"yes", "no", "maybe"} for o in outs)
    pattern = r"(red|green|blue) [0-9]{2}"
    regex = SamplingParams(
        temperature=1.0, seed=2, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    mixed = llm.generate(as_prompts(prompts[:2]), [regex, greedy(5)])
    assert re.fullmatch(pattern, mixed[0].outputs[0].text)
    assert len(mixed[1].outputs[0].token_ids) == 5  # a plain request in the same batch is unaffected


def test_generation_stops_at_max_model_len(
    llm: Any, prompts: list[list[int]], hf_greedy: Callable[..., list[int]]
) -> None:
    long_prompt = (prompts[1] * 10)[: CTX - 6]
    out = llm.generate(as_prompts([long_prompt]), greedy(50))[0].outputs[0]
    assert len(long_prompt) + len(out.token_ids) == CTX  # the last KV position of the slot is used
    assert out.finish_reason == "length"
    assert list(out.token_ids) == hf_greedy(long_prompt, len(out.token_ids))
