"""What to change when the runtime refuses a program: the one table every backend's error path uses.

A real card answers ``Program.activate`` with a bare ``QS_NOSPC`` and ``Program.load`` with
``QS_NOMEM``; the simulator knows why. Both go through :func:`status_advice`, so a failure reads
the same on either backend: the status, what the program needs, what the devices have free, and
which setting to change to what (vLLM's spelling, the variable, and the ``qaic-aot`` flag).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qaic_core.resources import MB, DeviceResources
from qaic_core.types import QStatus


@dataclass(frozen=True)
class ProgramNeeds:
    """What a program takes on each device of its group, where known."""

    num_cores: int | None = None
    dram_bytes_per_device: int | None = None
    smaller: str = ""
    """A shape that would fit (for example ``--max-num-seqs 8 at --max-model-len 2048``), or empty."""


def cores_setting(n: int | str) -> str:
    """How to compile for ``n`` NSP cores, in every spelling the stack takes."""
    return (
        f'num_cores={n} (vLLM: --additional-config \'{{"override_qaic_config": {{"num_cores": {n}}}}}\' '
        f"or VLLM_QAIC_NUM_CORES={n}; qaic-aot: --num-cores {n})"
    )


MEMORY_SETTINGS = (
    "lower --max-num-seqs (full_batch_size) or --max-model-len (ctx_len), compress with "
    "--quantization mxfp6 and --kv-cache-dtype mxint8 (qaic-aot: --mxfp6 --mxint8), or spread the model "
    "over more devices (override_qaic_config device_group / num_devices; qaic-aot: --num-devices)"
)
"""The settings that shrink a program's device memory, in the order users reach for them."""


def _cores(needs: ProgramNeeds | None, devices: Sequence[DeviceResources]) -> str:
    cores = needs.num_cores if needs is not None else None
    short = [d for d in devices if cores is not None and d.nsp_free < cores]
    if cores is None or not short:
        return (
            "not enough free NSP cores on the device: compile with at most the free cores "
            "(qaic-util shows nspFree), "
            + cores_setting("N")
            + ", or stop the programs holding the other cores"
        )
    worst = min(short, key=lambda d: d.nsp_free)
    where = f"QID {worst.qid} has {worst.nsp_free} of {worst.nsp_total} NSP cores free"
    if worst.nsp_free == 0:
        return (
            f"the program was compiled for {cores} NSP cores but {where}: stop the programs on QID "
            f"{worst.qid}, or choose free devices with override_qaic_config device_group"
        )
    return (
        f"the program was compiled for {cores} NSP cores but {where}: compile with "
        f"{cores_setting(worst.nsp_free)}, or stop the programs holding the other cores"
    )


def _memory(needs: ProgramNeeds | None, devices: Sequence[DeviceResources]) -> str:
    need = needs.dram_bytes_per_device if needs is not None else None
    smaller = f"; {needs.smaller} would fit" if needs is not None and needs.smaller else ""
    if need is None or not devices:
        return f"not enough device memory for the program: {MEMORY_SETTINGS}{smaller}"
    worst = min(devices, key=lambda d: d.dram_free_mb)
    return (
        f"the program needs {need / MB:.0f} MB on each device but QID {worst.qid} has "
        f"{worst.dram_free_mb} of {worst.dram_total_mb} MB free: {MEMORY_SETTINGS}{smaller}, "
        "or unload the other programs on it"
    )


def status_advice(
    status: int,
    call: str,
    needs: ProgramNeeds | None = None,
    devices: Sequence[DeviceResources] = (),
) -> str:
    """The fix for a failed runtime ``call`` (``Program.activate``, ...), or empty when there is none to give."""
    code = int(status)
    if code == QStatus.NOSPC:
        return _cores(needs, devices)
    if code == QStatus.NOMEM:
        return _memory(needs, devices)
    if code in (QStatus.BUSY, QStatus.AGAIN):
        return (
            "the device is held by another process: wait for it, or choose other devices with "
            "override_qaic_config device_group (or QAIC_VISIBLE_DEVICES)"
        )
    if code == QStatus.NODEV:
        return (
            "no such device: device_group lists visible ids (after QAIC_VISIBLE_DEVICES); check them with "
            "qaic-util (or qaic-sim list)"
        )
    if code == QStatus.TIMEDOUT:
        return "the device did not answer in time: check it with qaic-util; a hung device needs a reset"
    if code in (QStatus.DEV_ERROR, QStatus.DATA_CRC_ERROR):
        return (
            "the device reported an error: reset it (sudo /opt/qti-aic/tools/qaic-util -s; this stops every "
            "program on the card) and start again"
        )
    if code == QStatus.INVAL and call.startswith("Program."):
        return (
            "the program does not match its devices: it was compiled for a different number of devices "
            "than device_group lists; recompile or fix device_group"
        )
    return ""
