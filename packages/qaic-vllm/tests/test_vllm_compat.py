"""Each of vLLM's (torch's, argparse's) private seams holds on the installed release, and a moved one fails naming it."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from qaic_vllm.compat import SEAMS, TORCH_CHECKED, VLLM_CHECKED, SeamMovedError, probe_all


@pytest.mark.parametrize("name", sorted(SEAMS))
def test_the_seam_holds_on_the_installed_release(name: str) -> None:
    SEAMS[name].probe()


def test_every_seam_is_probed_at_start_up() -> None:
    probe_all()  # the platform's check_and_update_config runs it first


class MovedScheduler:
    """A scheduler of a release that renamed what the scheduler seams reach."""

    def __init__(self) -> None:
        self.max_active_requests = 1
        self.token_budget = 1
        self.request_errors: dict[str, Any] = {}

    def schedule(self) -> None:
        self.update_after_schedule(None)

    def update_after_schedule(self, scheduler_output: Any) -> None:
        return None

    def preempt_request(self, request: Any, timestamp: float) -> None:
        return None

    def update_from_output(self) -> dict[str, Any]:
        return self.request_errors


class ReorderedScheduler(MovedScheduler):
    """Keeps the private names but changes the preemption's parameters."""

    def _preempt_request(self, timestamp: float, request: Any) -> None:
        return None


class MovedEngineArgs:
    def create_engine_config(self) -> None:
        return None


class MovedParser:
    actions: list[Any] = []  # noqa: RUF012


class MovedModule:
    """torch or vLLM's adapters module without the private functions."""

    accelerator = None


@pytest.mark.parametrize(
    ("name", "stand_in", "missing"),
    [
        ("scheduler.step_limits", MovedScheduler, "self.max_num_active_reqs"),
        ("scheduler.step_update", MovedScheduler, "_update_after_schedule"),
        ("scheduler.preempt", MovedScheduler, "_preempt_request"),
        ("scheduler.preempt", ReorderedScheduler, "(self, timestamp, request)"),
        ("scheduler.fail_request", MovedScheduler, "self.grammar_compile_error_reqs"),
        ("engine_args.batch_defaults", MovedEngineArgs, "_set_default_max_num_seqs_and_batched_tokens_args"),
        ("models.st_projector", MovedModule, "_load_st_projector"),
        ("argparse.actions", MovedParser(), "_actions"),
        ("torch.accelerator", MovedModule, "is_available"),
        ("torch.privateuse1", MovedModule, "_C._get_privateuse1_backend_name"),
    ],
)
def test_a_moved_name_fails_naming_the_seam_and_the_checked_version(
    name: str, stand_in: Any, missing: str
) -> None:
    seam = SEAMS[name]
    with pytest.raises(SeamMovedError) as info:
        seam.probe(stand_in)
    message = str(info.value)
    assert f"seam {name!r}" in message and seam.checked_with in message and missing in message
    assert info.value.seam is seam


def test_seams_name_the_pinned_versions() -> None:
    assert VLLM_CHECKED == "vllm 0.34.0" and TORCH_CHECKED == "torch 2.13.0"
    pins = (VLLM_CHECKED, TORCH_CHECKED, "Python 3.11 argparse")
    assert {seam.checked_with for seam in SEAMS.values()} <= set(pins)
    noxfile = (__import__("pathlib").Path(__file__).resolve().parents[3] / "noxfile.py").read_text()
    assert '"vllm==0.34.0"' in noxfile  # the version the vLLM seams were checked with is the one tested


def test_step_limits_cap_one_schedule_and_restore_vllms_own() -> None:
    from qaic_vllm.compat.scheduler import step_limits

    class Limits:
        max_num_active_reqs = 8
        max_num_scheduled_tokens = 512

    scheduler: Any = Limits()
    with step_limits(scheduler, max_active=3, max_tokens=1024):
        assert (scheduler.max_num_active_reqs, scheduler.max_num_scheduled_tokens) == (3, 512)
    assert (scheduler.max_num_active_reqs, scheduler.max_num_scheduled_tokens) == (8, 512)
    with pytest.raises(RuntimeError), step_limits(scheduler, max_active=1, max_tokens=1):
        raise RuntimeError("a failed schedule() still restores the limits")
    assert (scheduler.max_num_active_reqs, scheduler.max_num_scheduled_tokens) == (8, 512)


def test_the_kv_cache_dtype_option_takes_the_new_value_once() -> None:
    from qaic_vllm.compat.arguments import accept_option_value

    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], type=str)

    def convert(inner: Any) -> Any:
        return lambda value: "fp8" if value == "mxint8" else inner(value)

    accept_option_value(parser, "--kv-cache-dtype", "mxint8", convert)
    accept_option_value(parser, "--kv-cache-dtype", "mxint8", convert)  # a second call changes nothing
    (action,) = [a for a in parser._actions if "--kv-cache-dtype" in a.option_strings]
    assert action.choices == ["auto", "fp8", "mxint8"]
    assert parser.parse_args(["--kv-cache-dtype", "mxint8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"


def test_vllm_filling_in_the_batch_is_told_from_a_given_one(tiny_model: Any) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from qaic_vllm.compat.engine_args import batch_defaulted, install_batch_default_probe

    install_batch_default_probe()
    install_batch_default_probe()  # wraps once
    given = EngineArgs(model=str(tiny_model), max_model_len=256, max_num_seqs=4, dtype="float32")
    chosen = EngineArgs(model=str(tiny_model), max_model_len=256, dtype="float32")
    assert batch_defaulted(given.create_engine_config().model_config) is False
    assert batch_defaulted(chosen.create_engine_config().model_config) is True


def test_docs_list_every_seam_with_its_version() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "vllm.md").read_text()
    section = text.split("## vLLM's private seams", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_.0-9]+)` \|.*\| ([^|]+?) \|$", section, flags=re.M))
    assert rows == {name: seam.checked_with for name, seam in SEAMS.items()}
