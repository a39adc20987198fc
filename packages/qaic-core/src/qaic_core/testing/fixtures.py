"""pytest plugin of the conformance suite: the ``--qaic-backend`` option and fixtures."""

from __future__ import annotations

import pytest

from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicBackendNotFoundError
from qaic_core.manager import get_plugin_manager
from qaic_core.runtime import AicApiModule, QaicrtModule


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--qaic-backend", default=None, help="device backend under test")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(capability): skip unless the backend claims it")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> DeviceBackend:
    name = request.config.getoption("--qaic-backend")
    pm = get_plugin_manager()
    try:
        return pm.select_device_backend(name)
    except QaicBackendNotFoundError as err:
        pytest.exit(f"cannot run the conformance suite: {err}", returncode=2)


@pytest.fixture(autouse=True)
def _capability_gate(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("requires")
    if marker is None:
        return
    backend: DeviceBackend = request.getfixturevalue("backend")
    missing = [c for c in marker.args if c not in backend.capabilities]
    if missing:
        pytest.skip(f"backend {backend.name!r} does not claim {', '.join(missing)}")


@pytest.fixture(scope="session")
def qaicrt(backend: DeviceBackend) -> QaicrtModule:
    return backend.runtime()


@pytest.fixture(scope="session")
def aicapi(backend: DeviceBackend) -> AicApiModule:
    return backend.aicapi()
