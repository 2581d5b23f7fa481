"""The records of one outer iteration of H-SADMM and of flat ADMM, and the iteration's program
(pure: no MPI).

:class:`HSADMMPlan` lists what the solver (:class:`hsadmm.solver.HSADMM`) runs in one outer
iteration, in its order, on any :class:`~substrate.calls.Placement` (PruneX Algorithm 1): its
calls and, between them, the solver's compute (:class:`~substrate.calls.Work` items, each after
the calls whose results it reads):

==================  ==============================  ==========================================
record              what (group)                    ``after``
==================  ==============================  ==========================================
``intra_allreduce`` SUM ring all-reduce of θ + u,   ``"local"`` (the local epochs, eq. 8: the
                    every node (line 9, eq. 9)      ``local_sgd`` block)
``z_update``        compute: z~_i (eq. 9), the      its node's ``intra_allreduce``
                    projection (eq. 10), c = z_i+v
``mask_sync``       bitwise-OR ring all-reduce of   ``z_update``
                    the packed masks, leaders
                    (eq. 14; until frozen)
``mask_bcast``      binomial bcast of the global    ``mask_sync``
                    mask from the leader, every
                    node (until frozen)
``mask_update``     compute: adopt the global       its node's ``mask_bcast``
                    masks, rebuild the shrink plan
``shrink``          compute: compaction of c to     ``mask_update`` (``z_update`` once frozen)
                    the compact buffer (eq. 15)
``inter_allreduce`` average ring all-reduce of one  bucket 0: ``shrink``; bucket k: bucket k-1
                    compact bucket, leaders         (the leaders' blocking loop)
                    (line 23, eq. 15), per bucket
``bcast_z``         binomial bcast of the compact   the last bucket
                    ``z`` from the leader, every
                    node (line 24)
``expand_duals``    compute: zero-fill recovery     its node's ``bcast_z``
                    (§4.4.3), duals (eqs. 12-13),
                    residual sums
``residuals``       SUM ring all-reduce of the      ``expand_duals``
                    per-layer residual sums, world
``penalties``       compute: stopping rule,         ``residuals``
                    residual balancing (§3.4)
==================  ==============================  ==========================================

:class:`FlatADMMPlan` ("PruneX (AR)"): the dense SUM all-reduce of θ + u over the world after
the local epochs, the ``z_update`` (z, projection, duals and residual sums), the residuals after
it and the ``penalties``.

The records are the iteration's program: :func:`iteration_programs` lays them on one rank
(:class:`substrate.program.Placer`) after the local SGD block, and the solver runs that program
(:class:`substrate.executor.Executor`).  An H-SADMM iteration's program comes in two parts, up to
the mask update and from the shrink on: the OR-reduced masks can change the shrink plan and so
the compact buckets of ``inter_allreduce``, so the second part is generated from the plan the
mask update leaves.  The calls alone (:meth:`HSADMMPlan.calls`, each waiting for what the
compute it follows waited for) are what the run accounts and ``commvol`` prices: their bytes
(:func:`substrate.calls.bytes_by_phase`) are what the run books, and :mod:`volume.hsadmm` holds
the closed forms they are tested against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from substrate.calls import Call, Placement, Work
from substrate.program import Builder, Placer, rebase

__all__ = ["EXPAND_DUALS", "LOCAL", "LOCAL_SGD", "MASK_UPDATE", "PENALTIES",
           "RESIDUAL_ITEMSIZE", "RESIDUAL_ROWS", "SHRINK", "Z_UPDATE", "FlatADMMPlan",
           "HSADMMPlan", "bucket_label", "communication", "iteration_program",
           "iteration_programs", "local_sgd_block", "residual_call"]

#: float64 sums per penalty group that the residual all-reduce carries (the solver's rows:
#: ``||θ - z_i||², ||z_i - z_i^old||², ||z_i - z||², ||z - z^old||², ||θ||², ||u||², ||z_i||²,
#: ||v||², ||z||²``, node-level rows from the leaders only)
RESIDUAL_ROWS = 9
RESIDUAL_ITEMSIZE = 8

#: the records' token for the local epochs (eq. 8): the ``local_sgd`` block
LOCAL = "local"
#: the solver's compute blocks of one iteration (Algorithm 1), as it times them
LOCAL_SGD = "local_sgd"          # eq. 8's local epochs, then θ + u
Z_UPDATE = "z_update"            # eqs. 9-10 (flat ADMM: also eqs. 12-13 and the residual sums)
MASK_UPDATE = "mask_update"      # the global masks of eq. 14 adopted, the shrink plan rebuilt
SHRINK = "shrink"                # eq. 15's compaction of z_i + v (the leaders)
EXPAND_DUALS = "expand_duals"    # zero-fill recovery (§4.4.3), eqs. 12-13, residual sums
PENALTIES = "penalties"          # stopping rule and residual balancing (§3.4)


def _count(v, what: str, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    v = int(v)
    if v < low:
        raise ValueError(f"{what} must be >= {low}, got {v}")
    return v


def _index(token) -> bool:
    return isinstance(token, (int, np.integer)) and not isinstance(token, bool)


def residual_call(placement: Placement, num_groups: int, after: tuple) -> Call:
    """The world SUM all-reduce of the :data:`RESIDUAL_ROWS` float64 sums per penalty group."""
    n = RESIDUAL_ITEMSIZE
    return Call("residuals", "allreduce", placement.world, n * RESIDUAL_ROWS * num_groups, n,
                op="sum", after=after)


def bucket_label(k: int) -> str:
    """The label of the ``inter_allreduce`` record of compact bucket ``k``."""
    return f"inter_allreduce[{int(k)}]"


def communication(records) -> list[Call]:
    """The calls of ``records``: a dependency on a compute item becomes what that item waits
    for (the call waits for it through the compute), indices renumbered to the calls' list."""
    out: list[Call] = []
    index: dict[int, int] = {}           # record -> call
    through: dict[int, tuple] = {}       # compute item -> what it waits for
    for i, r in enumerate(records):
        after: list = []
        for t in r.after:
            if not _index(t):
                deps = (t,)                      # a token (the local epochs)
            elif int(t) in through:
                deps = through[int(t)]
            else:
                deps = (index[int(t)],)
            for d in deps:
                if d not in after:
                    after.append(d)
        if isinstance(r, Work):
            through[i] = tuple(after)
        else:
            index[i] = len(out)
            out.append(dataclasses.replace(r, after=tuple(after)))
    return out


class _Records:
    """Appends records, returning the index tuples later records wait for."""

    def __init__(self, placement: Placement) -> None:
        self.nodes = [placement.members(m) for m in range(placement.num_nodes)]
        self.out: list = []

    def add(self, record) -> tuple:
        self.out.append(record)
        return (len(self.out) - 1,)

    def per_node(self, make) -> tuple:
        """One record per node (``make(members)``); returns their indices."""
        return tuple(self.add(make(members))[0] for members in self.nodes)


@dataclass(frozen=True)
class HSADMMPlan:
    """One outer H-SADMM iteration's records (see the module docstring).

    Attributes
    ----------
    total : int
        ``T``: elements of the flat parameter vector (θ + u is reduced whole in every node).
    bucket_sizes : tuple of int
        Elements of each bucket of the compact inter-node buffer (eq. 15; their sum is ``C``).
    mask_bytes : int
        ``B``: packed bytes of the global masks (eq. 14; 0 when no layer is pruned: the solver
        still synchronizes the empty buffer).
    num_groups : int
        Penalty groups (layers), each reducing :data:`RESIDUAL_ROWS` float64.
    itemsize : int
        Bytes per parameter (float32: 4).
    """

    total: int
    bucket_sizes: tuple
    mask_bytes: int
    num_groups: int
    itemsize: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", _count(self.total, "total parameters", 1))
        object.__setattr__(self, "bucket_sizes", tuple(_count(s, "a compact bucket size", 1)
                                                       for s in self.bucket_sizes))
        object.__setattr__(self, "mask_bytes", _count(self.mask_bytes, "mask bytes"))
        object.__setattr__(self, "num_groups", _count(self.num_groups, "penalty groups", 1))
        object.__setattr__(self, "itemsize", _count(self.itemsize, "itemsize", 1))

    @classmethod
    def from_shrink(cls, shrink, num_groups: int) -> HSADMMPlan:
        """The iteration of a :class:`hsadmm.shrink.ShrinkPlan` (its buckets, mask bytes and
        dtype; θ + u covers every tensor the plan lays out)."""
        return cls(shrink.dense_size, tuple(b - a for a, b in shrink.buckets), shrink.mask_bytes,
                   num_groups, shrink.dtype.itemsize)

    @property
    def compact_size(self) -> int:
        """``C``: elements of one leader's compact buffer."""
        return int(sum(self.bucket_sizes))

    def _mask_sync(self, rec: _Records, leaders: tuple, after: tuple) -> tuple:
        """Eq. 14: the leaders' OR of the packed masks, its broadcast in every node and the
        mask update after it."""
        sync = rec.add(Call("mask_sync", "allreduce", leaders, self.mask_bytes, 1, op="bor",
                            after=after))
        bcast = rec.per_node(lambda g: Call("mask_bcast", "bcast", g, self.mask_bytes, 1,
                                            root=0, after=sync))
        return rec.add(Work(MASK_UPDATE, after=bcast))

    def records(self, placement: Placement, *, mask_synced: bool) -> list:
        """The records of one iteration on ``placement``, in the solver's order: its calls and
        compute items (see the module docstring); the mask records only while the masks are
        synchronized (``mask_synced``, before the freeze)."""
        n, T = self.itemsize, self.total
        rec = _Records(placement)
        prev = rec.per_node(lambda g: Call("intra_allreduce", "allreduce", g, n * T, n,
                                           op="sum", after=(LOCAL,)))
        prev = rec.add(Work(Z_UPDATE, after=prev))
        if mask_synced:
            prev = self._mask_sync(rec, placement.leaders, prev)
        prev = rec.add(Work(SHRINK, after=prev))
        for k, size in enumerate(self.bucket_sizes):
            prev = rec.add(Call("inter_allreduce", "allreduce", placement.leaders, n * size, n,
                                op="avg", after=prev, label=bucket_label(k)))
        C = self.compact_size
        prev = rec.per_node(lambda g: Call("bcast_z", "bcast", g, n * C, n, root=0,
                                           after=prev))
        prev = rec.add(Work(EXPAND_DUALS, after=prev))
        prev = rec.add(residual_call(placement, self.num_groups, prev))
        rec.add(Work(PENALTIES, after=prev))
        return rec.out

    def mask_records(self, placement: Placement) -> list:
        """The mask synchronization alone (eq. 14, as :meth:`records` holds it): what a
        benchmark times outside an iteration."""
        rec = _Records(placement)
        self._mask_sync(rec, placement.leaders, ())
        return rec.out

    def calls(self, placement: Placement, *, mask_synced: bool) -> list[Call]:
        """The calls of :meth:`records` (:func:`communication`): each waits for every call of
        the phase before it, bucket after bucket."""
        return communication(self.records(placement, mask_synced=mask_synced))


@dataclass(frozen=True)
class FlatADMMPlan:
    """One flat-ADMM iteration's records: the world SUM all-reduce of θ + u after the local
    epochs, the z update, the residuals and the penalties.

    Attributes
    ----------
    total : int
        ``T``, elements of the flat parameter vector.
    num_groups : int
        Penalty groups (layers).
    itemsize : int
        Bytes per parameter.
    """

    total: int
    num_groups: int
    itemsize: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", _count(self.total, "total parameters", 1))
        object.__setattr__(self, "num_groups", _count(self.num_groups, "penalty groups", 1))
        object.__setattr__(self, "itemsize", _count(self.itemsize, "itemsize", 1))

    def records(self, placement: Placement) -> list:
        """The records of one iteration: calls and compute items in the solver's order."""
        n = self.itemsize
        rec = _Records(placement)
        prev = rec.add(Call("world_allreduce", "allreduce", placement.world, n * self.total, n,
                            op="sum", after=(LOCAL,)))
        prev = rec.add(Work(Z_UPDATE, after=prev))
        prev = rec.add(residual_call(placement, self.num_groups, prev))
        rec.add(Work(PENALTIES, after=prev))
        return rec.out

    def calls(self, placement: Placement) -> list[Call]:
        """The calls of :meth:`records` (:func:`communication`)."""
        return communication(self.records(placement))


# -- the iteration's program ----------------------------------------------------------------------
def local_sgd_block(b: Builder, units, steps: int) -> int:
    """Eq. 8's local epochs as one block of ``b``: ``steps`` forward and backward passes over
    the model's ``units`` (their layer entries, as the model records them: every unit forward,
    the loss, every unit backward); returns the block's entry."""
    i = b.begin(LOCAL_SGD)
    for _ in range(_count(steps, "local steps", 1)):
        for u in units:
            b.layer("forward", u.name)
        b.layer("forward", "loss")
        for u in reversed(units):
            b.layer("backward", u.name)
    b.end()
    return i


def iteration_programs(records, units, local_steps: int, placement: Placement, rank: int, *,
                       overlap: bool) -> list[list]:
    """The program of one outer iteration of world rank ``rank``, in the parts the solver runs
    one after the other (:meth:`substrate.executor.Executor.run_step` each): the local SGD block
    (:func:`local_sgd_block`), then ``records`` (:meth:`HSADMMPlan.records`,
    :meth:`FlatADMMPlan.records`) laid by :class:`substrate.program.Placer`.  H-SADMM's records
    are cut at the ``shrink``: the first part ends with the mask update (which can rebuild the
    shrink plan), the second runs from the shrink on, after everything before it, and ends the
    step; flat ADMM's iteration is one part.

    Parameters
    ----------
    records : sequence
        The iteration's records (calls and compute items; ``after`` naming earlier records and
        :data:`LOCAL`).
    units : sequence
        The model's compute units in forward order (:meth:`models.Model.compute_units`).
    local_steps : int
        SGD steps of the local epochs (:meth:`hsadmm.config.HSADMMConfig.local_steps_for`).
    placement : substrate.calls.Placement
    rank : int
    overlap : bool
        ``--overlap``: a follower waits for the leaders' calls after what they name.
    """
    records = list(records)
    cut = next((i for i, r in enumerate(records) if isinstance(r, Work) and r.label == SHRINK),
               len(records))
    b = Builder()
    local = local_sgd_block(b, units, local_steps)

    def resolve(token):
        if token != LOCAL:
            raise ValueError(f"an ADMM record waits for {token!r}: only records and {LOCAL!r}")
        return local

    parts = []
    head = Placer(b, records[:cut], placement, rank, overlap=overlap, resolve=resolve)
    head.emit_rest()
    head.wait_all()
    if cut < len(records):
        parts.append(b.entries)
        b = Builder()
        # after everything the first part ran: its dependencies are dropped, the rest renumbered
        rest = [dataclasses.replace(r, after=tuple(int(t) - cut if _index(t) else t
                                                   for t in r.after
                                                   if not _index(t) or int(t) >= cut))
                for r in records[cut:]]
        tail = Placer(b, rest, placement, rank, overlap=overlap)
        tail.emit_rest()
        tail.wait_all()
    b.step()
    parts.append(b.entries)
    return parts


def iteration_program(records, units, local_steps: int, placement: Placement, rank: int, *,
                      overlap: bool) -> list:
    """The parts of :func:`iteration_programs` as one step's program (the later parts'
    entries renumbered after the earlier ones): what a run records of the iteration."""
    out: list = []
    for part in iteration_programs(records, units, local_steps, placement, rank,
                                   overlap=overlap):
        out += rebase(part, -len(out))
    return out
