"""``python -m qaic_bench --out DIR [--quick]``: measure, then write report.json/.md/.png."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from qaic_bench.settings import DEFAULT_PACE_AS, BenchSettings

log = logging.getLogger("qaic.bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m qaic_bench", description=__doc__)
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for report.json, report.md, report.png"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer, shorter requests: a few minutes on 2 cores"
    )
    parser.add_argument(
        "--pace-as",
        default=DEFAULT_PACE_AS,
        help=f"realistic shape the simulator is paced to in part 1 (QAIC_SIM_PACE_AS; default {DEFAULT_PACE_AS})",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local Hugging Face model directory (default: the default model)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float16", "float32"),
        default="float16",
        help="model dtype of every run (float16: compiled with -convert-to-fp16, as on a card)",
    )
    parser.add_argument(
        "--vs-vllm-cpu",
        action="store_true",
        help="also compare with vLLM's own CPU backend (its environment is built once and cached)",
    )
    parser.add_argument(
        "--parts",
        default=None,
        help="comma-separated part numbers to measure (default: all); 3 needs 5, whose unpaced run it reuses",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    return parser.parse_args(argv)


def part_keys(text: str | None) -> frozenset[str] | None:
    """Report keys of ``--parts`` numbers ("2,10,11"); None for every part."""
    if text is None:
        return None
    from qaic_bench.report import COMPANIONS, TITLES

    by_number = {title.split(".", 1)[0]: key for key, title in TITLES.items() if key not in COMPANIONS}
    keys = set()
    for piece in text.split(","):
        number = piece.strip()
        if number not in by_number:
            raise ValueError(
                f"--parts {text!r}: no part {number!r}; parts are {', '.join(sorted(by_number, key=int))}"
            )
        keys.add(by_number[number])
    keys |= {companion for companion, owner in COMPANIONS.items() if owner in keys}
    return frozenset(keys)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from qaic_bench.report import validate, write_report
    from qaic_bench.run import Runner

    settings = BenchSettings.quick(args.pace_as) if args.quick else BenchSettings.full(args.pace_as)
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            print(
                f"error: --model {args.model} has no config.json: give a local Hugging Face model directory",
                file=sys.stderr,
            )
            return 2
        model = args.model.resolve()
    else:
        from qaic_vllm.default_model import ensure_default_model

        model = ensure_default_model()
    out = args.out.resolve()
    try:
        parts = part_keys(args.parts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if parts is not None and "vs_vllm_cpu" in parts:
        args.vs_vllm_cpu = True
    report = Runner(settings, out, model, args.dtype, vs_vllm_cpu=args.vs_vllm_cpu, parts=parts).run()
    paths = write_report(report, out)
    print(f"report written to {paths['json']}, {paths['md']} and {paths['png']}")
    problems = validate(report.document())
    if parts is not None:  # a subset: only the selected parts' failures count
        failed = {k: e for k, e in report.errors.items() if not e.startswith("not run:")}
        for key, err in failed.items():
            print(f"  {key}: {err}", file=sys.stderr)
        return 1 if failed else 0
    if problems:
        print("the report is incomplete:\n  " + "\n  ".join(problems), file=sys.stderr)
        for key, err in report.errors.items():
            print(f"  {key}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
