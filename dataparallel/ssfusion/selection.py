"""SSFusion's planning rules (§IV-B to §IV-D), pure and rank-independent: the fusion buffers
(``count`` or Cupcake's FindOptFusion), per-tensor counts, the overlap-maximized selection of
dense tensors (eq. 2), density-aware counts, the interleave split (``T1 + T2``), the offload set
and the α–β times they are planned on.  :func:`dataparallel.ssfusion.plan_ssfusion` combines
them into one :class:`~dataparallel.ssfusion.SSFusionPlan`."""

from __future__ import annotations

import math

import numpy as np

from substrate.buckets import bucket_groups

from ..codec import INDEX_BYTES, VALUE_BYTES

__all__ = [
    "alpha_beta_times",
    "count_buffers",
    "density_aware_counts",
    "feasible_dense",
    "find_opt_fusion",
    "interleave_split",
    "per_tensor_counts",
    "plan_offload",
    "select_dense",
]


def per_tensor_counts(sizes, density: float) -> list[int]:
    """Per-tensor sparsification (§II-D, DGC): ``k_l = max(1, ⌈d n_l⌉)``, at most ``n_l``."""
    return [min(int(n), max(1, math.ceil(density * int(n)))) for n in sizes]


def count_buffers(sizes, *, buffers: int = 4, buffer_bytes: int = 0,
                  itemsize: int = 4) -> list[tuple[int, int]]:
    """Contiguous tensor ranges ``[t0, t1)`` (backward order): ``buffers`` buffers of (nearly)
    equal tensor count, or, with ``buffer_bytes > 0``, a greedy byte budget
    (:func:`substrate.comm.bucket_groups`; a larger tensor gets a buffer of its own)."""
    L = len(sizes)
    if buffer_bytes > 0:
        groups = bucket_groups([int(n) * itemsize for n in sizes], int(buffer_bytes))
        return [(g[0], g[-1] + 1) for g in groups]
    if not 1 <= buffers <= L:
        raise ValueError(f"--buffers {buffers} must be between 1 and the model's {L} tensors; "
                         f"use --buffers {min(max(buffers, 1), L)} or a --buffer-mib budget")
    return [(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(L), buffers)]


def find_opt_fusion(T_b, T_sp, k, allgather_s) -> list[tuple[int, int]]:
    """Cupcake's ``FindOptFusion`` (the paper's §IV-B Step 1, [28]): the fusion buffers that
    minimize the modeled iteration under wait-free backpropagation.

    With per-tensor sparsification (Step 1) tensor ``l`` is ready after ``R_l = Σ_{m≤l} (T_b^m +
    T_sp^m)``; buffer ``[i, j)`` starts its all-gather of ``8 Σ_{i≤l<j} k_l`` bytes per rank
    when its last tensor is ready and the previous buffer's all-gather has ended.  The end of
    the last all-gather over contiguous cuts is minimized exactly by ``F(0) = 0``, ``F(j) =
    min_{i<j} max(R_j, F(i)) + T_AG(i, j)`` (``F(j)`` is nondecreasing in ``F(i)``, so optimal
    prefixes compose); among equal ends at a prefix the one with fewer buffers is kept.

    Parameters
    ----------
    T_b, T_sp : sequence of float
        Per-tensor backward and sparsification seconds (backward order).
    k : sequence of int
        Per-tensor counts ``k_l``.
    allgather_s : callable
        Vectorized ``block bytes per rank -> all-gather seconds``.
    """
    L = len(k)
    ready = np.concatenate(([0.0], np.cumsum(np.asarray(T_b, float) + np.asarray(T_sp, float))))
    K = np.concatenate(([0], np.cumsum(np.asarray(k, dtype=np.int64))))
    F = np.zeros(L + 1)
    n_buf = np.zeros(L + 1, dtype=np.int64)
    prev = np.zeros(L + 1, dtype=np.int64)
    for j in range(1, L + 1):
        t_ag = np.broadcast_to(np.asarray(allgather_s(8.0 * (K[j] - K[:j])), float), (j,))
        cand = np.maximum(ready[j], F[:j]) + t_ag
        best = cand.min()
        tie = np.flatnonzero(cand <= best + 1e-12 * max(abs(best), 1e-30))
        i = int(tie[np.argmin(n_buf[tie])])
        F[j], n_buf[j], prev[j] = cand[i], n_buf[i] + 1, i
    out, j = [], L
    while j > 0:
        out.append((int(prev[j]), j))
        j = int(prev[j])
    return out[::-1]


def feasible_dense(sizes, dense, density: float, density_floor: float) -> bool:
    """Whether the tensors ``dense`` of one buffer can stay dense while the others absorb them
    at densities ≥ the floor: ``Σ_D n_l + Σ_S ⌈d_min n_l⌉ ≤ K = Σ_l ⌈d n_l⌉``."""
    sizes = [int(n) for n in sizes]
    kmin = per_tensor_counts(sizes, density_floor)
    need = sum(n if j in dense else kmin[j] for j, n in enumerate(sizes))
    return need <= sum(per_tensor_counts(sizes, density))


def density_aware_counts(sizes, dense, density: float, density_floor: float) -> list[int]:
    """Per-tensor counts of one fusion buffer after density-aware sparsification (§IV-B).

    ``k'_l`` for the sparse tensors and 0 for the dense ones.  With no dense tensor these are
    the per-tensor counts ``max(1, ⌈d n_l⌉)``; otherwise the remaining budget ``R = K - Σ_D
    n_l`` is shared in proportion to size (largest remainder, each count between ``max(1,
    ⌈d_min n_l⌉)`` and ``n_l``), so the buffer sends exactly ``K`` elements.

    Raises
    ------
    ValueError
        If the floor makes the dense set infeasible (:func:`feasible_dense` is false).
    """
    sizes = [int(n) for n in sizes]
    dense = {int(j) for j in dense}
    k_full = per_tensor_counts(sizes, density)
    if not dense:
        return k_full
    if not feasible_dense(sizes, dense, density, density_floor):
        raise ValueError(f"dense tensors {sorted(dense)} of a buffer with sizes {sizes} cannot "
                         f"be compensated at --density-floor {density_floor}")
    kmin = per_tensor_counts(sizes, density_floor)
    sparse = [j for j in range(len(sizes)) if j not in dense]
    budget = sum(k_full) - sum(sizes[j] for j in dense)
    total_sparse = sum(sizes[j] for j in sparse)
    k = [0] * len(sizes)
    share = {j: budget * sizes[j] / total_sparse for j in sparse} if total_sparse else {}
    for j in sparse:
        k[j] = min(sizes[j], max(kmin[j], math.floor(share[j])))
    excess = sum(k[j] for j in sparse) - budget  # largest-remainder fix-up, one element a move
    while excess > 0:
        j = max((j for j in sparse if k[j] > kmin[j]), key=lambda j: (k[j] - share[j], -j))
        k[j] -= 1
        excess -= 1
    while excess < 0:
        cand = [j for j in sparse if k[j] < sizes[j]]
        if not cand:
            break
        j = max(cand, key=lambda j: (share[j] - k[j], -j))
        k[j] += 1
        excess += 1
    return k


def select_dense(sizes, T_b, T_sp, T_cm_prev: float, density: float,
                 density_floor: float) -> set[int]:
    """Overlap-maximized selection in one buffer (§IV-B, eq. 2).

    Walk the tensors by ascending size (ties: backward order) and leave each dense while
    ``T_cm^{i-1} < Σ_j T_b^j + Σ_{j∈S} T_sp^j`` (eq. 2 not yet satisfied) and the remaining
    sparse tensors can absorb it at densities ≥ the floor (:func:`feasible_dense`).

    Returns
    -------
    set of int
        Positions (within the buffer) of the tensors left dense.
    """
    comp = float(np.sum(T_b)) + float(np.sum(T_sp))
    dense: set[int] = set()
    for j in sorted(range(len(sizes)), key=lambda j: (int(sizes[j]), j)):
        if T_cm_prev >= comp:  # eq. 2 holds: computation hidden behind the previous buffer
            break
        if not feasible_dense(sizes, dense | {j}, density, density_floor):
            break
        dense.add(j)
        comp -= float(T_sp[j])
    return dense


def interleave_split(sizes, dense, k, T_b, T_sp, comm_times) -> tuple[int, float, float]:
    """Split ``l'`` of one buffer into ``Buffer_AR`` / ``Buffer_AG`` minimizing ``T1 + T2``
    (§IV-D).

    ``T1 = Σ_{j≤l'} (T_b^j + T_sp^j)``, ``T2 = max(T_AR, Σ_{j>l'} (T_b^j + T_sp^j)) + T_AG``;
    ``Buffer_AR`` holds the dense tensors among the first ``l'`` (backward order), ``Buffer_AG``
    the later dense tensors and every sparse one.  ``comm_times(n_ar, n_ag_dense, k_sparse)``
    returns ``(T_AR, T_AG)``.  Ties go to the smallest ``l'``.

    Returns
    -------
    (l', T_AR, T_AG)
    """
    n = len(sizes)
    dense = set(dense)
    comp = [float(T_b[j]) + (0.0 if j in dense else float(T_sp[j])) for j in range(n)]
    total = sum(comp)
    k_sparse = sum(int(k[j]) for j in range(n) if j not in dense)
    best = None
    T1 = 0.0
    for lp in range(n + 1):
        if lp:
            T1 += comp[lp - 1]
        n_ar = sum(int(sizes[j]) for j in range(lp) if j in dense)
        n_agd = sum(int(sizes[j]) for j in range(lp, n) if j in dense)
        t_ar, t_ag = comm_times(n_ar, n_agd, k_sparse)
        obj = T1 + max(t_ar, total - T1) + t_ag
        if best is None or obj < best[0]:
            best = (obj, lp, t_ar, t_ag)
    return best[1], best[2], best[3]


def plan_offload(T_b, T_cpu, sparse, buffers, *, deadline: str = "backward") -> np.ndarray:
    """Tensors whose sparsification goes to the CPU worker (SSFusion-O, §IV-C Step 1).

    Tensor ``l`` is ready at ``R_l = Σ_{m≤l} T_b^m``; the one worker runs the offloaded tensors
    in backward order, so ``l`` finishes at ``F_l = max(R_l, F_prev) + T_cpu^l``.  It is
    offloaded when ``F_l`` does not exceed the deadline: the end of its buffer's backward
    (``deadline="buffer"``, the paper's rule for a pipeline that communicates each buffer during
    backward, as the trainer does with ``--overlap on``) or the end of the whole backward
    (``"backward"``: for a run that communicates every buffer after the backward, ``--overlap
    off``).
    """
    if deadline not in ("buffer", "backward"):
        raise ValueError(f"deadline must be 'buffer' or 'backward', got {deadline!r}")
    ready = np.cumsum(np.asarray(T_b, dtype=np.float64))
    out = np.zeros(len(ready), dtype=bool)
    free = 0.0
    for t0, t1 in buffers:
        end = ready[t1 - 1] if deadline == "buffer" else ready[-1]
        for l in range(t0, t1):
            if not sparse[l]:
                continue
            finish = max(ready[l], free) + float(T_cpu[l])
            if finish <= end:
                out[l] = True
                free = finish
    return out


def alpha_beta_times(cost, p: int, link: str, value_bytes: int = VALUE_BYTES,
                     index_bytes: int = INDEX_BYTES):
    """``comm_times(n_ar, n_ag_dense, k_sparse) -> (T_AR, T_AG)`` from the run's α–β model
    (eqs. 3-4: ring all-reduce of the dense part, ring all-gather of every rank's block)."""
    def comm_times(n_ar: int, n_agd: int, k: int) -> tuple[float, float]:
        t_ar = cost.ring_allreduce_time(value_bytes * n_ar, p, link) if n_ar else 0.0
        block = value_bytes * n_agd + (value_bytes + index_bytes) * k
        t_ag = cost.ring_allgather_time(p * block, p, link) if block else 0.0
        return t_ar, t_ag
    return comm_times

