"""What the transformer layers share: GPT-2's initializer scale, the lazily loaded Numba
kernels for a float array, per-thread scratch, row views, the scatter-add of rows and the
token-id check.

The layers are in :mod:`models.embeddings`, :mod:`models.normalization`,
:mod:`models.activations`, :mod:`models.attention` and :mod:`models.transformer`; the kernels
they load on first use (:mod:`models.kernel_loader`) in :mod:`models.kernels_transformer`.
"""

from __future__ import annotations

import threading

import numpy as np

from substrate.backend import array_module

from .im2col import Workspace
from .kernel_loader import kernels as _load_kernels

__all__ = ["GPT2_INIT_STD"]

#: standard deviation of GPT-2's weight initializer
GPT2_INIT_STD = 0.02


def _kernels_for(x):
    """The Numba kernels (:mod:`models.kernels`, imported on first use) for a NumPy float
    array, else ``None`` (CuPy arrays, integer input, or no Numba): the layers then take their
    array path, the same values to float round-off."""
    if x.dtype.kind != "f" or array_module(x) is not np:
        return None
    return _load_kernels()


_LOCAL = threading.local()


def _thread_scratch(key: str, shape, dtype):
    """A scratch array private to the calling thread (one per key, shape and dtype), for the
    passes that :func:`models.kernels.parallel_for` shares over threads."""
    ws = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = Workspace()
    shape = tuple(int(n) for n in shape)
    return ws.get((key, shape, np.dtype(dtype).str), shape, dtype, np)


def _rows2d(x):
    """``x`` as a C-contiguous ``(rows, last dim)`` matrix (a view when it already is one)."""
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]))


def _scatter_add_rows(out, idx, rows) -> None:
    """``out[idx[i]] += rows[i]`` with repeated indices summed (NumPy ``add.at`` / CuPy)."""
    xp = array_module(out)
    if xp is np:
        np.add.at(out, idx, rows)
    else:  # pragma: no cover - GPU only
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(out, idx, rows)


def _as_tokens(x, vocab: int, what: str):
    xp = array_module(x)
    if x.dtype.kind == "f":
        t = x.astype(xp.int64)
        if not bool((t == x).all()):
            raise ValueError(f"{what} expects integer token ids, got non-integer floats")
        x = t
    elif x.dtype.kind not in "iu":
        raise ValueError(f"{what} expects integer token ids, got dtype {x.dtype}")
    if x.size and (int(x.min()) < 0 or int(x.max()) >= vocab):
        raise ValueError(f"{what}: token ids must be in [0, {vocab}), got range "
                         f"[{int(x.min())}, {int(x.max())}]")
    return x
