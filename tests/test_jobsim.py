"""The job simulation (substrate.jobsim): every rank's program run together on the simulated
network.  Times are checked against the cost model's closed forms (lock-step cases) and against
hand-derived schedules (drift, sharing, protocols); bytes against the ledger's wire bytes."""

import json
import math
import re

import pytest

from substrate.calls import Call, Placement, wire_bytes
from substrate.costmodel import INTER, CostModel
from substrate.jobsim import JobSim, job_steps

BETA = 1000.0                     # inter-node bytes/s: 1000 bytes take 1 s


def _cost(alpha=0.0, intra_bw=1e12, intra_lat=0.0):
    return CostModel(intra_bw=intra_bw, inter_bw=BETA, intra_lat=intra_lat, inter_lat=alpha)


def _block(label):
    return [["B", "clock", label, label, [], "compute", None], ["E"]]


def _call(algorithm, group, nbytes, **kw):
    return {"phase": "t", "algorithm": algorithm, "group": list(group), "nbytes": nbytes,
            "itemsize": kw.pop("itemsize", 4), "root": kw.pop("root", 0), "op": None, **kw}


def _charge(table):
    return lambda label, k: table.get(label)


def test_compute_only_steps_are_the_profile_charges():
    """Layer blocks cost their (label, k) charge; a clock block around them only its rest
    (never below zero); occurrences count per step."""
    prog = (["B", "clock", "fb", "fb", [], "compute", None],
            ["B", "layer", "f:a", "f:a", [], "compute", None], ["E"],
            ["B", "layer", "f:a", "f:a", [], "compute", None], ["E"],
            ["E"], *_block("opt"), ["S"])
    charges = {"fb": [5.0], "f:a": [1.0, 2.0], "opt": [0.5]}
    sim = JobSim([list(prog) * 3], [0], _cost(), [lambda lab, k: charges[lab][k]])
    # fb 5 = its layers 1 + 2 and a rest of 2; then opt 0.5: 5.5 a step
    assert job_steps(sim.run()) == pytest.approx([5.5, 5.5, 5.5])
    charges["fb"] = [1.0]       # a block shorter than its layers adds nothing
    sim = JobSim([list(prog)], [0], _cost(), [lambda lab, k: charges[lab][k]])
    assert job_steps(sim.run()) == pytest.approx([3.5])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_lock_step_ring_allreduce_is_the_cost_models_closed_form(p):
    """One rank per node, every rank at the same point: each ring step moves one chunk on every
    link at once, so the step is 2 (p-1) (α + n/p β) (CostModel.ring_allreduce_time)."""
    n = 1200 * p
    progs = [[*_block("c"), ["C", _call("allreduce", range(p), n), None, True, True, None],
              ["S"]] for _ in range(p)]
    alpha = 0.01
    sim = JobSim(progs, list(range(p)), _cost(alpha), [_charge({"c": 0.5})] * p)
    want = 0.5 + _cost(alpha).ring_allreduce_time(n, p, INTER)
    for r in range(p):
        assert job_steps(sim.run() if r == 0 else sim.steps, r) == pytest.approx([want])


def test_ring_allgather_drifts_into_a_pipelined_steady_state():
    """2 nodes x 2 ranks, ring 0-1-2-3 over two inter-node hops (1->2, 3->0), blocks of T
    seconds on those links, intra-node free, compute c.  In lock step (the first step) rank 0
    ends after c + 3T.  Then block 1 reaches rank 0 2T after rank 1 starts (hops 1->2 and
    3->0), and the link 1->2 carries three blocks a step, so the steady period is
    max(3T, c + 2T): the ranks overlap compute with the other ranks' transfers."""
    T = 1.0
    for c in (0.25, 1.0, 2.5):
        prog = [*_block("c"),
                ["C", _call("allgather", range(4), 4 * BETA * T, blocks=[BETA * T] * 4), None,
                 True, True, None], ["S"]] * 6
        sim = JobSim([prog] * 4, [0, 0, 1, 1], _cost(), [_charge({"c": c})] * 4)
        steps = job_steps(sim.run())
        assert steps[0] == pytest.approx(c + 3 * T)
        assert steps[2:] == pytest.approx([max(3 * T, c + 2 * T)] * 4)


def test_two_ranks_cannot_drift():
    """Two ranks on two nodes exchanging blocks: each step needs the other's new block, so the
    period stays c + α + T."""
    prog = [*_block("c"), ["C", _call("allgather", (0, 1), 2 * 500, blocks=[500, 500]), None,
                           True, True, None], ["S"]] * 4
    sim = JobSim([prog, prog], [0, 1], _cost(0.1), [_charge({"c": 2.0})] * 2)
    assert job_steps(sim.run()) == pytest.approx([2.6] * 4)


def _p2p(src, dst, nbytes, group, tag=7):
    return ["C", _call("p2p", group, nbytes, pairs=[[src, dst, nbytes]]), [], True, False, tag]


def test_messages_share_node_links_max_min():
    """Ranks 0 and 1 (nodes 0, 1) send 1000 bytes each to rank 2 (node 2) and rank 0 also 1000
    bytes to rank 1: node 2's downlink and node 0's uplink carry two messages each, every
    message gets half the bandwidth and arrives after α + 2 s."""
    g = (0, 1, 2)
    p0 = [_p2p(0, 2, 1000, g), _p2p(0, 1, 1000, g), ["A", [0, 1]], ["S"]]
    p1 = [_p2p(1, 2, 1000, g), ["R", 0, 1000, 7, list(g)], ["A", [0, 1]], ["S"]]
    p2 = [["R", 0, 1000, 7, list(g)], ["R", 1, 1000, 7, list(g)], ["A", [0, 1]], ["S"]]
    sim = JobSim([p0, p1, p2], [0, 1, 2], _cost(0.05), [_charge({})] * 3)
    b = sim.run()
    assert b[0] == pytest.approx([0.0])                      # eager sends complete at once
    assert b[1] == pytest.approx([2.05]) and b[2] == pytest.approx([2.05])
    # one connection per pair: two messages 0 -> 2 move one after the other
    p0 = [_p2p(0, 2, 1000, g), _p2p(0, 2, 1000, g), ["A", [0, 1]], ["S"]]
    p2 = [["R", 0, 1000, 7, list(g)], ["R", 0, 1000, 7, list(g)], ["A", [0, 1]], ["S"]]
    sim = JobSim([p0, [["S"]], p2], [0, 1, 2], _cost(0.05), [_charge({})] * 3)
    assert sim.run()[2] == pytest.approx([2.05])


def test_rendezvous_waits_for_the_receive():
    """Above the eager limit the data leaves once the receive is posted, after a handshake
    latency, and the send completes when it has arrived."""
    g = (0, 1)
    p0 = [_p2p(0, 1, 1000, g), ["A", [0]], ["S"]]
    p1 = [*_block("late"), ["R", 0, 1000, 7, list(g)], ["A", [2]], ["S"]]
    # eager: arrived at α + 1 s, long before the receive; rendezvous: 3 + α + α + 1
    for limit, sender, receiver in ((math.inf, 0.0, 3.0), (100, 4.2, 4.2)):
        sim = JobSim([p0, p1], [0, 1], _cost(0.1), [_charge({}), _charge({"late": 3.0})],
                     eager_limit=limit)
        b = sim.run()
        assert (b[0], b[1]) == (pytest.approx([sender]), pytest.approx([receiver])), limit


def test_stream_calls_overlap_compute_and_blocking_calls_drain_the_stream():
    """An all-reduce issued without waiting runs beside the next compute block; ``W`` waits
    for it.  A blocking call issued while the stream is busy starts only when it drains."""
    n = 2000                               # 2 ranks, 2 nodes: 2 x (n/2) / β = 2 s
    ar = ["C", _call("allreduce", (0, 1), n), [], True, False, None]
    prog = [*_block("bwd"), ar, *_block("more"), ["W", 2], ["S"]]
    sim = JobSim([prog, prog], [0, 1], _cost(), [_charge({"bwd": 1.0, "more": 1.5})] * 2)
    assert job_steps(sim.run()) == pytest.approx([3.0])      # 1 + max(1.5, 2)
    blocking = ["C", _call("allreduce", (0, 1), n), None, True, True, None]
    prog = [*_block("bwd"), ar, *_block("more"), blocking, ["W", 2], ["S"]]
    sim = JobSim([prog, prog], [0, 1], _cost(), [_charge({"bwd": 1.0, "more": 1.5})] * 2)
    assert job_steps(sim.run()) == pytest.approx([5.0])      # 1 + 2 (drain) + 2


def test_moved_bytes_are_the_ledgers_wire_bytes():
    """Uneven chunks, all-gather(v) blocks, a broadcast and a barrier on 2 nodes x 3 ranks (and
    a round-robin placement): the simulation moves exactly the bytes the ledger books."""
    world = tuple(range(6))
    calls = [_call("allreduce", world, 4 * 1001), _call("allgather", world, 6 * 40, blocks=[40] * 6),
             _call("allgather", world, 63, blocks=[5, 9, 13, 1, 20, 15], itemsize=1),
             _call("bcast", world, 333, root=4, itemsize=1), _call("barrier", world, 0),
             _call("allreduce", (0, 2, 4), 4 * 17)]
    for node_of in ([0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1]):
        pl = Placement(tuple(node_of))
        progs = []
        for r in world:
            progs.append([["C", d, None, r in d["group"], True, None] for d in calls] + [["S"]])
        sim = JobSim(progs, node_of, _cost(0.001, intra_bw=5e3, intra_lat=0.0005),
                     [_charge({})] * 6)
        sim.run()
        want = {"intra": 0, "inter": 0}
        for d in calls:
            w = wire_bytes(Call.from_dict(d), pl)
            want["intra"] += w["intra"]
            want["inter"] += w["inter"]
        assert sim.moved == pytest.approx(want), node_of


def test_programs_that_do_not_match_are_refused():
    g = (0, 1)
    p1 = [["R", 0, 10, 7, list(g)], ["A", [0]], ["S"]]
    with pytest.raises(RuntimeError, match=r"ranks \[1\] wait"):
        JobSim([[["S"]], p1], [0, 1], _cost(), [_charge({})] * 2).run()
    with pytest.raises(ValueError, match="one of each per rank"):
        JobSim([[["S"]]], [0, 1], _cost(), [_charge({})])
    a2a = ["C", _call("alltoallv", g, 8), None, True, True, None]
    with pytest.raises(ValueError, match="alltoallv call"):
        JobSim([[a2a], [a2a]], [0, 1], _cost(), [_charge({})] * 2).run()


# -- python -m commvol simulate: a recorded job on another network, no MPI ----------------------
def _profile(path, c=0.25, steps=5):
    """A profile of the 2 x 2 ring all-gather job of the drift test (T = 1 s at 1000 B/s)."""
    from substrate.profile import write_profile

    prog = [*_block("c"), ["C", _call("allgather", range(4), 4000, blocks=[1000] * 4), None,
                           True, True, None], ["S"]] * steps
    write_profile(path, [{"c": [{"min_s": c, "median_s": c, "count": steps}]}] * 4,
                  {"system": "test"}, programs=[prog] * 4)
    return path


def test_commvol_simulate_prints_the_steps_on_any_placement(tmp_path, capsys):
    """Node-major, the ring drifts to max(3T, c + 2T) = 3 s after the lock-step first step;
    round-robin, every hop crosses nodes and both ranks of a node send over its uplink at every
    ring step (2T a step): c + 6T, in lock step, with twice the inter-node bytes."""
    from commvol.__main__ import main

    prof = _profile(tmp_path / "p.json")
    gbps = BETA * 8 / 1e9
    common = ["simulate", "--compute-profile", str(prof), "--inter-bw", str(gbps),
              "--inter-lat", "0", "--intra-lat", "0", "--intra-bw", "1e6"]
    assert main([*common, "--node-map", "block:2", "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "steps (ms): 3250.000, 3000.000" in out and "mean step after 1 warm-up: 3000.000" in out
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["step_s"] == pytest.approx([3.25, 3, 3, 3, 3]) and a["bytes"]["inter"] == 6000 * 5
    assert main([*common, "--node-map", "round-robin:2", "--skip", "0"]) == 0
    out = capsys.readouterr().out
    assert "mean step after 0 warm-up: 6250.000" in out and "inter-node 60000" in out


@pytest.mark.parametrize("extra,message", [
    (["--node-map", "block:3"], "block:R needs R ranks per node"),
    (["--node-map", "block:2", "--skip", "5"], "hold 5 steps; pass --skip 4 or fewer"),
    (["--node-map", "block:2", "--inter-bw", "0"], "inter_bw must be > 0"),
    (["--node-map", "block:2", "--eager-limit", "-2"], "--eager-limit -2: must be >= 0"),
    (["--node-map", "block:2", "--json", "EXISTS"], "already exists; choose a new file"),
])
def test_commvol_simulate_refuses_bad_input(tmp_path, extra, message):
    from commvol.__main__ import main

    prof = _profile(tmp_path / "p.json")
    (tmp_path / "EXISTS").write_text("keep")
    extra = [str(tmp_path / x) if x == "EXISTS" else x for x in extra]
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["simulate", "--compute-profile", str(prof), *extra])
    assert (tmp_path / "EXISTS").read_text() == "keep"


def test_commvol_simulate_refuses_a_profile_without_programs(tmp_path):
    from commvol.__main__ import main
    from substrate.profile import write_profile

    write_profile(tmp_path / "old.json", [{"c": [{"min_s": 0.1, "count": 1}]}], {})
    with pytest.raises(ValueError, match="holds no programs"):
        main(["simulate", "--compute-profile", str(tmp_path / "old.json"), "--node-map", "0"])
