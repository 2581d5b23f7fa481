"""Residuals, stopping rule and layer-wise adaptive penalties of H-SADMM (PruneX §3.4).

Residuals per layer ``l`` (norms are Frobenius):

* intra-node: ``r_intra = theta_ij - z_i`` and ``s_intra = rho1 (z_i^{k+1} - z_i^k)``;
* inter-node: ``r_inter = z_i - z`` and ``s_inter = rho2 (z^{k+1} - z^k)``.

Stopping (Boyd et al. 2011, §3.3.1): ``||r|| <= eps_pri = sqrt(n) eps_abs + eps_rel max(||x||,
||z||)`` and ``||s|| <= eps_dual = sqrt(n) eps_abs + eps_rel ||rho u||``.

Adaptive penalty (Boyd §3.4.1, residual balancing), per layer and independently for ``rho1`` and
``rho2``: ``rho <- tau rho`` if ``||r|| > mu ||s||``, ``rho <- rho / tau`` if ``||s|| > mu ||r||``,
with ``mu = 10``, ``tau = 2``, and ``rho`` capped at ``rho_max = 10``.  Because the duals are
*scaled* (``u = y / rho``), a change of ``rho`` rescales them by ``rho_old / rho_new``; the
function returns that factor.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "RHO_UPDATES",
    "balance_penalty",
    "eps_dual",
    "eps_primal",
    "increase_penalty",
    "penalty_groups",
]

#: ``--rho-update`` rules: Boyd's residual balancing, or a penalty that grows every iteration
RHO_UPDATES = ("balance", "increase")


def balance_penalty(rho, r_norm, s_norm, mu: float = 10.0, tau: float = 2.0,
                    rho_max: float = 10.0, rho_min: float = 1e-8):
    """Residual balancing of layer-wise penalties.

    Parameters
    ----------
    rho, r_norm, s_norm : array_like
        Current penalties and the primal/dual residual norms, one entry per layer.
    mu, tau : float
        Imbalance threshold and multiplicative step (Boyd: 10 and 2).
    rho_max, rho_min : float
        Caps on the penalty.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        New penalties, and the factor ``rho_old / rho_new`` to apply to the scaled duals.
    """
    if mu <= 1 or tau <= 1:
        raise ValueError(f"need mu > 1 and tau > 1 for residual balancing, got mu={mu}, "
                         f"tau={tau}")
    rho = np.asarray(rho, dtype=np.float64)
    r = np.asarray(r_norm, dtype=np.float64)
    s = np.asarray(s_norm, dtype=np.float64)
    new = np.where(r > mu * s, rho * tau, np.where(s > mu * r, rho / tau, rho))
    new = np.clip(new, rho_min, rho_max)
    return new, rho / new


def increase_penalty(rho, tau: float = 2.0, rho_max: float = 10.0):
    """``rho <- min(tau rho, rho_max)`` every iteration, whatever the residuals (the increasing
    penalty of PruneX §4.5: "as the H-SADMM penalty parameters increase ... the sparsity
    patterns naturally stabilize"; from §5.1.5's rho1 = 1.5e-3 the cap 10 is reached after 13
    doublings).  Returns ``(new, rho_old / rho_new)`` as :func:`balance_penalty`."""
    if tau <= 1:
        raise ValueError(f"need tau > 1 for an increasing penalty, got tau={tau}")
    rho = np.asarray(rho, dtype=np.float64)
    new = np.minimum(rho * tau, np.maximum(rho, rho_max))
    return new, rho / new


def eps_primal(n, x_norm, z_norm, eps_abs: float = 1e-4, eps_rel: float = 1e-3):
    """``sqrt(n) eps_abs + eps_rel max(||x||, ||z||)`` per layer."""
    return np.sqrt(np.asarray(n, dtype=np.float64)) * eps_abs + eps_rel * np.maximum(x_norm,
                                                                                      z_norm)


def eps_dual(n, y_norm, eps_abs: float = 1e-4, eps_rel: float = 1e-3):
    """``sqrt(n) eps_abs + eps_rel ||rho u||`` per layer."""
    return np.sqrt(np.asarray(n, dtype=np.float64)) * eps_abs + eps_rel * np.asarray(y_norm)


def penalty_groups(layout, scope: str) -> tuple[list[str], np.ndarray]:
    """``(group names, group index of every tensor)`` for the adaptive penalties.

    ``scope="layer"`` (PruneX §3.4, layer-wise ``rho^l``): tensors named ``<layer>.<param>``
    share the group ``<layer>``; ``"tensor"``: one group per tensor.
    """
    names = list(layout.names)
    keys = names if scope == "tensor" else [n.rsplit(".", 1)[0] for n in names]
    groups = list(dict.fromkeys(keys))
    index = {g: i for i, g in enumerate(groups)}
    return groups, np.array([index[k] for k in keys], dtype=np.int64)
