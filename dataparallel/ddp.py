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
from substrate.options import option

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
                                label=f"grad_allreduce[{k}]"))
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
                                label=f"intra_allreduce[{k}]"))
            inter = len(out)
            out.append(Call("inter_allreduce", "allreduce", placement.leaders, (b - a) * n, n,
                            op="sum", after=tuple(intra), label=f"inter_allreduce[{k}]"))
            for m, members in enumerate(nodes):
                last[m] = len(out)
                out.append(Call("intra_bcast", "bcast", members, (b - a) * n, n,
                                after=(inter,), label=f"intra_bcast[{k}]"))
        return out


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
        # the bucket of every tensor, and how many of its tensors the backward has still to
        # write (buckets are whole tensors, contiguous in backward order)
        ends = [b for _, b in self.buckets]
        offsets = self.layout.offsets
        self._bucket_of = {n: next(k for k, e in enumerate(ends) if offsets[n] < e)
                           for n in self.layout.names}
        self._tensors = [sum(1 for n in self.layout.names if self._bucket_of[n] == k)
                         for k in range(len(self.buckets))]
        self._left = list(self._tensors)
        self._grads = ctx.model.grads.flat
        self._issued: list = []          # handles of this step's calls, in issue order
        self._prev = None                # the last call on the communication stream

    def on_ready(self, name: str) -> None:
        """The backward wrote ``name``'s gradient: when that completes a bucket, hand the
        bucket to the communication stream at once (it is reduced while the backward goes on,
        PyTorch DDP's overlap); :meth:`sync` waits for every bucket."""
        k = self._bucket_of.get(name)
        if k is None or not self.run.recorder.overlap:
            return           # --overlap off: every bucket blocks, after the backward
        self._left[k] -= 1
        if self._left[k] == 0:
            self._issue(k, self.run.clock.now())

    def _issue(self, k: int, ready) -> None:
        """Issue bucket ``k`` without waiting: its call(s) after ``ready`` (the backward event
        that wrote it) and the previous call on the stream."""
        a, b = self.buckets[k]
        g, topo = self._grads, self.topo
        if self.options.allreduce == "ring":
            self._prev = topo.world.allreduce(g[a:b], "avg", phase="grad_allreduce",
                                              after=[ready, self._prev], wait=False)
            self._issued.append(self._prev)
            return
        h = topo.intra.allreduce(g[a:b], "sum", phase="intra_allreduce",
                                 after=[ready, self._prev], wait=False)
        h2 = topo.leaders.allreduce(g[a:b], "sum", phase="inter_allreduce", after=h,
                                    wait=False)
        self._prev = topo.intra.bcast(g[a:b], 0, phase="intra_bcast", after=h2, wait=False)
        self._issued += [h, h2, self._prev]

    def sync(self, state, buffers):
        """Every bucket, as :meth:`DDPPlan.calls` lists them.  Buckets the backward completed
        were issued then (:meth:`on_ready`); the rest (a backward run without the ready hook)
        are issued here, each after the backward event that wrote it; then wait for all.  The
        stream runs the same exact algorithm in the same order as a blocking call: the result
        is bitwise the blocking run's."""
        clock = self.run.clock
        for k, (a, b) in enumerate(self.buckets):
            if self._left[k] > 0:                # not issued during the backward
                self._left[k] = 0
                self._issue(k, clock.ready(a, b))
        for h in self._issued:
            h.wait()
        self._issued, self._prev = [], None
        self._left = list(self._tensors)
        g = buffers.flat
        if self.options.allreduce == "hierarchical":
            g /= self.topo.size
        return g

    def step_calls(self) -> list[Call]:
        return self.plan.calls(self.topo.placement)

    def report(self) -> dict:
        return {"payload_ratio": 1.0, "buckets": len(self.buckets)}


