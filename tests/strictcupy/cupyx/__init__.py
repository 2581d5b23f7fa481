"""``cupyx`` of the strict stand-in: ``scatter_add`` and ``cupyx.scipy.sparse``."""

from __future__ import annotations

import numpy as _np
from cupy import _core


def scatter_add(a, slices, value) -> None:
    """``a[slices] += value`` with repeated indices accumulated (``numpy.add.at``)."""
    if not isinstance(a, _core.ndarray):
        raise TypeError("scatter_add needs a device array")
    fakes: list = [a]
    ix = _core._index(slices, fakes)
    v = _core._unwrap(value, fakes)
    _core._check_device(fakes)
    _core._order_before_op(_core.get_current_stream())
    _np.add.at(a._a, ix, v)
    _core._stamp_write([a])


def scatter_max(a, slices, value) -> None:
    fakes: list = [a]
    ix = _core._index(slices, fakes)
    v = _core._unwrap(value, fakes)
    _np.maximum.at(a._a, ix, v)
    _core._stamp_write([a])


def scatter_min(a, slices, value) -> None:
    fakes: list = [a]
    ix = _core._index(slices, fakes)
    v = _core._unwrap(value, fakes)
    _np.minimum.at(a._a, ix, v)
    _core._stamp_write([a])


def zeros_pinned(shape, dtype=float):
    n = int(_np.prod(shape)) * _np.dtype(dtype).itemsize
    out = _np.frombuffer(_core.alloc_pinned_memory(n), dtype, int(_np.prod(shape))).reshape(shape)
    out[...] = 0
    return out


def empty_pinned(shape, dtype=float):
    n = int(_np.prod(shape)) * _np.dtype(dtype).itemsize
    return _np.frombuffer(_core.alloc_pinned_memory(n), dtype, int(_np.prod(shape))).reshape(shape)


from . import scipy  # noqa: F401
