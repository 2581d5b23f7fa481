"""SSFusion: tensor fusion with selective sparsification (seed paper 004, §III-IV).

The tensors (backward order, the model's flat layout) are cut once into fusion buffers
``B_1 .. B_{N_B}`` (``--buffers N``: ``N`` buffers of equal tensor count, as the paper's
``N_i`` tensors per buffer; or ``--buffer-mib``: a byte budget per buffer).  Every step each rank
adds its error-feedback residual to the fresh gradient, ``a = g + e``, and, per ``--fusion``:

``selective`` (SSFusion, §IV-B)
    in every buffer the smallest tensors ``D_i`` stay dense and the others ``S_i`` are
    sparsified one by one (:func:`dataparallel.sparsify.dgc_topk`: DGC sampled threshold,
    refinement, trim to exactly ``k_l``).  The selection is profiled during ``--profile-steps``
    dense steps and fixed afterwards (:func:`plan_selective`):

    * *overlap-maximized selection*: walk ``B_i``'s tensors by ascending size and leave them
      dense until eq. 2 holds, ``T_cm^{i-1} ≥ Σ_{j∈B_i} (T_b^j + T_sp^j)`` (sparsification time
      counted for sparse tensors only; ``T_cm^0 = 0``: nothing hides the first buffer);
    * *density-aware sparsification*: the counts of ``S_i`` are lowered so that the buffer still
      sends ``K_i = Σ_{l∈B_i} ⌈d n_l⌉`` elements, never below the floor ``⌈d_min n_l⌉``
      (``--density-floor``, 0.001); a tensor stays dense only while that compensation is
      feasible (:func:`commvol.ssfusion.density_aware_counts`);
    * *interleaved communication* (SSFusion-I, §IV-D, ``--interleave``): the split ``l'_i``
      minimizing ``T1 + T2`` (:func:`interleave_split`) sends the dense tensors among the
      first ``l'_i`` with a ring all-reduce (``Buffer_AR``) and the rest with one all-gather
      (``Buffer_AG``: dense values, then float32 values and int32 indices of the sparse ones);
      ``--no-interleave`` all-gathers the whole buffer (SSFusion "naive");
    * *offloading* (SSFusion-O, §IV-C, ``--offload``): the sparsification of large tensors whose
      CPU time fits under the rest of the backward pass (:func:`plan_offload`) is submitted from
      :meth:`SSFusion.on_ready` to one CPU worker thread and collected in :meth:`SSFusion.sync`;
      a guard measured during warm-up keeps it only when the main-thread time it saves exceeds
      the slowdown the busy worker causes to the backward (see :meth:`SSFusion._decide`).
``per-tensor``
    every tensor sparsified at density ``d`` (``k_l = ⌈d n_l⌉``), each buffer all-gathered.
``multi-tensor``
    each buffer sparsified as one vector with ``K_i`` entries, all-gathered; tensors with no
    selected entry are *missing* (Table I's tensor-missing rate, reported).

Every mode starts with ``--profile-steps`` dense steps (each buffer averaged with one ring
all-reduce, no residual), so the three modes differ only in the sparsification.  The
synchronized gradient is ``(1/p) Σ_j (dense part + sparse(a_j))``; the residual keeps the
unsent entries (``e = a - sparse(a)``, zero for dense tensors).

Profiling (selective): ``T_b^l`` from :meth:`SSFusion.on_ready` timestamps (the gap to the
previous tensor's; the first tensor gets 0 as the trainer has no backward-start hook),
``T_sp^l`` by timing the sparsifier on tensor ``l`` itself after the backward, ``T_cpu^l``
(with ``--offload``, on every second warm-up step) by running it on the worker thread from
``on_ready``, concurrently with the rest of the backward as it will run (hand-off and contention
included; without offload ``T_cpu = T_sp``), communication times from the run's α–β model.
The timings are max-reduced over all ranks, rank 0 plans and broadcasts the plan, so every rank
uses the same selection.  Closed forms: :mod:`commvol.ssfusion`.

Simulation notes: the collectives are blocking and run in ``sync`` after the backward, buffer
by buffer (all-reduce, then all-gather); the overlap of eq. 2 and §IV-D exists in the plan's time
model, not on the simulated clock, which adds the modeled communication to the measured compute.
The sparsification in ``sync`` is timed as compute (``sparsify_s_per_step`` in the report).
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from commvol import ssfusion as cv
from commvol.dataparallel import ddp_step_bytes, topk_k
from substrate.comm import bucket_groups

from .ddp import DDPOptions, flat_buckets
from .sparsify import dgc_topk
from .strategy import Strategy, register
from .topk import TopKOptions

__all__ = ["SSFusionOptions", "SSFusion", "FusionPlan", "FUSION_MODES", "fusion_buffers",
           "select_dense", "interleave_split", "plan_offload", "plan_selective",
           "per_tensor_plan", "alpha_beta_times"]

FUSION_MODES = ("selective", "per-tensor", "multi-tensor")


@dataclass(frozen=True)
class SSFusionOptions:
    """Options of SSFusion (``--method ssfusion``)."""

    density: float = field(default=0.01, metadata={
        "help": "fraction of each tensor's entries sent per step"})
    density_floor: float = field(default=0.001, metadata={
        "help": "ssfusion: lowest density the density-aware adjustment may give a tensor"})
    fusion: str = field(default="selective", metadata={
        "help": "ssfusion: selective | per-tensor | multi-tensor sparsification"})
    buffers: int = field(default=4, metadata={
        "help": "ssfusion: number of fusion buffers (equal tensor counts, backward order)"})
    buffer_mib: float = field(default=0.0, metadata={
        "help": "ssfusion: fusion-buffer byte budget in MiB (> 0 overrides --buffers)"})
    profile_steps: int = field(default=5, metadata={
        "help": "ssfusion: dense warm-up steps; selective profiles T_b and T_sp during them and "
                "then fixes the selection (the paper's 5)"})
    sample_ratio: float = field(default=0.01, metadata={
        "help": "ssfusion: fraction of a tensor sampled for the DGC threshold estimate"})
    interleave: bool = field(default=True, metadata={
        "help": "ssfusion: all-reduce the dense part, all-gather the sparse part "
                "(disable with --no-interleave)"})
    offload: bool = field(default=False, metadata={
        "help": "ssfusion: sparsify large tensors on a CPU worker thread during backward"})
    error_feedback: bool = field(default=True, metadata={
        "help": "accumulate unsent entries into the next step (disable with --no-error-feedback)"})

    def __post_init__(self) -> None:
        TopKOptions(density=self.density)  # the shared --density flag, validated once
        if not 0 < self.density_floor <= 1:
            raise ValueError(f"--density-floor must be in (0, 1] (the paper uses 0.001), got "
                             f"{self.density_floor}")
        if self.density < self.density_floor:
            raise ValueError(f"--density {self.density} is below --density-floor "
                             f"{self.density_floor} (the lower bound against over-"
                             f"sparsification); raise --density or lower --density-floor")
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"--fusion {self.fusion!r} unknown; use one of {FUSION_MODES}")
        if int(self.buffers) != self.buffers or self.buffers < 1:
            raise ValueError(f"--buffers must be an integer >= 1, got {self.buffers}")
        if not self.buffer_mib >= 0:
            raise ValueError(f"--buffer-mib must be >= 0 (0: use --buffers), got "
                             f"{self.buffer_mib}")
        if int(self.profile_steps) != self.profile_steps or self.profile_steps < 0:
            raise ValueError(f"--profile-steps must be an integer >= 0, got "
                             f"{self.profile_steps}")
        if self.fusion == "selective" and self.profile_steps < 1:
            raise ValueError("--fusion selective profiles during the dense warm-up: "
                             "--profile-steps must be >= 1 (the paper uses 5)")
        if not 0 < self.sample_ratio <= 1:
            raise ValueError(f"--sample-ratio must be in (0, 1] (DGC samples ~0.01), got "
                             f"{self.sample_ratio}")
        if self.offload and self.profile_steps < 2:
            raise ValueError(f"--offload profiles the backward with and without the CPU worker "
                             f"on alternate warm-up steps: use --profile-steps >= 2 (got "
                             f"{self.profile_steps})")
        if self.offload and self.fusion != "selective":
            raise ValueError(f"--offload is SSFusion-O on top of --fusion selective; drop "
                             f"--offload or use --fusion selective (got --fusion {self.fusion})")


# -- planning (pure, rank-independent) -----------------------------------------------------------
def fusion_buffers(sizes, *, buffers: int = 4, buffer_bytes: int = 0,
                   itemsize: int = 4) -> list[tuple[int, int]]:
    """Contiguous tensor ranges ``[t0, t1)`` (backward order) of the fusion buffers.

    ``buffer_bytes > 0``: greedy byte budget (:func:`substrate.comm.bucket_groups`; a larger
    tensor gets a buffer of its own).  Otherwise ``buffers`` buffers of (nearly) equal tensor
    count, as the paper's ``N_i`` tensors per buffer (§IV-B, Step 1).
    """
    L = len(sizes)
    if buffer_bytes > 0:
        groups = bucket_groups([int(n) * itemsize for n in sizes], int(buffer_bytes))
        return [(g[0], g[-1] + 1) for g in groups]
    if not 1 <= buffers <= L:
        raise ValueError(f"--buffers {buffers} must be between 1 and the model's {L} tensors; "
                         f"use --buffers {min(max(buffers, 1), L)} or a --buffer-mib budget")
    return [(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(L), buffers)]


def select_dense(sizes, T_b, T_sp, T_cm_prev: float, density: float,
                 density_floor: float) -> set[int]:
    """Overlap-maximized selection in one buffer (§IV-B, eq. 2).

    Walk the tensors by ascending size (ties: backward order) and leave each dense while
    ``T_cm^{i-1} < Σ_j T_b^j + Σ_{j∈S} T_sp^j`` (eq. 2 not yet satisfied) and the remaining
    sparse tensors can absorb it at densities ≥ the floor (:func:`commvol.ssfusion.
    feasible_dense`).

    Returns
    -------
    set of int
        Positions (within the buffer) of the tensors left dense.
    """
    n = len(sizes)
    comp = float(np.sum(T_b)) + float(np.sum(T_sp))
    dense: set[int] = set()
    for j in sorted(range(n), key=lambda j: (int(sizes[j]), j)):
        if T_cm_prev >= comp:  # eq. 2 holds: computation hidden behind the previous buffer
            break
        if not cv.feasible_dense(sizes, dense | {j}, density, density_floor):
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


@dataclass(frozen=True)
class FusionPlan:
    """The fixed selection: per tensor its count ``k_l`` (-1: dense) and offload flag, per
    buffer the interleave split ``l'_i``."""

    buffers: tuple
    k: tuple
    offload: tuple
    split: tuple

    def encode(self) -> np.ndarray:
        """The broadcast form: ``2L + N_B`` int64 (:func:`commvol.ssfusion.plan_length`)."""
        return np.concatenate([np.asarray(self.k, np.int64),
                               np.asarray(self.offload, np.int64),
                               np.asarray(self.split, np.int64)])

    @classmethod
    def decode(cls, code, buffers) -> "FusionPlan":
        L = buffers[-1][1]
        code = np.asarray(code, dtype=np.int64)
        if code.size != cv.plan_length(L, len(buffers)):
            raise ValueError(f"plan of {code.size} entries does not fit {L} tensors and "
                             f"{len(buffers)} buffers")
        return cls(tuple(buffers), tuple(int(v) for v in code[:L]),
                   tuple(bool(v) for v in code[L:2 * L]), tuple(int(v) for v in code[2 * L:]))

    def dense(self) -> list[int]:
        return [l for l, k in enumerate(self.k) if k < 0]


def per_tensor_plan(sizes, buffers, density: float) -> FusionPlan:
    """Every tensor sparsified at ``density`` (also the counts the multi-tensor baseline sums)."""
    L = len(sizes)
    return FusionPlan(tuple(buffers), tuple(topk_k(sizes, density)), (False,) * L,
                      (0,) * len(buffers))


def alpha_beta_times(cost, p: int, link: str, value_bytes: int = 4, index_bytes: int = 4):
    """``comm_times(n_ar, n_ag_dense, k_sparse) -> (T_AR, T_AG)`` from the run's α–β model
    (eqs. 3-4: ring all-reduce of the dense part, ring all-gather of every rank's block)."""
    def comm_times(n_ar: int, n_agd: int, k: int) -> tuple[float, float]:
        t_ar = cost.ring_allreduce_time(value_bytes * n_ar, p, link) if n_ar else 0.0
        block = value_bytes * n_agd + (value_bytes + index_bytes) * k
        t_ag = cost.ring_allgather_time(p * block, p, link) if block else 0.0
        return t_ar, t_ag
    return comm_times


def plan_selective(sizes, buffers, T_b, T_sp, T_cpu, *, density: float, density_floor: float,
                   comm_times, interleave: bool = True, offload: bool = False,
                   offload_deadline: str = "backward") -> FusionPlan:
    """SSFusion's selection for every buffer, in backward order (§IV-B to §IV-D).

    For buffer ``i``: :func:`select_dense` against the previous buffer's communication time
    ``T_cm^{i-1} = T_AR + T_AG`` (``T_cm^0 = 0``), density-aware counts
    (:func:`commvol.ssfusion.density_aware_counts`), the split (:func:`interleave_split`, or
    ``l' = 0``: everything all-gathered, without ``interleave``), then the offload set
    (:func:`plan_offload`) when ``offload``.
    """
    sizes = [int(n) for n in sizes]
    k = [0] * len(sizes)
    split = []
    T_cm_prev = 0.0
    for t0, t1 in buffers:
        sz, tb, tsp = sizes[t0:t1], T_b[t0:t1], T_sp[t0:t1]
        dense = select_dense(sz, tb, tsp, T_cm_prev, density, density_floor)
        kb = cv.density_aware_counts(sz, dense, density, density_floor)
        if interleave:
            lp, t_ar, t_ag = interleave_split(sz, dense, kb, tb, tsp, comm_times)
        else:
            lp = 0
            t_ar, t_ag = comm_times(0, sum(sz[j] for j in dense),
                                    sum(kb[j] for j in range(len(sz)) if j not in dense))
        T_cm_prev = t_ar + t_ag
        for j in range(t1 - t0):
            k[t0 + j] = -1 if j in dense else kb[j]
        split.append(lp)
    sparse = np.array([v >= 0 for v in k])
    off = (plan_offload(T_b, T_cpu, sparse, buffers, deadline=offload_deadline) if offload
           else np.zeros(len(sizes), dtype=bool))
    return FusionPlan(tuple(buffers), tuple(k), tuple(bool(v) for v in off), tuple(split))


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
        self.buffers = fusion_buffers(self.sizes, buffers=int(options.buffers),
                                      buffer_bytes=int(options.buffer_mib * (1 << 20)),
                                      itemsize=g.dtype.itemsize)
        self.buffer_sizes = [int(self.offsets[t1] - self.offsets[t0]) for t0, t1 in self.buffers]
        self.residual = xp.zeros_like(g)
        self.warmup = int(options.profile_steps)
        self.plan: FusionPlan | None = None
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
        self._prof_futures: list = []
        self._k_full = topk_k(self.sizes, options.density)
        self._host_res: dict[int, np.ndarray] = {}
        # step bookkeeping and statistics
        self._last: tuple[str, bool] = ("none", False)
        self._stats = {"sparse_steps": 0, "sparsify_s": 0.0, "worker_s": 0.0,
                       "profile_s": 0.0, "missing": 0.0, "missing_global": 0.0}
        self._missing_by_tensor = np.zeros(self.L)
        if options.fusion != "selective":
            self._install(per_tensor_plan(self.sizes, self.buffers, options.density))

    # -- plan installation ------------------------------------------------------------------------
    def _install(self, plan: FusionPlan) -> None:
        """Build the fixed per-buffer layouts and send buffers (plan once, run many)."""
        xp, off = self.xp, self.offsets
        multi = self.options.fusion == "multi-tensor"
        self.plan = plan
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

    def _select(self, buf: _Buffer, seg: _Segment, step: int) -> None:
        """Sparsify one segment in place: ``a = g + e``, top-``k`` into ``buf.send``,
        ``e = a`` with the sent entries zeroed."""
        g = self.ctx.model.grads.flat
        a, b = seg.a, seg.b
        if self.options.error_feedback:
            acc = self.residual[a:b]
            acc += g[a:b]
        else:
            acc = g[a:b]
        idx = dgc_topk(acc, seg.k, self._rng(step, seg.sid), self.options.sample_ratio)
        self._put(buf, seg, acc[idx], idx)
        if self.options.error_feedback:
            acc[idx] = 0

    def _put(self, buf: _Buffer, seg: _Segment, values, idx) -> None:
        v0 = buf.n_agd + seg.slot
        i0 = buf.n_agd + buf.K + seg.slot
        buf.send[v0:v0 + seg.k] = values.astype(np.float32, copy=False).view(np.int32)
        buf.send[i0:i0 + seg.k] = (idx + seg.a).astype(np.int32)

    def _offload_job(self, buf: _Buffer, seg: _Segment, step: int):
        """Worker thread: sparsify one tensor on the CPU (on a GPU run: copy to the host, select
        with NumPy, keep its residual on the host; the main thread copies the result back)."""
        t = time.perf_counter()
        if not self.run.backend.is_gpu:
            self._select(buf, seg, step)
            return time.perf_counter() - t, None
        host = self.ctx.model.grads.flat[seg.a:seg.b].get()
        if self.options.error_feedback:
            acc = self._host_res[seg.sid]
            acc += host
        else:
            acc = host
        idx = dgc_topk(acc, seg.k, self._rng(step, seg.sid), self.options.sample_ratio)
        values = acc[idx].copy()
        if self.options.error_feedback:
            acc[idx] = 0
        return time.perf_counter() - t, (values, idx)

    def _sparsify_all(self, step: int) -> None:
        xp = self.xp
        for buf in self._bufs:
            for seg in buf.segs:
                if not (seg.offload and seg.sid in self._futures):
                    self._select(buf, seg, step)
        for l, fut in self._futures.items():
            dt, host = fut.result()
            self._stats["worker_s"] += dt
            if host is not None:
                buf, seg = self._seg_of[l]
                self._put(buf, seg, xp.asarray(host[0]), xp.asarray(host[1]))
        self._futures.clear()

    # -- one step ---------------------------------------------------------------------------------
    def sync(self, state, buffers):
        g = buffers.flat
        step = int(state.step)
        if self.plan is None or step < self.warmup:
            return self._warmup_sync(step, g)
        clock, sync_dev = self.run.clock, self.run.backend.synchronize
        with clock.compute():
            t = time.perf_counter()
            self._sparsify_all(step)
            sync_dev()
            self._stats["sparsify_s"] += time.perf_counter() - t
        world, p = self.topo.world, self.topo.size
        xp = self.xp
        gathered_idx = []
        for buf in self._bufs:
            if buf.n_ar:
                o = 0
                for ra, rb in buf.ar:
                    buf.ar_buf[o:o + rb - ra] = g[ra:rb]
                    o += rb - ra
                world.allreduce(buf.ar_buf, "avg", phase=cv.DENSE)
                o = 0
                for ra, rb in buf.ar:
                    g[ra:rb] = buf.ar_buf[o:o + rb - ra]
                    o += rb - ra
            if buf.send.size:
                nd, K = buf.n_agd, buf.K
                o = 0
                for ra, rb in buf.agd:
                    buf.send[o:o + rb - ra] = g[ra:rb].view(np.int32)
                    o += rb - ra
                rows = world.allgather(buf.send, phase=cv.SPARSE)
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
                    gathered_idx.append(idx)
        self._count_missing(gathered_idx)
        self._stats["sparse_steps"] += 1
        self._last = ("sparse", False)
        return g

    def _warmup_sync(self, step: int, g):
        """Dense all-reduce of every fusion buffer; selective also profiles (T_b, T_sp, T_cpu)
        and, after the last warm-up step, fixes the selection."""
        selective = self.options.fusion == "selective"
        if selective:
            with self.run.clock.compute():
                t = time.perf_counter()
                self._profile_step(step, g)
                self._stats["profile_s"] += time.perf_counter() - t
        for (t0, t1) in self.buffers:
            self.topo.world.allreduce(g[self.offsets[t0]:self.offsets[t1]], "avg",
                                      phase=cv.WARMUP)
        decided = selective and step == self.warmup - 1
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
        dgc_topk(self.run.backend.asnumpy(x), self._k_full[l], self._rng(step, l),
                 self.options.sample_ratio)
        return l, t_submit, t_start, time.perf_counter()

    def _profile_step(self, step: int, g) -> None:
        """One warm-up step's timings (sums, averaged in :meth:`_decide`).

        ``T_b`` from the ``on_ready`` timestamps of steps without the worker; with
        ``--offload`` every second warm-up step runs each tensor's sparsification on the worker
        from ``on_ready``, concurrently with the rest of the backward as it will run: ``T_cpu``
        is its service time (job end minus the later of its submission and the previous job's
        end: hand-off latency and contention included), and the backward span (first to last
        ready) of those steps against the plain ones measures how much the worker slows the
        backward down.  ``T_sp`` is timed on the main thread after the backward.  Without
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
                sums["T_b"] += np.maximum(np.diff(self._t_ready, prepend=self._t_ready[0]), 0)
                counts["T_b"] += 1
        t_cpu = np.zeros(self.L)
        prev_end = -np.inf
        for fut in self._prof_futures:
            l, t_submit, _, t_end = fut.result()
            t_cpu[l] = t_end - max(t_submit, prev_end)
            prev_end = t_end
        if len(self._prof_futures) == self.L:
            sums["T_cpu"] += t_cpu
            counts["T_cpu"] += 1
        self._prof_futures.clear()
        for l in range(self.L):
            a, b = int(self.offsets[l]), int(self.offsets[l + 1])
            backend.synchronize()
            t = time.perf_counter()
            dgc_topk(g[a:b], self._k_full[l], self._rng(step, l), self.options.sample_ratio)
            backend.synchronize()
            sums["T_sp"][l] += time.perf_counter() - t
        counts["T_sp"] += 1

    def _profile_vector(self) -> np.ndarray:
        """The averaged profile, ``3L + 2`` float64 (:func:`commvol.ssfusion.profile_length`)."""
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
        """Max-reduce the profiled timings, plan on rank 0, broadcast the plan (§IV-B online
        profiling: the selection is recorded once and fixed).

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
        self._profile = prof[:3 * L].reshape(len(cv.PROFILE_FIELDS), L)
        T_b, T_sp, T_cpu = self._profile
        code = np.zeros(cv.plan_length(L, len(self.buffers)), dtype=np.int64)
        if world.rank == 0:
            times = alpha_beta_times(self.run.cost, world.size, world.slowest)
            plan = plan_selective(self.sizes, self.buffers, T_b, T_sp, T_cpu,
                                  density=o.density, density_floor=o.density_floor,
                                  comm_times=times, interleave=o.interleave, offload=o.offload)
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
        self._install(FusionPlan.decode(code, self.buffers))

    def _count_missing(self, gathered_idx) -> None:
        """Tensor-missing rate (Table I): tensors with no selected entry on this rank, and with
        none on any rank (dense tensors are never missing)."""
        xp = self.xp
        own = [buf.send[buf.n_agd + buf.K:] for buf in self._bufs if buf.K]
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
        kind, decided = self._last
        M, P = self.M, self.P
        if kind == "warmup":
            out = cv.warmup_step_bytes(M=M, P=P, buffer_sizes=self.buffer_sizes)
            if decided:
                out.update(cv.selection_bytes(M=M, P=P, num_tensors=self.L,
                                              num_buffers=len(self.buffers)))
            return out
        if kind == "sparse":
            ar, agd, ks = self._counts()
            return cv.sparse_step_bytes(M=M, P=P, ar_counts=ar, ag_dense_counts=agd,
                                        ag_sparse_counts=ks)
        return {}

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Error-feedback residuals (the host-side ones of offloaded tensors on a GPU run), the
        installed selection, the profile sums or the decided profile and offload guard, the
        statistics and the step whose backward runs next."""
        host = self.run.backend.asnumpy
        state = {
            "residual": host(self.residual).copy(),
            "plan": self.plan.encode() if self.plan is not None else np.zeros(0, np.int64),
            "profile": (self._profile.copy() if self._profile is not None
                        else np.zeros((0, self.L))),
            "offload_guard": json.dumps(self._offload_guard),
            "counts_prof": json.dumps(self._counts_prof), "stats": json.dumps(self._stats),
            "missing_by_tensor": self._missing_by_tensor.copy(), "step": np.int64(self._step),
        }
        state.update({f"sums/{k}": v.copy() for k, v in self._sums.items()})
        state.update({f"host_res/{sid}": r.copy() for sid, r in self._host_res.items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.residual[...] = self.xp.asarray(state["residual"])
        if state["plan"].size:
            self._install(FusionPlan.decode(state["plan"], self.buffers))
        self._profile = state["profile"].copy() if state["profile"].size else None
        self._offload_guard = json.loads(str(state["offload_guard"]))
        self._counts_prof = json.loads(str(state["counts_prof"]))
        self._stats = json.loads(str(state["stats"]))
        self._missing_by_tensor = state["missing_by_tensor"].copy()
        self._step = int(state["step"])
        self._sums = {k: state[f"sums/{k}"].copy() for k in self._sums}
        for sid, r in self._host_res.items():
            r[...] = state[f"host_res/{sid}"]

    # -- summary ----------------------------------------------------------------------------------
    def report(self) -> dict:
        o, st = self.options, self._stats
        out = {"fusion": o.fusion, "buffers": len(self.buffers),
               "buffer_tensors": [list(self.names[t0:t1]) for t0, t1 in self.buffers],
               "profile_steps": self.warmup, "sparse_steps": st["sparse_steps"]}
        if self.plan is None:
            return out
        ar, agd, ks = self._counts()
        sparse = cv.sparse_step_bytes(M=self.M, P=self.P, ar_counts=ar, ag_dense_counts=agd,
                                      ag_sparse_counts=ks)
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
