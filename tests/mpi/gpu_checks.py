"""MPI checks of the device-array paths, on the strict CuPy stand-in (``tests/strictcupy`` first
on ``PYTHONPATH``) or on a GPU; run as ``python -m mpi4py gpu_checks.py CHECK MODE R``.

``MODE`` is the collectives mode (``exact`` or ``native``), ``R`` ranks per virtual node.
Every check runs the same communication on NumPy arrays (the CPU path) and on device arrays,
and requires the results to be bitwise equal (the collectives reduce in the same order on
both), the ledger to book the same bytes, and the device path not to allocate pinned memory
per message.  Verdicts are collective.
"""

import os
import sys

import cupy as cp
import numpy as np
from mpi4py import MPI

from substrate import Topology, collective_check
from substrate.backend import Backend


def _topos(mode, R):
    """A CPU and a GPU topology of the same shape (the GPU one bound to a fresh backend)."""
    cpu = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R, collectives=mode)
    gpu = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R, collectives=mode)
    backend = Backend("gpu", gpu.gpu_index)
    gpu.bind_backend(backend)
    return cpu, gpu, backend


def _same(a, b) -> bool:
    b = b.get() if isinstance(b, cp.ndarray) else b
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def _ledger(t):
    tot = t.recorder.ledger.totals(t.world)
    return {k: (v["intra_bytes"], v["inter_bytes"], v["messages"])
            for k, v in tot["by_phase"].items()}


def alltoallv_symmetric(mode, R):
    """Equal send and receive sizes on every rank (a symmetric exchange): the received data
    must be the peers' blocks, not this rank's own send buffer (an aliasing bug:
    staging buffers keyed by shape and dtype gave send and receive one host buffer)."""
    cpu, gpu, _ = _topos(mode, R)
    p, r = cpu.size, cpu.rank
    for b in (5, 20000):   # eager and rendezvous-sized messages
        counts = np.full(p, b, dtype=np.int64)
        send = np.arange(b * p, dtype=np.float64) + 1e6 * r
        want = np.concatenate([np.arange(b * r, b * r + b) + 1e6 * j for j in range(p)])
        got_cpu, _ = cpu.world.alltoallv(send, counts, counts, phase="a2a").result
        got_gpu, _ = gpu.world.alltoallv(cp.asarray(send), counts, counts, phase="a2a").result
        ok = np.array_equal(got_cpu, want) and _same(want, got_gpu)
        collective_check(cpu.world, ok, f"alltoallv of {b}-element blocks on the device: "
                         f"{got_gpu.get()[:3]}... want {want[:3]}...")
    collective_check(cpu.world, _ledger(cpu) == _ledger(gpu), "ledger differs")
    # again with the buffers reused: staging never hands back stale data
    for k in range(2):
        s2 = send * (k + 2)
        g2, _ = gpu.world.alltoallv(cp.asarray(s2), counts, counts, phase="a2a").result
        collective_check(cpu.world, _same(want * (k + 2), g2), "alltoallv repeated differs")


def overlapped_same_shape(mode, R):
    """Two all-reduces of equal shape issued without waiting (DDP's buckets): each must get
    its own staging buffers (a pool keyed by shape hands both the same one)."""
    cpu, gpu, _ = _topos(mode, R)
    r = cpu.rank
    xs = [np.full(1000, r + 1.0 + 10 * i, dtype=np.float32) for i in range(3)]
    for t in (cpu, gpu):
        t.recorder.overlap = True
    hc = [cpu.world.allreduce(x.copy(), "sum", phase="b", wait=False) for x in xs]
    hg = [gpu.world.allreduce(cp.asarray(x), "sum", phase="b", wait=False) for x in xs]
    ok = True
    early = []
    for a, b in zip(hc, hg):
        a.wait()
        b.wait()
        ra, rb = a.result.copy(), b.result.get()
        early.append((np.flatnonzero(ra != rb)[:4].tolist(), ra[:2].tolist(), rb[:2].tolist()))
        ok = ok and np.array_equal(ra, rb)
    p = cpu.size
    want = [np.full(1000, p * (p + 1) / 2 + 10 * i * p, dtype=np.float32) for i in range(3)]
    ok = ok and all(np.array_equal(h.result, w) for h, w in zip(hc, want))
    diff = [(i, np.flatnonzero(a.result != w)[:5].tolist(),
             np.flatnonzero(b.result.get() != w)[:5].tolist())
            for i, (a, b, w) in enumerate(zip(hc, hg, want))]
    collective_check(cpu.world, ok, "overlapped all-reduces of one shape on the device differ "
                     f"from the CPU: (call, cpu wrong at, gpu wrong at) {diff} early {early}")


def chained_in_flight(mode, R):
    """Calls issued without waiting on one buffer, each reading the previous one's result
    (DDP's hierarchical all-reduce: intra sum, leaders' sum, intra broadcast), on the CPU and
    on the device: the communication thread must see each result before the next call."""
    cpu, gpu, _ = _topos(mode, R)
    r = cpu.rank
    res = []
    for t, conv in ((cpu, lambda a: a), (gpu, cp.asarray)):
        t.recorder.overlap = True
        g = conv(np.arange(3000, dtype=np.float32) * (r + 1))
        hs = [t.intra.allreduce(g, "sum", phase="i", wait=False)]
        hs.append(t.leaders.allreduce(g, "sum", phase="l", after=hs[-1], wait=False))
        hs.append(t.intra.bcast(g, 0, phase="b", after=hs[-1], wait=False))
        for h in hs:
            h.wait()
        res.append(g)
    p = cpu.size
    want = np.arange(3000, dtype=np.float32) * (p * (p + 1) / 2)
    collective_check(cpu.world, np.array_equal(res[0], want) and _same(res[0], res[1]),
                     f"chained calls: cpu {res[0][:3]} gpu {res[1].get()[:3]} want {want[:3]}")


def back_to_back(mode, R):
    """Calls issued one after another on device buffers, read only at the end: each staging
    block must not be reused (a receive written into it by MPI, or a send copied into it)
    while the copy of an earlier call that reads it has not run."""
    cpu, gpu, _ = _topos(mode, R)
    p, r = cpu.size, cpu.rank
    res = {}
    for t, conv in ((cpu, lambda a: a), (gpu, cp.asarray)):
        w, out = t.world, []
        for k in range(4):
            counts = np.full(p, 300, dtype=np.int64)
            send = np.arange(300 * p, dtype=np.float64) + 1e4 * r + k
            out.append(w.alltoallv(conv(send), counts, counts, phase="a2a").result[0])
            out.append(w.allreduce(conv(np.full(1200, r + k, np.float32)), phase="ar").result)
            out.append(w.bcast(conv(np.full(2400, float(r + k))), root=k % p,
                               phase="bc").result)
        res[t is gpu] = out
    ok = all(_same(a, b) for a, b in zip(res[False], res[True]))
    collective_check(cpu.world, ok, "back-to-back device calls differ from the CPU")


def receive_only(mode, R):
    """Even ranks only receive (no staging copy ever synchronizes their side stream), odd
    ranks only send: a pinned block must not take the next message while the copy of the
    previous one to the device has not run (the pool's fence)."""
    _, gpu, _ = _topos(mode, R)
    p, r = gpu.size, gpu.rank
    w = gpu.world
    got = []
    if p % 2 == 0:
        for k in range(4):
            if r % 2 == 0:
                buf = cp.empty(5000, dtype=np.float64)
                w.waitall([w.irecv(buf, r + 1, tag=k, phase="p2p")])
                got.append(buf)
            else:
                w.waitall([w.isend(cp.full(5000, 10.0 * r + k), r - 1, tag=k, phase="p2p")])
    ok = all(_same(np.full(5000, 10.0 * (r + 1) + k), g) for k, g in enumerate(got))
    collective_check(w, ok, f"received {[float(g[0]) for g in got]}")


def collectives(mode, R):
    """Every collective and point-to-point call on device arrays equals the CPU path bitwise
    (sum / avg / max / bor all-reduce, bcast, allgather(v), alltoallv, isend/irecv), books the
    same bytes, and after a warm-up round the pinned pool allocates nothing more."""
    cpu, gpu, backend = _topos(mode, R)
    p, r = cpu.size, cpu.rank
    rng = np.random.default_rng(100 + r)

    def round_(t, dev):
        conv = cp.asarray if dev else (lambda a: a)
        host = (lambda a: a.get()) if dev else (lambda a: a)
        w = t.world
        out = []
        for n, dt in ((1, np.float64), (1001, np.float32), (70000, np.float32)):
            x = rng_vals[(n, dt)]
            for op in ("sum", "avg", "max"):
                out.append(host(w.allreduce(conv(x.copy()), op, phase="ar").result))
        m = rng_vals["mask"]
        out.append(host(w.allreduce(conv(m.copy()), "bor", phase="or").result))
        b = rng_vals[(1001, np.float32)].copy()
        out.append(host(w.bcast(conv(b), root=p - 1, phase="bc").result))
        out.append(host(w.allgather(conv(rng_vals["small"].copy()), phase="ag").result))
        v = np.arange(r + 3, dtype=np.float64) * (r + 1)
        got, _counts = w.allgatherv(conv(v), phase="agv").result
        out.append(host(got))
        sc = np.arange(p, dtype=np.int64) + r + 1
        sb = np.arange(int(sc.sum()), dtype=np.float32) + 100 * r
        rc = np.array([j + r + 1 for j in range(p)], dtype=np.int64)
        got, _ = w.alltoallv(conv(sb), sc, rc, phase="a2av").result
        out.append(host(got))
        # point to point: a ring exchange, two messages each way of different sizes
        right, left = (r + 1) % p, (r - 1) % p
        recvs = [conv(np.empty(n, dtype=np.float64)) for n in (33, 4000)]
        reqs = [w.irecv(buf, left, tag=3 + i, phase="p2p") for i, buf in enumerate(recvs)]
        reqs += [w.isend(conv(np.full(n, r + 0.5 * i)), right, tag=3 + i, phase="p2p")
                 for i, n in enumerate((33, 4000))]
        w.waitall(reqs)
        out += [host(x) for x in recvs]
        return out

    rng_vals = {(n, dt): rng.standard_normal(n).astype(dt)
                for n, dt in ((1, np.float64), (1001, np.float32), (70000, np.float32))}
    rng_vals["mask"] = rng.integers(0, 256, 64, dtype=np.uint8)
    rng_vals["small"] = rng.standard_normal((2, 7))
    want = round_(cpu, False)
    got = round_(gpu, True)
    bad = [i for i, (a, b) in enumerate(zip(want, got)) if not _same(a, b)]
    collective_check(cpu.world, not bad, f"device results differ from the CPU in calls {bad}")
    collective_check(cpu.world, _ledger(cpu) == _ledger(gpu),
                     f"ledger: cpu {_ledger(cpu)} gpu {_ledger(gpu)}")
    allocs = backend.pool.allocations
    for _ in range(3):
        again = round_(gpu, True)
    collective_check(cpu.world, all(_same(a, b) for a, b in zip(want, again)),
                     "device results change when the staging buffers are reused")
    # after a warm-up round the pool serves every message from blocks it holds
    grew = backend.pool.allocations - allocs
    collective_check(cpu.world, grew == 0 or backend.cuda_aware,
                     f"{grew} pinned allocations after warm-up (one per message?)")


def cuda_aware(mode, R):
    """With a CUDA-aware MPI (``SPARDIST_CUDA_AWARE=1``: device memory is handed to MPI, the
    stand-in checks the writing stream was synchronized first) the results are the same."""
    os.environ["SPARDIST_CUDA_AWARE"] = "1"
    collectives(mode, R)


CHECKS = {f.__name__: f for f in (alltoallv_symmetric, overlapped_same_shape, chained_in_flight,
                                   back_to_back,
                                   receive_only, collectives,
                                   cuda_aware)}

if __name__ == "__main__":
    check, mode, R = sys.argv[1], sys.argv[2], int(sys.argv[3])
    CHECKS[check](mode, R)
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"OK {check} {mode}")
