"""Numba kernels for the memory-bound passes of the layers (CPU, NumPy arrays only).

Imported lazily by :mod:`models.layers` (the first BatchNorm forward on a NumPy array), so a run
whose model has no BatchNorm never imports Numba.  Every kernel works on a channels-last 2-D
view ``X`` of shape ``(M, C)``, ``M = N*H*W`` (one row per pixel, one column per channel), and
accumulates in float64 whatever the array dtype, so float32 models get per-channel statistics
more accurate than a float32 reduction.

BatchNorm (Ioffe & Szegedy 2015, Alg. 1 and its gradient), per channel ``c`` over ``M`` values:

* ``mu = (1/M) sum x``, ``var = (1/M) sum (x - mu)^2`` (biased), ``x_hat = (x - mu) / sqrt(var +
  eps)``, ``y = gamma x_hat + beta``;
* ``d_beta = sum dy``, ``d_gamma = sum dy x_hat``,
  ``dx = gamma / (M sqrt(var + eps)) (M dy - d_beta - x_hat d_gamma)``.

The forward is two passes over ``X`` (statistics, then ``y``) and the backward two passes over
``dY`` and ``X`` (sums, then ``dx``); ``x_hat`` is recomputed from ``X`` rather than stored.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["channel_stats", "bn_apply", "bn_backward_sums", "bn_backward_input"]

_JIT = dict(nopython=True, nogil=True, cache=True, fastmath=False)


@numba.jit(**_JIT)
def channel_stats(X):
    """Per-column mean and biased variance of ``X`` (M, C), float64.

    Shifted-data algorithm (shift = first row), so the variance does not cancel when the mean is
    large against the spread.
    """
    M, C = X.shape
    shift = np.empty(C, np.float64)
    s = np.zeros(C, np.float64)
    q = np.zeros(C, np.float64)
    for c in range(C):
        shift[c] = X[0, c]
    for i in range(M):
        for c in range(C):
            d = np.float64(X[i, c]) - shift[c]
            s[c] += d
            q[c] += d * d
    mean = np.empty(C, np.float64)
    var = np.empty(C, np.float64)
    for c in range(C):
        m1 = s[c] / M
        mean[c] = shift[c] + m1
        v = q[c] / M - m1 * m1
        var[c] = v if v > 0.0 else 0.0
    return mean, var


@numba.jit(**_JIT)
def bn_apply(X, mean, scale, beta, Y):
    """``Y = (X - mean) * scale + beta`` per column (float64 arithmetic, cast on store)."""
    M, C = X.shape
    for i in range(M):
        for c in range(C):
            Y[i, c] = (np.float64(X[i, c]) - mean[c]) * scale[c] + beta[c]


@numba.jit(**_JIT)
def bn_backward_sums(dY, X, mean, inv_std):
    """``d_beta = sum dY`` and ``d_gamma = sum dY * x_hat`` per column, float64."""
    M, C = X.shape
    db = np.zeros(C, np.float64)
    dxm = np.zeros(C, np.float64)
    for i in range(M):
        for c in range(C):
            g = np.float64(dY[i, c])
            db[c] += g
            dxm[c] += g * (np.float64(X[i, c]) - mean[c])
    dg = np.empty(C, np.float64)
    for c in range(C):
        dg[c] = dxm[c] * inv_std[c]
    return db, dg


@numba.jit(**_JIT)
def bn_backward_input(dY, X, mean, inv_std, gamma, d_beta, d_gamma, dX):
    """``dX = gamma inv_std / M (M dY - d_beta - x_hat d_gamma)``, ``x_hat`` from ``X``."""
    M, C = X.shape
    a = np.empty(C, np.float64)       # gamma * inv_std
    b = np.empty(C, np.float64)       # -(gamma * inv_std / M) * d_beta
    k = np.empty(C, np.float64)       # -(gamma * inv_std / M) * d_gamma * inv_std
    for c in range(C):
        a[c] = gamma[c] * inv_std[c]
        b[c] = -a[c] * d_beta[c] / M
        k[c] = -a[c] * d_gamma[c] * inv_std[c] / M
    for i in range(M):
        for c in range(C):
            dX[i, c] = a[c] * np.float64(dY[i, c]) + b[c] + k[c] * (np.float64(X[i, c])
                                                                     - mean[c])
