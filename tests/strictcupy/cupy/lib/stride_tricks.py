"""``cupy.lib.stride_tricks`` of the strict stand-in."""

import numpy as _np

from .. import _core


def as_strided(x, shape=None, strides=None):
    if not isinstance(x, _core.ndarray):
        raise TypeError(_core._REFUSE_NUMPY)
    return _core.ndarray._from(_np.lib.stride_tricks.as_strided(x._a, shape, strides), x._dev)


def sliding_window_view(x, window_shape, axis=None, *, subok=False, writeable=False):
    if not isinstance(x, _core.ndarray):
        raise TypeError(_core._REFUSE_NUMPY)
    return _core.ndarray._from(_np.lib.stride_tricks.sliding_window_view(
        x._a, window_shape, axis, writeable=writeable), x._dev)
