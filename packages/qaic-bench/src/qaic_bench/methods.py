"""How each figure was measured, in words, for report.md (filled with this run's settings)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from qaic_bench import eager
from qaic_bench.settings import BenchSettings
from qaic_bench.vllm_cpu import CompareSettings


def _f(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


PHASE_NAMES = {
    "schedule": "scheduling",
    "runner_inputs": "runner: inputs and outputs",
    "sampling": "sampling",
    "engine_other": "engine core and output processing",
}


def host_breakdown(results: Mapping[str, Any]) -> str:
    """A Markdown table: each batch's median host µs per phase, and the device time left out."""
    rows = [v for k, v in sorted(results.items()) if k.startswith("host_") and "phases_us" in v]
    if not rows:
        return ""
    rows.sort(key=lambda v: v["batch"])
    header = ["batch", "host", *PHASE_NAMES.values(), "device (excluded)", "steps"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in rows:
        cells = [v["batch"], f"{v['host_us']:.0f}"]
        cells += [f"{v['phases_us'].get(k, 0.0):.0f}" for k in PHASE_NAMES]
        cells += [f"{v['device_us']:.0f}", v["steps"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    missing = sorted({m for v in rows for m in v.get("missing_phases", [])})
    note = f"\n\nNot found, so not split out: {', '.join(missing)}." if missing else ""
    return "Median µs per decode step:\n\n" + "\n".join(lines) + note


def _qpc_note(results: Mapping[str, Any]) -> str:
    first, cached = results.get("qpc_first_s"), results.get("qpc_cached_s")
    if first is None or cached is None:
        return ""
    return (
        f" Of these, the worker logged {_f(first, 1)} s for export + compile on the first start and "
        f"{_f(cached, 1)} s for the cache lookup on the cached one; the rest is vLLM's own start-up."
    )


def _ccl_text(s: BenchSettings) -> str:
    lengths = CompareSettings.for_bench(s).comp_ctx_lengths()
    return ", ".join(map(str, lengths)) if lengths else "none"


def describe(s: BenchSettings, dtype: str, model: str, results: Mapping[str, Any]) -> dict[str, str]:
    """One paragraph per report key."""
    from qaic_bench.embedding import METHOD as EMBEDDING_METHOD

    additional = s.serve_shape.additional_config()
    served = f" --additional-config '{json.dumps(additional)}'" if additional else ""
    c = CompareSettings.for_bench(s)
    workload = (
        f"{s.num_prompts} requests of {s.input_len} prompt tokens and exactly {s.output_len} output tokens "
        f"(`--ignore-eos`), at most {s.batch} in flight, on a program compiled for `--max-num-seqs {s.batch} "
        f"--max-model-len {s.max_model_len} --long-prefill-token-threshold {s.prefill_seq_len} --dtype {dtype}"
        f"{served}`"
    )
    if additional:
        workload += (
            f" (every free slot starts a prompt in the next step, up to {s.serve_shape.max_num_partial_prefills} "
            f"prompts in prefill at once, and the prefill runs {s.serve_prefill_batch} prompts of up to "
            f"{s.prefill_seq_len} tokens together; the raw loop runs the same program)"
        )
    raw = results.get("raw_paced") or {}
    paced = results.get("serve_paced") or {}
    unpaced = results.get("serve_unpaced") or {}
    hf = results.get("hf") or {}
    host = {k: v for k, v in results.items() if k.startswith("host_")}
    on_path = results.get("on_path") or {}
    path_rows = ", ".join(
        f"batch {b}: p90 {v['decode_wait_us']['p90']} µs over {v['decode_wait_us']['count']} waits"
        for b, v in sorted(on_path.items(), key=lambda kv: int(kv[0]))
        if v.get("decode_wait_us")
    )
    host_rows = ", ".join(
        f"batch {v['batch']}: {v['steps']} steps, device {_f(v['device_us'], 0)} µs/step"
        for v in host.values()
    )
    return {
        "stack_overhead": (
            f"`vllm serve` of `{model}` on the simulator, paced with `QAIC_SIM_PACE=1 "
            f"QAIC_SIM_PACE_AS={s.pace_as}` (each run takes the modelled device time of that shape on one "
            f"{s.topology} SoC while the small model is computed), measured by `vllm bench serve --backend openai "
            f"--dataset-name random`: {workload}. serve tok/s is its `output_throughput` "
            f"({paced.get('total_output_tokens', '?')} tokens in {_f(paced.get('duration', '?'))} s). The raw loop is "
            f"`qaic_aot.CausalLM.generate` (greedy, continuous batching over the same KV slots) on the same QPC "
            f"with the same pacing, prompt lengths and output length ({raw.get('tokens', '?')} tokens in "
            f"{_f(raw.get('seconds', '?'))} s). ratio = serve / raw; 1.0 means the stack adds nothing to device time."
        ),
        "host_overhead_us": (
            "vLLM's engine in-process (`LLM`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, no pacing) with "
            f"`--max-num-seqs` = batch, {s.host_input_len}-token prompts, {s.host_output_len} output tokens each. "
            "An observer registered through the `qaic_observers` hook receives the time of every "
            "`QAICInferenceSession.submit` and `RunHandle.wait`; a step's host time is the wall "
            "time of `LLMEngine.step()` (scheduling, input preparation, sampling, output processing and "
            "detokenization) minus the time spent in those session calls. Reported: the median over decode-only "
            f"steps with every slot busy ({host_rows or 'n/a'}). The split uses the phases the stack reports: "
            "the QAIC scheduler's `schedule`, the runner's step (less device time and sampling) and its "
            "sampling; the rest is vLLM's engine core and output processing.\n\n" + host_breakdown(results)
        ),
        "hf_baseline": (
            f"transformers `generate` (greedy, {dtype}, torch threads: {hf.get('threads', '?')}, the faster of one "
            "thread and all cores in a short trial) on the same model, "
            f"the same prompt lengths and output length in batches of {s.batch}, against the unpaced `vllm serve` "
            f"run of the same workload ({_f(unpaced.get('output_throughput', '?'))} tok/s). ratio = serve / "
            "transformers: both compute the small model on this CPU, so this compares the stacks, not devices."
        ),
        "speculative": (
            f"Each configuration in its own process, paced as Llama-3.1-8B (target) with Llama-3.2-1B (draft) "
            f"on one {s.topology} SoC; {s.batch} requests of {s.spec_input_len} prompt tokens and "
            f"{s.spec_output_len} output tokens; K in {list(s.spec_ks)}; speed-up = output tok/s over the same "
            "workload without speculation on all 16 cores; acceptance = vLLM's accepted / proposed drafts at "
            "the largest K. The draft is the target's own weights, and the tiny models decide acceptance."
        ),
        "disaggregated": (
            "Transfer: one request's KV (shaped as Qwen2.5-0.5B's) held by a KV server and fetched by a client "
            "in one process, best of a few rounds, float16 and mxint8 (compact on the wire), TCP and shared "
            f"memory; GB/s counts float16 KV bytes delivered. Serving: `qaic-disagg` paced as {s.pace_as} "
            "(PCIe copies of the slot and a 100 Gbit/s network sized as that model's KV); added TTFT = mean "
            "time to first token through prefill + decode minus the decode instance computing the same "
            "prompts itself, one request at a time; prefill-heavy = long prompts, short answers, concurrent, "
            "on 1P1D and on two co-located instances on the same two device groups behind the same router."
        ),
        "eager": eager.METHOD,
        "embedding": EMBEDDING_METHOD,
        "host_on_device_path_us": (
            f"The steps of part 2 ({s.host_input_len}-token prompts, {s.host_output_len} output tokens, one "
            f"request per slot) with asynchronous scheduling (vLLM's default), paced as `{s.pace_as}` so "
            "that the device, not the host, is the slower side, as on a card; vLLM's engine in-process. "
            "From the simulator's trace (the backend's `trace` control), the time from one decode run's end "
            "to the next decode run's start on the device: the host work the device waits for per decode "
            "step (waking on the finished run, sampling it, writing the sampled tokens into the next decode "
            "prepared beforehand and handing it over). vLLM's scheduling and output processing, and the rest "
            f"of part 2's host work, run while the device computes. Median per batch ({path_rows or 'n/a'})."
        ),
        "device_load": (
            f"The serve workload of part 1 ({workload}) generated by vLLM's engine in-process, paced as "
            f"`{s.pace_as}`, with asynchronous scheduling (vLLM's default) and without. Busy "
            "fraction: the modelled device time the runtime's counters gained (`Util.getPerformanceInfo`) "
            "over the wall time; device idle µs per step: the wall time the device was not busy over the "
            "runner's steps (host work not hidden behind the device, the workload's start and end "
            "included); device wait between decode runs: from the simulator's trace, the time from one "
            "decode run's end to the next decode run's start on the device (sampling the last step, "
            "preparing and handing over the next), median and 90th percentile. Padding waste: token positions the device computed over those the "
            "requests needed, from the runner's step records (prefill chunks padded to their compiled "
            "length; every KV slot of a full-batch decode)."
        ),
        "vs_vllm_cpu": (
            "`vllm serve` of the same model in vLLM's CPU build (`vllm-cpu`, its own cached environment) and "
            "in qaic on the simulator, unpaced, at batch 4 and 16 (qaic with compute-context lengths "
            f"{_ccl_text(s)}: `comp_ctx_lengths_prefill` and `_decode`); `vllm bench serve` (random "
            f"{c.input_len}-token prompts, {c.output_len} output tokens, `--ignore-eos`, "
            f"{c.prompts_per_batch} x batch prompts per run) alternating between the two for {c.rounds} "
            "rounds, the other server paused during each run; medians and the ratios qaic / CPU backend, and each server's lowest and highest rate "
            "and p99 TTFT over the rounds (a stalled round shows in its p99 TTFT)."
        ),
        "timing_model": (
            "`qaic-sim fidelity --json`: the simulator's roofline timing model against every published "
            "Cloud AI 100 decode rate (batch 1, prompt 1024, generate 1024, ctx 2048). Computed, not timed."
        ),
        "startup_s": (
            "Seconds from launching `vllm serve` until both `/health` and `/v1/models` answer. First: an empty "
            "`QEFF_HOME`, so the model is exported to ONNX and compiled (the unpaced server). Cached: the next "
            "start with the same `QEFF_HOME` and engine arguments, which reuses the QPC (the paced server; "
            "pacing changes no compile setting and only lengthens device runs)." + _qpc_note(results)
        ),
    }
