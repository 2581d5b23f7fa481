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

Threads
-------
Every kernel is a serial, GIL-free loop over a range ``[lo, hi)`` of its outer index (rows of
an image, blocks of rows, elements).  :func:`parallel_for` cuts the range into chunks that the
calling thread and ``numba.get_num_threads() - 1`` helper threads take from a shared counter
(dynamic scheduling: a helper that the OS has not scheduled yet leaves its chunks to the
others, so a loaded machine costs no straggler wait, and idle helpers block rather than spin
against OpenBLAS's threads).  The thread count is Numba's, which is the process's configured
count: ``NUMBA_NUM_THREADS`` (the launcher sets it per rank), else ``OMP_NUM_THREADS`` when
only that is set, else all cores; ``numba.set_num_threads`` changes it.  One thread, or a pass
too small to share (:data:`MIN_PARALLEL`), runs inline.  Reductions sum fixed blocks of
:data:`ROW_BLOCK` rows into per-block partials and add the partials in block order, so no
result depends on the thread count.

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

GEMMs (:func:`matmul`): a large GEMM is cut into :data:`GEMM_PARTS` row or column parts, each
one single-threaded BLAS call, taken by :func:`parallel_for`'s threads with the BLAS pool held
at one thread (:class:`blas_on_one_thread`).  A BLAS pool splits statically and sleeps between
calls, so on a shared core one late thread (or one wake-up per small GEMM) stalls every GEMM.

Transformers (:mod:`models.transformer`): LayerNorm rows in one pass (float64 statistics) with
the residual sum and a bias row fused in, its backward with the residual gradient and the
bias gradient's column sum fused in; GELU around NumPy's ``tanh`` per block of rows (the array
path's float32 operations, same bits) with the bias fused in; the attention softmax's shift,
normalisation and backward on the rows of one chunk; the token embedding's gradient (the bits
of ``np.add.at``); the softmax cross-entropy of large logits; AdamW in one pass (the array
path's bits).

Winograd F(2x2, 3x3) convolution (:class:`models.layers.Conv2d`, Lavin & Gray 2016): input,
output and weight transforms and their adjoints over channel vectors (the matrices are given
with the kernels below).
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

__all__ = ["channel_stats", "bn_apply", "bn_backward_sums", "bn_backward_input",
           "im2col_nhwc", "col2im_nhwc", "relu_forward", "add_relu_forward", "relu_backward",
           "add", "parallel_for", "configured_threads", "ROW_BLOCK", "MIN_PARALLEL",
           "layer_norm_forward", "layer_norm_backward", "gelu_forward", "gelu_backward",
           "softmax_shift", "softmax_normalize", "softmax_backward", "embedding_grad",
           "adamw_step", "GELU_ROWS", "winograd_input", "winograd_output",
           "winograd_output_adjoint", "winograd_weight", "winograd_weight_grad", "pad1",
           "matmul", "blas_on_one_thread", "GEMM_MIN_SPLIT", "GEMM_PARTS",
           "softmax_cross_entropy", "CE_ROWS"]

_JIT = dict(nopython=True, nogil=True, cache=True, fastmath=False)

#: rows per block of the reductions (fixed, so the sums do not depend on the threads)
ROW_BLOCK = 256
#: passes touching fewer elements than this run on the calling thread alone
MIN_PARALLEL = 1 << 15
#: chunks per thread (more chunks balance better; each costs a few microseconds)
CHUNKS_PER_THREAD = 4


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------
def configured_threads() -> int:
    """The process's thread count: ``NUMBA_NUM_THREADS`` when set (the launcher sets it per
    rank), else ``OMP_NUM_THREADS`` when set (the BLAS convention), else all cores; at most
    the pool Numba started with."""
    limit = numba.config.NUMBA_NUM_THREADS
    if "NUMBA_NUM_THREADS" in os.environ:
        return limit
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return max(1, min(limit, int(omp))) if omp.isdigit() else limit


numba.set_num_threads(configured_threads())

_POOL: list = []                 # [(helper count, ThreadPoolExecutor)], grown on demand
_POOL_LOCK = threading.Lock()


def _helpers(n: int) -> ThreadPoolExecutor:
    """An executor with at least ``n`` helper threads (created on first use)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0][0] < n:
            if _POOL:
                _POOL.pop()[1].shutdown(wait=False)
            _POOL.append((n, ThreadPoolExecutor(max_workers=n,
                                                thread_name_prefix="spardist-kernels")))
        return _POOL[0][1]


def parallel_for(kernel, n: int, work: int, *args) -> None:
    """``kernel(*args, lo, hi)`` over chunks covering ``[0, n)``, on up to
    ``numba.get_num_threads()`` threads (the caller included).

    ``work`` (elements touched) decides whether sharing pays (:data:`MIN_PARALLEL`).  Chunks go
    to whichever thread asks next; the caller returns when every chunk is done, waiting only
    on chunks a helper has started.
    """
    threads = numba.get_num_threads()
    if threads <= 1 or n <= 1 or work < MIN_PARALLEL:
        kernel(*args, 0, n)
        return
    nchunks = min(n, CHUNKS_PER_THREAD * threads)
    bounds = [n * c // nchunks for c in range(nchunks + 1)]
    counter = itertools.count()
    state = {"done": 0, "error": None}
    cv = threading.Condition()

    def drain() -> None:
        taken = 0
        try:
            while (c := next(counter)) < nchunks:
                taken += 1
                kernel(*args, bounds[c], bounds[c + 1])
        except BaseException as exc:            # noqa: BLE001 (handed to the caller)
            state["error"] = exc
            while next(counter) < nchunks:      # skip (and count) the chunks left
                taken += 1
        finally:
            if taken:
                with cv:
                    state["done"] += taken
                    cv.notify_all()

    pool = _helpers(threads - 1)
    for _ in range(threads - 1):
        pool.submit(drain)
    drain()
    with cv:
        cv.wait_for(lambda: state["done"] >= nchunks)
    if state["error"] is not None:
        raise state["error"]


# ---------------------------------------------------------------------------------------------
# GEMMs on the same threads
# ---------------------------------------------------------------------------------------------
#: GEMMs with fewer multiply-accumulates run as one BLAS call on the calling thread
GEMM_MIN_SPLIT = 1 << 22
#: a split GEMM is cut into this many parts (fixed: the cut does not depend on the threads)
GEMM_PARTS = 8

_BLAS: list = []


def _blas_pools():
    """threadpoolctl's controllers of the BLAS libraries loaded in the process (NumPy's
    OpenBLAS), found once; empty without threadpoolctl."""
    if not _BLAS:
        try:
            from threadpoolctl import ThreadpoolController  # noqa: PLC0415 (optional)
            _BLAS.append(list(ThreadpoolController().select(user_api="blas").lib_controllers))
        except Exception:                       # noqa: BLE001 (no control: BLAS as it is)
            _BLAS.append([])
    return _BLAS[0]


class blas_on_one_thread:
    """Context: the BLAS pools run each call on the calling thread (then restored), so that
    GEMMs issued by :func:`parallel_for`'s threads neither wake nor wait for BLAS's own
    threads.  A BLAS pool splits every GEMM statically over its threads and sleeps between
    calls (``OPENBLAS_THREAD_TIMEOUT``): on a shared core one late thread stalls the whole
    GEMM, and hundreds of small GEMMs each pay a wake-up; the model's step collapsed (a
    two-thread GPT step 3-7x slower than one thread beside one busy process)."""

    def __enter__(self):
        self._saved = []
        for lib in _blas_pools():
            n = lib.num_threads
            if n > 1:
                lib.set_num_threads(1)
                self._saved.append((lib, n))
        return self

    def __exit__(self, *exc):
        for lib, n in self._saved:
            lib.set_num_threads(n)
        return False


def _gemm_parts(a, b, out, axis, edges, lo, hi):
    """Parts ``lo..hi-1`` of a GEMM cut along ``axis`` of ``out`` (1: rows, 2: columns of the
    last two axes) at ``edges``."""
    for p in range(lo, hi):
        s = slice(edges[p], edges[p + 1])
        if axis == 1:
            np.matmul(a[..., s, :], b, out=out[..., s, :])
        else:
            np.matmul(a, b[..., :, s], out=out[..., :, s])


def matmul(a, b, out=None):
    """``out = a @ b`` (2-D, or stacks of equal 2-D shapes) on the process's threads.

    One thread (or a GEMM under :data:`GEMM_MIN_SPLIT` multiply-accumulates): one
    ``np.matmul`` call.  Otherwise the output is cut into :data:`GEMM_PARTS` blocks of rows (or
    of columns when it has more columns than rows), one single-threaded BLAS call each, taken
    by :func:`parallel_for`'s threads as they come (a descheduled thread leaves its parts to
    the others) inside :class:`blas_on_one_thread`.  Each output element is the same dot
    product either way (OpenBLAS cuts the inner dimension alike), so the values agree to
    round-off with the single call, and do not depend on the thread count.
    """
    if out is None:
        shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
        out = np.empty(shape, dtype=np.result_type(a, b))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    macs = out.size * k
    if numba.get_num_threads() <= 1 or macs < GEMM_MIN_SPLIT or max(m, n) < 2 * GEMM_PARTS:
        np.matmul(a, b, out=out)
        return out
    axis, size = (1, m) if m >= n else (2, n)
    edges = [size * p // GEMM_PARTS for p in range(GEMM_PARTS + 1)]
    with blas_on_one_thread():
        parallel_for(_gemm_parts, GEMM_PARTS, macs, a, b, out, axis, edges)
    return out


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


# ---------------------------------------------------------------------------------------------
# transformer passes: LayerNorm, GELU, attention softmax, embedding gradient, AdamW
# ---------------------------------------------------------------------------------------------
#: per-row reductions (LayerNorm statistics, softmax maxima and sums, attention's ``dO . O``)
#: may be reassociated so that they vectorize: the order of a row's sum is fixed by the
#: compiled code (the same on every call and thread), not by the thread count
_JIT_ROWS = dict(nopython=True, nogil=True, cache=True, fastmath={"reassoc", "nsz"})

#: rows per block of the GELU passes (its three passes stay in cache within a block) and of
#: the bias-gradient partial sums (fixed: the sums do not depend on the thread count)
GELU_ROWS = 128

#: GELU's constants ``sqrt(2/pi)``, 0.044715, ``3 x 0.044715``, 1/2, 1, rounded to a dtype
#: (as NumPy rounds a Python float that meets a float32 array)
def _gelu_constants(dtype):
    f = np.dtype(dtype).type
    return f(np.sqrt(2.0 / np.pi)), f(0.044715), f(3 * 0.044715), f(0.5), f(1.0)


@numba.jit(**_JIT_ROWS)
def _ln_forward_rows(X, R, B, add, eps, gamma, beta, H, Y, mean, rstd, lo, hi):
    """Rows ``lo..hi-1``: ``h = x + (r + b)`` when ``add`` (else ``h = x``), statistics of
    ``h`` in float64, ``y = (h - mean) rstd gamma + beta`` in the dtype."""
    D = X.shape[1]
    inv_d = 1.0 / D
    t = np.empty(2, X.dtype)
    for i in range(lo, hi):
        src = H if add else X
        if add:
            for j in range(D):
                H[i, j] = X[i, j] + (R[i, j] + B[j])
        s = 0.0
        for j in range(D):
            s += np.float64(src[i, j])
        m = s * inv_d
        q = 0.0
        for j in range(D):
            c = np.float64(src[i, j]) - m
            q += c * c
        r = 1.0 / np.sqrt(q * inv_d + eps)
        mean[i] = m
        rstd[i] = r
        t[0] = m                            # the statistics in the dtype: the output pass
        t[1] = r                            # runs at the dtype's vector width
        mt, rt = t[0], t[1]
        for j in range(D):
            Y[i, j] = (src[i, j] - mt) * rt * gamma[j] + beta[j]


def layer_norm_forward(X, gamma, beta, eps, Y, mean, rstd, R=None, B=None, H=None):
    """LayerNorm over the rows of ``X`` (M, D) into ``Y``; ``mean``, ``rstd`` (M,) float64.

    With ``R`` (and ``H``): the residual sum ``H = X + (R + B)`` (``B`` a bias row, zeros when
    omitted; float32 rounding as ``X + (R + B)`` in NumPy) is formed in the same pass and
    normalized instead of ``X``."""
    add = R is not None
    if add:
        if B is None:
            B = np.zeros(X.shape[1], X.dtype)
    else:
        R, B, H = X, np.zeros(X.shape[1], X.dtype), X
    parallel_for(_ln_forward_rows, X.shape[0], 3 * X.size, X, R, B, add, float(eps),
                 gamma, beta, H, Y, mean, rstd)


@numba.jit(**_JIT_ROWS)
def _ln_backward_blocks(dY, X, mean, rstd, gamma, Rg, add, dX, DG, DB, DS, colsum, lo, hi):
    """Blocks ``lo..hi-1`` of :data:`ROW_BLOCK` rows: ``dx = rstd (g - mean(g) - x̂ mean(g
    x̂))`` with ``g = dy gamma`` (plus ``Rg`` when ``add``), and the block's partial sums
    ``DG = Σ dy x̂``, ``DB = Σ dy`` (and ``DS = Σ dx`` when ``colsum``)."""
    M, D = X.shape
    inv_d = 1.0 / D
    t = np.empty(4, X.dtype)
    for b in range(lo, hi):
        for i in range(b * ROW_BLOCK, min(M, (b + 1) * ROW_BLOCK)):
            m = mean[i]
            r = rstd[i]
            sg = 0.0
            sgx = 0.0
            for j in range(D):
                xh = (np.float64(X[i, j]) - m) * r
                dy = np.float64(dY[i, j])
                g = dy * gamma[j]
                sg += g
                sgx += g * xh
                DG[b, j] += dy * xh
                DB[b, j] += dy
            t[0] = m                        # the output pass in the dtype
            t[1] = r
            t[2] = sg * inv_d
            t[3] = sgx * inv_d
            mt, rt, at, ct = t[0], t[1], t[2], t[3]
            for j in range(D):
                xh = (X[i, j] - mt) * rt
                dX[i, j] = rt * (dY[i, j] * gamma[j] - at - xh * ct)
                if add:
                    dX[i, j] = Rg[i, j] + dX[i, j]
                if colsum:
                    DS[b, j] += dX[i, j]


def layer_norm_backward(dY, X, mean, rstd, gamma, dX, R=None, colsum: bool = False):
    """Input gradient of :func:`layer_norm_forward` into ``dX`` (plus ``R`` when given: the
    residual stream's gradient, added in float32 as ``R + dx``); returns ``(dgamma, dbeta,
    Σ_rows dX or None)`` in float64, summed over fixed blocks of :data:`ROW_BLOCK` rows."""
    M, D = X.shape
    nb = -(-M // ROW_BLOCK)
    DG = np.zeros((nb, D), np.float64)
    DB = np.zeros((nb, D), np.float64)
    DS = np.zeros((nb if colsum else 1, D), np.float64)
    add = R is not None
    parallel_for(_ln_backward_blocks, nb, 4 * X.size, dY, X, mean, rstd, gamma,
                 R if add else dY, add, dX, DG, DB, DS, colsum)
    return DG.sum(axis=0), DB.sum(axis=0), (DS.sum(axis=0) if colsum else None)


@numba.jit(**_JIT)
def _gelu_arg(Z, B, has_b, consts, H, U, lo, hi):
    """Rows ``lo..hi-1``: ``h = z + b`` (or ``z``) and the tanh argument
    ``u = c (h + 0.044715 h^3)`` (in the dtype, the array path's operation order)."""
    c, a = consts[0], consts[1]
    D = Z.shape[1]
    for i in range(lo, hi):
        for j in range(D):
            h = Z[i, j] + B[j] if has_b else Z[i, j]
            H[i, j] = h
            U[i, j] = c * (h + a * h * h * h)


@numba.jit(**_JIT)
def _gelu_out(H, T, consts, Y, lo, hi):
    """Rows ``lo..hi-1``: ``y = h/2 (1 + t)``."""
    half, one = consts[3], consts[4]
    D = H.shape[1]
    for i in range(lo, hi):
        for j in range(D):
            Y[i, j] = half * H[i, j] * (one + T[i, j])


def _gelu_forward_blocks(Z, B, has_b, consts, H, T, Y, lo, hi):
    for b in range(lo, hi):
        r0, r1 = b * GELU_ROWS, min(Z.shape[0], (b + 1) * GELU_ROWS)
        _gelu_arg(Z, B, has_b, consts, H, T, r0, r1)
        np.tanh(T[r0:r1], out=T[r0:r1])
        _gelu_out(H, T, consts, Y, r0, r1)


def gelu_forward(Z, B, H, T, Y):
    """GELU (tanh form) of ``Z + B`` (rows; ``B`` a bias row or ``None``): ``H = Z + B``,
    ``T = tanh(c (H + 0.044715 H^3))`` (NumPy's vectorised tanh), ``Y = H/2 (1 + T)``, block by
    block of :data:`GELU_ROWS` rows (the three passes in cache).  ``H`` may be ``Z``."""
    has_b = B is not None
    nb = -(-Z.shape[0] // GELU_ROWS)
    consts = np.array(_gelu_constants(Z.dtype), Z.dtype)
    parallel_for(_gelu_forward_blocks, nb, 4 * Z.size, Z,
                 B if has_b else np.zeros(Z.shape[1], Z.dtype), has_b, consts, H, T, Y)


@numba.jit(**_JIT)
def _gelu_backward_blocks(dY, H, T, consts, dZ, DB, colsum, lo, hi):
    """Blocks ``lo..hi-1`` of :data:`GELU_ROWS` rows: ``dz = dy (t/2 + 1/2 + h/2 (1 - t^2)
    c (1 + 3 0.044715 h^2))`` (float32, the array path's order) and, when ``colsum``, the
    block's partial column sums of ``dz`` (the bias gradient) in float64."""
    c, a3, half, one = consts[0], consts[2], consts[3], consts[4]
    M, D = H.shape
    for b in range(lo, hi):
        for i in range(b * GELU_ROWS, min(M, (b + 1) * GELU_ROWS)):
            for j in range(D):
                h = H[i, j]
                t = T[i, j]
                du = c * (one + a3 * h * h)
                v = dY[i, j] * (half * (one + t) + half * h * (one - t * t) * du)
                dZ[i, j] = v
                if colsum:
                    DB[b, j] += v


def gelu_backward(dY, H, T, dZ, colsum: bool = False):
    """Gradient of :func:`gelu_forward` with respect to ``Z`` into ``dZ``; returns the bias
    gradient ``Σ_rows dZ`` (float64, fixed blocks of :data:`GELU_ROWS` rows) or ``None``."""
    M, D = H.shape
    nb = -(-M // GELU_ROWS)
    DB = np.zeros((nb if colsum else 1, D), np.float64)
    consts = np.array(_gelu_constants(H.dtype), H.dtype)
    parallel_for(_gelu_backward_blocks, nb, 4 * H.size, dY, H, T, consts, dZ, DB, colsum)
    return DB.sum(axis=0) if colsum else None


@numba.jit(**_JIT)
def _row_max(row, c):
    """``max(row[:c])`` with eight independent running maxima (LLVM does not vectorise a
    float max reduction; eight chains hide its latency).  A maximum is exact in any order."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row[0]
    j = 0
    while j + 8 <= c:
        m0 = max(m0, row[j])
        m1 = max(m1, row[j + 1])
        m2 = max(m2, row[j + 2])
        m3 = max(m3, row[j + 3])
        m4 = max(m4, row[j + 4])
        m5 = max(m5, row[j + 5])
        m6 = max(m6, row[j + 6])
        m7 = max(m7, row[j + 7])
        j += 8
    while j < c:
        m0 = max(m0, row[j])
        j += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@numba.jit(**_JIT_ROWS)
def softmax_shift(P, n0, n1, i0, i1, L, scale, causal):
    """Attention scores in ``P[n0:n1, :, i0:i1, :L]`` (``P`` the C-contiguous (N, H, T, T)
    probability array; row ``i`` is query ``i``), in place: the row maximum over the keys the
    row sees (all ``L``, or ``j <= i`` when ``causal``) subtracted and the result times
    ``scale``; the keys it does not see set to ``-inf``.  Then ``exp`` (NumPy) gives the
    unnormalised probabilities."""
    H = P.shape[1]
    for n in range(n0, n1):
        for h in range(H):
            for i in range(i0, i1):
                row = P[n, h, i]
                c = min(L, i + 1) if causal else L
                m = _row_max(row, c)
                for j in range(c):
                    row[j] = (row[j] - m) * scale
                row[c:L] = -np.inf


@numba.jit(**_JIT_ROWS)
def softmax_normalize(P, n0, n1, i0, i1, L):
    """Rows of ``P[n0:n1, :, i0:i1, :L]`` divided by their sums (in place)."""
    H = P.shape[1]
    for n in range(n0, n1):
        for h in range(H):
            for i in range(i0, i1):
                row = P[n, h, i]
                s = np.float32(0.0)
                for j in range(L):
                    s += row[j]
                inv = np.float32(1.0) / s
                for j in range(L):
                    row[j] *= inv


@numba.jit(**_JIT_ROWS)
def softmax_backward(P, dA, dO, Ot, n0, n1, i0, i1, L, scale, causal):
    """Attention's score gradient written over the probabilities ``A = P[n0:n1, :, i0:i1,
    :L]``: ``dS = scale A ⊙ (dA - rowsum(dO ⊙ O))`` with ``dA = dO V^T`` given in ``dA``
    (n1-n0, H, i1-i0, L) (``rowsum(dO ⊙ O) = rowsum(dA ⊙ A)`` for ``O = A V``: a sum over
    ``d_h`` instead of ``L`` terms); ``dO``, ``Ot`` = ``O`` are (N, T, H, d_h); zero where a
    causal row sees no key."""
    H = P.shape[1]
    for n in range(n0, n1):
        for h in range(H):
            for i in range(i0, i1):
                a = P[n, h, i]
                da = dA[n - n0, h, i - i0]
                g = dO[n, i, h]
                o = Ot[n, i, h]
                dv = np.float32(0.0)
                for k in range(g.shape[0]):
                    dv += g[k] * o[k]
                c = min(L, i + 1) if causal else L
                for j in range(c):
                    a[j] = scale * a[j] * (da[j] - dv)
                a[c:L] = 0


#: rows per block of the softmax cross-entropy (the logits' block stays in cache over its
#: three passes; the loss is summed per block, then over blocks in order)
CE_ROWS = 64


@numba.jit(**_JIT)
def _ce_shift(X, labels, G, true, r0, r1):
    """Rows ``r0..r1-1``: ``G = x - max(x)`` and ``true[r] = G[r, labels[r]]``."""
    K = X.shape[1]
    for r in range(r0, r1):
        x = X[r]
        g = G[r]
        m = _row_max(x, K)
        for j in range(K):
            g[j] = x[j] - m
        true[r] = g[labels[r]]


@numba.jit(**_JIT_ROWS)
def _ce_grad(G, labels, true, inv_n, r0, r1):
    """Rows ``r0..r1-1`` of ``G = exp(x - max)``: returns ``sum_r (log sum_j G[r, j] -
    true[r])`` (float64) and turns ``G`` into ``(softmax - onehot) / N``."""
    K = G.shape[1]
    total = 0.0
    for r in range(r0, r1):
        g = G[r]
        s = 0.0
        for j in range(K):
            s += g[j]
        total += np.log(s) - true[r]
        inv = 1.0 / s
        for j in range(K):
            g[j] = g[j] * inv
        g[labels[r]] -= 1
        for j in range(K):
            g[j] = g[j] * inv_n
    return total


def _ce_blocks(X, labels, G, true, parts, lo, hi):
    for b in range(lo, hi):
        r0, r1 = b * CE_ROWS, min(X.shape[0], (b + 1) * CE_ROWS)
        _ce_shift(X, labels, G, true, r0, r1)
        np.exp(G[r0:r1], out=G[r0:r1])
        parts[b] = _ce_grad(G, labels, true, 1.0 / X.shape[0], r0, r1)


def softmax_cross_entropy(X, labels):
    """Mean softmax cross-entropy of the rows of ``X`` (N, K) and its gradient
    ``(softmax - onehot) / N``: per block of :data:`CE_ROWS` rows the shift by the row maximum
    (Numba), NumPy's vectorised ``exp``, the sums (float64), the loss and the gradient (Numba);
    blocks shared over threads, the loss summed over blocks in order."""
    N = X.shape[0]
    nb = -(-N // CE_ROWS)
    G = np.empty_like(X)
    true = np.empty(N)
    parts = np.zeros(nb)
    parallel_for(_ce_blocks, nb, 3 * X.size, X, labels, G, true, parts)
    return float(parts.sum() / N), G


@numba.jit(**_JIT)
def _scatter_rows(G, idx, rows, lo, hi):
    """Table rows ``lo..hi-1`` of ``G``: zeroed, then ``G[idx[t]] += rows[t]`` for the tokens
    ``t`` (in order) whose id falls in the range (the order of ``np.add.at``)."""
    D = G.shape[1]
    for v in range(lo, hi):
        g = G[v]
        for j in range(D):
            g[j] = 0
    for t in range(idx.shape[0]):
        v = idx[t]
        if lo <= v < hi:
            g = G[v]
            r = rows[t]
            for j in range(D):
                g[j] += r[j]


def embedding_grad(G, idx, rows):
    """``G = 0; G[idx[t]] += rows[t]`` (repeated ids summed in token order, the bits of
    ``np.add.at``), shared over threads by ranges of table rows."""
    parallel_for(_scatter_rows, G.shape[0], rows.size + G.size, G, idx, rows)


@numba.jit(nopython=True, nogil=True, cache=True, error_model="numpy")
def _adamw_blocks(theta, d, m, v, wd, wd_vec, lr, b1, omb1, b2, omb2, eps, bc2, step_size,
                  block, lo, hi):
    """Blocks ``lo..hi-1`` (``block`` elements) of one AdamW step, element by element in the
    array path's float32 operation order (the same bits).  Weight decay: ``wd_vec[i]`` when
    ``wd_vec`` is not empty, else ``wd[0]`` (0: none).  (Loops over slices from index 0 and
    NumPy's error model, so that they vectorise.)"""
    i0, i1 = lo * block, min(theta.shape[0], hi * block)
    th, g, mm, vv = theta[i0:i1], d[i0:i1], m[i0:i1], v[i0:i1]
    n = i1 - i0
    for i in range(n):
        mm[i] = mm[i] * b1 + g[i] * omb1
        vv[i] = vv[i] * b2 + (g[i] * g[i]) * omb2
    if wd_vec.shape[0] > 0:
        w = wd_vec[i0:i1]
        for i in range(n):
            th[i] = th[i] - (th[i] * w[i]) * lr
    elif wd[0] != 0:
        w0 = wd[0]
        for i in range(n):
            th[i] = th[i] - (th[i] * w0) * lr
    for i in range(n):
        th[i] = th[i] - (mm[i] / (np.sqrt(vv[i] / bc2) + eps)) * step_size


def adamw_step(theta, d, m, v, wd, lr, beta1, beta2, eps, bc1, bc2, block):
    """One AdamW step on flat float32 vectors in place (see :class:`models.optim.AdamW`):
    ``wd`` is a float (0: no decay) or a per-element vector; Python scalars are rounded to the
    vector dtype first, as NumPy does for ``array * python_float``."""
    f = theta.dtype.type
    if isinstance(wd, float):
        wd_s, wd_vec = np.array([wd], theta.dtype), theta[:0]
    else:
        wd_s, wd_vec = theta[:0], wd
    n = theta.shape[0]
    nblocks = -(-n // block)
    parallel_for(_adamw_blocks, nblocks, 4 * n, theta, d, m, v, wd_s, wd_vec, f(lr), f(beta1),
                 f(1.0 - beta1), f(beta2), f(1.0 - beta2), f(eps), f(bc2), f(lr / bc1), block)


# ---------------------------------------------------------------------------------------------
# Winograd F(2x2, 3x3) convolution (Lavin & Gray 2016): stride 1, padding 1, even H and W
# ---------------------------------------------------------------------------------------------
# Tile t of images [n0, n1) is image n0 + t // P, tile row t % P // tw, tile column t % tw
# (P = th tw tiles of 2x2 outputs, th = H/2, tw = W/2).  Its input patch d is the 4x4 window
# of the zero-padded image at rows 2 ty - 1 .. 2 ty + 2 and columns 2 tx - 1 .. 2 tx + 2.
#   input transform   V[4 i + j, t, c] = (B^T d_c B)[i, j],  B^T = [[1, 0, -1, 0], [0, 1, 1, 0],
#                                                                  [0, -1, 1, 0], [0, 1, 0, -1]]
#   output transform  Y[n, 2 ty + a, 2 tx + b, k] = (A^T m_k A)[a, b] (+ bias[k]),
#                     A^T = [[1, 1, 1, 0], [0, 1, -1, -1]], m_k[i, j] = M[4 i + j, t, k]
#   its adjoint       dM[4 i + j, t, k] = (A dy_k A^T)[i, j] for the 2x2 gradient tile dy_k
# Loops run over the channel innermost (contiguous in every operand), so they vectorise.

@numba.jit(**_JIT)
def _pad_rows(X, Xp, lo, hi):
    """Images ``lo..hi-1``: ``Xp[n]`` = ``X[n]`` (H, W, C) inside a zero border of one pixel."""
    _, H, W, C = X.shape
    for n in range(lo, hi):
        for y in range(H + 2):
            for x in range(W + 2):
                d = Xp[n, y, x]
                if 1 <= y <= H and 1 <= x <= W:
                    s = X[n, y - 1, x - 1]
                    for c in range(C):
                        d[c] = s[c]
                else:
                    for c in range(C):
                        d[c] = 0


def pad1(X, Xp):
    """``Xp`` (N, H+2, W+2, C) = ``X`` (N, H, W, C) zero-padded by one pixel, shared over
    threads by images."""
    parallel_for(_pad_rows, X.shape[0], 2 * Xp.size, X, Xp)


@numba.jit(**_JIT)
def _wino_input_row(A, B, sign, x, v0, v1, v2, v3):
    """One row ``i`` of ``B^T d B`` for every channel: ``a_j = A[x + j] + sign B[x + j]``
    (``A``, ``B`` the two padded input rows that row ``i`` of ``B^T d`` combines), then
    ``v = (a0 - a2, a1 + a2, a2 - a1, a1 - a3)``.  Few distinct arrays per loop, so LLVM
    vectorises it over the channels."""
    a0r, a1r, a2r, a3r = A[x], A[x + 1], A[x + 2], A[x + 3]
    b0r, b1r, b2r, b3r = B[x], B[x + 1], B[x + 2], B[x + 3]
    for c in range(v0.shape[0]):
        a0 = a0r[c] + sign * b0r[c]
        a1 = a1r[c] + sign * b1r[c]
        a2 = a2r[c] + sign * b2r[c]
        a3 = a3r[c] + sign * b3r[c]
        v0[c] = a0 - a2
        v1[c] = a1 + a2
        v2[c] = a2 - a1
        v3[c] = a1 - a3


@numba.jit(**_JIT)
def _wino_input_tiles(Xp, n0, V, lo, hi):
    """Tiles ``lo..hi-1``: ``V[:, t, :]`` from the 4x4 patches of the padded images ``Xp``
    (N, H+2, W+2, C); the rows of ``B^T d`` are ``d0 - d2``, ``d1 + d2``, ``d2 - d1``,
    ``d1 - d3`` (``d_i`` the patch's rows)."""
    H, W = Xp.shape[1] - 2, Xp.shape[2] - 2
    tw = W // 2
    P = (H // 2) * tw
    one = Xp.dtype.type(1)
    for t in range(lo, hi):
        n = n0 + t // P
        y = 2 * ((t % P) // tw)
        x = 2 * (t % tw)
        X0, X1, X2, X3 = Xp[n, y], Xp[n, y + 1], Xp[n, y + 2], Xp[n, y + 3]
        _wino_input_row(X0, X2, -one, x, V[0, t], V[1, t], V[2, t], V[3, t])
        _wino_input_row(X1, X2, one, x, V[4, t], V[5, t], V[6, t], V[7, t])
        _wino_input_row(X2, X1, -one, x, V[8, t], V[9, t], V[10, t], V[11, t])
        _wino_input_row(X1, X3, -one, x, V[12, t], V[13, t], V[14, t], V[15, t])


@numba.jit(**_JIT)
def _wino_output_tiles(M, n0, bias, has_bias, Y, lo, hi):
    """Tiles ``lo..hi-1``: the 2x2 outputs ``A^T m A`` (+ bias) into ``Y`` (N, H, W, K), one
    channel vector at a time (the 16 products in registers)."""
    _, H, W, K = Y.shape
    tw = W // 2
    P = (H // 2) * tw
    zero = M.dtype.type(0)
    for t in range(lo, hi):
        n = n0 + t // P
        y = 2 * ((t % P) // tw)
        x = 2 * (t % tw)
        m0, m1, m2, m3 = M[0, t], M[1, t], M[2, t], M[3, t]
        m4, m5, m6, m7 = M[4, t], M[5, t], M[6, t], M[7, t]
        m8, m9, m10, m11 = M[8, t], M[9, t], M[10, t], M[11, t]
        m12, m13, m14, m15 = M[12, t], M[13, t], M[14, t], M[15, t]
        y00, y01, y10, y11 = Y[n, y, x], Y[n, y, x + 1], Y[n, y + 1, x], Y[n, y + 1, x + 1]
        for k in range(K):
            b = bias[k] if has_bias else zero
            # A^T m: rows 0..3 -> 2, for each of the 4 columns
            s00 = m0[k] + m4[k] + m8[k]
            s10 = m4[k] - m8[k] - m12[k]
            s01 = m1[k] + m5[k] + m9[k]
            s11 = m5[k] - m9[k] - m13[k]
            s02 = m2[k] + m6[k] + m10[k]
            s12 = m6[k] - m10[k] - m14[k]
            s03 = m3[k] + m7[k] + m11[k]
            s13 = m7[k] - m11[k] - m15[k]
            # (A^T m) A: columns 0..3 -> 2
            y00[k] = (s00 + s01 + s02) + b
            y01[k] = (s01 - s02 - s03) + b
            y10[k] = (s10 + s11 + s12) + b
            y11[k] = (s11 - s12 - s13) + b


@numba.jit(**_JIT)
def _wino_adjoint_row(G0, G1, s0, s1, x, d0, d1, d2, d3):
    """One row ``i`` of ``A dy A^T`` for every channel: ``q_b = s0 G0[x + b] + s1 G1[x + b]``
    (``G0``, ``G1`` the tile's two gradient rows, ``(s0, s1)`` row ``i`` of ``A``), then
    ``d = (q0, q0 + q1, q0 - q1, -q1)``."""
    g00, g01, g10, g11 = G0[x], G0[x + 1], G1[x], G1[x + 1]
    for k in range(d0.shape[0]):
        q0 = s0 * g00[k] + s1 * g10[k]
        q1 = s0 * g01[k] + s1 * g11[k]
        d0[k] = q0
        d1[k] = q0 + q1
        d2[k] = q0 - q1
        d3[k] = -q1


@numba.jit(**_JIT)
def _wino_output_adjoint_tiles(dY, n0, dM, lo, hi):
    """Tiles ``lo..hi-1``: ``dM[:, t, :] = A dy A^T`` of the 2x2 tiles of ``dY`` (N, H, W, K)
    (the adjoint of :func:`_wino_output_tiles`; ``A``'s rows are (1, 0), (1, 1), (1, -1),
    (0, -1))."""
    _, H, W, K = dY.shape
    tw = W // 2
    P = (H // 2) * tw
    one = dY.dtype.type(1)
    zero = dY.dtype.type(0)
    for t in range(lo, hi):
        n = n0 + t // P
        y = 2 * ((t % P) // tw)
        x = 2 * (t % tw)
        G0, G1 = dY[n, y], dY[n, y + 1]
        _wino_adjoint_row(G0, G1, one, zero, x, dM[0, t], dM[1, t], dM[2, t], dM[3, t])
        _wino_adjoint_row(G0, G1, one, one, x, dM[4, t], dM[5, t], dM[6, t], dM[7, t])
        _wino_adjoint_row(G0, G1, one, -one, x, dM[8, t], dM[9, t], dM[10, t], dM[11, t])
        _wino_adjoint_row(G0, G1, zero, -one, x, dM[12, t], dM[13, t], dM[14, t], dM[15, t])


def winograd_input(Xp, n0, n1, V):
    """Input transform of the tiles of images ``n0..n1-1`` of the padded ``Xp``
    (N, H+2, W+2, C, from :func:`pad1`) into ``V`` (16, tiles, C), shared over threads by
    tiles."""
    T = V.shape[1]
    parallel_for(_wino_input_tiles, T, 4 * V.size, Xp, n0, V)


def winograd_output(M, n0, bias, Y):
    """Output transform of ``M`` (16, tiles, K) into the images ``n0..`` of ``Y`` (N, H, W, K),
    plus ``bias`` (K,) when given."""
    T = M.shape[1]
    has_bias = bias is not None
    parallel_for(_wino_output_tiles, T, 2 * M.size, M, n0,
                 bias if has_bias else M[0, 0], has_bias, Y)


def winograd_output_adjoint(dY, n0, dM):
    """``dM`` (16, tiles, K) from the output-gradient tiles of images ``n0..`` of ``dY``."""
    T = dM.shape[1]
    parallel_for(_wino_output_adjoint_tiles, T, 2 * dM.size, dY, n0, dM)


@numba.jit(**_JIT)
def _wino_weight_rows(w, flip, U, lo, hi):
    """Rows ``lo..hi-1`` of ``U``'s second axis: ``U[4 a + b] = (G g G^T)[a, b]`` for every
    3x3 kernel ``g = w[k, c]`` (``w`` (K, C, 3, 3)), ``G = [[1, 0, 0], [1/2, 1/2, 1/2],
    [1/2, -1/2, 1/2], [0, 0, 1]]``, into ``U[:, c, k]`` (rows = input channels ``c``); with
    ``flip`` the kernel turned by 180 degrees into ``U[:, k, c]`` (rows = output channels
    ``k``: the input gradient's convolution, channels swapped).  The kernels of one row are
    gathered into a (3, 3, n) scratch, then transformed along ``n`` (vectorised)."""
    K, C = w.shape[0], w.shape[1]
    n = C if flip else K
    half = w.dtype.type(0.5)
    g = np.empty((3, 3, n), w.dtype)
    r = np.empty((4, 3, n), w.dtype)
    for row in range(lo, hi):
        for i in range(3):
            for j in range(3):
                gij = g[i, j]
                if flip:
                    for m in range(n):
                        gij[m] = w[row, m, 2 - i, 2 - j]
                else:
                    for m in range(n):
                        gij[m] = w[m, row, i, j]
        for j in range(3):
            g0, g1, g2 = g[0, j], g[1, j], g[2, j]
            r0, r1, r2, r3 = r[0, j], r[1, j], r[2, j], r[3, j]
            for m in range(n):
                r0[m] = g0[m]
                r1[m] = half * (g0[m] + g1[m] + g2[m])
                r2[m] = half * (g0[m] - g1[m] + g2[m])
                r3[m] = g2[m]
        for a in range(4):
            s0, s1, s2 = r[a, 0], r[a, 1], r[a, 2]
            u0, u1, u2, u3 = U[4 * a, row], U[4 * a + 1, row], U[4 * a + 2, row], U[4 * a + 3, row]
            for m in range(n):
                u0[m] = s0[m]
                u1[m] = half * (s0[m] + s1[m] + s2[m])
                u2[m] = half * (s0[m] - s1[m] + s2[m])
                u3[m] = s2[m]


def winograd_weight(w, U, flip: bool = False):
    """Weight transform of the (K, C, 3, 3) kernel ``w`` into ``U`` (16, C, K), or with
    ``flip`` of the input gradient's kernel into ``U`` (16, K, C)."""
    parallel_for(_wino_weight_rows, U.shape[1], 2 * U.size, w, flip, U)


@numba.jit(**_JIT)
def _wino_weight_grad_rows(dU, dW, lo, hi):
    """Input channels ``lo..hi-1``: ``dW[k, c] = G^T dU[:, c, k] G`` (the adjoint of the weight
    transform), along ``k`` (vectorised), then stored into ``dW`` (K, C, 3, 3)."""
    K = dW.shape[0]
    half = dW.dtype.type(0.5)
    r = np.empty((3, 4, K), dU.dtype)
    o = np.empty((3, 3, K), dU.dtype)
    for c in range(lo, hi):
        for b in range(4):                  # G^T u: rows 4 -> 3
            u0, u1, u2, u3 = dU[b, c], dU[4 + b, c], dU[8 + b, c], dU[12 + b, c]
            r0, r1, r2 = r[0, b], r[1, b], r[2, b]
            for k in range(K):
                r0[k] = u0[k] + half * (u1[k] + u2[k])
                r1[k] = half * (u1[k] - u2[k])
                r2[k] = half * (u1[k] + u2[k]) + u3[k]
        for i in range(3):                  # (G^T u) G: columns 4 -> 3
            s0, s1, s2, s3 = r[i, 0], r[i, 1], r[i, 2], r[i, 3]
            o0, o1, o2 = o[i, 0], o[i, 1], o[i, 2]
            for k in range(K):
                o0[k] = s0[k] + half * (s1[k] + s2[k])
                o1[k] = half * (s1[k] - s2[k])
                o2[k] = half * (s1[k] + s2[k]) + s3[k]
        for i in range(3):
            for j in range(3):
                oij = o[i, j]
                for k in range(K):
                    dW[k, c, i, j] = oij[k]


def winograd_weight_grad(dU, dW):
    """``dW`` (K, C, 3, 3) from the transformed-domain gradient ``dU`` (16, C, K)."""
    parallel_for(_wino_weight_grad_rows, dW.shape[1], 2 * dU.size, dU, dW)
