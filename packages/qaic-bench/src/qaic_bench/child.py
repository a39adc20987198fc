"""Runs one measurement in a fresh process, so each gets its own environment (pacing) and engine.

``python -m qaic_bench.child JOB.json RESULT.json``: JOB holds ``kind`` (raw, host, hf) and
``args``; RESULT receives the measurement as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qaic_bench.server import ServeShape, tail

log = logging.getLogger("qaic.bench")


def _run_job(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    if kind == "raw":
        from qaic_bench.stack import raw_session_loop

        return raw_session_loop(
            Path(args["model"]),
            ServeShape(**args["shape"]),
            args["dtype"],
            Path(args["qeff_home"]),
            args["input_lens"],
            args["output_len"],
        )
    if kind == "host":
        from qaic_bench.host import host_overhead

        return host_overhead(
            Path(args["model"]),
            ServeShape(**args["shape"]),
            args["dtype"],
            args["input_len"],
            args["output_len"],
        )
    if kind == "hf":
        from qaic_bench.hf import hf_generate_tok_s

        return hf_generate_tok_s(
            Path(args["model"]), args["input_lens"], args["output_len"], args["batch"], args["dtype"]
        )
    if kind == "load":
        from qaic_bench.load import paced_load

        return paced_load(
            Path(args["model"]),
            ServeShape(**args["shape"]),
            args["dtype"],
            args["input_len"],
            args["output_len"],
            args["num_prompts"],
            bool(args["async_scheduling"]),
        )
    if kind == "spec":
        from qaic_bench.speculative import spec_run

        return spec_run(args)
    raise ValueError(f"unknown job kind {kind!r}: use raw, host, hf or spec")


def run_in_child(
    kind: str, args: Mapping[str, Any], env: Mapping[str, str], work_dir: Path, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Run a job in ``python -m qaic_bench.child`` with ``env``; its result, or an error with its log."""
    work_dir.mkdir(parents=True, exist_ok=True)
    job, result, log_path = (
        work_dir / f"{kind}-job.json",
        work_dir / f"{kind}-result.json",
        work_dir / f"{kind}.log",
    )
    job.write_text(json.dumps({"kind": kind, "args": dict(args)}, default=str))
    result.unlink(missing_ok=True)
    with log_path.open("wb") as handle:
        proc = subprocess.run(
            [sys.executable, "-m", "qaic_bench.child", str(job), str(result)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=dict(env),
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(
            f"the {kind} measurement failed (exit {proc.returncode}); see {log_path}:\n{tail(log_path)}"
        )
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m qaic_bench.child JOB.json RESULT.json", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=os.environ.get("QAIC_BENCH_LOG", "INFO"), format="%(asctime)s %(name)s %(message)s"
    )
    job = json.loads(Path(argv[0]).read_text())
    data = _run_job(job["kind"], job["args"])
    Path(argv[1]).write_text(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
