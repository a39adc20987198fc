"""The ``qaic-sim`` command: list devices, inspect a program, compile like qaic-compile, show fidelity."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from qaic_core.errors import QaicError

USAGE = """qaic-sim list                      simulated devices and their free resources
qaic-sim qpc PATH                  bindings and specializations of a compiled program
qaic-sim compile -aic-hw ... -m=X.onnx -aic-binary-dir=DIR/qpc   (qaic-compile flags)
qaic-sim fidelity [--json]         the timing model against every published decode figure"""


def cmd_list(console: Console) -> int:
    from qaic_sim.machine import get_machine

    topo = get_machine().topology
    table = Table(title=f"qaic-sim devices ({topo.config.source})")
    for col in ("QID", "phys", "SKU", "card", "SoC", "NSP free/total", "DRAM free/total (MB)", "runs"):
        table.add_column(col, justify="right" if col not in ("SKU",) else "left")
    for d in topo.devices:
        table.add_row(
            str(d.qid),
            str(d.physical_qid),
            d.sku.value,
            str(d.card),
            str(d.soc),
            f"{d.nsp_free}/{d.nsp_total}",
            f"{d.dram_free // 2**20}/{d.dram_total // 2**20}",
            str(d.runs),
        )
    console.print(table)
    return 0


def cmd_qpc(console: Console, path: str) -> int:
    from qaic_sim.qpcfile import find_program, read_manifest

    manifest, _ = read_manifest(path)
    console.print(f"[bold]{find_program(path)}[/bold]")
    console.print(
        f"cores {manifest.num_cores}, devices {manifest.num_devices}, fp16 {manifest.convert_to_fp16}, "
        f"mxfp6 {manifest.mxfp6_matmul}, device memory {manifest.dram_bytes / 2**20:.1f} MB "
        f"(weights {manifest.weights_bytes / 2**20:.1f}, retained {manifest.retained_bytes / 2**20:.1f}, "
        f"activations {manifest.activation_bytes / 2**20:.1f})"
    )
    table = Table(title="bindings")
    for col in ("index", "name", "dir", "type", "dims", "bytes", "retained"):
        table.add_column(col)
    retained = set(manifest.retained) | set(manifest.retained.values())
    for b in manifest.bindings:
        table.add_row(
            str(b.index),
            b.name,
            b.dir.name.lower(),
            b.type.name + (f" ({manifest.precisions[b.name]})" if b.name in manifest.precisions else ""),
            str(list(b.dims)),
            str(b.size),
            "yes" if b.name in retained else "",
        )
    console.print(table)
    specs = Table(title="specializations")
    specs.add_column("#")
    specs.add_column("name")
    specs.add_column("symbols")
    for i, s in enumerate(manifest.specs):
        specs.add_row(str(i), s.name, ", ".join(f"{k}={v}" for k, v in s.symbols.items()))
    console.print(specs)
    return 0


def cmd_compile(argv: Sequence[str]) -> int:
    from qaic_sim.compiler import compile_argv

    path = compile_argv(list(argv))
    print(f"wrote {path}")
    return 0


def cmd_fidelity(as_json: bool) -> int:
    """The fidelity table as Markdown, or with ``--json`` as a JSON list of rows (see ``fidelity_rows``).

    Each JSON row has ``card``, ``model``, ``precision``, ``num_devices``, ``num_cores``,
    ``published_tok_s``, ``modelled_tok_s`` and ``error_pct``; tools read this instead of importing
    the simulator.
    """
    from qaic_sim.fidelity import fidelity_rows, markdown_table

    rows = fidelity_rows()
    print(json.dumps(rows, indent=2) if as_json else markdown_table(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    is_compile = bool(args) and args[0] == "compile"
    level = logging.INFO if is_compile else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    try:
        if is_compile:
            return cmd_compile(args[1:])  # qaic-compile's own argv, not argparse syntax
        parser = argparse.ArgumentParser(prog="qaic-sim", usage=USAGE)
        sub = parser.add_subparsers(dest="cmd", required=True)
        sub.add_parser("list", help="simulated devices and their free resources")
        qpc = sub.add_parser("qpc", help="bindings and specializations of a compiled program")
        qpc.add_argument("path")
        sub.add_parser("compile", help="compile with qaic-compile flags")
        fid = sub.add_parser("fidelity", help="the timing model against every published decode figure")
        fid.add_argument("--json", action="store_true", help="print the rows as JSON instead of Markdown")
        ns = parser.parse_args(args)
        if ns.cmd == "fidelity":
            return cmd_fidelity(ns.json)
        return cmd_list(console) if ns.cmd == "list" else cmd_qpc(console, ns.path)
    except (QaicError, FileNotFoundError) as exc:
        # On stderr, as the real compiler writes its errors: callers that keep stderr show the cause.
        Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
