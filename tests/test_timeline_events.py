"""Every system declares its communication on the timeline (issue 12, what-to-build 1).

Each test trains a system for a few steps under MPI with this file as the launcher
(``python -m mpi4py tests/test_timeline_events.py OUT MODULE ARGS...``): it wraps
:meth:`substrate.clock.SimClock.step` (and :meth:`runner.run.Run.finish`, for the
communication after the last step) to record, per rank and step, before the step is closed:

* per phase, the payload bytes and the α–β seconds the ledger booked (:meth:`Ledger.since`) and
  those of the declared transfers (each call's record, priced for the timeline by
  :func:`substrate.calls.event_parts` independently of the ledger's
  :func:`substrate.calls.rank_seconds`);
* the scheduled step: critical path, no-overlap sum, compute, offload and each link's busy
  time.

The test side then checks (a) nothing is undeclared, (b) declared bytes and seconds equal the
booked ones per phase (a rank that waits for its node leader's inter-node phase declares it
without booking it: the leader's booking is the reference), (c) ``max(compute, offload, busiest
link) <= step <= no-overlap sum``, and (d) for DDP and SSFusion with two or more buffers, the
step is strictly below the no-overlap sum.  Compute is timed by the ``flops`` source (the model's
FLOP counts; deterministic); blocks without a count fall back to CPU time, which only moves the
bounds of (c).
"""

from __future__ import annotations

import json
import math
import sys

import pytest

if __name__ != "__main__":  # the test side (the MPI side needs neither)
    from mpi_helpers import read_summary, run_mpi

TOL = 1e-9


# -- the MPI side ----------------------------------------------------------------------------------

def _ledger_terms(call, rank: int) -> float:
    """Payload bytes of ``call`` on ``rank`` in the ledger's terms (its own buffer)."""
    if call.algorithm == "barrier":
        return 0.0
    if call.algorithm == "allgather":
        return float(call.blocks[call.group.index(rank)]) if rank in call.group else \
            float(call.nbytes) / call.size
    if call.algorithm == "p2p":
        return float(call.pairs[call.pairs[:, 0] == rank, 2].sum())
    return float(call.nbytes)


def _main(argv) -> None:
    """``OUT MODULE ARGS...``: run ``python -m MODULE ARGS`` with the probes installed and write
    every rank's records to ``OUT`` (rank 0, JSON)."""
    import importlib

    from mpi4py import MPI

    from runner.run import Run
    from substrate.calls import event_parts
    from substrate.clock import SimClock
    from substrate.recorder import Recorder

    out, module, args = argv[0], argv[1], argv[2:]
    records: list = []
    where: dict = {}
    declare, step, finish = Recorder.declare, SimClock.step, Run.finish
    open_step: dict = {"declared": {}, "shares": {}, "messages": [], "snap": {}}

    def probed_declare(self, call, after=None, member=True, **kw):
        ev = declare(self, call, after, member, **kw)
        if self.timeline is not None:
            parts = event_parts(call, self.cost, self.placement, self.rank)
            d = open_step["declared"].setdefault(call.phase, [0.0, 0.0])
            d[0] += _ledger_terms(call, self.rank)
            # in the ledger's terms: a transfer sharing its node's link with `share` ranks
            # books its own bytes at the full rate
            d[1] += sum(lat + work for _, lat, work, _, _, _ in parts)
            for link, _, _, share, _, _ in parts:
                key = f"{call.phase}:{link}"
                have = open_step["shares"].setdefault(key, [])
                if share not in have:
                    have.append(share)
            if call.algorithm == "p2p":
                open_step["messages"].append([call.phase, kw.get("tag"), call.pairs.tolist(),
                                              [(link, share) for link, _, _, share, _, _
                                               in parts]])
        return ev

    def probe(clock) -> dict:
        booked = {ph: [e["payload_bytes"], e["modeled_s"], e["calls"]]
                  for ph, e in clock.ledger.since(open_step["snap"]).items()}
        rec = {"declared": open_step["declared"], "booked": booked,
               "shares": open_step["shares"], "messages": open_step["messages"]}
        open_step.update(declared={}, shares={}, messages=[], snap=clock.ledger.snapshot())
        return rec

    def probed_step(self):
        rec = probe(self) if self.timeline is not None else {}
        timing = step(self)
        records.append({**rec, **_timing(timing)})
        return timing

    def probed_finish(self, *a, **kw):
        if self.clock.timeline is not None and self.clock.timeline.open_events:
            rec = probe(self.clock)
            rec.update(_timing(self.clock.timeline.schedule()), final=True)
            records.append(rec)
        where.update(node=self.topo.node, leader=bool(self.topo.is_leader))
        return finish(self, *a, **kw)

    Recorder.declare, SimClock.step, Run.finish = probed_declare, probed_step, probed_finish
    main = importlib.import_module({"dataparallel": "dataparallel.train",
                                    "hsadmm": "hsadmm.train",
                                    "sparse_sgd": "sparse_sgd.cli"}[module]).main
    main(args)
    gathered = MPI.COMM_WORLD.gather({**where, "records": records}, root=0)
    if MPI.COMM_WORLD.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def _timing(t) -> dict:
    return {"step_s": t.step_s, "no_overlap_s": t.no_overlap_s, "compute_s": t.compute_s,
            "offload_s": t.offload_s, "busy_s": max(t.comm_busy_s.values(), default=0.0),
            "transfers": sum(1 for e in t.events if e.kind == "transfer")}


# -- the test side ---------------------------------------------------------------------------------

def _run(tmp_path, n, module, *args, timeout=300):

    out = tmp_path / "records.json"
    run_mpi(__file__, n, out, module, *args, "--out", tmp_path / "run",
            "--compute-source", "flops", "--device-tflops", 1.0, timeout=timeout)
    return json.loads(out.read_text())


def _check(ranks, *, strict=False, chain: bool = False, min_steps: int = 1) -> None:
    """(a)-(c) for every rank and step, (d) when ``strict`` (``True``: every step; a phase
    name: the steps that declare it); ``chain``: every event waits for the previous one, so
    the critical path is the no-overlap sum."""
    leaders = {r["node"]: r for r in ranks if r["leader"]}
    for rank, r in enumerate(ranks):
        steps = [s for s in r["records"] if not s.get("final")]
        assert len(steps) >= min_steps, (rank, len(steps))
        for i, s in enumerate(r["records"]):
            where = f"rank {rank} step {i}"
            # (a) everything the ledger booked was declared
            for phase, (_, seconds, _) in s["booked"].items():
                assert seconds == 0 or phase in s["declared"], (where, phase, "undeclared")
            # (b) declared bytes and seconds per phase equal the booked ones
            for phase, (nbytes, seconds) in s["declared"].items():
                if phase in s["booked"]:
                    want_b, want_s, _ = s["booked"][phase]
                else:  # a follower waits for its leader's phase: the leader booked it
                    assert not r["leader"], (where, phase, "declared, never booked")
                    want_b, want_s, _ = leaders[r["node"]]["records"][i]["booked"][phase]
                assert nbytes == want_b, (where, phase, nbytes, want_b)
                assert math.isclose(seconds, want_s, rel_tol=1e-9, abs_tol=1e-15), \
                    (where, phase, seconds, want_s)
            # (c) the critical path lies between the busiest resource and the serial sum
            lower = max(s["compute_s"], s["offload_s"], s["busy_s"])
            assert lower <= s["step_s"] * (1 + TOL) + 1e-15, (where, s)
            assert s["step_s"] <= s["no_overlap_s"] * (1 + TOL) + 1e-15, (where, s)
            # (d) overlap strictly shortens a step with two or more transfers in flight
            overlapped = strict is True or strict in s["declared"]
            if overlapped and not s.get("final") and s["transfers"] >= 2:
                assert s["step_s"] < s["no_overlap_s"] * (1 - 1e-6), (where, s)
            if chain and not s.get("final"):
                assert math.isclose(s["step_s"], s["no_overlap_s"], rel_tol=1e-9), (where, s)


DP = ("--steps", 3, "--eval-every", 3, "--batch-size", 8)


@pytest.mark.parametrize("n,R,allreduce", [(6, 3, "ring"), (4, 2, "hierarchical")])
def test_ddp_buckets_are_declared_and_overlap(tmp_path, n, R, allreduce):
    ranks = _run(tmp_path, n, "dataparallel", "train", "--method", "ddp", *DP,
                 "--bucket-mib", 0.005, "--allreduce", allreduce, "--ranks-per-node", R)
    _check(ranks, strict=True, min_steps=3)


@pytest.mark.parametrize("n,R,extra", [
    (6, 3, ("--fusion", "selective")),
    (4, 2, ("--fusion", "per-tensor", "--fusion-policy", "count")),
    (3, 1, ("--fusion", "multi-tensor", "--fusion-policy", "count")),
    (4, 2, ("--fusion", "selective", "--offload", "--profile-steps", 2, "--steps", 4)),
])
def test_ssfusion_buffers_are_declared_and_overlap(tmp_path, n, R, extra):
    ranks = _run(tmp_path, n, "dataparallel", "train", "--method", "ssfusion", *DP,
                 "--fusion-policy", "count", "--buffers", 3, "--profile-steps", 1, *extra,
                 "--ranks-per-node", R)
    # sparse steps: buffer i's collectives overlap buffer i+1's sparsification (the warm-up
    # all-reduces follow the profiling of the whole gradient: nothing left to overlap)
    _check(ranks, strict="ssf_sparse_allgather", min_steps=3)
    assert any("ssf_sparse_allgather" in s["declared"] for r in ranks for s in r["records"])
    guard = read_summary(tmp_path / "run")["metrics"].get("offload_guard")
    if guard is not None and guard["enabled"]:
        # SSFusion-O declares its worker's sparsification on the offload stream
        assert any(s["offload_s"] > 0 for r in ranks for s in r["records"])


@pytest.mark.parametrize("n,R,extra,phase", [
    (6, 3, ("--warmup-steps", 1, "--stable-window", 1, "--prune-score", "grasp"),
     "packed_allreduce"),
    (4, 2, ("--ternary", "--warmup-steps", 0, "--stable-window", 0), "ternary_allgather"),
])
def test_pactrain_buckets_are_declared_and_overlap(tmp_path, n, R, extra, phase):
    """Dense, packed and ternary calls per bucket after its gradients (GraSP's all-reduces in
    the pruning step, blocking; with --warmup-steps 0 in the constructor, before the first
    step's calls): the packed / ternary buckets overlap the backward."""
    ranks = _run(tmp_path, n, "dataparallel", "train", "--method", "pactrain", *DP,
                 "--bucket-mib", 0.02, *extra, "--ranks-per-node", R)
    _check(ranks, strict=phase, min_steps=3)
    steps = [s for r in ranks for s in r["records"] if not s.get("final")]
    assert any(phase in s["declared"] for s in steps)
    # GraSP's scores (grasp, or the default grasp-abs) prune in the first step on every rank
    assert all(["grasp_allreduce" in s["declared"] for s in r["records"][:2]] == [True, False]
               for r in ranks)


@pytest.mark.parametrize("n,R,extra,strict", [
    (6, 3, ("--coverage", "2/3"), "sdp_gated_allreduce"),
    (4, 2, ("--model", "resnet", "--sdp-mode", "block-backward", "--active-blocks", "2/3"),
     False),
])
def test_sdp_holder_groups_are_declared(tmp_path, n, R, extra, strict):
    """The gated all-reduces on the holder groups' sub-communicators (the first, the world's
    ring of the unmasked coordinates, overlaps the backward of the first layer), B_b-SDP's
    broadcasts after the update, the assembly's messages at the evaluation."""
    ranks = _run(tmp_path, n, "dataparallel", "train", "--method", "sdp", *DP, *extra,
                 "--ranks-per-node", R)
    _check(ranks, strict=strict, min_steps=3)
    steps = [s for r in ranks for s in r["records"] if not s.get("final")]
    assert all("sdp_gated_allreduce" in s["declared"] for s in steps)
    if "block-backward" in extra:
        assert any("sdp_param_bcast" in s["declared"] for s in steps)
    else:  # the evaluation after step 3 assembles the model on rank 0
        assert any("sdp_assemble" in s["declared"] for s in steps)


@pytest.mark.parametrize("n,R,method", [(6, 3, "hsadmm"), (3, 1, "hsadmm"),
                                        (4, 2, "flat-admm")])
def test_admm_phases_are_declared_as_a_chain(tmp_path, n, R, method):
    ranks = _run(tmp_path, n, "hsadmm", "train", "--method", method, "--iters", 2,
                 "--local-steps", 2, "--batch-size", 8, "--bucket-mib", 0.002,
                 "--ranks-per-node", R)
    _check(ranks, chain=True, min_steps=2)
    # the compact inter-node buffer went out in more than one bucket on some iteration
    assert method != "hsadmm" or any(s["declared"].get("inter_allreduce", [0])[0] > 0
                                     for r in ranks for s in r["records"])


@pytest.mark.parametrize("n,R,partition", [(6, 3, "hypergraph"), (3, 1, "random")])
def test_spff_spbp_messages_are_declared_per_peer(tmp_path, n, R, partition):
    ranks = _run(tmp_path, n, "sparse_sgd", "train", "--neurons", 1024, "--layers", 4,
                 "--partition", partition, "--steps", 3, "--batch-size", 8,
                 "--ranks-per-node", R)
    _check(ranks, min_steps=3)
    steps = [s for r in ranks for s in r["records"] if not s.get("final")]
    assert all({"spff", "spbp"} <= set(s["declared"]) for s in steps)
    # a layer's exchange ends when its busiest node link does: every sender's inter-node
    # messages carry share = busiest / its own inter-node bytes (R, the one-NIC rule, when the
    # node's senders send alike), counted here from the messages all ranks sent in the step;
    # intra-node messages do not share
    for ph in ("spff", "spbp"):
        assert all(s["shares"].get(f"{ph}:intra", [1]) == [1] for s in steps)
        assert any(f"{ph}:inter" in s["shares"] for s in steps) == (n > R)
    node = [rank // R for rank in range(n)]
    checked = 0
    for i in range(min(len([s for s in r["records"] if not s.get("final")]) for r in ranks)):
        exchanges: dict = {}
        for r in ranks:
            for ph, tag, pairs, parts in r["records"][i]["messages"]:
                if ph in ("spff", "spbp"):
                    exchanges.setdefault((ph, tag), []).append((pairs, parts))
        for msgs in exchanges.values():
            up, down, own = {}, {}, {}
            for pairs, _ in msgs:
                for src, dst, b in pairs:
                    if node[src] != node[dst] and b:
                        up[node[src]] = up.get(node[src], 0) + b
                        down[node[dst]] = down.get(node[dst], 0) + b
                        own[src] = own.get(src, 0) + b
            for pairs, parts in msgs:
                for (src, _, _), (link, share) in zip(pairs, parts):
                    if link == "inter":
                        busiest = max([*up.values(), *down.values()])
                        assert share == pytest.approx(max(1.0, busiest / own[src])), \
                            (i, pairs, share, busiest, own[src])
                        checked += 1
    assert (checked > 0) == (n > R)
    # the non-blocking messages overlap the local products on some rank and step
    assert any(s["step_s"] < s["no_overlap_s"] * (1 - 1e-9) for s in steps)
    # the held-out evaluation after the last step declares its SpFF messages too
    assert all("eval" in r["records"][-1]["declared"] for r in ranks)


if __name__ == "__main__":
    _main(sys.argv[1:])
