"""The ``qaic-aot`` command: compile a model to a cached QPC, or generate text through one."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from qaic_core.errors import QaicError
from qaic_core.settings import SETTINGS, CompileSettings, SettingSpec

log = logging.getLogger("qaic.aot.cli")


def _compile_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", type=Path, help="local Hugging Face model folder (config.json + weights)"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    g = parser.add_argument_group("compile settings")
    for spec in SETTINGS.values():
        _setting_flag(g, spec)
    g.add_argument(
        "--backend", default=None, help="device backend (default: QAIC_BACKEND or the best available)"
    )
    g.add_argument("--qeff-home", type=Path, default=None, help="cache root (default: $QEFF_HOME)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def _setting_flag(group: argparse._ArgumentGroup, spec: SettingSpec) -> None:
    """One setting's flag(s), help and default from qaic_core.settings, so the CLI and the API agree."""
    if spec.flag is None:
        return
    if spec.boolean:
        if spec.off_flag is None:
            group.add_argument(spec.flag, dest=spec.name, action="store_true", help=spec.help)
            return
        pair = group.add_mutually_exclusive_group()
        shown = " (default)" if spec.default else ""
        pair.add_argument(
            spec.flag, dest=spec.name, action="store_true", default=spec.default, help=spec.help + shown
        )
        pair.add_argument(spec.off_flag, dest=spec.name, action="store_false", help=spec.off_help)
        return
    limit = f"; {spec.limit.replace('`', '')}" if spec.limit else ""
    shown = "" if spec.default in (None, ()) else " (default %(default)s)"
    group.add_argument(spec.flag, dest=spec.name, default=spec.default, help=spec.help + limit + shown)


def settings_from_args(args: argparse.Namespace) -> CompileSettings:
    """Build validated settings from the command line (errors name the flag to change)."""
    values = {name: getattr(args, name) for name, spec in SETTINGS.items() if spec.flag is not None}
    return CompileSettings.from_mapping(values, lambda name: SETTINGS[name].flag or name)


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
