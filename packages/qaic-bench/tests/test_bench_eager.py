"""The eager benchmark part's summary, report section and workloads."""

from __future__ import annotations

from qaic_bench import eager
from qaic_bench.report import BenchReport, render_markdown


def run(
    tok_s: float, wall: float, hits: float = 0.0, queries: float = 0.0, outputs: list | None = None
) -> dict:
    return {
        "tok_s": tok_s,
        "wall_s": wall,
        "device_s": wall / 2,
        "prefix_hits": hits,
        "prefix_queries": queries,
        "outputs": outputs or [[1, 2]],
    }


def test_the_summary_compares_the_modes_and_the_prefix_cache() -> None:
    figures = eager.summarise(
        {
            "aot": run(100.0, 2.0),
            "pyt": run(80.0, 2.5),
            "pyt-prefix-off": run(50.0, 4.0),
            "pyt-prefix-on": run(100.0, 2.0, hits=1280, queries=1344),
        }
    )
    assert figures["ratio_pyt_aot"] == 0.8
    assert figures["prefix_speedup"] == 2.0
    assert figures["prefix_device_speedup"] == 2.0
    assert figures["prefix_hit_rate"] == 0.952
    assert figures["same_tokens"] and figures["prefix_same_tokens"]
    text = render_markdown(BenchReport(data={"eager": figures, "commit": "abc"}))
    assert "8. Eager (pyt) mode beside aot" in text
    assert "pyt / aot: **0.800**" in text and "Speed-up: **2.000**" in text


def test_the_shared_prefix_workload_shares_its_prefix() -> None:
    prompts = eager.prompts("shared_prefix", 300, 4, 64)
    assert len({tuple(p[: eager.SHARED_PREFIX_LEN]) for p in prompts}) == 1
    assert len({tuple(p) for p in prompts}) == 4
    assert all(len(p) == 64 for p in eager.prompts("random", 300, 3, 64))
