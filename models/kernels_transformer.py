"""Numba kernels of the transformer layers (:mod:`models.transformer`, CPU, NumPy arrays only).

Transformers (:mod:`models.transformer`): LayerNorm rows in one pass (float64 statistics) with
the residual sum and a bias row fused in, its backward with the residual gradient and the
bias gradient's column sum fused in; GELU around NumPy's ``tanh`` per block of rows (the array
path's float32 operations, same bits) with the bias fused in; the attention softmax's shift,
normalisation and backward on the rows of one chunk; the token embedding's gradient (the bits
of ``np.add.at``); the softmax cross-entropy of large logits; AdamW in one pass (the array
path's bits).

* LayerNorm (Ba et al. 2016): ``y = gamma (x - mu) / sqrt(var + eps) + beta`` per row, with
  ``H = X + R`` (pre-norm residual) and a bias row ``B`` fused in;
* GELU, tanh form (Hendrycks & Gimpel 2016): ``y = z/2 (1 + tanh(sqrt(2/pi) (z + 0.044715
  z^3)))``;
* the attention softmax ``softmax(Q K^T / sqrt(d_h))`` (Vaswani et al. 2017, eq. 1), causal or
  not, and its backward ``dS = P (dA - (dO . O))``;
* the softmax cross-entropy, the embedding gradient and AdamW (Loshchilov & Hutter 2019,
  Alg. 2, decoupled weight decay).

Imported only through :mod:`models.kernels` (loaded lazily by :mod:`models.kernel_loader`);
threads and blocks from :mod:`models.kernels_threads`.
"""

from __future__ import annotations

import numba
import numpy as np

from .kernels_threads import _JIT, ROW_BLOCK, parallel_for

__all__ = [
    "CE_ROWS",
    "GELU_ROWS",
    "adamw_step",
    "embedding_grad",
    "gelu_backward",
    "gelu_forward",
    "layer_norm_backward",
    "layer_norm_forward",
    "softmax_backward",
    "softmax_cross_entropy",
    "softmax_normalize",
    "softmax_shift",
]

#: may be reassociated so that they vectorize: the order of a row's sum is fixed by the
#: compiled code (the same on every call and thread), not by the thread count
_JIT_ROWS = {"nopython": True, "nogil": True, "cache": True, "fastmath": {"reassoc", "nsz"}}

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

