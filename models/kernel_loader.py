"""The Numba kernels of :mod:`models.kernels`, imported on first use.

Numba costs about 40 MiB and 0.3 s a rank, so :mod:`models.kernels` is imported only when a
layer asks for it with ``load=True`` (BatchNorm, the transformer layers); the other users
(convolution data movement, ReLU, the optimizers' blocked passes) take the kernels once they
are loaded and keep their NumPy array path otherwise (the same values).
"""

from __future__ import annotations

import numpy as np

__all__ = ["kernels", "numba_kernels"]

_KERNELS: list = []


def kernels(load: bool = True):
    """:mod:`models.kernels` (Numba), imported on first use; ``None`` without Numba.

    BatchNorm loads it (``load=True``).  The convolutions' data movement asks with
    ``load=False``: they use the kernels once a BatchNorm has paid for Numba (~40 MiB a rank),
    and keep their NumPy copies in a model without BatchNorm (the digits CNN), which then never
    imports Numba.  Both give the same bits.
    """
    if not _KERNELS:
        if not load:
            return None
        try:
            from . import kernels as mod  # noqa: PLC0415 (lazy: Numba costs ~40 MiB, ~0.3 s)
        except ImportError:
            mod = None
        _KERNELS.append(mod)
    return _KERNELS[0]


def numba_kernels(xp):
    """The loaded Numba kernels for NumPy arrays, else ``None`` (CuPy, or not loaded yet)."""
    return kernels(load=False) if xp is np else None
