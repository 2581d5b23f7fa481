"""SSFusion's one plan (:class:`SSFusionPlan`, built by :func:`plan_ssfusion`): the fusion
buffers, which tensors stay dense, every sparse count, the interleave splits and the offload set,
and the records of one step (:meth:`SSFusionPlan.calls`) that the run executes call for call and
``commvol`` prices and schedules at any scale.  Pure: no MPI, no array of the run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from substrate.calls import Call, Placement, Ready, Work

from ..codec import INDEX_BYTES, VALUE_BYTES, SparseRow
from ..sparsify import selection_flops, selection_kernels
from .options import SSFusionOptions, needs_profile
from .selection import (
    alpha_beta_times,
    count_buffers,
    density_aware_counts,
    find_opt_fusion,
    interleave_split,
    per_tensor_counts,
    plan_offload,
    select_dense,
)

__all__ = [
    "DENSE",
    "PHASES",
    "PROFILE",
    "PROFILE_FIELDS",
    "SELECT",
    "SPARSE",
    "STEP_KINDS",
    "WARMUP",
    "WORK_BYTES_PER_FLOP",
    "FusionBuffer",
    "SSFusionPlan",
    "Segment",
    "plan_ssfusion",
    "profile_length",
]

#: Ledger phases of SSFusion's calls (:meth:`SSFusionPlan.calls`): the warm-up all-reduces, the
#: decision's profile MAX all-reduce and plan broadcast, ``Buffer_AR``'s all-reduce and
#: ``Buffer_AG``'s all-gather.  :mod:`volume.ssfusion`, the closed forms the plan is tested
#: against, names them on its own (the tests hold the two equal).
WARMUP = "ssf_warmup_allreduce"
PROFILE = "ssf_profile_allreduce"
SELECT = "ssf_select_bcast"
DENSE = "ssf_dense_allreduce"
SPARSE = "ssf_sparse_allgather"
PHASES = (WARMUP, PROFILE, SELECT, DENSE, SPARSE)

#: Timings per tensor the warm-up profiles and max-reduces: backward, sparsification (device),
#: sparsification on the CPU worker; the profile vector ends with the two backward spans (without
#: / with the offload worker busy).
PROFILE_FIELDS = ("T_b", "T_sp", "T_cpu")
#: What :meth:`SSFusionPlan.calls` lists: a dense warm-up step or a sparse step.
STEP_KINDS = ("warmup", "sparse")
#: Bytes each element operation of SSFusion's compute items streams (an assumption of the
#: job simulation at scale, whose device roofline makes them memory-bound: one float32
#: read or written per operation of momentum, error feedback, selection, packing and decoding).
WORK_BYTES_PER_FLOP = 4


def profile_length(num_tensors: int) -> int:
    """float64 entries of the max-reduced profile: ``T_b, T_sp, T_cpu`` per tensor and the two
    backward spans."""
    return len(PROFILE_FIELDS) * int(num_tensors) + 2


@dataclass(frozen=True)
class Segment:
    """One sparsified unit of a fusion buffer: a tensor (``sid`` = its index; selective,
    per-tensor) or the whole buffer (multi-tensor, ``sid = L + i``), flat range ``[a, b)``,
    ``k`` entries in slots ``slot .. slot + k - 1`` of its buffer's row."""

    sid: int
    a: int
    b: int
    k: int
    slot: int
    offload: bool = False


@dataclass(frozen=True)
class FusionBuffer:
    """The fixed communication layout of fusion buffer ``index`` (tensors ``[t0, t1)``, flat
    ``[a, b)``).

    ``[a, c)`` holds the tensors before its interleave split ``l'_i`` (``c = a`` without one):
    the dense ones among them (``ar``, flat ranges) are all-reduced as ``Buffer_AR``;
    ``Buffer_AG`` (:attr:`row`) holds the later dense tensors (``agd``) and every sparsified
    segment.
    """

    index: int
    t0: int
    t1: int
    a: int
    c: int
    b: int
    ar: tuple
    agd: tuple
    segments: tuple

    @property
    def n_ar(self) -> int:
        return sum(rb - ra for ra, rb in self.ar)

    @property
    def n_agd(self) -> int:
        return sum(rb - ra for ra, rb in self.agd)

    @property
    def K(self) -> int:
        return sum(s.k for s in self.segments)

    @property
    def row(self) -> SparseRow:
        """One rank's all-gathered row: the ``agd`` dense values, then ``K`` values and ``K``
        indices (:class:`dataparallel.codec.SparseRow`)."""
        return SparseRow(self.n_agd, self.K)

    def head(self, seg: Segment) -> bool:
        """Whether ``seg`` lies before the split (computed before ``Buffer_AR`` is sent)."""
        return seg.a < self.c


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
        Whether the run decides this plan from its warm-up profile (then every warm-up step
        profiles, and the timings are max-reduced and the plan broadcast once, at the end of
        warm-up).
    density, sparsifier, sample_ratio, error_feedback
        The sparsification's options (the operation counts of its compute items).
    """

    fusion: str
    sizes: tuple
    warmup_buffers: tuple
    buffers: tuple
    k: tuple
    split: tuple
    offload: tuple
    profiled: bool
    density: float = 0.01
    sparsifier: str = "dgc"
    sample_ratio: float = 0.01
    error_feedback: bool = True

    @property
    def L(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return int(sum(self.sizes))

    @cached_property
    def offsets(self) -> tuple:
        """Flat offset of every tensor (backward order) and the total."""
        return tuple(int(v) for v in np.concatenate(([0], np.cumsum(self.sizes, dtype=np.int64))))

    def dense(self) -> list[int]:
        """Tensors sent dense."""
        return [l for l, k in enumerate(self.k) if k < 0]

    def buffer_sizes(self, warmup: bool = False) -> list[int]:
        return [sum(self.sizes[t0:t1]) for t0, t1 in
                (self.warmup_buffers if warmup else self.buffers)]

    @cached_property
    def layout(self) -> tuple:
        """The :class:`FusionBuffer` of every fusion buffer, in order."""
        off, out = self.offsets, []
        for i, ((t0, t1), lp) in enumerate(zip(self.buffers, self.split)):
            a, b = off[t0], off[t1]
            if self.fusion == "multi-tensor":
                segs = (Segment(self.L + i, a, b, sum(self.k[t0:t1]), 0),)
                out.append(FusionBuffer(i, t0, t1, a, a, b, (), (), segs))
                continue
            ar, agd, segs, slot = [], [], [], 0
            for l in range(t0, t1):
                if self.k[l] < 0:
                    (ar if l - t0 < lp else agd).append((off[l], off[l + 1]))
                else:
                    segs.append(Segment(l, off[l], off[l + 1], self.k[l], slot,
                                        bool(self.offload[l])))
                    slot += self.k[l]
            out.append(FusionBuffer(i, t0, t1, a, off[t0 + lp], b, tuple(ar), tuple(agd),
                                    tuple(segs)))
        return tuple(out)

    def counts(self) -> tuple[list[int], list[int], list[int]]:
        """Per buffer: all-reduced elements, all-gathered dense elements, sparse entries."""
        lay = self.layout
        return [b.n_ar for b in lay], [b.n_agd for b in lay], [b.K for b in lay]

    # -- compute items ----------------------------------------------------------------------------
    def segment_flops(self, n: int, k: int, momentum: bool) -> float:
        """Element operations of sparsifying ``n`` entries to ``k`` (the ``flops`` compute
        source's count): momentum ``u = μ u + g`` (``2n``), error feedback ``a = e + u``
        (``n``), the selection (:func:`dataparallel.sparsify.selection_flops`) and the gather
        and masking of the ``k`` sent entries (``2k``)."""
        return (selection_flops(n, k, self.sparsifier, self.sample_ratio)
                + (2 * n if momentum else 0) + (n if self.error_feedback else 0) + 2 * k)

    @staticmethod
    def dense_flops(n: int, momentum: bool) -> float:
        """Element operations of a dense tensor of ``n`` entries in a sparse step: plain
        momentum (``2n``) and the copy into its send buffer (``n``)."""
        return 2.0 * n * bool(momentum) + float(n)

    def segment_kernels(self, n: int, k: int, momentum: bool) -> int:
        """Kernel launches of sparsifying one segment (what the strategy's ``_select`` issues):
        momentum ``u *= μ; u += g`` (2), error feedback ``a = e + u`` (1), the selection
        (:func:`dataparallel.sparsify.selection_kernels`), the gather of the sent values (1),
        their values and indices into the row (2), the residual's update (2) and the velocity's
        masking (1)."""
        return (selection_kernels(n, k, self.sparsifier, self.sample_ratio)
                + (3 if momentum else 0) + (3 if self.error_feedback else 0) + 3)

    @staticmethod
    def dense_kernels(momentum: bool) -> int:
        """Kernel launches of a dense tensor in a sparse step: momentum (2) and the copy into
        its send buffer (1)."""
        return 2 * bool(momentum) + 1

    def part_kernels(self, buf: FusionBuffer, head: bool, momentum: bool) -> int:
        """Kernel launches of the part of ``buf`` before its split (``head``) or after it: a
        tensor-by-tensor loop, so every dense tensor and every segment not offloaded launches
        its own (:meth:`dense_kernels`, :meth:`segment_kernels`)."""
        dense = buf.ar if head else buf.agd
        return (len(dense) * self.dense_kernels(momentum)
                + sum(self.segment_kernels(s.b - s.a, s.k, momentum) for s in buf.segments
                      if buf.head(s) == head and not s.offload))

    def part_flops(self, buf: FusionBuffer, head: bool, momentum: bool) -> float:
        """Element operations on the compute stream of the part of ``buf`` before its split
        (``head``) or after it: its dense tensors and its segments not offloaded."""
        dense = buf.ar if head else buf.agd
        return (sum(self.dense_flops(rb - ra, momentum) for ra, rb in dense)
                + sum(self.segment_flops(s.b - s.a, s.k, momentum) for s in buf.segments
                      if buf.head(s) == head and not s.offload))

    def profile_flops(self) -> float:
        """Element operations of one warm-up step's profiling: every tensor sparsified once at
        its per-tensor count ``⌈d n_l⌉`` (the ``T_sp`` timings)."""
        full = per_tensor_counts(self.sizes, self.density)
        return float(sum(selection_flops(n, k, self.sparsifier, self.sample_ratio)
                         for n, k in zip(self.sizes, full)))

    def profile_kernels(self) -> int:
        """Kernel launches of one warm-up step's profiling (a selection per tensor)."""
        full = per_tensor_counts(self.sizes, self.density)
        return int(sum(selection_kernels(n, k, self.sparsifier, self.sample_ratio)
                       for n, k in zip(self.sizes, full)))

    # -- the records of one step ------------------------------------------------------------------
    def calls(self, placement: Placement, kind: str = "sparse", decided: bool = False, *,
              momentum: bool = False, profiling: bool | None = None) -> list:
        """The records of one step on ``placement``: the program :class:`SSFusion` runs
        (:func:`dataparallel.program.step_program` places each record at the first unit
        boundary of the backward where what it names is there, in this order).

        ``kind="warmup"`` (the ``--profile-steps`` dense steps): when the plan is profiled
        (``profiling``, default :attr:`profiled`), the profiling of the whole gradient
        (compute, after the backward); with DGC momentum
        correction (``momentum``) the update ``u = μ u + g`` of the whole gradient; then per
        warm-up buffer ``j`` a ring all-reduce (avg) of its float32 values over all ranks
        (``ssf_warmup_allreduce[j]``), after the backward wrote the buffer, those compute items
        and the previous buffer's all-reduce, on the communication stream.  ``decided``: the
        last warm-up step of a profiled plan adds the MAX all-reduce of the ``3L + 2`` float64
        timings (after the profiling and the last all-reduce) and the binomial broadcast of the
        ``4L`` int64 plan from rank 0, both blocking (rank 0 plans between them).

        ``kind="sparse"``: per fusion buffer ``i`` (§IV-D, Fig. 10: one communication channel,
        buffer after buffer), ``ssf_sparsify_ar[i]`` (compute: momentum, sparsification and
        packing of the tensors before the split ``l'_i``, once the backward wrote them), the
        ring all-reduce of ``Buffer_AR`` (``ssf_dense_allreduce[i]``, avg, float32; after that
        and the previous buffer's last call), ``ssf_sparsify[i]`` (compute: the tensors after
        the split) and the ring all-gather of ``Buffer_AG`` (``ssf_sparse_allgather[i]``,
        ``4 n_AGd + 8 K`` bytes a rank, int32 words; after both parts and the all-reduce:
        ``T2 = max(T_AR, Σ_{j>l'} T_b + T_sp) + T_AG``), both calls on the communication
        stream.  Calls with nothing to send are not made.  SSFusion-O (§IV-C): each offloaded
        segment ``l`` is sparsified on the CPU worker, ``ssf_offload[l]`` (compute on the
        ``offload`` stream, listed where the backward writes the tensor, so it is handed over
        at once), and the compute stream collects the buffer's segments,
        ``ssf_offload_wait[i]`` (no work of its own: the wait), before the all-gather, which
        waits for it.  The decoding of the received buffers (``ssf_unpack_dense[i]``,
        ``ssf_unpack_sparse[i]``: compute after their call) closes the list.

        Compute items (:class:`~substrate.calls.Work`) carry their element operations
        (:meth:`part_flops`, :meth:`segment_flops` for the worker's),
        :data:`WORK_BYTES_PER_FLOP` bytes per operation and their kernel launches
        (:meth:`part_kernels`, :meth:`segment_kernels`: tensor by tensor, so per-tensor
        sparsification pays a selection's launches for every tensor, multi-tensor once a buffer).
        """
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind {kind!r} unknown; use one of {STEP_KINDS}")
        world, p, off = placement.world, placement.size, self.offsets
        out: list = []

        def add(item) -> int:
            out.append(item)
            return len(out) - 1

        def work(label: str, flops: float, after: tuple, stream: str = "compute",
                 kernels: int = 1) -> int:
            return add(Work(label, flops=float(flops), nbytes=WORK_BYTES_PER_FLOP * float(flops),
                            after=after, stream=stream, kernels=int(kernels)))

        def chain(*items) -> tuple:
            return tuple(i for i in items if i is not None)

        if kind == "warmup":
            whole = Ready(0, self.total)
            before: list[int] = []
            profiling = self.profiled if profiling is None else profiling
            if profiling:
                before.append(work("ssf_profile", self.profile_flops(), (whole,),
                                   kernels=self.profile_kernels()))
            if momentum:
                before.append(work("ssf_momentum", 2.0 * self.total, (whole,), kernels=2))
            prev = None
            for j, (t0, t1) in enumerate(self.warmup_buffers):
                a, b = off[t0], off[t1]
                prev = add(Call(WARMUP, "allreduce", world, VALUE_BYTES * (b - a), VALUE_BYTES,
                                op="avg", after=(Ready(a, b), *before, *chain(prev)),
                                label=f"{WARMUP}[{j}]", wait=False))
            if decided and profiling:
                prof = add(Call(PROFILE, "allreduce", world, 8 * profile_length(self.L), 8,
                                op="max", after=(*before[:1], *chain(prev))))
                add(Call(SELECT, "bcast", world, 8 * self.encode().size, 8, root=0,
                         after=(prof,)))
            return out

        def offload(buf: FusionBuffer, head: bool) -> list[int]:
            """The worker's items of ``buf``'s offloaded segments before / after its split."""
            return [work(f"ssf_offload[{s.sid}]", self.segment_flops(s.b - s.a, s.k, momentum),
                         (Ready(s.a, s.b),), stream="offload",
                         kernels=self.segment_kernels(s.b - s.a, s.k, momentum))
                    for s in buf.segments if s.offload and buf.head(s) == head]

        unpack: list = []
        prev = None                      # the last call on the communication channel
        for buf in self.layout:
            i = buf.index
            head = tail = None
            offloaded = offload(buf, True)
            if buf.c > buf.a:
                head = work(f"ssf_sparsify_ar[{i}]", self.part_flops(buf, True, momentum),
                            (Ready(buf.a, buf.c),),
                            kernels=self.part_kernels(buf, True, momentum))
            if buf.n_ar:
                prev = add(Call(DENSE, "allreduce", world, VALUE_BYTES * buf.n_ar, VALUE_BYTES,
                                op="avg", after=(Ready(buf.a, buf.c), *chain(head, prev)),
                                label=f"{DENSE}[{i}]", wait=False))
                unpack.append(Work(f"ssf_unpack_dense[{i}]", flops=float(buf.n_ar),
                                   nbytes=WORK_BYTES_PER_FLOP * float(buf.n_ar), after=(prev,),
                                   kernels=len(buf.ar)))
            offloaded += offload(buf, False)
            if buf.b > buf.c:
                tail = work(f"ssf_sparsify[{i}]", self.part_flops(buf, False, momentum),
                            (Ready(buf.c, buf.b),),
                            kernels=self.part_kernels(buf, False, momentum))
            collect = work(f"ssf_offload_wait[{i}]", 0.0, tuple(offloaded)) if offloaded \
                else None
            row = buf.row
            if row.words:
                prev = add(Call(SPARSE, "allgather", world, blocks=(row.nbytes,) * p,
                                itemsize=INDEX_BYTES, label=f"{SPARSE}[{i}]", wait=False,
                                after=(Ready(buf.a, buf.b), *chain(head, tail, collect, prev))))
                flops = float(p * buf.n_agd + 2 * p * buf.K + buf.b - buf.a)
                # the dense blocks' sum (2) and copies, the scatter-mean (3), the copies back
                kernels = (2 + len(buf.agd) if buf.n_agd else 0) + \
                    (3 + len(buf.segments) if buf.K else 0)
                unpack.append(Work(f"ssf_unpack_sparse[{i}]", flops=flops,
                                   nbytes=WORK_BYTES_PER_FLOP * flops, after=(prev,),
                                   kernels=kernels))
        return out + unpack

    # -- the broadcast form -----------------------------------------------------------------------
    def encode(self) -> np.ndarray:
        """The broadcast form, ``4L`` int64: counts, offload flags, buffer-start flags and each
        buffer's ``l'_i`` at its first tensor."""
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
        if code.size != 4 * L:
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
    k_full = per_tensor_counts(sizes, o.density)
    sparsification = {"density": o.density, "sparsifier": o.sparsifier,
                      "sample_ratio": o.sample_ratio, "error_feedback": o.error_feedback}
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
                            (False,) * L, needs_profile(o), **sparsification)
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
    off = (plan_offload(T_b, T_cpu, np.array([v >= 0 for v in k]), buffers,
                        deadline=o.offload_deadline) if o.offload
           else np.zeros(L, dtype=bool))
    return SSFusionPlan(o.fusion, sizes, warm, buffers, tuple(k), tuple(lps),
                        tuple(bool(v) for v in off), True, **sparsification)

