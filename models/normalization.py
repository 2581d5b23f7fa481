"""Normalization over the last axis (any leading shape): :class:`LayerNorm` and :class:`RMSNorm`.

* LayerNorm (Ba et al. 2016, eqs. 3-4): ``y = gamma (x - mu) / sqrt(var + eps) + beta`` per
  row, the variance the mean of squared *centered* values (never ``E[x^2] - E[x]^2``); on NumPy
  arrays one fused Numba pass per row (float64 statistics, :mod:`models.kernels_transformer`),
  with a pre-norm block's residual sum and bias row fused in;
* RMSNorm (Zhang & Sennrich 2019, as LLaMA uses it): ``y = gamma x / sqrt(mean(x^2) + eps)``.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

from .layer_base import Layer
from .transformer_base import _kernels_for, _load_kernels, _rows2d

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(Layer):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis (Ba et al. 2016).

    Parameters ``weight`` (gamma, ones) and ``bias`` (beta, zeros), kind ``"bn"``.  The variance
    is the biased mean of squared centered values.  Backward, with ``x̂`` the normalized input,
    ``g = dy * gamma`` and ``D`` the width::

        dx = rstd / D * (D g - sum(g) - x̂ sum(g x̂)),   dgamma = Σ dy x̂,   dbeta = Σ dy
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        if dim <= 0 or not eps > 0:
            raise ValueError(f"LayerNorm needs dim > 0 and eps > 0, got {dim}, {eps}")
        self.dim, self.eps = int(dim), float(eps)
        self.declare_param("weight", "bn", (dim,), "ones")
        self.declare_param("bias", "bn", (dim,), "zeros")

    def forward(self, x, training: bool = True):
        if x.shape[-1] != self.dim:
            raise ValueError(f"LayerNorm expects last dim {self.dim}, got {tuple(x.shape)}")
        k = _kernels_for(x)
        if k is not None:
            return self._forward_rows(k, x)[1]
        xp = array_module(x)
        xc = x - x.mean(axis=-1, keepdims=True)
        var = (xc * xc).mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + self.eps)
        x_hat = xc * rstd
        self._cache = ("xp", x_hat, rstd)
        return x_hat * self.P["weight"] + self.P["bias"]

    def _forward_rows(self, k, x, r=None, b=None):
        """Numba path: one pass per row (statistics in float64); with ``r`` the residual sum
        ``h = x + (r + b)`` is formed in the same pass and normalized.  Returns ``(h, y)``."""
        X = _rows2d(x)
        M = X.shape[0]
        Y = np.empty_like(X)
        mean, rstd = np.empty(M), np.empty(M)
        if r is None:
            H = X
            k.layer_norm_forward(X, self.P["weight"], self.P["bias"], self.eps, Y, mean, rstd)
        else:
            H = np.empty_like(X)
            k.layer_norm_forward(X, self.P["weight"], self.P["bias"], self.eps, Y, mean, rstd,
                                 R=_rows2d(r), B=b, H=H)
        self._cache = ("rows", H, mean, rstd)
        return H.reshape(x.shape), Y.reshape(x.shape)

    def forward_residual(self, x, r, b=None):
        """``h = x + (r + b)`` (a residual sum; ``b`` a bias row or ``None``) and ``LN(h)``, in
        one pass with the Numba kernels; returns ``(h, LN(h))``."""
        k = _kernels_for(x)
        if k is not None and r.shape == x.shape:
            return self._forward_rows(k, x, r, b)
        h = x + (r if b is None else r + b)
        return h, self.forward(h)

    def backward(self, dy):
        return self.backward_residual(dy)[0]

    def backward_residual(self, dy, dres=None, colsum: bool = False):
        """Input gradient plus the residual stream's gradient ``dres`` (``dres + dx``, one
        pass with the Numba kernels), and with ``colsum`` its sum over rows (the bias
        gradient of the layer whose output fed the residual sum); returns ``(dx, sum or
        None)``."""
        if self._cache[0] == "rows":
            _, X, mean, rstd = self._cache
            k = _load_kernels()
            dY = _rows2d(dy)
            dX = np.empty_like(dY)
            dg, db, cs = k.layer_norm_backward(dY, X, mean, rstd, self.P["weight"], dX,
                                               R=None if dres is None else _rows2d(dres),
                                               colsum=colsum)
            self.G["weight"][...] = dg
            self.G["bias"][...] = db
            self._emit_ready()
            self._cache = None
            return dX.reshape(dy.shape), (None if cs is None else cs.astype(dy.dtype))
        _, x_hat, rstd = self._cache
        lead = tuple(range(dy.ndim - 1))
        self.G["weight"][...] = (dy * x_hat).sum(axis=lead)
        self.G["bias"][...] = dy.sum(axis=lead)
        self._emit_ready()
        g = dy * self.P["weight"]
        D = self.dim
        dx = rstd / D * (D * g - g.sum(axis=-1, keepdims=True)
                         - x_hat * (g * x_hat).sum(axis=-1, keepdims=True))
        self._cache = None
        if dres is not None:
            dx = dres + dx
        return dx, (dx.reshape(-1, D).sum(axis=0) if colsum else None)

    def __repr__(self):
        return f"LayerNorm({self.dim}, eps={self.eps})"


class RMSNorm(Layer):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last axis (LLaMA; Zhang & Sennrich 2019).

    Parameter ``weight`` (gamma, ones, kind ``"bn"``).  Backward with ``g = dy * gamma``:
    ``dx = rstd (g - x̂ mean(g x̂))``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)
        self.declare_param("weight", "bn", (dim,), "ones")

    def forward(self, x, training: bool = True):
        xp = array_module(x)
        rstd = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps)
        x_hat = x * rstd
        self._cache = (x_hat, rstd)
        return x_hat * self.P["weight"]

    def backward(self, dy):
        x_hat, rstd = self._cache
        self.G["weight"][...] = (dy * x_hat).sum(axis=tuple(range(dy.ndim - 1)))
        self._emit_ready()
        g = dy * self.P["weight"]
        self._cache = None
        return rstd * (g - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))

    def __repr__(self):
        return f"RMSNorm({self.dim}, eps={self.eps})"
