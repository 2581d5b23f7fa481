"""Dense data parallelism (PyTorch-DDP style): average the gradients every step.

The flat gradient (backward order) is cut once into contiguous buckets of whole tensors of at
most ``--bucket-mib`` (:func:`substrate.comm.bucket_groups`); each bucket is averaged with one
ring all-reduce over all ranks (``--allreduce ring``) or hierarchically (``--allreduce
hierarchical``: SUM inside each node, leaders' all-reduce across nodes, broadcast inside the node,
as Horovod/NCCL's two-level scheme).  Closed forms: :mod:`volume.dataparallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from substrate.comm import bucket_groups
from substrate.options import option
from volume.dataparallel import ddp_step_bytes, hierarchical_step_bytes

from .strategy import Strategy, register

__all__ = ["DDPOptions", "DDPPlan", "DDP", "flat_buckets"]

ALLREDUCE_ALGORITHMS = ("ring", "hierarchical")


def flat_buckets(layout, bucket_bytes: int, itemsize: int) -> list[tuple[int, int]]:
    """Contiguous ``[a, b)`` ranges of the flat buffer, whole tensors in backward order, each
    at most ``bucket_bytes`` (a larger tensor gets a bucket of its own)."""
    sizes = [layout.sizes[n] for n in layout.names]
    out, start = [], 0
    for g in bucket_groups([s * itemsize for s in sizes], bucket_bytes):
        n = sum(sizes[i] for i in g)
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class DDPOptions:
    """Options of dense DDP."""

    bucket_mib: float = option(32.0, "gradient bucket size in MiB")
    allreduce: str = option("ring", "all-reduce algorithm", choices=ALLREDUCE_ALGORITHMS)

    def __post_init__(self) -> None:
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")
        if self.allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"--allreduce {self.allreduce!r} unknown; use one of "
                             f"{ALLREDUCE_ALGORITHMS}")


@dataclass(frozen=True)
class DDPPlan:
    """The one plan of dense DDP: the gradient buckets and the all-reduce algorithm.

    ``buckets`` are contiguous ``[a, b)`` element ranges of the flat gradient (backward order,
    whole tensors, at most ``--bucket-mib`` each unless one tensor is larger); every step
    all-reduces each bucket once.  Built without MPI from the layout alone, so the run
    (:class:`DDP`) and the prediction (``commvol.systems.dataparallel``) execute the same plan.
    """

    buckets: tuple[tuple[int, int], ...]
    allreduce: str
    itemsize: int

    @classmethod
    def for_layout(cls, layout, options: DDPOptions, itemsize: int = 4) -> "DDPPlan":
        buckets = flat_buckets(layout, int(options.bucket_mib * (1 << 20)), itemsize)
        return cls(tuple(buckets), options.allreduce, int(itemsize))

    @property
    def bucket_sizes(self) -> list[int]:
        return [b - a for a, b in self.buckets]

    def step_bytes(self, M: int, P: int) -> dict[str, dict]:
        """``{phase: {"intra", "inter"}}`` of one step on ``M`` nodes of ``P`` ranks."""
        fn = ddp_step_bytes if self.allreduce == "ring" else hierarchical_step_bytes
        return fn(M=M, P=P, bucket_sizes=self.bucket_sizes, itemsize=self.itemsize)


@register
class DDP(Strategy):
    """Average every gradient bucket over all ranks: ``g <- (1/p) Σ_j g_j``."""

    name = "ddp"
    Options = DDPOptions

    def __init__(self, ctx, options: DDPOptions) -> None:
        super().__init__(ctx, options)
        self.itemsize = ctx.model.grads.flat.dtype.itemsize
        self.plan = DDPPlan.for_layout(self.layout, options, self.itemsize)
        self.buckets = self.plan.buckets

    def sync(self, state, buffers):
        """All-reduce every bucket.  On the timeline each bucket's transfer starts as soon as
        the backward has written its gradients and the previous bucket's has ended (PyTorch
        DDP's overlap: the buckets' all-reduces are issued in order on one communication
        stream, so they overlap the backward, not each other); the hierarchical phases of a
        bucket are chained intra -> inter -> intra on that stream."""
        g = buffers.flat
        topo, clock = self.topo, self.run.clock
        tl = clock.timeline
        nb = self.itemsize
        prev = None                      # the last transfer declared on the stream
        if self.options.allreduce == "ring":
            for a, b in self.buckets:
                topo.world.allreduce(g[a:b], "avg", phase="grad_allreduce")
                if tl is not None:
                    prev = tl.collective(topo.world, "grad_allreduce", (b - a) * nb,
                                         deps=[clock.ready(a, b), prev])
            return g
        for a, b in self.buckets:
            topo.intra.allreduce(g[a:b], "sum", phase="intra_allreduce")
            if topo.is_leader:
                topo.inter.allreduce(g[a:b], "sum", phase="inter_allreduce")
            topo.intra.bcast(g[a:b], 0, phase="intra_bcast")
            if tl is not None:
                ev = tl.collective(topo.intra, "intra_allreduce", (b - a) * nb,
                                   deps=[clock.ready(a, b), prev])
                # every rank of the node waits for its leader's inter-node phase
                ev = tl.transfer("inter_allreduce", "inter" if self.M > 1 else "intra",
                                 (b - a) * nb, algorithm="allreduce", p=self.M, deps=ev)
                prev = tl.collective(topo.intra, "intra_bcast", (b - a) * nb,
                                     algorithm="bcast", deps=ev)
        g /= topo.size
        return g

    def step_bytes(self) -> dict[str, dict]:
        return self.plan.step_bytes(self.M, self.P)

    def report(self) -> dict:
        return {"payload_ratio": 1.0, "buckets": len(self.buckets)}


