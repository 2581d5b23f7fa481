"""Numba kernels for the memory-bound passes of the layers (CPU, NumPy arrays only).

Imported lazily (:mod:`models.kernel_loader`) by the first BatchNorm or transformer layer
forward on a NumPy array, so a run whose model has neither (the digits CNN) never imports
Numba.  Compiled code is cached on disk (``cache=True``): ranks load it instead of each
compiling.

Writing kernels that vectorise: LLVM vectorises a loop over a contiguous axis when its index
starts at 0 (``range(lo, hi)`` over an array index keeps Numba's negative-index wrap-around in
the loop, so slice first), when it divides under NumPy's error model (Python's raises on zero),
when it touches few distinct arrays (past about eight, the run-time alias checks are given up:
split the loop), and when its float reductions may be reassociated (``fastmath`` ``reassoc``,
used for per-row sums whose order is then fixed by the compiled code, never by the threads).
It does not vectorise a float ``max`` reduction: :func:`_row_max` keeps eight running maxima.
Transcendental functions are NumPy's (vectorised ``exp``/``tanh``; Numba's scalar ``tanh`` is
~100x slower) on cache-sized blocks between Numba passes.

Threads: every kernel is a serial, GIL-free loop over a range ``[lo, hi)`` of its outer index,
shared out by :func:`models.kernels_threads.parallel_for`; reductions sum fixed blocks of
:data:`ROW_BLOCK` rows, so no result depends on the thread count (the scheduling and the
threaded GEMMs of :func:`matmul` are described in :mod:`models.kernels_threads`).

BatchNorm (Ioffe & Szegedy 2015, Alg. 1 and its gradient) works on a channels-last 2-D view
``X`` of shape ``(M, C)``, ``M = N*H*W`` (one row per pixel, one column per channel), and
accumulates in float64 whatever the array dtype, so float32 models get per-channel statistics
more accurate than a float32 reduction.  Per channel ``c`` over ``M`` values:

* ``mu = (1/M) sum x``, ``var = (1/M) sum (x - mu)^2`` (biased), ``x_hat = (x - mu) / sqrt(var +
  eps)``, ``y = gamma x_hat + beta``;
* ``d_beta = sum dy``, ``d_gamma = sum dy x_hat``,
  ``dx = gamma / (M sqrt(var + eps)) (M dy - d_beta - x_hat d_gamma)``.

The forward is two passes over ``X`` (statistics, then ``y``) and the backward two passes over
``dY`` and ``X`` (sums, then ``dx``); ``x_hat`` is recomputed from ``X`` rather than stored.

Convolution data movement (channels-last, the kernels behind :func:`models.im2col.im2col_nhwc`
and :func:`models.im2col.col2im_nhwc`):

* ``im2col``: row ``(n, ho, wo)``, column ``(i, j, c)`` of the result is ``X[n, ho sh + i - ph,
  wo sw + j - pw, c]``, zero outside the image (the zero border is never materialised);
* ``col2im``, its adjoint: ``dX[n, h, w, c] = sum_{i, j} D[(n, ho, wo), (i, j, c)]`` over the
  windows with ``ho sh + i - ph = h`` and ``wo sw + j - pw = w``, gathered per input pixel in
  ``(i, j)`` order, which is the order of the array path's strided adds (same bits).

ReLU and the residual sum are NumPy ufuncs on chunks of flat views of one memory order (the
same operations as the layers' array path, shared out by :func:`parallel_for`).

Rooms: this module holds the CNN passes (BatchNorm, convolution data movement, ReLU and the
residual sum) and re-exports the others, so :func:`models.kernel_loader.kernels` hands the
layers one module: :mod:`models.kernels_threads` (:func:`parallel_for`, :func:`matmul`),
:mod:`models.kernels_transformer` (LayerNorm, GELU, attention softmax, cross-entropy,
embedding gradient, AdamW) and :mod:`models.kernels_winograd` (Winograd F(2x2, 3x3)).

Transformers (:mod:`models.transformer`, in :mod:`models.kernels_transformer`): LayerNorm and
GELU with the residual sum and the bias fused in, the attention softmax, the token embedding's
gradient, the softmax cross-entropy of large logits, AdamW in one pass.  Winograd F(2x2, 3x3)
convolution (:class:`models.conv.Conv2d`, Lavin & Gray 2016, in :mod:`models.kernels_winograd`):
the input, output and weight transforms and their adjoints.
"""

from __future__ import annotations

import numba
import numpy as np

from .kernels_threads import (
    _JIT,
    CHUNKS_PER_THREAD,
    GEMM_MIN_SPLIT,
    GEMM_PARTS,
    MIN_PARALLEL,
    ROW_BLOCK,
    blas_on_one_thread,
    configured_threads,
    matmul,
    parallel_for,
)
from .kernels_transformer import (
    CE_ROWS,
    GELU_ROWS,
    adamw_step,
    embedding_grad,
    gelu_backward,
    gelu_forward,
    layer_norm_backward,
    layer_norm_forward,
    softmax_backward,
    softmax_cross_entropy,
    softmax_normalize,
    softmax_shift,
)
from .kernels_winograd import (
    IDENTITY,
    TURNED,
    pad1,
    winograd_input,
    winograd_output,
    winograd_output_adjoint,
    winograd_weight,
    winograd_weight_grad,
)

__all__ = [
    "CE_ROWS",
    "CHUNKS_PER_THREAD",
    "GELU_ROWS",
    "GEMM_MIN_SPLIT",
    "GEMM_PARTS",
    "IDENTITY",
    "MIN_PARALLEL",
    "ROW_BLOCK",
    "TURNED",
    "adamw_step",
    "add",
    "add_relu_forward",
    "blas_on_one_thread",
    "bn_apply",
    "bn_backward_input",
    "bn_backward_sums",
    "channel_stats",
    "col2im_nhwc",
    "configured_threads",
    "embedding_grad",
    "gelu_backward",
    "gelu_forward",
    "im2col_nhwc",
    "layer_norm_backward",
    "layer_norm_forward",
    "matmul",
    "pad1",
    "parallel_for",
    "relu_backward",
    "relu_forward",
    "softmax_backward",
    "softmax_cross_entropy",
    "softmax_normalize",
    "softmax_shift",
    "winograd_input",
    "winograd_output",
    "winograd_output_adjoint",
    "winograd_weight",
    "winograd_weight_grad",
]


# ---------------------------------------------------------------------------------------------
# BatchNorm
# ---------------------------------------------------------------------------------------------
@numba.jit(**_JIT)
def _stats_blocks(X, shift, S, Q, lo, hi):
    """Blocks ``lo..hi-1``: ``S[b] = sum (x - shift)``, ``Q[b] = sum (x - shift)^2``."""
    M, C = X.shape
    for b in range(lo, hi):
        for i in range(b * ROW_BLOCK, min(M, (b + 1) * ROW_BLOCK)):
            for c in range(C):
                d = np.float64(X[i, c]) - shift[c]
                S[b, c] += d
                Q[b, c] += d * d


def channel_stats(X):
    """Per-column mean and biased variance of ``X`` (M, C), float64.

    Shifted-data algorithm (shift = first row), so the variance does not cancel when the mean is
    large against the spread.
    """
    M, C = X.shape
    nb = -(-M // ROW_BLOCK)
    shift = X[0].astype(np.float64)
    S = np.zeros((nb, C), np.float64)
    Q = np.zeros((nb, C), np.float64)
    parallel_for(_stats_blocks, nb, X.size, X, shift, S, Q)
    m1 = S.sum(axis=0) / M
    var = Q.sum(axis=0) / M - m1 * m1
    return shift + m1, np.maximum(var, 0.0)


@numba.jit(**_JIT)
def _apply_rows(X, mean, scale, beta, Y, lo, hi):
    C = X.shape[1]
    for i in range(lo, hi):
        for c in range(C):
            Y[i, c] = (np.float64(X[i, c]) - mean[c]) * scale[c] + beta[c]


def bn_apply(X, mean, scale, beta, Y):
    """``Y = (X - mean) * scale + beta`` per column (float64 arithmetic, cast on store)."""
    parallel_for(_apply_rows, X.shape[0], 2 * X.size, X, mean, scale, beta, Y)


@numba.jit(**_JIT)
def _backward_sum_blocks(dY, X, mean, DB, DXM, lo, hi):
    """Blocks ``lo..hi-1``: ``DB[b] = sum dy``, ``DXM[b] = sum dy (x - mean)``."""
    M, C = X.shape
    for b in range(lo, hi):
        for i in range(b * ROW_BLOCK, min(M, (b + 1) * ROW_BLOCK)):
            for c in range(C):
                g = np.float64(dY[i, c])
                DB[b, c] += g
                DXM[b, c] += g * (np.float64(X[i, c]) - mean[c])


def bn_backward_sums(dY, X, mean, inv_std):
    """``d_beta = sum dY`` and ``d_gamma = sum dY * x_hat`` per column, float64."""
    M, C = X.shape
    nb = -(-M // ROW_BLOCK)
    DB = np.zeros((nb, C), np.float64)
    DXM = np.zeros((nb, C), np.float64)
    parallel_for(_backward_sum_blocks, nb, 2 * X.size, dY, X, mean, DB, DXM)
    return DB.sum(axis=0), DXM.sum(axis=0) * inv_std


@numba.jit(**_JIT)
def _backward_input_rows(dY, X, mean, a, b, k, dX, lo, hi):
    C = X.shape[1]
    for i in range(lo, hi):
        for c in range(C):
            dX[i, c] = a[c] * np.float64(dY[i, c]) + b[c] + k[c] * (np.float64(X[i, c])
                                                                     - mean[c])


def bn_backward_input(dY, X, mean, inv_std, gamma, d_beta, d_gamma, dX):
    """``dX = gamma inv_std / M (M dY - d_beta - x_hat d_gamma)``, ``x_hat`` from ``X``."""
    M = X.shape[0]
    a = gamma * inv_std                       # gamma / sqrt(var + eps)
    b = -a * d_beta / M
    k = -a * d_gamma * inv_std / M
    parallel_for(_backward_input_rows, M, 3 * X.size, dY, X, mean, a, b, k, dX)


# ---------------------------------------------------------------------------------------------
# convolution data movement
# ---------------------------------------------------------------------------------------------
@numba.jit(**_JIT)
def _im2col_rows(X, kh, kw, sh, sw, ph, pw, out, lo, hi):
    """Output image rows ``r = n*Ho + ho`` for ``lo <= r < hi``."""
    _, H, W, C = X.shape
    Ho = (H + 2 * ph - kh) // sh + 1
    Wo = (W + 2 * pw - kw) // sw + 1
    for r in range(lo, hi):
        n = r // Ho
        ho = r - n * Ho
        for wo in range(Wo):
            row = r * Wo + wo
            for i in range(kh):
                h = ho * sh + i - ph
                for j in range(kw):
                    w = wo * sw + j - pw
                    base = (i * kw + j) * C
                    if 0 <= h < H and 0 <= w < W:
                        for c in range(C):
                            out[row, base + c] = X[n, h, w, c]
                    else:
                        for c in range(C):
                            out[row, base + c] = 0


def im2col_nhwc(X, kh, kw, sh, sw, ph, pw, out):
    """Channels-last im2col of ``X`` (N, H, W, C) into ``out`` (N*Ho*Wo, kh*kw*C), zero padding
    ``(ph, pw)`` on each side, parallel over output image rows."""
    N, H = X.shape[0], X.shape[1]
    Ho = (H + 2 * ph - kh) // sh + 1
    parallel_for(_im2col_rows, N * Ho, out.size, X, kh, kw, sh, sw, ph, pw, out)


@numba.jit(**_JIT)
def _col2im_rows(D, kh, kw, sh, sw, ph, pw, out, lo, hi):
    """Input image rows ``r = n*H + h`` for ``lo <= r < hi`` (overwritten)."""
    _, H, W, C = out.shape
    Ho = (H + 2 * ph - kh) // sh + 1
    Wo = (W + 2 * pw - kw) // sw + 1
    for r in range(lo, hi):
        n = r // H
        h = r - n * H
        for w in range(W):
            for c in range(C):
                out[n, h, w, c] = 0
            for i in range(kh):
                t = h + ph - i
                if t < 0 or t % sh != 0 or t // sh >= Ho:
                    continue
                ho = t // sh
                for j in range(kw):
                    u = w + pw - j
                    if u < 0 or u % sw != 0 or u // sw >= Wo:
                        continue
                    row = (n * Ho + ho) * Wo + u // sw
                    base = (i * kw + j) * C
                    for c in range(C):
                        out[n, h, w, c] += D[row, base + c]


def col2im_nhwc(D, kh, kw, sh, sw, ph, pw, out):
    """Adjoint of :func:`im2col_nhwc`: ``D`` (N*Ho*Wo, kh*kw*C) summed into ``out`` (N, H, W, C)
    (overwritten), parallel over input image rows."""
    N, H = out.shape[0], out.shape[1]
    parallel_for(_col2im_rows, N * H, D.size + out.size, D, kh, kw, sh, sw, ph, pw, out)


# ---------------------------------------------------------------------------------------------
# elementwise passes of ReLU and the residual sum (flat arrays of one memory order): NumPy
# ufuncs on chunks (they release the GIL), the same operations as the layers' array path
# ---------------------------------------------------------------------------------------------
def _relu_forward(X, Y, mask, lo, hi):
    np.greater(X[lo:hi], 0, out=mask[lo:hi])
    np.multiply(X[lo:hi], mask[lo:hi], out=Y[lo:hi])


def relu_forward(X, Y, mask):
    """``mask = X > 0``, ``Y = X * mask``."""
    parallel_for(_relu_forward, X.shape[0], 2 * X.size, X, Y, mask)


def _add_relu_forward(A, B, Y, mask, lo, hi):
    y = Y[lo:hi]
    np.add(A[lo:hi], B[lo:hi], out=y)
    np.greater(y, 0, out=mask[lo:hi])
    np.multiply(y, mask[lo:hi], out=y)


def add_relu_forward(A, B, Y, mask):
    """``relu(A + B)`` of a residual block, chunk by chunk (the sum rounded to the dtype)."""
    parallel_for(_add_relu_forward, A.shape[0], 3 * A.size, A, B, Y, mask)


def _relu_backward(dY, mask, dX, lo, hi):
    np.multiply(dY[lo:hi], mask[lo:hi], out=dX[lo:hi])


def relu_backward(dY, mask, dX):
    """``dX = dY * mask``."""
    parallel_for(_relu_backward, dY.shape[0], 2 * dY.size, dY, mask, dX)


def _add(A, B, Y, lo, hi):
    np.add(A[lo:hi], B[lo:hi], out=Y[lo:hi])


def add(A, B, Y):
    """``Y = A + B`` (the two branches' input gradients of a residual block)."""
    parallel_for(_add, A.shape[0], 3 * A.size, A, B, Y)

