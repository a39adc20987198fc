"""Disaggregated prefill and decode: KV transfer throughput, added TTFT, and paced P/D vs co-located.

Three figures (``python -m qaic_bench.disaggregated --out DIR [--quick]``):

1. ``transfer``: GB/s of one request's KV through the connector's own transports on this host
   (hold on the prefill side, fetch and decode on the decode side), for a float16 and an mxint8
   KV shaped as Qwen2.5-0.5B's at 2048 positions. Software throughput: no link pacing.
2. ``added_ttft_ms``: one ``qaic-disagg`` 1P1D, paced as ``--pace-as``; time to first token of
   the same prompts, one at a time, through the router against the decode instance asked directly
   (one instance computing its own prompt). The difference is what disaggregation adds: the second
   hop, both PCIe copies (modelled by the simulator at the paced model's KV size) and the network
   (``--link-gbps``, paced at the paced model's KV size).
3. ``prefill_heavy``: long prompts, short answers, concurrent; 1P1D against two co-located instances
   behind the same router (same two device groups), both paced: output tokens/s, mean TTFT and
   mean time per output token.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from qaic_bench.server import free_port

log = logging.getLogger("qaic.bench.disagg")

PACE_AS = "llama-2-7b"


@dataclass(frozen=True)
class DisaggSettings:
    """Shapes and request counts of the disaggregated benchmark."""

    max_model_len: int = 512
    prefill_seq_len: int = 128
    decode_batch: int = 8
    input_len: int = 384
    output_len: int = 16
    num_prompts: int = 24
    concurrency: int = 8
    ttft_prompts: int = 6
    link_gbps: float = 100.0
    transfer_positions: int = 2048
    transfer_repeats: int = 5

    @classmethod
    def quick(cls) -> DisaggSettings:
        return cls(input_len=256, num_prompts=12, ttft_prompts=4, transfer_positions=1024, transfer_repeats=3)

    @classmethod
    def for_bench(cls, num_prompts: int) -> DisaggSettings:
        """The quick settings beside ``qaic-bench --quick`` (8 prompts), the full ones otherwise."""
        return cls.quick() if num_prompts <= 8 else cls()


# -- 1. transfer throughput -------------------------------------------------------------------
def transfer_throughput(positions: int, repeats: int) -> dict[str, dict[str, float]]:
    """GB/s (float16 KV bytes delivered per second) per transport and KV dtype, in this process."""
    from qaic_core.execution import SlotKV
    from qaic_kvconnector import wire
    from qaic_kvconnector.transport import KVClient, KVServer

    layers, heads, head_dim = 24, 2, 64  # Qwen2.5-0.5B
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for dtype in ("float16", "mxint8"):
        values = {
            f"past_{kind}.{i}": _on_grid(rng.normal(size=(1, heads, positions, head_dim)), dtype)
            for i in range(layers)
            for kind in ("key", "value")
        }
        kv = SlotKV(positions, values, dtype)
        kv_bytes = sum(int(a.nbytes) for a in values.values())
        probe = SlotKV(1, {k: v[:, :, :1] for k, v in values.items()}, dtype)
        fp = wire.fingerprint("bench", positions, probe)
        for transport in ("tcp", "shm"):
            server = KVServer("127.0.0.1", 0, fp, transport, keep_s=600)
            client = KVClient(fp, timeout_s=120)
            seconds, wire_bytes = [], 0
            try:
                for r in range(repeats + 1):
                    start = time.perf_counter()
                    header, buffers = wire.encode_kv(kv)
                    server.hold(f"r{r}", header, buffers)
                    got = client.fetch("127.0.0.1", server.port, f"r{r}").result()
                    if r:  # the first round warms up
                        seconds.append(time.perf_counter() - start)
                    wire_bytes = got.nbytes
            finally:
                client.close()
                server.close()
            best = min(seconds)
            out[f"{transport}_{dtype}"] = {
                "gb_per_s": round(kv_bytes / best / 1e9, 3),
                "kv_mb": round(kv_bytes / 1e6, 2),
                "wire_mb": round(wire_bytes / 1e6, 2),
                "ms": round(best * 1000, 2),
            }
            log.info("transfer %s %s: %s", transport, dtype, out[f"{transport}_{dtype}"])
    return out


def _on_grid(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values as a card hands them to the host: float16, and on the MXINT8 grid for an mxint8 KV."""
    from qaic_kvconnector import mxint8

    values = x.astype(np.float16)
    if dtype == "mxint8":
        codes, scales = mxint8.encode(values)
        values = mxint8.decode(codes, scales, values.shape[-1], np.float16)
    return values


# -- 2. and 3. serving ----------------------------------------------------------------------------
class Launch:
    """``qaic-disagg`` in its own process group, until ``stop()``."""

    def __init__(
        self, model: Path, args: Sequence[str], env: Mapping[str, str], work: Path, name: str
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        script = Path(sys.executable).parent / "qaic-disagg"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "qaic_kvconnector.disagg"]
        command += ["--model", str(model), "--port", str(self.port), "--log-dir", str(self.dir), *args]
        self._log = (self.dir / "qaic-disagg.log").open("wb")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )

    def wait(self, timeout: float = 1200.0) -> Launch:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qaic-disagg exited with {self.proc.returncode}: see {self.dir}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"qaic-disagg did not become ready in {timeout:.0f}s: see {self.dir}")

    def instance_url(self, name: str) -> str:
        data = json.loads((self.dir / "instances.json").read_text())
        return str(next(i["url"] for i in data if i["name"] == name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@dataclass
class Timed:
    """One streamed request: when its first and last tokens came, and how many."""

    ttft_s: float
    total_s: float
    tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / max(self.tokens - 1, 1)


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int) -> Timed:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - start
            tokens += len(ids)
    total = time.perf_counter() - start
    return Timed(ttft_s=first if first is not None else total, total_s=total, tokens=tokens)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]


def run_workload(
    url: str, model: str, batch: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        timed = list(pool.map(lambda p: stream_one(url, model, p, max_tokens), batch))
    duration = time.perf_counter() - start
    tokens = sum(t.tokens for t in timed)
    return {
        "duration_s": round(duration, 3),
        "output_tok_s": round(tokens / duration, 2),
        "mean_ttft_ms": round(statistics.mean(t.ttft_s for t in timed) * 1000, 1),
        "p90_ttft_ms": round(sorted(t.ttft_s for t in timed)[int(0.9 * (len(timed) - 1))] * 1000, 1),
        "mean_tpot_ms": round(statistics.mean(t.tpot_s for t in timed) * 1000, 2),
    }


def serving(model: Path, env: Mapping[str, str], work: Path, s: DisaggSettings) -> dict[str, Any]:
    """Added TTFT on a paced 1P1D, then the prefill-heavy workload on 1P1D and on two co-located instances."""
    served = "bench"
    common = [
        "--served-model-name", served,
        "--max-model-len", str(s.max_model_len),
        "--long-prefill-token-threshold", str(s.prefill_seq_len),
        "--decode-max-num-seqs", str(s.decode_batch),
        "--dtype", "float16",
        "--kv-port", str(free_port()),
    ]  # fmt: skip
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    heavy = prompts(s.num_prompts, s.input_len, vocab, seed=1)
    result: dict[str, Any] = {}
    pd_args = [
        *common,
        "--prefill-device-group", "0", "--decode-device-group", "1",
        "--prefill-max-num-seqs", "1", "--kv-transport", "tcp", "--kv-link-gbps", str(s.link_gbps),
        "--prefill-port", str(free_port()), "--decode-port", str(free_port()),
    ]  # fmt: skip
    pd = Launch(model, pd_args, env, work, "pd")
    try:
        pd.wait()
        single_url = pd.instance_url("decode-0")
        few = prompts(s.ttft_prompts, s.input_len, vocab, seed=2)
        stream_one(pd.url, served, few[0], 2)  # warm both paths once
        stream_one(single_url, served, few[0], 2)
        routed = [stream_one(pd.url, served, p, 4).ttft_s for p in few]
        single = [stream_one(single_url, served, p, 4).ttft_s for p in few]
        result["ttft"] = {
            "single_ms": round(statistics.mean(single) * 1000, 1),
            "disaggregated_ms": round(statistics.mean(routed) * 1000, 1),
        }
        result["added_ttft_ms"] = round((statistics.mean(routed) - statistics.mean(single)) * 1000, 1)
        log.info("TTFT: %s", result["ttft"])
        result["disaggregated"] = run_workload(pd.url, served, heavy, s.output_len, s.concurrency)
        log.info("1P1D prefill-heavy: %s", result["disaggregated"])
    finally:
        pd.stop()
    co_args = [*common, "--decode-device-group", "0", "1", "--decode-port", f"{free_port()},{free_port()}"]
    co = Launch(model, co_args, env, work, "colocated")
    try:
        co.wait()
        stream_one(co.url, served, heavy[0], 2)
        result["colocated"] = run_workload(co.url, served, heavy, s.output_len, s.concurrency)
        log.info("co-located prefill-heavy: %s", result["colocated"])
    finally:
        co.stop()
    return result


def measure(
    model: Path, env: Mapping[str, str], work: Path, settings: DisaggSettings, pace_as: str
) -> dict[str, Any]:
    """Every figure; ``env`` is a paced simulator's environment (``QAIC_SIM_PACE_AS=pace_as``)."""
    report: dict[str, Any] = {"settings": asdict(settings), "pace_as": pace_as}
    report["transfer"] = transfer_throughput(settings.transfer_positions, settings.transfer_repeats)
    report.update(serving(model, env, work, settings))
    return report


def run(model: Path, out: Path, settings: DisaggSettings, pace_as: str = PACE_AS) -> dict[str, Any]:
    """Every figure, also written to ``out/disaggregated.json``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(
        QAIC_BACKEND="sim",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        QAIC_SIM_PACE="1",
        QAIC_SIM_PACE_AS=pace_as,
        QAIC_SIM_THREADS=env.get("QAIC_SIM_THREADS", "1"),
    )
    env.setdefault("QEFF_HOME", str(out / "work" / "qeff_home"))
    report = measure(model, env, out / "work", settings, pace_as)
    (out / "disaggregated.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def markdown(report: Mapping[str, Any]) -> str:
    """The figures as a Markdown section."""
    title = f"## Disaggregated prefill and decode (paced as {report['pace_as']})"
    return "\n".join([title, "", *section_lines(report)]) + "\n"


def section_lines(report: Mapping[str, Any]) -> list[str]:
    """The figures as Markdown tables (the body of qaic-bench's report section)."""
    lines = [
        "| transfer | KV MB | on the wire MB | ms | GB/s |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["transfer"].items():
        lines.append(f"| {name} | {row['kv_mb']} | {row['wire_mb']} | {row['ms']} | {row['gb_per_s']} |")
    t = report.get("ttft", {})
    lines += [
        "",
        f"Added time to first token: **{report.get('added_ttft_ms')} ms** "
        f"(single instance {t.get('single_ms')} ms, through prefill + decode {t.get('disaggregated_ms')} ms).",
        "",
        "| prefill-heavy workload | output tok/s | mean TTFT ms | p90 TTFT ms | mean TPOT ms | duration s |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("disaggregated", "colocated"):
        row = report.get(name)
        if row:
            lines.append(
                f"| {name} | {row['output_tok_s']} | {row['mean_ttft_ms']} | {row['p90_ttft_ms']} | "
                f"{row['mean_tpot_ms']} | {row['duration_s']} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qaic_bench.disaggregated", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pace-as", default=PACE_AS)
    parser.add_argument(
        "--model", type=Path, default=None, help="a local model directory (default: the default model)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.model is None:
        from qaic_vllm.default_model import ensure_default_model

        model = ensure_default_model()
    else:
        model = args.model.resolve()
    settings = DisaggSettings.quick() if args.quick else DisaggSettings()
    report = run(model, args.out.resolve(), settings, args.pace_as)
    text = markdown(report)
    (args.out / "disaggregated.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
