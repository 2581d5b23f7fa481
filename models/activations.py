"""Activations of the transformers: :class:`GELU` and :class:`Tanh`.

GELU in the tanh form of Hendrycks & Gimpel 2016 (as GPT-2 and BERT use it):
``GELU(z) = z/2 (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``; on NumPy arrays with the Numba
kernels around NumPy's ``tanh`` (:mod:`models.kernels_transformer`, the same float32
operations) and ``fc1``'s bias fused in.
"""

from __future__ import annotations

import math

import numpy as np

from substrate.backend import array_module

from .layer_base import Layer
from .transformer_base import _kernels_for, _load_kernels, _rows2d

__all__ = ["GELU", "Tanh"]

_GELU_C = math.sqrt(2.0 / math.pi)


class GELU(Layer):
    """``y = x/2 (1 + tanh(c (x + 0.044715 x^3)))``, ``c = sqrt(2/pi)`` (GPT-2 / BERT form)."""

    def forward(self, x, training: bool = True):
        return self.forward_bias(x)

    def forward_bias(self, z, b=None):
        """GELU of ``z + b`` (``b`` a bias row or ``None``): with the Numba kernels, the bias
        sum, the polynomial and the output in Numba around NumPy's vectorised ``tanh``, block
        by block of rows (the same float32 operations, so the same values as the array path);
        ``z`` may be overwritten with ``z + b``."""
        k = _kernels_for(z)
        if k is not None:
            Z = _rows2d(z)
            T, Y = np.empty_like(Z), np.empty_like(Z)
            k.gelu_forward(Z, b, Z, T, Y)
            self._cache = ("rows", Z, T)
            return Y.reshape(z.shape)
        x = z if b is None else z + b
        xp = array_module(x)
        t = xp.tanh(_GELU_C * (x + 0.044715 * x * x * x))
        self._cache = ("xp", x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, dy):
        return self.backward_bias(dy)[0]

    def backward_bias(self, dy, bias_grad: bool = False):
        """``dL/dz`` and, with ``bias_grad``, ``Σ_rows dL/dz`` (the gradient of the bias added
        in :meth:`forward_bias`, summed in the same pass); returns ``(dz, sum or None)``."""
        kind, x, t = self._cache
        self._cache = None
        if kind == "rows":
            k = _load_kernels()
            dY = _rows2d(dy)
            dZ = np.empty_like(dY)
            db = k.gelu_backward(dY, x, t, dZ, colsum=bias_grad)
            return dZ.reshape(dy.shape), (None if db is None else db.astype(dy.dtype))
        du = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        dz = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
        return dz, (dz.reshape(-1, dz.shape[-1]).sum(axis=0) if bias_grad else None)


class Tanh(Layer):
    """``y = tanh(x)`` (BERT's pooler)."""

    def forward(self, x, training: bool = True):
        self._y = array_module(x).tanh(x)
        return self._y

    def backward(self, dy):
        y, self._y = self._y, None
        return dy * (1.0 - y * y)
