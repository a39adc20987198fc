"""Where the eager path runs: the backend's eager layer, else the card through torch_qaic (faked here)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from qaic_core import get_plugin_manager
from qaic_core.descriptors import DeviceBackend
from qaic_core.eager import DeviceMemoryError, EagerDeviceRequest, EagerStep
from qaic_core.errors import QaicConfigError
from qaic_pyt import device as eager_device

REQUEST = EagerDeviceRequest(model_config={"model_type": "llama"}, device_group=(1,))


def card_backend() -> DeviceBackend:
    def unused() -> object:
        raise AssertionError("the eager path does not open the runtime")

    return DeviceBackend(name="qaicrt", package="qaic-core", runtime=unused, aicapi=unused)  # type: ignore[arg-type]


class FakeQaic(types.ModuleType):
    """``torch_qaic.qaic`` as far as the eager layer uses it."""

    def __init__(self) -> None:
        super().__init__("torch_qaic.qaic")
        self.current: int | None = None
        self.syncs = 0

    def set_device(self, qid: int) -> None:
        self.current = qid

    def mem_get_info(self, qid: int) -> tuple[int, int]:
        return 3 * 2**30, 32 * 2**30

    def synchronize(self) -> None:
        self.syncs += 1


@pytest.fixture
def fake_torch_qaic(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeQaic]:
    qaic = FakeQaic()
    package = types.ModuleType("torch_qaic")
    package.qaic = qaic  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_qaic", package)
    monkeypatch.setitem(sys.modules, "torch_qaic.qaic", qaic)
    monkeypatch.setattr(eager_device, "torch_qaic_installed", lambda: True)
    yield qaic


def test_the_simulator_offers_its_own_layer() -> None:
    layer = eager_device.open_device(get_plugin_manager().select_device_backend("sim"), REQUEST)
    assert layer.torch_device == "cpu"
    assert layer.device_ids == (1,)
    layer.close()


def test_a_card_runs_on_the_qaic_device_through_torch_qaic(fake_torch_qaic: FakeQaic) -> None:
    layer = eager_device.open_device(card_backend(), REQUEST)
    assert isinstance(layer, eager_device.TorchQaicDevice)
    assert layer.torch_device == "qaic:1" and fake_torch_qaic.current == 1
    assert layer.total_bytes() == 32 * 2**30
    layer.reserve("weights", 2 * 2**30)
    with pytest.raises(DeviceMemoryError, match="QID 1 for the kv cache"):
        layer.reserve("kv cache", 4 * 2**30)
    with layer.step(EagerStep(query_lens=[1], seq_lens=[5], num_logits=1)):
        pass
    assert fake_torch_qaic.syncs == 1


def test_without_torch_qaic_or_an_eager_layer_the_message_names_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(eager_device, "torch_qaic_installed", lambda: False)
    with pytest.raises(QaicConfigError, match=r"needs torch_qaic .* QAIC_BACKEND=sim, or choose the aot"):
        eager_device.open_device(card_backend(), REQUEST)


def test_one_soc_only(fake_torch_qaic: FakeQaic) -> None:
    with pytest.raises(QaicConfigError, match="one SoC"):
        eager_device.open_device(card_backend(), EagerDeviceRequest(model_config={}, device_group=(0, 1)))
