"""``python -m runner.probe``: topology report and ledger self-check.

Runs every wrapped call on known sizes and data, checks the numbers each rank receives, and
compares the ledger (reduced over ranks) with the closed-form volumes of
:mod:`substrate.costmodel` computed from the topology alone.  Prints one JSON object (rank 0) with
``"ledger_matches_model": true`` when every phase's intra/inter bytes, messages and calls agree.
The closed forms assume a node-major layout (ranks of a node are consecutive), which virtual nodes
always have; on a real allocation with another placement the comparison is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from substrate import costmodel as cm
from substrate.comm import bucketed_allreduce

from .errors import main_guard
from .options import add_common_args
from .run import start_run

K = 1024  # elements per rank unit: the counts below are divisible by every communicator size,
#            except probe_world_allreduce_uneven's K p + 1 (uneven ring chunks)


def _exercise(run) -> dict[str, bool]:
    """Run each wrapped call; return per-phase numerical verdicts (local)."""
    topo, w = run.topo, run.world
    p, r = w.size, w.rank
    ok: dict[str, bool] = {}

    n = K * p
    a = np.full(n, topo.intra.rank + 1, dtype=np.float32)
    topo.intra.allreduce(a, "sum", phase="probe_intra_allreduce")
    P = topo.intra.size
    ok["probe_intra_allreduce"] = bool(np.all(a == P * (P + 1) / 2))

    a = np.full(n, float(r), dtype=np.float32)
    w.allreduce(a, "max", phase="probe_world_allreduce_max")
    ok["probe_world_allreduce_max"] = bool(np.all(a == p - 1))

    a = np.full(n + 1, float(r), dtype=np.float32)  # p does not divide n + 1: uneven chunks
    w.allreduce(a, "sum", phase="probe_world_allreduce_uneven")
    ok["probe_world_allreduce_uneven"] = bool(np.all(a == p * (p - 1) / 2))

    if topo.inter is not None:
        M = topo.inter.size
        a = np.full(n, float(topo.node), dtype=np.float64)
        topo.inter.allreduce(a, "avg", phase="probe_inter_allreduce_avg")
        ok["probe_inter_allreduce_avg"] = bool(np.allclose(a, (M - 1) / 2))
        bits = np.zeros(8 * n, dtype=bool)
        bits[topo.node::M] = True  # each node keeps a disjoint stripe; the OR keeps them all
        packed = np.packbits(bits)
        topo.inter.allreduce(packed, "bor", phase="probe_inter_mask_or")
        ok["probe_inter_mask_or"] = bool(np.all(np.unpackbits(packed)))
        ts = [np.full(K, float(topo.node * 1000 + i), dtype=np.float32) for i in range(200)]
        bucketed_allreduce(ts, topo.inter, phase="probe_inter_bucketed")
        ok["probe_inter_bucketed"] = all(
            np.all(t == sum(m * 1000 + i for m in range(M))) for i, t in enumerate(ts))

    a = np.arange(n, dtype=np.float32) if r == 0 else np.zeros(n, dtype=np.float32)
    w.bcast(a, 0, phase="probe_world_bcast")
    ok["probe_world_bcast"] = bool(np.all(a == np.arange(n)))

    g = w.allgather(np.full(K, r, dtype=np.int32), phase="probe_world_allgather").result
    ok["probe_world_allgather"] = bool(np.all(g == np.arange(p)[:, None]))

    counts = (np.arange(p) + 1) * K
    gv, _ = w.allgatherv(np.full(counts[r], r, dtype=np.float32), counts,
                         phase="probe_world_allgatherv").result
    ok["probe_world_allgatherv"] = bool(np.all(gv == np.repeat(np.arange(p), counts)))

    sendcounts = (np.arange(p) + 1) * K // 4
    send = np.repeat(np.arange(p, dtype=np.float32) + 100 * r, sendcounts)
    recvcounts = np.full(p, sendcounts[r])
    got, _ = w.alltoallv(send, sendcounts, recvcounts, phase="probe_world_alltoallv").result
    ok["probe_world_alltoallv"] = bool(np.all(got == np.repeat(100 * np.arange(p) + r,
                                                               recvcounts)))

    src = np.full(n, r, dtype=np.float32)
    dst = np.empty_like(src)
    reqs = [w.irecv(dst, (r - 1) % p, phase="probe_p2p_ring"),
            w.isend(src, (r + 1) % p, phase="probe_p2p_ring")]
    w.waitall(reqs)
    ok["probe_p2p_ring"] = bool(np.all(dst == (r - 1) % p))

    w.barrier(phase="probe_barrier")
    ok["probe_barrier"] = True
    return ok


def _predicted(M: int, P: int) -> dict[str, dict]:
    """Closed-form per-phase totals for the probe's calls on ``M`` nodes × ``P`` ranks."""
    p = M * P
    f32, f64 = 4, 8
    n = K * p
    world_inter_links = M if M > 1 else 0

    def entry(bytes_by_link, messages, calls=1):
        return {"intra_bytes": int(bytes_by_link[cm.INTRA]),
                "inter_bytes": int(bytes_by_link[cm.INTER]), "messages": int(messages),
                "calls": calls}

    def ring_msgs(q):
        return 2 * (q - 1) * q

    out = {}
    intra = cm.ring_allreduce_wire_bytes(n * f32, P, 0, f32)
    out["probe_intra_allreduce"] = entry({k: M * v for k, v in intra.items()}, M * ring_msgs(P))
    out["probe_world_allreduce_max"] = entry(
        cm.ring_allreduce_wire_bytes(n * f32, p, world_inter_links, f32), ring_msgs(p))
    out["probe_world_allreduce_uneven"] = entry(
        cm.ring_allreduce_wire_bytes((n + 1) * f32, p, world_inter_links, f32), ring_msgs(p))
    out["probe_inter_allreduce_avg"] = entry(cm.ring_allreduce_wire_bytes(n * f64, M, M, f64),
                                             ring_msgs(M))
    out["probe_inter_mask_or"] = entry(cm.ring_allreduce_wire_bytes(n, M, M, 1), ring_msgs(M))
    out["probe_inter_bucketed"] = entry(cm.ring_allreduce_wire_bytes(200 * K * f32, M, M, f32),
                                        ring_msgs(M))
    out["probe_world_bcast"] = entry(cm.bcast_wire_bytes(n * f32, M, P), p - 1)
    out["probe_world_allgather"] = entry(
        cm.ring_allgather_wire_bytes(K * 4, p, world_inter_links), (p - 1) * p)
    # all-gatherv: link i carries N - b_{i+1}; the node-crossing links are i = mP - 1
    b = (np.arange(p) + 1) * K * f32
    total = (p - 1) * int(b.sum())
    cross = sum(int(b.sum() - b[(m * P) % p]) for m in range(1, M + 1)) if M > 1 else 0
    out["probe_world_allgatherv"] = entry({cm.INTRA: total - cross, cm.INTER: cross},
                                          (p - 1) * p)
    # all-to-allv: rank i sends (j+1) K/4 floats to every j != i
    node = np.arange(p) // P
    to = (np.arange(p) + 1) * K // 4 * f32
    inter = sum(int(to[j]) for i in range(p) for j in range(p) if node[i] != node[j])
    allb = sum(int(to[j]) for i in range(p) for j in range(p) if i != j)
    out["probe_world_alltoallv"] = entry({cm.INTRA: allb - inter, cm.INTER: inter},
                                         p * (p - 1))
    out["probe_p2p_ring"] = entry({cm.INTRA: (p - world_inter_links) * n * f32 if p > 1 else 0,
                                   cm.INTER: world_inter_links * n * f32}, p if p > 1 else 0)
    out["probe_barrier"] = entry({cm.INTRA: 0, cm.INTER: 0}, p * cm.binomial_depth(p))
    if M == 1:  # one node: the leaders' communicator has one rank and moves nothing
        for k in ("probe_inter_allreduce_avg", "probe_inter_mask_or", "probe_inter_bucketed"):
            out[k] = entry({cm.INTRA: 0, cm.INTER: 0}, 0)
    return out


def probe(run) -> dict:
    topo = run.topo
    ok = _exercise(run)
    verdicts = run.world.mpi.allgather(ok)
    numerics = {k: all(v.get(k, True) for v in verdicts) for k in verdicts[0]}
    measured = run.ledger.totals(run.world)
    node_major = bool(np.array_equal(topo.node_of,
                                     np.arange(topo.size) // topo.ranks_per_node))
    predicted = _predicted(topo.num_nodes, topo.ranks_per_node)
    mismatches = []
    if node_major:
        for phase, pred in predicted.items():
            got = measured["by_phase"].get(phase, {})
            for field, want in pred.items():
                have = got.get(field, 0)
                if have != want:
                    mismatches.append({"phase": phase, "field": field, "measured": have,
                                       "predicted": want})
    return {
        "topology": topo.describe(),
        "collectives_correct": all(numerics.values()),
        "numerics": numerics,
        "ledger_matches_model": (not mismatches) if node_major else None,
        "mismatches": mismatches,
        "traffic": {"inter_node_bytes": measured["inter_node_bytes"],
                    "intra_node_bytes": measured["intra_node_bytes"],
                    "messages": measured["messages"],
                    "predicted_inter_node_bytes": sum(v["inter_bytes"]
                                                      for v in predicted.values()),
                    "predicted_intra_node_bytes": sum(v["intra_bytes"]
                                                      for v in predicted.values())},
        "modeled_comm_s": max(run.world.mpi.allgather(run.ledger.modeled_s)),
        "cost_model": run.cost.describe(),
    }, measured, predicted


@main_guard
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    run = start_run(args, system="substrate", method="probe")
    report, _measured, predicted = probe(run)
    pred_block = {"inter_node_bytes": report["traffic"]["predicted_inter_node_bytes"],
                  "intra_node_bytes": report["traffic"]["predicted_intra_node_bytes"],
                  "by_phase": predicted}
    run.finish(metrics={"collectives_correct": report["collectives_correct"],
                        "ledger_matches_model": report["ledger_matches_model"]},
               predicted=pred_block)
    if run.rank == 0:
        print(json.dumps(report, indent=2))
    ok = report["collectives_correct"] and report["ledger_matches_model"] is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
