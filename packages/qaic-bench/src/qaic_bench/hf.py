"""Part 3: transformers ``generate`` on the same model and workload, as the baseline to beat."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qaic_core.host import usable_cpus

log = logging.getLogger("qaic.bench")


def hf_generate_tok_s(
    model_dir: Path, input_lens: Sequence[int], output_len: int, batch: int, dtype: str = "float32"
) -> dict[str, Any]:
    """Greedy ``generate`` in batches of ``batch`` same-length prompts; output tokens per second.

    Prompts of one batch share a length (the workload's lengths are fixed), so no padding is
    needed; ``min_new_tokens`` makes every sequence produce exactly ``output_len`` tokens. The
    faster of one thread and all cores is used (a short trial of each).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from qaic_bench.stack import random_prompts

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    prompts = random_prompts(input_lens, int(model.config.vocab_size), seed=1)
    batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    def run(group: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in group)
        group = [p + p[-1:] * (width - len(p)) for p in group]
        ids = torch.tensor(group, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
            )
        return int((out.shape[1] - ids.shape[1]) * ids.shape[0])

    # Give transformers its best thread count: on a busy small machine one thread can beat all of them.
    cores = usable_cpus()
    trial: dict[int, float] = {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        run(batches[0], 2)
        t0 = time.perf_counter()
        run(batches[0], 4)
        trial[threads] = time.perf_counter() - t0
    torch.set_num_threads(min(trial, key=lambda t: trial[t]))
    log.info(
        "transformers generate: %d batches of %d, %d new tokens, %d torch threads",
        len(batches),
        batch,
        output_len,
        torch.get_num_threads(),
    )
    t0 = time.perf_counter()
    tokens = sum(run(group, output_len) for group in batches)
    elapsed = time.perf_counter() - t0
    return {
        "tok_s": tokens / elapsed,
        "tokens": tokens,
        "seconds": elapsed,
        "threads": torch.get_num_threads(),
    }
