"""SSFusion: tensor fusion with selective sparsification (seed paper 004, §III-IV).

Everything a run sends is fixed by one pure plan, :class:`SSFusionPlan`, built by
:func:`plan_ssfusion` from the tensor sizes (backward order), ``p``, the slowest link, the α–β
cost model, :class:`SSFusionOptions` and — when the plan depends on timings — the warm-up
profile ``(T_b, T_sp, T_cpu)``.  The strategy executes it (:meth:`SSFusion._install`);
``commvol`` predicts from the same function on an assumed profile.

Fusion buffers (§IV-B Step 1, ``--fusion-policy``):

``cupcake`` (default, the paper's)
    the buffers of Cupcake's ``FindOptFusion`` [28]: the contiguous cut of the tensors that
    minimizes the modeled end of the last all-gather under wait-free backpropagation with
    per-tensor sparsification (:func:`find_opt_fusion`, an exact dynamic program on the profile);
``count``
    ``--buffers N`` buffers of equal tensor count (or a ``--buffer-mib`` byte budget): the
    reference code's default partition, kept as an option.

The ``--profile-steps`` dense warm-up steps all-reduce the gradient in the ``--buffers`` /
``--buffer-mib`` warm-up buffers.  Then, per ``--fusion``:

``selective`` (SSFusion, §IV-B)
    in every buffer the smallest tensors ``D_i`` stay dense and the others ``S_i`` are
    sparsified one by one.  *Overlap-maximized selection* (:func:`select_dense`): walk ``B_i``'s
    tensors by ascending size and leave them dense until eq. 2 holds, ``T_cm^{i-1} ≥ Σ_{j∈B_i}
    (T_b^j + T_sp^j)`` (sparsification counted for sparse tensors only), for ``2 ≤ i ≤ M``; the
    first buffer keeps every tensor sparsified (``--first-buffer per-tensor``; ``exclude``:
    ``T_cm^0 = 0``).  *Density-aware sparsification* (:func:`density_aware_counts`): the counts
    of ``S_i`` are lowered so that the buffer still sends ``K_i = Σ_{l∈B_i} ⌈d n_l⌉``
    elements, never below ``⌈d_min n_l⌉`` (``--density-floor``, 0.001).  *Interleaved
    communication* (SSFusion-I, §IV-D, ``--interleave``): the split ``l'_i`` minimizing ``T1 +
    T2`` (:func:`interleave_split`) sends the dense tensors among the first ``l'_i`` with a
    ring all-reduce (``Buffer_AR``) and the rest with one all-gather (``Buffer_AG``: dense
    values, then float32 values and int32 indices of the sparse ones); ``--no-interleave``
    all-gathers the whole buffer (SSFusion "naive").  *Offloading* (SSFusion-O, §IV-C,
    ``--offload``): the sparsification of large tensors whose CPU time fits under the rest of
    the backward pass (:func:`plan_offload`) runs on one CPU worker thread, submitted from
    :meth:`SSFusion.on_ready`.
``per-tensor``
    every tensor sparsified at density ``d`` (``k_l = ⌈d n_l⌉``), each buffer all-gathered.
``multi-tensor``
    each buffer sparsified as one vector with ``K_i`` entries, all-gathered; tensors with no
    selected entry are *missing* (Table I's tensor-missing rate, reported).

Sparsifier (``--sparsifier``): ``dgc`` (DGC [44], the paper's: sampled threshold, refinement,
trim to exactly ``k``: :func:`dataparallel.sparsify.dgc_topk`), ``gaussiank`` (Gaussian-k
[22]: threshold from a normal fit, at most three rescalings, at most ``k`` sent and the slots
left padded with zeros: :func:`gaussiank_select`) or ``exact`` (full top-``k``).  DGC's
*momentum correction* (``--momentum-correction``, on): the strategy takes the optimizer's
momentum over, ``u ← μ u + g``, ``v ← v + u``, sends top-``k`` of ``v`` and zeroes ``u`` and
``v`` where it sent (momentum factor masking); dense tensors keep plain momentum ``u``.
Without it, error feedback accumulates the raw gradient (``a = g + e``) and the optimizer
applies momentum to the synchronized gradient.

Profiling: ``T_b^l``, the gap between tensor ``l``'s gradient and the previous tensor's (the
first tensor gets 0 as the trainer has no backward-start hook), from the per-layer compute events
of the run's compute source (``on_ready`` wall-clock timestamps without per-layer events);
``T_sp^l`` by timing the sparsifier on tensor ``l`` itself after the backward, with the run's
compute source; so a loaded host or a replayed ``--compute-profile`` plans the same buffers.
``T_cpu^l`` (with ``--offload``, on every second warm-up step) by running it on the worker thread
from ``on_ready``, and the backward spans of the offload guard, stay wall-clock: they measure
contention between threads.  Communication times from the run's α–β model.  The timings are
max-reduced over all ranks, rank 0 plans and broadcasts the plan, so every rank uses the same
plan.  Closed forms and the second source: :mod:`volume.ssfusion`.

Simulation notes: the collectives are blocking and run in ``sync`` after the backward, buffer
by buffer (all-reduce, then all-gather), and so does the main-thread sparsification.  On the
timeline clock every buffer declares the events of the paper's pipeline (:meth:`SSFusion.sync`,
Fig. 10): its preparation (momentum, sparsification, packing) on the compute stream placed right
after the backward event that completes the buffer (``after=``: it delays the rest of the
backward, as a kernel launched on the compute stream would), its offloaded segments on the
``offload`` stream, then its all-reduce and all-gather, one collective after another (one
communication channel), overlapping the rest of the backward; unpacking the received buffers
into the gradient follows each collective.  The tensor-missing count is a
:meth:`SimClock.diagnostic` (not part of the step).  The ``flops`` source counts the
sparsification's element operations (:func:`dataparallel.sparsify.selection_flops`), with no
kernel-launch cost per tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from substrate.backend import array_module
from substrate.buckets import bucket_groups
from substrate.options import option
from substrate.compute import CpuTimeSource
from volume import ssfusion as cv
from volume.dataparallel import ddp_step_bytes, topk_k

from .ddp import DDPOptions, flat_buckets
from .sparsify import dgc_topk, selection_flops
from .strategy import Strategy, register
from .topk import TopKOptions

__all__ = [
    "FIRST_BUFFER_RULES",
    "FUSION_MODES",
    "FUSION_POLICIES",
    "SPARSIFIERS",
    "SSFusion",
    "SSFusionOptions",
    "SSFusionPlan",
    "alpha_beta_times",
    "count_buffers",
    "density_aware_counts",
    "exact_select",
    "feasible_dense",
    "find_opt_fusion",
    "gaussiank_select",
    "interleave_split",
    "needs_profile",
    "plan_offload",
    "plan_ssfusion",
    "select_dense",
]

FUSION_MODES = ("selective", "per-tensor", "multi-tensor")
FUSION_POLICIES = ("cupcake", "count")
FIRST_BUFFER_RULES = ("per-tensor", "exclude")
SPARSIFIERS = ("dgc", "gaussiank", "exact")


@dataclass(frozen=True)
class SSFusionOptions:
    """Options of SSFusion (``--method ssfusion``)."""

    density: float = option(0.01, "fraction of each tensor's entries sent per step")
    density_floor: float = option(
        0.001, "ssfusion: lowest density the density-aware adjustment may give a tensor")
    fusion: str = option("selective", "ssfusion: selective | per-tensor | multi-tensor "
                         "sparsification", choices=FUSION_MODES)
    fusion_policy: str = option(
        "cupcake", "ssfusion: fusion buffers: cupcake (the paper's Step 1, Cupcake's "
        "FindOptFusion: the contiguous cut minimizing the modeled backward + sparsify + "
        "all-gather pipeline on the warm-up profile) | count (--buffers equal tensor counts or "
        "a --buffer-mib budget)", choices=FUSION_POLICIES)
    buffers: int = option(4, "ssfusion: warm-up buffers of equal tensor count (backward "
                          "order); also the fusion buffers with --fusion-policy count")
    buffer_mib: float = option(0.0, "ssfusion: warm-up (and --fusion-policy count) buffer "
                               "byte budget in MiB (> 0 overrides --buffers)")
    first_buffer: str = option(
        "per-tensor", "ssfusion selective: the first buffer, which eq. 2 (2 <= i <= M) leaves "
        "out: per-tensor (every tensor sparsified) | exclude (T_cm^0 = 0: small tensors dense "
        "as far as the floor allows)", choices=FIRST_BUFFER_RULES)
    profile_steps: int = option(
        5, "ssfusion: dense warm-up steps; the timings profiled during them fix the fusion "
        "buffers and the selection (the paper's 5)")
    sparsifier: str = option("dgc", "ssfusion: dgc (DGC sampled threshold, exactly k) | "
                             "gaussiank (Gaussian-k threshold, at most k) | exact (full top-k)",
                             choices=SPARSIFIERS)
    sample_ratio: float = option(
        0.01, "ssfusion: fraction of a tensor sampled for the DGC threshold estimate")
    momentum_correction: bool = option(
        True, "ssfusion: DGC momentum correction and factor masking (the strategy takes the "
        "optimizer's momentum over; disable with --no-momentum-correction)")
    interleave: bool = option(True, "ssfusion: all-reduce the dense part, all-gather the "
                              "sparse part (disable with --no-interleave)")
    offload: bool = option(False, "ssfusion: sparsify large tensors on a CPU worker thread "
                           "during backward")
    error_feedback: bool = option(True, "accumulate unsent entries into the next step "
                                  "(disable with --no-error-feedback)")

    def __post_init__(self) -> None:
        TopKOptions(density=self.density)  # the shared --density flag, validated once
        if not 0 < self.density_floor <= 1:
            raise ValueError(f"--density-floor must be in (0, 1] (the paper uses 0.001), got "
                             f"{self.density_floor}")
        if self.density < self.density_floor:
            raise ValueError(f"--density {self.density} is below --density-floor "
                             f"{self.density_floor} (the lower bound against over-"
                             f"sparsification); raise --density or lower --density-floor")
        for flag, v, allowed in (("--fusion", self.fusion, FUSION_MODES),
                                 ("--fusion-policy", self.fusion_policy, FUSION_POLICIES),
                                 ("--first-buffer", self.first_buffer, FIRST_BUFFER_RULES),
                                 ("--sparsifier", self.sparsifier, SPARSIFIERS)):
            if v not in allowed:
                raise ValueError(f"{flag} {v!r} unknown; use one of {allowed}")
        for flag, v in (("--buffers", self.buffers), ("--profile-steps", self.profile_steps)):
            if np.asarray(v).dtype.kind not in "iu":  # bool, float, str: not a count
                raise ValueError(f"{flag} takes a whole number, got {v!r}")
        if self.buffers < 1:
            raise ValueError(f"--buffers must be an integer >= 1, got {self.buffers}")
        if not self.buffer_mib >= 0:
            raise ValueError(f"--buffer-mib must be >= 0 (0: use --buffers), got "
                             f"{self.buffer_mib}")
        if self.profile_steps < 0:
            raise ValueError(f"--profile-steps must be an integer >= 0, got "
                             f"{self.profile_steps}")
        if needs_profile(self) and self.profile_steps < 1:
            why = ("--fusion selective" if self.fusion == "selective"
                   else "--fusion-policy cupcake")
            raise ValueError(f"{why} plans on the timings profiled during the dense warm-up: "
                             f"--profile-steps must be >= 1 (the paper uses 5), or use "
                             f"--fusion-policy count with a non-selective --fusion")
        if not 0 < self.sample_ratio <= 1:
            raise ValueError(f"--sample-ratio must be in (0, 1] (DGC samples ~0.01), got "
                             f"{self.sample_ratio}")
        if self.momentum_correction and not self.error_feedback:
            raise ValueError("--momentum-correction accumulates the velocity of unsent entries "
                             "(DGC): it needs error feedback; add --no-momentum-correction to "
                             "--no-error-feedback")
        if self.offload and self.profile_steps < 2:
            raise ValueError(f"--offload profiles the backward with and without the CPU worker "
                             f"on alternate warm-up steps: use --profile-steps >= 2 (got "
                             f"{self.profile_steps})")
        if self.offload and self.fusion != "selective":
            raise ValueError(f"--offload is SSFusion-O on top of --fusion selective; drop "
                             f"--offload or use --fusion selective (got --fusion {self.fusion})")


def needs_profile(options: SSFusionOptions) -> bool:
    """Whether the plan depends on the warm-up profile (selective selection or Cupcake
    buffers): the run then max-reduces its timings and broadcasts the plan once."""
    return options.fusion == "selective" or options.fusion_policy == "cupcake"


# -- sparsifiers ----------------------------------------------------------------------------------
def exact_select(x, k: int):
    """Positions of the ``k`` largest ``|x|`` (full selection; unordered int64)."""
    xp = array_module(x)
    n = int(x.size)
    if k >= n:
        return xp.arange(n, dtype=np.int64)
    return xp.argpartition(xp.abs(x), n - k)[n - k:].astype(np.int64, copy=False)


def gaussiank_select(x, k: int):
    """Gaussian-k (Shi et al. 2019 [22]): at most ``k`` positions of large ``|x|``.

    Fit ``x ~ N(μ, σ²)`` and take the threshold ``τ = μ + σ Φ^{-1}(1 - k/(2n))`` (the two-sided
    tail holding ``k`` of ``n``); rescale it at most three times, ``τ ← τ/2`` while fewer than
    ``2k/3`` entries pass and ``τ ← 1.5 τ`` while more than ``4k/3`` do; keep ``{|x| > τ}``,
    trimmed to the ``k`` largest when more pass.  Fewer than ``k`` may be returned (the caller
    pads the fixed-size message with zeros).
    """
    xp = array_module(x)
    n = int(x.size)
    if k >= n:
        return xp.arange(n, dtype=np.int64)
    mu, sigma = float(x.mean()), float(x.std())
    from scipy.special import ndtri  # noqa: PLC0415 (17 MiB a rank; --sparsifier gaussiank only)

    tau = mu + sigma * float(ndtri(1.0 - k / (2.0 * n)))
    mag = xp.abs(x)
    for _ in range(3):
        c = int(xp.count_nonzero(mag > tau))
        if c < 2 * k / 3:
            tau *= 0.5
        elif c > 4 * k / 3:
            tau *= 1.5
        else:
            break
    cand = xp.flatnonzero(mag > tau)
    if cand.size > k:
        cand = cand[xp.argpartition(mag[cand], cand.size - k)[cand.size - k:]]
    return cand.astype(np.int64, copy=False)


# -- planning (pure, rank-independent) -----------------------------------------------------------
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
    kmin = topk_k(sizes, density_floor)
    need = sum(n if j in dense else kmin[j] for j, n in enumerate(sizes))
    return need <= sum(topk_k(sizes, density))


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
    k_full = topk_k(sizes, density)
    if not dense:
        return k_full
    if not feasible_dense(sizes, dense, density, density_floor):
        raise ValueError(f"dense tensors {sorted(dense)} of a buffer with sizes {sizes} cannot "
                         f"be compensated at --density-floor {density_floor}")
    kmin = topk_k(sizes, density_floor)
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
    backward) or the end of the whole backward (``"backward"``, this trainer's case: buffers are
    communicated in ``sync`` after the backward).
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


def alpha_beta_times(cost, p: int, link: str, value_bytes: int = 4, index_bytes: int = 4):
    """``comm_times(n_ar, n_ag_dense, k_sparse) -> (T_AR, T_AG)`` from the run's α–β model
    (eqs. 3-4: ring all-reduce of the dense part, ring all-gather of every rank's block)."""
    def comm_times(n_ar: int, n_agd: int, k: int) -> tuple[float, float]:
        t_ar = cost.ring_allreduce_time(value_bytes * n_ar, p, link) if n_ar else 0.0
        block = value_bytes * n_agd + (value_bytes + index_bytes) * k
        t_ag = cost.ring_allgather_time(p * block, p, link) if block else 0.0
        return t_ar, t_ag
    return comm_times


@dataclass(frozen=True)
class SSFusionPlan:
    """Everything SSFusion sends, fixed once (the run executes it, ``commvol`` predicts it).

    Attributes
    ----------
    fusion : str
        ``selective``, ``per-tensor`` or ``multi-tensor``.
    sizes : tuple of int
        Tensor sizes ``n_l`` in backward order.
    warmup_buffers, buffers : tuple of (t0, t1)
        Tensor ranges of the warm-up all-reduces and of the fusion buffers ``B_i``.
    k : tuple of int
        Per tensor: its count ``k_l`` (``-1``: dense).  Multi-tensor sends ``Σ_{B_i} k_l`` from
        the fused buffer.
    split : tuple of int
        ``l'_i`` per fusion buffer (dense tensors before it go to ``Buffer_AR``).
    offload : tuple of bool
        Per tensor: sparsified on the CPU worker (SSFusion-O).
    profiled : bool
        Whether the run decides this plan from its warm-up profile (then the timings are
        max-reduced and the plan broadcast once, at the end of warm-up).
    """

    fusion: str
    sizes: tuple
    warmup_buffers: tuple
    buffers: tuple
    k: tuple
    split: tuple
    offload: tuple
    profiled: bool

    @property
    def L(self) -> int:
        return len(self.sizes)

    def dense(self) -> list[int]:
        """Tensors sent dense."""
        return [l for l, k in enumerate(self.k) if k < 0]

    def buffer_sizes(self, warmup: bool = False) -> list[int]:
        return [sum(self.sizes[t0:t1]) for t0, t1 in
                (self.warmup_buffers if warmup else self.buffers)]

    def counts(self) -> tuple[list[int], list[int], list[int]]:
        """Per buffer: all-reduced elements, all-gathered dense elements, sparse entries."""
        ar, agd, ks = [], [], []
        for (t0, t1), lp in zip(self.buffers, self.split):
            ar.append(sum(self.sizes[l] for l in range(t0, t1) if self.k[l] < 0 and l - t0 < lp))
            agd.append(sum(self.sizes[l] for l in range(t0, t1)
                           if self.k[l] < 0 and l - t0 >= lp))
            ks.append(sum(self.k[l] for l in range(t0, t1) if self.k[l] >= 0))
        return ar, agd, ks

    def step_bytes(self, M: int, P: int, kind: str, decided: bool = False) -> dict[str, dict]:
        """Closed-form bytes of one step: ``kind`` ``"warmup"`` (``decided``: the step that
        ends warm-up and decides this plan) or ``"sparse"``."""
        if kind == "warmup":
            out = cv.warmup_step_bytes(M=M, P=P, buffer_sizes=self.buffer_sizes(warmup=True))
            if decided and self.profiled:
                out.update(cv.selection_bytes(M=M, P=P, num_tensors=self.L))
            return out
        ar, agd, ks = self.counts()
        return cv.sparse_step_bytes(M=M, P=P, ar_counts=ar, ag_dense_counts=agd,
                                    ag_sparse_counts=ks)

    def encode(self) -> np.ndarray:
        """The broadcast form, ``4L`` int64 (:func:`volume.ssfusion.plan_length`): counts,
        offload flags, buffer-start flags and each buffer's ``l'_i`` at its first tensor."""
        start = np.zeros(self.L, np.int64)
        split = np.zeros(self.L, np.int64)
        for (t0, _), lp in zip(self.buffers, self.split):
            start[t0], split[t0] = 1, lp
        return np.concatenate([np.asarray(self.k, np.int64),
                               np.asarray(self.offload, np.int64), start, split])

    def decode(self, code) -> SSFusionPlan:
        """This plan with the counts, offload flags, buffers and splits of ``code``."""
        L = self.L
        code = np.asarray(code, dtype=np.int64)
        if code.size != cv.plan_length(L):
            raise ValueError(f"plan of {code.size} entries does not fit {L} tensors")
        starts = [int(t) for t in np.flatnonzero(code[2 * L:3 * L])]
        if not starts or starts[0] != 0:
            raise ValueError("decoded plan has no buffer starting at tensor 0")
        buffers = tuple(zip(starts, starts[1:] + [L]))
        return dataclasses.replace(
            self, buffers=buffers, k=tuple(int(v) for v in code[:L]),
            offload=tuple(bool(v) for v in code[L:2 * L]),
            split=tuple(int(code[3 * L + t0]) for t0, _ in buffers))


def plan_ssfusion(sizes, p: int, link: str, options: SSFusionOptions, cost, *, profile=None,
                  buffers=None, dense=None, split=None, itemsize: int = 4) -> SSFusionPlan:
    """SSFusion's plan for tensors of ``sizes`` (backward order) on ``p`` ranks (pure).

    Parameters
    ----------
    sizes : sequence of int
        Tensor sizes in the layout's backward order.
    p : int
        Ranks; ``link`` the slowest link class of a world ring; ``cost`` the α–β model.
    options : SSFusionOptions
    profile : (T_b, T_sp, T_cpu) or None
        Per-tensor seconds (warm-up profile, or an assumed one).  Needed when
        :func:`needs_profile`.
    buffers : sequence of (t0, t1) or None
        Given fusion buffers (a recorded run's) instead of the fusion policy's.
    dense, split : or None
        Selective only: the given dense tensors (indices) and ``l'_i`` per buffer instead of
        the eq. 2 rule and the ``T1 + T2`` split (to reproduce a recorded run).

    Returns
    -------
    SSFusionPlan
    """
    o = options
    sizes = tuple(int(n) for n in sizes)
    L = len(sizes)
    warm = tuple(count_buffers(sizes, buffers=int(o.buffers),
                               buffer_bytes=int(o.buffer_mib * (1 << 20)), itemsize=itemsize))
    if profile is None:
        if needs_profile(o) and not (buffers is not None and (o.fusion != "selective" or (
                dense is not None and (split is not None or not o.interleave)))):
            raise ValueError("this SSFusion plan depends on timings (--fusion selective or "
                             "--fusion-policy cupcake): pass the profile (T_b, T_sp, T_cpu)")
        T_b = T_sp = T_cpu = np.zeros(L)
    else:
        T_b, T_sp, T_cpu = (np.asarray(t, dtype=np.float64) for t in profile)
        if not T_b.shape == T_sp.shape == T_cpu.shape == (L,):
            raise ValueError(f"profile arrays must have one entry per tensor ({L})")
    k_full = topk_k(sizes, o.density)
    times = alpha_beta_times(cost, p, link)
    if buffers is not None:
        buffers = tuple((int(a), int(b)) for a, b in buffers)
        if not buffers or buffers[0][0] != 0 or buffers[-1][1] != L or any(
                a >= b or b != c for (a, b), (c, _) in zip(buffers, buffers[1:] + ((L, L),))):
            raise ValueError(f"fusion buffers {list(buffers)} do not cut the {L} tensors into "
                             "contiguous non-empty ranges")
    elif o.fusion_policy == "cupcake":
        buffers = tuple(find_opt_fusion(
            T_b, T_sp, k_full, lambda block: cost.ring_allgather_time(p * block, p, link)))
    else:
        buffers = warm
    nb = len(buffers)
    if o.fusion != "selective":
        if dense is not None or split is not None:
            raise ValueError(f"a dense set or split is a --fusion selective selection (got "
                             f"--fusion {o.fusion})")
        return SSFusionPlan(o.fusion, sizes, warm, buffers, tuple(k_full), (0,) * nb,
                            (False,) * L, needs_profile(o))
    if split is not None and (len(split) != nb or any(
            not 0 <= int(lp) <= t1 - t0 for lp, (t0, t1) in zip(split, buffers))):
        raise ValueError(f"interleave split {list(split)} needs one l'_i in 0..n_i per fusion "
                         f"buffer (tensors per buffer: {[t1 - t0 for t0, t1 in buffers]})")
    if split is not None and not o.interleave and any(split):
        raise ValueError("--no-interleave all-gathers whole buffers (l'_i = 0); drop the "
                         "non-zero splits")
    k = [0] * L
    lps = []
    T_cm_prev = 0.0
    for i, (t0, t1) in enumerate(buffers):
        sz, tb, tsp = sizes[t0:t1], T_b[t0:t1], T_sp[t0:t1]
        if dense is not None:
            d = {int(l) - t0 for l in dense if t0 <= int(l) < t1}
        elif i == 0 and o.first_buffer == "per-tensor":
            d = set()  # eq. 2 is for 2 <= i <= M: the first buffer keeps per-tensor Step 1
        else:
            d = select_dense(sz, tb, tsp, T_cm_prev, o.density, o.density_floor)
        kb = density_aware_counts(sz, d, o.density, o.density_floor)
        if split is not None:
            lp = int(split[i])
            t_ar, t_ag = times(sum(sz[j] for j in d if j < lp),
                               sum(sz[j] for j in d if j >= lp),
                               sum(kb[j] for j in range(len(sz)) if j not in d))
        elif o.interleave:
            lp, t_ar, t_ag = interleave_split(sz, d, kb, tb, tsp, times)
        else:
            lp = 0
            t_ar, t_ag = times(0, sum(sz[j] for j in d),
                               sum(kb[j] for j in range(len(sz)) if j not in d))
        T_cm_prev = t_ar + t_ag
        for j in range(t1 - t0):
            k[t0 + j] = -1 if j in d else kb[j]
        lps.append(lp)
    if dense is not None and {int(l) for l in dense} - {l for l in range(L) if k[l] < 0}:
        raise ValueError(f"dense tensors {sorted(dense)} are not all tensor indices 0..{L - 1}")
    off = (plan_offload(T_b, T_cpu, np.array([v >= 0 for v in k]), buffers) if o.offload
           else np.zeros(L, dtype=bool))
    return SSFusionPlan(o.fusion, sizes, warm, buffers, tuple(k), tuple(lps),
                        tuple(bool(v) for v in off), True)

# -- the strategy ---------------------------------------------------------------------------------
@dataclass
class _Segment:
    """One sparsified unit: a tensor (selective, per-tensor) or a whole buffer (multi-tensor)."""

    sid: int
    a: int
    b: int
    k: int
    slot: int
    offload: bool = False


def _placeable(event):
    """``event`` if a compute event can be placed right after it on the compute stream
    (:meth:`substrate.timeline.Timeline.compute`'s ``after``), else ``None`` (additive clock,
    no per-layer events: the event then goes at the end of the stream)."""
    if event is None or event.kind != "compute" or event.resource != "compute":
        return None
    return event if event.order == (event.index,) else None


@dataclass
class _Buffer:
    """The fixed communication layout of one fusion buffer."""

    a: int
    b: int
    ar: list  # flat ranges all-reduced
    agd: list  # flat ranges of dense tensors all-gathered
    segs: list
    n_ar: int = 0
    n_agd: int = 0
    K: int = 0
    ar_buf: object = None
    send: object = None  # int32: [dense values | sparse values | sparse flat indices]


@register
class SSFusion(Strategy):
    """Fusion buffers with selective (or per-tensor / multi-tensor) sparsification."""

    name = "ssfusion"
    Options = SSFusionOptions

    def __init__(self, ctx, options: SSFusionOptions) -> None:
        super().__init__(ctx, options)
        xp, layout = self.xp, self.layout
        g = ctx.model.grads.flat
        if g.dtype != np.float32:
            raise ValueError(f"ssfusion packs float32 values with int32 indices; the model is "
                             f"{g.dtype} (build it with dtype float32)")
        if layout.total >= 2 ** 31:
            raise ValueError(f"{layout.total} parameters do not fit int32 indices")
        self.names = layout.names
        self.L = len(self.names)
        self.sizes = [int(layout.sizes[n]) for n in self.names]
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        self._offsets_x = xp.asarray(self.offsets)
        self.index_of = {n: i for i, n in enumerate(self.names)}
        world = self.topo.world
        self._plan_args = (self.sizes, world.size, world.slowest, options, self.run.cost)
        # the plan at once when it needs no timings; else a placeholder on a zero profile that
        # fixes the warm-up buffers and is replaced by the decided plan at the end of warm-up
        zero = np.zeros(self.L)
        self._template = plan_ssfusion(*self._plan_args, itemsize=g.dtype.itemsize,
                                       profile=(zero, zero, zero) if needs_profile(options)
                                       else None)
        self.buffers = self._template.buffers
        self.residual = xp.zeros_like(g)
        self.warmup = int(options.profile_steps)
        self.plan: SSFusionPlan | None = None
        # DGC momentum correction: the optimizer's momentum moves here, before sparsification
        self.mu = 0.0
        opt_cfg = getattr(ctx.opt, "config", None)
        if options.momentum_correction and hasattr(ctx.opt, "exp_avg_sq"):
            raise ValueError("--momentum-correction moves SGD's momentum before sparsification "
                             "(DGC); AdamW keeps two moments it cannot move: add "
                             "--no-momentum-correction (or use --optimizer sgd)")
        if options.momentum_correction and getattr(ctx.opt, "momentum_buffer", None) is not None:
            if getattr(opt_cfg, "nesterov", False):
                raise ValueError("--momentum-correction implements DGC's heavy-ball momentum; "
                                 "Nesterov momentum is not supported: add "
                                 "--no-momentum-correction")
            self.mu = float(opt_cfg.momentum)
            ctx.opt.momentum_buffer = None  # the optimizer applies the synced update as is
        self.velocity = xp.zeros_like(g) if self.mu else None
        self._bufs: list[_Buffer] = []
        self._seg_of: dict = {}
        # profiling (selective): sums and step counts of T_b, T_sp, T_cpu per tensor and of the
        # backward span without / with the offload worker busy
        self._sums = {f: np.zeros(self.L) for f in cv.PROFILE_FIELDS}
        self._sums.update(span_plain=np.zeros(1), span_worker=np.zeros(1))
        self._counts_prof = dict.fromkeys(self._sums, 0)
        self._profile: np.ndarray | None = None
        self._offload_guard: dict | None = None
        self._t_ready = np.zeros(self.L)
        self._ready_count = 0
        self._step = 0  # the step whose backward runs (for on_ready)
        self._executor = ThreadPoolExecutor(1, "ssfusion-offload") if options.offload else None
        self._futures: dict[int, object] = {}
        # the worker's events are timed on the worker thread by the run's compute source; a GPU
        # run's worker does host work that CUDA events cannot see: its thread CPU time
        self._worker_source = (CpuTimeSource("thread") if self.run.backend.is_gpu
                               else self.run.clock.source)
        self._profile_event = None  # timeline: the warm-up profiling event of this step
        self._comm_event = None  # timeline: the last warm-up all-reduce of this step
        self._prof_futures: list = []
        self._k_full = topk_k(self.sizes, options.density)
        self._host_res: dict[int, np.ndarray] = {}
        self._host_vel: dict[int, np.ndarray] = {}
        # step bookkeeping and statistics
        self._last: tuple[str, bool] = ("none", False)
        self._stats = {"sparse_steps": 0, "sparsify_s": 0.0, "worker_s": 0.0,
                       "profile_s": 0.0, "missing": 0.0, "missing_global": 0.0}
        self._missing_by_tensor = np.zeros(self.L)
        if not needs_profile(options):
            self._install(self._template)

    # -- plan installation ------------------------------------------------------------------------
    def _install(self, plan: SSFusionPlan) -> None:
        """Execute the plan: build the fixed per-buffer layouts and send buffers (plan once,
        run many)."""
        xp, off = self.xp, self.offsets
        multi = plan.fusion == "multi-tensor"
        self.plan = plan
        self.buffers = plan.buffers
        self._bufs = []
        for i, (t0, t1) in enumerate(plan.buffers):
            a, b = int(off[t0]), int(off[t1])
            buf = _Buffer(a=a, b=b, ar=[], agd=[], segs=[])
            if multi:
                K = sum(plan.k[t0:t1])
                buf.segs.append(_Segment(sid=self.L + i, a=a, b=b, k=K, slot=0))
            else:
                slot = 0
                for l in range(t0, t1):
                    ra, rb = int(off[l]), int(off[l + 1])
                    if plan.k[l] < 0:
                        (buf.ar if l - t0 < plan.split[i] else buf.agd).append((ra, rb))
                    else:
                        buf.segs.append(_Segment(sid=l, a=ra, b=rb, k=plan.k[l], slot=slot,
                                                 offload=plan.offload[l]))
                        slot += plan.k[l]
            buf.n_ar = sum(rb - ra for ra, rb in buf.ar)
            buf.n_agd = sum(rb - ra for ra, rb in buf.agd)
            buf.K = sum(s.k for s in buf.segs)
            buf.ar_buf = xp.empty(buf.n_ar, dtype=np.float32)
            buf.send = xp.empty(buf.n_agd + 2 * buf.K, dtype=np.int32)
            self._bufs.append(buf)
        self._seg_of = {s.sid: (buf, s) for buf in self._bufs for s in buf.segs}
        if self.run.backend.is_gpu:
            self._host_res = {s.sid: np.zeros(s.b - s.a, dtype=np.float32)
                              for buf in self._bufs for s in buf.segs if s.offload}
            if self.mu:
                self._host_vel = {sid: np.zeros_like(r) for sid, r in self._host_res.items()}

    def _counts(self) -> tuple[list[int], list[int], list[int]]:
        """Per buffer: all-reduced elements, all-gathered dense elements, sparse count."""
        return ([b.n_ar for b in self._bufs], [b.n_agd for b in self._bufs],
                [b.K for b in self._bufs])

    # -- per-tensor hook --------------------------------------------------------------------------
    def on_ready(self, name: str) -> None:
        """Profile timestamps during warm-up; afterwards submit offloaded sparsifications."""
        l = self.index_of[name]
        if self.plan is None or self._step < self.warmup:
            self._t_ready[l] = time.perf_counter()
            self._ready_count += 1
            if self._executor is not None and self.plan is None and self._step % 2 == 1:
                self._prof_futures.append(self._executor.submit(
                    self._profile_job, l, self._step, self._t_ready[l]))
            return
        if self._executor is not None and self.plan.offload[l]:
            buf, seg = self._seg_of[l]
            self._futures[l] = self._executor.submit(self._offload_job, buf, seg, self._step)

    # -- sparsification ---------------------------------------------------------------------------
    def _rng(self, step: int, sid: int) -> tuple:
        """Key of the segment's sampling generator (:func:`dataparallel.sparsify.segment_rng`:
        run seed, rank, step, segment), built lazily by the sparsifier."""
        return (self.ctx.seed, self.topo.rank, step, sid)

    def _sparsify(self, x, k: int, key: tuple):
        """Positions of (at most) ``k`` large ``|x|`` by ``--sparsifier``."""
        kind = self.options.sparsifier
        if kind == "dgc":
            return dgc_topk(x, k, key, self.options.sample_ratio)
        if kind == "gaussiank":
            return gaussiank_select(x, k)
        return exact_select(x, k)

    def _select(self, buf: _Buffer, seg: _Segment, step: int) -> None:
        """Sparsify one segment in place: with momentum correction ``u = μ u + g`` and ``a =
        e + u`` (else ``a = e + g``), top-``k`` of ``a`` into ``buf.send``, ``e = a`` and ``u``
        with the sent entries zeroed (DGC's momentum factor masking)."""
        g = self.ctx.model.grads.flat
        a, b = seg.a, seg.b
        src = g[a:b]
        if self.velocity is not None:
            u = self.velocity[a:b]
            u *= self.mu
            u += src
            src = u
        if self.options.error_feedback:
            acc = self.residual[a:b]
            acc += src
        else:
            acc = src
        idx = self._sparsify(acc, seg.k, self._rng(step, seg.sid))
        self._put(buf, seg, acc[idx], idx)
        if self.options.error_feedback:
            acc[idx] = 0
        if self.velocity is not None:
            self.velocity[a:b][idx] = 0

    def _put(self, buf: _Buffer, seg: _Segment, values, idx) -> None:
        """Values and flat indices into the segment's slots; slots a sparsifier left empty
        (Gaussian-k) carry the value 0 at the segment's first index."""
        v0 = buf.n_agd + seg.slot
        i0 = buf.n_agd + buf.K + seg.slot
        c = int(idx.size)
        buf.send[v0:v0 + c] = values.astype(np.float32, copy=False).view(np.int32)
        buf.send[i0:i0 + c] = (idx + seg.a).astype(np.int32)
        if c < seg.k:
            buf.send[v0 + c:v0 + seg.k] = 0
            buf.send[i0 + c:i0 + seg.k] = seg.a

    def _offload_job(self, buf: _Buffer, seg: _Segment, step: int):
        """Worker thread: sparsify one tensor on the CPU (on a GPU run: copy to the host, select
        with NumPy, keep its residual on the host; the main thread copies the result back).

        Returns ``(wall seconds, simulated seconds, host result or None)``: the simulated
        seconds are the run's compute source's reading taken on this thread (thread CPU time of
        the worker, or the FLOP estimate :meth:`_segment_flops`; on a GPU run the worker's
        thread CPU time, as CUDA events would not see host work)."""
        t = time.perf_counter()
        src = self._worker_source
        with src.measure(self._segment_flops(seg), None, f"ssf_offload:{seg.sid}") as m:
            if not self.run.backend.is_gpu:
                self._select(buf, seg, step)
                host_out = None
            else:
                host = self.ctx.model.grads.flat[seg.a:seg.b].get()
                if self.mu:
                    u = self._host_vel[seg.sid]
                    u *= self.mu
                    u += host
                    host = u
                if self.options.error_feedback:
                    acc = self._host_res[seg.sid]
                    acc += host
                else:
                    acc = host
                idx = self._sparsify(acc, seg.k, self._rng(step, seg.sid))
                values = acc[idx].copy()
                if self.options.error_feedback:
                    acc[idx] = 0
                if self.mu:
                    self._host_vel[seg.sid][idx] = 0
                host_out = (values, idx)
        return time.perf_counter() - t, m.seconds, host_out

    def _segment_flops(self, seg: _Segment) -> float:
        """Element operations of sparsifying one segment (the ``flops`` compute source's count):
        momentum ``u = μ u + g`` (``2n``), error feedback ``a = e + u`` (``n``), the selection
        (:func:`dataparallel.sparsify.selection_flops`) and the gather and masking of the ``k``
        sent entries (``2k``)."""
        n = seg.b - seg.a
        return (selection_flops(n, seg.k, self.options.sparsifier, self.options.sample_ratio)
                + (2 * n if self.mu else 0) + (n if self.options.error_feedback else 0)
                + 2 * seg.k)

    def _buffer_flops(self, buf: _Buffer) -> float:
        """Element operations of one buffer's step on the compute stream: momentum of its dense
        tensors (``2n``), packing them into the send buffers (``n``) and the sparsification of
        its segments not offloaded."""
        n_dense = sum(rb - ra for ra, rb in buf.ar + buf.agd)
        dense = n_dense if self.mu else 0
        # + packing the dense ranges into the send buffers (one copy each)
        return 2.0 * dense + n_dense + sum(self._segment_flops(s) for s in buf.segs
                                 if not (s.offload and s.sid in self._futures))

    def _prepare_buffer(self, buf: _Buffer, step: int) -> None:
        """Main thread, one buffer: plain momentum ``u = μ u + g`` of its dense tensors (sent as
        they are) and the sparsification of its segments not handed to the worker."""
        g = self.ctx.model.grads.flat
        if self.velocity is not None:
            u = self.velocity
            for ra, rb in buf.ar + buf.agd:
                u[ra:rb] *= self.mu
                u[ra:rb] += g[ra:rb]
                g[ra:rb] = u[ra:rb]
        for seg in buf.segs:
            if not (seg.offload and seg.sid in self._futures):
                self._select(buf, seg, step)

    def _collect_offloaded(self, buf: _Buffer) -> list:
        """Wait for the worker's segments of ``buf``, copy GPU-run results into the send buffer,
        and declare each as an event on the timeline's ``offload`` stream after its gradients'
        ready event (SSFusion-O, §IV-C: the worker runs during the backward)."""
        clock, xp = self.run.clock, self.xp
        tl = clock.timeline
        events = []
        for seg in buf.segs:
            fut = self._futures.pop(seg.sid, None)
            if fut is None:
                continue
            dt, sim, host = fut.result()
            self._stats["worker_s"] += dt
            if host is not None:
                self._put(buf, seg, xp.asarray(host[0]), xp.asarray(host[1]))
            if tl is not None:
                events.append(tl.compute(f"ssf_offload[{self.names[seg.sid]}]", sim,
                                         deps=clock.ready(seg.a, seg.b), stream="offload"))
        return events

    # -- one step ---------------------------------------------------------------------------------
    def sync(self, state, buffers):
        """One sparse step, buffer by buffer in backward order: prepare (dense momentum,
        sparsification on the compute stream; offloaded segments from the worker), all-reduce
        ``Buffer_AR``, all-gather ``Buffer_AG``.

        On the timeline each buffer's preparation is a compute event ``ssf_sparsify[i]`` after
        its gradients' ready event (:meth:`SimClock.ready`), its offloaded segments are events
        on the ``offload`` stream (:meth:`_collect_offloaded`), its all-reduce (``DENSE``, ring,
        ``4 n_AR`` bytes) follows its preparation and its all-gather (``SPARSE``, ring, ``p``
        blocks of ``4 n_AG + 8 K``) follows the preparation and the offloaded segments.  The
        collectives run one after another, in this order, on one communication channel (the
        blocking calls here; the paper's pipeline, in which buffer ``i`` starts its
        communication when it is ready and buffer ``i-1``'s has ended: eq. 2, Fig. 10,
        :func:`find_opt_fusion`), so buffer ``i``'s collectives overlap buffer ``i+1``'s
        sparsification and the rest of the backward, not each other."""
        g = buffers.flat
        step = int(state.step)
        if self.plan is None or step < self.warmup:
            return self._warmup_sync(step, g)
        clock, sync_dev = self.run.clock, self.run.backend.synchronize
        tl = clock.timeline
        world, p = self.topo.world, self.topo.size
        gathered_idx = []
        comm = None  # the last collective declared: they run one after another
        for i, buf in enumerate(self._bufs):
            ready = clock.ready(buf.a, buf.b)
            # the buffer's preparation (momentum, sparsification, packing both send buffers:
            # the all-reduced and all-gathered ranges are disjoint) is launched on the compute
            # stream as soon as the backward has written the buffer (the paper's pipeline,
            # Fig. 10), although this code runs it after the backward
            with clock.compute(f"ssf_sparsify[{i}]", flops=self._buffer_flops(buf),
                               deps=ready, after=_placeable(ready)):
                t = time.perf_counter()
                self._prepare_buffer(buf, step)
                o = 0
                for ra, rb in buf.ar:
                    buf.ar_buf[o:o + rb - ra] = g[ra:rb]
                    o += rb - ra
                o = 0
                for ra, rb in buf.agd:
                    buf.send[o:o + rb - ra] = g[ra:rb].view(np.int32)
                    o += rb - ra
                sync_dev()
                self._stats["sparsify_s"] += time.perf_counter() - t
            prepared = clock.last_event if tl is not None else None
            offloaded = self._collect_offloaded(buf)
            if buf.n_ar:
                world.allreduce(buf.ar_buf, "avg", phase=cv.DENSE)
                if tl is not None:
                    comm = tl.collective(world, cv.DENSE, buf.ar_buf.nbytes,
                                         deps=[prepared, comm], label=f"{cv.DENSE}[{i}]")
                with clock.compute(f"ssf_unpack_dense[{i}]", flops=float(buf.n_ar),
                                   deps=comm):
                    o = 0
                    for ra, rb in buf.ar:
                        g[ra:rb] = buf.ar_buf[o:o + rb - ra]
                        o += rb - ra
            if buf.send.size:
                rows = world.allgather(buf.send, phase=cv.SPARSE)
                if tl is not None:
                    comm = tl.collective(world, cv.SPARSE, p * buf.send.nbytes,
                                         algorithm="allgather",
                                         deps=[prepared, *offloaded, comm],
                                         label=f"{cv.SPARSE}[{i}]")
                # element operations: the p dense blocks summed, the p K entries
                # scatter-added, the buffer's dense and sparse ranges written back
                with clock.compute(f"ssf_unpack_sparse[{i}]",
                                   flops=float(p * buf.n_agd + 2 * p * buf.K + buf.b - buf.a),
                                   deps=comm):
                    self._unpack_gathered(buf, rows, g, p, gathered_idx)
        with clock.diagnostic():
            self._count_missing(gathered_idx)
        self._stats["sparse_steps"] += 1
        self._last = ("sparse", False)
        return g

    def _unpack_gathered(self, buf, rows, g, p: int, gathered_idx: list) -> None:
        """Average the gathered dense tensors and scatter-add the gathered sparse entries of
        one buffer into ``g``."""
        xp = self.xp
        nd, K = buf.n_agd, buf.K
        if nd:
            dense = rows[:, :nd].view(np.float32).astype(np.float64).sum(axis=0) / p
            o = 0
            for ra, rb in buf.agd:
                g[ra:rb] = dense[o:o + rb - ra]
                o += rb - ra
        if K:
            values = rows[:, nd:nd + K].reshape(-1).view(np.float32)
            idx = rows[:, nd + K:].reshape(-1)
            summed = xp.bincount(idx - buf.a, weights=values.astype(np.float64),
                                 minlength=buf.b - buf.a) / p
            for seg in buf.segs:
                g[seg.a:seg.b] = summed[seg.a - buf.a:seg.b - buf.a]
            gathered_idx.append(idx[values != 0])

    def _warmup_sync(self, step: int, g):
        """Dense all-reduce of every warm-up buffer (with momentum correction, of ``u = μ u +
        g``); a plan that needs timings also profiles (T_b, T_sp, T_cpu) and, after the last
        warm-up step, is decided.

        On the timeline the profiling and the momentum update are compute events after the
        backward (they read the whole gradient), each warm-up buffer's all-reduce (``WARMUP``)
        starts when its gradients are ready, those events are done and the previous buffer's
        all-reduce has ended, and the decision's profile all-reduce and plan broadcast
        (:meth:`_decide`) follow the profiling and the last all-reduce."""
        clock = self.run.clock
        tl = clock.timeline
        profiling = self.plan is None
        after = []
        self._profile_event = None
        if profiling:
            with clock.compute("ssf_profile"):
                t = time.perf_counter()
                self._profile_step(step, g)
                self._stats["profile_s"] += time.perf_counter() - t
            if tl is not None:
                self._profile_event = clock.last_event
                after.append(clock.last_event)
        if self.velocity is not None:
            with clock.compute("ssf_momentum", flops=2.0 * g.size):
                self.velocity *= self.mu
                self.velocity += g
                g[...] = self.velocity
            if tl is not None:
                after.append(clock.last_event)
        world = self.topo.world
        self._comm_event = None
        for (t0, t1) in self._template.warmup_buffers:
            a, b = int(self.offsets[t0]), int(self.offsets[t1])
            world.allreduce(g[a:b], "avg", phase=cv.WARMUP)
            if tl is not None and b > a:
                self._comm_event = tl.collective(
                    world, cv.WARMUP, (b - a) * g.itemsize,
                    deps=[clock.ready(a, b), *after, self._comm_event])
        decided = profiling and step == self.warmup - 1
        if decided:
            self._decide()
        self._last = ("warmup", decided)
        self._ready_count = 0
        return g

    def _profile_job(self, l: int, step: int, t_submit: float):
        """Worker thread, warm-up with ``--offload``: time tensor ``l``'s sparsification on the
        CPU worker while the backward goes on (read-only: the result is discarded)."""
        t_start = time.perf_counter()
        x = self.ctx.model.grads.flat[self.offsets[l]:self.offsets[l + 1]]
        # service time by the run's compute source on this thread (consistent with T_b, T_sp)
        with self._worker_source.measure(selection_flops(x.size, self._k_full[l],
                                                          self.options.sparsifier,
                                                          self.options.sample_ratio)) as m:
            self._sparsify(self.run.backend.asnumpy(x), self._k_full[l], self._rng(step, l))
        return l, t_submit, t_start, time.perf_counter(), m.seconds

    def _source_ready_times(self) -> np.ndarray | None:
        """When each tensor's gradient was written in this step's backward, in the compute
        source's seconds: the compute-stream events up to its ready event
        (:meth:`SimClock.ready`), summed; ``None`` without per-layer events (the ``on_ready``
        wall-clock timestamps are used then)."""
        clock = self.run.clock
        if clock.timeline is None or clock.layers is None or clock.layers.last is None:
            return None
        events = clock.timeline.open_events
        cum = np.cumsum([e.seconds if e.kind == "compute" and e.resource == "compute" else 0.0
                         for e in events])
        return np.array([cum[clock.ready(int(self.offsets[l]), int(self.offsets[l + 1])).index]
                         for l in range(self.L)])

    def _profile_step(self, step: int, g) -> None:
        """One warm-up step's timings (sums, averaged in :meth:`_decide`).

        ``T_b`` from the compute source's per-layer events (:meth:`_source_ready_times`; else
        the ``on_ready`` timestamps) of steps without the worker; with
        ``--offload`` every second warm-up step runs each tensor's sparsification on the worker
        from ``on_ready``, concurrently with the rest of the backward as it will run: ``T_cpu``
        is its service time on the worker by the run's compute source (contention with the
        backward is left to the offload guard), and the backward span (first to last ready) of those steps against the plain ones measures how much the worker slows the
        backward down.  ``T_sp`` is timed on the main thread after the backward by the compute
        source (event ``ssf_tsp:l``).  Without
        offload profiling ``T_cpu = T_sp`` and both spans are 0.
        """
        backend = self.run.backend
        sums, counts = self._sums, self._counts_prof
        worker_step = bool(self._prof_futures)
        if self._ready_count == self.L:  # every on_ready seen this step
            span = self._t_ready[-1] - self._t_ready[0]
            if worker_step:
                sums["span_worker"] += span
                counts["span_worker"] += 1
            else:
                sums["span_plain"] += span
                counts["span_plain"] += 1
                t_ready = self._source_ready_times()
                if t_ready is None:            # no per-layer events: wall-clock timestamps
                    t_ready = self._t_ready
                sums["T_b"] += np.maximum(np.diff(t_ready, prepend=t_ready[0]), 0)
                counts["T_b"] += 1
        t_cpu = np.zeros(self.L)
        for fut in self._prof_futures:
            l, _, _, _, service_s = fut.result()
            t_cpu[l] = service_s
        if len(self._prof_futures) == self.L:
            sums["T_cpu"] += t_cpu
            counts["T_cpu"] += 1
        self._prof_futures.clear()
        source = self.run.clock.source
        for l in range(self.L):
            a, b = int(self.offsets[l]), int(self.offsets[l + 1])
            backend.synchronize()
            # timed by the run's compute source (not the wall clock), so a loaded host or a
            # replayed profile plans the same buffers
            with source.measure(selection_flops(b - a, self._k_full[l],
                                                self.options.sparsifier,
                                                self.options.sample_ratio),
                                label=f"ssf_tsp:{l}") as m:
                self._sparsify(g[a:b], self._k_full[l], self._rng(step, l))
                backend.synchronize()
            sums["T_sp"][l] += m.seconds
        counts["T_sp"] += 1

    def _profile_vector(self) -> np.ndarray:
        """The averaged profile, ``3L + 2`` float64 (:func:`volume.ssfusion.profile_length`)."""
        sums, n = self._sums, self._counts_prof

        def mean(f, fallback):
            return sums[f] / n[f] if n[f] else fallback

        t_sp = mean("T_sp", np.zeros(self.L))
        spans = (np.concatenate([mean("span_plain", None), mean("span_worker", None)])
                 if n["span_plain"] and n["span_worker"] else np.zeros(2))
        return np.ascontiguousarray(np.concatenate(
            [mean("T_b", np.zeros(self.L)), t_sp, mean("T_cpu", t_sp), spans]),
            dtype=np.float64)

    def _decide(self) -> None:
        """Max-reduce the profiled timings, plan on rank 0 (:func:`plan_ssfusion`), broadcast
        the plan (§IV-B online profiling: buffers and selection are recorded once and fixed).

        Offload guard (not in the paper, whose backward runs on the GPU): the offload set of
        :func:`plan_offload` is kept only when the main-thread sparsification time it saves,
        ``Σ_{l∈O} T_sp^l``, exceeds the measured slowdown of the backward while the worker is
        busy (span with worker - span without).  On a CPU-only run with no spare core the worker
        competes with the backward and offloading is switched off.
        """
        o, L = self.options, self.L
        prof = self._profile_vector()
        world = self.topo.world
        world.allreduce(prof, "max", phase=cv.PROFILE)
        tl = self.run.clock.timeline
        if tl is not None:
            ev = tl.collective(world, cv.PROFILE, prof.nbytes,
                               deps=[self._profile_event, self._comm_event])
        self._profile = prof[:3 * L].reshape(len(cv.PROFILE_FIELDS), L)
        T_b, T_sp, T_cpu = self._profile
        code = np.zeros(cv.plan_length(L), dtype=np.int64)
        if world.rank == 0:
            plan = plan_ssfusion(*self._plan_args, profile=(T_b, T_sp, T_cpu))
            if o.offload:
                off = np.array(plan.offload)
                saved = float(T_sp[off].sum())
                slowdown = float(prof[3 * L + 1] - prof[3 * L])
                keep = saved > slowdown
                self._offload_guard = {"saved_s": saved, "backward_slowdown_s": slowdown,
                                       "candidates": [self.names[l] for l in np.flatnonzero(off)],
                                       "enabled": bool(keep)}
                if not keep:
                    plan = dataclasses.replace(plan, offload=(False,) * L)
            code[:] = plan.encode()
        world.bcast(code, 0, phase=cv.SELECT)
        if tl is not None:  # rank 0 plans between the two (host work, not timed)
            tl.collective(world, cv.SELECT, code.nbytes, algorithm="bcast", deps=ev)
        self._install(self._template.decode(code))

    def _count_missing(self, gathered_idx) -> None:
        """Tensor-missing rate (Table I): tensors with no entry sent (with a non-zero value) by
        this rank, and by no rank (dense tensors are never missing)."""
        xp = self.xp
        own = [buf.send[buf.n_agd + buf.K:][buf.send[buf.n_agd:buf.n_agd + buf.K] != 0]
               for buf in self._bufs if buf.K]
        dense = np.array([k < 0 for k in self.plan.k], dtype=bool)

        def missing(idx_list) -> np.ndarray:
            if not idx_list:
                return ~dense
            idx = xp.concatenate(idx_list)
            tid = xp.searchsorted(self._offsets_x, idx, side="right") - 1
            hit = xp.bincount(tid, minlength=self.L) > 0
            hit = hit.get() if hasattr(hit, "get") else hit
            return ~(hit | dense)

        mine = missing(own)
        self._missing_by_tensor += mine
        self._stats["missing"] += mine.sum() / self.L
        self._stats["missing_global"] += missing(gathered_idx).sum() / self.L

    def after_step(self, state) -> None:
        self._step = int(state.step) + 1

    def step_bytes(self) -> dict[str, dict]:
        """The plan's closed form of the last step (:meth:`SSFusionPlan.step_bytes`)."""
        kind, decided = self._last
        if kind == "none":
            return {}
        plan = self.plan if self.plan is not None else self._template
        return plan.step_bytes(self.M, self.P, kind, decided)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Error-feedback residuals (the host-side ones of offloaded tensors on a GPU run), the
        installed selection, the profile sums or the decided profile and offload guard, the
        statistics and the step whose backward runs next."""
        host = self.run.backend.asnumpy
        state = {
            "residual": host(self.residual).copy(),
            "velocity": (host(self.velocity).copy() if self.velocity is not None
                         else np.zeros(0, np.float32)),
            "plan": self.plan.encode() if self.plan is not None else np.zeros(0, np.int64),
            "profile": (self._profile.copy() if self._profile is not None
                        else np.zeros((0, self.L))),
            "offload_guard": json.dumps(self._offload_guard),
            "counts_prof": json.dumps(self._counts_prof), "stats": json.dumps(self._stats),
            "missing_by_tensor": self._missing_by_tensor.copy(), "step": np.int64(self._step),
        }
        state.update({f"sums/{k}": v.copy() for k, v in self._sums.items()})
        state.update({f"host_res/{sid}": r.copy() for sid, r in self._host_res.items()})
        state.update({f"host_vel/{sid}": r.copy() for sid, r in self._host_vel.items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.residual[...] = self.xp.asarray(state["residual"])
        if self.velocity is not None:
            self.velocity[...] = self.xp.asarray(state["velocity"])
        if state["plan"].size:
            self._install(self._template.decode(state["plan"]))
        self._profile = state["profile"].copy() if state["profile"].size else None
        self._offload_guard = json.loads(str(state["offload_guard"]))
        self._counts_prof = json.loads(str(state["counts_prof"]))
        self._stats = json.loads(str(state["stats"]))
        self._missing_by_tensor = state["missing_by_tensor"].copy()
        self._step = int(state["step"])
        self._sums = {k: state[f"sums/{k}"].copy() for k in self._sums}
        for sid, r in self._host_res.items():
            r[...] = state[f"host_res/{sid}"]
        for sid, r in self._host_vel.items():
            r[...] = state[f"host_vel/{sid}"]

    # -- summary ----------------------------------------------------------------------------------
    def report(self) -> dict:
        o, st = self.options, self._stats
        out = {"fusion": o.fusion, "fusion_policy": o.fusion_policy, "sparsifier": o.sparsifier,
               "momentum_correction": self.mu, "buffers": len(self.buffers),
               "buffer_tensors": [list(self.names[t0:t1]) for t0, t1 in self.buffers],
               "warmup_buffer_tensors": [list(self.names[t0:t1])
                                         for t0, t1 in self._template.warmup_buffers],
               "profile_steps": self.warmup, "sparse_steps": st["sparse_steps"]}
        if self.plan is None:
            return out
        ar, agd, ks = self._counts()
        sparse = self.plan.step_bytes(self.M, self.P, "sparse")
        ddp_buckets = flat_buckets(self.layout, int(DDPOptions().bucket_mib * (1 << 20)), 4)
        ddp = ddp_step_bytes(M=self.M, P=self.P, bucket_sizes=[b - a for a, b in ddp_buckets])
        ddp_total = sum(ddp["grad_allreduce"].values())
        n = max(1, st["sparse_steps"])
        out.update({
            "payload_ratio": cv.payload_ratio(self.layout.total, ar, agd, ks),
            "bytes_per_step_vs_ddp": (sum(sum(v.values()) for v in sparse.values()) / ddp_total
                                      if ddp_total else None),
            "transmitted_elements": sum(ar) + sum(agd) + sum(ks),
            "target_elements": sum(topk_k(self.sizes, o.density)),
            "tensor_missing_rate": st["missing"] / n,
            "tensor_missing_rate_global": st["missing_global"] / n,
            "missing_by_tensor": {self.names[l]: float(c / n)
                                  for l, c in enumerate(self._missing_by_tensor) if c},
            "sparsify_s_per_step": st["sparsify_s"] / n,
            "offload_worker_s_per_step": st["worker_s"] / n,
            "selection": {
                "dense": [self.names[l] for l in self.plan.dense()],
                "offloaded": [self.names[l] for l, f in enumerate(self.plan.offload) if f],
                "k": ({f"buffer{i}": b.K for i, b in enumerate(self._bufs)}
                      if o.fusion == "multi-tensor" else
                      {self.names[l]: int(k) for l, k in enumerate(self.plan.k) if k >= 0}),
                "split": list(self.plan.split),
                "allreduce_elements": ar, "allgather_dense_elements": agd,
                "sparse_elements": ks},
        })
        if self._profile is not None:
            out["profile"] = {f: {self.names[l]: float(v) for l, v in enumerate(row)}
                              for f, row in zip(cv.PROFILE_FIELDS, self._profile)}
            out["profile_s"] = st["profile_s"]
        if self._offload_guard is not None:
            out["offload_guard"] = self._offload_guard
        return out
