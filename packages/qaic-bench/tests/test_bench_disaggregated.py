"""The disaggregated benchmark's transfer measurement and its report section."""

from __future__ import annotations

from qaic_bench import disaggregated
from qaic_bench.report import BenchReport, render_markdown


def test_transfer_throughput_measures_each_transport_and_dtype() -> None:
    rows = disaggregated.transfer_throughput(positions=64, repeats=1)
    assert sorted(rows) == ["shm_float16", "shm_mxint8", "tcp_float16", "tcp_mxint8"]
    assert all(r["gb_per_s"] > 0 for r in rows.values())
    assert rows["tcp_mxint8"]["wire_mb"] < 0.6 * rows["tcp_float16"]["wire_mb"]  # compact on the wire


def test_section_renders_every_figure() -> None:
    figures = {
        "pace_as": "llama-2-7b",
        "transfer": {"tcp_float16": {"gb_per_s": 1.5, "kv_mb": 12.6, "wire_mb": 12.6, "ms": 8.4}},
        "ttft": {"single_ms": 410.0, "disaggregated_ms": 455.5},
        "added_ttft_ms": 45.5,
        "disaggregated": {"output_tok_s": 120.0, "mean_ttft_ms": 800.0, "p90_ttft_ms": 1200.0,
                          "mean_tpot_ms": 31.5, "duration_s": 9.0},
        "colocated": {"output_tok_s": 100.0, "mean_ttft_ms": 900.0, "p90_ttft_ms": 1500.0,
                      "mean_tpot_ms": 48.0, "duration_s": 11.0},
    }  # fmt: skip
    report = BenchReport(data={"disaggregated": figures, "commit": "abc"})
    md = render_markdown(report)
    for text in ("7. Disaggregated prefill and decode", "| tcp_float16 | 12.6 | 12.6 | 8.4 | 1.5 |",
                 "**45.5 ms**", "| disaggregated | 120.0 |", "| colocated | 100.0 |", "31.5"):  # fmt: skip
        assert text in md, text
