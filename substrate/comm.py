"""Ledger-recording wrappers around the mpi4py calls spardist needs.

No module outside ``substrate`` calls an mpi4py communication method; they call a :class:`Comm`
method with a ``phase`` label, which performs the communication and records what this rank sent
into the run's :class:`~substrate.ledger.Ledger` under the named algorithm of
:mod:`substrate.costmodel`.  In the default ``exact`` mode the collectives are
:mod:`substrate.collectives`' own point-to-point implementations of exactly these algorithms and
the ledger records the bytes they handed to MPI; in ``native`` mode the MPI library's collective
runs (pinned where spardist knows how) and the ledger books the algorithm's bytes:

============  ============================  ==============================================
call          algorithm (accounting)        bytes this rank sends per call
============  ============================  ==============================================
allreduce     ring RS + AG                  ``2n - c_{(i+1)%p} - c_{(i+2)%p}``
allgather(v)  ring                          ``N - b_{(i+1)%p}``
bcast         binomial tree                 ``n`` per child
isend         direct                        ``n`` (recorded by the sender)
alltoallv     pairwise direct               ``sendcounts[j]`` to each ``j != i``
barrier       dissemination                 0 bytes, ``ceil(log2 p)`` messages
============  ============================  ==============================================

The link class of every byte follows from the two endpoints' nodes (``Topology.node_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from . import collectives as coll
from .backend import Backend, array_module, get_backend
from .costmodel import (
    INTER,
    INTRA,
    CostModel,
    binomial_children,
    binomial_depth,
    ring_allgatherv_sent,
    ring_allreduce_sent,
)
from .ledger import Ledger

__all__ = ["Comm", "Request", "bucketed_allreduce", "BucketPlan", "bucket_groups"]

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "bor": MPI.BOR}


@dataclass
class Request:
    """A pending point-to-point operation; :meth:`Comm.waitall` completes it."""

    mpi: MPI.Request
    buf: object = None
    view: object = None
    backend: Backend | None = None

    def _finish(self) -> None:
        if self.backend is not None and self.view is not None:
            self.backend.mpi_done(self.buf, self.view)


class Comm:
    """A communicator that records its traffic.

    Parameters
    ----------
    mpi : mpi4py.MPI.Intracomm
        The communicator (owned: created by the topology, never ``COMM_WORLD`` itself).
    node_of_world : numpy.ndarray
        Node id of every world rank.
    world_ranks : numpy.ndarray
        World rank of each member, indexed by rank in ``mpi``.
    ledger, cost : Ledger, CostModel
        Shared by every communicator of the run.
    backend : Backend, optional
        Array backend used to hand buffers to MPI (CPU by default).
    collectives : {"exact", "native"}, optional
        How collectives run (:mod:`substrate.collectives`); default ``SPARDIST_COLLECTIVES`` or
        ``exact``.
    """

    def __init__(self, mpi: MPI.Intracomm, node_of_world: np.ndarray, world_ranks: np.ndarray,
                 ledger: Ledger, cost: CostModel, backend: Backend | None = None,
                 collectives: str | None = None) -> None:
        self.mpi = mpi
        self.mode = coll.check_mode(collectives) if collectives else coll.default_mode()
        self._coll_mpi: MPI.Intracomm | None = None
        self.rank = mpi.Get_rank()
        self.size = mpi.Get_size()
        self.node_of_world = np.asarray(node_of_world)
        self.world_ranks = np.asarray(world_ranks, dtype=np.int64)
        self.ledger = ledger
        self.cost = cost
        self.backend = backend or get_backend("cpu")
        self.member_nodes = self.node_of_world[self.world_ranks]
        p = self.size
        # ring link i -> i+1 classes, fixed for the life of the communicator
        nxt = np.roll(self.member_nodes, -1)
        self.ring_links = np.where(self.member_nodes == nxt, 0, 1)  # 0 intra, 1 inter
        self.inter_ring_links = int(self.ring_links.sum()) if p > 1 else 0
        self.out_link = INTER if (p > 1 and self.ring_links[self.rank]) else INTRA
        self.slowest = INTER if self.inter_ring_links else INTRA
        self.link = "none" if p == 1 else (
            INTRA if self.inter_ring_links == 0 else
            INTER if self.inter_ring_links == p else "mixed")
        self._bcast_cache: dict[int, tuple[int, int, int]] = {}
        self._bucket_plans: dict = {}

    # -- helpers ---------------------------------------------------------------------------------
    def link_to(self, other: int) -> str:
        """Link class between this rank and member ``other``."""
        return INTRA if self.member_nodes[other] == self.member_nodes[self.rank] else INTER

    @staticmethod
    def _check(buf, what: str) -> None:
        if not getattr(buf, "flags", None) or not buf.flags.c_contiguous:
            raise ValueError(f"{what} needs a C-contiguous array (got {type(buf).__name__}); "
                             "pass np.ascontiguousarray(buf)")

    def _by_link(self, nbytes: int, link: str) -> tuple[int, int]:
        return (nbytes, 0) if link == INTRA else (0, nbytes)

    def sub(self, color: int, key: int | None = None) -> "Comm | None":
        """Split into sub-communicators (collective); ``color < 0`` gets ``None``."""
        c = self.mpi.Split(MPI.UNDEFINED if color < 0 else color,
                           self.rank if key is None else key)
        if c == MPI.COMM_NULL:
            return None
        members = np.array(c.allgather(int(self.world_ranks[self.rank])), dtype=np.int64)
        return Comm(c, self.node_of_world, members, self.ledger, self.cost, self.backend,
                    self.mode)

    @property
    def exact(self) -> bool:
        """True when collectives run on spardist's own point-to-point algorithms."""
        return self.mode == "exact" and self.size > 1

    def _cmpi(self) -> MPI.Intracomm:
        """Private duplicate for the exact collectives (created on the first collective call,
        which every member makes in the same order), so their messages never match user ones."""
        if self._coll_mpi is None:
            self._coll_mpi = self.mpi.Dup()
        return self._coll_mpi

    def _record_sent(self, phase: str, payload: int, sent, modeled_s: float) -> None:
        """Record the messages an exact collective handed to MPI: ``(dest, nbytes)`` pairs."""
        intra = inter = 0
        links = set()
        for dest, nb in sent:
            link = self.link_to(dest)
            if link == INTRA:
                intra += nb
            else:
                inter += nb
            if nb:
                links.add(link)
        self.ledger.record(phase, payload=payload, intra=intra, inter=inter, messages=len(sent),
                           modeled_s=modeled_s, links=links)

    # -- collectives -----------------------------------------------------------------------------
    def allreduce(self, buf, op: str = "sum", *, phase: str):
        """In-place all-reduce of ``buf`` (ring algorithm in the ledger).

        ``op`` is ``"sum"``, ``"avg"`` (sum divided by the size), ``"max"``, ``"min"`` or
        ``"bor"`` (bitwise OR; unsigned-integer arrays, e.g. ``numpy.packbits`` masks).
        """
        if op not in _OPS:
            raise ValueError(f"unknown all-reduce op {op!r}; use one of {sorted(_OPS)}")
        self._check(buf, "allreduce")
        if op == "bor" and buf.dtype.kind not in "ub":
            raise ValueError(f"bitwise-OR all-reduce needs unsigned integer or bool data, got "
                             f"{buf.dtype}; pack masks with numpy.packbits first")
        if op == "avg" and buf.dtype.kind != "f":
            raise ValueError(f"'avg' all-reduce needs floating-point data, got {buf.dtype}")
        if self.exact:
            view = self.backend.mpi_view(buf)
            sent = coll.ring_allreduce(self._cmpi(), view.reshape(-1), op, array_module(view))
            self.backend.mpi_done(buf, view)
            self._record_sent(phase, buf.nbytes, sent, self.cost.ring_allreduce_time(
                buf.nbytes, self.size, self.slowest))
        else:
            if self.size > 1:
                view = self.backend.mpi_view(buf)
                self.mpi.Allreduce(MPI.IN_PLACE, view, op=_OPS[op])
                self.backend.mpi_done(buf, view)
            self._record_allreduce(phase, buf.size, buf.itemsize)
        if op == "avg" and self.size > 1:
            buf /= self.size
        return buf

    def _record_allreduce(self, phase: str, count: int, itemsize: int) -> None:
        p = self.size
        sent = ring_allreduce_sent(count, itemsize, p, self.rank)
        intra, inter = self._by_link(sent, self.out_link)
        self.ledger.record(phase, payload=count * itemsize, intra=intra, inter=inter,
                           messages=2 * (p - 1),
                           modeled_s=self.cost.ring_allreduce_time(count * itemsize, p,
                                                                   self.slowest),
                           links=(self.out_link,) if p > 1 else ())

    def bcast(self, buf, root: int = 0, *, phase: str):
        """In-place broadcast from ``root`` (binomial tree in the ledger)."""
        self._check(buf, "bcast")
        if not 0 <= root < self.size:
            raise ValueError(f"bcast root {root} outside communicator of size {self.size}")
        intra_kids, inter_kids, slow = self._bcast_plan(root)
        n = buf.nbytes
        if self.exact:
            view = self.backend.mpi_view(buf, fill=self.rank == root)
            sent = coll.binomial_bcast(self._cmpi(), view, root)
            self.backend.mpi_done(buf, view)
            self._record_sent(phase, n, sent, self.cost.bcast_time(n, self.size, slow))
            return buf
        if self.size > 1:
            view = self.backend.mpi_view(buf, fill=self.rank == root)
            self.mpi.Bcast(view, root=root)
            self.backend.mpi_done(buf, view)
        links = tuple(x for x, k in ((INTRA, intra_kids), (INTER, inter_kids)) if k)
        self.ledger.record(phase, payload=n, intra=intra_kids * n, inter=inter_kids * n,
                           messages=intra_kids + inter_kids,
                           modeled_s=self.cost.bcast_time(n, self.size, slow), links=links)
        return buf

    def _bcast_plan(self, root: int) -> tuple[int, int, str]:
        plan = self._bcast_cache.get(root)
        if plan is None:
            p = self.size
            rel = (self.rank - root) % p
            kids = [(k + root) % p for k in binomial_children(rel, p)]
            inter = sum(self.link_to(k) == INTER for k in kids)
            any_inter = any(
                self.member_nodes[(r + root) % p] != self.member_nodes[(c + root) % p]
                for r in range(p) for c in binomial_children(r, p))
            plan = (len(kids) - inter, inter, INTER if any_inter else INTRA)
            self._bcast_cache[root] = plan
        return plan

    def allgather(self, buf, *, phase: str):
        """Gather equal-size ``buf`` from every rank: returns shape ``(size, *buf.shape)``."""
        self._check(buf, "allgather")
        xp = array_module(buf)
        out = xp.empty((self.size, *buf.shape), dtype=buf.dtype)
        if self.exact:
            out[self.rank] = buf
            counts = np.full(self.size, buf.size, dtype=np.int64)
            self._exact_allgatherv(out.reshape(-1), counts, buf.nbytes, phase)
            return out
        if self.size > 1:
            sview = self.backend.mpi_view(buf)
            rview = self.backend.mpi_view(out, fill=False)
            self.mpi.Allgather(sview, rview)
            self.backend.mpi_done(out, rview)
        else:
            out[0] = buf
        self._record_allgather(phase, [buf.nbytes] * self.size, buf.nbytes)
        return out

    def _exact_allgatherv(self, flat, counts: np.ndarray, payload: int, phase: str) -> None:
        """Ring all-gather(v) in place on ``flat`` (own block already at its offset)."""
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        view = self.backend.mpi_view(flat)
        sent = coll.ring_allgatherv(self._cmpi(), view, counts, displs)
        self.backend.mpi_done(flat, view)
        self._record_sent(phase, payload, sent, self.cost.ring_allgather_time(
            int(counts.sum()) * flat.itemsize, self.size, self.slowest))

    def _record_allgather(self, phase: str, block_bytes: Sequence[int], payload: int) -> None:
        p = self.size
        sent = ring_allgatherv_sent(block_bytes, self.rank)
        intra, inter = self._by_link(sent, self.out_link)
        self.ledger.record(phase, payload=payload, intra=intra, inter=inter,
                           messages=p - 1,
                           modeled_s=self.cost.ring_allgather_time(sum(block_bytes), p,
                                                                   self.slowest),
                           links=(self.out_link,) if p > 1 else ())

    def allgatherv(self, buf, counts: Sequence[int] | None = None, *, phase: str):
        """Gather 1-D ``buf`` of varying length from every rank.

        ``counts`` (element counts per rank) may be passed when known from a plan; otherwise
        they are exchanged first with a recorded all-gather of one ``int64`` per rank.

        Returns
        -------
        (numpy or cupy array, numpy.ndarray)
            The concatenation in rank order and the counts.
        """
        self._check(buf, "allgatherv")
        if buf.ndim != 1:
            raise ValueError(f"allgatherv takes a 1-D array, got shape {buf.shape}; ravel it")
        if counts is None:
            counts = self.allgather(np.array([buf.size], dtype=np.int64), phase=phase)[:, 0]
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (self.size,) or counts[self.rank] != buf.size:
            raise ValueError(f"allgatherv counts {counts.tolist()} do not match this rank's "
                             f"buffer of {buf.size} elements")
        xp = array_module(buf)
        out = xp.empty(int(counts.sum()), dtype=buf.dtype)
        if self.exact:
            start = int(counts[:self.rank].sum())
            out[start:start + buf.size] = buf
            self._exact_allgatherv(out, counts, buf.nbytes, phase)
            return out, counts
        if self.size > 1:
            displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
            sview = self.backend.mpi_view(buf)
            rview = self.backend.mpi_view(out, fill=False)
            self.mpi.Allgatherv(sview, [rview, (counts, displs)])
            self.backend.mpi_done(out, rview)
        else:
            out[:] = buf
        self._record_allgather(phase, (counts * buf.itemsize).tolist(), buf.nbytes)
        return out, counts

    def alltoallv(self, sendbuf, sendcounts: Sequence[int], recvcounts=None, *, phase: str):
        """Personalized all-to-all of a 1-D buffer cut into ``sendcounts`` per destination.

        ``recvcounts`` may be passed from a plan; otherwise they are exchanged first with a
        recorded all-to-all of one ``int64`` per pair.
        """
        self._check(sendbuf, "alltoallv")
        p = self.size
        sendcounts = np.asarray(sendcounts, dtype=np.int64)
        if sendbuf.ndim != 1 or sendcounts.shape != (p,) or sendcounts.sum() != sendbuf.size:
            raise ValueError(f"alltoallv: sendcounts {sendcounts.tolist()} must have one entry "
                             f"per rank ({p}) summing to the 1-D buffer length {sendbuf.size}")
        if recvcounts is None:
            if self.exact:
                recvcounts, _ = self.alltoallv(sendcounts.copy(), np.ones(p, dtype=np.int64),
                                               np.ones(p, dtype=np.int64), phase=phase)
            else:
                rc = np.empty(p, dtype=np.int64)
                self.mpi.Alltoall(sendcounts, rc)
                self._record_pairwise(phase, np.full(p, 8, dtype=np.int64), p * 8)
                recvcounts = rc
        recvcounts = np.asarray(recvcounts, dtype=np.int64)
        if recvcounts.shape != (p,) or (recvcounts < 0).any():
            raise ValueError(f"alltoallv: recvcounts {recvcounts.tolist()} must have one "
                             f"non-negative entry per rank ({p})")
        xp = array_module(sendbuf)
        out = xp.empty(int(recvcounts.sum()), dtype=sendbuf.dtype)
        sd = np.concatenate(([0], np.cumsum(sendcounts)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recvcounts)[:-1]))
        sview = self.backend.mpi_view(sendbuf)
        rview = self.backend.mpi_view(out, fill=False)
        if self.mode == "exact":
            sent = coll.pairwise_alltoallv(self._cmpi() if p > 1 else self.mpi, sview, sendcounts,
                                           sd, rview, recvcounts, rd, array_module(sview))
            self.backend.mpi_done(out, rview)
            self._record_sent(phase, sendbuf.nbytes, sent,
                              sum(self.cost.p2p_time(nb, self.link_to(d)) for d, nb in sent))
            return out, recvcounts
        self.mpi.Alltoallv([sview, (sendcounts, sd)], [rview, (recvcounts, rd)])
        self.backend.mpi_done(out, rview)
        self._record_pairwise(phase, sendcounts * sendbuf.itemsize, sendbuf.nbytes)
        return out, recvcounts

    def _record_pairwise(self, phase: str, bytes_to: np.ndarray, payload: int) -> None:
        intra = inter = msgs = 0
        t = 0.0
        links = set()
        for j, nb in enumerate(bytes_to.tolist()):
            if j == self.rank or nb == 0:
                continue
            link = self.link_to(j)
            links.add(link)
            if link == INTRA:
                intra += nb
            else:
                inter += nb
            msgs += 1
            t += self.cost.p2p_time(nb, link)
        self.ledger.record(phase, payload=payload, intra=intra, inter=inter, messages=msgs,
                           modeled_s=t, links=links)

    def barrier(self, *, phase: str) -> None:
        """Barrier (dissemination algorithm in the ledger: messages, no bytes)."""
        if self.exact:
            sent = coll.dissemination_barrier(self._cmpi())
            self.ledger.record(phase, payload=0, messages=len(sent),
                               modeled_s=self.cost.barrier_time(self.size, self.slowest))
            return
        self.mpi.Barrier()
        d = binomial_depth(self.size)
        self.ledger.record(phase, payload=0, messages=d,
                           modeled_s=self.cost.barrier_time(self.size, self.slowest))

    # -- point to point --------------------------------------------------------------------------
    def isend(self, buf, dest: int, tag: int = 0, *, phase: str) -> Request:
        """Non-blocking send; the bytes are recorded here, on the sender."""
        self._check(buf, "isend")
        if array_module(buf) is np or self.backend.cuda_aware:
            self.backend.synchronize()
            view = buf
        else:
            view = buf.get()  # a private host copy: stays valid until the request completes
        req = self.mpi.Isend(view, dest=dest, tag=tag)
        if dest == self.rank:  # a self-message is a local copy: no link, no wire bytes
            self.ledger.record(phase, payload=buf.nbytes)
            return Request(req, buf=view)
        link = self.link_to(dest)
        intra, inter = self._by_link(buf.nbytes, link)
        self.ledger.record(phase, payload=buf.nbytes, intra=intra, inter=inter, messages=1,
                           modeled_s=self.cost.p2p_time(buf.nbytes, link), links=(link,))
        return Request(req, buf=view)

    def irecv(self, buf, source: int, tag: int = 0, *, phase: str) -> Request:
        """Non-blocking receive into ``buf`` (nothing recorded: the sender records)."""
        self._check(buf, "irecv")
        if array_module(buf) is np or self.backend.cuda_aware:
            req = self.mpi.Irecv(buf, source=source, tag=tag)
            return Request(req)
        host = np.empty(buf.shape, dtype=buf.dtype)
        req = self.mpi.Irecv(host, source=source, tag=tag)
        return Request(req, buf=buf, view=host, backend=self.backend)

    @staticmethod
    def waitall(requests: Sequence[Request]) -> None:
        """Complete every request (and copy staged receives back to the device)."""
        if not requests:
            return
        MPI.Request.Waitall([r.mpi for r in requests])
        for r in requests:
            r._finish()

    def bucketed_allreduce(self, tensors, bucket_bytes: int = 32 << 20, op: str = "sum", *,
                           phase: str):
        """See :func:`bucketed_allreduce`."""
        return bucketed_allreduce(tensors, self, bucket_bytes, op, phase=phase)


def bucket_groups(nbytes, bucket_bytes: int, keys=None) -> list[list[int]]:
    """Greedy, order-preserving grouping of items of ``nbytes[i]`` bytes into buckets of at most
    ``bucket_bytes`` (an item larger than a bucket gets one of its own; a change of ``keys[i]``,
    e.g. the dtype, starts a new bucket).  Returns lists of item indices."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, nb in enumerate(nbytes):
        if cur and (cur_bytes + nb > bucket_bytes or (keys is not None and keys[i] != keys[cur[0]])):
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nb
    if cur:
        groups.append(cur)
    return groups


class BucketPlan:
    """Assignment of tensors to contiguous buckets (:func:`bucket_groups`) with the flat bucket
    buffers allocated once."""

    def __init__(self, shapes_dtypes, bucket_bytes: int, xp) -> None:
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape, _ in shapes_dtypes]
        dtypes = [np.dtype(d) for _, d in shapes_dtypes]
        groups = bucket_groups([s * d.itemsize for s, d in zip(sizes, dtypes)], bucket_bytes,
                               dtypes)
        self.buckets: list[list[tuple[int, int, int]]] = []  # (tensor idx, offset, size)
        self.buffers = []
        for g in groups:
            offs = np.concatenate(([0], np.cumsum([sizes[i] for i in g])[:-1]))
            self.buckets.append([(i, int(o), sizes[i]) for i, o in zip(g, offs)])
            self.buffers.append(xp.empty(sum(sizes[i] for i in g), dtype=dtypes[g[0]]))


def bucketed_allreduce(tensors, comm: Comm, bucket_bytes: int = 32 << 20, op: str = "sum", *,
                       phase: str):
    """All-reduce many arrays in place with one collective per contiguous bucket.

    Tensors are coalesced, in order, into buckets of at most ``bucket_bytes`` (PyTorch DDP /
    PruneX §4.4 use ~32 MiB); each bucket is all-reduced once and scattered back.  The bucket
    layout and buffers are planned on the first call for a given list of shapes/dtypes and reused
    on every later call with the same signature.

    Parameters
    ----------
    tensors : sequence of arrays
        Contiguous arrays, reduced in place.
    comm : Comm
    bucket_bytes : int
    op : str
        As for :meth:`Comm.allreduce`.
    phase : str
        Ledger label.

    Returns
    -------
    list
        ``tensors`` (the same objects).
    """
    tensors = list(tensors)
    if not tensors:
        return tensors
    for t in tensors:
        Comm._check(t, "bucketed_allreduce")
    xp = array_module(tensors[0])
    key = (tuple((t.shape, t.dtype.str) for t in tensors), int(bucket_bytes), xp.__name__)
    plan = comm._bucket_plans.get(key)
    if plan is None:
        plan = BucketPlan([(t.shape, t.dtype.str) for t in tensors], bucket_bytes, xp)
        comm._bucket_plans[key] = plan
    for bucket, flat in zip(plan.buckets, plan.buffers):
        for i, off, size in bucket:
            flat[off:off + size] = tensors[i].reshape(-1)
        comm.allreduce(flat, op, phase=phase)
        for i, off, size in bucket:
            tensors[i].reshape(-1)[...] = flat[off:off + size]
    return tensors
