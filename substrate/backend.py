"""Array backend: NumPy on CPU, CuPy on GPU, and the one adapter that hands arrays to MPI.

The backend is chosen once per run (``--device cpu|gpu``).  Everything else receives ``xp``
(the array module) or asks :func:`array_module` which module owns an array.

Handing device arrays to MPI
----------------------------
:meth:`Backend.mpi_view` returns something mpi4py can send/receive:

* NumPy arrays are passed as they are (zero copy);
* CuPy arrays are passed as device memory only when the MPI library is CUDA-aware
  (``MPI.Query_cuda_support()``, overridable with ``SPARDIST_CUDA_AWARE=0|1``), after
  synchronizing the current stream so the kernels that produced the data have finished;
* otherwise they are staged through a pinned host buffer, and :meth:`Backend.mpi_done` copies the
  received bytes back to the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

__all__ = ["Backend", "get_backend", "array_module", "cupy_available"]


def _import_cupy() -> ModuleType | None:
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # ImportError, CUDARuntimeError without a driver, ...
        return None


def cupy_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    return _import_cupy() is not None


def array_module(arr) -> ModuleType:
    """Return ``numpy`` or ``cupy``, whichever owns ``arr`` (NumPy for anything else)."""
    mod = type(arr).__module__
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def _mpi_cuda_aware() -> bool:
    env = os.environ.get("SPARDIST_CUDA_AWARE")
    if env is not None:
        return env not in ("0", "", "false", "no")
    try:
        from mpi4py import MPI  # noqa: PLC0415

        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query is not None else False
    except Exception:
        return False


@dataclass
class Backend:
    """The array module of a run plus the MPI hand-off adapter.

    Parameters
    ----------
    name : {"cpu", "gpu"}
        ``cpu`` uses NumPy, ``gpu`` uses CuPy on device ``gpu_index``.
    gpu_index : int
        Device to bind (the node-local rank, see :class:`substrate.topology.Topology`).
    """

    name: str = "cpu"
    gpu_index: int = 0
    xp: ModuleType = field(init=False, repr=False)
    cuda_aware: bool = field(init=False, default=False)
    _staging: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.name == "cpu":
            self.xp = np
        elif self.name == "gpu":
            cp = _import_cupy()
            if cp is None:
                raise ValueError(
                    "--device gpu needs CuPy and a visible CUDA device; install the 'gpu' extra "
                    "(pip install 'spardist[gpu]') on a GPU node, or run with --device cpu"
                )
            n = cp.cuda.runtime.getDeviceCount()
            cp.cuda.Device(self.gpu_index % n).use()
            self.xp = cp
            self.cuda_aware = _mpi_cuda_aware()
        else:
            raise ValueError(f"unknown device {self.name!r}: use --device cpu or --device gpu")

    @property
    def is_gpu(self) -> bool:
        return self.name == "gpu"

    def asarray(self, a, dtype=None):
        """Move ``a`` to this backend (no copy when it already lives there)."""
        return self.xp.asarray(a, dtype=dtype)

    def asnumpy(self, a) -> np.ndarray:
        """Return ``a`` as a NumPy array (device-to-host copy for CuPy)."""
        if array_module(a) is np:
            return np.asarray(a)
        return a.get()

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    # -- MPI hand-off -------------------------------------------------------------------------
    def mpi_view(self, arr, *, fill: bool = True):
        """Return a buffer MPI can use for ``arr``.

        For NumPy and CUDA-aware MPI this is ``arr`` itself (after a stream sync for CuPy).
        Otherwise a pinned host staging buffer of the same shape/dtype, filled from ``arr`` when
        ``fill`` is true (send side); pass the result to :meth:`mpi_done` after a receive.
        """
        if array_module(arr) is np:
            return arr
        self.xp.cuda.get_current_stream().synchronize()
        if self.cuda_aware:
            return arr
        key = (arr.shape, arr.dtype.str)
        host = self._staging.get(key)
        if host is None:
            mem = self.xp.cuda.alloc_pinned_memory(max(arr.nbytes, 1))
            host = np.frombuffer(mem, arr.dtype, arr.size).reshape(arr.shape)
            self._staging[key] = host
        if fill:
            arr.get(out=host)
        return host

    def mpi_done(self, arr, view) -> None:
        """Copy a received staging buffer ``view`` back into device array ``arr`` if needed."""
        if view is not arr:
            arr.set(view)


_BACKENDS: dict[tuple[str, int], Backend] = {}


def get_backend(device: str = "cpu", gpu_index: int = 0) -> Backend:
    """Return the (cached) :class:`Backend` for ``device`` (``"cpu"`` or ``"gpu"``)."""
    key = (device, gpu_index)
    if key not in _BACKENDS:
        _BACKENDS[key] = Backend(device, gpu_index)
    return _BACKENDS[key]
