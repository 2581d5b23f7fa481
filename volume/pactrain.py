"""Closed-form communication volume of PacTrain (paper 002), one training step.

All ranks are laid out node-major: ``M`` nodes × ``P`` ranks, ``p = M P``; a ring over all ranks
crosses nodes on ``M`` of its ``p`` links (none when ``M = 1``).  ``T`` is the parameter count,
``K`` the number of entries kept by the mask (conv/fc survivors plus every bias/BN entry),
``w = itemsize`` (4 for float32).

=====================  ===================================  ======================================
phase                  call (when)                          bytes on the wire per step
=====================  ===================================  ======================================
``dense_allreduce``    ring all-reduce per gradient bucket  ``Σ_b 2 (p-1) · w n_b`` (``Σ n_b = T``),
                       (warm-up, and while the mask is      the same as DDP
                       unstable)
``packed_allreduce``   ring all-reduce of the packed        ``Σ_c 2 (p-1) · w k_c`` (``Σ k_c = K``)
                       survivors, chunks of ≤ one bucket
                       (mask stable, float)
``ternary_scale``      ring MAX all-reduce of the ``L``     ``2 (p-1) · w L`` (``L`` = tensors, or
                       scales ``s`` (mask stable,           1 with ``--ternary-scale global``)
                       ``--ternary``)
``ternary_allgather``  ring all-gather of every rank's      every link ``(p-1) · ⌈K/4⌉``
                       2-bit codes (mask stable,
                       ``--ternary``)
``grasp_allreduce``    two ring all-reduces of ``T``        ``2 · 2 (p-1) · w T`` (once, at the
                       (``∇ℓ`` and ``H∇ℓ``, pruning step)   pruning step)
=====================  ===================================  ======================================

Every ring total is exact for any element count; the intra/inter split follows the ring's
chunking exactly (:func:`volume.dataparallel.world_ring_bytes`); when ``p`` divides the count
``n`` the inter-node share is ``M · 2 (p-1)/p · w n``.  The ternary all-gather moves
``(p-1) ⌈K/4⌉`` bytes per link versus ``2 (p-1)/p · w K`` for the packed float all-reduce, so it
is the smaller of the two while ``p < 8 w`` (32 ranks for float32).

Per-bucket masks (Algorithm 1, l. 6-11: ``foreach update ∈ model_updates``): with one mask
tracker per gradient bucket ``b`` (``n_b`` entries, ``K_b = Σ_{l ∈ b} K_l`` kept), a stable
bucket sends one all-reduce of ``K_b`` (or TernGrad's scales and ``⌈K_b/4⌉`` code bytes), an
unstable one its ``n_b`` (:func:`bucketed_step_bytes`).  A tensor of ``n_l`` entries pruned at
ratio ``r`` keeps ``K_l = n_l − ⌊r n_l⌋`` (:func:`kept_count`); the mask is stable
``W = --stable-window`` comparisons after pruning at step ``w``, so steps ``< w + W`` are dense
(:func:`is_dense_step`).
"""

from __future__ import annotations

import math

from .dataparallel import ddp_step_bytes, world_allgather_bytes, world_ring_bytes
from .hsadmm import add_bytes

__all__ = [
    "STEP_MODES",
    "bucketed_step_bytes",
    "dense_allreduce_bytes",
    "grasp_score_bytes",
    "is_dense_step",
    "kept_count",
    "packed_allreduce_bytes",
    "packed_chunks",
    "packed_payload_ratio",
    "pactrain_step_bytes",
    "ternary_bytes",
    "ternary_code_bytes",
]

#: What one synchronization step does: ``dense`` (warm-up or unstable mask), ``packed``
#: (float all-reduce of the survivors) or ``ternary`` (2-bit all-gather of the survivors).
STEP_MODES = ("dense", "packed", "ternary")


def packed_chunks(kept: int, bucket_elems: int) -> list[int]:
    """Element counts of the packed vector's all-reduce chunks: ``⌈K / B⌉`` contiguous chunks of
    at most ``B = bucket_elems`` elements (the last one shorter); no chunk when ``K = 0``."""
    if bucket_elems < 1:
        raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems}")
    kept = int(kept)
    return [min(bucket_elems, kept - a) for a in range(0, kept, bucket_elems)]


def dense_allreduce_bytes(*, M: int, P: int, bucket_sizes, itemsize: int = 4) -> dict:
    """Dense gradient averaging (paper eq. 1): one ring all-reduce per bucket over all ranks.

    Wire bytes ``Σ_b 2 (p-1) · itemsize · n_b`` (exact per link class), identical to DDP's.

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    bucket_sizes : sequence of int
        Element count ``n_b`` of every gradient bucket (they sum to ``T``).
    itemsize : int
        Bytes per gradient element.

    Returns
    -------
    dict
        ``{"intra": bytes, "inter": bytes}``.
    """
    return ddp_step_bytes(M=M, P=P, bucket_sizes=bucket_sizes, itemsize=itemsize)["grad_allreduce"]


def packed_allreduce_bytes(*, M: int, P: int, kept: int, bucket_elems: int,
                           itemsize: int = 4) -> dict:
    """Compact all-reduce of the ``K`` surviving gradient entries (paper §III-C, Alg. 1 l. 9-11).

    Every rank packs ``g[idx]`` (the same index set everywhere, so no indices travel) and the
    packed vector is averaged by ring all-reduces of :func:`packed_chunks` (``kept`` = ``K``,
    chunks of ``bucket_elems``; other parameters as :func:`dense_allreduce_bytes`):
    ``Σ_c 2 (p-1) · itemsize · k_c = 2 (p-1) · itemsize · K`` bytes in total.
    """
    return dense_allreduce_bytes(M=M, P=P, bucket_sizes=packed_chunks(kept, bucket_elems),
                                 itemsize=itemsize)


def ternary_code_bytes(kept: int) -> int:
    """Bytes of one rank's 2-bit codes for ``K`` ternary values, 4 per byte: ``⌈K/4⌉``."""
    return math.ceil(int(kept) / 4)


def ternary_bytes(*, M: int, P: int, kept: int, scales: int = 1,
                  itemsize: int = 4) -> dict[str, dict]:
    """TernGrad on the packed vector (paper §III-D, eq. 3), one step.

    The shared scales ``s_l = max_j max|g_{j,l}|`` (one per tensor ``l``, or one in all) are one
    ring MAX all-reduce of ``L = scales`` elements (``2 (p-1) · itemsize · L`` bytes); a sum
    all-reduce of 2-bit codes is not closed, so every
    rank's ``⌈K/4⌉`` code bytes are all-gathered (ring: ``(p-1) ⌈K/4⌉`` bytes on each of the ``p``
    links) and every rank decodes and averages.

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    kept : int
        ``K``, the length of the packed vector.
    scales : int
        ``L``, the number of scales.
    itemsize : int
        Bytes of one scale (the gradient's element size).

    Returns
    -------
    dict
        ``{"ternary_scale": {...}, "ternary_allgather": {...}}``.
    """
    return {"ternary_scale": world_ring_bytes(scales, itemsize, M, P),
            "ternary_allgather": world_allgather_bytes(ternary_code_bytes(kept), M, P)}


def grasp_score_bytes(*, M: int, P: int, total: int, itemsize: int = 4) -> dict:
    """GraSP score (paper eq. 4) at the pruning step: the gradient ``v = ∇ℓ`` and the
    finite-difference ``H v`` are each averaged by one ring all-reduce of ``T`` elements:
    ``2 · 2 (p-1) · itemsize · T`` bytes."""
    one = world_ring_bytes(total, itemsize, M, P)
    return add_bytes(one, one)


def pactrain_step_bytes(*, M: int, P: int, mode: str, bucket_sizes, kept: int,
                        bucket_elems: int, itemsize: int = 4, scales: int = 1,
                        grasp_total: int | None = None) -> dict[str, dict]:
    """Per-phase wire bytes of one PacTrain step (the module table).

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    mode : {"dense", "packed", "ternary"}
        What the step's synchronization did (:data:`STEP_MODES`).
    bucket_sizes : sequence of int
        Dense gradient buckets (element counts, summing to ``T``).
    kept : int
        ``K``, the entries the current mask keeps (used by the packed modes).
    bucket_elems : int
        Chunk length of the packed all-reduce.
    itemsize : int
        Bytes per gradient element.
    scales : int
        TernGrad scales per step (``mode="ternary"``).
    grasp_total : int, optional
        ``T`` when this step also computed the GraSP pruning score.

    Returns
    -------
    dict
        ``{phase: {"intra": bytes, "inter": bytes}}`` for every phase the step calls (zero
        bytes on one rank), as the ledger lists them; no all-reduce phase without a bucket or
        chunk to reduce.
    """
    if mode not in STEP_MODES:
        raise ValueError(f"unknown PacTrain step mode {mode!r}; use one of {STEP_MODES}")
    if mode == "dense":
        out = {"dense_allreduce": dense_allreduce_bytes(M=M, P=P, bucket_sizes=bucket_sizes,
                                                        itemsize=itemsize)}
    elif mode == "packed":
        out = {"packed_allreduce": packed_allreduce_bytes(M=M, P=P, kept=kept,
                                                          bucket_elems=bucket_elems,
                                                          itemsize=itemsize)}
    else:
        out = ternary_bytes(M=M, P=P, kept=kept, scales=scales, itemsize=itemsize)
    if grasp_total is not None:
        out["grasp_allreduce"] = grasp_score_bytes(M=M, P=P, total=grasp_total,
                                                   itemsize=itemsize)
    called = {"dense_allreduce": len(bucket_sizes) > 0,
              "packed_allreduce": len(packed_chunks(kept, bucket_elems)) > 0}
    return {k: v for k, v in out.items() if called.get(k, True)}


def packed_payload_ratio(*, kept: int, total: int, ternary: bool, scales: int = 1,
                         itemsize: int = 4) -> float:
    """Payload one rank contributes per packed step relative to the dense ``itemsize · T``:
    ``K / T`` for the float all-reduce, ``(⌈K/4⌉ + itemsize · L) / (itemsize · T)`` for the
    ternary codes plus the ``L`` scales."""
    dense = itemsize * int(total)
    if ternary:
        return (ternary_code_bytes(kept) + itemsize * int(scales)) / dense
    return itemsize * int(kept) / dense


def kept_count(n: int, prune_ratio: float) -> int:
    """``K_l = n_l − ⌊r n_l⌋``: entries of a tensor of ``n_l`` entries left by unstructured
    pruning at ratio ``r`` (paper §III-C, "pruning ratio"; ``r = 0`` for a tensor that is not
    pruned)."""
    return int(n) - math.floor(float(prune_ratio) * int(n))


def is_dense_step(step: int, warmup_steps: int, stable_window: int) -> bool:
    """Whether ``step`` synchronizes densely (Algorithm 1 l. 8-11 "else Perform All-reduce"):
    pruning happens before step ``w``, the mask tracker first sees the pruned mask at step ``w``
    and calls it stable after ``W`` unchanged comparisons, i.e. from step ``w + W`` on."""
    return int(step) < int(warmup_steps) + int(stable_window)


def bucketed_step_bytes(*, M: int, P: int, buckets, mode: str, scope: str = "bucket",
                        bucket_elems: int = 1 << 23, per_tensor_scales: bool = True,
                        itemsize: int = 4) -> dict[str, dict]:
    """Per-phase bytes of one PacTrain step from the layer shapes and pruning ratios.

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    buckets : sequence of sequence of (int, float)
        DDP's gradient buckets, each a list of its tensors' ``(n_l, r_l)``: entries and pruning
        ratio (0 for biases and BatchNorm parameters).
    mode : {"dense", "packed", "ternary"}
        What every mask unit does this step.
    scope : {"bucket", "global"}
        One mask tracker per bucket (Algorithm 1): a packed bucket is one all-reduce of its
        ``K_b``; or one for the whole gradient: the ``K = Σ_b K_b`` survivors in chunks of
        ``bucket_elems`` (:func:`packed_chunks`).  Dense steps all-reduce every bucket's ``n_b``
        either way.
    per_tensor_scales : bool
        TernGrad: one scale per tensor of the unit, else one per unit.
    itemsize : int
        Bytes per gradient element.
    """
    if mode not in STEP_MODES:
        raise ValueError(f"unknown PacTrain step mode {mode!r}; use one of {STEP_MODES}")
    if scope not in ("bucket", "global"):
        raise ValueError(f"unknown mask scope {scope!r}; use bucket or global")
    n_b = [sum(int(n) for n, _ in b) for b in buckets]
    K_b = [sum(kept_count(n, r) for n, r in b) for b in buckets]
    L_b = [len(b) for b in buckets]
    if mode == "dense":
        return pactrain_step_bytes(M=M, P=P, mode="dense", bucket_sizes=n_b, kept=0,
                                   bucket_elems=1, itemsize=itemsize)
    if scope == "global":
        units = [(sum(K_b), sum(L_b) if per_tensor_scales else 1)]
        if mode == "packed":
            return pactrain_step_bytes(M=M, P=P, mode="packed", bucket_sizes=n_b,
                                       kept=units[0][0], bucket_elems=bucket_elems,
                                       itemsize=itemsize)
    else:
        units = [(k, L if per_tensor_scales else 1) for k, L in zip(K_b, L_b)]
    parts = []
    for k, L in units:
        if mode == "packed":        # one all-reduce of K_b per bucket (none when K_b = 0)
            parts.append(pactrain_step_bytes(M=M, P=P, mode="packed", bucket_sizes=[k],
                                             kept=k, bucket_elems=max(k, 1), itemsize=itemsize))
        else:
            parts.append(ternary_bytes(M=M, P=P, kept=k, scales=L, itemsize=itemsize))
    out: dict = {}
    for part in parts:
        for phase, v in part.items():
            out[phase] = add_bytes(out[phase], v) if phase in out else v
    return out
