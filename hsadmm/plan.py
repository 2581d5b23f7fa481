"""The call records of one outer iteration of H-SADMM and of flat ADMM (pure: no MPI).

:class:`HSADMMPlan` lists what the solver (:class:`hsadmm.solver.HSADMM`) executes in one outer
iteration, in its order, on any :class:`~substrate.calls.Placement` (PruneX Algorithm 1):

==================  ==============================  ==========================================
phase               call (group)                    ``after``
==================  ==============================  ==========================================
``intra_allreduce`` SUM ring all-reduce of θ + u,   ``"local"`` (the local epochs, eq. 8)
                    every node (line 9, eq. 9)
``mask_sync``       bitwise-OR ring all-reduce of   every node's ``intra_allreduce``
                    the packed masks, leaders
                    (eq. 14; until frozen)
``mask_bcast``      binomial bcast of the global    ``mask_sync``
                    mask from the leader, every
                    node (until frozen)
``inter_allreduce`` average ring all-reduce of one  bucket 0: every node's previous call
                    compact bucket, leaders         (``mask_bcast``, or ``intra_allreduce``
                    (line 23, eq. 15), per bucket   once frozen); bucket k: bucket k-1 (the
                                                    leaders' blocking loop)
``bcast_z``         binomial bcast of the compact   the last bucket
                    ``z`` from the leader, every
                    node (line 24)
``residuals``       SUM ring all-reduce of the      every node's ``bcast_z``
                    per-layer residual sums, world
==================  ==============================  ==========================================

:class:`FlatADMMPlan` ("PruneX (AR)"): the dense SUM all-reduce of θ + u over the world after
the local epochs, then the residuals after it.

The bytes of these records (:func:`substrate.calls.bytes_by_phase`) are what the run books and
``commvol`` predicts; :mod:`volume.hsadmm` holds the closed forms they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from substrate.calls import Call, Placement

__all__ = ["RESIDUAL_ITEMSIZE", "RESIDUAL_ROWS", "FlatADMMPlan", "HSADMMPlan", "residual_call"]

#: float64 sums per penalty group that the residual all-reduce carries (the solver's rows:
#: ``||θ - z_i||², ||z_i - z_i^old||², ||z_i - z||², ||z - z^old||², ||θ||², ||u||², ||z_i||²,
#: ||v||², ||z||²``, node-level rows from the leaders only)
RESIDUAL_ROWS = 9
RESIDUAL_ITEMSIZE = 8


def _count(v, what: str, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    v = int(v)
    if v < low:
        raise ValueError(f"{what} must be >= {low}, got {v}")
    return v


def residual_call(placement: Placement, num_groups: int, after: tuple) -> Call:
    """The world SUM all-reduce of the :data:`RESIDUAL_ROWS` float64 sums per penalty group."""
    n = RESIDUAL_ITEMSIZE
    return Call("residuals", "allreduce", placement.world, n * RESIDUAL_ROWS * num_groups, n,
                op="sum", after=after)


@dataclass(frozen=True)
class HSADMMPlan:
    """One outer H-SADMM iteration's communication (see the module docstring).

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

    def calls(self, placement: Placement, *, mask_synced: bool) -> list[Call]:
        """The records of one iteration on ``placement``, in the solver's order; the mask
        calls only while the masks are synchronized (``mask_synced``, before the freeze)."""
        n, T = self.itemsize, self.total
        nodes = [placement.members(m) for m in range(placement.num_nodes)]
        leaders = placement.leaders
        out: list[Call] = []

        def per_node(make) -> tuple:
            idx = []
            for members in nodes:
                idx.append(len(out))
                out.append(make(members))
            return tuple(idx)

        prev = per_node(lambda g: Call("intra_allreduce", "allreduce", g, n * T, n, op="sum",
                                       after=("local",)))
        if mask_synced:
            out.append(Call("mask_sync", "allreduce", leaders, self.mask_bytes, 1, op="bor",
                            after=prev))
            sync = (len(out) - 1,)
            prev = per_node(lambda g: Call("mask_bcast", "bcast", g, self.mask_bytes, 1,
                                           root=0, after=sync))
        for k, size in enumerate(self.bucket_sizes):
            out.append(Call("inter_allreduce", "allreduce", leaders, n * size, n, op="avg",
                            after=prev, label=f"inter_allreduce[{k}]"))
            prev = (len(out) - 1,)
        C = self.compact_size
        prev = per_node(lambda g: Call("bcast_z", "bcast", g, n * C, n, root=0, after=prev))
        out.append(residual_call(placement, self.num_groups, prev))
        return out


@dataclass(frozen=True)
class FlatADMMPlan:
    """One flat-ADMM iteration's communication: the world SUM all-reduce of θ + u after the
    local epochs, then the residuals.

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

    def calls(self, placement: Placement) -> list[Call]:
        n = self.itemsize
        return [Call("world_allreduce", "allreduce", placement.world, n * self.total, n,
                     op="sum", after=("local",)),
                residual_call(placement, self.num_groups, (0,))]
