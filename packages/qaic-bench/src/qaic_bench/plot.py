"""report.png: the report's figures in four panels, drawn with matplotlib without a display."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _missing(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def write_plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Throughput bars, host overhead by batch, timing-model error by row and start-up times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_tput, ax_host), (ax_fid, ax_start) = axes

    stack, hf = doc.get("stack_overhead"), doc.get("hf_baseline")
    if stack and hf:
        # The unpaced serve figure is the transformers ratio's numerator.
        labels = ["serve\n(paced)", "raw loop\n(paced)", "serve\n(unpaced)", "transformers\n(unpaced)"]
        values = [stack["serve_tok_s"], stack["raw_tok_s"], hf["tok_s"] * hf["ratio"], hf["tok_s"]]
        ax_tput.bar(labels, values, color=["tab:blue", "tab:gray", "tab:blue", "tab:orange"])
        ax_tput.axvline(1.5, color="black", linewidth=0.8, linestyle="--")
        ax_tput.set_ylabel("output tokens / s")
        ax_tput.set_title(
            f"Throughput (serve/raw = {stack['ratio']:.3f}, serve/transformers = {hf['ratio']:.2f})"
        )
    else:
        _missing(ax_tput, "Throughput")

    host = doc.get("host_overhead_us")
    if host:
        batches = sorted(host, key=int)
        ax_host.bar(range(len(batches)), [host[b] for b in batches], color="tab:green")
        ax_host.set_xticks(range(len(batches)), batches)
        ax_host.set_xlabel("batch (max_num_seqs)")
        ax_host.set_ylabel("µs per decode step")
        ax_host.set_title("Host overhead per decode step")
    else:
        _missing(ax_host, "Host overhead")

    rows = doc.get("timing_model")
    if rows:
        names = [f"{r['card']} {r['model']} {r['precision']}" for r in rows]
        ax_fid.barh(names, [r["error_pct"] for r in rows], color="tab:purple")
        ax_fid.axvline(0, color="black", linewidth=0.8)
        ax_fid.set_xlabel("modelled vs published decode tok/s, error %")
        ax_fid.set_title("Timing-model fidelity")
        ax_fid.tick_params(axis="y", labelsize=7)
    else:
        _missing(ax_fid, "Timing-model fidelity")

    start = doc.get("startup_s")
    if start:
        ax_start.bar(["first (compile)", "cached"], [start["first"], start["cached"]], color="tab:red")
        ax_start.set_ylabel("seconds to /health")
        ax_start.set_title("vllm serve start-up")
    else:
        _missing(ax_start, "Start-up")

    fig.suptitle(f"qaic benchmarks @ {str(doc.get('commit') or 'unknown')[:12]}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
