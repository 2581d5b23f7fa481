"""``cupy.linalg`` of the strict stand-in (NumPy's, under CuPy's rules)."""

import numpy as _np

from . import _core


def __getattr__(name):
    fn = getattr(_np.linalg, name)
    if callable(fn) and not isinstance(fn, type):
        return _core._function(name, fn)
    return fn
