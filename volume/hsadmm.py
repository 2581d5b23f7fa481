"""Closed-form communication volume of H-SADMM and flat ADMM (PruneX Algorithm 1).

One outer iteration of H-SADMM on ``M`` nodes × ``P`` ranks (node-major) with ``T`` float32
parameters, per-layer compact sizes from the global masks, and ``B`` packed mask bytes:

=============  ==========================  ===========================================
phase          call                        bytes on the wire (per iteration)
=============  ==========================  ===========================================
intra_allreduce  ring all-reduce of θ+u     ``M · 2 (P-1) · 4T``  (intra, any T and P)
mask_sync      ring OR all-reduce, leaders  ``2 (M-1) · B``        (inter; until frozen)
mask_bcast     binomial bcast in each node  ``M (P-1) · B``        (intra; until frozen)
inter_allreduce  ring all-reduce per bucket  ``2 (M-1) · 4C``       (inter; C = compact size)
bcast_z        binomial bcast of compact z  ``M (P-1) · 4C``       (intra)
residuals      ring all-reduce (world)      ``2 (p-1) · 8·9L`` total (9 float64 per layer)
=============  ==========================  ===========================================

The ring totals are exact for any element count (``2 (p-1) n``: every rank sends all chunks
but two, and each chunk is left out twice); world-level rings are split into intra/inter exactly
with the node-major ring's chunking: the ``M`` links ``i = mP - 1`` cross nodes and link ``i``
carries ``2n - c_{(i+1)%p} - c_{(i+2)%p}`` elements (``numpy.array_split`` chunk sizes ``c``),
which is ``M · 2(p-1)/p · n`` inter bytes only when ``p`` divides the element count.

:func:`hsadmm_eq15_iteration_bytes` is the same table written from the paper alone, from layer
shapes and keep rates (a second source for the solver's shrink plan): every conv weight
``(C_out, C_in, K_H, K_W)`` travels as ``|K_out| x |K_in| x K_H x K_W`` (eq. 15) with the set
sizes of :func:`eq15_kept_sets`, every other tensor whole; ``B = ceil(sum of conv numel / 8)``.

Flat ADMM ("PruneX (AR)") all-reduces θ+u densely over all ``p = M P`` ranks every iteration:
``Σ_m (2T - c_{mP%p} - c_{(mP+1)%p}) · 4`` inter-node bytes (``M · 2(p-1)/p · 4T`` when ``p``
divides ``T``).
"""

from __future__ import annotations

import numpy as np

from . import collectives as cm

__all__ = [
    "RESIDUALS_PER_LAYER",
    "add_bytes",
    "eq15_compact_elems",
    "eq15_kept_sets",
    "flat_admm_iteration_bytes",
    "hsadmm_eq15_iteration_bytes",
    "hsadmm_iteration_bytes",
    "kept_groups",
]

#: float64 sums of squares reduced per layer and iteration for residuals and stopping thresholds
RESIDUALS_PER_LAYER = 9


def add_bytes(*parts: dict) -> dict:
    """Sum ``{"intra": .., "inter": ..}`` dicts."""
    return {cm.INTRA: sum(p[cm.INTRA] for p in parts), cm.INTER: sum(p[cm.INTER] for p in parts)}


def _world_ring(count: int, itemsize: int, M: int, P: int) -> dict:
    """Node-major ring over all ``M P`` ranks: exact per-class split for any ``count``."""
    return cm.ring_allreduce_split(count, itemsize, np.arange(M * P) // P)


def hsadmm_iteration_bytes(*, M: int, P: int, total_params: int, compact_sizes,
                           mask_bytes: int, mask_synced: bool, num_layers: int,
                           itemsize: int = 4) -> dict[str, dict]:
    """Per-phase wire bytes of one H-SADMM iteration (see the module table).

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    total_params : int
        ``T``, the length of the flat parameter vector.
    compact_sizes : sequence of int
        Element count of each bucket of the compact inter-node buffer (their sum is ``C``).
    mask_bytes : int
        Packed global-mask bytes ``B`` (0 when no layer is pruned).
    mask_synced : bool
        Whether this iteration still synchronizes masks (before freezing).
    num_layers : int
        Tensors whose residuals are reduced (:data:`RESIDUALS_PER_LAYER` float64 each).

    Returns
    -------
    dict
        ``{phase: {"intra": bytes, "inter": bytes}}`` for every phase the iteration calls, as
        the ledger lists them: with zero bytes where the communicator has one rank (one node:
        the leaders' all-reduces; one rank per node: the node rings and broadcasts).
    """
    out: dict[str, dict] = {}
    # one ring per node, all links intra: 2 (P-1) · itemsize · T exactly, for any T and P
    intra_one = cm.ring_allreduce_wire_bytes(total_params * itemsize, P, 0, itemsize)
    out["intra_allreduce"] = {cm.INTRA: M * intra_one[cm.INTRA], cm.INTER: 0}
    if mask_synced:  # a ring of M leaders (one per node): all links inter; the solver syncs
        # even an empty mask buffer (no pruned layer: B = 0)
        out["mask_sync"] = {cm.INTRA: 0, cm.INTER: 2 * (M - 1) * mask_bytes}
        out["mask_bcast"] = {cm.INTRA: M * (P - 1) * mask_bytes, cm.INTER: 0}
    C = int(sum(compact_sizes))
    if len(compact_sizes):  # one leaders' ring per bucket
        out["inter_allreduce"] = {cm.INTRA: 0, cm.INTER: 2 * (M - 1) * itemsize * C}
    out["bcast_z"] = {cm.INTRA: M * (P - 1) * itemsize * C, cm.INTER: 0}
    out["residuals"] = _world_ring(RESIDUALS_PER_LAYER * num_layers, 8, M, P)
    return out


def flat_admm_iteration_bytes(*, M: int, P: int, total_params: int, num_layers: int,
                              itemsize: int = 4) -> dict[str, dict]:
    """Per-phase wire bytes of one flat-ADMM iteration (dense world all-reduce of θ+u), both
    phases listed (zero bytes on one rank), as the ledger lists them."""
    out = {"world_allreduce": _world_ring(total_params, itemsize, M, P)}
    out["residuals"] = _world_ring(RESIDUALS_PER_LAYER * num_layers, 8, M, P)
    return out


def kept_groups(keep: float, n: int) -> int:
    """``alpha``: the groups of ``n`` a keep rate keeps (§2.1, §5.1.5 "keep rate 0.5, i.e. 50 %
    density"): ``keep n`` rounded to the nearest integer, ties up, between 1 and ``n``."""
    return max(1, min(int(n), int(np.floor(keep * n + 0.5))))


def eq15_kept_sets(shape, keep: float, sparsity: str) -> tuple[int, int]:
    """``(|K_out|, |K_in|)`` of eq. 15 for a conv weight ``(C_out, C_in, K_H, K_W)`` pruned to
    ``sparsity`` (``channel``, ``filter``, ``shape`` or an intersection ``a+b``) at ``keep``.

    Filter sparsity keeps ``alpha(C_out)`` filters, channel sparsity ``alpha(C_in)`` input
    channels; shape sparsity keeps ``alpha(C_in K_H K_W)`` kernel columns ``(c, h, w)`` with all
    filters, which touch at most that many of the live input channels (the widest ``K_in``: the
    columns spread over the channels).
    """
    c_out, c_in, kh, kw = (int(x) for x in shape)
    kinds = set(sparsity.split("+"))
    k_out = kept_groups(keep, c_out) if "filter" in kinds else c_out
    k_in = kept_groups(keep, c_in) if "channel" in kinds else c_in
    if "shape" in kinds:
        k_in = min(k_in, kept_groups(keep, c_in * kh * kw))
    return k_out, k_in


def eq15_compact_elems(layers, keep: float, sparsity: str, keep_overrides=None) -> int:
    """``C``: elements of one leader's compact buffer, ``sum |K_out| |K_in| K_H K_W`` over the
    conv weights plus every other tensor whole.

    ``layers`` holds ``(name, kind, shape)`` per tensor (``kind == "conv"`` is pruned);
    ``keep_overrides`` maps conv names to their own keep rate.
    """
    over = keep_overrides or {}
    total = 0
    for name, kind, shape in layers:
        if kind == "conv":
            k_out, k_in = eq15_kept_sets(shape, over.get(name, keep), sparsity)
            total += k_out * k_in * int(np.prod(shape[2:], dtype=np.int64))
        else:
            total += int(np.prod(shape, dtype=np.int64))
    return total


def hsadmm_eq15_iteration_bytes(*, M: int, P: int, layers, keep: float, sparsity: str,
                                mask_synced: bool, num_groups: int, keep_overrides=None,
                                itemsize: int = 4) -> dict[str, dict]:
    """Per-phase wire bytes of one H-SADMM iteration from layer shapes and keep rates alone
    (Algorithm 1 lines 9, 20, 23, 27; eq. 15), for masks on which all nodes agree.

    Ring all-reduce of ``n`` bytes over ``p`` ranks: ``2 (p-1) n``; binomial broadcast of ``n``
    bytes to ``p`` ranks: ``(p-1) n``.  ``num_groups`` penalty groups reduce
    :data:`RESIDUALS_PER_LAYER` float64 each over the world.
    """
    T = sum(int(np.prod(shape, dtype=np.int64)) for _, _, shape in layers)
    C = eq15_compact_elems(layers, keep, sparsity, keep_overrides)
    conv_bits = sum(int(np.prod(shape, dtype=np.int64)) for _, kind, shape in layers
                    if kind == "conv")
    B = -(-conv_bits // 8)
    out = {"intra_allreduce": {cm.INTRA: M * 2 * (P - 1) * itemsize * T, cm.INTER: 0}}
    if mask_synced:
        out["mask_sync"] = {cm.INTRA: 0, cm.INTER: 2 * (M - 1) * B}
        out["mask_bcast"] = {cm.INTRA: M * (P - 1) * B, cm.INTER: 0}
    out["inter_allreduce"] = {cm.INTRA: 0, cm.INTER: 2 * (M - 1) * itemsize * C}
    out["bcast_z"] = {cm.INTRA: M * (P - 1) * itemsize * C, cm.INTER: 0}
    out["residuals"] = _world_ring(RESIDUALS_PER_LAYER * num_groups, 8, M, P)
    return out
