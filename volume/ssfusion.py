"""Closed-form communication volume of SSFusion (seed paper 004: tensor fusion with selective
sparsification, interleaved All-Reduce / All-Gather), written from the paper.

All ranks are laid out node-major: ``M`` nodes × ``P`` ranks, ``p = M P``.  The tensors
(backward order) are cut into fusion buffers ``B_1 .. B_{N_B}``; in buffer ``i`` the tensors
``D_i`` stay dense and the tensors ``S_i`` are sparsified (``multi-tensor``: one top-``K_i`` over
the whole buffer).  The split ``l'_i`` of §IV-D puts the dense tensors among the first ``l'_i``
of the buffer into ``Buffer_AR`` and everything else into ``Buffer_AG``.

=========================  =========================================  ==========================
phase                      call (per step)                            bytes on the wire
=========================  =========================================  ==========================
``ssf_warmup_allreduce``   warm-up steps: ring all-reduce (avg) of    as dense DDP, per buffer:
                           every warm-up buffer (``--buffers`` /      ``2 (p-1) · 4 n_i``
                           ``--buffer-mib``)
``ssf_profile_allreduce``  end of warm-up, once: ring all-reduce      ``2 (p-1) · 8 (3L+2)``
                           (max) of the ``3L + 2`` float64 timings
                           ``T_b, T_sp, T_cpu`` and two spans
``ssf_select_bcast``       end of warm-up, once: binomial broadcast   ``(p-1) · 8 · 4L``
                           of the ``4L`` int64 plan from rank 0       (edges ``r & (r-1) -> r``)
``ssf_dense_allreduce``    ring all-reduce (avg) of ``Buffer_AR``     ``2 (p-1) · 4 n^AR_i``
                           (buffers with ``n^AR_i > 0``)
``ssf_sparse_allgather``   ring all-gather of ``Buffer_AG``: dense    every link
                           values (float32) then ``k`` values         ``(p-1) · (4 n^AGd_i +
                           (float32) and ``k`` flat indices (int32)   8 k_i)``; ``M`` of ``p``
                                                                      links inter-node
=========================  =========================================  ==========================

**Second source** (:func:`buffer_elements`, :func:`mode_step_bytes`): the paper fixes what
each buffer sends without naming per-tensor roundings.  Per-tensor sparsification (§II-D) sends
``k_l = max(1, ⌈d n_l⌉)`` entries of every tensor, so buffer ``i`` sends ``K_i = Σ_{l∈B_i}
k_l``; multi-tensor sparsification (Fig. 1(c)) sends the same ``K_i`` from the fused buffer;
density-aware sparsification (§IV-B, steps i-iv) lowers the density of the sparsified tensors
until the buffer again sends ``K_i`` elements, so with the dense set ``D_i`` the sparse tensors
send ``K_i - Σ_{l∈D_i} n_l`` (:func:`adjusted_density`: ``d'_i = (K_i - n_D) / n_S``), each no
fewer than ``⌈d_min n_l⌉`` (the floor 0.001; :func:`compensable`).  These functions take
tensor sizes, buffers, the density and the dense set only, never a plan.
"""

from __future__ import annotations

import numpy as np

from . import collectives as cm
from .dataparallel import topk_k, world_allgather_bytes, world_ring_bytes
from .hsadmm import add_bytes

__all__ = [
    "DENSE",
    "PROFILE",
    "PROFILE_FIELDS",
    "SELECT",
    "SPARSE",
    "WARMUP",
    "adjusted_density",
    "buffer_elements",
    "buffer_target",
    "compensable",
    "mode_step_bytes",
    "payload_ratio",
    "plan_length",
    "profile_length",
    "run_bytes",
    "selection_bytes",
    "sparse_step_bytes",
    "warmup_step_bytes",
]

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


def plan_length(num_tensors: int) -> int:
    """int64 entries of the broadcast plan, four per tensor: its count ``k_l`` (-1 dense), its
    offload flag, whether it opens a fusion buffer, and (at a buffer's first tensor) the split
    ``l'_i`` — ``4L`` whatever the number of buffers, which the receivers do not know."""
    return 4 * int(num_tensors)


# -- second source: what each buffer sends, from the paper ----------------------------------------
def buffer_target(sizes, density: float) -> int:
    """``K_i = Σ_l max(1, ⌈d n_l⌉)``: the elements per-tensor sparsification sends from one
    buffer of tensors of sizes ``n_l`` (§II-D; each capped at ``n_l``)."""
    return int(sum(topk_k([int(n) for n in sizes], density)))


def compensable(sizes, dense, density: float, density_floor: float) -> bool:
    """Whether the tensors ``dense`` (positions in ``sizes``) can stay dense while the others
    make up for them at densities no lower than the floor (§IV-B: lower bound 0.001):
    ``Σ_{D} n_l + Σ_{S} max(1, ⌈d_min n_l⌉) ≤ K_i``."""
    dense = {int(j) for j in dense}
    need = sum(int(n) if j in dense else topk_k([int(n)], density_floor)[0]
               for j, n in enumerate(sizes))
    return need <= buffer_target(sizes, density)


def adjusted_density(sizes, dense, density: float) -> float:
    """Density-aware sparsification (§IV-B steps i-iv): the density ``d'_i = (K_i - n_D) / n_S``
    of the sparsified tensors of one buffer that makes the buffer send ``K_i`` elements again
    (``n_D``, ``n_S``: elements of the dense and sparse tensors; 0 when nothing is sparse)."""
    dense = {int(j) for j in dense}
    n_d = sum(int(n) for j, n in enumerate(sizes) if j in dense)
    n_s = sum(int(n) for j, n in enumerate(sizes) if j not in dense)
    return (buffer_target(sizes, density) - n_d) / n_s if n_s else 0.0


def buffer_elements(sizes, density: float, fusion: str, dense=(), split: int = 0
                    ) -> tuple[int, int, int]:
    """``(n^AR, n^AGd, k)`` of one fusion buffer per sparse step: elements all-reduced, dense
    elements all-gathered, and sparse entries sent.

    ``per-tensor`` and ``multi-tensor`` send ``K_i`` sparse entries; ``selective`` with the dense
    positions ``dense`` and split ``l'`` sends the dense tensors before ``l'`` by all-reduce,
    the later ones by all-gather, and ``K_i - n_D`` sparse entries (density-aware, §IV-B).
    """
    if fusion in ("per-tensor", "multi-tensor"):
        return 0, 0, buffer_target(sizes, density)
    if fusion != "selective":
        raise ValueError(f"fusion {fusion!r} unknown; use selective, per-tensor or multi-tensor")
    dense = {int(j) for j in dense}
    n_ar = sum(int(sizes[j]) for j in dense if j < split)
    n_agd = sum(int(sizes[j]) for j in dense if j >= split)
    return n_ar, n_agd, buffer_target(sizes, density) - n_ar - n_agd


def mode_step_bytes(*, M: int, P: int, sizes, buffer_tensor_counts, density: float,
                    fusion: str, dense=(), splits=None) -> dict[str, dict]:
    """Bytes of one sparse step of a fusion mode, from tensor sizes alone.

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    sizes : sequence of int
        Tensor sizes in backward order.
    buffer_tensor_counts : sequence of int
        Tensors per fusion buffer, in order (they sum to ``len(sizes)``).
    density : float
        ``d``.
    fusion : str
        ``per-tensor``, ``multi-tensor`` or ``selective``.
    dense : collection of int
        Selective: the dense tensors (indices into ``sizes``).
    splits : sequence of int or None
        Selective: ``l'_i`` per buffer (``None``: all 0, everything all-gathered).
    """
    counts = [int(c) for c in buffer_tensor_counts]
    if sum(counts) != len(sizes) or min(counts, default=1) < 1:
        raise ValueError(f"buffer tensor counts {counts} do not cut {len(sizes)} tensors")
    splits = [0] * len(counts) if splits is None else list(splits)
    dense = {int(j) for j in dense}
    ar, agd, ks = [], [], []
    t0 = 0
    for c, lp in zip(counts, splits):
        n_ar, n_agd, k = buffer_elements(sizes[t0:t0 + c], density, fusion,
                                         {j - t0 for j in dense if t0 <= j < t0 + c}, lp)
        ar.append(n_ar)
        agd.append(n_agd)
        ks.append(k)
        t0 += c
    return sparse_step_bytes(M=M, P=P, ar_counts=ar, ag_dense_counts=agd, ag_sparse_counts=ks)


# -- the calls ------------------------------------------------------------------------------------
def warmup_step_bytes(*, M: int, P: int, buffer_sizes, itemsize: int = 4) -> dict[str, dict]:
    """One warm-up step: a dense ring all-reduce (avg) of every warm-up buffer."""
    return {WARMUP: add_bytes(*(world_ring_bytes(n, itemsize, M, P) for n in buffer_sizes))}


def selection_bytes(*, M: int, P: int, num_tensors: int) -> dict[str, dict]:
    """The one-off decision at the end of warm-up: max all-reduce of the ``3L + 2`` float64
    timings, then the binomial broadcast of the ``4L`` int64 plan from rank 0."""
    nodes = np.arange(M * P) // P
    return {PROFILE: world_ring_bytes(profile_length(num_tensors), 8, M, P),
            SELECT: cm.bcast_split(8 * plan_length(num_tensors), nodes)}


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


def run_bytes(*, M: int, P: int, steps: int, warmup_steps: int, warmup_buffer_sizes,
              ar_counts, ag_dense_counts, ag_sparse_counts, num_tensors: int,
              selection: bool = True) -> dict[str, dict]:
    """Bytes of a whole run of ``steps`` steps (the sum of the per-step forms): ``w = min(steps,
    warmup)`` warm-up steps, the decision once when warm-up completes (``selection``: when the
    run profiles, i.e. ``--fusion selective`` or ``--fusion-policy cupcake``), then ``steps -
    w`` sparse steps."""
    w = min(int(steps), int(warmup_steps))
    s = int(steps) - w

    def times(parts: dict, n: int) -> dict:
        return {ph: {k: v * n for k, v in b.items()} for ph, b in parts.items()} if n else {}

    terms = [times(warmup_step_bytes(M=M, P=P, buffer_sizes=warmup_buffer_sizes), w),
             times(sparse_step_bytes(M=M, P=P, ar_counts=ar_counts,
                                     ag_dense_counts=ag_dense_counts,
                                     ag_sparse_counts=ag_sparse_counts), s)]
    if selection and w == warmup_steps > 0:
        terms.append(selection_bytes(M=M, P=P, num_tensors=num_tensors))
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

