"""Part 7: the eager (pyt) mode beside the aot mode, and what prefix caching buys in the eager mode.

Method: each run is its own process with vLLM's engine in-process on one SoC of the simulated card,
paced (``QAIC_SIM_PACE=1``) as the report's pacing model, so wall time follows the modelled device
time of the compiled programs (aot) or of the eager steps (pyt). The same model, dtype, batch and
requests run in both modes: random prompts of ``input_len`` tokens and ``output_len`` greedy output
tokens each. Output tokens per second are wall figures (paced device time plus host work); device
seconds are the simulated QID's own total (``getPerformanceInfo``) over the run.

Prefix caching: in the eager mode, ``num_prompts`` requests sharing one long system prompt (each
with a short suffix of its own) run once with prefix caching on and once with it off; the
speed-up is the ratio of their wall times and the hit rate is vLLM's own (prefix-cache hits over
queries, in tokens).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("qaic.bench")

SHARED_PREFIX_LEN = 160
SUFFIX_LEN = 8
PREFIX_OUTPUT_LEN = 4
"""Short answers to long shared prompts: the workload where prefill, and so the prefix cache, matters."""


def prompts(workload: str, vocab_size: int, count: int, input_len: int) -> list[list[int]]:
    """``random``: independent prompts; ``shared_prefix``: one long prefix and a short suffix each."""
    import numpy as np

    rng = np.random.default_rng(11)
    if workload == "random":
        return [rng.integers(16, vocab_size, size=input_len).tolist() for _ in range(count)]
    prefix = rng.integers(16, vocab_size, size=SHARED_PREFIX_LEN).tolist()
    return [prefix + rng.integers(16, vocab_size, size=SUFFIX_LEN).tolist() for _ in range(count)]


def device_seconds() -> float:
    """Modelled device seconds of every visible QID so far (the simulator's counters)."""
    from qaic_core import get_plugin_manager

    util = get_plugin_manager().select_device_backend().runtime().Util()
    status, ids = util.getDeviceIds()
    total = 0.0
    for qid in ids if int(status) == 0 else []:
        status, info = util.getPerformanceInfo(qid)
        if int(status) == 0 and info is not None:
            total += float(getattr(info, "deviceTimeS", 0.0))
    return total


def eager_run(args: dict[str, Any]) -> dict[str, Any]:
    """One mode (``aot``/``pyt``) and prefix-caching setting in this process: tok/s, device time, hits."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    mode = args["mode"]
    extra: dict[str, Any] = {"execution_mode": mode, "override_qaic_config": {"device_group": [0]}}
    engine: dict[str, Any] = {}
    if mode == "aot":
        engine["long_prefill_token_threshold"] = int(args["prefill_seq_len"])
    else:
        engine["enable_prefix_caching"] = bool(args["prefix_caching"])
    llm = LLM(
        model=str(Path(args["model"])),
        max_model_len=int(args["max_model_len"]),
        max_num_seqs=int(args["batch"]),
        dtype=args["dtype"],
        additional_config=extra,
        disable_log_stats=False,
        **engine,
    )
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    batch = prompts(args["workload"], vocab, int(args["num_prompts"]), int(args["input_len"]))
    output_len = PREFIX_OUTPUT_LEN if args["workload"] == "shared_prefix" else int(args["output_len"])
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in batch]
    hits0, queries0 = _prefix_counters(llm)
    device0 = device_seconds()
    start = time.perf_counter()
    results = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    hits, queries = _prefix_counters(llm)
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    out = {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "device_s": device_seconds() - device0,
        "prefix_hits": hits - hits0,
        "prefix_queries": queries - queries0,
        "outputs": [list(r.outputs[0].token_ids) for r in results],
    }
    del llm
    gc.collect()
    return out


def _prefix_counters(llm: Any) -> tuple[float, float]:
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            values[metric.name] = values.get(metric.name, 0.0) + float(getattr(metric, "value", 0) or 0)
    return values.get("vllm:prefix_cache_hits", 0.0), values.get("vllm:prefix_cache_queries", 0.0)


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report section: both modes on one workload, and the prefix-caching speed-up."""
    aot, pyt = runs["aot"], runs["pyt"]
    on, off = runs["pyt-prefix-on"], runs["pyt-prefix-off"]
    return {
        "aot_tok_s": round(aot["tok_s"], 2),
        "pyt_tok_s": round(pyt["tok_s"], 2),
        "ratio_pyt_aot": round(pyt["tok_s"] / aot["tok_s"], 3) if aot["tok_s"] else None,
        "aot_device_s": round(aot["device_s"], 3),
        "pyt_device_s": round(pyt["device_s"], 3),
        "same_tokens": aot["outputs"] == pyt["outputs"],
        "prefix_off_s": round(off["wall_s"], 3),
        "prefix_on_s": round(on["wall_s"], 3),
        "prefix_speedup": round(off["wall_s"] / on["wall_s"], 3) if on["wall_s"] else None,
        "prefix_off_device_s": round(off["device_s"], 3),
        "prefix_on_device_s": round(on["device_s"], 3),
        "prefix_device_speedup": round(off["device_s"] / on["device_s"], 3) if on["device_s"] else None,
        "prefix_hit_rate": round(on["prefix_hits"] / on["prefix_queries"], 3)
        if on["prefix_queries"]
        else None,
        "prefix_same_tokens": on["outputs"] == off["outputs"],
    }


METHOD = (
    "Each run in its own process, vLLM's engine in-process on SoC 0 of the simulated card, paced as the "
    "report's pacing model. aot and pyt: the same random prompts (`input_len` tokens, `output_len` greedy "
    "output tokens each, `--max-num-seqs` = batch) in each mode; tok/s is output tokens over wall time "
    "(paced device time plus host work), device s the QID's modelled device time over the run, and "
    "'same tokens' whether both modes produced identical output (in float16 they may differ: the aot mode "
    "emulates the card's fp16 datapath in onnxruntime, the eager mode computes fp16 with torch on the host). "
    "The eager mode's wall time includes its host work, which on a small CPU can exceed the paced device "
    "time; device s is what the card would spend. Prefix caching: pyt mode, every request "
    f"shares one {SHARED_PREFIX_LEN}-token prefix, has {SUFFIX_LEN} tokens of its own and gets "
    f"{PREFIX_OUTPUT_LEN} output tokens (a prefill-heavy workload); wall and device "
    "time with prefix caching off over on, and vLLM's prefix-cache hit rate (hit tokens over queried tokens)."
)


def measure(
    model: Path, env: dict[str, str], work: Path, shape: dict[str, Any], timeout_s: float = 1800.0
) -> dict[str, Any]:
    """The four runs in child processes (``python -m qaic_bench.eager``), summarised for the report."""
    import json
    import subprocess
    import sys

    work.mkdir(parents=True, exist_ok=True)
    configs = {
        "aot": {"mode": "aot", "workload": "random", "prefix_caching": False},
        "pyt": {"mode": "pyt", "workload": "random", "prefix_caching": False},
        "pyt-prefix-off": {"mode": "pyt", "workload": "shared_prefix", "prefix_caching": False},
        "pyt-prefix-on": {"mode": "pyt", "workload": "shared_prefix", "prefix_caching": True},
    }
    runs: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        job, result, log_path = work / f"{name}.json", work / f"{name}-result.json", work / f"{name}.log"
        job.write_text(json.dumps({**shape, **config, "model": str(model)}))
        result.unlink(missing_ok=True)
        with log_path.open("wb") as handle:
            proc = subprocess.run(
                [sys.executable, "-m", "qaic_bench.eager", str(job), str(result)],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
                check=False,
            )
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"eager benchmark run {name} failed (exit {proc.returncode}):\n{tail}")
        runs[name] = json.loads(result.read_text())
        log.info("eager part %s: %.2f tok/s, %.2f s", name, runs[name]["tok_s"], runs[name]["wall_s"])
    return summarise(runs)


def section_lines(value: dict[str, Any]) -> list[str]:
    """The report's Markdown for this part."""

    def fmt(x: Any) -> str:
        return "n/a" if x is None else (f"{x:,.3f}" if isinstance(x, float) else str(x))

    return [
        "| mode | output tok/s | device s | same tokens |",
        "|---|---|---|---|",
        f"| aot | {fmt(value['aot_tok_s'])} | {fmt(value['aot_device_s'])} | {value['same_tokens']} |",
        f"| pyt | {fmt(value['pyt_tok_s'])} | {fmt(value['pyt_device_s'])} | {value['same_tokens']} |",
        "",
        f"pyt / aot: **{fmt(value['ratio_pyt_aot'])}**.",
        "",
        "| prefix caching (pyt, shared prefix) | wall s | device s |",
        "|---|---|---|",
        f"| off | {fmt(value['prefix_off_s'])} | {fmt(value['prefix_off_device_s'])} |",
        f"| on | {fmt(value['prefix_on_s'])} | {fmt(value['prefix_on_device_s'])} |",
        "",
        f"Speed-up: **{fmt(value['prefix_speedup'])}** (wall), **{fmt(value['prefix_device_speedup'])}** "
        f"(device time); hit rate {fmt(value['prefix_hit_rate'])}, same tokens: {value['prefix_same_tokens']}.",
    ]


def main(argv: list[str] | None = None) -> int:
    import json
    import sys

    job, result = (argv if argv is not None else sys.argv[1:])[:2]
    logging.basicConfig(level=logging.INFO)
    out = eager_run(json.loads(Path(job).read_text()))
    Path(result).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
