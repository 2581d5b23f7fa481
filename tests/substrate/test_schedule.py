"""The collective schedules (:mod:`substrate.schedule`), written once: the exact collectives
execute them, the job simulation simulates them, the pricing counts them.

Each is held against what is written independently of it: the results of a reduction, a
gather or a broadcast (NumPy), the wire bytes of :mod:`volume.collectives` and of the
message-by-message walks of ``traffic_reference``; and a mutated schedule fails both the
execution and the simulation check.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from traffic_reference import simulated_bcast, simulated_ring

from simulation.jobsim import JobSim
from substrate import collectives as coll
from substrate import schedule
from substrate.calls import Call, Placement, messages, wire_bytes
from substrate.costmodel import CostModel
from volume import collectives as closed


def _schedules(p: int, count: int, root: int):
    rng = np.random.default_rng(p * 1000 + count)
    m = rng.integers(0, 4, size=(p, p))
    yield schedule.allreduce(count, p)
    yield schedule.allgatherv(tuple(int(c) for c in rng.integers(0, 5, size=p)))
    yield schedule.bcast(count, p, root % p)
    yield schedule.barrier(p)
    yield schedule.alltoallv(m)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 6, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 30])
def test_table_is_the_rounds_and_every_send_meets_its_receive(p, count):
    for sched in _schedules(p, count, root=p - 1):
        # the pricing table is the sum of every member's rounds
        sent: dict = {}
        for i in range(p):
            for peer, n in sched.sent(i):
                e = sent.setdefault((i, peer), [0, 0])
                e[0] += n
                e[1] += 1
        src, dst, elems, msgs = sched.table()
        assert {(int(s), int(d)): [int(n), int(k)] for s, d, n, k in
                zip(src, dst, elems, msgs)} == sent
        # MPI matches messages per (sender, receiver) in posting order: the receiver posts the
        # same sizes in the same order as the sender's sends
        for i in range(p):
            for j in range(p):
                out = [hi - lo for r in sched.rounds(i) for q, lo, hi in r.sends if q == j]
                got = [hi - lo for r in sched.rounds(j) for q, lo, hi in r.recvs if q == i]
                assert out == got, (type(sched).__name__, i, j)


@given(nodes=st.lists(st.integers(0, 3), min_size=1, max_size=12), count=st.integers(0, 300),
       itemsize=st.sampled_from([1, 4, 8]), data=st.data())
@settings(max_examples=60, deadline=None)
def test_schedule_bytes_are_the_independent_walks(nodes, count, itemsize, data):
    p = len(nodes)
    pl = Placement(tuple(nodes))
    # the placement renumbers nodes; a group in rank order sees them in that order
    world = pl.world
    ring = Call("r", "allreduce", world, count * itemsize, itemsize)
    assert wire_bytes(ring, pl) == simulated_ring(count, itemsize, pl.nodes_array)
    assert wire_bytes(ring, pl) == closed.ring_allreduce_split(count, itemsize, pl.nodes_array)
    assert messages(ring) == (2 * p * (p - 1) if p > 1 else 0)
    root = data.draw(st.integers(0, p - 1))
    b = Call("b", "bcast", world, 3 * itemsize, itemsize, root=root)
    assert wire_bytes(b, pl) == simulated_bcast(3 * itemsize, pl.nodes_array, root)
    assert messages(b) == p - 1


@pytest.mark.parametrize("M,P", [(1, 3), (2, 3), (3, 3), (2, 2), (4, 1), (3, 5)])
def test_schedule_bytes_equal_the_closed_forms(M, P):
    p = M * P
    pl = Placement.node_major(M, P)
    for count in (7, 38282, p * 11 + 1):
        call = Call("a", "allreduce", pl.world, 4 * count, 4)
        assert wire_bytes(call, pl) == closed.ring_allreduce_wire_bytes(
            4 * count, p, M if M > 1 else 0, 4)
    leaders = Call("l", "allreduce", pl.leaders, 4 * 1001, 4)
    assert wire_bytes(leaders, pl) == closed.ring_allreduce_wire_bytes(4 * 1001, M, M, 4)
    gather = Call("g", "allgather", pl.world, blocks=(24,) * p, itemsize=4)
    assert wire_bytes(gather, pl) == closed.ring_allgather_wire_bytes(24, p, M if M > 1 else 0)
    assert wire_bytes(Call("b", "bcast", pl.world, 40, 4), pl) == \
        closed.bcast_wire_bytes(40, M, P)


# -- execution on a transport of queues (the exact collectives' code, without MPI) --------------
class _Req:
    def __init__(self, wait, start=None) -> None:
        self._wait = wait
        self._start = start

    def Wait(self) -> None:
        self._wait()

    def Start(self) -> None:            # a persistent request (Send_init, Recv_init)
        self._start()

    def Free(self) -> None:
        self._start = self._wait = None


class _Transport:
    """p members exchanging through one queue per (sender, receiver): what the exact
    collectives call of an mpi4py communicator (``Sendrecv``, ``Isend``, ``Irecv``)."""

    def __init__(self, p: int) -> None:
        self.p = p
        self.boxes = {(i, j): queue.Queue() for i in range(p) for j in range(p)}

    def comm(self, i: int):
        t = self

        class _Comm:
            def Get_size(self):
                return t.p

            def Get_rank(self):
                return i

            def Isend(self, buf, dest, tag):
                t.boxes[(i, dest)].put(np.array(buf, copy=True))
                return _Req(lambda: None)

            def Irecv(self, buf, source, tag):
                def wait():
                    got = t.boxes[(source, i)].get(timeout=3)
                    assert got.size == buf.size, "a message of another size than posted"
                    buf[...] = got
                return _Req(wait)

            def Sendrecv(self, sbuf, dest, stag, rbuf, source, rtag):
                self.Isend(sbuf, dest, stag)
                self.Irecv(rbuf, source, rtag).Wait()

            def Send_init(self, buf, dest, tag):
                return _Req(lambda: None, lambda: self.Isend(buf, dest, tag))

            def Recv_init(self, buf, source, tag):
                return _Req(lambda: self.Irecv(buf, source, tag).Wait(), lambda: None)

        return _Comm()


def _run(p: int, fn, monkeypatch) -> list:
    """``fn(comm, i)`` on p threads over a queue transport; returns each member's result."""
    monkeypatch.setattr(coll, "_wait", lambda reqs, poll: [r.Wait() for r in reqs])
    monkeypatch.setattr(coll, "_startall", lambda reqs: [r.Start() for r in reqs])
    monkeypatch.setattr(coll, "_waitall", lambda reqs: [r.Wait() for r in reqs])
    t = _Transport(p)
    out: list = [None] * p
    errors: list = []

    def member(i):
        try:
            out[i] = fn(t.comm(i), i)
        except Exception as e:                                # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(p)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    if errors:
        raise errors[0]
    return out


def _executed_ok(p: int, count: int, monkeypatch) -> bool:
    """Every collective on p members gives NumPy's answer (odd sizes: uneven chunks and
    blocks) and books its schedule's messages."""
    rng = np.random.default_rng(count)
    data = [rng.integers(-50, 50, size=count).astype(np.float64) for _ in range(p)]

    def allreduce(c, i):
        buf = data[i].copy()
        sent = coll.ring_allreduce(c, buf, "sum")
        return buf, sent

    res = _run(p, allreduce, monkeypatch)
    want = np.sum(data, axis=0)
    ok = all(np.array_equal(buf, want) for buf, _ in res)
    ok &= all(sent == schedule.sent(schedule.allreduce(count, p), i, 8)
              for i, (_, sent) in enumerate(res))
    counts = [(i * 3 + 1) % 5 for i in range(p)]
    displs = np.concatenate(([0], np.cumsum(counts)))

    def gather(c, i):
        out = np.zeros(int(displs[-1]))
        out[displs[i]:displs[i + 1]] = i + 1
        coll.ring_allgatherv(c, out, counts)
        return out

    want = np.repeat(np.arange(p) + 1.0, counts)
    ok &= all(np.array_equal(out, want) for out in _run(p, gather, monkeypatch))

    def bcast(c, i):
        buf = np.arange(count, dtype=np.float64) if i == p - 1 else np.zeros(count)
        coll.binomial_bcast(c, buf, p - 1)
        return buf

    ok &= all(np.array_equal(b, np.arange(count)) for b in _run(p, bcast, monkeypatch))

    def alltoall(c, i):
        send_counts = np.array([(i + j) % 3 for j in range(p)])
        recv_counts = np.array([(j + i) % 3 for j in range(p)])
        send = np.repeat(100.0 * i + np.arange(p), send_counts)
        out = np.zeros(int(recv_counts.sum()))
        coll.pairwise_alltoallv(c, send, send_counts, np.concatenate(([0], np.cumsum(
            send_counts)[:-1])), out, recv_counts, np.concatenate(([0], np.cumsum(
                recv_counts)[:-1])))
        return out, recv_counts

    for i, (out, rc) in enumerate(_run(p, alltoall, monkeypatch)):
        ok &= np.array_equal(out, np.repeat(100.0 * np.arange(p) + i, rc))
    return bool(ok)


@pytest.mark.parametrize("p,count", [(2, 16), (3, 10), (5, 23), (6, 4)])
def test_exact_collectives_execute_the_schedules(p, count, monkeypatch):
    assert _executed_ok(p, count, monkeypatch)


def _simulated_ok(M: int, P: int, count: int) -> bool:
    """The job simulation of one all-reduce and one broadcast on every rank moves the bytes of
    the independent closed forms."""
    pl = Placement.node_major(M, P)
    p = pl.size
    calls = [Call("a", "allreduce", pl.world, 4 * count, 4, op="sum"),
             Call("b", "bcast", pl.world, 4 * count, 4)]
    programs = [[["C", c.to_dict(), None, True, True, None] for c in calls] + [["S"]]
                for _ in range(p)]
    sim = JobSim(programs, pl.node_of, CostModel(), [lambda key, k: 0.0] * p)
    sim.run()
    want = closed.ring_allreduce_wire_bytes(4 * count, p, M if M > 1 else 0, 4)
    b = closed.bcast_wire_bytes(4 * count, M, P)
    return sim.moved == {"intra": want["intra"] + b["intra"], "inter": want["inter"] + b["inter"]}


@pytest.mark.parametrize("M,P,count", [(2, 2, 16), (2, 3, 10), (3, 1, 7)])
def test_job_simulation_simulates_the_schedules(M, P, count):
    assert _simulated_ok(M, P, count)


def test_a_mutated_schedule_fails_execution_and_simulation(monkeypatch):
    """One wrong chunk index in the ring's reduce-scatter: the exact all-reduce no longer sums
    and the simulation no longer moves the closed form's bytes."""
    right = schedule._RingAllreduce.rounds

    def mutated(self, i):
        rounds = list(right(self, i))
        if self.p > 1 and i == 0:
            (q, _, _), = rounds[0].sends
            o = self.offs
            j = (1 % self.p)                                   # chunk 1 instead of chunk 0
            rounds[0] = schedule.Round(((q, o[j], o[j + 1]),), rounds[0].recvs, True)
        return tuple(rounds)

    assert _executed_ok(3, 10, monkeypatch) and _simulated_ok(2, 2, 17)
    monkeypatch.setattr(schedule._RingAllreduce, "rounds", mutated)
    schedule.allreduce.cache_clear()
    try:
        with pytest.raises((AssertionError, queue.Empty)):
            assert _executed_ok(3, 10, monkeypatch)
        assert not _simulated_ok(2, 2, 17)
    finally:
        schedule.allreduce.cache_clear()


# -- the communicator's bound all-reduce: the general path's messages, results and books -------
def _comms(p: int, transport):
    """One :class:`substrate.comm.Comm` per member over ``transport`` (exact mode), each with
    its own recorder, on two nodes where ``p > 2``."""
    from substrate.comm import Comm
    from substrate.recorder import Recorder

    pl = Placement(tuple(i * 2 // p for i in range(p)))
    out = []
    for i in range(p):
        c = transport.comm(i)
        c.Dup = lambda c=c: c
        out.append(Comm(c, pl, np.arange(p), Recorder(pl, i), collectives="exact"))
    return out


def _workload(comm, i: int, p: int) -> list:
    """Blocking all-reduces of every op on buffers reduced again and again (with new data),
    under two phases, and on new buffers every time."""
    rng = np.random.default_rng(i)
    kept = {("sum", np.float32, 16), ("max", np.float32, 5), ("avg", np.float64, 7),
            ("min", np.int64, 1), ("bor", np.uint8, 9), ("sum", np.int32, 3 * p + 1),
            ("sum", np.float64, 0)}
    kept = {k: np.zeros(k[2], dtype=k[1]) for k in sorted(kept, key=str)}
    got = []
    for step in range(4):
        for (op, dt, n), buf in kept.items():
            buf[...] = (rng.standard_normal(n) * 100 if np.dtype(dt).kind == "f"
                        else rng.integers(0, 100, n))
            for phase in ("a", "b"):
                h = comm.allreduce(buf, op, phase=f"{phase}_{op}")
                assert h.result is buf and h.call.nbytes == buf.nbytes
                got.append(buf.copy())
        fresh = rng.standard_normal((2, 3)).astype(np.float32)
        comm.allreduce(fresh, phase="fresh")
        got.append(fresh)
    return got


@pytest.mark.parametrize("p", [2, 3, 4])
def test_bound_allreduce_is_the_general_path(p, monkeypatch):
    """A blocking all-reduce of a small NumPy buffer runs bound (its steps, views and booking
    worked out once per buffer): the same messages (the transport checks every size), bitwise
    the same results and the same ledger, to the modeled second, and call log as the general
    path, which runs when binding is off."""
    from substrate import comm as comm_mod

    def run(bind: bool):
        monkeypatch.setattr(comm_mod, "BIND_MAX_BYTES", 64 << 10 if bind else -1)
        comms = _comms(p, _Transport(p))
        res = _run(p, lambda c, i: _workload(comms[i], i, p), monkeypatch)
        books = [(c.recorder.ledger.local(), c.recorder.log.describe()) for c in comms]
        return res, books, [len(c._bound) for c in comms]

    (bound, books_b, kept_b), (general, books_g, kept_g) = run(True), run(False)
    assert all(k > 0 for k in kept_b) and kept_g == [0] * p
    assert all(len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                        for x, y in zip(a, b)) for a, b in zip(bound, general))
    assert books_b == books_g
    # and the ring's answer: every member holds the same bits
    assert all(np.array_equal(x, y) for res in bound[1:] for x, y in zip(res, bound[0]))


def test_bound_allreduce_follows_its_buffer(monkeypatch):
    """A buffer is bound when it comes back (the same object, phase and op), by identity and
    dtype: new buffers every call (even at a reused address) are never bound, a dtype changed
    in place is bound again, and at most MAX_BOUND buffers are kept (their requests freed)."""
    from substrate import comm as comm_mod

    monkeypatch.setattr(comm_mod, "MAX_BOUND", 4)
    comms = _comms(2, _Transport(2))
    freed = []
    real_free = coll.BoundRing.free
    monkeypatch.setattr(coll.BoundRing, "free",
                        lambda self: (freed.append(len(self.requests)), real_free(self)))

    def work(c, i):
        out = []
        for k in range(10):                     # new buffers, freed between calls
            x = np.full(6, float(i + k), dtype=np.float64)
            c.allreduce(x, phase="x")
            out.append(x[0])
        assert not c._bound
        kept = [np.full(3, float(i + k)) for k in range(6)]
        for _ in range(3):
            for k, z in enumerate(kept):
                z[...] = i + k
                c.allreduce(z, phase="z")
                out.append(z[0])
        assert len(c._bound) <= 4
        y = np.arange(4, dtype=np.int32) + i
        for _ in range(2):
            c.allreduce(y, phase="y")
        out.append(y.copy())
        y.dtype = np.float32                    # the same memory, another dtype: bound again
        for _ in range(3):
            y[...] = i + 0.5
            c.allreduce(y, phase="y")
            out.append(y.copy())
        assert c._bound[(id(y), "y", "sum")].dtype == np.float32
        return out

    a, b = _run(2, lambda c, i: work(comms[i], i), monkeypatch)
    assert a[:10] == b[:10] == [1.0 + 2 * k for k in range(10)]
    assert a[10:28] == [1.0 + 2 * k for k in range(6)] * 3
    assert np.array_equal(a[28], [2, 6, 10, 14]) and a[28].dtype == np.int32
    assert all(y.dtype == np.float32 and np.array_equal(y, np.full(4, 2.0)) for y in a[29:])
    assert freed and all(n == 4 for n in freed)     # p = 2: two steps, two requests each


def test_member_rounds_are_worked_out_once():
    """``rounds_of`` is the schedule's rounds, the same object call after call, until the
    schedule cache is cleared."""
    s = schedule.allreduce(11, 3)
    assert schedule.rounds_of(s, 1) is schedule.rounds_of(s, 1) and \
        schedule.rounds_of(s, 1) == s.rounds(1)
    plan = coll.ring_plan(11, 3, 1)
    assert plan is coll.ring_plan(11, 3, 1) and plan.rounds == s.rounds(1)
    assert list(plan.sent(4)) == schedule.sent(s, 1, 4)
    schedule.allreduce.cache_clear()
    assert coll.ring_plan(11, 3, 1) is not plan
