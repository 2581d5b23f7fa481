"""Ledger-recording wrappers around the mpi4py calls spardist needs.

No module outside ``substrate`` calls an mpi4py communication method; they call a :class:`Comm`
method with a ``phase`` label, which performs the communication and records what this rank sent
into the run's :class:`~substrate.ledger.Ledger` under the named algorithm of
:mod:`substrate.costmodel`.  In the default ``exact`` mode the collectives are
:mod:`substrate.collectives`' own point-to-point implementations of exactly these algorithms and
the ledger records the bytes they handed to MPI; in ``native`` mode the MPI library's collective
runs (pinned where spardist knows how) and the ledger books the messages of the algorithm's
schedule (:mod:`substrate.schedule`: ring all-reduce and all-gather(v), binomial broadcast,
pairwise all-to-all, dissemination barrier; a send books its bytes on the sender).

The link class of every byte follows from the two endpoints' nodes (``Topology.node_of``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from . import collectives as coll
from . import schedule
from .backend import Backend, Staged, array_module, get_backend
from .buckets import BucketPlan, bucket_groups
from .calls import Call, Placement
from .costmodel import INTER, INTRA
from .recorder import Handle, Recorder
from .stream import CommStream

__all__ = [
    "BucketPlan",
    "Comm",
    "Handle",
    "Request",
    "Waiting",
    "bucket_groups",
    "bucketed_allreduce",
]

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "bor": MPI.BOR}
#: distinct collective records a communicator keeps for reuse (:meth:`Comm._call`)
MAX_CALLS = 1024
#: buffers a communicator keeps bound for blocking exact all-reduces (:class:`_Bound`) ...
MAX_BOUND = 64
#: ... each of at most this many bytes (larger calls gain nothing from it)
BIND_MAX_BYTES = 64 << 10
#: buffers reduced once a communicator remembers (weakly), to bind them when they come back
MAX_SEEN = 256


@functools.lru_cache(maxsize=4096)
def _scheduled(call: Call, member: int) -> list:
    """``(dest, bytes)`` of the messages member ``member`` sends in ``call``'s algorithm
    (:func:`substrate.schedule.of_call`): what a native collective is booked as (the library
    runs the algorithm, pinned; the ledger books its messages)."""
    return schedule.of_call(call).sent(member)


class Request(Handle):
    """A pending point-to-point operation: a :class:`~substrate.recorder.Handle` (the send's
    record; the program entry of the send or the receive) that :meth:`Comm.waitall`
    completes.

    ``staged`` is the buffer's :class:`~substrate.backend.Staged` hand-off (device arrays): its
    pinned block stays leased until the request completes, then a receive is copied back to
    the device."""

    __slots__ = ("buf", "mpi", "staged")

    def __init__(self, mpi: MPI.Request, call: Call | None = None, event=None, buf=None,
                 staged: Staged | None = None) -> None:
        super().__init__(call, event, buf)
        self.mpi, self.buf, self.staged = mpi, buf, staged
        self._wait = self._complete

    def _complete(self) -> None:
        self.mpi.Wait()
        self._finish()

    def _finish(self) -> None:
        if self.staged is not None:
            self.staged.push()
            self.staged = None


class _Bound:
    """A blocking exact all-reduce of one NumPy buffer with one phase and op, worked out once
    (:meth:`Comm.allreduce`'s common case: a run reduces the same small buffers step after
    step): its record, its ring steps bound to the buffer's chunks
    (:class:`substrate.collectives.BoundRing`) and its booking, made from the messages those
    steps send by the rule every other call is booked by (:meth:`Comm._split`)."""

    __slots__ = ("booking", "buf", "call", "divide", "dtype", "ring")

    def __init__(self, buf: np.ndarray, call: Call, ring: coll.BoundRing, booking,
                 divide: int) -> None:
        self.buf, self.dtype, self.call, self.ring = buf, buf.dtype, call, ring
        self.booking, self.divide = booking, divide


class Comm:
    """A communicator that records its traffic.

    Every collective and point-to-point method builds the call's record
    (:class:`~substrate.calls.Call`), executes it, books what this rank sent in the ledger,
    records the call in the rank's program after ``after=`` (default: blocking, after everything
    before) and returns a :class:`~substrate.recorder.Handle` (``.result``, ``.event``).

    Parameters
    ----------
    mpi : mpi4py.MPI.Intracomm
        The communicator (owned: created by the topology, never ``COMM_WORLD`` itself).
    placement : Placement
        Node of every world rank.
    world_ranks : numpy.ndarray
        World rank of each member, indexed by rank in ``mpi``.
    recorder : Recorder
        The run's books (ledger, cost model, program, call log), shared by every communicator.
    backend : Backend, optional
        Array backend used to hand buffers to MPI (CPU by default).
    collectives : {"exact", "native"}, optional
        How collectives run (:mod:`substrate.collectives`); default ``SPARDIST_COLLECTIVES`` or
        ``exact``.
    stream : CommStream, optional
        The process's communication stream (shared by every communicator of a topology).
    """

    def __init__(self, mpi: MPI.Intracomm, placement: Placement, world_ranks: np.ndarray,
                 recorder: Recorder, backend: Backend | None = None,
                 collectives: str | None = None, stream: CommStream | None = None) -> None:
        self.mpi = mpi
        self.stream = stream if stream is not None else CommStream()
        self.mode = coll.check_mode(collectives) if collectives else coll.default_mode()
        self._coll_mpi: MPI.Intracomm | None = None
        self.rank = mpi.Get_rank()
        self.size = mpi.Get_size()
        self.placement = placement
        self.node_of_world = placement.nodes_array
        self.world_ranks = np.asarray(world_ranks, dtype=np.int64)
        self.group = tuple(int(r) for r in self.world_ranks)
        self.world_rank = self.group[self.rank]
        self.recorder = recorder
        self.backend = backend or get_backend("cpu")
        self.member_nodes = self.node_of_world[self.world_ranks]
        #: link class from this rank to every member (fixed for the life of the communicator)
        self.links_to = tuple(INTRA if n == self.member_nodes[self.rank] else INTER
                              for n in self.member_nodes)
        p = self.size
        # ring link i -> i+1 classes, fixed for the life of the communicator
        nxt = np.roll(self.member_nodes, -1)
        self.ring_links = np.where(self.member_nodes == nxt, 0, 1)  # 0 intra, 1 inter
        self.out_link = INTER if (p > 1 and self.ring_links[self.rank]) else INTRA
        self.link = "none" if p == 1 else (
            INTRA if not self.ring_links.any() else
            INTER if self.ring_links.all() else "mixed")
        self._bucket_plans: dict = {}
        self._calls: dict = {}
        self._bound: dict = {}
        self._seen: dict = {}

    @property
    def ledger(self):
        return self.recorder.ledger

    # -- helpers ---------------------------------------------------------------------------------
    def link_to(self, other: int) -> str:
        """Link class between this rank and member ``other``."""
        return self.links_to[other]

    @staticmethod
    def _check(buf, what: str) -> None:
        if not getattr(buf, "flags", None) or not buf.flags.c_contiguous:
            raise ValueError(f"{what} needs a C-contiguous array (got {type(buf).__name__}); "
                             "pass np.ascontiguousarray(buf)")

    def sub(self, color: int, key: int | None = None) -> Comm | None:
        """Split into sub-communicators (collective); ``color < 0`` gets ``None``."""
        c = self.mpi.Split(MPI.UNDEFINED if color < 0 else color,
                           self.rank if key is None else key)
        if c == MPI.COMM_NULL:
            return None
        members = np.array(c.allgather(self.world_rank), dtype=np.int64)
        return Comm(c, self.placement, members, self.recorder, self.backend, self.mode,
                    self.stream)

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

    def _split(self, sent) -> dict:
        """``intra``, ``inter``, ``messages`` and ``links`` of ``(dest, nbytes)`` messages:
        how they are booked (a zero-byte message counts, on no link)."""
        intra = inter = 0
        links = set()
        links_to = self.links_to
        for dest, nb in sent:
            link = links_to[dest]
            if link == INTRA:
                intra += nb
            else:
                inter += nb
            if nb:
                links.add(link)
        return {"intra": intra, "inter": inter, "messages": len(sent), "links": links}

    def _book(self, call: Call, *, payload: int, sent=()) -> None:
        """Book ``call``: the ``(dest, nbytes)`` messages this rank handed to MPI (an exact
        collective's), or that the pinned algorithm sends (a native one's)."""
        self.recorder.book(call, payload=payload, **self._split(sent))

    def _done(self, call: Call, after, result, **book) -> Handle:
        """Book a call that has run, declare it, return its handle (a blocking call)."""
        self._book(call, **book)
        return self.recorder.handle(call, self.recorder.declare(call, after), result)

    def _issue(self, call: Call, after, result, run, finish, wait: bool) -> Handle:
        """Run a collective: ``run(poll)`` moves the data (returns what :meth:`_book` needs),
        ``finish(out)`` books it and completes the result.

        ``wait=True`` (or no stream): after the stream has drained, here and now; the handle is
        complete.  ``wait=False``: on the communication stream (:mod:`substrate.stream`), in
        issue order, while this thread goes on; the call is recorded now (after ``after``),
        the booking and completion happen in :meth:`Handle.wait`.  Without overlap
        (``--overlap off``) every call blocks."""
        rec = self.recorder
        if wait or not rec.overlap or not self.stream.enabled:
            self.stream.drain()
            finish(run(None))
            return rec.handle(call, rec.declare(call, after), result)
        event = rec.declare(call, after, wait=False)
        fut = self.stream.submit(lambda: run(self.stream.poll))
        return rec.handle(call, event, result, wait=lambda: finish(fut.result()))

    def _call(self, phase: str, algorithm: str, **kw) -> Call:
        """The record of a call on this communicator.  Records are immutable and a run makes
        the same few collectives (phase, sizes) step after step, so each distinct one is built
        and validated once and reused (up to :data:`MAX_CALLS` of them); direct messages and
        all-to-alls, whose sizes change from call to call, get a new record each time."""
        if algorithm in ("p2p", "alltoallv"):
            return Call(phase, algorithm, self.group, **kw)
        key = (phase, algorithm, *kw.items())
        call = self._calls.get(key)
        if call is None:
            call = Call(phase, algorithm, self.group, **kw)
            if len(self._calls) >= MAX_CALLS:
                self._calls.clear()
            self._calls[key] = call
        return call

    # -- collectives -----------------------------------------------------------------------------
    def allreduce(self, buf, op: str = "sum", *, phase: str, after=None,
                  wait: bool = True) -> Handle:
        """In-place all-reduce of ``buf`` (ring algorithm in the ledger); ``.result`` is ``buf``.

        ``op`` is ``"sum"``, ``"avg"`` (sum divided by the size), ``"max"``, ``"min"`` or
        ``"bor"`` (bitwise OR; unsigned-integer arrays, e.g. ``numpy.packbits`` masks).
        ``wait=False`` issues it to the communication stream (:meth:`_issue`): leave ``buf``
        alone until :meth:`Handle.wait` returns.
        """
        key = (id(buf), phase, op)
        bound = self._bound.get(key)
        if bound is None or bound.buf is not buf or buf.dtype is not bound.dtype:
            bound = self._bind(key, buf, op, phase)
        if bound is not None and (wait or not self.recorder.overlap
                                  or not self.stream.enabled):
            # the common case (blocking, exact, a small NumPy buffer): what the general path
            # below does, every step worked out once for this buffer
            self.stream.drain()
            bound.ring.run()
            if bound.divide:
                buf[...] /= bound.divide
            return self.recorder.complete(bound.booking, after, buf)
        if op not in _OPS:
            raise ValueError(f"unknown all-reduce op {op!r}; use one of {sorted(_OPS)}")
        self._check(buf, "allreduce")
        if op == "bor" and buf.dtype.kind not in "ub":
            raise ValueError(f"bitwise-OR all-reduce needs unsigned integer or bool data, got "
                             f"{buf.dtype}; pack masks with numpy.packbits first")
        if op == "avg" and buf.dtype.kind != "f":
            raise ValueError(f"'avg' all-reduce needs floating-point data, got {buf.dtype}")
        call = self._call(phase, "allreduce", nbytes=buf.nbytes, itemsize=buf.itemsize, op=op)
        p = self.size
        staged = self.backend.stage(buf) if p > 1 else None
        side = self.backend.side
        if self.exact:
            cmpi = self._cmpi()             # created here: a Dup is collective, in call order

            def run(poll):
                with side():
                    sent = self._exact_allreduce(cmpi, staged, op, poll)
                    staged.land()       # a later call on this buffer reads the result
                    return sent
        else:
            def run(poll):
                if staged is not None:
                    with side():
                        self.mpi.Allreduce(MPI.IN_PLACE, staged.pull(), op=_OPS[op])
                        staged.land()

        def finish(sent):
            if staged is not None:
                staged.push()
            self._book(call, payload=buf.nbytes,
                       sent=sent if self.exact else _scheduled(call, self.rank))
            if op == "avg" and p > 1:
                buf[...] /= p

        return self._issue(call, after, buf, run, finish, wait)

    def _bind(self, key: tuple, buf, op: str, phase: str) -> _Bound | None:
        """The :class:`_Bound` all-reduce of ``buf`` under ``key`` (kept for the next call), or
        ``None`` where the general path runs: native mode or one member, anything but a valid
        contiguous NumPy array, more than :data:`BIND_MAX_BYTES`, or a buffer not reduced
        before with this phase and op (one reduced once, a new array or view every call, is
        not worth binding)."""
        if not (self.exact and type(buf) is np.ndarray and buf.flags.c_contiguous
                and buf.nbytes <= BIND_MAX_BYTES and op in _OPS):
            return None
        kind = buf.dtype.kind
        if (op == "bor" and kind not in "ub") or (op == "avg" and kind != "f") \
                or kind not in "biuf":
            return None                     # the general path says why (or runs it)
        seen = self._seen.pop(key, None)
        if seen is None or seen() is not buf:
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen[key] = weakref.ref(buf)
            return None
        call = self._call(phase, "allreduce", nbytes=buf.nbytes, itemsize=buf.itemsize, op=op)
        cmpi = self._cmpi()                 # created here: a Dup is collective, in call order
        ring = coll.ring_plan(buf.size, self.size, self.rank).bind(cmpi, buf, op)
        booking = self.recorder.booking(call, payload=buf.nbytes, **self._split(ring.sent))
        bound = _Bound(buf, call, ring, booking, self.size if op == "avg" else 0)
        old = self._bound.pop(key, None)
        if old is not None:
            old.ring.free()
        if len(self._bound) >= MAX_BOUND:
            self._unbind()
        self._bound[key] = bound
        return bound

    def _unbind(self) -> None:
        """Forget every bound buffer (and free its requests)."""
        bound, self._bound = self._bound, {}
        for b in bound.values():
            b.ring.free()

    def _exact_allreduce(self, cmpi, staged: Staged, op: str, poll) -> list:
        """Ring all-reduce of a staged buffer: NumPy in place; device memory with a CUDA-aware
        MPI (CuPy reductions on the side stream); else through the pinned staging block,
        reducing on the device when the chunks are large enough
        (:meth:`Backend.reduce_on_device`), on the host otherwise."""
        if not staged.device:
            return coll.ring_allreduce(cmpi, staged.arr.reshape(-1), op, np, poll)
        be = self.backend
        if staged.host is None:
            return coll.ring_allreduce(cmpi, staged.pull().reshape(-1), op, be.xp, poll)
        i = cmpi.Get_rank()
        ring = schedule.allreduce(staged.arr.size, cmpi.Get_size())
        width = ring.width
        if not be.reduce_on_device(width * staged.arr.itemsize):
            return coll.ring_allreduce(cmpi, staged.pull().reshape(-1), op, np, poll)
        host = staged.pull(ring.offs[i], ring.offs[i + 1]).reshape(-1)
        dev = staged.arr.reshape(-1)
        xp = be.xp
        ufunc = getattr(xp, coll.UFUNCS[op])
        lease = be.pool.acquire(width * dev.itemsize)
        recv = lease.array(dev.dtype, (width,))
        tmp = xp.empty(width, dtype=dev.dtype)

        def reduce_chunk(lo: int, hi: int, got: np.ndarray) -> None:
            t = tmp[:hi - lo]
            t.set(got, stream=be.side_stream)
            ufunc(dev[lo:hi], t, out=dev[lo:hi])
            dev[lo:hi].get(out=host[lo:hi], stream=be.side_stream, blocking=False)
            be.sync_side()      # the sum is on the host for the next send; got is free again

        try:
            return coll.ring_allreduce_staged(cmpi, host, recv, reduce_chunk, poll)
        finally:
            be.pool.release(lease)

    def bcast(self, buf, root: int = 0, *, phase: str, after=None, wait: bool = True) -> Handle:
        """In-place broadcast from ``root`` (binomial tree in the ledger); ``.result`` is
        ``buf``; ``wait=False`` as for :meth:`allreduce`."""
        self._check(buf, "bcast")
        if not 0 <= root < self.size:
            raise ValueError(f"bcast root {root} outside communicator of size {self.size}")
        n = buf.nbytes
        call = self._call(phase, "bcast", nbytes=n, itemsize=buf.itemsize, root=root)
        root_me = self.rank == root
        staged = self.backend.stage(buf, send=root_me, recv=not root_me) \
            if self.size > 1 else None
        side = self.backend.side
        if self.exact:
            cmpi = self._cmpi()

            def run(poll):
                with side():
                    sent = coll.binomial_bcast(cmpi, staged.pull(), root, poll)
                    staged.land()
                    return sent
        else:
            def run(poll):
                if staged is not None:
                    with side():
                        self.mpi.Bcast(staged.pull(), root=root)
                        staged.land()

        def finish(sent):
            if staged is not None:
                staged.push()
            self._book(call, payload=n, sent=sent if self.exact else _scheduled(call, self.rank))

        return self._issue(call, after, buf, run, finish, wait)

    def allgather(self, buf, *, phase: str, after=None, wait: bool = True) -> Handle:
        """Gather equal-size ``buf`` from every rank: ``.result`` has shape
        ``(size, *buf.shape)``; ``wait=False`` as for :meth:`allreduce`."""
        self._check(buf, "allgather")
        xp = array_module(buf)
        p = self.size
        out = xp.empty((p, *buf.shape), dtype=buf.dtype)
        call = self._call(phase, "allgather", blocks=(buf.nbytes,) * p, itemsize=buf.itemsize)
        side = self.backend.side
        if self.exact:
            out[self.rank] = buf
            flat = out.reshape(-1)
            counts = np.full(p, buf.size, dtype=np.int64)
            displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
            staged = self.backend.stage(flat)
            lo = int(displs[self.rank])
            cmpi = self._cmpi()

            def run(poll):
                with side():
                    sent = coll.ring_allgatherv(cmpi, staged.pull(lo, lo + buf.size), counts,
                                                poll)
                    staged.land()
                    return sent

            def finish(sent):
                staged.push()
                self._book(call, payload=buf.nbytes, sent=sent)
        else:
            sstage = self.backend.stage(buf, recv=False) if p > 1 else None
            rstage = self.backend.stage(out, send=False) if p > 1 else None

            def run(poll):
                if p > 1:
                    with side():
                        self.mpi.Allgather(sstage.pull(), rstage.pull())
                        sstage.land()
                        rstage.land()
                else:
                    out[0] = buf

            def finish(_):
                if rstage is not None:
                    sstage.push()
                    rstage.push()
                self._book(call, payload=buf.nbytes, sent=_scheduled(call, self.rank))

        return self._issue(call, after, out, run, finish, wait)

    def _exact_allgatherv(self, flat, counts: np.ndarray) -> list:
        """Ring all-gather(v) in place on ``flat`` (own block already at its offset)."""
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        staged = self.backend.stage(flat)
        lo = int(displs[self.rank])
        with self.backend.side():
            sent = coll.ring_allgatherv(self._cmpi(), staged.pull(lo, lo + int(counts[self.rank])),
                                        counts)
        staged.push()
        return sent

    def _gathered(self, call: Call, after, result, payload: int) -> Handle:
        """Book a native all-gather(v) with the ring's messages."""
        return self._done(call, after, result, payload=payload,
                          sent=_scheduled(call, self.rank))

    def allgatherv(self, buf, counts: Sequence[int] | None = None, *, phase: str,
                   after=None) -> Handle:
        """Gather 1-D ``buf`` of varying length from every rank.

        ``counts`` (element counts per rank) may be passed when known from a plan; otherwise
        they are exchanged first with a recorded all-gather of one ``int64`` per rank.
        ``.result`` is ``(concatenation in rank order, counts)``.
        """
        self._check(buf, "allgatherv")
        self.stream.drain()
        if buf.ndim != 1:
            raise ValueError(f"allgatherv takes a 1-D array, got shape {buf.shape}; ravel it")
        if counts is None:
            counts = self.allgather(np.array([buf.size], dtype=np.int64), phase=phase,
                                    after=after).result[:, 0]
            after = None
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (self.size,) or counts[self.rank] != buf.size:
            raise ValueError(f"allgatherv counts {counts.tolist()} do not match this rank's "
                             f"buffer of {buf.size} elements")
        xp = array_module(buf)
        out = xp.empty(int(counts.sum()), dtype=buf.dtype)
        call = self._call(phase, "allgather", blocks=tuple(int(c) * buf.itemsize
                                                          for c in counts),
                          itemsize=buf.itemsize)
        if self.exact:
            start = int(counts[:self.rank].sum())
            out[start:start + buf.size] = buf
            sent = self._exact_allgatherv(out, counts)
            return self._done(call, after, (out, counts), payload=buf.nbytes, sent=sent)
        if self.size > 1:
            displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
            sstage = self.backend.stage(buf, recv=False)
            rstage = self.backend.stage(out, send=False)
            with self.backend.side():
                self.mpi.Allgatherv(sstage.pull(), [rstage.pull(), (counts, displs)])
            sstage.push()
            rstage.push()
        else:
            out[:] = buf
        return self._gathered(call, after, (out, counts), buf.nbytes)

    def alltoallv(self, sendbuf, sendcounts: Sequence[int], recvcounts=None, *, phase: str,
                  after=None) -> Handle:
        """Personalized all-to-all of a 1-D buffer cut into ``sendcounts`` per destination;
        ``.result`` is ``(received, recvcounts)``.

        ``recvcounts`` may be passed from a plan; otherwise they are exchanged first with a
        recorded all-to-all of one ``int64`` per pair.
        """
        self._check(sendbuf, "alltoallv")
        self.stream.drain()
        p = self.size
        sendcounts = np.asarray(sendcounts, dtype=np.int64)
        if sendbuf.ndim != 1 or sendcounts.shape != (p,) or sendcounts.sum() != sendbuf.size:
            raise ValueError(f"alltoallv: sendcounts {sendcounts.tolist()} must have one entry "
                             f"per rank ({p}) summing to the 1-D buffer length {sendbuf.size}")
        if recvcounts is None:
            recvcounts = self.alltoallv(sendcounts.copy(), np.ones(p, dtype=np.int64),
                                        np.ones(p, dtype=np.int64), phase=phase,
                                        after=after).result[0]
            after = None
        recvcounts = np.asarray(recvcounts, dtype=np.int64)
        if recvcounts.shape != (p,) or (recvcounts < 0).any():
            raise ValueError(f"alltoallv: recvcounts {recvcounts.tolist()} must have one "
                             f"non-negative entry per rank ({p})")
        # a member knows its own row of the byte matrix only: its record carries that row
        # (the others zero), which is all its booking and its program entry need
        mine = sendcounts * sendbuf.itemsize
        matrix = np.zeros((p, p), dtype=np.int64)
        matrix[self.rank] = mine
        call = self._call(phase, "alltoallv", blocks=tuple(matrix.reshape(-1).tolist()),
                          itemsize=sendbuf.itemsize)
        xp = array_module(sendbuf)
        out = xp.empty(int(recvcounts.sum()), dtype=sendbuf.dtype)
        sd = np.concatenate(([0], np.cumsum(sendcounts)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recvcounts)[:-1]))
        # distinct staging for the send and the receive buffer, whatever their sizes
        sstage = self.backend.stage(sendbuf, recv=False)
        rstage = self.backend.stage(out, send=False)
        with self.backend.side():
            sview, rview = sstage.pull(), rstage.pull()
            if self.mode == "exact":
                sent = coll.pairwise_alltoallv(self._cmpi() if p > 1 else self.mpi, sview,
                                               sendcounts, sd, rview, recvcounts, rd,
                                               array_module(sview))
            else:
                self.mpi.Alltoallv([sview, (sendcounts, sd)], [rview, (recvcounts, rd)])
                sent = [(j, int(nb)) for j, nb in enumerate(mine.tolist())
                        if j != self.rank and nb]
        sstage.push()
        rstage.push()
        return self._done(call, after, (out, recvcounts), payload=sendbuf.nbytes, sent=sent)

    def barrier(self, *, phase: str, after=None) -> Handle:
        """Barrier (dissemination algorithm in the ledger: messages, no bytes)."""
        call = self._call(phase, "barrier")
        self.stream.drain()
        if self.exact:
            sent = coll.dissemination_barrier(self._cmpi())
            return self._done(call, after, None, payload=0, sent=sent)
        self.mpi.Barrier()
        return self._done(call, after, None, payload=0, sent=_scheduled(call, self.rank))

    # -- point to point --------------------------------------------------------------------------
    def isend(self, buf, dest: int, tag: int = 0, *, phase: str, after=None) -> Request:
        """Non-blocking send; the bytes are recorded here, on the sender."""
        self._check(buf, "isend")
        self.stream.drain()
        staged = None
        view = buf
        if array_module(buf) is not np:
            # a pinned block of the pool (or the device memory itself, CUDA-aware), the data
            # there when Isend is posted; held until the request completes
            staged = self.backend.stage(buf, recv=False)
            with self.backend.side():
                view = staged.pull()
        req = self.mpi.Isend(view, dest=dest, tag=tag)
        dst = self.group[dest]
        call = self._call(phase, "p2p", pairs=((self.world_rank, dst, buf.nbytes),))
        rec = self.recorder
        if dest == self.rank:  # a self-message is a local copy: no link, no wire bytes
            rec.book(call, payload=buf.nbytes)
            return Request(req, call, None, buf=buf, staged=staged)
        link = self.link_to(dest)
        intra, inter = (buf.nbytes, 0) if link == INTRA else (0, buf.nbytes)
        rec.book(call, payload=buf.nbytes, intra=intra, inter=inter, messages=1, links=(link,))
        return Request(req, call, rec.declare(call, after, wait=False, tag=tag), buf=buf,
                       staged=staged)

    def irecv(self, buf, source: int, tag: int = 0, *, phase: str) -> Request:
        """Non-blocking receive into ``buf`` (nothing recorded: the sender records)."""
        self._check(buf, "irecv")
        staged = None
        view = buf
        if array_module(buf) is not np:
            staged = self.backend.stage(buf, send=False)
            with self.backend.side():
                view = staged.pull()
        r = Request(self.mpi.Irecv(view, source=source, tag=tag), buf=buf, staged=staged)
        prog = self.recorder.program
        if prog is not None:
            r.event = prog.receive(self.group[source], buf.nbytes, tag, self.group)
        return r

    def waitall(self, requests: Sequence[Request]) -> None:
        """Complete every request (and copy staged receives back to the device)."""
        requests = [r for r in requests if not r.done]
        if not requests:
            return
        prog = self.recorder.program
        if prog is not None:
            prog.waitall([r.event for r in requests if r.event is not None])
        MPI.Request.Waitall([r.mpi for r in requests])
        for r in requests:
            r._wait = None
            r._finish()

    def bucketed_allreduce(self, tensors, bucket_bytes: int = 32 << 20, op: str = "sum", *,
                           phase: str, after=None) -> list:
        """See :func:`bucketed_allreduce`."""
        return bucketed_allreduce(tensors, self, bucket_bytes, op, phase=phase, after=after)


class Waiting:
    """A communicator this rank is not a member of, as the rank sees it: the node leaders'
    communicator seen from a follower (:attr:`substrate.topology.Topology.leaders`).

    Its collectives execute nothing, book nothing and leave the buffer alone; each records the
    leaders' call in this rank's program as a wait, so that what the rank does next waits for
    it (a broadcast from the leader after the leaders' all-reduce cannot start before it
    ends).
    """

    def __init__(self, group, recorder: Recorder) -> None:
        self.group = tuple(int(r) for r in group)
        self.size = len(self.group)
        self.recorder = recorder
        self.rank = None

    def _wait(self, call: Call, after, result) -> Handle:
        rec = self.recorder
        return rec.handle(call, rec.declare(call, after, member=False), result)

    def allreduce(self, buf, op: str = "sum", *, phase: str, after=None,
                  wait: bool = True) -> Handle:
        return self._wait(Call(phase, "allreduce", self.group, nbytes=buf.nbytes,
                               itemsize=buf.itemsize, op=op), after, buf)

    def bcast(self, buf, root: int = 0, *, phase: str, after=None, wait: bool = True) -> Handle:
        return self._wait(Call(phase, "bcast", self.group, nbytes=buf.nbytes,
                               itemsize=buf.itemsize, root=root), after, buf)

    def allgather(self, buf, *, phase: str, after=None, wait: bool = True) -> Handle:
        return self._wait(Call(phase, "allgather", self.group,
                               blocks=(buf.nbytes,) * self.size, itemsize=buf.itemsize),
                          after, None)


def bucketed_allreduce(tensors, comm: Comm, bucket_bytes: int = 32 << 20, op: str = "sum", *,
                       phase: str, after=None):
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
        comm.allreduce(flat, op, phase=phase, after=after)
        for i, off, size in bucket:
            tensors[i].reshape(-1)[...] = flat[off:off + size]
    return tensors
