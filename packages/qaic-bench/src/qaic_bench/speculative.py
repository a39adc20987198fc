"""Part 6: speculative decoding, paced as a real target and draft pair on one Ultra SoC.

Method: each configuration runs in its own process with vLLM's engine in-process, the simulator
paced (``QAIC_SIM_PACE=1``) with the target's program timed as Llama-3.1-8B and the draft's as
Llama-3.2-1B (``QAIC_SIM_PACE_AS=target=...,draft=...``) on SoC 0 of an Ultra card. Output tokens
per second (wall, so paced device time plus host work) are compared with the same workload without
speculation on all 16 cores; with a draft model the cores are split 8/8. The acceptance rate is
vLLM's own (accepted / proposed drafts). The tiny models' tokens decide acceptance, so the figures
show what a given acceptance buys on the card, not the acceptance a real 8B/1B pair reaches.
Workloads: ``repetitive`` (greedy continuations of prompts that repeat a phrase) and
``non_repetitive`` (temperature 1.0 sampling of random prompts).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("qaic.bench")

TARGET_PACE = "llama-3.1-8b"
DRAFT_PACE = "llama-3.2-1b"
WORKLOADS = ("repetitive", "non_repetitive")


def pace_as(target_dir: Path, draft_dir: Path) -> str:
    """Per-program pacing: QPC paths hold the model folder's name."""
    return f"{draft_dir.name}={DRAFT_PACE},{target_dir.name}={TARGET_PACE}"


def draft_copy(model_dir: Path, work: Path) -> Path:
    """The draft: the same weights under another name (acceptance then depends on the workload only)."""
    draft = work / f"{model_dir.name}-draft"
    if not draft.exists():
        shutil.copytree(model_dir, draft)
    return draft


def prompts(workload: str, vocab_size: int, batch: int, input_len: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(7)
    out = []
    for _ in range(batch):
        if workload == "repetitive":
            phrase = rng.integers(16, vocab_size, size=6).tolist()
            out.append((phrase * (input_len // 6 + 1))[:input_len])
        else:
            out.append(rng.integers(16, vocab_size, size=input_len).tolist())
    return out


def spec_run(args: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: output tok/s and vLLM's acceptance counters."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target = Path(args["model"])
    method, k = args["method"], int(args["k"])
    extra: dict[str, Any] = {"override_qaic_config": {"device_group": [0]}}
    speculative = None
    if method != "none":
        speculative = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            speculative.update(prompt_lookup_min=1, prompt_lookup_max=4)
        if method == "draft_model":
            speculative["model"] = args["draft"]
            extra["draft_override_qaic_config"] = {"device_group": [0]}
    llm = LLM(
        model=str(target),
        max_model_len=int(args["max_model_len"]),
        max_num_seqs=int(args["batch"]),
        long_prefill_token_threshold=int(args["prefill_seq_len"]),
        dtype=args["dtype"],
        speculative_config=speculative,
        additional_config=extra,
        disable_log_stats=False,
    )
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    out: dict[str, Any] = {}
    for workload in args["workloads"]:
        batch = prompts(workload, vocab, int(args["batch"]), int(args["input_len"]))
        greedy = workload == "repetitive"
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            seed=None if greedy else 3,
            max_tokens=int(args["output_len"]),
            ignore_eos=True,
        )
        before = _counters(llm)
        start = time.perf_counter()
        requests: list[TokensPrompt] = [TokensPrompt(prompt_token_ids=p) for p in batch]
        results = llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = _counters(llm)
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        proposed = after[0] - before[0]
        accepted = after[1] - before[1]
        out[workload] = {
            "tok_s": tokens / wall,
            "proposed": proposed,
            "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
        }
    del llm
    gc.collect()
    return out


def _counters(llm: Any) -> tuple[int, int]:
    values = {m.name: m for m in llm.get_metrics()}
    drafts = values.get("vllm:spec_decode_num_draft_tokens")
    accepted = values.get("vllm:spec_decode_num_accepted_tokens")
    return (int(drafts.value) if drafts else 0, int(accepted.value) if accepted else 0)


def summarise(runs: dict[str, dict[str, Any]], ks: tuple[int, ...]) -> dict[str, Any]:
    """Speed-up against no speculation per method and K, and acceptance per method and workload."""
    base = runs["none"]
    speedup: dict[str, dict[str, float | None]] = {}
    acceptance: dict[str, dict[str, float | None]] = {}
    for name, run in runs.items():
        if name == "none":
            continue
        method, k = name.rsplit("-k", 1)
        speedup.setdefault(method, {})[k] = _ratio(run["repetitive"]["tok_s"], base["repetitive"]["tok_s"])
        if int(k) == max(ks):
            acceptance[method] = {w: _round(run[w]["acceptance"]) for w in WORKLOADS if w in run}
    return {
        "baseline_tok_s": {w: round(base[w]["tok_s"], 2) for w in WORKLOADS},
        "speedup_vs_k": speedup,
        "acceptance": acceptance,
        "paced_as": {"target": TARGET_PACE, "draft": DRAFT_PACE, "card": "ultra, one SoC"},
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))
