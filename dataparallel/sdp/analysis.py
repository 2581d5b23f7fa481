"""What SDP reports about its mask (paper 003): per-worker memory (§3.2) and the spectral gap
ρ of the masking operator (eq. 1)."""

from __future__ import annotations

import numpy as np

from .plan import SDPPlan

__all__ = ["spectral_gap", "worker_memory"]


def worker_memory(plan: SDPPlan, itemsize: int = 4, momentum: bool = True) -> dict:
    """Per-worker bytes of parameters + gradients + optimizer momentum, and DDP's (§3.2).

    Forward masking materialises only worker ``i``'s ``N_i`` coordinates:
    ``itemsize (2 + s) N_i`` (``s = 1`` with momentum); backward masking keeps the full
    parameters for its full forward pass: ``itemsize (T + (1 + s) N_i)``; DDP holds
    ``itemsize (2 + s) T`` (= 3 × 4 × T for float32 SGD with momentum).
    """
    T, s = plan.total, int(bool(momentum))
    held = [plan.held(r) for r in range(plan.n)]
    if plan.mode == "block-backward":
        mem = [itemsize * (T + (1 + s) * h) for h in held]
    else:
        mem = [itemsize * (2 + s) * h for h in held]
    ddp = itemsize * (2 + s) * T
    return {"memory_bytes": mem, "memory_ddp_bytes": ddp,
            "memory_ratio_mean": float(np.mean(mem) / ddp),
            "memory_ratio_max": float(max(mem) / ddp),
            "held_fraction": [h / T for h in held]}


def spectral_gap(mask) -> float:
    """Spectral gap ρ of the masking operator, eq. (1) of paper 003, from a mask matrix.

    Parameters
    ----------
    mask : array (n, |J|) of bool / 0-1
        ``m_ij = 1`` when worker ``i`` holds coordinate ``j``; every column needs ``d_j >= 1``.

    Returns
    -------
    float
        ``ρ = sup ||m̄(g)||`` over ``Σ_i ||g_i||² <= 1`` with ``m̄_uni(g) = 0``.  The operator
        acts column by column, so it is block diagonal over the coordinates: block ``j`` is the
        functional ``a_jᵀ = m_{:,j}ᵀ / d_j`` on ``1^⊥`` and ρ is the largest singular value
        of the blocks ``a_jᵀ (I - 11ᵀ/n)`` (equal columns give equal blocks, so only distinct
        columns are evaluated).  Closed form for comparison: ``sqrt(1/min_j d_j - 1/n)``.
    """
    m = np.asarray(mask).astype(bool)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"mask must be a non-empty (n, |J|) matrix, got shape {m.shape}")
    cols = np.unique(m, axis=1)
    d = cols.sum(axis=0)
    if (d == 0).any():
        raise ValueError("a coordinate has no holder (d_j = 0); the gated average needs "
                         "d_j >= 1 for every j")
    a = cols.T / d[:, None]                        # rows a_jᵀ, k × n
    blocks = a - a.mean(axis=1, keepdims=True)     # a_jᵀ (I - 11ᵀ/n)
    sv = [np.linalg.svd(row[None, :], compute_uv=False)[0] for row in blocks]
    return float(max(sv))
