"""The ``qaic-vllm`` command: serve the default model with ``vllm serve`` on Cloud AI (or the simulator)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from qaic_vllm.default_model import DEFAULT_MODEL_NAME, ensure_default_model

DEFAULTS: dict[str, str] = {
    "--max-model-len": "1024",
    "--max-num-seqs": "4",
    "--long-prefill-token-threshold": "64",
    "--dtype": "float32",
}
"""Engine arguments serve-default adds unless given: ctx_len, full_batch_size, prefill_seq_len."""


def vllm_executable() -> str:
    """The ``vllm`` script next to this Python, else the one on PATH."""
    local = Path(sys.executable).parent / "vllm"
    if local.exists():
        return str(local)
    found = shutil.which("vllm")
    if found is None:
        raise SystemExit(
            "qaic-vllm: the 'vllm' command was not found; install vllm==0.34.0 in this environment"
        )
    return found


def serve_command(model_dir: Path, host: str, port: int, extra: Sequence[str]) -> list[str]:
    """The ``vllm serve`` argv for the default model; flags in ``extra`` win over the defaults."""
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    argv = [vllm_executable(), "serve", str(model_dir), "--served-model-name", DEFAULT_MODEL_NAME]
    for flag, value in DEFAULTS.items():
        if flag not in given:
            argv += [flag, value]
    argv += ["--host", host, "--port", str(port), *extra]
    return argv


def usage_examples(host: str, port: int) -> str:
    base = f"http://{host}:{port}/v1"
    return f"""
Once the server says "Application startup complete", try:

  curl {base}/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{DEFAULT_MODEL_NAME}", "prompt": "The card", "max_tokens": 16, "temperature": 0}}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="unused")
reply = client.chat.completions.create(
    model="{DEFAULT_MODEL_NAME}", messages=[{{"role": "user", "content": "What does json.dumps do?"}}], max_tokens=64, temperature=0
)
print(reply.choices[0].message.content)
PY

(The default model is tiny and was trained here on Python's own documentation for a few minutes:
 it answers in words about Python, not in facts to rely on.)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qaic-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve-default",
        help="build (first time) and serve the default model; extra arguments go to 'vllm serve'",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--dry-run", action="store_true", help="print the vllm command instead of running it")
    sub.add_parser("default-model", help="build the default model if needed and print its directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args, extra = _parser().parse_known_args(argv)
    if args.command == "default-model":
        if extra:
            raise SystemExit(f"qaic-vllm default-model takes no arguments, got {extra}")
        print(ensure_default_model())
        return 0
    model_dir = ensure_default_model()
    command = serve_command(model_dir, args.host, args.port, extra)
    print("qaic-vllm: " + " ".join(command), flush=True)
    print(usage_examples(args.host, args.port), flush=True)
    if args.dry_run:
        return 0
    os.execv(command[0], command)
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    raise SystemExit(main())
