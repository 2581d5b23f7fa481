"""PacTrain's plan (paper 002): :class:`PacTrainPlan`, every step's call records.

:meth:`PacTrainPlan.build` (pure: layout, options and the run's kept index set or, for a
prediction, the keep rate) gives ``K`` per tensor and bucket, the chunks, the TernGrad
segments, the dense-until-stable schedule and every step's call records
(:meth:`PacTrainPlan.calls`); the strategy (:mod:`.strategy`) executes them and
:mod:`commvol.systems.pactrain` prices them.  Independent closed forms: :mod:`volume.pactrain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from substrate.calls import Call, Placement, Ready

from ..ddp import flat_buckets
from .options import PacTrainOptions
from .pruning import PRUNABLE_KINDS

__all__ = ["PacTrainPlan"]


@dataclass(frozen=True, eq=False)
class PacTrainPlan:
    """What PacTrain sends, built once by :meth:`build` (pure: no communicator).

    Attributes
    ----------
    nodes, ranks_per_node, itemsize : int
        ``M``, ``P`` and the gradient's bytes per element.
    tensor_sizes, tensor_kept : tuple of int
        ``n_l`` and the kept count ``K_l`` of every tensor, in flat (backward) order.
    buckets : tuple of (int, int)
        DDP's gradient buckets ``[a, b)`` of the flat gradient (whole tensors, ``--bucket-mib``).
    units : tuple of (int, int)
        The flat ranges with a mask tracker of their own: the buckets (``--mask-scope
        bucket``, Algorithm 1's ``foreach update``) or ``[(0, T)]`` (``global``).
    unit_buckets : tuple of tuple of int
        Indices into :attr:`buckets` of the buckets a unit all-reduces when dense.
    unit_kept : tuple of int
        ``K_u``, the entries of unit ``u`` the mask keeps (the length of its packed vector).
    chunks : tuple of tuple of int
        Element counts of unit ``u``'s packed all-reduces: one of ``K_u`` per bucket (none when
        ``K_u = 0``); with ``global`` scope ``⌈K / B⌉`` chunks of at most one bucket ``B``.
    segments : tuple of tuple of (int, int)
        TernGrad scale segments of unit ``u`` in packed coordinates: one per tensor (``--ternary-
        scale tensor``; a tensor's survivors are contiguous in the packed vector) or one.
    packed_mode : str
        What a stable unit does: ``"packed"`` (float all-reduce) or ``"ternary"``.
    warmup_steps, dense_steps : int
        ``w`` (pruning happens before step ``w``) and ``w + W``: the mask trackers first compare
        at step ``w`` and call a mask stable after ``W = --stable-window`` unchanged comparisons,
        so steps ``0 .. w + W - 1`` are dense and every unit packs from step ``w + W`` on.
    grasp_step : int or None
        The step charged with GraSP's two all-reduces of ``T`` (``max(w - 1, 0)``).
    index : tuple of numpy arrays, or None
        Run plans: the sorted flat indices of unit ``u``'s survivors (``None`` for a prediction
        from the keep rate).
    """

    nodes: int
    ranks_per_node: int
    itemsize: int
    tensor_sizes: tuple
    tensor_kept: tuple
    buckets: tuple
    units: tuple
    unit_buckets: tuple
    unit_kept: tuple
    chunks: tuple
    segments: tuple
    packed_mode: str
    warmup_steps: int
    dense_steps: int
    grasp_step: int | None
    index: tuple | None = field(default=None, repr=False)

    @classmethod
    def build(cls, layout, nodes: int, ranks_per_node: int, options: PacTrainOptions,
              kept_index=None, itemsize: int = 4) -> PacTrainPlan:
        """The plan of a run (``kept_index``: the sorted flat indices the mask keeps) or of a
        prediction (``kept_index=None``: every conv/fc tensor keeps ``n − ⌊r n⌋`` entries, as
        :func:`prune_mask` does, every other tensor all of them)."""
        names = list(layout.names)
        sizes = [int(layout.sizes[n]) for n in names]
        offsets = [int(layout.offsets[n]) for n in names] + [int(layout.total)]
        T = int(layout.total)
        if kept_index is None:
            r = options.prune_ratio
            kept = [n - math.floor(r * n) if layout.kind(name) in PRUNABLE_KINDS else n
                    for name, n in zip(names, sizes)]
            idx = None
        else:
            idx = np.asarray(kept_index, dtype=np.int64).ravel()
            if idx.size and (idx[0] < 0 or idx[-1] >= T or np.any(np.diff(idx) <= 0)):
                raise ValueError(f"kept_index must be sorted, unique flat indices in [0, {T})")
            kept = np.diff(np.searchsorted(idx, offsets)).tolist()
        bucket_bytes = int(options.bucket_mib * (1 << 20))
        buckets = tuple(flat_buckets(layout, bucket_bytes, itemsize))
        if options.mask_scope == "bucket":
            units = buckets
            unit_buckets = tuple((b,) for b in range(len(buckets)))
        else:
            units = ((0, T),)
            unit_buckets = (tuple(range(len(buckets))),)
        # tensors of every unit (units are unions of whole tensors)
        starts = np.asarray(offsets[:-1])
        unit_tensors = [np.flatnonzero((starts >= a) & (starts < b)).tolist() for a, b in units]
        unit_kept = tuple(int(sum(kept[i] for i in ts)) for ts in unit_tensors)
        B = max(1, bucket_bytes // itemsize)
        if options.mask_scope == "bucket":
            chunks = tuple((k,) if k else () for k in unit_kept)
        else:
            chunks = tuple(tuple(min(B, k - a) for a in range(0, k, B)) for k in unit_kept)
        segs = []
        for ts, k in zip(unit_tensors, unit_kept):
            if options.ternary_scale == "tensor":
                ends = np.cumsum([kept[i] for i in ts]).tolist()
                segs.append(tuple(zip([0] + ends[:-1], ends)))
            else:
                segs.append(((0, k),))
        w = options.warmup
        index = None
        if idx is not None:
            index = tuple(idx[np.searchsorted(idx, a):np.searchsorted(idx, b)] for a, b in units)
        return cls(nodes=int(nodes), ranks_per_node=int(ranks_per_node), itemsize=int(itemsize),
                   tensor_sizes=tuple(sizes), tensor_kept=tuple(int(k) for k in kept),
                   buckets=buckets, units=tuple(units), unit_buckets=unit_buckets,
                   unit_kept=unit_kept, chunks=chunks, segments=tuple(segs),
                   packed_mode="ternary" if options.ternary else "packed", warmup_steps=w,
                   dense_steps=w + int(options.stable_window),
                   grasp_step=max(w - 1, 0) if options.prune_score != "magnitude" else None,
                   index=index)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """``T``."""
        return int(sum(self.tensor_sizes))

    @property
    def kept(self) -> int:
        """``K = Σ_u K_u``."""
        return int(sum(self.unit_kept))

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def packed_offsets(self) -> tuple:
        """Start of unit ``u``'s packed vector in the concatenation of all units' (the
        TernGrad uniforms of a step are drawn once for all ``K`` and sliced)."""
        return tuple(np.concatenate(([0], np.cumsum(self.unit_kept)[:-1])).astype(int).tolist())

    @property
    def num_scales(self) -> int:
        """TernGrad scales of a step in which every unit is ternary."""
        return int(sum(len(s) for s in self.segments))

    # -- the schedule and its records -----------------------------------------------------------
    def modes_at(self, step: int) -> tuple:
        """Every unit's mode at ``step`` when the mask stays stable once pruned: dense before
        :attr:`dense_steps`, :attr:`packed_mode` from then on."""
        mode = "dense" if step < self.dense_steps else self.packed_mode
        return (mode,) * self.num_units

    def calls(self, placement: Placement, modes=None, grasp: bool = False) -> list[Call]:
        """The world records of a step whose units run ``modes`` (default: dense), in the
        strategy's order, on one stream: per unit ``u`` (``[a, b)``), ``dense``: an average
        all-reduce per bucket after its gradients (:class:`~substrate.calls.Ready`) and the
        previous record; ``packed``: one per chunk of the ``K_u`` survivors, the first after
        ``Ready(a, b)``; ``ternary``: a MAX all-reduce of the scales, then the all-gather of
        ``⌈K_u/4⌉`` code bytes per rank.  ``grasp``: GraSP's two all-reduces of ``T`` (eq. 4),
        before the step's records when pruning precedes the first step (``w = 0``), else after
        them (pruning follows the update of step ``w - 1``)."""
        modes = ("dense",) * self.num_units if modes is None else tuple(modes)
        if len(modes) != self.num_units:
            raise ValueError(f"{len(modes)} modes for {self.num_units} mask units")
        world, w = placement.world, self.itemsize
        out: list[Call] = []

        def prev() -> tuple:
            return (len(out) - 1,) if out else ()

        def grasp_calls() -> None:
            for _ in range(2):
                out.append(Call("grasp_allreduce", "allreduce", world, w * self.total, w,
                                op="avg", after=prev()))

        if grasp and self.warmup_steps == 0:
            grasp_calls()
        for u, mode in enumerate(modes):
            a, b = self.units[u]
            if mode == "dense":
                for bi in self.unit_buckets[u]:
                    lo, hi = self.buckets[bi]
                    out.append(Call("dense_allreduce", "allreduce", world, w * (hi - lo), w,
                                    op="avg", after=(Ready(lo, hi), *prev())))
            elif mode == "packed":
                for c, k in enumerate(self.chunks[u]):
                    dep = (Ready(a, b), *prev()) if c == 0 else prev()
                    out.append(Call("packed_allreduce", "allreduce", world, w * k, w, op="avg",
                                    after=dep))
            elif mode == "ternary":
                out.append(Call("ternary_scale", "allreduce", world, w * len(self.segments[u]),
                                w, op="max", after=(Ready(a, b), *prev())))
                out.append(Call("ternary_allgather", "allgather", world,
                                blocks=(-(-self.unit_kept[u] // 4),) * placement.size,
                                after=prev()))
            else:
                raise ValueError(f"unknown PacTrain step mode {mode!r}; use dense, packed or "
                                 "ternary")
        if grasp and self.warmup_steps > 0:
            grasp_calls()
        return out

    def calls_at(self, placement: Placement, step: int) -> list[Call]:
        """The records of ``step`` of the schedule (:meth:`modes_at`, :attr:`grasp_step`)."""
        return self.calls(placement, self.modes_at(step), grasp=step == self.grasp_step)
