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

The algorithms are written once, as message schedules (:mod:`substrate.schedule`: ring
all-reduce and all-gather(v), binomial broadcast, scattered pairwise all-to-all, dissemination
barrier); the functions here execute a schedule's rounds on MPI point-to-point
(:func:`run_rounds`), and the job simulation (:mod:`simulation.jobsim`) simulates the same rounds.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
from mpi4py import MPI

from . import schedule
from .pinning import DEFAULT_MODE, MODES, WIRE_VERIFIED, check_mode, default_mode, pinning_env

__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "UFUNCS",
    "BoundRing",
    "RingAllreduce",
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
    "ring_plan",
    "run_rounds",
]

_TAG = 7171  # every exact collective runs on a private Dup(): the tag never meets user messages

#: Reduction ufuncs by op name (``"avg"`` is a sum followed by a division in the caller).
UFUNCS = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum", "bor": "bitwise_or"}


# -- exact algorithms on point-to-point ------------------------------------------------------------
# Each runs the rounds of its :mod:`substrate.schedule` on an mpi4py communicator reserved for
# them (a Dup of the run's), host or (CUDA-aware) device buffers, and returns ``sent``: a list
# of ``(dest, nbytes)`` pairs, one per message this rank handed to MPI (zero-byte messages
# included, so message counts are exact too).

def _sync_for(xp):
    if xp is np:
        return lambda: None
    return lambda: xp.cuda.get_current_stream().synchronize()


def _wait(reqs, poll) -> None:
    """``Waitall``; with ``poll`` (seconds), testing every ``poll`` seconds instead (the
    communication thread: it sleeps between tests, so it does not take a core from the
    computation it overlaps, and MPI progresses at every test)."""
    if poll is None:
        MPI.Request.Waitall(reqs)
        return
    while not MPI.Request.Testall(reqs):
        time.sleep(poll)


def run_rounds(mpi: MPI.Intracomm, rounds, send, recv, poll=None, tmp=None,
               reduce=None) -> list[tuple[int, int]]:
    """Execute a member's rounds (:class:`substrate.schedule.Round`): ``send`` is the 1-D
    buffer the sends read, ``recv`` the one receives land in (the same array for in-place
    collectives).  A reducing round receives into ``tmp`` and hands each range to
    ``reduce(lo, hi, received)``.  One send and one receive: ``Sendrecv`` (or, with ``poll``,
    the non-blocking pair); else every receive and send posted, then waited for.  Returns the
    ``(dest, bytes)`` of every message sent."""
    isz = send.itemsize
    out = []
    for r in rounds:
        sends, recvs = r.sends, r.recvs
        got = None
        if r.reduce:
            (src, lo, hi), = recvs
            got = tmp[:hi - lo]
            rviews = ((src, got),)
        else:
            rviews = tuple((src, recv[lo:hi]) for src, lo, hi in recvs)
        if len(sends) == 1 and len(rviews) == 1 and poll is None:
            (dst, slo, shi), = sends
            (src, rbuf), = rviews
            mpi.Sendrecv(send[slo:shi], dst, _TAG, rbuf, src, _TAG)
            out.append((dst, (shi - slo) * isz))
        else:
            reqs = [mpi.Irecv(rbuf, src, _TAG) for src, rbuf in rviews]
            reqs += [mpi.Isend(send[lo:hi], dst, _TAG) for dst, lo, hi in sends]
            _wait(reqs, poll)
            for dst, lo, hi in sends:
                out.append((dst, (hi - lo) * isz))
        if got is not None:
            reduce(recvs[0][1], recvs[0][2], got)
    return out


class RingAllreduce:
    """Member ``i``'s part of the ring all-reduce of ``count`` elements over ``p`` members
    (:func:`substrate.schedule.allreduce`), worked out once (:func:`ring_plan`): its rounds,
    the same rounds as flat ``(dst, slo, shi, src, rlo, rhi, reduce)`` steps (one send and one
    receive each), the largest chunk and the ``(dest, elements)`` of every message.

    :func:`ring_allreduce` executes the steps on any NumPy buffer of ``count`` elements; a
    :class:`BoundRing` (:meth:`bind`) executes them on one buffer, its chunk views made once.

    Parameters
    ----------
    sched : Schedule
        The ring all-reduce's schedule (:func:`substrate.schedule.allreduce`).
    i : int
        The member.
    """

    __slots__ = ("_sent", "rounds", "sent_elements", "steps", "width")

    def __init__(self, sched, i: int) -> None:
        self.rounds = schedule.rounds_of(sched, i)
        steps = []
        for r in self.rounds:
            (dst, slo, shi), = r.sends
            (src, rlo, rhi), = r.recvs
            steps.append((dst, slo, shi, src, rlo, rhi, r.reduce))
        self.steps = tuple(steps)
        self.width = sched.width
        self.sent_elements = tuple((dst, shi - slo) for dst, slo, shi, *_ in self.steps)
        self._sent: dict = {}

    def sent(self, itemsize: int) -> tuple:
        """``(dest, bytes)`` of every message the steps send (elements of ``itemsize`` bytes),
        in order: what :func:`run_rounds` returns for these rounds."""
        out = self._sent.get(itemsize)
        if out is None:
            out = self._sent[itemsize] = tuple((d, n * itemsize) for d, n in self.sent_elements)
        return out

    def bind(self, mpi: MPI.Intracomm, buf: np.ndarray, op: str) -> BoundRing:
        """The steps on NumPy ``buf`` over ``mpi`` with ``op`` (see :class:`BoundRing`)."""
        return BoundRing(self, mpi, buf, op)


def ring_plan(count: int, p: int, i: int) -> RingAllreduce:
    """Member ``i``'s :class:`RingAllreduce` of ``count`` elements over ``p``, worked out once
    per schedule (:func:`substrate.schedule.memo`: a run reduces the same few sizes step after
    step)."""
    sched = schedule.allreduce(count, p)
    return schedule.memo(sched, ("ring", i), lambda: RingAllreduce(sched, i))


class BoundRing:
    """A ring all-reduce bound to one contiguous NumPy buffer: every step's receive and send
    made once, as a pair of persistent requests on its chunks (``Recv_init`` / ``Send_init``,
    receive first, as :func:`run_rounds` posts them), so that a buffer reduced again (a run's
    small all-reduces reuse their buffers step after step) costs one ``Startall``, one
    ``Waitall`` per step and one ufunc per reducing step.  The messages, their order and the
    reductions are :func:`ring_allreduce`'s (each chunk reduced once, ``op(own, received)``).
    :meth:`free` releases the requests (an unbound buffer).

    Parameters
    ----------
    plan : RingAllreduce
        The member's ring (:func:`ring_plan`) for the buffer's element count.
    mpi : mpi4py.MPI.Intracomm
        The communicator the exact collectives run on.
    buf : numpy.ndarray
        The contiguous buffer, reduced in place by every :meth:`run`.
    op : str
        The reduction (a key of :data:`UFUNCS`).
    """

    __slots__ = ("buf", "ops", "requests", "sent", "startall", "ufunc", "waitall")

    def __init__(self, plan: RingAllreduce, mpi: MPI.Intracomm, buf: np.ndarray,
                 op: str) -> None:
        flat = buf.reshape(-1)
        tmp = np.empty(plan.width, dtype=buf.dtype)
        ops, requests = [], []
        for dst, slo, shi, src, rlo, rhi, red in plan.steps:
            rview = tmp[:rhi - rlo] if red else flat[rlo:rhi]
            pair = [mpi.Recv_init(rview, src, _TAG), mpi.Send_init(flat[slo:shi], dst, _TAG)]
            requests.extend(pair)
            ops.append((pair, flat[rlo:rhi] if red else None, rview))
        self.buf = buf
        self.ops = tuple(ops)
        self.requests = requests
        self.ufunc = getattr(np, UFUNCS[op])
        self.startall, self.waitall = _startall, _waitall
        self.sent = plan.sent(buf.itemsize)

    def run(self) -> tuple:
        """Reduce the buffer in place (blocking); returns the ``(dest, bytes)`` sent."""
        startall, waitall, ufunc = self.startall, self.waitall, self.ufunc
        for pair, acc, rview in self.ops:
            startall(pair)
            waitall(pair)
            if acc is not None:
                ufunc(acc, rview, out=acc)
        return self.sent

    def free(self) -> None:
        """Release the persistent requests (not in use: every run has waited for them)."""
        for r in self.requests:
            r.Free()
        self.requests = []
        self.ops = ()


#: how a :class:`BoundRing` starts and completes its requests (the tests' transport replaces
#: them, as it replaces :func:`_wait`)
_startall = MPI.Prequest.Startall
_waitall = MPI.Request.Waitall


def ring_allreduce(mpi: MPI.Intracomm, buf, op: str, xp=np, poll=None) -> list[tuple[int, int]]:
    """In-place ring all-reduce (:func:`substrate.schedule.allreduce`) of the 1-D contiguous
    ``buf``: every rank ends with bitwise-identical data (each chunk is reduced once, then
    copied)."""
    p = mpi.Get_size()
    if p == 1:
        return []
    plan = ring_plan(buf.size, p, mpi.Get_rank())
    ufunc = getattr(xp, UFUNCS[op])
    if xp is np and poll is None:
        # blocking, on the host: the plan's steps, one Sendrecv each
        tmp = np.empty(plan.width, dtype=buf.dtype)
        sendrecv = mpi.Sendrecv
        for dst, slo, shi, src, rlo, rhi, red in plan.steps:
            if red:
                got = tmp[:rhi - rlo]
                sendrecv(buf[slo:shi], dst, _TAG, got, src, _TAG)
                acc = buf[rlo:rhi]
                ufunc(acc, got, out=acc)
            else:
                sendrecv(buf[slo:shi], dst, _TAG, buf[rlo:rhi], src, _TAG)
        return list(plan.sent(buf.itemsize))
    sync = _sync_for(xp)
    tmp = xp.empty(plan.width, dtype=buf.dtype)

    def reduce(lo, hi, got):
        ufunc(buf[lo:hi], got, out=buf[lo:hi])
        sync()

    return run_rounds(mpi, plan.rounds, buf, buf, poll, tmp, reduce)


def ring_allreduce_staged(mpi: MPI.Intracomm, host, recv, reduce_chunk,
                          poll=None) -> list[tuple[int, int]]:
    """:func:`ring_allreduce`'s rounds, message for message, for a device buffer staged
    through host memory with the reduction on the device.

    ``host`` is the buffer's pinned host mirror (1-D; its own chunk filled by the caller),
    ``recv`` a pinned block of at least the largest chunk.  A reduce-scatter round hands the
    received chunk to ``reduce_chunk(lo, hi, recv[:hi-lo])``, which adds it into the device
    buffer and refreshes ``host[lo:hi]`` with the sum (what the next round sends); the
    all-gather runs on the host mirror, which the caller copies back."""
    p = mpi.Get_size()
    if p == 1:
        return []
    plan = ring_plan(host.size, p, mpi.Get_rank())
    return run_rounds(mpi, plan.rounds, host, host, poll, recv, reduce_chunk)


def ring_allgatherv(mpi: MPI.Intracomm, out, counts, poll=None) -> list[tuple[int, int]]:
    """Ring all-gather(v) (:func:`substrate.schedule.allgatherv`) into ``out``: rank ``i``'s
    own block of ``counts[i]`` elements already in place, the blocks in rank order."""
    if mpi.Get_size() == 1:
        return []
    sched = schedule.allgatherv(tuple(int(c) for c in counts))
    return run_rounds(mpi, schedule.rounds_of(sched, mpi.Get_rank()), out, out, poll)


def binomial_bcast(mpi: MPI.Intracomm, buf, root: int, poll=None) -> list[tuple[int, int]]:
    """Binomial-tree broadcast (:func:`substrate.schedule.bcast`) of ``buf`` from ``root``."""
    p = mpi.Get_size()
    if p == 1:
        return []
    sched = schedule.bcast(buf.size, p, root)
    return run_rounds(mpi, schedule.rounds_of(sched, mpi.Get_rank()), buf, buf, poll)


def pairwise_alltoallv(mpi: MPI.Intracomm, sendbuf, sendcounts, sdispls, out, recvcounts,
                       rdispls, xp=np) -> list[tuple[int, int]]:
    """Personalized all-to-all (:func:`substrate.schedule.alltoallv`): block ``j`` of
    ``sendbuf`` goes to rank ``j`` (non-empty blocks only; the own block is a local copy)."""
    p, i = mpi.Get_size(), mpi.Get_rank()
    out[rdispls[i]:rdispls[i] + recvcounts[i]] = sendbuf[sdispls[i]:sdispls[i] + sendcounts[i]]
    if p == 1:
        return []
    _sync_for(xp)()
    # this rank's row (what it sends) and column (what it receives) of the element matrix
    matrix = np.zeros((p, p), dtype=np.int64)
    matrix[i] = sendcounts
    matrix[:, i] = recvcounts
    return run_rounds(mpi, schedule.alltoallv(matrix).rounds(i), sendbuf, out)


def dissemination_barrier(mpi: MPI.Intracomm) -> list[tuple[int, int]]:
    """Dissemination barrier (:func:`substrate.schedule.barrier`): zero-byte messages."""
    return run_rounds(mpi, schedule.rounds_of(schedule.barrier(mpi.Get_size()), mpi.Get_rank()),
                      _EMPTY, _EMPTY)


_EMPTY = np.empty(0, dtype=np.uint8)


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
