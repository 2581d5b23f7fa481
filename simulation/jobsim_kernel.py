"""The job simulation's FIFO network, compiled (Numba): :class:`simulation.jobsim.JobSim` with
``link_sharing="fifo"`` for thousands of ranks.

A ring all-reduce over ``p`` ranks moves ``2 (p-1)`` messages a rank: a step of ResNet-152's
DDP at 1,024 ranks is 21 million messages, each a few events (its latency, its uplink, its
downlink, its arrival).  This module runs the same events as :meth:`JobSim.run`'s Python loop,
in the same order and with the same floating-point operations, so that every time it gives is
bitwise the Python one (the tests hold them equal):

* the ranks' threads run :meth:`JobSim._program_ops` (encoded by :class:`_Encoded`): blocks'
  sleeps, requests and waits, the stream and offload workers, the calls;
* a collective's rounds are its schedule's (:mod:`substrate.schedule`: ring all-reduce, ring
  all-gather(v), binomial broadcast, dissemination barrier; :func:`rounds` gives them to the
  tests, which hold them equal to :meth:`substrate.schedule.Schedule.rounds`), a round's
  requests counted on its thread rather than kept;
* timers are one heap ordered by (time, sequence number), the number taken where
  :meth:`JobSim._at` takes it; ready threads one first-in-first-out queue.

Not compiled (:func:`simulate` raises :class:`NotImplementedError` and :meth:`JobSim.run` runs
its Python loop): max-min fair links, recorded events, personalized all-to-alls.

The waits that can be open at once are counted from the operations; the other pools (messages,
timers, unmatched receives, match keys, connections) start at ``4 p + 256`` rows and a run that
outgrows one raises :class:`PoolFull`; :func:`simulate` then doubles that pool and runs again
from the start (the same run: nothing is random).

The functions are compiled without Numba's runtime (no reference counts: every array is made
in Python and outlives the run; counting references at each call took most of the time) and
kept in Numba's cache, which is keyed on this file: the first call after a change compiles for
about 20 s of CPU, later processes load it in about 0.2 s.  The operation kinds (``_OP_*``) are
:mod:`simulation.jobsim`'s, compiled in as constants: after changing them there, touch this file.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from substrate import schedule

from .jobsim import (
    _EPS_BYTES,
    _OP_CALL,
    _OP_DONE,
    _OP_DRAIN,
    _OP_ERROR,
    _OP_NEW,
    _OP_OFFLOAD,
    _OP_RECV,
    _OP_SEND,
    _OP_SLEEP,
    _OP_STEP,
    _OP_STREAM,
    _OP_WAIT,
)

__all__ = ["PoolFull", "State", "rounds", "run", "simulate"]

#: the kernel's functions: compiled once into Numba's cache, and without the runtime's reference
#: counts (every array is :class:`State`'s, made in Python; counting the references of its
#: arrays at every call cost half the time); NumPy's error model drops the zero check of every
#: division (no divisor here is zero: the Python loop, which would raise, gives the same steps)
_jit = njit(cache=True, _nrt=False, error_model="numpy")

_OP_END = 99                            # a rank's thread ends

# the collective algorithms compiled here: a call row (``State.calls``) holds the algorithm,
# members p, group number, where its members and its chunk offsets (all-reduce, in elements) or
# block displacements (all-gather, in bytes) start in ``State.data``, root, item size, bytes
_RING_AR, _RING_AG, _BCAST, _BARRIER = range(4)
_C_ALGO, _C_P, _C_GID, _C_GROUP, _C_CHUNKS, _C_ROOT, _C_ITEM, _C_BYTES = range(8)

# a rank (``State.rank``): its first operation, node, NIC port, first handle, first step time,
# steps done, its last stream call's and offloaded block's requests (-1: none yet)
_R_OP0, _R_NODE, _R_PORT, _R_SLOT0, _R_STEP0, _R_NSTEP, _R_STREAM, _R_OFFLOAD = range(8)

# a thread (``State.procs``): kind, rank, next operation (a rank's) or phase (a worker's), how
# many requests it waits for, parked (waiting or asleep), its call (-1: none), member index,
# the call's next round (-1: the call's overhead not slept yet), the request before it and its
# own request (a worker's), the operation that made it (a worker's)
_MAIN, _STREAMED, _OFFLOADED = range(3)
(_P_KIND, _P_RANK, _P_PC, _P_WAITING, _P_PARKED, _P_CALL, _P_MEMBER, _P_ROUND, _P_BEFORE,
 _P_H, _P_OP) = range(11)

# a program's request (``State.req``): done, first and last waiter (``State.wnode`` rows:
# thread, next)
_Q_DONE, _Q_WHEAD, _Q_WTAIL = range(3)

# a message (``State.msg``): source, destination, flags, the send's request or thread, the
# receive's request or thread (-1: none), next in its match queue, next in its link queue or
# the free list
_M_SRC, _M_DST, _M_FLAGS, _M_SREQ, _M_SPROC, _M_RREQ, _M_RPROC, _M_NEXT, _M_LINK = range(9)
_EAGER, _ARRIVED, _ACK, _MATCHED, _IN_LINK = 1, 2, 4, 8, 16

# timers: (time, sequence) in ``State.ht`` / ``State.hi[:, 0]``, then kind and arguments
_T_WAKE, _T_QUEUE, _T_ARRIVE, _T_FABRIC, _T_UPLINK = range(5)

# scalars (``State.si``, ``State.sf``)
(_S_SEQ, _S_HEAP, _S_RHEAD, _S_RCOUNT, _S_ALIVE, _S_MFREE, _S_RFREE, _S_WFREE, _S_NREQ,
 _S_NPROC, _S_NKEY, _S_NPAIR, _S_ERROR, _S_N, _S_NPORTS, _S_SHARED, _S_TIERS,
 _S_NTIERS, _S_NMSG, _S_NPOP, _S_NRUN) = range(21)
(_F_NOW, _F_INTRA, _F_INTER, _F_ACK, _F_INTRA_BW, _F_INTER_BW, _F_INTRA_LAT, _F_CALL_S,
 _F_EAGER, _F_ACK_OVERHEAD, _F_LATENCY) = range(11)


class PoolFull(Exception):
    """A pool of :func:`run` was too small (its name is the message)."""


State = namedtuple("State", [
    "ops", "opx",           # operations (kind, a, b, c, d) and their seconds or bytes
    "data",                 # handle lists of the operations, the calls' members and chunks,
                            # nodes per switch of each tier
    "calls", "rank",        # call rows, rank rows
    "procs", "ready",       # threads, the ready queue (a ring)
    "req", "wnode",         # programs' requests, their waiters
    "handles",              # every rank's requests by entry (from its first handle)
    "msg", "mbytes",        # messages, their bytes
    "keys", "kq", "recv",   # match key -> row of kq (a hash table, :func:`_row_of`); kq: send
                            # head, tail, receive head, tail; unmatched receives (request,
                            # thread, next)
    "pairs", "pq",          # connection -> row of pq (a hash table); pq: moving message, queue
                            # head, tail
    "uq", "down",           # uplink queues (head, tail); downlinks (bytes waiting, input
                            # rate, at time, set)
    "ht", "hi",             # timers
    "si", "sf",             # scalars
    "sends", "recvs", "ev",  # a round's sends (peer, bytes) and receives, a timer's fields
    "steps"])               # every rank's step times (from its first)


# -- requests and threads ----------------------------------------------------------------------
@_jit
def _ready(S, proc):
    cap = S.ready.shape[0]
    S.ready[(S.si[_S_RHEAD] + S.si[_S_RCOUNT]) % cap] = proc
    S.si[_S_RCOUNT] += 1


@_jit
def _complete(S, req):
    """A program's request is done (:meth:`JobSim._complete`): its waiters, in the order they
    began to wait, may go on."""
    S.req[req, _Q_DONE] = 1
    w = S.req[req, _Q_WHEAD]
    while w >= 0:
        proc = S.wnode[w, 0]
        S.procs[proc, _P_WAITING] -= 1
        if S.procs[proc, _P_WAITING] == 0:
            S.procs[proc, _P_PARKED] = 0
            _ready(S, proc)
        nxt = S.wnode[w, 1]
        S.wnode[w, 1] = S.si[_S_WFREE]
        S.si[_S_WFREE] = w
        w = nxt
    S.req[req, _Q_WHEAD] = -1
    S.req[req, _Q_WTAIL] = -1


@_jit
def _notify(S, req, proc):
    """A message's send or receive is done: a program's request, or one of the requests of a
    collective's round, which its thread counts instead of keeping."""
    if req >= 0:
        _complete(S, req)
    if proc >= 0:
        S.procs[proc, _P_WAITING] -= 1
        if S.procs[proc, _P_WAITING] == 0 and S.procs[proc, _P_PARKED]:
            S.procs[proc, _P_PARKED] = 0
            _ready(S, proc)


@_jit
def _wait_on(S, proc, req):
    """``proc`` waits for ``req`` too (its last waiter)."""
    w = S.si[_S_WFREE]
    if w < 0:
        raise PoolFull("waits")
    S.si[_S_WFREE] = S.wnode[w, 1]
    S.wnode[w, 0] = proc
    S.wnode[w, 1] = -1
    if S.req[req, _Q_WTAIL] >= 0:
        S.wnode[S.req[req, _Q_WTAIL], 1] = w
    else:
        S.req[req, _Q_WHEAD] = w
    S.req[req, _Q_WTAIL] = w
    S.procs[proc, _P_WAITING] += 1


@_jit
def _new_req(S):
    req = S.si[_S_NREQ]
    S.si[_S_NREQ] = req + 1
    return req


@_jit
def _spawn(S, kind, rank):
    """A new thread of ``rank``, ready (:meth:`JobSim._spawn`)."""
    proc = S.si[_S_NPROC]
    S.si[_S_NPROC] = proc + 1
    S.procs[proc, :] = 0
    S.procs[proc, _P_KIND] = kind
    S.procs[proc, _P_RANK] = rank
    S.procs[proc, _P_CALL] = -1
    S.procs[proc, _P_BEFORE] = -1
    S.si[_S_ALIVE] += 1
    _ready(S, proc)
    return proc


@_jit
def _at(S, t, kind, a, b, c):
    """A timer at ``t``, after every timer set before it for ``t`` (:meth:`JobSim._at`)."""
    S.si[_S_SEQ] += 1
    n = S.si[_S_HEAP]
    if n >= S.ht.shape[0]:
        raise PoolFull("timers")
    seq = S.si[_S_SEQ]
    ht, hi = S.ht, S.hi
    i = n
    while i > 0:                        # sift up
        up = (i - 1) >> 1
        if ht[up] < t or (ht[up] == t and hi[up, 0] < seq):
            break
        ht[i] = ht[up]
        for f in range(5):
            hi[i, f] = hi[up, f]
        i = up
    ht[i] = t
    hi[i, 0] = seq
    hi[i, 1] = kind
    hi[i, 2] = a
    hi[i, 3] = b
    hi[i, 4] = c
    S.si[_S_HEAP] = n + 1


@_jit
def _pop(S, out):
    """The first timer's kind and arguments into ``out``, and off the heap."""
    ht, hi = S.ht, S.hi
    for f in range(4):
        out[f] = hi[0, f + 1]
    n = S.si[_S_HEAP] - 1
    S.si[_S_HEAP] = n
    if n == 0:
        return
    t, seq = ht[n], hi[n, 0]
    i = 0
    while True:                         # the last one sifted down from the top
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (ht[c + 1] < ht[c] or (ht[c + 1] == ht[c] and hi[c + 1, 0] < hi[c, 0])):
            c += 1
        if t < ht[c] or (t == ht[c] and seq < hi[c, 0]):
            break
        ht[i] = ht[c]
        for f in range(5):
            hi[i, f] = hi[c, f]
        i = c
    ht[i] = t
    for f in range(5):
        hi[i, f] = hi[n, f]


# -- messages ----------------------------------------------------------------------------------
@_jit
def _new_msg(S, src, dst, nbytes, flags):
    m = S.si[_S_MFREE]
    if m < 0:
        raise PoolFull("messages")
    M = S.msg
    S.si[_S_NMSG] += 1
    S.si[_S_MFREE] = M[m, _M_LINK]
    M[m, :] = -1
    M[m, _M_SRC] = src
    M[m, _M_DST] = dst
    M[m, _M_FLAGS] = flags
    S.mbytes[m] = nbytes
    return m


@_jit
def _free_if_done(S, m):
    """A message arrived, matched and off its link is forgotten (its row reused)."""
    f = S.msg[m, _M_FLAGS]
    if f & _ARRIVED and f & _MATCHED and not f & _IN_LINK:
        S.msg[m, _M_LINK] = S.si[_S_MFREE]
        S.si[_S_MFREE] = m


@_jit
def _row_of(table, key, new):
    """The row of ``key`` in a hash table of ``(key, row)`` (open addressing, linear probing,
    rows >= 0; -1: empty), which gets row ``new`` when ``key`` is not there (``new`` < 0:
    look only).  Returns the row, or -1 when ``key`` was not there."""
    mask = table.shape[0] - 1
    h = key * -7046029254386353131          # Fibonacci hashing (2^64 / golden ratio)
    i = (h ^ (h >> 32)) & mask
    while table[i, 1] >= 0:
        if table[i, 0] == key:
            return table[i, 1]
        i = (i + 1) & mask
    if new >= 0:
        table[i, 0] = key
        table[i, 1] = new
    return -1


@_jit
def _key_row(S, key):
    """The match queues of ``key`` (made empty on first use)."""
    row = S.si[_S_NKEY]
    full = row >= S.kq.shape[0]
    got = _row_of(S.keys, key, -1 if full else row)
    if got >= 0:
        return got
    if full:
        raise PoolFull("match keys")
    S.si[_S_NKEY] = row + 1
    S.kq[row, 0] = -1
    S.kq[row, 1] = -1
    S.kq[row, 2] = -1
    S.kq[row, 3] = -1
    return row


@_jit
def _alpha(S, src, dst):
    """:meth:`JobSim._alpha`: the latency by the switch tiers the message climbs."""
    a, b = S.rank[src, _R_NODE], S.rank[dst, _R_NODE]
    if a == b:
        return S.sf[_F_INTRA_LAT]
    climbs = 0                          # Cluster.switches_between
    for k in range(S.si[_S_NTIERS]):
        n = S.data[S.si[_S_TIERS] + k]
        if a // n == b // n:
            break
        climbs += 1
    return S.sf[_F_LATENCY + climbs]


@_jit
def _launch(S, m, t):
    _at(S, t + _alpha(S, S.msg[m, _M_SRC], S.msg[m, _M_DST]), _T_QUEUE, m, 0, 0)


@_jit
def _matched(S, m, rreq, rproc):
    """Message ``m`` meets its receive (:meth:`JobSim._matched`); True when the receive is
    done at once (``rreq`` completed; ``rproc`` not counted: the caller's business)."""
    M = S.msg
    M[m, _M_FLAGS] |= _MATCHED
    M[m, _M_RREQ] = rreq
    M[m, _M_RPROC] = rproc
    if M[m, _M_FLAGS] & _ARRIVED:
        if rreq >= 0:
            _complete(S, rreq)
        _free_if_done(S, m)
        return True
    if not M[m, _M_FLAGS] & _EAGER:     # rendezvous: leaves after the handshake
        _launch(S, m, S.sf[_F_NOW] + _alpha(S, M[m, _M_SRC], M[m, _M_DST]))
    return False


@_jit
def _send(S, src, dst, key, nbytes, sreq, sproc):
    """:meth:`JobSim._send`: the send's request is ``sreq`` (a program's) or one of
    ``sproc``'s round requests, counted there until it is done."""
    if src == dst:                      # a local copy
        if sreq >= 0:
            _complete(S, sreq)
        m = _new_msg(S, src, dst, nbytes, _ARRIVED)
    else:
        eager = nbytes <= S.sf[_F_EAGER]
        m = _new_msg(S, src, dst, nbytes, _EAGER if eager else 0)
        if eager:
            if sreq >= 0:
                _complete(S, sreq)
            _launch(S, m, S.sf[_F_NOW])
        else:
            S.msg[m, _M_SREQ] = sreq
            S.msg[m, _M_SPROC] = sproc
            if sproc >= 0:
                S.procs[sproc, _P_WAITING] += 1
    row = _key_row(S, key)
    r = S.kq[row, 2]
    if r < 0:                           # nobody receives yet
        if S.kq[row, 1] >= 0:
            S.msg[S.kq[row, 1], _M_NEXT] = m
        else:
            S.kq[row, 0] = m
        S.kq[row, 1] = m
        return
    S.kq[row, 2] = S.recv[r, 2]
    if S.kq[row, 2] < 0:
        S.kq[row, 3] = -1
    rreq, rproc = S.recv[r, 0], S.recv[r, 1]
    S.recv[r, 2] = S.si[_S_RFREE]
    S.si[_S_RFREE] = r
    if _matched(S, m, rreq, rproc) and rproc >= 0:
        _notify(S, -1, rproc)           # (counted when it was posted)


@_jit
def _recv(S, key, rreq, rproc):
    """:meth:`JobSim._recv`: the receive's request is ``rreq`` (a program's) or one of
    ``rproc``'s round requests, counted there until it is done."""
    row = _key_row(S, key)
    m = S.kq[row, 0]
    if m >= 0:                          # the message was sent
        S.kq[row, 0] = S.msg[m, _M_NEXT]
        if S.kq[row, 0] < 0:
            S.kq[row, 1] = -1
        if not _matched(S, m, rreq, rproc) and rproc >= 0:
            S.procs[rproc, _P_WAITING] += 1
        return
    r = S.si[_S_RFREE]
    if r < 0:
        raise PoolFull("receives")
    S.si[_S_RFREE] = S.recv[r, 2]
    S.recv[r, 0] = rreq
    S.recv[r, 1] = rproc
    S.recv[r, 2] = -1
    if S.kq[row, 3] >= 0:
        S.recv[S.kq[row, 3], 2] = r
    else:
        S.kq[row, 2] = r
    S.kq[row, 3] = r
    if rproc >= 0:
        S.procs[rproc, _P_WAITING] += 1


# -- links -------------------------------------------------------------------------------------
@_jit
def _pair_row(S, m):
    """The connection of ``m``'s two ranks (a link of its own inside a node)."""
    key = S.msg[m, _M_SRC] * S.si[_S_N] + S.msg[m, _M_DST]
    row = S.si[_S_NPAIR]
    full = row >= S.pq.shape[0]
    got = _row_of(S.pairs, key, -1 if full else row)
    if got >= 0:
        return got
    if full:
        raise PoolFull("connections")
    S.si[_S_NPAIR] = row + 1
    S.pq[row, 0] = -1
    S.pq[row, 1] = -1
    S.pq[row, 2] = -1
    return row


@_jit
def _own_link(S, m):
    """A message inside a node whose ranks each have a link to each other (not a shared
    fabric): one connection per pair, one message at a time; every other goes through FIFO
    queues."""
    return S.rank[S.msg[m, _M_SRC], _R_NODE] == S.rank[S.msg[m, _M_DST], _R_NODE] \
        and not S.si[_S_SHARED]


@_jit
def _queue(S, m):
    """:meth:`JobSim._queue` (timer: one latency after leaving)."""
    if _own_link(S, m):
        row = _pair_row(S, m)
        if S.pq[row, 0] >= 0:           # the pair's earlier message still moves
            if S.pq[row, 2] >= 0:
                S.msg[S.pq[row, 2], _M_LINK] = m
            else:
                S.pq[row, 1] = m
            S.pq[row, 2] = m
            return
    if _move(S, m):
        _arrive(S, m)


@_jit
def _move(S, m):
    """:meth:`JobSim._move`; True when ``m`` has no bytes to move (the caller has it
    arrive)."""
    M = S.msg
    src = M[m, _M_SRC]
    a, b = S.rank[src, _R_NODE], S.rank[M[m, _M_DST], _R_NODE]
    fifo = a != b or S.si[_S_SHARED]
    ack = M[m, _M_FLAGS] & _ACK
    if not (fifo or ack):
        S.pq[_pair_row(S, m), 0] = m
    nbytes = S.mbytes[m]
    if not ack:
        if a == b:
            S.sf[_F_INTRA] += nbytes
        else:
            S.sf[_F_INTER] += nbytes
    if nbytes <= _EPS_BYTES:
        return True
    if fifo:                            # the node's uplink (or its shared fabric)
        port = S.si[_S_NPORTS] + a if a == b else S.rank[src, _R_PORT]
        M[m, _M_FLAGS] |= _IN_LINK
        M[m, _M_LINK] = -1
        if S.uq[port, 1] >= 0:
            M[S.uq[port, 1], _M_LINK] = m
            S.uq[port, 1] = m
            return False
        S.uq[port, 0] = m
        S.uq[port, 1] = m
        _uplink_send(S, port)
        return False
    _at(S, S.sf[_F_NOW] + nbytes / S.sf[_F_INTRA_BW], _T_ARRIVE, m, 0, 0)
    return False


@_jit
def _downlink_input(S, port, rate):
    """:meth:`JobSim._downlink_input`."""
    d = S.down[port]
    now = S.sf[_F_NOW]
    if d[3] == 0.0:
        d[0], d[1], d[2], d[3] = 0.0, 0.0, now, 1.0
    w = d[0] + (d[1] - S.sf[_F_INTER_BW]) * (now - d[2])
    d[0] = w if w > 0.0 else 0.0  # noqa: FURB136 (Python's max(0.0, w), to the bit)
    d[1] += rate
    d[2] = now


@_jit
def _uplink_send(S, port):
    """:meth:`JobSim._uplink_send`."""
    m = S.uq[port, 0]
    now = S.sf[_F_NOW]
    if port >= S.si[_S_NPORTS]:         # a node's shared fabric
        _at(S, now + S.mbytes[m] / S.sf[_F_INTRA_BW], _T_FABRIC, port, m, 0)
        return
    dst = S.rank[S.msg[m, _M_DST], _R_PORT]
    _downlink_input(S, dst, S.sf[_F_INTER_BW])
    _at(S, now + S.mbytes[m] / S.sf[_F_INTER_BW], _T_UPLINK, port, m, dst)


@_jit
def _next_on(S, port):
    """:meth:`JobSim._next_on`."""
    m = S.uq[port, 0]
    nxt = S.msg[m, _M_LINK]
    S.uq[port, 0] = nxt
    if nxt < 0:
        S.uq[port, 1] = -1
    S.msg[m, _M_FLAGS] &= ~_IN_LINK
    _free_if_done(S, m)
    if nxt >= 0:
        _uplink_send(S, port)


@_jit
def _uplink_sent(S, port, m, dst):
    """:meth:`JobSim._uplink_sent`."""
    _downlink_input(S, dst, -S.sf[_F_INTER_BW])
    wait = S.down[dst, 0] / S.sf[_F_INTER_BW]
    if wait > 0:
        _at(S, S.sf[_F_NOW] + wait, _T_ARRIVE, m, 0, 0)
    else:
        _arrive(S, m)
    _next_on(S, port)


@_jit
def _arrive(S, m):
    """:meth:`JobSim._arrive`; a message of no bytes that its pair's queue releases arrives at
    once, the next turn of the loop."""
    M = S.msg
    while m >= 0:
        M[m, _M_FLAGS] |= _ARRIVED
        f = M[m, _M_FLAGS]
        if f & _ACK:
            _free_if_done(S, m)
            return
        src, dst = M[m, _M_SRC], M[m, _M_DST]
        inter = S.rank[src, _R_NODE] != S.rank[dst, _R_NODE]
        if S.sf[_F_ACK_OVERHEAD] != 0.0 and inter and S.mbytes[m] > 0:
            nbytes = S.sf[_F_ACK_OVERHEAD] * S.mbytes[m]
            ack = _new_msg(S, dst, src, nbytes, _ACK | _MATCHED)
            S.sf[_F_ACK] += nbytes
            if _move(S, ack):           # leaves the receiver's node now, behind its queue
                M[ack, _M_FLAGS] |= _ARRIVED
                _free_if_done(S, ack)
        row = -1
        if _own_link(S, m):
            row = _pair_row(S, m)
            if S.pq[row, 0] == m:
                S.pq[row, 0] = -1
        if not f & _EAGER:
            _notify(S, M[m, _M_SREQ], M[m, _M_SPROC])
        if f & _MATCHED:
            _notify(S, M[m, _M_RREQ], M[m, _M_RPROC])
        _free_if_done(S, m)
        m = -1
        if row >= 0 and S.pq[row, 1] >= 0 and S.pq[row, 0] < 0:
            nxt = S.pq[row, 1]
            S.pq[row, 1] = M[nxt, _M_LINK]
            if S.pq[row, 1] < 0:
                S.pq[row, 2] = -1
            M[nxt, _M_LINK] = -1
            if _move(S, nxt):
                m = nxt


# -- collectives -------------------------------------------------------------------------------
@_jit
def _bit_length(x):
    n = 0
    while x > 0:
        x >>= 1
        n += 1
    return n


@_jit
def _kids(rel, p, out):
    """:func:`substrate.schedule.binomial_children` into ``out``; returns how many."""
    low = rel & -rel if rel else 1 << _bit_length(max(p - 1, 0))
    k = 0
    mask = 1
    while mask < low and rel + mask < p:
        out[k] = rel + mask
        k += 1
        mask <<= 1
    return k


@_jit
def _n_rounds(calls, c, i, kids):
    p = calls[c, _C_P]
    if p <= 1:
        return 0
    algo = calls[c, _C_ALGO]
    if algo == _RING_AR:
        return 2 * (p - 1)
    if algo == _RING_AG:
        return p - 1
    if algo == _BCAST:
        rel = (i - calls[c, _C_ROOT]) % p
        return (1 if rel else 0) + (1 if _kids(rel, p, kids) else 0)
    n, d = 0, 1
    while d < p:
        n += 1
        d <<= 1
    return n


@_jit
def _round(calls, data, c, i, s, sends, recvs):
    """Member ``i``'s round ``s`` of call ``c`` (:meth:`substrate.schedule.Schedule.rounds`,
    in bytes): ``sends`` rows (peer, bytes), ``recvs`` peers; returns how many of each."""
    p = calls[c, _C_P]
    algo = calls[c, _C_ALGO]
    off = calls[c, _C_CHUNKS]
    if algo == _RING_AR:                # reduce-scatter, then all-gather
        k = calls[c, _C_ITEM]
        j = (i - s) % p if s < p - 1 else (i + 1 - (s - (p - 1))) % p
        sends[0, 0] = (i + 1) % p
        sends[0, 1] = data[off + j + 1] * k - data[off + j] * k
        recvs[0] = (i - 1) % p
        return 1, 1
    if algo == _RING_AG:
        j = (i - s) % p
        sends[0, 0] = (i + 1) % p
        sends[0, 1] = data[off + j + 1] - data[off + j]
        recvs[0] = (i - 1) % p
        return 1, 1
    if algo == _BCAST:
        root = calls[c, _C_ROOT]
        rel = (i - root) % p
        if rel and s == 0:              # from the parent
            recvs[0] = (rel - (rel & -rel) + root) % p
            return 0, 1
        n = _kids(rel, p, recvs)        # (no receives in this round: its scratch)
        for q in range(n):              # to the children, farthest first
            sends[q, 0] = (recvs[n - 1 - q] + root) % p
            sends[q, 1] = calls[c, _C_BYTES]
        return n, 0
    d = 1 << s                          # dissemination
    sends[0, 0] = (i + d) % p
    sends[0, 1] = 0
    recvs[0] = (i - d) % p
    return 1, 1


@njit(cache=True)
def rounds(calls, data, c, i):
    """Member ``i``'s rounds of call ``c``, one ``(round, 0, peer, bytes)`` per send and
    ``(round, 1, peer, 0)`` per receive (the tests hold them to the schedules')."""
    sends = np.empty((64, 2), np.int64)
    recvs = np.empty(64, np.int64)
    out = []
    for s in range(_n_rounds(calls, c, i, recvs)):
        ns, nr = _round(calls, data, c, i, s, sends, recvs)
        for q in range(ns):
            out.append((s, 0, sends[q, 0], sends[q, 1]))
        for q in range(nr):
            out.append((s, 1, recvs[q], 0))
    return out


@_jit
def _collective(S, proc, sends, recvs):
    """:meth:`JobSim._collective` for thread ``proc``, from where it stopped: the library's
    overhead, then its rounds (sends, receives, then the wait for those not done yet).  True
    when the call is over."""
    P = S.procs
    c, i = P[proc, _P_CALL], P[proc, _P_MEMBER]
    calls = S.calls
    p = calls[c, _C_P]
    if P[proc, _P_ROUND] < 0:
        P[proc, _P_ROUND] = 0
        if S.sf[_F_CALL_S] and p > 1:
            P[proc, _P_PARKED] = 1
            _at(S, S.sf[_F_NOW] + S.sf[_F_CALL_S], _T_WAKE, proc, 0, 0)
            return False
    r = P[proc, _P_RANK]
    n = S.si[_S_N]
    base = calls[c, _C_GID] * n
    g = calls[c, _C_GROUP]
    last = _n_rounds(calls, c, i, recvs)
    while P[proc, _P_ROUND] < last:
        s = P[proc, _P_ROUND]
        P[proc, _P_ROUND] = s + 1
        ns, nr = _round(calls, S.data, c, i, s, sends, recvs)
        for q in range(ns):
            dst = S.data[g + sends[q, 0]]
            _send(S, r, dst, (base + r) * n + dst, float(sends[q, 1]), -1, proc)
        for q in range(nr):
            src = S.data[g + recvs[q]]
            _recv(S, (base + src) * n + r, -1, proc)
        if P[proc, _P_WAITING] > 0:
            P[proc, _P_PARKED] = 1
            return False
    return True


# -- threads -----------------------------------------------------------------------------------
@_jit
def _wait_handles(S, proc, r, off, count):
    """``proc`` waits for those of rank ``r``'s handles ``data[off:off+count]`` not done yet
    (and what it already waits for); True when it has to."""
    base = S.rank[r, _R_SLOT0]
    for q in range(off, off + count):
        req = S.handles[base + S.data[q]]
        if not S.req[req, _Q_DONE]:
            _wait_on(S, proc, req)
    if S.procs[proc, _P_WAITING] > 0:
        S.procs[proc, _P_PARKED] = 1
        return True
    return False


@_jit
def _sleep(S, proc, dt):
    """``proc`` sleeps ``dt`` (not at all unless > 0); True when it does."""
    if dt > 0:
        S.procs[proc, _P_PARKED] = 1
        _at(S, S.sf[_F_NOW] + dt, _T_WAKE, proc, 0, 0)
        return True
    return False


@_jit
def _worker(S, proc, sends, recvs):
    """A stream call (:meth:`JobSim._on_stream`) or an offloaded block (:meth:`JobSim.
    _offloaded`), from where it stopped."""
    P = S.procs
    op = P[proc, _P_OP]
    before = P[proc, _P_BEFORE]
    if P[proc, _P_KIND] == _STREAMED:
        if P[proc, _P_PC] == 0:
            P[proc, _P_PC] = 1
            if before >= 0 and not S.req[before, _Q_DONE]:
                _wait_on(S, proc, before)
                P[proc, _P_PARKED] = 1
                return
        if P[proc, _P_PC] == 1:
            P[proc, _P_PC] = 2
            P[proc, _P_CALL] = S.ops[op, 2]
            P[proc, _P_MEMBER] = S.ops[op, 3]
            P[proc, _P_ROUND] = -1
        if not _collective(S, proc, sends, recvs):
            return
    else:
        if P[proc, _P_PC] == 0:
            P[proc, _P_PC] = 1
            if before >= 0 and not S.req[before, _Q_DONE]:
                _wait_on(S, proc, before)
            if _wait_handles(S, proc, P[proc, _P_RANK], S.ops[op, 2], S.ops[op, 3]):
                return
        if P[proc, _P_PC] == 1:
            P[proc, _P_PC] = 2
            if _sleep(S, proc, S.opx[op]):
                return
    _complete(S, P[proc, _P_H])
    S.si[_S_ALIVE] -= 1


@_jit
def _main(S, proc, sends, recvs):
    """Rank thread ``proc`` (:meth:`JobSim._rank`), from where it stopped, until it waits;
    False at an error operation (its index in ``si[_S_ERROR]``)."""
    P = S.procs
    r = P[proc, _P_RANK]
    ops = S.ops
    base = S.rank[r, _R_SLOT0]
    while True:
        if P[proc, _P_CALL] >= 0:
            if not _collective(S, proc, sends, recvs):
                return True
            P[proc, _P_CALL] = -1
        pc = P[proc, _P_PC]
        P[proc, _P_PC] = pc + 1
        kind = ops[pc, 0]
        if kind == _OP_SLEEP:
            if _sleep(S, proc, S.opx[pc]):
                return True
        elif kind == _OP_NEW:
            S.handles[base + ops[pc, 1]] = _new_req(S)
        elif kind == _OP_DONE:
            _complete(S, S.handles[base + ops[pc, 1]])
        elif kind == _OP_WAIT:
            if _wait_handles(S, proc, r, ops[pc, 1], ops[pc, 2]):
                return True
        elif kind == _OP_OFFLOAD or kind == _OP_STREAM:
            h = _new_req(S)
            w = _spawn(S, _OFFLOADED if kind == _OP_OFFLOAD else _STREAMED, r)
            P[w, _P_H] = h
            P[w, _P_OP] = pc
            col = _R_OFFLOAD if kind == _OP_OFFLOAD else _R_STREAM
            P[w, _P_BEFORE] = S.rank[r, col]
            S.rank[r, col] = h
            S.handles[base + ops[pc, 1]] = h
        elif kind == _OP_DRAIN:
            h = S.rank[r, _R_STREAM]
            if h >= 0 and not S.req[h, _Q_DONE]:
                _wait_on(S, proc, h)
                P[proc, _P_PARKED] = 1
                return True
        elif kind == _OP_SEND:
            h = _new_req(S)
            S.handles[base + ops[pc, 1]] = h
            _send(S, ops[pc, 2], ops[pc, 3], ops[pc, 4], S.opx[pc], h, -1)
        elif kind == _OP_RECV:
            h = _new_req(S)
            S.handles[base + ops[pc, 1]] = h
            _recv(S, ops[pc, 3], h, -1)
        elif kind == _OP_CALL:
            P[proc, _P_CALL] = ops[pc, 1]
            P[proc, _P_MEMBER] = ops[pc, 2]
            P[proc, _P_ROUND] = -1
        elif kind == _OP_STEP:
            S.steps[S.rank[r, _R_STEP0] + S.rank[r, _R_NSTEP]] = S.sf[_F_NOW]
            S.rank[r, _R_NSTEP] += 1
        elif kind == _OP_END:
            S.si[_S_ALIVE] -= 1
            return True
        else:                           # _OP_ERROR: the caller raises it
            S.si[_S_ERROR] = ops[pc, 1]
            return False


@_jit
def run(S):
    """:meth:`JobSim.run`'s loop: every rank's thread to its end.  Returns 0, or -1 at an
    error operation."""
    sends, recvs, ev = S.sends, S.recvs, S.ev
    for r in range(S.si[_S_N]):
        S.procs[_spawn(S, _MAIN, r), _P_PC] = S.rank[r, _R_OP0]
    si, sf = S.si, S.sf
    cap = S.ready.shape[0]
    while True:
        while si[_S_RCOUNT] > 0:
            proc = S.ready[si[_S_RHEAD]]
            si[_S_RHEAD] = (si[_S_RHEAD] + 1) % cap
            si[_S_RCOUNT] -= 1
            si[_S_NRUN] += 1
            if S.procs[proc, _P_KIND] == _MAIN:
                if not _main(S, proc, sends, recvs):
                    return -1
            else:
                _worker(S, proc, sends, recvs)
        if si[_S_HEAP] == 0:
            return 0
        if S.ht[0] > sf[_F_NOW]:  # noqa: PLR1730 (Python's max(t, now), to the bit)
            sf[_F_NOW] = S.ht[0]
        while si[_S_HEAP] > 0 and S.ht[0] <= sf[_F_NOW]:
            _pop(S, ev)
            si[_S_NPOP] += 1
            kind = ev[0]
            if kind == _T_WAKE:
                _ready(S, ev[1])
            elif kind == _T_QUEUE:
                _queue(S, ev[1])
            elif kind == _T_ARRIVE:
                _arrive(S, ev[1])
            elif kind == _T_FABRIC:
                _arrive(S, ev[2])
                _next_on(S, ev[1])
            else:
                _uplink_sent(S, ev[1], ev[2], ev[3])


@_jit
def _stuck(S, out):
    """``out[r]``: rank r waits for a receive nobody matched (:meth:`JobSim._waiting_procs`)."""
    for row in range(S.si[_S_NKEY]):
        e = S.kq[row, 2]
        while e >= 0:
            if S.recv[e, 1] >= 0:
                out[S.procs[S.recv[e, 1], _P_RANK]] = True
            req = S.recv[e, 0]
            if req >= 0:
                w = S.req[req, _Q_WHEAD]
                while w >= 0:
                    out[S.procs[S.wnode[w, 0], _P_RANK]] = True
                    w = S.wnode[w, 1]
            e = S.recv[e, 2]


# -- from JobSim to arrays ---------------------------------------------------------------------
class _Encoded:
    """Every rank's operations (:meth:`JobSim._program_ops`) as the arrays of :class:`State`.
    Raises :class:`NotImplementedError` for a schedule not compiled here."""

    def __init__(self, sim, ops_of) -> None:
        self._kinds = (schedule._Scaled, schedule._RingAllgather, schedule._BinomialBcast,
                       schedule._Dissemination)
        n = len(ops_of)
        self.data: list = []            # handle lists, then the calls' members and chunks
        self.calls: list = []
        self.errors: list = []          # what an error operation raises
        self._row: dict = {}            # id(call) -> its row
        self._members: dict = {}        # group number -> where its members start in data
        self._p2p: dict = {}            # point-to-point match key -> its number (< 0)
        rows, xs = [], []
        self.rank = np.zeros((n + 1, 8), dtype=np.int64)
        self.procs = n
        self.reqs = slots = steps = 0
        #: the waits that can be open at once (the "waits" pool: then it never fills): a
        #: rank's thread waits for one operation's handles at a time, a worker for its
        #: dependencies and the worker's previous request
        self.waits = 0
        for r, ops in enumerate(ops_of):
            self.rank[r, [_R_OP0, _R_SLOT0, _R_STEP0]] = len(rows), slots, steps
            slots += len(sim.programs[r])
            waits = 1
            for op in ops:
                k, a, b, c, d, x = op[0], 0, 0, 0, 0, 0.0
                if k == _OP_SLEEP:
                    x = op[1]
                elif k in (_OP_NEW, _OP_DONE):
                    a = op[1]
                elif k == _OP_WAIT:
                    a, b = len(self.data), len(op[1])
                    self.data.extend(op[1])
                    waits = max(waits, b)
                elif k == _OP_OFFLOAD:
                    a, b, c, x = op[1], len(self.data), len(op[2]), op[3]
                    self.data.extend(op[2])
                    self.procs += 1
                    self.waits += c + 1
                elif k == _OP_STREAM:
                    a = op[1]
                    b, c = self._call(sim, op[2], r)
                    if b < 0:
                        raise NotImplementedError("a stream call the Python loop refuses")
                    self.procs += 1
                    self.waits += 1
                elif k == _OP_SEND:
                    a, b, c, d, x = op[1], op[2], op[3], self._key(op[4]), float(op[5])
                elif k == _OP_RECV:
                    a, b, c = op[1], op[2], self._key(op[3])
                elif k == _OP_CALL:
                    a, b = self._call(sim, op[1], r)
                    if a < 0:
                        k, a = _OP_ERROR, b
                elif k == _OP_STEP:
                    steps += 1
                elif k == _OP_ERROR:
                    a = len(self.errors)
                    self.errors.append(op[1])
                self.reqs += k in (_OP_NEW, _OP_OFFLOAD, _OP_STREAM, _OP_SEND, _OP_RECV)
                rows.append((k, a, b, c, d))
                xs.append(x)
            self.waits += waits
            rows.append((_OP_END, 0, 0, 0, 0))
            xs.append(0.0)
        self.rank[n, [_R_SLOT0, _R_STEP0]] = slots, steps
        self.ops = np.array(rows, dtype=np.int64).reshape(-1, 5)
        self.opx = np.array(xs, dtype=np.float64)
        self.slots, self.steps = slots, steps

    def _key(self, key) -> int:
        """A point-to-point match key as a number < 0 (a collective's are >= 0)."""
        hit = self._p2p.get(key)
        if hit is None:
            hit = self._p2p[key] = -1 - len(self._p2p)
        return hit

    def _call(self, sim, call, r: int) -> tuple:
        """``(row, member)`` of rank ``r``'s collective call; ``(-1, error)`` where the Python
        loop raises."""
        try:
            sched, gid, member = sim._schedule(call)
            i = sim._member(call, member, r)
        except ValueError as err:
            self.errors.append(err)
            return -1, len(self.errors) - 1
        row = self._row.get(id(call))
        if row is not None:
            return row, i
        if not isinstance(sched, self._kinds) or (isinstance(sched, schedule._Scaled) and not
                                                  isinstance(sched.inner,
                                                             schedule._RingAllreduce)):
            raise NotImplementedError(f"{type(sched).__name__} schedules")
        if gid not in self._members:
            self._members[gid] = len(self.data)
            self.data.extend(call.group)
        chunks, root, item, nbytes = len(self.data), 0, 1, 0
        if isinstance(sched, schedule._Scaled):
            algo, item = _RING_AR, sched.itemsize
            self.data.extend(sched.inner.offs)
        elif isinstance(sched, schedule._RingAllgather):
            algo = _RING_AG
            self.data.extend(sched.displs)
        elif isinstance(sched, schedule._BinomialBcast):
            algo, root, nbytes = _BCAST, sched.root, sched.count
        else:
            algo = _BARRIER
        row = self._row[id(call)] = len(self.calls)
        self.calls.append((algo, sched.p, gid, self._members[gid], chunks, root, item, nbytes))
        return row, i


def _latencies(cluster) -> list:
    """Latency between two nodes by the number of switch tiers a message climbs, each from a
    pair of nodes that climbs that many (:meth:`Cluster.inter_latency`)."""
    tiers = cluster.tiers
    out = []
    for c in range(len(tiers) + 1):
        b = max(t.nodes for t in tiers[:c]) if c else 1
        if len(cluster.switches_between(0, b)) != c:
            raise NotImplementedError("switch tiers whose switches hold fewer nodes upwards")
        out.append(cluster.inter_latency(0, b))
    return out


def _pool(cap: int, width: int) -> np.ndarray:
    """Rows of -1, chained through their last column (a free list from row 0)."""
    a = np.full((cap, width), -1, dtype=np.int64)
    a[:-1, width - 1] = np.arange(1, cap)
    return a


def _table(rows: int) -> np.ndarray:
    """An empty hash table (:func:`_row_of`) for ``rows`` keys, at most half full."""
    return np.full((1 << (2 * rows - 1).bit_length(), 2), -1, dtype=np.int64)


def _state(sim, enc: _Encoded, caps: dict) -> State:
    n = len(sim.programs)
    nics = sim.cluster.node.nics
    nodes = max(sim.node_of) + 1
    ports = nodes * nics
    rank = enc.rank.copy()
    rank[:n, _R_NODE] = sim.node_of
    rank[:n, _R_PORT] = [a * nics + b for a, b in sim.port_of]
    rank[:, [_R_STREAM, _R_OFFLOAD]] = -1
    tiers = [t.nodes for t in sim.cluster.tiers]
    si = np.zeros(21, dtype=np.int64)
    si[[_S_N, _S_NPORTS, _S_SHARED, _S_TIERS, _S_NTIERS, _S_ERROR]] = (
        n, ports, int(sim._shared_fabric), len(enc.data), len(tiers), -1)
    c = sim.cost
    sf = np.array([0.0, 0.0, 0.0, 0.0, c.intra_bw, c.inter_bw, c.intra_lat, sim._call_s,
                   sim.eager_limit, sim.ack_overhead, *_latencies(sim.cluster)])
    req = np.full((enc.reqs + 1, 3), -1, dtype=np.int64)
    req[:, _Q_DONE] = 0
    return State(
        ops=enc.ops, opx=enc.opx, data=np.array(enc.data + tiers + [0], dtype=np.int64),
        calls=np.array(enc.calls, dtype=np.int64).reshape(-1, 8), rank=rank,
        procs=np.zeros((enc.procs, 11), dtype=np.int64),
        ready=np.zeros(enc.procs + 1, dtype=np.int64), req=req,
        wnode=_pool(caps["waits"], 2), handles=np.full(enc.slots + 1, -1, dtype=np.int64),
        msg=_pool(caps["messages"], 9), mbytes=np.zeros(caps["messages"]),
        keys=_table(caps["match keys"]), kq=np.full((caps["match keys"], 4), -1),
        recv=_pool(caps["receives"], 3),
        pairs=_table(caps["connections"]), pq=np.full((caps["connections"], 3), -1),
        uq=np.full((ports + nodes, 2), -1, dtype=np.int64), down=np.zeros((ports, 4)),
        ht=np.zeros(caps["timers"]), hi=np.zeros((caps["timers"], 5), dtype=np.int64),
        si=si, sf=sf, sends=np.empty((64, 2), dtype=np.int64), recvs=np.empty(64, dtype=np.int64),
        ev=np.empty(4, dtype=np.int64), steps=np.zeros(enc.steps + 1))


def simulate(sim, ops_of, caps: int | None = None) -> list | None:
    """Run ``sim`` (a :class:`JobSim` with FIFO links) on its ranks' operations ``ops_of``:
    sets its ``steps``, ``now``, ``moved`` and ``ack_bytes`` as :meth:`JobSim.run` does and
    returns the ranks left waiting for a receive (``None``: every thread ended).  Raises
    :class:`NotImplementedError` for what is not compiled (the caller runs Python).  ``caps``:
    the rows each pool starts with (default ``4 n + 256`` for ``n`` ranks)."""
    enc = _Encoded(sim, ops_of)
    n = len(ops_of)
    caps = dict.fromkeys(("messages", "receives", "waits", "match keys", "connections",
                          "timers"), caps or 4 * n + 256)
    if caps is None:
        caps["waits"] = enc.waits + 1
    while True:
        S = _state(sim, enc, caps)
        try:
            status = run(S)
        except PoolFull as full:        # a larger pool, the same run again
            caps[str(full.args[0])] *= 2
            continue
        break
    if status < 0:
        raise enc.errors[S.si[_S_ERROR]]
    steps = S.steps.tolist()
    sim.steps = [steps[enc.rank[r, _R_STEP0]:enc.rank[r + 1, _R_STEP0]] for r in range(n)]
    sim.now = float(S.sf[_F_NOW])
    sim.moved = {"intra": float(S.sf[_F_INTRA]), "inter": float(S.sf[_F_INTER])}
    sim.ack_bytes = float(S.sf[_F_ACK])
    sim.counts = {"messages": int(S.si[_S_NMSG]), "timers": int(S.si[_S_NPOP]),
                  "thread turns": int(S.si[_S_NRUN])}
    if not S.si[_S_ALIVE]:
        return None
    out = np.zeros(n, dtype=np.bool_)
    _stuck(S, out)
    return np.flatnonzero(out).tolist()
