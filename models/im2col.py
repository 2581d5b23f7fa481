"""Convolution data movement: im2col / col2im and the scratch arrays they reuse.

Four pairs, each an unfolding of image windows into a matrix (``im2col*``) and its adjoint,
which sums a matrix of window gradients back into an image (``col2im*``):

* :func:`im2col` / :func:`col2im`: ``NCHW``, ``(C*kh*kw, N*Ho*Wo)`` (row ``(c, i, j)``);
* :func:`im2col_rows` / :func:`col2im_rows`: stride 1 on the row-extended grid (long
  contiguous runs, a few discarded columns);
* :func:`im2col_nhwc` / :func:`col2im_nhwc`: channels-last, ``(N*Ho*Wo, kh*kw*C)`` (column
  ``(i, j, c)``), what :class:`models.layers.Conv2d` uses; with the Numba kernels loaded
  (:mod:`models.kernels`) one pass shared over the process's threads, the same values.

:class:`Workspace` holds scratch arrays reused across calls (plan once, run many);
:func:`transient` is the process-wide scratch for arrays that live within one call.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

from .kernel_loader import numba_kernels as _numba_kernels

__all__ = [
    "Workspace",
    "col2im",
    "col2im_nhwc",
    "col2im_rows",
    "conv_output_size",
    "im2col",
    "im2col_nhwc",
    "im2col_rows",
    "transient",
]

def conv_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """Spatial output size ``floor((size + 2 padding - kernel) / stride) + 1``."""
    out = (size + 2 * padding - kernel) // stride + 1
    if out <= 0:
        raise ValueError(
            f"input size {size} is too small for kernel {kernel} with padding {padding} "
            f"and stride {stride}; use a larger input or more padding"
        )
    return out


# ---------------------------------------------------------------------------------------------
# scratch arrays
# ---------------------------------------------------------------------------------------------
class Workspace:
    """Scratch arrays reused across calls (plan once, run many).

    A conv layer allocates its im2col matrix and temporaries once per input shape instead of
    every step, which avoids allocator churn (fresh pages for every multi-MB temporary).  An
    array handed out under a key stays valid until the next request for that key.
    """

    def __init__(self) -> None:
        self._bufs: dict = {}

    def get(self, key: str, shape: tuple[int, ...], dtype, xp, *, zero: bool = False):
        """Array ``key`` of ``shape``/``dtype`` (zeros when new, or when ``zero``)."""
        buf = self._bufs.get(key)
        if (buf is None or buf.shape != tuple(shape) or buf.dtype != dtype
                or array_module(buf) is not xp):
            buf = xp.zeros(shape, dtype=dtype)
            self._bufs[key] = buf
        elif zero:
            buf.fill(0)
        return buf

    def clear(self) -> None:
        """Drop every scratch array."""
        self._bufs.clear()


def _scratch(ws: Workspace | None, key: str, shape, dtype, xp, zero: bool = False):
    if ws is None:
        return xp.zeros(shape, dtype=dtype)
    return ws.get(key, shape, dtype, xp, zero=zero)


#: scratch shared by every layer for arrays that live only within one call (keyed by shape)
_TRANSIENT = Workspace()


def transient(key: str, shape, dtype, xp, zero: bool = False):
    """A scratch array from :data:`_TRANSIENT`, one per ``(key, shape, dtype, array module)``."""
    shape = tuple(int(s) for s in shape)
    full = (key, shape, str(dtype), xp.__name__)
    return _TRANSIENT.get(full, shape, dtype, xp, zero=zero)


# ---------------------------------------------------------------------------------------------
# im2col / col2im
# ---------------------------------------------------------------------------------------------
def _padded(x, ph: int, pw: int, extra_rows: int, ws: Workspace | None):
    """``x`` inside a zero border (plus ``extra_rows`` zero rows at the bottom).

    A reused buffer keeps its zero border: only the interior is ever written.
    """
    xp = array_module(x)
    N, C, H, W = x.shape
    if ph == 0 and pw == 0 and extra_rows == 0:
        return x
    buf = _scratch(ws, "xpad", (N, C, H + 2 * ph + extra_rows, W + 2 * pw), x.dtype, xp)
    buf[:, :, ph:ph + H, pw:pw + W] = x
    return buf


def im2col(x, kh: int, kw: int, stride: tuple[int, int], padding: tuple[int, int],
           ws: Workspace | None = None):
    """Unfold ``(N, C, H, W)`` (zero-padded by ``padding``) into a ``(C*kh*kw, N*Ho*Wo)`` matrix.

    Row ``(c, i, j)`` and column ``(n, ho, wo)`` hold ``xpad[n, c, ho*sh + i, wo*sw + j]``.  The
    window view is built with ``as_strided`` (no copy) and copied once into the result.

    Returns
    -------
    cols : array (C*kh*kw, N*Ho*Wo)
    out_hw : (Ho, Wo)
    """
    xp = array_module(x)
    N, C, H, W = x.shape
    sh, sw = stride
    ph, pw = padding
    Ho, Wo = conv_output_size(H, kh, sh, ph), conv_output_size(W, kw, sw, pw)
    xpad = _padded(x, ph, pw, 0, ws)
    bN, bC, bH, bW = xpad.strides
    win = xp.lib.stride_tricks.as_strided(
        xpad, shape=(C, kh, kw, N, Ho, Wo), strides=(bC, bH, bW, bN, bH * sh, bW * sw))
    cols = _scratch(ws, "cols", (C * kh * kw, N * Ho * Wo), x.dtype, xp)
    xp.copyto(cols.reshape(C, kh, kw, N, Ho, Wo), win)
    return cols, (Ho, Wo)


def col2im(dcols, in_shape: tuple[int, int, int, int], kh: int, kw: int,
           stride: tuple[int, int], padding: tuple[int, int], ws: Workspace | None = None):
    """Adjoint of :func:`im2col`: ``(C*kh*kw, N*Ho*Wo)`` → ``(N, C, H, W)``, overlaps summed.

    The loop runs over the ``kh*kw`` kernel offsets only; each iteration is one vectorised
    strided add over all batch elements, channels and pixels.
    """
    xp = array_module(dcols)
    N, C, H, W = in_shape
    sh, sw = stride
    ph, pw = padding
    Ho, Wo = conv_output_size(H, kh, sh, ph), conv_output_size(W, kw, sw, pw)
    d = dcols.reshape(C, kh, kw, N, Ho, Wo)
    # accumulate in (C, N, Hp, Wp) so each add reads d[:, i, j] contiguously
    acc = _scratch(ws, "acc", (C, N, H + 2 * ph, W + 2 * pw), dcols.dtype, xp, zero=True)
    for i in range(kh):
        for j in range(kw):
            acc[:, :, i:i + sh * (Ho - 1) + 1:sh, j:j + sw * (Wo - 1) + 1:sw] += d[:, i, j]
    return xp.ascontiguousarray(acc[:, :, ph:ph + H, pw:pw + W].transpose(1, 0, 2, 3))


def im2col_rows(x, kh: int, kw: int, padding: tuple[int, int], ws: Workspace | None = None):
    """Stride-1 im2col on the *row-extended* grid: ``(C*kh*kw, N*Ho*Wp)``.

    With the padded image flattened row by row (row length ``Wp``), the window offset ``(i, j)``
    is a plain shift by ``i*Wp + j``, so every copied run is ``Ho*Wp`` contiguous values instead
    of ``Wo``.  Column ``(n, h, w)`` for ``w >= Wo`` wraps into the next row: those outputs are
    computed and discarded (a ``Wp/Wo`` GEMM overhead, 1.06 for 32x32 3x3 convs), in exchange
    for long vectorised copies in both :func:`im2col_rows` and :func:`col2im_rows`.

    Returns
    -------
    cols : array (C*kh*kw, N*Ho*Wp)
    geometry : tuple (Hp, Wp, Ho, Wo)
    """
    xp = array_module(x)
    N, C, H, W = x.shape
    ph, pw = padding
    Hp, Wp = H + 2 * ph, W + 2 * pw
    Ho, Wo = conv_output_size(H, kh, 1, ph), conv_output_size(W, kw, 1, pw)
    # one spare zero row so the last shifted run (offset (kh-1)*Wp + kw-1) stays in bounds
    buf = _padded(x, ph, pw, 1, ws)
    L = Ho * Wp
    bN, bC, bH, bW = buf.strides
    win = xp.lib.stride_tricks.as_strided(
        buf, shape=(C, kh, kw, N, L), strides=(bC, bH, bW, bN, bW))
    cols = _scratch(ws, "cols", (C * kh * kw, N * L), x.dtype, xp)
    xp.copyto(cols.reshape(C, kh, kw, N, L), win)
    return cols, (Hp, Wp, Ho, Wo)


def col2im_rows(dcols, in_shape: tuple[int, int, int, int], kh: int, kw: int,
                padding: tuple[int, int], geometry: tuple[int, int, int, int],
                ws: Workspace | None = None):
    """Adjoint of :func:`im2col_rows` (columns with ``w >= Wo`` must hold zeros)."""
    xp = array_module(dcols)
    N, C, H, W = in_shape
    ph, pw = padding
    Hp, Wp, Ho, _ = geometry
    L = Ho * Wp
    d = dcols.reshape(C, kh, kw, N, L)
    acc = _scratch(ws, "acc", (C, N, (Hp + 1) * Wp), dcols.dtype, xp, zero=True)
    for i in range(kh):
        for j in range(kw):
            off = i * Wp + j
            acc[:, :, off:off + L] += d[:, i, j]
    img = acc.reshape(C, N, Hp + 1, Wp)[:, :, ph:ph + H, pw:pw + W]
    return xp.ascontiguousarray(img.transpose(1, 0, 2, 3))


def im2col_nhwc(xl, kh: int, kw: int, stride: tuple[int, int], padding: tuple[int, int],
                out=None, ws: Workspace | None = None):
    """Channels-last im2col: ``(N, H, W, C)`` (any strides) → ``(N*Ho*Wo, kh*kw*C)``.

    Row ``(n, ho, wo)`` and column ``(i, j, c)`` hold ``xpad[n, ho*sh + i, wo*sw + j, c]``
    (``xpad``: ``xl`` inside a zero border of ``padding``).  With the Numba kernels loaded
    (:func:`models.kernel_loader.kernels`), one pass shared out over threads by output image
    rows, the border never materialised.  Otherwise the padded image is one copy into a shared
    scratch buffer whose border stays zero (a transposed ``NCHW`` input becomes channels-last in
    the same copy); the windows are an ``as_strided`` view copied once into ``out``, in runs of
    ``kw*C`` contiguous values (stride 1).  Both give the same array.

    Parameters
    ----------
    xl : array (N, H, W, C)
    kh, kw : int
    stride, padding : (int, int)
    out : array (N*Ho*Wo, kh*kw*C), optional
        Destination (a fresh array when omitted).
    ws : Workspace, optional
        Where the padded copy lives (default: the shared scratch, kept for the next call of
        the same shape; pass a throwaway ``Workspace()`` for one-off calls).
    """
    xp = array_module(xl)
    N, H, W, C = xl.shape
    (sh, sw), (ph, pw) = stride, padding
    Ho, Wo = conv_output_size(H, kh, sh, ph), conv_output_size(W, kw, sw, pw)
    k = _numba_kernels(xp)
    if k is not None:                  # one parallel pass, the zero border never materialised
        if out is None:
            out = np.empty((N * Ho * Wo, kh * kw * C), dtype=xl.dtype)
        k.im2col_nhwc(np.ascontiguousarray(xl), kh, kw, sh, sw, ph, pw, out)
        return out
    if ph or pw:
        shape = (N, H + 2 * ph, W + 2 * pw, C)
        xpad = (transient(f"pad{ph}x{pw}", shape, xl.dtype, xp) if ws is None
                else ws.get(f"pad{ph}x{pw}", shape, xl.dtype, xp))
        xpad[:, ph:ph + H, pw:pw + W, :] = xl
    else:
        xpad = xl
    bN, bH, bW, bC = xpad.strides
    win = xp.lib.stride_tricks.as_strided(
        xpad, shape=(N, Ho, Wo, kh, kw, C), strides=(bN, bH * sh, bW * sw, bH, bW, bC))
    if out is None:
        out = xp.empty((N * Ho * Wo, kh * kw * C), dtype=xl.dtype)
    xp.copyto(out.reshape(N, Ho, Wo, kh, kw, C), win)
    return out


def col2im_nhwc(dcols, in_nhwc: tuple[int, int, int, int], kh: int, kw: int,
                stride: tuple[int, int], padding: tuple[int, int]):
    """Adjoint of :func:`im2col_nhwc`: ``(N*Ho*Wo, kh*kw*C)`` → a fresh ``(N, H, W, C)``.

    One strided add per kernel offset ``(i, j)`` over all pixels and channels, into a zeroed
    padded accumulator, whose interior is returned; with the Numba kernels loaded, one gather
    pass per input pixel in the same ``(i, j)`` order, shared out over threads by image rows
    (the same bits).
    """
    xp = array_module(dcols)
    N, H, W, C = in_nhwc
    (sh, sw), (ph, pw) = stride, padding
    Ho, Wo = conv_output_size(H, kh, sh, ph), conv_output_size(W, kw, sw, pw)
    k = _numba_kernels(xp)
    if k is not None:                  # one parallel gather pass, same summation order
        dx = np.empty((N, H, W, C), dtype=dcols.dtype)
        k.col2im_nhwc(np.ascontiguousarray(dcols), kh, kw, sh, sw, ph, pw, dx)
        return dx
    d = dcols.reshape(N, Ho, Wo, kh, kw, C)
    if ph or pw:
        acc = transient(f"acc{ph}x{pw}", (N, H + 2 * ph, W + 2 * pw, C), dcols.dtype, xp,
                         zero=True)
    else:
        acc = xp.zeros((N, H, W, C), dtype=dcols.dtype)
    for i in range(kh):
        for j in range(kw):
            acc[:, i:i + sh * (Ho - 1) + 1:sh, j:j + sw * (Wo - 1) + 1:sw, :] += d[:, :, :, i, j, :]
    if ph or pw:
        return acc[:, ph:ph + H, pw:pw + W, :].copy()
    return acc

