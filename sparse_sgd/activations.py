"""Activations f and their derivatives f' written in terms of the output x = f(z) (eq. 3, eq. 7)."""

from __future__ import annotations

import numpy as np

__all__ = ["ACTIVATIONS", "ACT_FLOPS", "Activation"]

#: FLOPs per element of an activation or its derivative (the ``flops`` compute source's counts)
ACT_FLOPS = {"sigmoid": 4, "relu": 1}


class Activation:
    """f(z) applied in place and f'(z) evaluated from x = f(z)."""

    name = "identity"

    @staticmethod
    def apply(z: np.ndarray) -> np.ndarray:  # in place, returns z
        return z

    @staticmethod
    def derivative(x: np.ndarray) -> np.ndarray:
        return np.ones_like(x)


class Sigmoid(Activation):
    """f(z) = 1 / (1 + exp(-z)); f'(z) = x (1 - x) (the paper's choice, §6.1)."""

    name = "sigmoid"

    @staticmethod
    def apply(z):
        np.negative(z, out=z)
        np.exp(z, out=z)
        z += 1.0
        np.reciprocal(z, out=z)
        return z

    @staticmethod
    def derivative(x):
        return x * (1.0 - x)


class ReLU(Activation):
    """f(z) = max(z, 0); f'(z) = [x > 0]."""

    name = "relu"

    @staticmethod
    def apply(z):
        np.maximum(z, 0.0, out=z)
        return z

    @staticmethod
    def derivative(x):
        return (x > 0).astype(x.dtype)


#: registry keyed by ``--activation``
ACTIVATIONS = {"sigmoid": Sigmoid, "relu": ReLU}
