"""Dense data parallelism (PyTorch-DDP style): average the gradients every step.

The flat gradient (backward order) is cut once into contiguous buckets of whole tensors of at
most ``--bucket-mib`` (:func:`substrate.comm.bucket_groups`); each bucket is averaged with one
ring all-reduce over all ranks (``--allreduce ring``) or hierarchically (``--allreduce
hierarchical``: SUM inside each node, leaders' all-reduce across nodes, broadcast inside the node,
as Horovod/NCCL's two-level scheme).  Closed forms: :mod:`volume.dataparallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from substrate.buckets import bucket_groups
from substrate.calls import Call, Placement, Ready
from substrate.options import check_choices, option

from .strategy import Strategy, register

__all__ = ["DDP", "DDPOptions", "DDPPlan", "flat_buckets"]

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
        check_choices(self)


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
    def for_layout(cls, layout, options: DDPOptions, itemsize: int = 4) -> DDPPlan:
        buckets = flat_buckets(layout, int(options.bucket_mib * (1 << 20)), itemsize)
        return cls(tuple(buckets), options.allreduce, int(itemsize))

    @property
    def bucket_sizes(self) -> list[int]:
        return [b - a for a, b in self.buckets]

    def calls(self, placement: Placement) -> list[Call]:
        """The records of one step on ``placement``.

        ``ring``: per bucket one all-reduce (average) over all ranks, after the backward wrote
        the bucket and after the previous bucket's (PyTorch DDP issues the buckets in order on
        one communication stream).  ``hierarchical``: per bucket a SUM all-reduce in every
        node, the leaders' all-reduce, a broadcast from the leader in every node, chained on
        each node's stream (Horovod / NCCL's two-level scheme).
        """
        out: list[Call] = []
        n = self.itemsize
        if self.allreduce == "ring":
            for k, (a, b) in enumerate(self.buckets):
                prev = (len(out) - 1,) if out else ()
                out.append(Call("grad_allreduce", "allreduce", placement.world, (b - a) * n, n,
                                op="avg", after=(Ready(a, b), *prev),
                                label=f"grad_allreduce[{k}]", wait=False))
            return out
        nodes = [placement.members(m) for m in range(placement.num_nodes)]
        last = [None] * len(nodes)            # each node's previous bcast
        for k, (a, b) in enumerate(self.buckets):
            intra = []
            for m, members in enumerate(nodes):
                prev = () if last[m] is None else (last[m],)
                intra.append(len(out))
                out.append(Call("intra_allreduce", "allreduce", members, (b - a) * n, n,
                                op="sum", after=(Ready(a, b), *prev),
                                label=f"intra_allreduce[{k}]", wait=False))
            inter = len(out)
            out.append(Call("inter_allreduce", "allreduce", placement.leaders, (b - a) * n, n,
                            op="sum", after=tuple(intra), label=f"inter_allreduce[{k}]",
                            wait=False))
            for m, members in enumerate(nodes):
                last[m] = len(out)
                out.append(Call("intra_bcast", "bcast", members, (b - a) * n, n,
                                after=(inter,), label=f"intra_bcast[{k}]", wait=False))
        return out


@register
class DDP(Strategy):
    """Average every gradient bucket over all ranks: ``g <- (1/p) Σ_j g_j``.

    Runs :meth:`DDPPlan.calls` from the step's program: each record works in place on its
    bucket of the flat gradient; hierarchically, the leader's broadcast brings the node the
    sum, which is divided by the world size."""

    name = "ddp"
    Options = DDPOptions

    def __init__(self, ctx, options: DDPOptions) -> None:
        super().__init__(ctx, options)
        self.itemsize = ctx.model.grads.flat.dtype.itemsize
        self.plan = DDPPlan.for_layout(self.layout, options, self.itemsize)
        self.buckets = self.plan.buckets
        self._records = self.plan.calls(self.topo.placement)
        g = ctx.model.grads.flat
        self._bucket = {f"{phase}[{k}]": g[a:b] for k, (a, b) in enumerate(self.buckets)
                        for phase in ("grad_allreduce", "intra_allreduce", "inter_allreduce",
                                      "intra_bcast")}

    def records(self, state) -> list[Call]:
        return self._records

    def buffer(self, call: Call):
        return self._bucket[call.label]

    def received(self, call: Call, result) -> None:
        if call.phase == "intra_bcast":          # the node's sum of the bucket: average it
            result /= self.topo.size

    def report(self) -> dict:
        return {"payload_ratio": 1.0, "buckets": len(self.buckets)}
