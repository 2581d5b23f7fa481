"""The layer base class (:class:`Layer`) and the array helpers the layers share.

:class:`Layer` declares parameters, buffers and children in forward execution order and gets
views of the model's flat parameter and gradient vectors bound (:class:`models.network.Model`);
the conventions every layer follows are in :mod:`models.layers`.  The helpers: channels-last
row views, GEMMs and weight copies on the Numba kernels' threads once they are loaded
(:mod:`models.kernel_loader`), shared flat views of one memory order, float64-accumulated
channel sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from substrate.backend import array_module

from .kernel_loader import numba_kernels as _numba_kernels

__all__ = ["Layer"]


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
        a, b = int(v[0]), int(v[1])
    else:
        a = b = int(v)
    return a, b


def _rows(x):
    """``(N, C, H, W)`` → its channels-last ``(N*H*W, C)`` matrix (a view when ``x`` is
    channels-last, else a copy)."""
    xp = array_module(x)
    return xp.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(-1, x.shape[1])


def _matmul(a, b, out=None):
    """``a @ b`` (into ``out``): on the Numba kernels' threads with single-threaded BLAS calls
    (:func:`models.kernels.matmul`) once they are loaded, else the array module's matmul."""
    xp = array_module(a)
    k = _numba_kernels(xp)
    if k is not None:
        return k.matmul(a, b, out)
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)


def _copy_slab(dst, src, lo, hi):
    dst[lo:hi] = src[lo:hi]


def _copy(dst, src) -> None:
    """``dst[...] = src`` (same shape, any strides): the weight-layout copies of the
    convolutions, in slabs of the first axis shared over the process's threads once the Numba
    kernels are loaded (a copy: the same bits however it is cut)."""
    k = _numba_kernels(array_module(dst))
    if k is None:
        dst[...] = src
    else:
        k.parallel_for(_copy_slab, dst.shape[0], dst.size, dst, src)


def _flat_layout(*arrays):
    """1-D views of ``arrays`` in one shared memory order (row-major, or channels-last for
    4-D ``NCHW``-shaped views of ``NHWC`` memory), so element ``i`` of each view is the same
    tensor element; ``None`` when the arrays do not share such a layout."""
    if all(a.flags.c_contiguous for a in arrays):
        return [a.reshape(-1) for a in arrays]
    if all(a.ndim == 4 and a.transpose(0, 2, 3, 1).flags.c_contiguous for a in arrays):
        return [a.transpose(0, 2, 3, 1).reshape(-1) for a in arrays]
    return None


def _empty_like_layout(x, dtype=None):
    """An empty array shaped like ``x`` with the same memory order (row-major or
    channels-last), so :func:`_flat_layout` pairs them."""
    dtype = x.dtype if dtype is None else dtype
    if not x.flags.c_contiguous and x.ndim == 4:
        N, C, H, W = x.shape
        return np.empty((N, H, W, C), dtype=dtype).transpose(0, 3, 1, 2)
    return np.empty(x.shape, dtype=dtype)


def _channel_sum(m):
    """Column sums of the ``(M, C)`` matrix ``m`` with float64 accumulation, in ``m.dtype``."""
    xp = array_module(m)
    return m.sum(axis=0, dtype=xp.float64).astype(m.dtype)


# ---------------------------------------------------------------------------------------------
# base class
# ---------------------------------------------------------------------------------------------
class Layer:
    """Base class: parameter declarations, children, views bound by the model.

    Subclasses call :meth:`declare_param` / :meth:`declare_buffer` / :meth:`add_child` in their
    constructor, in **forward execution order**, and implement ``forward``, ``backward``,
    ``output_shape`` and ``macs``.
    """

    def __init__(self) -> None:
        self._param_decls: list[tuple[str, str, tuple[int, ...], str]] = []
        self._buffer_decls: list[tuple[str, tuple[int, ...], float]] = []
        self._children: list[tuple[str, Layer]] = []
        #: parameter views (local name -> array), bound by the model
        self.P: dict = {}
        #: gradient views (local name -> array), bound by the model
        self.G: dict = {}
        #: buffers (local name -> array), bound by the model
        self.B: dict = {}
        self._ready: Callable[[str], None] | None = None
        self._ready_names: tuple[str, ...] = ()

    # -- declarations ---------------------------------------------------------------------------
    def declare_param(self, local: str, kind: str, shape: Sequence[int], init: str) -> None:
        """Declare a trainable tensor (``init`` in ``{"he", "zeros", "ones"}``)."""
        if init not in ("he", "zeros", "ones"):
            raise ValueError(f"unknown initializer {init!r}; use 'he', 'zeros' or 'ones'")
        self._param_decls.append((local, kind, tuple(int(s) for s in shape), init))

    def declare_buffer(self, local: str, shape: Sequence[int], fill: float) -> None:
        """Declare a non-trainable state tensor (e.g. BatchNorm running statistics)."""
        self._buffer_decls.append((local, tuple(int(s) for s in shape), float(fill)))

    def add_child(self, local: str, layer: Layer) -> Layer:
        """Register ``layer`` as a child named ``local`` (forward execution order)."""
        if not isinstance(layer, Layer):
            raise ValueError(
                f"child {local!r} must be a Layer, got {type(layer).__name__}")
        if any(n == local for n, _ in self._children):
            raise ValueError(f"duplicate child name {local!r}")
        self._children.append((local, layer))
        return layer

    def children(self) -> list[tuple[str, Layer]]:
        return list(self._children)

    def walk(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """Pre-order traversal yielding ``(dotted_prefix, layer)``; own params before children."""
        yield prefix, self
        for local, child in self._children:
            yield from child.walk(f"{prefix}{local}.")

    # -- gradient-ready notification ------------------------------------------------------------
    def _emit_ready(self) -> None:
        """Tell the model this layer's gradients are written (backward order within the layer)."""
        if self._ready is not None:
            for name in self._ready_names:
                self._ready(name)

    # -- interface ------------------------------------------------------------------------------
    def forward(self, x, training: bool = True):  # pragma: no cover - abstract
        """Compute the output for a batch ``x`` and cache what backward needs.

        Parameters
        ----------
        x : array (N, ...)
            NumPy or CuPy; the layer computes with the same module.
        training : bool
            Training mode (BatchNorm uses and updates batch statistics).
        """
        raise NotImplementedError

    def backward(self, dy):  # pragma: no cover - abstract
        """Given ``dL/dy`` of the last forward, write parameter gradients into ``G``
        (overwrite, not accumulate) and return ``dL/dx``."""
        raise NotImplementedError

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sample output shape (batch dimension excluded)."""
        return tuple(in_shape)

    def macs(self, in_shape: tuple[int, ...]) -> int:
        """Multiply-accumulates of the forward pass per sample (conv and fc only)."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
