"""``qaic-disagg``: x prefill and y decode ``vllm serve`` instances behind one OpenAI endpoint.

Flags follow vllm-qaic's ``qaic_disagg``: one ``--prefill-device-group`` / ``--decode-device-group``
value per instance (``0..15``, ``0,1`` or ``3``), ``--prefill-port`` / ``--decode-port`` (one port,
counted up per instance, or a comma-separated list), and any vLLM flag given as
``--prefill-<flag>`` or ``--decode-<flag>`` goes to that stage only (``--prefill-max-num-seqs 1``,
``--decode-speculative-config '{...}'``, ``--prefill-override-qaic-config "num_cores:8"``); every
other vLLM flag goes to both (``--max-model-len``, ``--kv-cache-dtype mxint8``).

With ``--prefill-url`` / ``--decode-url`` instead of device groups it starts only the router, in
front of instances started elsewhere (across machines: see docs/disaggregated.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qaic_core.errors import QaicConfigError
from qaic_kvconnector import transport, wire
from qaic_kvconnector.settings import CONNECTOR_NAME

log = logging.getLogger("qaic.disagg")

STAGES = ("prefill", "decode")


@dataclass
class Stage:
    """One ``vllm serve`` instance the launcher starts."""

    role: str
    index: int
    devices: list[int]
    port: int
    kv_port: int
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: Any = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def parse_device_group(text: str) -> list[int]:
    """``0..15`` (inclusive range), ``0,1,2`` or ``3``: the QIDs of one instance."""
    value = text.strip()
    try:
        if ".." in value:
            lo, hi = (int(v) for v in value.split("..", 1))
            if hi < lo:
                raise ValueError
            return list(range(lo, hi + 1))
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise QaicConfigError(
            f"device group {text!r}: write a range 0..15, a list 0,1,2 or one id 3"
        ) from None


def parse_ports(text: str | None, count: int, default: int) -> list[int]:
    """One port per instance: a comma-separated list, or one port counted up."""
    if not text:
        return [default + i for i in range(count)]
    ports = [int(p) for p in str(text).split(",") if p.strip()]
    if len(ports) == 1:
        return [ports[0] + i for i in range(count)]
    if len(ports) != count:
        raise QaicConfigError(
            f"{len(ports)} ports given for {count} instances: give one port or one per instance"
        )
    return ports


def parse_qaic_overrides(text: str) -> dict[str, Any]:
    """vllm-qaic's ``"key:value key:value"`` (or a JSON object) as an ``override_qaic_config`` dict."""
    text = text.strip()
    if text.startswith("{"):
        return dict(json.loads(text))
    out: dict[str, Any] = {}
    for item in text.split():
        key, sep, raw = item.partition(":")
        if not sep:
            raise QaicConfigError(f"override {item!r}: write key:value (for example mxfp6_matmul:True)")
        out[key] = _value(raw)
    return out


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def split_stage_args(extra: Sequence[str]) -> dict[str, list[str]]:
    """Unknown flags by stage: ``--prefill-x v`` -> prefill ``--x v``, ``--decode-x`` -> decode, else both."""
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    target: tuple[str, ...] = STAGES
    for token in extra:
        if token.startswith("--"):
            name, eq, val = token[2:].partition("=")
            target = STAGES
            for stage in STAGES:
                if name.startswith(stage + "-"):
                    target = (stage,)
                    name = name[len(stage) + 1 :]
            token = f"--{name}{eq}{val}"
        for stage in target:
            out[stage].append(token)
    return out


def _pop_flag(args: list[str], flag: str) -> str | None:
    """Remove ``flag`` (``--flag v`` or ``--flag=v``) from ``args``; its last value."""
    value = None
    i = 0
    while i < len(args):
        token = args[i]
        if token == flag and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
            del args[i]
        else:
            i += 1
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qaic-disagg",
        allow_abbrev=False,
        description="Disaggregated prefill and decode on Cloud AI: x prefill and y decode vLLM instances "
        "behind one OpenAI endpoint. vLLM flags pass through (--prefill-<flag> / --decode-<flag> for one stage).",
    )
    p.add_argument("--model", help="the model every instance serves (required when starting instances)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port: the one OpenAI endpoint")
    p.add_argument("--prefill-device-group", nargs="+", default=[], metavar="QIDS",
                   help="one device group per prefill instance: 0..15, 0,1 or 3")  # fmt: skip
    p.add_argument("--decode-device-group", nargs="+", default=[], metavar="QIDS",
                   help="one device group per decode instance")  # fmt: skip
    p.add_argument("--prefill-port", help="HTTP port of the prefill instances (one, counted up, or a list)")
    p.add_argument("--decode-port", help="HTTP port of the decode instances (one, counted up, or a list)")
    p.add_argument("--kv-port", "--kv-handoff-port", "--kv-handOff-port", dest="kv_port", type=int, default=14579,
                   help="first KV-transfer port; each instance takes the next one (default 14579)")  # fmt: skip
    p.add_argument("--kv-host", default="127.0.0.1", help="address the instances' KV servers listen on")
    p.add_argument("--kv-transport", choices=["shm", "tcp"], default="shm",
                   help="how KV moves between the instances: shm (default, one host) or tcp")  # fmt: skip
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a decode instance waits for a request's KV before computing it itself")  # fmt: skip
    p.add_argument("--kv-link-gbps", type=float, default=None,
                   help="pace tcp transfers to this link rate (Gbit/s): models a network on one host")  # fmt: skip
    p.add_argument("--kv-link-scale", default="auto",
                   help="pace transfers as this many times larger; auto: on a simulator paced as a bigger model "
                   "(QAIC_SIM_PACE_AS), that model's KV size per position over this model's")  # fmt: skip
    p.add_argument("--on-transfer-failure", choices=["recompute", "fail"], default="recompute",
                   help="a decode instance whose KV does not arrive recomputes the prompt (default) or fails "
                   "that request")  # fmt: skip
    p.add_argument("--override-qaic-config", default=None,
                   help="override_qaic_config for both stages: 'key:value key:value' or JSON")  # fmt: skip
    p.add_argument(
        "--prefill-url", action="append", default=[], help="router only: a running prefill instance"
    )
    p.add_argument("--decode-url", action="append", default=[], help="router only: a running decode instance")
    p.add_argument(
        "--log-dir", default="qaic-disagg-logs", help="one log file per instance (default ./qaic-disagg-logs)"
    )
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds to wait for the instances")
    p.add_argument("--no-handshake-check", action="store_true",
                   help="start the router without comparing the instances' model, ctx_len and KV layout")  # fmt: skip
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def build_stages(ns: argparse.Namespace, extra: Sequence[str]) -> list[Stage]:
    """The instances to start, each with its full ``vllm serve`` command line arguments."""
    if not ns.model:
        raise QaicConfigError("--model is required to start instances (or give --prefill-url / --decode-url)")
    if not ns.decode_device_group:
        raise QaicConfigError(
            "give at least one --decode-device-group (and --prefill-device-group per prefill instance)"
        )
    colocated = not ns.prefill_device_group
    per_stage = split_stage_args(extra)
    groups = {
        "prefill": [parse_device_group(g) for g in ns.prefill_device_group],
        "decode": [parse_device_group(g) for g in ns.decode_device_group],
    }
    ports = {
        "prefill": parse_ports(ns.prefill_port, len(groups["prefill"]), 9900),
        "decode": parse_ports(ns.decode_port, len(groups["decode"]), 9800),
    }
    base_overrides = parse_qaic_overrides(ns.override_qaic_config) if ns.override_qaic_config else {}
    log_dir = Path(ns.log_dir)
    stages: list[Stage] = []
    kv_port = ns.kv_port
    seen: dict[int, str] = {}
    for role in STAGES:
        args = list(per_stage[role])
        stage_overrides = _pop_flag(args, "--override-qaic-config")
        additional = json.loads(_pop_flag(args, "--additional-config") or "{}")
        for i, devices in enumerate(groups[role]):
            for qid in devices:
                if qid in seen:
                    raise QaicConfigError(f"device {qid} is in the groups of both {seen[qid]} and {role}-{i}")
                seen[qid] = f"{role}-{i}"
            overrides = dict(base_overrides)
            if stage_overrides:
                overrides.update(parse_qaic_overrides(stage_overrides))
            overrides["device_group"] = devices
            config = dict(additional)
            config["override_qaic_config"] = {**config.get("override_qaic_config", {}), **overrides}
            kv = {
                "kv_connector": CONNECTOR_NAME,
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_port": kv_port,
                "kv_connector_extra_config": _extra_config(ns),
            }
            if role == "decode":
                kv["kv_load_failure_policy"] = ns.on_transfer_failure
            command = [str(ns.model), "--host", "127.0.0.1", "--port", str(ports[role][i])]
            if not colocated:
                command += ["--kv-transfer-config", json.dumps(kv)]
            command += ["--additional-config", json.dumps(config), *args]
            stages.append(
                Stage(role, i, devices, ports[role][i], kv_port, command, log_dir / f"{role}-{i}.log")
            )
            kv_port += 1
    return stages


def _extra_config(ns: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "transport": ns.kv_transport,
        "kv_host": ns.kv_host,
        "transfer_timeout_s": ns.kv_transfer_timeout,
    }
    if ns.kv_link_gbps:
        extra["link_gbps"] = ns.kv_link_gbps
        scale = link_scale(ns.kv_link_scale, ns.model)
        if scale != 1.0:
            extra["link_scale"] = scale
    return extra


def link_scale(value: str, model: str) -> float:
    """``--kv-link-scale``: a number, or ``auto``: on a simulator paced as a bigger model
    (``QAIC_SIM_PACE_AS``), that model's KV bytes per position over this model's, else 1."""
    if value != "auto":
        return float(value)
    pace_as = os.environ.get("QAIC_SIM_PACE_AS", "").strip()
    if not pace_as:
        return 1.0
    try:  # the simulator's presets, when it is installed: nothing here needs it otherwise
        from qaic_sim.config import pace_as_config, pace_as_for
        from qaic_sim.timing_shape import DecoderShape
    except ImportError:
        return 1.0
    paced_model = pace_as_for(pace_as, str(model))
    if paced_model is None:
        return 1.0
    paced = DecoderShape.from_config(pace_as_config(paced_model)).kv_elements_per_token
    own = DecoderShape.from_config(
        json.loads((Path(model) / "config.json").read_text())
    ).kv_elements_per_token
    return paced / own


def vllm_command() -> list[str]:
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def write_state(stages: Sequence[Stage], path: Path) -> None:
    """``instances.json`` in the log directory: each instance's name, pid, URL, KV port and log."""
    data = [
        {
            "name": s.name,
            "role": s.role,
            "pid": s.proc.pid if s.proc is not None else None,
            "url": s.url,
            "kv_port": s.kv_port,
            "devices": s.devices,
            "log": str(s.log_path),
        }
        for s in stages
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def start(stage: Stage) -> None:
    stage.log_path.parent.mkdir(parents=True, exist_ok=True)
    stage._log = stage.log_path.open("wb")
    command = [*vllm_command(), "serve", *stage.args]
    log.info("starting %s on devices %s: %s", stage.name, stage.devices, " ".join(command))
    stage.proc = subprocess.Popen(
        command, stdout=stage._log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(stages: Sequence[Stage], timeout: float = 30.0) -> None:
    """SIGTERM every instance's process group, then SIGKILL what is left after ``timeout``."""
    for stage in stages:
        if stage.proc is not None and stage.proc.poll() is None:
            _signal_group(stage.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for stage in stages:
        if stage.proc is None:
            continue
        try:
            stage.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(stage.proc.pid, signal.SIGKILL)
            stage.proc.wait(timeout=10)
        if stage._log is not None:
            stage._log.close()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_ready(stages: Sequence[Stage], timeout: float) -> None:
    """Until every instance answers /health; raises naming an instance that exited or never came up."""
    pending = list(stages)
    deadline = time.monotonic() + timeout
    while pending:
        for stage in list(pending):
            assert stage.proc is not None
            if stage.proc.poll() is not None:
                raise RuntimeError(
                    f"{stage.name} exited with status {stage.proc.returncode}; the end of "
                    f"{stage.log_path}:\n{log_tail(stage.log_path)}"
                )
            if _healthy(stage.url):
                log.info("%s is ready at %s", stage.name, stage.url)
                pending.remove(stage)
        if pending and time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise RuntimeError(
                f"{names} did not become ready within {timeout:.0f}s (see {pending[0].log_path})"
            )
        if pending:
            time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def check_handshake(stages: Sequence[Stage], kv_host: str) -> None:
    """Every prefill instance must agree with every decode instance on model, ctx_len, KV dtype and layout."""
    prints = {s.name: transport.hello(transport.endpoint(kv_host, s.kv_port)) for s in stages}
    problems = []
    for p in (s for s in stages if s.role == "prefill"):
        for d in (s for s in stages if s.role == "decode"):
            diff = wire.differences(prints[p.name], prints[d.name], p.name, d.name)
            if diff:
                problems.append(f"{p.name} and {d.name} differ: " + "; ".join(diff))
    if problems:
        raise QaicConfigError(
            "the instances cannot hand KV to each other, refused at handshake:\n  " + "\n  ".join(problems)
        )
    log.info("handshake: every instance serves %s", next(iter(prints.values())))


def run_router(
    prefills: Sequence[str], decodes: Sequence[str], host: str, port: int, access_log: bool = False
) -> None:
    from aiohttp import web

    from qaic_kvconnector.router import Router

    router = Router(prefills, decodes)
    log.info("router on http://%s:%d: prefill %s, decode %s", host, port, list(prefills), list(decodes))
    web.run_app(
        router.app(),
        host=host,
        port=port,
        print=None,
        handle_signals=True,
        access_log=logging.getLogger("qaic.disagg.access") if access_log else None,
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    ns, extra = parser().parse_known_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose > 1 else logging.INFO,
        format="(qaic-disagg) %(levelname)s %(asctime)s %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    if ns.prefill_url or ns.decode_url:
        if not ns.decode_url:
            print("qaic-disagg: --decode-url is required in router-only mode", file=sys.stderr)
            return 2
        run_router(ns.prefill_url, ns.decode_url, ns.host, ns.port, ns.verbose > 0)
        return 0
    try:
        stages = build_stages(ns, extra)
    except (QaicConfigError, ValueError) as exc:
        print(f"qaic-disagg: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for stage in stages:
            start(stage)
        write_state(stages, Path(ns.log_dir) / "instances.json")
        wait_ready(stages, ns.startup_timeout)
        if not ns.no_handshake_check and any(s.role == "prefill" for s in stages):
            check_handshake(stages, ns.kv_host)
        run_router(
            [s.url for s in stages if s.role == "prefill"],
            [s.url for s in stages if s.role == "decode"],
            ns.host,
            ns.port,
            ns.verbose > 0,
        )
        return 0
    except (QaicConfigError, RuntimeError, transport.TransferError) as exc:
        print(f"qaic-disagg: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(stages)


if __name__ == "__main__":
    sys.exit(main())
