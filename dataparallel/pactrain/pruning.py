"""PacTrain's pruning (paper 002, §III-D, Alg. 1 l. 2): GraSP scores and the per-layer mask.

The GraSP score of eq. 4, ``S = −θ ⊙ (H ∇ℓ)``, with ``H ∇ℓ`` a central finite difference of
gradients (:func:`hessian_vector_fd`), ranked by ``|S|`` (``grasp-abs``), ``−S`` (GraSP's own
rule) or ``|θ|`` (``magnitude``, :func:`prune_importance`); every conv and fc weight tensor
keeps ``n_l − ⌊r n_l⌋`` entries, ranked per layer (:func:`prune_mask`), so ``K`` is known from
the layout.  Biases and BatchNorm parameters are never pruned (:data:`PRUNABLE_KINDS`).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "GRASP_REL_STEP",
    "GRASP_SAMPLES",
    "PRUNABLE_KINDS",
    "PRUNE_SCORES",
    "grasp_score",
    "hessian_vector_fd",
    "prunable_flags",
    "prune_importance",
    "prune_mask",
]

#: ``--prune-score`` choices: keep the largest ``|S|`` (eq. 4), GraSP's rule (remove the highest
#: ``S``), keep the largest ``|θ|``.
PRUNE_SCORES = ("grasp-abs", "grasp", "magnitude")
#: Parameter kinds that are pruned (biases and BatchNorm parameters are kept whole).
PRUNABLE_KINDS = ("conv", "fc")
#: Samples of each rank's shard used for the GraSP gradient and Hessian-vector product.
GRASP_SAMPLES = 256
#: Finite-difference step of ``H v``: ``ε = GRASP_REL_STEP · max(‖θ‖, 1) / ‖v‖``.
GRASP_REL_STEP = 1e-3


def prunable_flags(layout) -> np.ndarray:
    """Flat bool vector: ``True`` on the entries of conv and fc weight tensors."""
    return layout.expand({n: float(layout.kind(n) in PRUNABLE_KINDS) for n in layout.names},
                         dtype=np.float64) > 0


def prune_mask(importance, layout, ratio: float, zero=None) -> np.ndarray:
    """Per-layer pruning mask: each conv/fc tensor keeps its ``n_l − ⌊r n_l⌋`` entries of
    highest ``importance``; other tensors are kept whole.

    Parameters
    ----------
    importance : array (T,)
        Higher is more important (``|θ|`` for magnitude pruning, ``−S`` for GraSP, eq. 4).
    layout : ParamLayout
    ratio : float
        ``r`` in ``[0, 1)``.
    zero : bool array (T,), optional
        Entries that are already exactly zero: ranked below every other entry.

    Returns
    -------
    numpy.ndarray of bool (T,)
        Ties are broken towards the lower flat index (stable sort), so the mask is the same on
        every rank given the same scores.
    """
    imp = np.asarray(importance.get() if hasattr(importance, "get") else importance,
                     dtype=np.float64)
    if zero is not None:
        z = np.asarray(zero.get() if hasattr(zero, "get") else zero, dtype=bool)
        imp = np.where(z, -np.inf, imp)
    mask = np.ones(layout.total, dtype=bool)
    for name in layout.names:
        if layout.kind(name) not in PRUNABLE_KINDS:
            continue
        sl = layout.slice(name)
        n = sl.stop - sl.start
        drop = math.floor(ratio * n)
        if drop == 0:
            continue
        order = np.argsort(-imp[sl], kind="stable")  # most important first
        seg = np.zeros(n, dtype=bool)
        seg[order[:n - drop]] = True
        mask[sl] = seg
    return mask


def hessian_vector_fd(grad_fn, theta, v, eps: float):
    """Central finite difference ``H v ≈ (∇ℓ(θ + εv) − ∇ℓ(θ − εv)) / (2ε)`` (for eq. 4).

    Parameters
    ----------
    grad_fn : callable(theta) -> gradient (same shape)
    theta, v : arrays
    eps : float
        Step ``ε > 0`` (exact for a quadratic loss up to rounding).
    """
    if not eps > 0:
        raise ValueError(f"finite-difference step must be > 0, got {eps}")
    gp = grad_fn(theta + eps * v)
    gm = grad_fn(theta - eps * v)
    return (gp - gm) / (2 * eps)


def grasp_score(theta, hv):
    """GraSP score, paper eq. 4: ``S = −θ ⊙ (H ∇ℓ(θ))``; GraSP removes the largest ``S``."""
    return -theta * hv


def prune_importance(kind: str, theta, score=None):
    """Importance for :func:`prune_mask` (higher is kept) under ``--prune-score kind``:
    ``grasp``: ``−S`` (GraSP's rule: the entries of highest score ``S`` of eq. 4 are removed),
    ``grasp-abs``: ``|S|``, ``magnitude``: ``|θ|``."""
    if kind == "magnitude":
        return abs(theta)
    if score is None:
        raise ValueError(f"--prune-score {kind} needs the GraSP score S (eq. 4)")
    if kind == "grasp":
        return -score
    if kind == "grasp-abs":
        return abs(score)
    raise ValueError(f"--prune-score {kind!r} unknown; use one of {PRUNE_SCORES}")
