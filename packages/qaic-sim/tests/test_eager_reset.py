"""A reset of the QID under the simulator's eager device layer: what it held is gone until reserved again."""

from __future__ import annotations

import pytest
from eager_devices import MB, open_device

from qaic_core.eager import EagerStep
from qaic_core.errors import QaicRuntimeError
from qaic_core.types import QStatus
from qaic_sim.machine import get_machine

WORK = EagerStep(query_lens=[1], seq_lens=[1], num_logits=1)


def test_after_a_reset_steps_fail_until_the_lost_memory_is_reserved_again() -> None:
    device = open_device(device_group=(2,))
    qid = get_machine().topology.device(2)
    assert qid is not None
    device.reserve("weights", 30 * MB)
    device.reserve("kv cache", 10 * MB)
    with device.step(WORK):
        pass
    get_machine().faults.reset_device(2)
    assert qid.dram_free == qid.dram_total  # the reset took the layer's memory with the rest
    failing = pytest.raises(QaicRuntimeError, match=r"QID 2 was reset and the kv cache and weights")
    with failing as failed, device.step(WORK):
        pass
    assert failed.value.status == int(QStatus.DEV_ERROR)
    device.settle("weights", 30 * MB)
    with pytest.raises(QaicRuntimeError, match=r"the kv cache held there are gone"), device.step(WORK):
        pass
    device.reserve("kv cache", 10 * MB)
    with device.step(WORK):
        pass
    assert qid.dram_free == qid.dram_total - 40 * MB
    device.close()
    assert qid.dram_free == qid.dram_total


def test_a_reset_fault_fails_its_step_and_the_steps_after_it() -> None:
    device = open_device(device_group=(2,))
    device.reserve("weights", 5 * MB)
    faults = get_machine().faults
    faults.inject("reset", qid=2, at=1)
    with pytest.raises(QaicRuntimeError, match="injected fault on QID 2: DEV_ERROR"), device.step(WORK):
        pass
    with pytest.raises(QaicRuntimeError, match="the weights held there are gone"), device.step(WORK):
        pass
    device.release("weights")  # a layer that gives up what it lost steps again
    with device.step(WORK):
        pass
    device.close()
