"""Closed-form communication volume of SSFusion (seed paper 004: tensor fusion with selective
sparsification, interleaved All-Reduce / All-Gather).

All ranks are laid out node-major: ``M`` nodes × ``P`` ranks, ``p = M P``.  The tensors
(backward order) are cut into fusion buffers ``B_1 .. B_{N_B}``; in buffer ``i`` the tensors
``D_i`` stay dense and the tensors ``S_i`` are sparsified to ``k_l`` entries each (``fusion =
multi-tensor``: one top-``K_i`` over the whole buffer).  The split ``l'_i`` of §IV-D puts the dense
tensors among the first ``l'_i`` of the buffer into ``Buffer_AR`` and everything else into
``Buffer_AG``.

=========================  =========================================  ==========================
phase                      call (per step)                            bytes on the wire
=========================  =========================================  ==========================
``ssf_warmup_allreduce``   warm-up steps: ring all-reduce (avg) of    as dense DDP, per buffer:
                           every fusion buffer                        ``2 (p-1) · 4 n_i``
``ssf_profile_allreduce``  end of warm-up, once: ring all-reduce      ``2 (p-1) · 8 (3L+2)``
                           (max) of the ``3L + 2`` float64 timings
                           ``T_b, T_sp, T_cpu`` and two spans
``ssf_select_bcast``       end of warm-up, once: binomial broadcast   ``(p-1) · 8 (2L + N_B)``
                           of the plan from rank 0 (``2L + N_B``      (edges ``r & (r-1) -> r``;
                           int64: ``k_l`` or -1, offload flag,        ``M-1`` cross nodes for a
                           ``l'_i``)                                  power-of-two ``P``)
``ssf_dense_allreduce``    ring all-reduce (avg) of ``Buffer_AR``     ``2 (p-1) · 4 n^AR_i``
                           (buffers with ``n^AR_i > 0``)
``ssf_sparse_allgather``   ring all-gather of ``Buffer_AG``: dense    every link
                           values (float32) then ``k`` values         ``(p-1) · (4 n^AGd_i +
                           (float32) and ``k`` flat indices (int32)   8 k_i)``; ``M`` of ``p``
                                                                      links inter-node
=========================  =========================================  ==========================

Counts: ``k_l = max(1, ⌈d n_l⌉)`` per tensor at ``--density d`` (capped at ``n_l``, as Top-K),
the buffer target ``K_i = Σ_{l∈B_i} k_l``.  Density-aware sparsification (§IV-B) lowers the
counts of ``S_i`` so that ``Σ_{D_i} n_l + Σ_{S_i} k'_l = K_i`` exactly, with ``k'_l ≥
max(1, ⌈d_min n_l⌉)`` (the floor ``d_min = 0.001``): :func:`density_aware_counts`.
"""

from __future__ import annotations

import math

import numpy as np

from substrate import costmodel as cm

from .dataparallel import topk_k, world_allgather_bytes, world_ring_bytes
from .hsadmm import add_bytes

__all__ = ["WARMUP", "PROFILE", "SELECT", "DENSE", "SPARSE", "PROFILE_FIELDS",
           "floor_counts", "feasible_dense", "density_aware_counts", "plan_length",
           "profile_length",
           "warmup_step_bytes", "selection_bytes",
           "sparse_step_bytes", "run_bytes", "payload_ratio"]

WARMUP = "ssf_warmup_allreduce"
PROFILE = "ssf_profile_allreduce"
SELECT = "ssf_select_bcast"
DENSE = "ssf_dense_allreduce"
SPARSE = "ssf_sparse_allgather"

#: Timings per tensor max-reduced at the end of warm-up: backward, sparsification (device),
#: sparsification on the CPU worker (the offload candidate cost); followed by the two backward
#: spans (without / with the offload worker busy), see :func:`profile_length`.
PROFILE_FIELDS = ("T_b", "T_sp", "T_cpu")


def profile_length(num_tensors: int) -> int:
    """float64 entries of the max-reduced profile: ``T_b, T_sp, T_cpu`` per tensor and the
    backward spans without and with the offload worker (``3L + 2``)."""
    return len(PROFILE_FIELDS) * int(num_tensors) + 2


def floor_counts(sizes, density_floor: float) -> list[int]:
    """Smallest counts the floor allows: ``max(1, ⌈d_min n_l⌉)`` (capped at ``n_l``)."""
    return topk_k(sizes, density_floor)


def feasible_dense(sizes, dense, density: float, density_floor: float) -> bool:
    """Whether the tensors ``dense`` of one buffer can stay dense while the others absorb them
    at densities ≥ the floor: ``Σ_D n_l + Σ_S ⌈d_min n_l⌉ ≤ K = Σ_l ⌈d n_l⌉`` (§IV-B,
    density-aware sparsification with the lower bound 0.001)."""
    sizes = [int(n) for n in sizes]
    dense = set(dense)
    target = sum(topk_k(sizes, density))
    kmin = floor_counts(sizes, density_floor)
    need = sum(n if j in dense else kmin[j] for j, n in enumerate(sizes))
    return need <= target


def density_aware_counts(sizes, dense, density: float, density_floor: float) -> list[int]:
    """Per-tensor counts of one fusion buffer after density-aware sparsification (§IV-B).

    Parameters
    ----------
    sizes : sequence of int
        Element counts ``n_l`` of the buffer's tensors.
    dense : collection of int
        Positions (into ``sizes``) of the tensors left dense.
    density, density_floor : float
        Target density ``d`` and its lower bound ``d_min``.

    Returns
    -------
    list of int
        ``k'_l`` for the sparse tensors and 0 for the dense ones.  With no dense tensor these are
        the per-tensor counts ``max(1, ⌈d n_l⌉)``.  Otherwise the remaining budget ``R = K -
        Σ_D n_l`` is shared in proportion to size (largest remainder, each count between
        ``max(1, ⌈d_min n_l⌉)`` and ``n_l``), so the buffer transmits exactly ``K`` elements.

    Raises
    ------
    ValueError
        If the floor makes the dense set infeasible (:func:`feasible_dense` is false).
    """
    sizes = [int(n) for n in sizes]
    dense = set(int(j) for j in dense)
    k_full = topk_k(sizes, density)
    if not dense:
        return k_full
    if not feasible_dense(sizes, dense, density, density_floor):
        raise ValueError(f"dense tensors {sorted(dense)} of a buffer with sizes {sizes} cannot "
                         f"be compensated at --density-floor {density_floor}")
    kmin = floor_counts(sizes, density_floor)
    sparse = [j for j in range(len(sizes)) if j not in dense]
    budget = sum(k_full) - sum(sizes[j] for j in dense)
    total_sparse = sum(sizes[j] for j in sparse)
    k = [0] * len(sizes)
    share = {j: budget * sizes[j] / total_sparse for j in sparse} if total_sparse else {}
    for j in sparse:
        k[j] = min(sizes[j], max(kmin[j], math.floor(share[j])))
    # largest-remainder fix-up so that Σ_S k = budget exactly (each step moves one element)
    excess = sum(k[j] for j in sparse) - budget
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


def plan_length(num_tensors: int, num_buffers: int) -> int:
    """int64 entries of the broadcast plan: ``k_l`` (or -1 dense), offload flag, ``l'_i``."""
    return 2 * int(num_tensors) + int(num_buffers)


def warmup_step_bytes(*, M: int, P: int, buffer_sizes, itemsize: int = 4) -> dict[str, dict]:
    """One warm-up step: a dense ring all-reduce (avg) of every fusion buffer."""
    return {WARMUP: add_bytes(*(world_ring_bytes(n, itemsize, M, P) for n in buffer_sizes))}


def selection_bytes(*, M: int, P: int, num_tensors: int, num_buffers: int) -> dict[str, dict]:
    """The one-off selection at the end of warm-up: max all-reduce of the ``3L + 2`` float64
    timings, then the binomial broadcast of the ``2L + N_B`` int64 plan from rank 0."""
    nodes = np.arange(M * P) // P
    return {PROFILE: world_ring_bytes(profile_length(num_tensors), 8, M, P),
            SELECT: cm.bcast_split(8 * plan_length(num_tensors, num_buffers), nodes)}


def sparse_step_bytes(*, M: int, P: int, ar_counts, ag_dense_counts, ag_sparse_counts,
                      value_bytes: int = 4, index_bytes: int = 4) -> dict[str, dict]:
    """One step after warm-up: per buffer ``i`` a ring all-reduce of ``ar_counts[i]`` float32
    (skipped when 0) and a ring all-gather of ``value_bytes · ag_dense_counts[i] + (value_bytes
    + index_bytes) · ag_sparse_counts[i]`` bytes per rank (skipped when 0).  A phase appears only
    when at least one call is made (as in the ledger)."""
    ar = [world_ring_bytes(n, value_bytes, M, P) for n in ar_counts if n > 0]
    ag = [world_allgather_bytes(value_bytes * nd + (value_bytes + index_bytes) * ks, M, P)
          for nd, ks in zip(ag_dense_counts, ag_sparse_counts) if nd + ks > 0]
    out = {}
    if ar:
        out[DENSE] = add_bytes(*ar)
    if ag:
        out[SPARSE] = add_bytes(*ag)
    return out


def run_bytes(*, M: int, P: int, steps: int, warmup_steps: int, buffer_sizes, ar_counts,
              ag_dense_counts, ag_sparse_counts, num_tensors: int,
              selection: bool = True) -> dict[str, dict]:
    """Bytes of a whole run of ``steps`` steps (the sum of the per-step forms): ``w = min(steps,
    warmup)`` warm-up steps, the selection once when warm-up completes (``selection``: only for
    ``--fusion selective``), then ``steps - w`` sparse steps."""
    w = min(int(steps), int(warmup_steps))
    s = int(steps) - w

    def times(parts: dict, n: int) -> dict:
        return {ph: {k: v * n for k, v in b.items()} for ph, b in parts.items()} if n else {}

    terms = [times(warmup_step_bytes(M=M, P=P, buffer_sizes=buffer_sizes), w),
             times(sparse_step_bytes(M=M, P=P, ar_counts=ar_counts,
                                     ag_dense_counts=ag_dense_counts,
                                     ag_sparse_counts=ag_sparse_counts), s)]
    if selection and w == warmup_steps > 0:
        terms.append(selection_bytes(M=M, P=P, num_tensors=num_tensors,
                                     num_buffers=len(buffer_sizes)))
    out: dict[str, dict] = {}
    for t in terms:
        for ph, b in t.items():
            out[ph] = add_bytes(out[ph], b) if ph in out else b
    return out


def payload_ratio(total: int, ar_counts, ag_dense_counts, ag_sparse_counts,
                  value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Payload bytes one rank contributes per sparse step relative to a dense float32 gradient
    of ``total`` elements (Top-K's ``2K / T`` when everything is sparse)."""
    sent = value_bytes * (sum(ar_counts) + sum(ag_dense_counts)) \
        + (value_bytes + index_bytes) * sum(ag_sparse_counts)
    return sent / (value_bytes * int(total))
