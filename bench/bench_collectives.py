"""Ledger overhead and bucketing speed-up, measured side by side in one run.

    ./run_mpi.sh -n 4 --ranks-per-node 2 bench.bench_collectives [--reps 20]

1. ledger-wrapped ``Comm.allreduce`` in both collective modes vs raw ``mpi4py`` ``Allreduce`` on
   1-64 MiB float32 buffers over the world communicator: the native wrapper's overhead (target
   <= 5 %) and the exact mode's throughput relative to the library (target >= 0.9x at 4-64 MiB).
   The raw call runs whatever the environment selects: pinned to ring under ``run_mpi.sh``;
   prefix ``MPIR_CVAR_DEVICE_COLLECTIVES=all MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=auto`` to
   compare against MPICH's own defaults;
2. ``bucketed_allreduce`` of 200 tensors of 4 KiB vs one wrapped call per tensor
   (target: >= 3x faster);
3. exact call overhead: the per-call time of a tiny all-reduce (16 float32, ``max``): raw
   ``mpi4py``, the native wrapper, the bare exact ring (``collectives.ring_allreduce``, no
   booking) and the exact wrapper (schedule + booking + record), each against raw (target:
   the exact wrapper <= 3x raw at 2 and 4 ranks).

``--parts`` picks the parts (default all three: ``throughput,bucketed,overhead``).  Timings
interleave the variants rep by rep and report medians, so machine noise hits all of them; the
header gives the load average when the run started (the box is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

from substrate import Topology, bucketed_allreduce
from substrate.collectives import describe, ring_allreduce


def _median_time(fn, comm, reps):
    out = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        comm.Barrier()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--parts", default="throughput,bucketed,overhead",
                    help="comma-separated parts to run: throughput, bucketed, overhead")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"throughput", "bucketed", "overhead"}
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}; use throughput, bucketed, overhead")
    topo = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=args.ranks_per_node,
                              collectives="native")
    exact = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=args.ranks_per_node,
                               collectives="exact").world
    w = topo.world
    raw = w.mpi
    rank0 = w.rank == 0
    pinned = describe("native", raw)["pinned"]
    if rank0:
        print(f"# bench_collectives: {w.size} ranks, {topo.num_nodes} nodes x "
              f"{topo.ranks_per_node}, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"library collectives {'pinned to ring' if pinned else 'as the library selects'}, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "throughput" in parts:
        _throughput(w, exact, raw, args.reps)
    if "bucketed" in parts:
        _bucketed(w, raw, args.reps)
    if "overhead" in parts:
        call_overhead(w, exact, args.reps)


def _throughput(w, exact, raw, reps):
    """Part 1: 1-64 MiB all-reduces, raw vs native wrapped vs exact."""
    rank0 = w.rank == 0
    if rank0:
        print("\n| buffer | raw mpi4py (ms) | native wrapped (ms) | exact (ms) | native wrapper "
              "overhead (median, noisy) | exact / raw throughput | wrapper bookkeeping per call |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
    for mib in (1, 4, 16, 64):
        buf = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
        raws, wraps, exs = [], [], []
        for _ in range(reps):  # interleaved
            raws.append(_median_time(lambda buf=buf: raw.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), raw, 1))
            wraps.append(_median_time(lambda buf=buf: w.allreduce(buf, phase="bench"), raw, 1))
            exs.append(_median_time(lambda buf=buf: exact.allreduce(buf, phase="bench"), raw, 1))
        r, l, x = statistics.median(raws), statistics.median(wraps), statistics.median(exs)
        # the wrapper's own work (argument checks, call record, ledger booking), timed without
        # MPI noise
        t = time.perf_counter()
        for _ in range(1000):
            w._check(buf, "allreduce")
            call = w._call("bench_bookkeeping", "allreduce", nbytes=buf.nbytes,
                           itemsize=buf.itemsize, op="sum")
            w.recorder.book(call, payload=buf.nbytes, intra=buf.nbytes,
                            messages=2 * (w.size - 1), links=(w.out_link,))
        book = (time.perf_counter() - t) / 1000
        if rank0:
            print(f"| {mib} MiB | {r * 1e3:.2f} | {l * 1e3:.2f} | {x * 1e3:.2f} | "
                  f"{(l / r - 1) * 100:+.1f} % | {r / x:.2f}x | {book * 1e6:.1f} us = "
                  f"{book / r * 100:.3f} % |")


def _bucketed(w, raw, reps):
    """Part 2: 200 tensors of 4 KiB, one call each vs bucketed."""
    rng = np.random.default_rng(w.rank)
    tensors = [rng.standard_normal(1024).astype(np.float32) for _ in range(200)]  # 4 KiB each

    def per_tensor():
        for t in tensors:
            w.allreduce(t, phase="bench_per_tensor")

    def bucketed():
        bucketed_allreduce(tensors, w, phase="bench_bucketed")

    bucketed()  # plan once
    pt, bk = [], []
    for _ in range(reps):
        pt.append(_median_time(per_tensor, raw, 1))
        bk.append(_median_time(bucketed, raw, 1))
    a, b = statistics.median(pt), statistics.median(bk)
    if w.rank == 0:
        print("\n| 200 x 4 KiB all-reduce | time (ms) |")
        print("|---|---:|")
        print(f"| one call per tensor | {a * 1e3:.2f} |")
        print(f"| bucketed (32 MiB buckets, 1 call) | {b * 1e3:.2f} |")
        print(f"| **speed-up** | **{a / b:.1f}x** |")


def call_overhead(native, exact, reps, calls: int = 200):
    """Per-call time of a tiny all-reduce (16 float32, ``max``: latency only), the variants
    interleaved rep by rep: where the exact mode's time goes beyond the library's."""
    raw = native.mpi
    ring_mpi = raw.Dup()
    a = np.ones(16, dtype=np.float32)
    variants = {
        "raw mpi4py Allreduce": lambda: raw.Allreduce(MPI.IN_PLACE, a, op=MPI.MAX),
        "native wrapped (Comm.allreduce)": lambda: native.allreduce(a, "max", phase="tiny"),
        "exact, bare ring (collectives.ring_allreduce)":
            lambda: ring_allreduce(ring_mpi, a, "max"),
        "exact wrapped (Comm.allreduce)": lambda: exact.allreduce(a, "max", phase="tiny"),
    }

    def batch(fn):
        for _ in range(calls):
            fn()

    times = {k: [] for k in variants}
    for fn in variants.values():
        batch(fn)  # warm up (the exact communicator's Dup, the ring schedule)
    for _ in range(reps):
        for k, fn in variants.items():
            times[k].append(_median_time(lambda fn=fn: batch(fn), raw, 1) / calls)
    ring_mpi.Free()
    if raw.Get_rank() == 0:
        base = statistics.median(times["raw mpi4py Allreduce"])
        print("\n| exact call overhead: all-reduce of 16 float32 (max) | per call (us) | vs raw |")
        print("|---|---:|---:|")
        for k, ts in times.items():
            m = statistics.median(ts)
            print(f"| {k} | {m * 1e6:.1f} | {m / base:.1f}x |")
        ratio = statistics.median(times["exact wrapped (Comm.allreduce)"]) / base
        print(f"\nexact wrapped / raw: {ratio:.2f}x (target <= 3x); load average at the end "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
