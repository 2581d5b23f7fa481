"""A strict CuPy stand-in for the test suite (never installed, never imported by spardist itself).

Tests put ``tests/strictcupy`` first on ``sys.path`` (or ``PYTHONPATH`` for MPI jobs) to run the
``--device gpu`` paths on the CPU under CuPy's rules; see :mod:`cupy._core` for what it enforces
and counts.  ``cupy._strict`` is the sync counter (:class:`cupy._core.StrictCounter`); its
presence tells a test it runs on the stand-in, not on a GPU.
"""

from __future__ import annotations

import numpy as _np

# submodules first: the module __getattr__ below would answer them with NumPy's
from . import _core, cuda, lib, linalg, random  # noqa: F401
from ._core import (  # noqa: F401
    CUDARuntimeError,
    ElementwiseKernel,
    RawKernel,
    RawModule,
    ReductionKernel,
    asnumpy,
    fuse,
    get_array_module,
    ndarray,
    ufunc,
)

__version__ = "13.0.0+strict"
_strict = _core.counter

_cache: dict = {}


def __getattr__(name: str):
    """Every NumPy function, ufunc and type under CuPy's rules (built on first use)."""
    if name in _cache:
        return _cache[name]
    if name.startswith("__") or name in _core.MISSING:
        raise AttributeError(f"module 'cupy' has no attribute {name!r}")
    obj = getattr(_np, name)
    if isinstance(obj, _np.ufunc):
        val = _core.ufunc(obj)
    elif name in _core.CONVERT:
        val = _core._convert(name, obj)
    elif callable(obj) and not isinstance(obj, type):
        val = _core._function(name, obj)
    else:
        val = obj
    _cache[name] = val
    return val




def get_default_memory_pool():
    return cuda.MemoryPool()


def get_default_pinned_memory_pool():
    return cuda.PinnedMemoryPool()
