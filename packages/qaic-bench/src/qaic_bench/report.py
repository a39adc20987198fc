"""The benchmark report: one JSON document with a fixed shape, and the same figures as Markdown."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPORT_KEYS = (
    "stack_overhead",
    "host_overhead_us",
    "host_on_device_path_us",
    "hf_baseline",
    "timing_model",
    "startup_s",
    "speculative",
    "disaggregated",
    "eager",
    "embedding",
    "device_load",
    "vs_vllm_cpu",
    "machine",
    "commit",
)
"""Top-level keys of report.json, exactly these."""

SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "stack_overhead": ("serve_tok_s", "raw_tok_s", "ratio"),
    "host_overhead_us": ("1", "8", "32"),
    "host_on_device_path_us": ("1", "8", "32"),
    "hf_baseline": ("tok_s", "ratio"),
    "startup_s": ("first", "cached"),
    "machine": ("cpu", "matmul_isa", "cores", "memory", "python", "torch", "vllm"),
}
TIMING_ROW_KEYS = ("card", "model", "precision", "published_tok_s", "modelled_tok_s", "error_pct")
HOST_BATCHES = (1, 8, 32)
COMPANIONS = {"host_on_device_path_us": "host_overhead_us"}
"""Report keys another part's run measures too (``--parts`` selects them with it)."""
TITLES = {
    "stack_overhead": "1. Stack overhead (paced serve vs raw session loop)",
    "host_overhead_us": "2. Host overhead per decode step",
    "host_on_device_path_us": "2. Host work the device waits for per decode step (asynchronous scheduling, paced)",
    "hf_baseline": "3. transformers baseline",
    "timing_model": "4. Timing-model fidelity",
    "startup_s": "5. Start-up",
    "speculative": "6. Speculative decoding (paced as Llama-3.1-8B with a Llama-3.2-1B draft)",
    "disaggregated": "7. Disaggregated prefill and decode (transfer, added TTFT, paced 1P1D vs co-located)",
    "eager": "8. Eager (pyt) mode beside aot, and prefix caching (paced)",
    "embedding": "9. Pooling: embedding throughput against sentence-transformers (unpaced; paced as BGE-large)",
    "device_load": "10. The device under a paced load: busy fraction and padding waste",
    "vs_vllm_cpu": "11. vLLM's CPU backend side by side (unpaced, same model and workload)",
}


@dataclass
class BenchReport:
    """Figures by report key, plus the method and settings of each part for the Markdown."""

    data: dict[str, Any] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    dirty: bool = False

    def document(self) -> dict[str, Any]:
        """report.json: every key in REPORT_KEYS, None for a part that failed."""
        return {key: self.data.get(key) for key in REPORT_KEYS}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate(doc: Mapping[str, Any]) -> list[str]:
    """Every way ``doc`` falls short of the report shape; empty when it is complete."""
    problems: list[str] = []
    if set(doc) != set(REPORT_KEYS):
        problems.append(f"top-level keys {sorted(doc)} differ from {sorted(REPORT_KEYS)}")
    for key, wanted in SECTION_KEYS.items():
        section = doc.get(key)
        if not isinstance(section, Mapping):
            problems.append(f"{key} is missing")
            continue
        if set(section) != set(wanted):
            problems.append(f"{key} has keys {sorted(section)}, expected {sorted(wanted)}")
        for name in wanted:
            if key != "machine" and not _is_number(section.get(name)):
                problems.append(f"{key}.{name} is not a number: {section.get(name)!r}")
    rows = doc.get("timing_model")
    if not isinstance(rows, Sequence) or isinstance(rows, str) or not rows:
        problems.append("timing_model has no rows")
    else:
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping) or set(row) != set(TIMING_ROW_KEYS):
                problems.append(f"timing_model[{i}] must have keys {list(TIMING_ROW_KEYS)}")
            elif not all(_is_number(row[k]) for k in ("published_tok_s", "modelled_tok_s", "error_pct")):
                problems.append(f"timing_model[{i}] has a non-numeric figure")
    commit = doc.get("commit")
    if not isinstance(commit, str) or not commit:
        problems.append("commit is missing")
    return problems


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, rounded for the report; NaN when the denominator is not positive."""
    return round(numerator / denominator, 3) if denominator > 0 else math.nan


def median_abs_error(rows: Sequence[Mapping[str, Any]]) -> float:
    """The median of |error_pct| over the timing-model rows."""
    return round(statistics.median(abs(float(r["error_pct"])) for r in rows), 2)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: Sequence[int] = ()) -> list[str]:
    """A Markdown table; ``digits[i]`` decimals for column i (2 when not given)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [_fmt(c, digits[i] if i < len(digits) else 2) for i, c in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _section_lines(report: BenchReport, key: str) -> list[str]:
    value = report.data.get(key)
    if value is None and key == "vs_vllm_cpu" and key not in report.errors:
        return ["Not run: add `--vs-vllm-cpu` (`nox -s bench -- --vs-vllm-cpu`)."]
    if value is None:
        return [f"**Not measured:** {report.errors.get(key, 'no result')}"]
    if key == "stack_overhead":
        return _table(
            ["serve tok/s", "raw session tok/s", "ratio serve/raw"],
            [[value["serve_tok_s"], value["raw_tok_s"], value["ratio"]]],
            digits=(2, 2, 3),
        )
    if key == "host_overhead_us":
        return _table(
            ["batch", "host µs per decode step"], [[b, value[b]] for b in sorted(value, key=int)], (0, 0)
        )
    if key == "host_on_device_path_us":
        split = report.details.get("host_on_device_path") or {}

        def part(batch: str, name: str, stat: str) -> Any:
            return ((split.get(batch) or {}).get(name) or {}).get(stat)

        return _table(
            [
                "batch",
                "device wait between decode runs, µs (median)",
                "p90",
                "of it, the stack's own work after the wait returns, µs (median)",
            ],
            [[b, value[b], part(b, "wait", "p90"), part(b, "own", "median")] for b in sorted(value, key=int)],
            (0, 0, 0, 0),
        )
    if key == "hf_baseline":
        return _table(
            ["transformers generate tok/s", "ratio serve (unpaced) / transformers"],
            [[value["tok_s"], value["ratio"]]],
            digits=(2, 3),
        )
    if key == "startup_s":
        return _table(
            ["first start s (export + compile)", "cached start s"], [[value["first"], value["cached"]]]
        )
    if key == "speculative":
        methods = sorted(value["speedup_vs_k"])
        ks = sorted({k for m in methods for k in value["speedup_vs_k"][m]}, key=int)
        rows = [[m, *[value["speedup_vs_k"][m].get(k) for k in ks]] for m in methods]
        lines = _table(["method", *[f"speed-up K={k}" for k in ks]], rows, digits=(0, *[3] * len(ks)))
        acc = value["acceptance"]
        lines += [
            "",
            *_table(
                ["method", "acceptance (repetitive)", "acceptance (non-repetitive)"],
                [[m, acc[m].get("repetitive"), acc[m].get("non_repetitive")] for m in sorted(acc)],
                digits=(0, 3, 3),
            ),
        ]
        base = value["baseline_tok_s"]
        return [
            *lines,
            "",
            f"Without speculation: {base['repetitive']} tok/s (repetitive), "
            f"{base['non_repetitive']} tok/s (non-repetitive).",
        ]
    if key == "disaggregated":
        from qaic_bench.disaggregated import section_lines

        return section_lines(value)
    if key == "eager":
        from qaic_bench import eager

        return eager.section_lines(value)
    if key == "embedding":
        from qaic_bench import embedding

        return embedding.section_lines(value)
    if key == "device_load":
        busy, tok_s, waste = value["busy_fraction"], value["tok_s"], value["padding_waste"]
        idle = value.get("idle_us_per_step") or {}
        waits = value.get("decode_wait_us") or {}

        def wait(name: str, key: str) -> Any:
            return (waits.get(name) or {}).get(key)

        lines = _table(
            [
                "scheduling",
                "device busy fraction",
                "output tok/s",
                "device idle µs per step",
                "device wait between decode runs, µs (median)",
                "(p90)",
            ],
            [
                [name, busy[name], tok_s[name], idle.get(name), wait(name, "median"), wait(name, "p90")]
                for name in sorted(busy)
            ],
            digits=(0, 3, 2, 0, 0, 0),
        )
        return [
            *lines,
            "",
            *_table(
                ["padding waste", "computed / needed tokens"],
                [["prefill", waste.get("prefill")], ["decode", waste.get("decode")]],
                digits=(0, 3),
            ),
        ]
    if key == "vs_vllm_cpu":
        from qaic_bench.vllm_cpu import section_lines as vs_lines

        return vs_lines(value)
    if key == "timing_model":
        rows = [[r[k] for k in TIMING_ROW_KEYS] for r in value]
        lines = _table(["card", "model", "precision", "published tok/s", "modelled tok/s", "error %"], rows)
        return [*lines, "", f"Median absolute error: **{median_abs_error(value)} %** over {len(value)} rows."]
    raise KeyError(key)


def render_markdown(report: BenchReport) -> str:
    """report.md: the machine, then one section per part with its figures and how they were taken."""
    doc = report.document()
    machine = doc.get("machine") or {}
    commit = doc.get("commit") or "unknown"
    lines = [
        "# qaic benchmark report",
        "",
        f"Commit `{commit}`" + (" (with uncommitted changes)" if report.dirty else "") + ".",
        "",
        *_table(
            ["cpu", "matrix-multiply features", "cores", "memory", "python", "torch", "vllm"],
            [[machine.get(k, "") for k in SECTION_KEYS["machine"]]],
        ),
    ]
    for key, title in TITLES.items():
        lines += ["", f"## {title}", "", *_section_lines(report, key)]
        if report.methods.get(key):
            lines += ["", report.methods[key]]
    if report.details:
        lines += ["", "## Settings", "", "```json", json.dumps(report.details, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


def write_report(report: BenchReport, out_dir: Path) -> dict[str, Path]:
    """Write report.json, report.md and report.png into ``out_dir``; return their paths."""
    from qaic_bench.plot import write_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md", "png": out_dir / "report.png"}
    paths["json"].write_text(json.dumps(report.document(), indent=2) + "\n")
    paths["md"].write_text(render_markdown(report))
    write_plot(report.document(), paths["png"])
    return paths
