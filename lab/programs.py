"""The MPI programs the lab runs on its hosts (``python -m mpi4py -m lab --idle`` etc.).

* ``--idle [--out DIR] [--sleep S]``: MPI init plus the same topology set-up as every spardist
  command, then exit: the start-up baseline every measurement subtracts (with ``--out`` rank 0
  writes a ``summary.json`` booking nothing: the lab's noise floor);
* ``--sendrecv NBYTES --out DIR [--repeat N]``: a calibration with known bytes: every rank
  ``Sendrecv``s NBYTES to the rank with the same local index on the next host, and rank 0
  writes a ``summary.json`` booking them;
* ``--pingpong --out DIR [--reps N] [--sizes 8,1048576] [--budget-s S]``: one-way time per size
  and link class (``pingpong.json``), from which the lab's alpha is taken.

The parent process never initialises MPI: mpi4py is imported inside the programs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from substrate.results import atomic_write_json

__all__ = ["PINGPONG_JSON", "PROGRAMS", "idle_main", "pingpong_main", "run_program",
           "sendrecv_main"]

PINGPONG_JSON = "pingpong.json"

def idle_main(argv: list[str]) -> int:
    """MPI init + the same topology set-up as every spardist command, then exit (the start-up
    baseline).  With ``--out DIR`` rank 0 also writes a summary.json booking nothing (a null
    measurement: the lab's noise floor)."""
    from mpi4py import MPI  # noqa: PLC0415 (the lab's parent process must not initialise MPI; only the in-lab ranks do)

    from substrate.topology import Topology  # noqa: PLC0415 (imports mpi4py: only in the in-lab ranks)

    topo = Topology.from_comm(MPI.COMM_WORLD)
    if "--sleep" in argv and topo.rank == 0:
        time.sleep(float(argv[argv.index("--sleep") + 1]))
    if "--out" in argv and topo.rank == 0:
        _write_summary(Path(argv[argv.index("--out") + 1]), "idle", topo, 0)
    return 0


def _write_summary(out: Path, method: str, topo, inter: int) -> None:

    traffic = {"inter_node_bytes": inter, "intra_node_bytes": 0, "by_phase": {}}
    atomic_write_json(out / "summary.json", {
        "system": "wirelab", "method": method, "topology": topo.describe(),
        "traffic": {"measured": traffic, "predicted": dict(traffic)}})


def sendrecv_main(argv: list[str]) -> int:
    """``--sendrecv NBYTES --out DIR``: every rank sends NBYTES to the rank with the same local
    index on the next host (``Sendrecv``), and rank 0 writes a summary.json booking them."""
    from mpi4py import MPI  # noqa: PLC0415 (the lab's parent process must not initialise MPI; only the in-lab ranks do)

    from substrate.topology import Topology  # noqa: PLC0415 (imports mpi4py: only in the in-lab ranks)

    p = argparse.ArgumentParser(prog="lab --sendrecv")
    p.add_argument("--sendrecv", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--overwrite", action="store_true", help="accepted like spardist commands")
    a = p.parse_args(argv)
    topo = Topology.from_comm(MPI.COMM_WORLD)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    node_of = topo.node_of
    m = topo.num_nodes
    members = [np.flatnonzero(node_of == k) for k in range(m)]
    dest = int(members[(topo.node + 1) % m][topo.local_rank])
    src = int(members[(topo.node - 1) % m][topo.local_rank])
    buf = np.full(a.sendrecv, rank % 251, dtype=np.uint8)
    got = np.empty_like(buf)
    world.Barrier()
    for _ in range(a.repeat):
        world.Sendrecv(buf, dest, 11, got, src, 11)
    inter = a.sendrecv * a.repeat if node_of[dest] != node_of[rank] else 0
    total = world.allreduce(inter)
    if rank == 0:
        _write_summary(a.out, "sendrecv", topo, total)
    return 0


def pingpong_main(argv: list[str]) -> int:
    """``--pingpong --out DIR [--reps N] [--sizes 8,1048576]``: world rank 0 ping-pongs messages
    of each size with the first rank of the next node (inter-node) and, when its node has
    another rank, with that rank (intra-node); every round trip is timed and rank 0 writes
    ``DIR/pingpong.json`` with the median one-way time ``RTT / 2`` per size and link class.

    ``alpha`` is the one-way time of the smallest size; ``beta`` (seconds per byte) is the
    slope between the smallest and the largest size.  Each size is timed for at most
    ``--budget-s`` seconds (at least 5 round trips), so large messages on slow links end in
    time.  The other ranks wait without spinning."""
    from mpi4py import MPI  # noqa: PLC0415 (the lab's parent process must not initialise MPI; only the in-lab ranks do)

    from substrate.topology import Topology  # noqa: PLC0415 (imports mpi4py: only in the in-lab ranks)

    p = argparse.ArgumentParser(prog="lab --pingpong")
    p.add_argument("--pingpong", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sizes", default="8,1048576")
    p.add_argument("--budget-s", type=float, default=3.0,
                   help="stop timing a size after this many seconds (at least 5 round trips)")
    p.add_argument("--overwrite", action="store_true", help="accepted like spardist commands")
    a = p.parse_args(argv)
    sizes = sorted({int(x) for x in a.sizes.split(",")})
    if len(sizes) < 1 or sizes[0] < 1 or a.reps < 1:
        raise SystemExit("--sizes needs positive byte counts and --reps >= 1")
    topo = Topology.from_comm(MPI.COMM_WORLD)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    node_of = np.asarray(topo.node_of)
    peers = {}
    others = np.flatnonzero(node_of != node_of[0])
    if others.size:
        peers["inter"] = int(others[0])
    same = np.flatnonzero((node_of == node_of[0]) & (np.arange(node_of.size) != 0))
    if same.size:
        peers["intra"] = int(same[0])
    def quiet_barrier() -> None:
        # ranks outside the pair wait without spinning: on oversubscribed cores a rank busy-polling
        # in MPI_Barrier steals the CPU the timed pair needs
        req = world.Ibarrier()
        while not req.Test():
            time.sleep(0.002)

    result = {}
    for link, peer in peers.items():
        quiet_barrier()
        if rank not in (0, peer):
            continue
        other = peer if rank == 0 else 0
        per_size = {}
        for n in sizes:
            buf = np.zeros(n, dtype=np.uint8)
            times = []
            start = MPI.Wtime()
            for i in range(a.warmup + a.reps):
                # both ends stop together: rank 0 decides and tells its partner in the ping
                stop = rank == 0 and len(times) >= 5 and MPI.Wtime() - start > a.budget_s
                if rank == 0:
                    buf[:1] = 1 if stop else 0
                t0 = MPI.Wtime()
                if rank == 0:
                    world.Send(buf, other, 21)
                    world.Recv(buf, other, 21)
                else:
                    world.Recv(buf, other, 21)
                    world.Send(buf, other, 21)
                if buf[0]:
                    break                           # the stop round trip is not timed
                if i >= a.warmup or n > 65536:      # big messages: no separate warm-up
                    times.append(MPI.Wtime() - t0)
            one_way = np.asarray(times) / 2
            per_size[str(n)] = {"round_trips": len(times), "median_s": float(np.median(one_way)),
                                "p10_s": float(np.percentile(one_way, 10)),
                                "p90_s": float(np.percentile(one_way, 90))}
        lo, hi = str(sizes[0]), str(sizes[-1])
        alpha = per_size[lo]["median_s"]
        beta = ((per_size[hi]["median_s"] - alpha) / (sizes[-1] - sizes[0])
                if len(sizes) > 1 else None)
        result[link] = {"peer": peer, "sizes": per_size, "alpha_s": alpha, "beta_s_per_byte": beta,
                        "bandwidth_gbps": (8e-9 / beta) if beta and beta > 0 else None}
    quiet_barrier()
    if rank == 0:
        atomic_write_json(a.out / PINGPONG_JSON, {
            "method": "MPI Send/Recv ping-pong, one-way = RTT/2, median over reps",
            "reps": a.reps, "warmup": a.warmup, "sizes": sizes,
            "topology": topo.describe(), "links": result})
    return 0


#: the first argument that selects each program
PROGRAMS = {"--idle": idle_main, "--sendrecv": sendrecv_main, "--pingpong": pingpong_main}


def run_program(argv: list[str]) -> int | None:
    """Run the program ``argv[0]`` selects (:data:`PROGRAMS`); ``None`` when it selects none."""
    prog = PROGRAMS.get(argv[0]) if argv else None
    return None if prog is None else prog(argv)
