"""Local sparse kernels (Numba) for SpFF/SpBP on one processor.

Dense operands are row-major ``(rows, batch)`` arrays: row i of X holds x(i) for every vector of
the mini-batch (§5.1, SpMM instead of SpMV), so one CSR row streams contiguous batch rows.
"""

from __future__ import annotations

import os

# Idle OpenMP workers sleep instead of spinning: Numba's default ``omp`` threading
# layer runs on libgomp, whose workers spin at every barrier by default; when other processes
# share the cores, the spinning thread takes the CPU its partner needs and a 2-thread inference
# becomes 3-10x slower than one thread (bench/bench_sparse.py, section threads).  libgomp reads
# the variable when Numba first loads it (the first parallel kernel); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # after the OpenMP wait policy
import numpy as np

from substrate.backend import array_module

__all__ = [
    "challenge_finish_device",
    "challenge_layer",
    "sddmm_update",
    "sddmm_update_device",
    "spmm_add",
    "spmm_add_challenge",
]


@numba.njit(inline="always", cache=True)
def _row_spmm_add(r, indptr, indices, data, X, out):
    """out[r] += A[r] @ X for one CSR row (inlined into the parallel kernels)."""
    B = X.shape[1]
    for p in range(indptr[r], indptr[r + 1]):
        w = data[p]
        c = indices[p]
        for b in range(B):
            out[r, b] += w * X[c, b]


@numba.njit(parallel=True, cache=True, fastmath=False)
def spmm_add(indptr, indices, data, X, out):
    """out += A @ X for CSR A (rows of ``out``) and dense row-major X."""
    for r in numba.prange(indptr.size - 1):
        _row_spmm_add(r, indptr, indices, data, X, out)


@numba.njit(parallel=True, cache=True, fastmath=False)
def spmm_add_challenge(indptr, indices, data, X, out, bias, ymax):
    """out = min(max(out + A @ X + bias * [out + A X != 0], 0), ymax)  (Graph Challenge layer).

    The bias is added only where the product is nonzero (the challenge's sparse semantics).
    """
    B = X.shape[1]
    for r in numba.prange(indptr.size - 1):
        _row_spmm_add(r, indptr, indices, data, X, out)
        for b in range(B):
            v = out[r, b]
            if v != 0.0:
                v += bias
                if v < 0.0:
                    v = 0.0
                elif v > ymax:
                    v = ymax
                out[r, b] = v


def challenge_layer(A, X, bias, ymax, out=None):
    """Y = min(max(A X + b, 0), ymax) with bias only where A X != 0, fused in one pass."""
    if out is None:
        out = np.zeros((A.shape[0], X.shape[1]), dtype=X.dtype)
    else:
        out[...] = 0
    spmm_add_challenge(A.indptr, A.indices, A.data, X, out, X.dtype.type(bias),
                       X.dtype.type(ymax))
    return out


@numba.njit(parallel=True, cache=True, fastmath=False)
def sddmm_update(indptr, indices, data, delta, X, lr):
    """W <- W - lr * (delta X^T) on the sparsity of W (eqs. 4-5 for a mini-batch, Alg. 3 l. 8-9).

    ``delta`` has one row per row of W, ``X`` one row per column of W.
    """
    n_rows = indptr.size - 1
    B = X.shape[1]
    for r in numba.prange(n_rows):
        for p in range(indptr[r], indptr[r + 1]):
            c = indices[p]
            g = 0.0
            for b in range(B):
                g += delta[r, b] * X[c, b]
            data[p] -= lr * g


# -- the device (CuPy) forms: the same arithmetic as array operations ---------------------------------

#: elements of the (nnz, batch) product ``sddmm_update_device`` forms at once
SDDMM_CHUNK = 1 << 24


def sddmm_update_device(rows, cols, data, delta, X, lr) -> None:
    """:func:`sddmm_update` on device arrays: ``data[p] -= lr * Σ_b delta[rows[p], b] *
    X[cols[p], b]`` with the sum accumulated in float64 (as the Numba kernel's ``g``), in
    chunks of at most :data:`SDDMM_CHUNK` products.  ``rows`` is the row of every stored
    entry (the CSR row pointer expanded once)."""
    nnz = int(data.size)
    B = int(X.shape[1])
    step = max(1, SDDMM_CHUNK // max(B, 1))
    for lo in range(0, nnz, step):
        hi = min(nnz, lo + step)
        g = (delta[rows[lo:hi]] * X[cols[lo:hi]]).sum(axis=1, dtype=np.float64)
        data[lo:hi] -= lr * g


def challenge_finish_device(z, bias, ymax):
    """The Graph Challenge activation of :func:`spmm_add_challenge` on a device product ``z``
    (in place): ``min(max(z + bias, 0), ymax)`` where ``z != 0``, ``0`` elsewhere."""
    nz = z != 0
    z += bias
    array_module(z).clip(z, 0.0, ymax, out=z)
    z *= nz
    return z
