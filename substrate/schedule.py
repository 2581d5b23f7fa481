"""Each collective algorithm, written once, as a pure message schedule.

A collective of ``p`` members is a list of **rounds** per member.  In a round a member posts
its sends and its receives together and waits for all of them; a round that reduces adds what
it received into the buffer, any other round receives in place.  Ranges are element ranges
``[lo, hi)`` of the member's buffer (an all-to-all sends from its send buffer and receives into
its receive buffer; every other collective works in place on one buffer):

``Round(sends=((peer, lo, hi), ...), recvs=((peer, lo, hi), ...), reduce=False)``

The same schedule is

* **executed** by :mod:`substrate.collectives` (the exact collectives: MPI point-to-point on
  the rounds, so the bytes booked are the bytes sent, on any MPI);
* **simulated** by :mod:`simulation.jobsim` (every member walks its rounds on the simulated
  network);
* **counted**: :func:`sent` (the ``(peer, bytes)`` of every message a member sends, in order:
  what the ledger books for it, in either collectives mode) and :meth:`Schedule.table` (one row
  per member and peer: bytes and messages, vectorized for pricing at thousands of ranks:
  :func:`substrate.calls.wire_bytes`, :func:`substrate.calls.messages`).  The tests hold the
  table equal to the sum of the rounds, and the bytes equal to the closed forms of
  :mod:`volume.collectives`, written from the algorithms independently.

The algorithms (member ``i`` of ``p``; ``c_j`` the :func:`ring_chunk_counts` cut):

==============  ===============================================================================
allreduce       ring reduce-scatter (round ``s``: chunk ``(i-s) % p`` to ``i+1``, chunk
                ``(i-s-1) % p`` from ``i-1``, reduced) then ring all-gather (chunk
                ``(i+1-s) % p`` to ``i+1``, ``(i-s) % p`` from ``i-1``)
allgather(v)    ring: round ``s`` block ``(i-s) % p`` to ``i+1``, ``(i-s-1) % p`` from ``i-1``
bcast           binomial tree from ``root``: relative rank ``r > 0`` receives from ``r -
                lowbit(r)``, then sends to its children, farthest first
barrier         dissemination: round ``k`` a zero-element message to ``i + 2^k``, one from
                ``i - 2^k``
alltoallv       scattered pairwise: receives from ``i-1, i-2, ...`` and sends to ``i+1, i+2,
                ...`` (non-empty blocks only) in one round
p2p             direct messages (the record lists them)
==============  ===============================================================================
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Round",
    "Schedule",
    "allgatherv",
    "allreduce",
    "alltoallv",
    "barrier",
    "bcast",
    "binomial_children",
    "binomial_depth",
    "binomial_parent",
    "memo",
    "of_call",
    "ring_chunk_counts",
    "rounds_of",
    "sent",
]


@dataclass(frozen=True)
class Round:
    """What one member posts at once and waits for: ``sends`` and ``recvs`` as ``(peer, lo,
    hi)`` element ranges (``peer`` a member index), ``reduce``: the received ranges are added
    into the buffer (else received in place)."""

    sends: tuple = ()
    recvs: tuple = ()
    reduce: bool = False


def ring_chunk_counts(count: int, p: int) -> np.ndarray:
    """Element counts of the ``p`` ring chunks of a ``count``-element buffer (the
    ``numpy.array_split`` cut: the first ``count mod p`` chunks one longer)."""
    base, extra = divmod(int(count), int(p))
    sizes = np.full(int(p), base, dtype=np.int64)
    sizes[:extra] += 1
    return sizes


def binomial_parent(rel: int) -> int:
    """Parent (relative rank) of relative rank ``rel > 0`` in the binomial tree: ``rel`` with
    its lowest set bit cleared."""
    return rel - (rel & -rel)


def binomial_children(rel: int, p: int) -> list[int]:
    """Children (relative ranks) of relative rank ``rel`` in the binomial broadcast tree over
    ``p`` ranks, nearest first: ``rel + mask`` for every power of two ``mask`` below
    ``lowbit(rel)`` (all powers below ``p`` for the root)."""
    low = rel & -rel if rel else 1 << max(p - 1, 0).bit_length()
    kids = []
    mask = 1
    while mask < low and rel + mask < p:
        kids.append(rel + mask)
        mask <<= 1
    return kids


def binomial_depth(p: int) -> int:
    """``ceil(log2 p)``: rounds of a binomial tree / dissemination barrier."""
    return 0 if p <= 1 else math.ceil(math.log2(p))


class Schedule:
    """One collective's schedule over ``p`` members (see the module docstring).

    Subclasses give :meth:`rounds` (what member ``i`` does, in order) and :meth:`table` (one
    row per member and peer it sends to: ``(src, dst, elements, messages)`` member-index
    arrays, for pricing every member at once)."""

    p: int

    def rounds(self, i: int) -> tuple:
        raise NotImplementedError

    def table(self) -> tuple:
        raise NotImplementedError

    def sent(self, i: int) -> tuple:
        """``(peer, elements)`` of every message member ``i`` sends, in order (zero-element
        messages included: the message counts are exact too)."""
        return tuple((peer, hi - lo) for r in self.rounds(i) for peer, lo, hi in r.sends)


def _rows(src, dst, elems, msgs) -> tuple:
    return (np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
            np.asarray(elems, dtype=np.int64), np.asarray(msgs, dtype=np.int64))


_EMPTY_TABLE = _rows([], [], [], [])


@dataclass(frozen=True)
class _RingAllreduce(Schedule):
    count: int
    p: int

    @functools.cached_property
    def offs(self) -> tuple:
        return (0, *itertools.accumulate(ring_chunk_counts(self.count, self.p).tolist()))

    @functools.cached_property
    def width(self) -> int:
        """Elements of the largest chunk (a receive buffer for the reduce-scatter)."""
        return int(self.offs[1] - self.offs[0]) if self.p else 0

    def rounds(self, i: int) -> tuple:
        p, o = self.p, self.offs
        if p <= 1:
            return ()
        right, left = (i + 1) % p, (i - 1) % p

        def chunk(j):
            return o[j], o[j + 1]

        scatter = tuple(Round(((right, *chunk((i - s) % p)),), ((left, *chunk((i - s - 1) % p)),),
                              True) for s in range(p - 1))
        gather = tuple(Round(((right, *chunk((i + 1 - s) % p)),), ((left, *chunk((i - s) % p)),))
                       for s in range(p - 1))
        return scatter + gather

    def table(self) -> tuple:
        p = self.p
        if p <= 1:
            return _EMPTY_TABLE
        c = ring_chunk_counts(self.count, p)
        i = np.arange(p)
        # round by round member i sends every chunk but (i+1) % p in the reduce-scatter and
        # every chunk but (i+2) % p in the all-gather, all to i+1
        elems = 2 * int(self.count) - c[(i + 1) % p] - c[(i + 2) % p]
        return _rows(i, (i + 1) % p, elems, np.full(p, 2 * (p - 1)))


@dataclass(frozen=True)
class _RingAllgather(Schedule):
    counts: tuple

    @property
    def p(self) -> int:
        return len(self.counts)

    @functools.cached_property
    def displs(self) -> tuple:
        return (0, *itertools.accumulate(self.counts))

    def rounds(self, i: int) -> tuple:
        p, d = self.p, self.displs
        if p <= 1:
            return ()
        right, left = (i + 1) % p, (i - 1) % p
        return tuple(Round(((right, d[(i - s) % p], d[(i - s) % p + 1]),),
                           ((left, d[(i - s - 1) % p], d[(i - s - 1) % p + 1]),))
                     for s in range(p - 1))

    def table(self) -> tuple:
        p = self.p
        if p <= 1:
            return _EMPTY_TABLE
        b = np.asarray(self.counts, dtype=np.int64)
        i = np.arange(p)
        # member i forwards every block but (i+1) % p, the one it holds only at the end
        return _rows(i, (i + 1) % p, b.sum() - b[(i + 1) % p], np.full(p, p - 1))


@dataclass(frozen=True)
class _BinomialBcast(Schedule):
    count: int
    p: int
    root: int

    def rounds(self, i: int) -> tuple:
        p, root, n = self.p, self.root, self.count
        if p <= 1:
            return ()
        rel = (i - root) % p
        out = []
        if rel:
            out.append(Round((), (((binomial_parent(rel) + root) % p, 0, n),)))
        kids = [(k + root) % p for k in reversed(binomial_children(rel, p))]
        if kids:
            out.append(Round(tuple((k, 0, n) for k in kids)))
        return tuple(out)

    def table(self) -> tuple:
        p = self.p
        if p <= 1:
            return _EMPTY_TABLE
        rel = np.arange(1, p, dtype=np.int64)
        parent = (rel & (rel - 1)) + self.root
        return _rows(parent % p, (rel + self.root) % p, np.full(p - 1, self.count),
                     np.ones(p - 1))


@dataclass(frozen=True)
class _Dissemination(Schedule):
    p: int

    def rounds(self, i: int) -> tuple:
        p, out, d = self.p, [], 1
        while d < p:
            out.append(Round((((i + d) % p, 0, 0),), (((i - d) % p, 0, 0),)))
            d <<= 1
        return tuple(out)

    def table(self) -> tuple:
        p = self.p
        k = binomial_depth(p)
        if not k:
            return _EMPTY_TABLE
        i = np.repeat(np.arange(p), k)
        d = np.tile(1 << np.arange(k), p)
        return _rows(i, (i + d) % p, np.zeros(p * k), np.ones(p * k))


@dataclass(frozen=True)
class _PairwiseAlltoallv(Schedule):
    """``matrix[i][j]``: elements member ``i`` sends member ``j`` (a member that knows only its
    own row still gets its own sends; its receives need its column)."""

    matrix: tuple

    @property
    def p(self) -> int:
        return len(self.matrix)

    def rounds(self, i: int) -> tuple:
        p, m = self.p, self.matrix
        if p <= 1:
            return ()
        sd = (0, *itertools.accumulate(m[i]))
        col = [m[j][i] for j in range(p)]
        rd = (0, *itertools.accumulate(col))
        recvs = tuple((src, rd[src], rd[src + 1]) for src in ((i - k) % p for k in range(1, p))
                      if col[src])
        sends = tuple((dst, sd[dst], sd[dst + 1]) for dst in ((i + k) % p for k in range(1, p))
                      if m[i][dst])
        return (Round(sends, recvs),)

    def table(self) -> tuple:
        m = np.asarray(self.matrix, dtype=np.int64)
        off = ~np.eye(self.p, dtype=bool) & (m > 0)
        src, dst = np.nonzero(off)
        return _rows(src, dst, m[src, dst], np.ones(src.size))


@dataclass(frozen=True, eq=False)
class _Direct(Schedule):
    """Direct messages: ``pairs`` an ``(m, 3)`` int64 array of rows ``(src, dst, elements)``
    (member indices); a message to oneself is a local copy, not a message."""

    pairs: np.ndarray
    p: int

    def rounds(self, i: int) -> tuple:
        pr = self.pairs[self.pairs[:, 0] != self.pairs[:, 1]]
        sends = tuple((int(d), 0, int(n)) for _, d, n in pr[pr[:, 0] == i].tolist())
        recvs = tuple((int(s), 0, int(n)) for s, _, n in pr[pr[:, 1] == i].tolist())
        return (Round(sends, recvs),) if sends or recvs else ()

    def table(self) -> tuple:
        pr = self.pairs[self.pairs[:, 0] != self.pairs[:, 1]]
        return pr[:, 0], pr[:, 1], pr[:, 2], np.ones(len(pr), dtype=np.int64)


@functools.lru_cache(maxsize=4096)
def allreduce(count: int, p: int) -> Schedule:
    """Ring all-reduce of ``count`` elements over ``p`` members (cached: a run reduces the same
    few sizes step after step)."""
    return _RingAllreduce(int(count), int(p))


@functools.lru_cache(maxsize=4096)
def allgatherv(counts: tuple) -> Schedule:
    """Ring all-gather(v): member ``j`` contributes ``counts[j]`` elements, gathered in member
    order."""
    return _RingAllgather(tuple(int(c) for c in counts))


@functools.lru_cache(maxsize=4096)
def bcast(count: int, p: int, root: int = 0) -> Schedule:
    """Binomial-tree broadcast of ``count`` elements from member ``root``."""
    return _BinomialBcast(int(count), int(p), int(root))


@functools.lru_cache(maxsize=256)
def barrier(p: int) -> Schedule:
    """Dissemination barrier over ``p`` members."""
    return _Dissemination(int(p))


def alltoallv(matrix) -> Schedule:
    """Scattered pairwise all-to-all of the ``p x p`` element matrix (row = sender)."""
    return _PairwiseAlltoallv(tuple(tuple(int(v) for v in row) for row in matrix))


def direct(pairs, p: int) -> Schedule:
    """Direct messages, rows ``(src, dst, elements)`` of member indices."""
    return _Direct(np.asarray(pairs, dtype=np.int64).reshape(-1, 3), int(p))


def of_call(call) -> Schedule:
    """The schedule of a call record (:class:`substrate.calls.Call`) in **bytes** (elements of
    one byte; a ring all-reduce's chunks cut on its ``itemsize``, so its ranges are whole
    elements): what every member sends and receives, for pricing and the job simulation."""
    a, p = call.algorithm, call.size
    if a == "allreduce":
        return _Scaled(allreduce(call.nbytes // call.itemsize, p), call.itemsize)
    if a == "allgather":
        return allgatherv(call.blocks)
    if a == "bcast":
        return bcast(call.nbytes, p, call.root)
    if a == "barrier":
        return barrier(p)
    if a == "alltoallv":
        return alltoallv(np.asarray(call.blocks, dtype=np.int64).reshape(p, p))
    if a == "p2p":
        group = np.asarray(call.group, dtype=np.int64)
        order = np.argsort(group)

        def member(world):
            return order[np.searchsorted(group, world, sorter=order)]

        pr = call.pairs
        return direct(np.stack([member(pr[:, 0]), member(pr[:, 1]), pr[:, 2]], axis=1), p)
    raise ValueError(f"no schedule for algorithm {a!r}")


@dataclass(frozen=True)
class _Scaled(Schedule):
    """A schedule of elements seen in bytes (``itemsize`` bytes per element)."""

    inner: Schedule
    itemsize: int

    @property
    def p(self) -> int:
        return self.inner.p

    def rounds(self, i: int) -> tuple:
        k = self.itemsize
        if k == 1:
            return self.inner.rounds(i)
        return tuple(Round(tuple((q, lo * k, hi * k) for q, lo, hi in r.sends),
                           tuple((q, lo * k, hi * k) for q, lo, hi in r.recvs), r.reduce)
                     for r in self.inner.rounds(i))

    def table(self) -> tuple:
        src, dst, elems, msgs = self.inner.table()
        return src, dst, elems * self.itemsize, msgs


def memo(schedule: Schedule, key, make):
    """``make()``, worked out once per schedule and ``key`` and kept on the schedule itself
    (so that clearing a schedule cache, :func:`allreduce` ``.cache_clear()``, drops it too).
    For the cached schedules (:func:`allreduce`, :func:`allgatherv`, :func:`bcast`,
    :func:`barrier`), which the executing side asks about call after call."""
    store = schedule.__dict__.get("_memo")
    if store is None:
        store = schedule.__dict__["_memo"] = {}
    hit = store.get(key)
    if hit is None:
        hit = store[key] = make()
    return hit


def rounds_of(schedule: Schedule, i: int) -> tuple:
    """``schedule.rounds(i)``, worked out once per schedule and member (:func:`memo`): the
    executing side (:mod:`substrate.collectives`) asks for its own member's rounds of the same
    few cached schedules call after call.  The rounds are immutable.  An all-to-all's or direct
    messages' schedule, new for every call, is not worth it: call its :meth:`Schedule.rounds`."""
    return memo(schedule, ("rounds", i), lambda: schedule.rounds(i))


def sent(schedule: Schedule, i: int, itemsize: int = 1) -> list:
    """``(peer, bytes)`` of every message member ``i`` sends in ``schedule`` (elements of
    ``itemsize`` bytes): the ledger's booking of the call on that member."""
    return [(peer, n * itemsize) for peer, n in schedule.sent(i)]
