"""Central differences for the gradient tests (one definition, shared by the layer tests)."""

from __future__ import annotations


def central_difference(vec, i, loss, eps):
    """``(loss(vec + eps e_i) - loss(vec - eps e_i)) / 2 eps``, restoring ``vec[i]``."""
    old = vec[i]
    vec[i] = old + eps
    lp = loss()
    vec[i] = old - eps
    lm = loss()
    vec[i] = old
    return (lp - lm) / (2 * eps)
