"""Numba kernels of the Winograd F(2x2, 3x3) convolution (Lavin & Gray 2016, §4).

The path of :class:`models.conv.Conv2d` for 3x3 stride-1 padding-1 convolutions on even
``H, W``: ``Y = A^T [ (G g G^T) ⊙ (B^T d B) ] A`` per 2x2 output tile (their eq. 8), with the
input, output and weight transforms and their adjoints over channel vectors (the matrices are
given with the kernels below); the 16 channel GEMMs between them run in
:class:`models.conv.Conv2d`.

Imported only through :mod:`models.kernels` (loaded lazily by :mod:`models.kernel_loader`);
threads from :mod:`models.kernels_threads`.
"""

from __future__ import annotations

import numba
import numpy as np

from .kernels_threads import _JIT, parallel_for

__all__ = [
    "IDENTITY",
    "TURNED",
    "pad1",
    "winograd_input",
    "winograd_output",
    "winograd_output_adjoint",
    "winograd_weight",
    "winograd_weight_grad",
]

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
#
# The input and output transforms take an ``order`` of the 16 products: product ``e`` is
# stored in (read from) slot ``order[e]``.  :data:`TURNED` lets the input gradient reuse the
# forward's ``U``: turning a 3x3 kernel by 180 degrees (``J g J``, ``J`` the 3x3 reversal)
# turns ``G J = S G`` (``S`` swaps rows 0 and 3 of 4), so ``G (J g J) G^T = S (G g G^T) S^T``:
# the turned kernel's product ``4 a + b`` is ``U``'s product ``4 s(a) + s(b)``, with ``s``
# swapping 0 and 3.  With the input's products stored in that order, the 16 GEMMs take
# ``U[e]^T`` (channels swapped) as they are, and the output transform reads back the same way
# (the order is its own inverse).

#: products in their own order
IDENTITY = np.arange(16, dtype=np.int64)
#: product ``4 a + b`` in slot ``4 s(a) + s(b)``, ``s = (3, 1, 2, 0)``: the 180-degree turned
#: kernel's order (see above)
TURNED = np.array([4 * a + b for a in (3, 1, 2, 0) for b in (3, 1, 2, 0)], dtype=np.int64)

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
def _wino_input_tiles(Xp, n0, order, V, lo, hi):
    """Tiles ``lo..hi-1``: ``V[order, t, :]`` from the 4x4 patches of the padded images ``Xp``
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
        o = order
        _wino_input_row(X0, X2, -one, x, V[o[0], t], V[o[1], t], V[o[2], t], V[o[3], t])
        _wino_input_row(X1, X2, one, x, V[o[4], t], V[o[5], t], V[o[6], t], V[o[7], t])
        _wino_input_row(X2, X1, -one, x, V[o[8], t], V[o[9], t], V[o[10], t], V[o[11], t])
        _wino_input_row(X1, X3, -one, x, V[o[12], t], V[o[13], t], V[o[14], t], V[o[15], t])


@numba.jit(**_JIT)
def _wino_output_tiles(M, n0, order, bias, has_bias, Y, lo, hi):
    """Tiles ``lo..hi-1``: the 2x2 outputs ``A^T m A`` (+ bias) into ``Y`` (N, H, W, K), one
    channel vector at a time (the 16 products, ``m_e = M[order[e], t]``, in registers)."""
    _, H, W, K = Y.shape
    tw = W // 2
    P = (H // 2) * tw
    zero = M.dtype.type(0)
    for t in range(lo, hi):
        n = n0 + t // P
        y = 2 * ((t % P) // tw)
        x = 2 * (t % tw)
        o = order
        m0, m1, m2, m3 = M[o[0], t], M[o[1], t], M[o[2], t], M[o[3], t]
        m4, m5, m6, m7 = M[o[4], t], M[o[5], t], M[o[6], t], M[o[7], t]
        m8, m9, m10, m11 = M[o[8], t], M[o[9], t], M[o[10], t], M[o[11], t]
        m12, m13, m14, m15 = M[o[12], t], M[o[13], t], M[o[14], t], M[o[15], t]
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
    _, H, W, _K = dY.shape
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


def winograd_input(Xp, n0, n1, V, order=IDENTITY):
    """Input transform of the tiles of images ``n0..n1-1`` of the padded ``Xp``
    (N, H+2, W+2, C, from :func:`pad1`) into ``V`` (16, tiles, C), product ``e`` in slot
    ``order[e]`` (:data:`TURNED`: for the turned kernel), shared over threads by tiles."""
    T = V.shape[1]
    parallel_for(_wino_input_tiles, T, 4 * V.size, Xp, n0, order, V)


def winograd_output(M, n0, bias, Y, order=IDENTITY):
    """Output transform of ``M`` (16, tiles, K), product ``e`` read from slot ``order[e]``,
    into the images ``n0..`` of ``Y`` (N, H, W, K), plus ``bias`` (K,) when given."""
    T = M.shape[1]
    has_bias = bias is not None
    parallel_for(_wino_output_tiles, T, 2 * M.size, M, n0, order,
                 bias if has_bias else M[0, 0], has_bias, Y)


def winograd_output_adjoint(dY, n0, dM):
    """``dM`` (16, tiles, K) from the output-gradient tiles of images ``n0..`` of ``dY``."""
    T = dM.shape[1]
    parallel_for(_wino_output_adjoint_tiles, T, 2 * dM.size, dY, n0, dM)


@numba.jit(**_JIT)
def _wino_weight_rows(w, U, lo, hi):
    """Input channels ``lo..hi-1``: ``U[4 a + b, c] = (G g G^T)[a, b]`` for every 3x3 kernel
    ``g = w[k, c]`` (``w`` (K, C, 3, 3)), ``G = [[1, 0, 0], [1/2, 1/2, 1/2],
    [1/2, -1/2, 1/2], [0, 0, 1]]``, into ``U[:, c, k]``.  The kernels of one input channel are
    gathered into a (3, 3, K) scratch, then transformed along ``k`` (vectorised)."""
    n = w.shape[0]
    half = w.dtype.type(0.5)
    g = np.empty((3, 3, n), w.dtype)
    r = np.empty((4, 3, n), w.dtype)
    for row in range(lo, hi):
        for i in range(3):
            for j in range(3):
                gij = g[i, j]
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


def winograd_weight(w, U):
    """Weight transform of the (K, C, 3, 3) kernel ``w`` into ``U`` (16, C, K); the input
    gradient's turned kernel is the same ``U`` in the :data:`TURNED` order, channels swapped."""
    parallel_for(_wino_weight_rows, U.shape[1], 2 * U.size, w, U)


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
