"""``python -m runner.probe``: topology report and ledger self-check.

Runs every wrapped call on known sizes and data, checks the numbers each rank receives, and
compares the ledger (reduced over ranks) with the volumes of the calls' records priced on the
topology's placement alone (:func:`substrate.calls.wire_bytes`: each algorithm's schedule, each
message on its link).  Prints one JSON object (rank 0) with ``"ledger_matches_model": true``
when every phase's intra/inter bytes, messages and calls agree: the topology was detected as the
ledger sees it and every collective sent what its schedule says, on any placement.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from substrate.calls import Call, Placement, messages, wire_bytes
from substrate.costmodel import INTER, INTRA
from substrate.executor import Bindings, Executor

from .errors import main_guard
from .options import add_common_args
from .run import start_run

K = 1024  # elements per rank unit: the counts below are divisible by every communicator size,
#            except probe_world_allreduce_uneven's K p + 1 (uneven ring chunks)


class _Probe(Bindings):
    """Known data for every record of :func:`_records` on this rank (what each call sends)
    and the verdict on what each call gave back, per phase."""

    def __init__(self, topo) -> None:
        self.topo = topo
        self.ok: dict[str, bool] = {}

    def buffer(self, call: Call):
        topo, ph = self.topo, call.phase
        p, r = topo.size, topo.rank
        n = K * p
        if ph == "probe_intra_allreduce":
            return np.full(n, topo.intra.rank + 1, dtype=np.float32)
        if ph == "probe_world_allreduce_max":
            return np.full(n, float(r), dtype=np.float32)
        if ph == "probe_world_allreduce_uneven":     # p does not divide n + 1: uneven chunks
            return np.full(n + 1, float(r), dtype=np.float32)
        if ph == "probe_inter_allreduce_avg":
            return np.full(n, float(topo.node), dtype=np.float64)
        if ph == "probe_inter_mask_or":
            bits = np.zeros(8 * n, dtype=bool)
            bits[topo.node::topo.num_nodes] = True   # disjoint stripes: the OR keeps them all
            return np.packbits(bits)
        if ph == "probe_inter_bucketed":             # 200 tensors packed in one bucket
            return np.concatenate([np.full(K, float(topo.node * 1000 + i), dtype=np.float32)
                                   for i in range(200)])
        if ph == "probe_world_bcast":
            return np.arange(n, dtype=np.float32) if r == 0 else np.zeros(n, np.float32)
        if ph == "probe_world_allgather":
            return np.full(K, r, dtype=np.int32)
        if ph == "probe_world_allgatherv":
            return np.full((r + 1) * K, r, dtype=np.float32)
        if ph == "probe_world_alltoallv":
            return np.repeat(np.arange(p, dtype=np.float32) + 100 * r, (np.arange(p) + 1) * K // 4)
        if ph == "probe_p2p_ring":
            return np.full(n, r, dtype=np.float32)
        if ph == "probe_barrier":
            return None
        raise ValueError(f"probe: no data for {ph!r}")

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        self._ring = np.empty(nbytes // 4, dtype=np.float32)
        return self._ring

    def received(self, call: Call, got) -> None:
        topo, ph = self.topo, call.phase
        p, r = topo.size, topo.rank
        if ph == "probe_intra_allreduce":
            P = len(call.group)
            ok = np.all(got == P * (P + 1) / 2)
        elif ph == "probe_world_allreduce_max":
            ok = np.all(got == p - 1)
        elif ph == "probe_world_allreduce_uneven":
            ok = np.all(got == p * (p - 1) / 2)
        elif ph == "probe_inter_allreduce_avg":
            ok = np.allclose(got, (len(call.group) - 1) / 2)
        elif ph == "probe_inter_mask_or":
            ok = np.all(np.unpackbits(got))
        elif ph == "probe_inter_bucketed":
            M = len(call.group)
            ok = all(np.all(t == sum(m * 1000 + i for m in range(M)))
                     for i, t in enumerate(got.reshape(200, K)))
        elif ph == "probe_world_bcast":
            ok = np.all(got == np.arange(K * p))
        elif ph == "probe_world_allgather":
            ok = np.all(got == np.arange(p)[:, None])
        elif ph == "probe_world_allgatherv":
            ok = np.all(got[0] == np.repeat(np.arange(p), (np.arange(p) + 1) * K))
        elif ph == "probe_world_alltoallv":
            out, recvcounts = got
            ok = np.all(out == np.repeat(100 * np.arange(p) + r, recvcounts))
        else:
            ok = True
        self.ok[ph] = bool(ok) and self.ok.get(ph, True)


def _exercise(run) -> dict[str, bool]:
    """Run the probe's records with known data; return per-phase numerical verdicts
    (local)."""
    pl = run.topo.placement
    bind = _Probe(run.topo)
    Executor(run).run_records(_records(pl), bind, pl)
    p, r = run.size, run.rank
    bind.ok["probe_p2p_ring"] = bool(np.all(bind._ring == (r - 1) % p)) if p > 1 else True
    bind.ok["probe_barrier"] = True
    return bind.ok


def _records(placement: Placement) -> list[Call]:
    """The records of the calls :func:`_exercise` makes on ``placement`` (a rank that is not a
    node leader does not take part in the leaders' calls)."""
    p, M = placement.size, placement.num_nodes
    f32, f64 = 4, 8
    n = K * p
    world, leaders = placement.world, placement.leaders
    out = [Call("probe_intra_allreduce", "allreduce", placement.members(m), n * f32, f32,
                op="sum") for m in range(M)]
    out += [Call("probe_world_allreduce_max", "allreduce", world, n * f32, f32, op="max"),
            Call("probe_world_allreduce_uneven", "allreduce", world, (n + 1) * f32, f32,
                 op="sum")]
    out += [Call("probe_inter_allreduce_avg", "allreduce", leaders, n * f64, f64, op="avg"),
            Call("probe_inter_mask_or", "allreduce", leaders, n, 1, op="bor"),
            Call("probe_inter_bucketed", "allreduce", leaders, 200 * K * f32, f32,
                 op="sum")]
    out += [Call("probe_world_bcast", "bcast", world, n * f32, f32),
            Call("probe_world_allgather", "allgather", world, blocks=(K * 4,) * p, itemsize=4),
            Call("probe_world_allgatherv", "allgather", world,
                 blocks=tuple(int(c) * f32 for c in (np.arange(p) + 1) * K), itemsize=f32)]
    to = (np.arange(p) + 1) * K // 4 * f32          # rank i sends (j+1) K/4 floats to every j
    out.append(Call("probe_world_alltoallv", "alltoallv", world,
                    blocks=tuple(int(v) for v in np.tile(to, p)), itemsize=f32))
    out += [Call("probe_p2p_ring", "p2p", world, pairs=[(r, (r + 1) % p, n * f32)
                                                        for r in range(p)]),
            Call("probe_barrier", "barrier", world)]
    return out


def _predicted(placement: Placement) -> dict[str, dict]:
    """Per-phase totals of the probe's records (their schedules' messages on ``placement``)."""
    out = {}
    for c in _records(placement):
        b = wire_bytes(c, placement)
        e = out.setdefault(c.phase, {"intra_bytes": 0, "inter_bytes": 0, "messages": 0,
                                     "calls": 0})
        e["intra_bytes"] += b[INTRA]
        e["inter_bytes"] += b[INTER]
        e["messages"] += messages(c)
        # a rank that sends itself its ring message makes no call (a local copy)
        e["calls"] = int(c.algorithm != "p2p" or e["messages"] > 0)
    return out


def probe(run) -> dict:
    topo = run.topo
    ok = _exercise(run)
    verdicts = run.world.mpi.allgather(ok)
    numerics = {k: all(v.get(k, True) for v in verdicts) for k in verdicts[0]}
    measured = run.ledger.totals(run.world)
    predicted = _predicted(topo.placement)
    mismatches = []
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
        "ledger_matches_model": not mismatches,
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
