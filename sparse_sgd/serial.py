"""Serial SciPy reference of SGD on a sparse DNN (Alg. 1 with mini-batches, §5.1).

Independent of the distributed code path (no maps, no Numba): the distributed SpFF/SpBP are
tested against it.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from sparse_sgd.activations import ACTIVATIONS

__all__ = [
    "INITS",
    "SerialSparseNet",
    "challenge_inference_serial",
    "init_weights",
    "mse_loss",
]

#: initialisations of the weights on the fixed sparsity pattern (``--init``)
INITS = ("fan-in", "uniform", "challenge")


def mse_loss(XL: np.ndarray, Y: np.ndarray) -> float:
    """J = 1/(2B) sum_b ||x^L_b - y_b||^2 for a mini-batch of B columns."""
    B = XL.shape[1]
    return float(0.5 * np.sum((XL - Y) ** 2) / B)


class SerialSparseNet:
    """Reference SGD: X^k = f(W^k X^{k-1} + b^k) (eq. 3), delta by eqs. 6-7, update eqs. 4-5.

    Parameters
    ----------
    weights : list of scipy.sparse matrices
        W^1 .. W^L (copied; values are trained on their fixed sparsity pattern).
    biases : list of np.ndarray, optional
        b^1 .. b^L (zeros if omitted); trained like the weights.
    activation : str
        ``"sigmoid"`` or ``"relu"``.
    """

    def __init__(self, weights, biases=None, activation: str = "sigmoid",
                 dtype=np.float64) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.f = ACTIVATIONS[activation]
        self.W = [sp.csr_matrix(W, dtype=dtype, copy=True) for W in weights]
        for W in self.W:
            W.sort_indices()
        self.b = ([np.zeros(W.shape[0], dtype=dtype) for W in self.W] if biases is None
                  else [np.array(b, dtype=dtype, copy=True) for b in biases])
        self.X: list = []
        self.delta: list = []

    def forward(self, X0: np.ndarray) -> np.ndarray:
        """Lines 2-4 of Alg. 1 on a mini-batch; keeps every X^k for the backward pass."""
        self.X = [np.asarray(X0)]
        for W, b in zip(self.W, self.b):
            Z = W @ self.X[-1] + b[:, None]
            self.X.append(self.f.apply(np.asarray(Z)))
        return self.X[-1]

    def backward(self, Y: np.ndarray, lr: float) -> float:
        """Lines 5-9 of Alg. 1 (mini-batch): returns the loss of the last forward pass."""
        L = len(self.W)
        B = Y.shape[1]
        XL = self.X[-1]
        loss = mse_loss(XL, Y)
        delta = (XL - Y) / B * self.f.derivative(XL)  # eq. 6 with J = MSE
        self.delta = [None] * (L + 1)
        self.delta[L] = delta
        for k in range(L, 0, -1):
            W = self.W[k - 1]
            Xprev = self.X[k - 1]
            s = W.T @ delta  # uses W^k before its update (Alg. 3 line 4)
            rows, cols = np.repeat(np.arange(W.shape[0]), np.diff(W.indptr)), W.indices
            grad = np.einsum("ij,ij->i", delta[rows], Xprev[cols])  # eq. 4 on the pattern
            W.data -= lr * grad
            self.b[k - 1] -= lr * delta.sum(axis=1)
            if k > 1:
                delta = s * self.f.derivative(Xprev)  # eq. 7
                self.delta[k - 1] = delta
        return loss

    def step(self, X0: np.ndarray, Y: np.ndarray, lr: float) -> float:
        """One SGD iteration; returns the loss before the update."""
        self.forward(X0)
        return self.backward(Y, lr)


def challenge_inference_serial(weights, bias: float, ymax: float, Y0: np.ndarray) -> np.ndarray:
    """Graph Challenge inference, serial reference: Y <- min(max(Y W + b, 0), ymax).

    ``Y0`` is (num_inputs, N) as in the challenge; ``weights`` are in the paper orientation, so
    the challenge's ``Y W_file`` is ``(W Y^T)^T``.  The bias is added only where Y W != 0.
    """
    Y = sp.csr_matrix(Y0)
    for W in weights:
        Z = sp.csr_matrix(Y @ sp.csr_matrix(W).T)  # structural nonzeros of Y W
        Z.data += bias
        Z.data = np.clip(Z.data, 0.0, ymax)
        Z.eliminate_zeros()
        Y = Z
    return Y


def init_weights(weights, init: str, activation: str, rng: np.random.Generator) -> list:
    """Initial values on the fixed sparsity pattern, the same on every rank.

    ``uniform``: U[-1, 1] (§6.1); ``fan-in``: U[-a, a] with a = sqrt(6 / fan-in) for ReLU
    (He) and sqrt(3 / fan-in) for sigmoid (LeCun), fan-in = nnz of the row; ``challenge``:
    the network's own values.
    """
    out = []
    for W in weights:
        W = sp.csr_matrix(W, copy=True)
        if init == "uniform":
            W.data = rng.uniform(-1.0, 1.0, W.nnz)
        elif init == "fan-in":
            fan_in = np.maximum(np.diff(W.indptr), 1)
            a = np.sqrt((6.0 if activation == "relu" else 3.0) / fan_in)
            W.data = rng.uniform(-1.0, 1.0, W.nnz) * np.repeat(a, np.diff(W.indptr))
        out.append(W)
    return out
