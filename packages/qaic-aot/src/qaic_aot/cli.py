"""The ``qaic-aot`` command: compile a model to a cached QPC, or generate text through one."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qaic_core.errors import QaicError
from qaic_core.settings import CompileSettings

log = logging.getLogger("qaic.aot.cli")

DEFAULTS = CompileSettings()
"""Flag defaults are the settings' own defaults, so the CLI and the Python API agree."""


def _compile_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", type=Path, help="local Hugging Face model folder (config.json + weights)"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    g = parser.add_argument_group("compile settings")
    g.add_argument(
        "--ctx-len",
        type=int,
        default=DEFAULTS.ctx_len,
        help="context length (KV positions per sequence; default %(default)s)",
    )
    g.add_argument(
        "--prefill-seq-len",
        type=int,
        default=DEFAULTS.prefill_seq_len,
        help="tokens per prefill chunk (default %(default)s)",
    )
    g.add_argument(
        "--full-batch-size", type=int, default=None, help="KV slots for continuous batching (decode batch)"
    )
    g.add_argument(
        "--num-cores",
        type=int,
        default=DEFAULTS.num_cores,
        help="NSP cores per device (1-16, default %(default)s)",
    )
    g.add_argument(
        "--num-devices",
        type=int,
        default=DEFAULTS.num_devices,
        help="devices (SoCs) to tensor-slice the model over",
    )
    g.add_argument("--device-group", default=None, help="device ids to run on, comma separated, e.g. 0,1")
    g.add_argument("--mxfp6", action="store_true", help="compress matmul weights to mxfp6 (-mxfp6-matmul)")
    g.add_argument("--mxint8", action="store_true", help="keep the KV cache in mxint8 (custom_io.yaml)")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument(
        "--fp16", dest="fp16", action="store_true", default=True, help="compute in fp16 (default)"
    )
    prec.add_argument("--fp32", dest="fp16", action="store_false", help="keep fp32 (no -convert-to-fp16)")
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K: add a decode of K+1 tokens (draft verification)",
    )
    g.add_argument("--mos", type=int, default=None, help="compiler -mos value")
    g.add_argument("--aic-enable-depth-first", action="store_true", help="compiler -aic-enable-depth-first")
    g.add_argument("--compiler-args", default="", help="extra qaic-compile flags, as one quoted string")
    g.add_argument(
        "--backend", default=None, help="device backend (default: QAIC_BACKEND or the best available)"
    )
    g.add_argument("--qeff-home", type=Path, default=None, help="cache root (default: $QEFF_HOME)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def settings_from_args(args: argparse.Namespace) -> CompileSettings:
    """Build validated settings from the command line (errors name the flag to change)."""
    values: dict[str, Any] = {
        "ctx_len": args.ctx_len,
        "prefill_seq_len": args.prefill_seq_len,
        "full_batch_size": args.full_batch_size,
        "num_cores": args.num_cores,
        "num_devices": args.num_devices,
        "device_group": args.device_group,
        "mxfp6": args.mxfp6,
        "mxint8": args.mxint8,
        "convert_to_fp16": args.fp16,
        "mos": args.mos,
        "num_speculative_tokens": args.num_speculative_tokens,
        "aic_enable_depth_first": args.aic_enable_depth_first,
        "compiler_args": tuple(shlex.split(args.compiler_args)),
    }
    if values["device_group"] is None:
        values.pop("device_group")
    return CompileSettings.from_mapping(values)


def _compile(args: argparse.Namespace, settings: CompileSettings) -> Path:
    from qaic_aot.compile import compile_model

    return compile_model(
        args.model_dir,
        settings,
        backend=args.backend,
        progress=not args.no_progress,
        qeff_home=args.qeff_home,
    )


def cmd_compile(args: argparse.Namespace) -> int:
    print(_compile(args, settings_from_args(args)))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from qaic_aot.causal_lm import CausalLM, check_lengths
    from qaic_aot.model_files import check_model_dir
    from qaic_aot.session import QAICInferenceSession
    from qaic_aot.validate import validate_qpc

    settings = settings_from_args(args)
    model_dir = check_model_dir(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [list(tokenizer(p)["input_ids"]) for p in args.prompt]
    check_lengths(prompts, args.generation_len, settings.ctx_len)
    if args.qpc_path is not None:
        validate_qpc(args.qpc_path, model_dir, settings, backend=args.backend)
        qpc = Path(args.qpc_path)
    else:
        qpc = _compile(args, settings)
    device_ids = list(settings.device_group) if settings.device_group else None
    session = QAICInferenceSession(qpc, device_ids, backend=args.backend)
    try:
        lm = CausalLM(session, settings)
        outputs = lm.generate(prompts, args.generation_len, eos_token_id=tokenizer.eos_token_id)
    finally:
        session.deactivate()
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outputs]
    if args.json:
        print(
            json.dumps(
                [
                    {"prompt": p, "text": t, "token_ids": ids}
                    for p, t, ids in zip(args.prompt, texts, outputs, strict=True)
                ]
            )
        )
    else:
        for i, (prompt, text) in enumerate(zip(args.prompt, texts, strict=True)):
            print(f"=== prompt {i}: {prompt!r}")
            print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qaic-aot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_compile = sub.add_parser("compile", help="export and compile a model; prints the QPC directory")
    _compile_flags(p_compile)
    p_compile.set_defaults(func=cmd_compile)
    p_gen = sub.add_parser("generate", help="greedy generation through the compiled model, without vLLM")
    _compile_flags(p_gen)
    p_gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p_gen.add_argument("--generation-len", type=int, default=32, help="tokens to generate per prompt")
    p_gen.add_argument(
        "--qpc-path", type=Path, default=None, help="use this prebuilt QPC (checked) instead of compiling"
    )
    p_gen.add_argument("--json", action="store_true", help="print the results as JSON")
    p_gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except QaicError as exc:
        print(f"qaic-aot: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
