"""PacTrain's plan (paper 002): :class:`PacTrainPlan`, every step's call records.

:meth:`PacTrainPlan.build` (pure: layout, options and the run's kept index set or, for a
prediction, the keep rate) gives ``K`` per tensor and bucket, the chunks, the TernGrad
segments, the dense-until-stable schedule and every step's call records
(:meth:`PacTrainPlan.calls`), which :mod:`commvol.systems.pactrain` prices; the same calls with
the codec's compute items (:meth:`PacTrainPlan.records`, :meth:`PacTrainPlan.grasp_records`)
are what the run's step programs are generated from (the strategy, :mod:`.strategy`, binds
them).  Independent closed forms: :mod:`volume.pactrain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from substrate.calls import Call, Placement, Ready, Work

from ..ddp import flat_buckets
from ..program import UPDATED
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
        ``⌈K_u/4⌉`` code bytes per rank.  Every one goes to the communication stream (the
        run overlaps them with the backward).  ``grasp``: GraSP's two all-reduces of ``T``
        (eq. 4, blocking), before the step's records when pruning precedes the first step
        (``w = 0``: the strategy's set-up, :meth:`grasp_records`), else after them (pruning
        follows the update of step ``w - 1``)."""
        out: list = []
        if grasp and self.warmup_steps == 0:
            self._grasp(out, placement, work=False, after=())
        self._step(out, placement, modes, work=False)
        if grasp and self.warmup_steps > 0:
            self._grasp(out, placement, work=False, after=(len(out) - 1,) if out else ())
        return out

    def records(self, placement: Placement, modes=None, *, gse: bool = False,
                ternary_wait: str = "bucket", grasp: bool = False) -> list:
        """The run's records of a step (:meth:`PacTrain.records <dataparallel.pactrain.
        PacTrain.records>`): :meth:`calls`'s calls in the same order, with the codec's compute
        items (:class:`~substrate.calls.Work`) where the strategy computes them, so the step's
        program times them as the paper's system (a DDP communication hook) would:

        * ``pactrain_gse[k]``: eq. 2 on dense bucket ``k`` once pruned (``gse``), before its
          all-reduce;
        * ``pactrain_pack[u]``: unit ``u``'s survivors gathered into its packed vector (and,
          ternary, each segment's ``max|g|``), before its first call;
        * ``pactrain_encode[u]``: a ternary unit's codes ``sign(g) b`` (eq. 3) once its scales
          are back, and then its codes' all-gather: with ``ternary_wait`` ``"bucket"`` when the
          next unit's gradients are written (the host waits for the scales there, before the
          next unit's calls), with ``"backward"`` (or for the last unit) after the backward;
        * ``pactrain_unpack[u]``: a packed or ternary unit's average back into the gradient
          (zeros elsewhere in the unit), after the backward, once its calls are done.

        ``grasp``: GraSP's set-up (:meth:`grasp_records`) after the step's update
        (:data:`dataparallel.program.UPDATED`), where the warm-up ends."""
        out: list = []
        self._step(out, placement, modes, work=True, gse=gse, ternary_wait=ternary_wait)
        if grasp:
            self._grasp(out, placement, work=True, after=(UPDATED,))
        return out

    def grasp_records(self, placement: Placement) -> list:
        """GraSP's scores (eq. 4) as a set-up the strategy runs before the first step when it
        prunes at once (``--warmup-steps 0``): ``pactrain_grasp_grad`` (the gradient ``∇ℓ``
        on the GraSP samples), its average all-reduce, ``pactrain_grasp_hvp`` (the finite
        difference ``H ∇ℓ``), its average all-reduce, ``pactrain_grasp_score``; blocking."""
        out: list = []
        self._grasp(out, placement, work=True, after=())
        return out

    def _grasp(self, out: list, placement: Placement, *, work: bool, after: tuple) -> None:
        world, w, T = placement.world, self.itemsize, self.total
        for k in range(2):
            if work:
                out.append(Work("pactrain_grasp_grad" if k == 0 else "pactrain_grasp_hvp",
                                after=after))
                after = (len(out) - 1,)
            out.append(Call("grasp_allreduce", "allreduce", world, w * T, w, op="avg",
                            after=after, label=f"grasp_allreduce[{k}]"))
            after = (len(out) - 1,)
        if work:
            out.append(Work("pactrain_grasp_score", after=after))

    def _step(self, out: list, placement: Placement, modes, *, work: bool, gse: bool = False,
              ternary_wait: str = "bucket") -> None:
        """Append one step's records to ``out`` (see :meth:`calls`, :meth:`records`)."""
        modes = ("dense",) * self.num_units if modes is None else tuple(modes)
        if len(modes) != self.num_units:
            raise ValueError(f"{len(modes)} modes for {self.num_units} mask units")
        world, w, p = placement.world, self.itemsize, placement.size
        last: list = [len(out) - 1] if out else []      # the previous record on the stream
        pending: list = []                    # a ternary unit waiting for its scales
        unpack: list = []                     # (unit, its calls)

        def call(c: Call) -> int:
            out.append(c)
            last[:] = [len(out) - 1]
            return len(out) - 1

        def compute(label: str, nbytes: float, after: tuple) -> tuple:
            if not work:
                return ()
            out.append(Work(label, nbytes=nbytes, after=after))
            return (len(out) - 1,)

        def flush(at: tuple) -> None:
            """The pending ternary unit's encoding, where the host waits for its scales
            (``at``: the next unit's gradients; none: after the backward), and its
            all-gather."""
            if not pending:
                return
            u, scales, pack = pending.pop()
            k = self.unit_kept[u]
            enc = compute(f"pactrain_encode[{u}]", (3 * w + 2) * k, (scales, *at))
            g = call(Call("ternary_allgather", "allgather", world, blocks=(-(-k // 4),) * p,
                          after=(scales, *enc) if work else tuple(last), wait=False,
                          label=f"ternary_allgather[{u}]"))
            unpack.append((u, (*pack, g)))

        def before_calls(ready: tuple) -> None:
            """A unit's (or dense bucket's) calls follow the pending ternary unit's."""
            if work:
                flush(ready if ternary_wait == "bucket" else ())

        for u, mode in enumerate(modes):
            a, b = self.units[u]
            k = self.unit_kept[u]
            if mode == "dense":
                for bi in self.unit_buckets[u]:
                    lo, hi = self.buckets[bi]
                    ready = (Ready(lo, hi),)
                    mask = (compute(f"pactrain_gse[{bi}]", (2 * w + 1) * (hi - lo), ready)
                            if gse else ())
                    before_calls(ready)
                    call(Call("dense_allreduce", "allreduce", world, w * (hi - lo), w,
                              op="avg", after=(*ready, *mask, *last), wait=False,
                              label=f"dense_allreduce[{bi}]"))
                continue
            if mode not in ("packed", "ternary"):
                raise ValueError(f"unknown PacTrain step mode {mode!r}; use dense, packed or "
                                 "ternary")
            ready = (Ready(a, b),)
            pack = compute(f"pactrain_pack[{u}]",
                           (2 * w + 8) * k + (w * k if mode == "ternary" else 0), ready)
            before_calls(ready)
            if mode == "packed":
                chunks = []
                for c, n in enumerate(self.chunks[u]):
                    dep = (*ready, *pack, *last) if c == 0 else tuple(last)
                    chunks.append(call(Call("packed_allreduce", "allreduce", world, w * n, w,
                                            op="avg", after=dep, wait=False,
                                            label=f"packed_allreduce[{u}.{c}]")))
                unpack.append((u, (*pack, *chunks)))
            else:
                scales = call(Call("ternary_scale", "allreduce", world,
                                   w * len(self.segments[u]), w, op="max",
                                   after=(*ready, *pack, *last), wait=False,
                                   label=f"ternary_scale[{u}]"))
                pending.append((u, scales, pack))
                if not work:
                    flush(())
        flush(())
        if work:
            for u, deps in unpack:
                a, b = self.units[u]
                k = self.unit_kept[u]
                codes = p * -(-k // 4) if modes[u] == "ternary" else 0
                compute(f"pactrain_unpack[{u}]", w * (b - a) + (2 * w + 8) * k + codes, deps)

    def calls_at(self, placement: Placement, step: int) -> list[Call]:
        """The records of ``step`` of the schedule (:meth:`modes_at`, :attr:`grasp_step`)."""
        return self.calls(placement, self.modes_at(step), grasp=step == self.grasp_step)
