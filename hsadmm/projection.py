"""Euclidean projections onto the structured sparsity sets of PruneX §2.1 (eq. 10).

For a convolution weight ``W`` of shape ``(C_out, C_in, K_H, K_W)``:

* filter set ``S_f = {W : ||m_f||_0 <= alpha_out}`` with ``(m_f)_k = ||W[k, :, :, :]||_F``;
* channel set ``S_c = {W : ||m_c||_0 <= alpha_in}`` with ``(m_c)_k = ||W[:, k, :, :]||_F``;
* shape set ``S_s = {W : ||vec(M_s)||_0 <= alpha_kern}`` with ``(M_s)_{b,u,v} = ||W[:, b, u, v]||_F``.

Each set is a union of subspaces indexed by a group support, so the closest point in Frobenius
norm keeps the ``alpha`` groups of largest norm and zeroes the others (ties broken by the lower
index, deterministically on every rank).  Intersections are projected by applying the individual
projections in sequence (filter, then channel, then shape), as PruneX does.

Fully connected weights ``(d_out, d_in)`` are treated as ``(d_out, d_in, 1, 1)`` when a caller
chooses to prune them; PruneX keeps FC layers dense.
"""

from __future__ import annotations

import math

from substrate.backend import array_module

__all__ = [
    "SPARSITY_KINDS",
    "keep_count",
    "parse_sparsity",
    "project",
    "structured_mask",
]

#: Group axes kept by each elementary set (the complementary axes are reduced in the norm).
_GROUP_AXES = {"filter": (0,), "channel": (1,), "shape": (1, 2, 3)}
SPARSITY_KINDS = ("filter", "channel", "shape")


def parse_sparsity(spec: str) -> tuple[str, ...]:
    """Parse ``"channel"``, ``"filter+channel"``, ... into a tuple in projection order.

    Raises
    ------
    ValueError
        For an unknown set name (the message lists the valid ones).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--sparsity must be a name like 'channel' or 'filter+channel', got "
                         f"{spec!r}")
    parts = [p.strip() for p in spec.split("+")]
    bad = [p for p in parts if p not in SPARSITY_KINDS]
    if bad:
        raise ValueError(f"unknown sparsity {bad[0]!r} in --sparsity {spec!r}; valid sets: "
                         f"{', '.join(SPARSITY_KINDS)} and intersections joined by '+', "
                         "e.g. filter+channel")
    if len(set(parts)) != len(parts):
        raise ValueError(f"--sparsity {spec!r} repeats a set")
    return tuple(k for k in SPARSITY_KINDS if k in parts)


def keep_count(keep: float, n: int) -> int:
    """Number of groups ``alpha`` kept out of ``n`` at rate ``keep``: ``keep * n`` rounded to
    the nearest integer, ties up (keep 0.5 of 9 keeps 5), at least 1 and at most ``n``.

    PruneX gives only the rate (§5.1.5: "keep rate 0.5, i.e. 50 % channel density"); ties up
    keeps the majority of an odd count, and round-half-to-even (keep 0.5 of 9 keeps 4, of 11
    keeps 6) is not used because it rounds ties in both directions.

    Raises
    ------
    ValueError
        If ``keep`` is outside ``(0, 1]``.
    """
    if not (isinstance(keep, (int, float)) and 0.0 < keep <= 1.0):
        raise ValueError(f"keep rate must be in (0, 1], got {keep!r}; e.g. --keep 0.5 keeps half "
                         "of the filters/channels")
    return max(1, min(n, math.floor(keep * n + 0.5)))


def _as4d(w):
    if w.ndim == 4:
        return w
    if w.ndim == 2:
        return w.reshape(w.shape[0], w.shape[1], 1, 1)
    raise ValueError(f"structured projection needs a conv (4-D) or FC (2-D) weight, got shape "
                     f"{w.shape}")


def _group_keep(w4, kind: str, keep: float):
    """Boolean array over the groups of ``kind`` marking the ``alpha`` largest-norm groups."""
    xp = array_module(w4)
    axes = _GROUP_AXES[kind]
    reduce_axes = tuple(a for a in range(4) if a not in axes)
    norms = xp.sqrt(xp.sum(w4.astype(xp.float64) ** 2, axis=reduce_axes))
    flat = norms.ravel()
    alpha = keep_count(keep, flat.size)
    # stable descending order: ties keep the lower index (identical on every rank)
    order = xp.argsort(-flat, kind="stable")
    kept = xp.zeros(flat.size, dtype=bool)
    kept[order[:alpha]] = True
    return kept.reshape(norms.shape), axes


def _expand(kept, axes, shape4):
    """Broadcastable view of a group mask over the full 4-D weight."""
    return kept.reshape([shape4[a] if a in axes else 1 for a in range(4)])


def structured_mask(w, kinds: tuple[str, ...], keep: float):
    """Boolean mask (shape of ``w``) of ``Pi_S(w)``'s support for ``S = ∩ kinds`` (sequential)."""
    w4 = _as4d(w)
    xp = array_module(w)
    mask = xp.ones(w4.shape, dtype=bool)
    cur = w4
    for kind in kinds:
        kept, axes = _group_keep(cur, kind, keep)
        mask &= _expand(kept, axes, w4.shape)
        cur = xp.where(mask, w4, 0)
    return mask.reshape(w.shape)


def project(w, kinds: tuple[str, ...], keep: float):
    """``Pi_S(w)`` for ``S`` the intersection of ``kinds`` at keep rate ``keep`` (eq. 10)."""
    xp = array_module(w)
    return xp.where(structured_mask(w, kinds, keep), w, 0).astype(w.dtype, copy=False)
