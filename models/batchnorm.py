"""Batch normalization (:class:`BatchNorm2d`; Ioffe & Szegedy 2015, Alg. 1 and its gradient).

Per channel over ``(N, H, W)``: batch statistics in training (PyTorch's running-average
update with the unbiased variance), running statistics in evaluation.  On NumPy arrays the
layer loads the Numba kernels (:mod:`models.kernels`: float64 statistics, two passes each
way); the array path computes the same formulas.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

from .kernel_loader import kernels as _kernels
from .layer_base import Layer, _rows

__all__ = ["BatchNorm2d"]


class BatchNorm2d(Layer):
    """Batch normalization over ``(N, H, W)`` per channel.

    Training: normalize with the batch mean and the biased batch variance, then update
    ``running = (1 - momentum) * running + momentum * batch_stat`` with the *unbiased* variance
    ``var * M / (M - 1)``, ``M = N*H*W`` (PyTorch semantics).  Evaluation: normalize with the
    running statistics.

    Parameters
    ----------
    num_features : int
    momentum : float, default 0.1
    eps : float, default 1e-5
    """

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        if num_features <= 0:
            raise ValueError(f"BatchNorm2d needs num_features > 0, got {num_features}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm2d momentum must be in [0, 1], got {momentum}")
        if eps <= 0:
            raise ValueError(f"BatchNorm2d eps must be > 0, got {eps}")
        self.num_features, self.momentum, self.eps = int(num_features), float(momentum), float(eps)
        self.declare_param("weight", "bn", (num_features,), "ones")
        self.declare_param("bias", "bn", (num_features,), "zeros")
        self.declare_buffer("running_mean", (num_features,), 0.0)
        self.declare_buffer("running_var", (num_features,), 1.0)
        self._ones_key = self._ones_vec = None

    def forward(self, x, training: bool = True):
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise ValueError(
                f"BatchNorm2d expects (N, {self.num_features}, H, W), got {tuple(x.shape)}")
        xp = array_module(x)
        if training and x.shape[0] * x.shape[2] * x.shape[3] < 2:
            raise ValueError("BatchNorm2d in training mode needs more than one value per "
                             "channel (batch*H*W >= 2); use a larger batch or eval mode")
        k = _kernels() if xp.__name__ == "numpy" else None
        if k is None:
            return self._forward_xp(x, training)
        return self._forward_kernels(k, x, training)

    def _update_running(self, mean, var, m: int) -> None:
        """``running = (1 - momentum) running + momentum batch`` (unbiased variance)."""
        mom = self.momentum
        rm, rv = self.B["running_mean"], self.B["running_var"]
        rm *= 1.0 - mom
        rm += (mom * mean).astype(rm.dtype)
        rv *= 1.0 - mom
        rv += ((mom * m / (m - 1)) * var).astype(rv.dtype)

    def _forward_kernels(self, k, x, training: bool):
        """Channels-last Numba path: statistics in one pass (float64), output in a second."""
        N, C, H, W = x.shape
        X = _rows(x)                                       # (N*H*W, C)
        if training:
            mean, var = k.channel_stats(X)
            self._update_running(mean, var, X.shape[0])
        else:
            mean = self.B["running_mean"].astype(np.float64)
            var = self.B["running_var"].astype(np.float64)
        inv_std = 1.0 / np.sqrt(var + self.eps)
        gamma = self.P["weight"].astype(np.float64)
        Y = np.empty_like(X)
        k.bn_apply(X, mean, gamma * inv_std, self.P["bias"].astype(np.float64), Y)
        self._cache = ("rows", X, mean, inv_std, training)
        return Y.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def _ones(self, xp, m: int, dtype):
        """A ones vector of ``m`` entries (the per-channel sums are products with it), kept
        while the batch shape stays."""
        key = (xp.__name__, m, np.dtype(dtype))
        if self._ones_key != key:
            self._ones_key, self._ones_vec = key, xp.ones(m, dtype=dtype)
        return self._ones_vec

    def _forward_xp(self, x, training: bool):
        """Array-module path (CuPy, or NumPy without Numba) on the channels-last rows
        ``(N*H*W, C)``: each per-channel sum is a product with a ones vector (one BLAS GEMV,
        which reads the rows coalesced on a GPU, where a reduction over ``(N, H, W)`` of the
        channels-last data does not), then the same formulas as the kernels."""
        xp = array_module(x)
        N, C, H, W = x.shape
        X = _rows(x)
        if training:
            m = X.shape[0]
            ones = self._ones(xp, m, X.dtype)
            mean = (ones @ X) / m
            xc = X - mean
            var = (ones @ (xc * xc)) / m
            inv_std = 1.0 / xp.sqrt(var + self.eps)
            self._update_running(mean, var, m)
        else:
            xc = X - self.B["running_mean"]
            inv_std = 1.0 / xp.sqrt(self.B["running_var"] + self.eps)
        xc *= inv_std                                      # x_hat
        self._cache = ("xp", xc, inv_std, training)
        y = xc * self.P["weight"] + self.P["bias"]
        return y.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def backward(self, dy):
        if self._cache[0] == "rows":
            return self._backward_kernels(dy)
        _, x_hat, inv_std, training = self._cache
        xp = array_module(dy)
        N, C, H, W = dy.shape
        dY = _rows(dy)
        gamma = self.P["weight"]
        ones = self._ones(xp, dY.shape[0], dY.dtype)
        d_beta = ones @ dY
        d_gamma = ones @ (dY * x_hat)
        self.G["bias"][...] = d_beta
        self.G["weight"][...] = d_gamma
        self._emit_ready()
        self._cache = None
        if not training:
            dX = dY * (gamma * inv_std)
        else:
            m = dY.shape[0]
            dX = (gamma * inv_std / m) * (m * dY - d_beta - x_hat * d_gamma)
        return dX.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def _backward_kernels(self, dy):
        k = _kernels()
        _, X, mean, inv_std, training = self._cache
        N, C, H, W = dy.shape
        dY = _rows(dy)
        d_beta, d_gamma = k.bn_backward_sums(dY, X, mean, inv_std)
        self.G["bias"][...] = d_beta
        self.G["weight"][...] = d_gamma
        self._emit_ready()
        self._cache = None
        gamma = self.P["weight"].astype(np.float64)
        dX = np.empty_like(dY)
        if training:
            k.bn_backward_input(dY, X, mean, inv_std, gamma, d_beta, d_gamma, dX)
        else:                                              # running statistics are constants
            k.bn_apply(dY, np.zeros_like(mean), gamma * inv_std, np.zeros_like(mean), dX)
        return dX.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def __repr__(self):
        return f"BatchNorm2d({self.num_features}, momentum={self.momentum}, eps={self.eps})"
