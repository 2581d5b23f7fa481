"""``cupy.cuda.runtime`` of the strict stand-in."""

from __future__ import annotations

from .. import _core
from .._core import CUDARuntimeError  # noqa: F401

is_hip = False
_is_hip_environment = False


def getDeviceCount() -> int:
    return len(_core._physical_devices())


def getDevice() -> int:
    return _core._current_device()


def setDevice(device: int) -> None:
    _core.Device(device).use()


def deviceSynchronize() -> None:
    _core.Device().synchronize()


def getDeviceProperties(device: int) -> dict:
    d = _core.Device(device)
    return {"name": b"strict CuPy stand-in (CPU)", "pciBusID": int(d.pci_bus_id[5:7], 16),
            "pciDeviceID": 0, "pciDomainID": 0, "totalGlobalMem": 16 << 30,
            "uuid": f"strict-{_core._physical_devices()[d.id]}".encode(),
            "multiProcessorCount": 1, "major": 0, "minor": 0}


def memGetInfo() -> tuple[int, int]:
    return (16 << 30, 16 << 30)


def runtimeGetVersion() -> int:
    return 0


def driverGetVersion() -> int:
    return 0
