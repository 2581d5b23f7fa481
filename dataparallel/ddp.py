"""Dense data parallelism (PyTorch-DDP style): average the gradients every step.

The flat gradient (backward order) is cut once into contiguous buckets of whole tensors of at
most ``--bucket-mib`` (:func:`substrate.comm.bucket_groups`); each bucket is averaged with one
ring all-reduce over all ranks (``--allreduce ring``) or hierarchically (``--allreduce
hierarchical``: SUM inside each node, leaders' all-reduce across nodes, broadcast inside the node,
as Horovod/NCCL's two-level scheme).  Closed forms: :mod:`commvol.dataparallel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from commvol.dataparallel import ddp_step_bytes, hierarchical_step_bytes
from substrate.comm import bucket_groups

from .strategy import Strategy, register

__all__ = ["DDPOptions", "DDP", "flat_buckets"]

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

    bucket_mib: float = field(default=32.0, metadata={"help": "gradient bucket size in MiB"})
    allreduce: str = field(default="ring", metadata={
        "help": "all-reduce algorithm", "choices": ALLREDUCE_ALGORITHMS})

    def __post_init__(self) -> None:
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")
        if self.allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"--allreduce {self.allreduce!r} unknown; use one of "
                             f"{ALLREDUCE_ALGORITHMS}")


@register
class DDP(Strategy):
    """Average every gradient bucket over all ranks: ``g <- (1/p) Σ_j g_j``."""

    name = "ddp"
    Options = DDPOptions

    def __init__(self, ctx, options: DDPOptions) -> None:
        super().__init__(ctx, options)
        self.itemsize = ctx.model.grads.flat.dtype.itemsize
        self.buckets = flat_buckets(self.layout, int(options.bucket_mib * (1 << 20)),
                                    self.itemsize)

    def sync(self, state, buffers):
        g = buffers.flat
        topo = self.topo
        if self.options.allreduce == "ring":
            for a, b in self.buckets:
                topo.world.allreduce(g[a:b], "avg", phase="grad_allreduce")
            return g
        for a, b in self.buckets:
            topo.intra.allreduce(g[a:b], "sum", phase="intra_allreduce")
            if topo.is_leader:
                topo.inter.allreduce(g[a:b], "sum", phase="inter_allreduce")
            topo.intra.bcast(g[a:b], 0, phase="intra_bcast")
        g /= topo.size
        return g

    def step_bytes(self) -> dict[str, dict]:
        sizes = [b - a for a, b in self.buckets]
        fn = ddp_step_bytes if self.options.allreduce == "ring" else hierarchical_step_bytes
        return fn(M=self.M, P=self.P, bucket_sizes=sizes, itemsize=self.itemsize)

    def report(self) -> dict:
        return {"payload_ratio": 1.0, "buckets": len(self.buckets)}


