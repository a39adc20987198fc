"""``python -m qaic_core.testing --backend NAME``: run the conformance suite on one backend."""

from __future__ import annotations

import argparse
import sys

from qaic_core.testing import run_suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qaic_core.testing", description=__doc__)
    parser.add_argument("--backend", required=True, help="device backend name, e.g. sim or qaicrt")
    args, rest = parser.parse_known_args(argv)
    return run_suite(args.backend, rest)


if __name__ == "__main__":
    sys.exit(main())
