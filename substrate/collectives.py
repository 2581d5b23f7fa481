"""The collectives the ledger books, and how the wire is made to carry exactly them.

The ledger (:mod:`substrate.ledger`) books every collective under a named algorithm
(:mod:`substrate.costmodel`).  An MPI library is free to run other algorithms: MPICH's defaults
are node-aware (reduce inside the node, all-reduce among leaders, broadcast back; recursive
halving), and on real hosts they move 0.33-0.86x of the bytes a ring books.  So spardist runs its
collectives in one of two **modes** (``--collectives``, env ``SPARDIST_COLLECTIVES``):

``exact`` (default)
    Every collective is implemented here on MPI point-to-point (``Sendrecv``/``Isend``/``Irecv``
    on a private duplicate of the communicator).  Each function returns the bytes it handed to
    MPI per destination, and the ledger records exactly those, so the booked bytes *are* the bytes
    sent, on any MPI library, whoever launched the job.  Large buffers move as whole ring chunks
    (one message per step); reductions are NumPy/CuPy ufuncs on the chunks, no per-element Python.

``native``
    The MPI library's own collective, with its algorithm pinned to the booked one where spardist
    knows how (:func:`pinning_env`: MPICH control variables, Open MPI ``coll_tuned`` dynamic
    rules).  The pinning must be in the environment before ``MPI_Init``; ``run_mpi.sh`` /
    ``python -m runner.launch`` sets it, a plain ``mpiexec`` does not.  Each run checks on every
    rank which library it runs and whether the pinning is in force, and says so in
    ``summary.json`` (:func:`describe`): an unknown library or a missing pin is reported as
    ``"booked, not verified"``, never as measured.

The algorithms (rank ``i`` of ``p``; ``c_j`` the ``numpy.array_split`` chunk sizes):

==================  ===========================================================  ================
collective          algorithm                                                    rank i sends
==================  ===========================================================  ================
allreduce           ring reduce-scatter then ring all-gather (to ``i+1``)        ``2n - c_{i+1} - c_{i+2}``
allgather(v)        ring (to ``i+1``), block ``i-s`` at step ``s``               ``N - b_{i+1}``
bcast               binomial tree from the root, farthest child first            ``n`` per child
alltoallv           scattered pairwise (``i+k``), empty blocks not sent          ``sendcounts[j]``
barrier             dissemination (``i + 2^k``), zero-byte messages              0 bytes
==================  ===========================================================  ================
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .costmodel import binomial_children, ring_chunk_counts
from .pinning import WIRE_VERIFIED, pinning_env

__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "UFUNCS",
    "RingSchedule",
    "binomial_bcast",
    "check_mode",
    "default_mode",
    "describe",
    "dissemination_barrier",
    "library",
    "pairwise_alltoallv",
    "ring_allgatherv",
    "ring_allreduce",
    "ring_allreduce_staged",
    "ring_schedule",
]

MODES = ("exact", "native")
DEFAULT_MODE = "exact"
_TAG = 7171  # every exact collective runs on a private Dup(): the tag never meets user messages

#: Reduction ufuncs by op name (``"avg"`` is a sum followed by a division in the caller).
UFUNCS = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum", "bor": "bitwise_or"}


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is a known collectives mode, else raise naming the fix."""
    if mode not in MODES:
        raise ValueError(f"unknown collectives mode {mode!r}: use --collectives exact (own "
                         f"point-to-point algorithms, the default) or --collectives native "
                         f"(the MPI library's, pinned where known); SPARDIST_COLLECTIVES sets "
                         f"the default")
    return mode


def default_mode() -> str:
    """``SPARDIST_COLLECTIVES`` if set, else ``exact``."""
    return check_mode(os.environ.get("SPARDIST_COLLECTIVES", DEFAULT_MODE) or DEFAULT_MODE)


# -- exact algorithms on point-to-point ------------------------------------------------------------
# Each takes an mpi4py communicator reserved for them (a Dup of the run's), host or (CUDA-aware)
# device buffers, and returns ``sent``: a list of ``(dest, nbytes)`` pairs, one per message this
# rank handed to MPI (zero-byte messages included, so message counts are exact too).

def _sync_for(xp):
    if xp is np:
        return lambda: None
    return lambda: xp.cuda.get_current_stream().synchronize()


def _sendrecv(mpi: MPI.Intracomm, sbuf, dest: int, rbuf, source: int, poll) -> None:
    """``Sendrecv``; with ``poll`` (seconds), a non-blocking pair tested every ``poll`` seconds
    instead (the communication thread: it sleeps between tests, so it does not take a core
    from the computation it overlaps, and MPI progresses at every test)."""
    if poll is None:
        mpi.Sendrecv(sbuf, dest, _TAG, rbuf, source, _TAG)
        return
    _wait([mpi.Irecv(rbuf, source, _TAG), mpi.Isend(sbuf, dest, _TAG)], poll)


def _wait(reqs, poll) -> None:
    """``Waitall``, or testing every ``poll`` seconds (see :func:`_sendrecv`)."""
    if poll is None:
        MPI.Request.Waitall(reqs)
        return
    while not MPI.Request.Testall(reqs):
        time.sleep(poll)


@dataclass(frozen=True)
class RingSchedule:
    """What one ring all-reduce of ``count`` elements does on ring rank ``i`` of ``p``, as
    plain ints, worked out once per ``(count, p, i, itemsize)`` (:func:`ring_schedule`).

    ``offs[j]:offs[j + 1]`` are the elements of chunk ``j`` (the
    :func:`~substrate.costmodel.ring_chunk_counts` cut); ``scatter`` lists the
    reduce-scatter steps ``(send chunk, receive chunk)``, ``gather`` the all-gather steps;
    ``width`` is the largest chunk (elements); ``sent`` the ``(peer, bytes)`` of every message
    sent, in order (the booking)."""

    p: int
    right: int
    left: int
    offs: tuple
    scatter: tuple
    gather: tuple
    width: int
    sent: tuple


@functools.lru_cache(maxsize=1024)
def ring_schedule(count: int, p: int, i: int, itemsize: int) -> RingSchedule:
    """The :class:`RingSchedule` of ring rank ``i`` of ``p`` for ``count`` elements of
    ``itemsize`` bytes (cached: a run all-reduces a few buffer sizes over and over)."""
    counts = ring_chunk_counts(count, p).tolist()
    offs = (0, *itertools.accumulate(counts))
    scatter = tuple(((i - s) % p, (i - s - 1) % p) for s in range(p - 1))
    gather = tuple(((i + 1 - s) % p, (i - s) % p) for s in range(p - 1))
    right = (i + 1) % p
    sent = tuple((right, counts[si] * itemsize) for si, _ in scatter + gather)
    return RingSchedule(p, right, (i - 1) % p, offs, scatter, gather, max(counts), sent)


def _ring(mpi: MPI.Intracomm, buf, recv, reduce, poll) -> list[tuple[int, int]]:
    """The ring all-reduce schedule on the 1-D ``buf`` (``p > 1``): reduce-scatter step ``s``
    sends chunk ``(i-s) % p`` to ``i+1``, receives chunk ``(i-s-1) % p`` from ``i-1`` into
    ``recv`` and hands it to ``reduce(lo, hi, received)`` (which must leave the sum in
    ``buf[lo:hi]``); all-gather step ``s`` sends chunk ``(i+1-s) % p``, receives ``(i-s) % p``
    in place.  Returns ``(peer, bytes)`` of every message sent."""
    r = ring_schedule(buf.size, mpi.Get_size(), mpi.Get_rank(), buf.itemsize)
    offs, right, left = r.offs, r.right, r.left
    chunk = [buf[offs[j]:offs[j + 1]] for j in range(r.p)]
    for si, ri in r.scatter:
        lo, hi = offs[ri], offs[ri + 1]
        got = recv[:hi - lo]
        _sendrecv(mpi, chunk[si], right, got, left, poll)
        reduce(lo, hi, got)
    for si, ri in r.gather:
        _sendrecv(mpi, chunk[si], right, chunk[ri], left, poll)
    return list(r.sent)


def ring_allreduce(mpi: MPI.Intracomm, buf, op: str, xp=np, poll=None) -> list[tuple[int, int]]:
    """In-place ring all-reduce (reduce-scatter + all-gather) of the 1-D contiguous ``buf``.

    Reduce-scatter step ``s`` (``0..p-2``): send chunk ``(i-s) % p`` to ``i+1``, receive chunk
    ``(i-s-1) % p`` from ``i-1`` and reduce it in; rank ``i`` then owns the reduced chunk
    ``(i+1) % p``.  All-gather step ``s``: send chunk ``(i+1-s) % p``, receive ``(i-s) % p``.
    Every rank ends with bitwise-identical data (each chunk is reduced once, then copied).
    """
    p = mpi.Get_size()
    if p == 1:
        return []
    ufunc = getattr(xp, UFUNCS[op])
    sync = _sync_for(xp)
    tmp = xp.empty(ring_schedule(buf.size, p, mpi.Get_rank(), buf.itemsize).width,
                   dtype=buf.dtype)

    def reduce(lo, hi, got):
        ufunc(buf[lo:hi], got, out=buf[lo:hi])
        sync()

    return _ring(mpi, buf, tmp, reduce, poll)


def ring_allreduce_staged(mpi: MPI.Intracomm, host, recv, reduce_chunk,
                          poll=None) -> list[tuple[int, int]]:
    """:func:`ring_allreduce`'s schedule, message for message, for a device buffer staged
    through host memory with the reduction on the device.

    ``host`` is the buffer's pinned host mirror (1-D; its own chunk ``i`` filled by the
    caller), ``recv`` a pinned block of at least the largest chunk.  At reduce-scatter step
    ``s`` the received chunk goes to ``reduce_chunk(lo, hi, recv[:hi-lo])``, which adds it
    into the device buffer and refreshes ``host[lo:hi]`` with the sum (what the next step
    sends); the all-gather runs on the host mirror, which the caller copies back."""
    if mpi.Get_size() == 1:
        return []
    return _ring(mpi, host, recv, reduce_chunk, poll)


def ring_allgatherv(mpi: MPI.Intracomm, out, counts, displs, poll=None) -> list[tuple[int, int]]:
    """Ring all-gather(v) into ``out`` (rank ``i``'s own block already in place at
    ``displs[i]``): step ``s`` sends block ``(i-s) % p`` to ``i+1`` and receives block
    ``(i-s-1) % p`` from ``i-1``."""
    p, i = mpi.Get_size(), mpi.Get_rank()
    if p == 1:
        return []
    right, left = (i + 1) % p, (i - 1) % p
    blocks = [out[displs[j]:displs[j] + counts[j]] for j in range(p)]
    sent = []
    for s in range(p - 1):
        si, ri = (i - s) % p, (i - s - 1) % p
        _sendrecv(mpi, blocks[si], right, blocks[ri], left, poll)
        sent.append((right, int(counts[si]) * out.itemsize))
    return sent


def binomial_bcast(mpi: MPI.Intracomm, buf, root: int, poll=None) -> list[tuple[int, int]]:
    """Binomial-tree broadcast of ``buf`` from ``root``: relative rank ``r > 0`` receives from
    ``r - lowbit(r)``, then sends to its children (:func:`~substrate.costmodel.binomial_children`),
    farthest first so the larger subtrees start early."""
    p, i = mpi.Get_size(), mpi.Get_rank()
    if p == 1:
        return []
    rel = (i - root) % p
    if rel:
        parent = (rel - (rel & -rel) + root) % p
        _wait([mpi.Irecv(buf, parent, _TAG)], poll)
    kids = [(k + root) % p for k in reversed(binomial_children(rel, p))]
    reqs = [mpi.Isend(buf, k, _TAG) for k in kids]
    _wait(reqs, poll)
    return [(k, buf.nbytes) for k in kids]


def pairwise_alltoallv(mpi: MPI.Intracomm, sendbuf, sendcounts, sdispls, out, recvcounts,
                       rdispls, xp=np) -> list[tuple[int, int]]:
    """Personalized all-to-all: block ``j`` of ``sendbuf`` goes to rank ``j`` (non-empty blocks
    only; the own block is a local copy), posted in the pairwise order ``i+1, i+2, ...``."""
    p, i = mpi.Get_size(), mpi.Get_rank()
    out[rdispls[i]:rdispls[i] + recvcounts[i]] = sendbuf[sdispls[i]:sdispls[i] + sendcounts[i]]
    if p == 1:
        return []
    _sync_for(xp)()
    reqs, sent = [], []
    for k in range(1, p):
        src = (i - k) % p
        if recvcounts[src]:
            reqs.append(mpi.Irecv(out[rdispls[src]:rdispls[src] + recvcounts[src]], src, _TAG))
    for k in range(1, p):
        dst = (i + k) % p
        if sendcounts[dst]:
            reqs.append(mpi.Isend(sendbuf[sdispls[dst]:sdispls[dst] + sendcounts[dst]], dst,
                                  _TAG))
            sent.append((dst, int(sendcounts[dst]) * sendbuf.itemsize))
    MPI.Request.Waitall(reqs)
    return sent


_EMPTY = np.empty(0, dtype=np.uint8)


def dissemination_barrier(mpi: MPI.Intracomm) -> list[tuple[int, int]]:
    """Dissemination barrier: in round ``k`` send a zero-byte message to ``i + 2^k`` and wait for
    one from ``i - 2^k`` (``ceil(log2 p)`` rounds)."""
    p, i = mpi.Get_size(), mpi.Get_rank()
    sent, d = [], 1
    while d < p:
        dst, src = (i + d) % p, (i - d) % p
        mpi.Sendrecv(_EMPTY, dst, _TAG, _EMPTY, src, _TAG)
        sent.append((dst, 0))
        d <<= 1
    return sent


# -- native mode: what a run can verify ------------------------------------------------------------
def library() -> tuple[str, str]:
    """``(family, version line)`` of the MPI library this process runs
    (family: ``"mpich"``, ``"openmpi"``, ``"intel"`` or ``"unknown"``)."""
    line = MPI.Get_library_version().strip().splitlines()[0].strip()
    low = line.lower()
    if "open mpi" in low:
        fam = "openmpi"
    elif "intel" in low:
        fam = "intel"
    elif "mpich" in low:
        fam = "mpich"
    else:
        fam = "unknown"
    return fam, line


def _version(line: str) -> str:
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", line)
    return m.group(1) if m else ""


def describe(mode: str, mpi: MPI.Intracomm) -> dict:
    """The ``collectives`` block of ``summary.json`` (collective over ``mpi``).

    ``verified`` is true when the wire carries what the ledger books: always in ``exact`` mode (the
    bytes booked are the bytes handed to point-to-point), and in ``native`` mode only when every
    rank runs a library family whose pinning has been checked on the wire with the pinning
    variables set.  ``status`` is the one-line verdict reports print.
    """
    fam, line = library()
    want = pinning_env(fam)
    have = all(os.environ.get(k) == v for k, v in want.items()) if want else False
    everywhere = bool(min(mpi.allgather(have))) if mpi.Get_size() > 1 else have
    out = {"mode": mode, "library": line, "family": fam}
    if mode == "exact":
        out.update(pinned=None, verified=True,
                   status="exact: own point-to-point algorithms (booked = sent, any MPI)")
        return out
    out["pinning"] = want
    out["pinned"] = everywhere
    if not want:
        out.update(verified=False, status=f"booked, not verified: native collectives of an MPI "
                                          f"spardist cannot pin ({fam})")
    elif not everywhere:
        out.update(verified=False, status="booked, not verified: native collectives without the "
                                          "pinning variables on every rank (launch through "
                                          "run_mpi.sh, or use --collectives exact)")
    elif fam in WIRE_VERIFIED and _version(line).startswith(WIRE_VERIFIED[fam][0] + "."):
        out.update(verified=True, status=f"native, pinned; verified on the wire for "
                                         f"{WIRE_VERIFIED[fam][1]}")
    else:
        out.update(verified=False, status=f"booked, not verified: native collectives pinned for "
                                          f"{line}, never checked on the wire")
    return out
