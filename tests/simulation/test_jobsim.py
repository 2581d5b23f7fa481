"""The job simulation (simulation.jobsim): every rank's program run together on the simulated
network.  Times are checked against the cost model's closed forms (lock-step cases) and against
hand-derived schedules (drift, sharing, protocols); bytes against the ledger's wire bytes."""

import json
import math
import re

import pytest

from simulation.jobsim import JobSim, job_steps
from substrate.calls import Call, Placement, wire_bytes
from substrate.costmodel import INTER, CostModel

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
    """``link_sharing="fair"``: ranks 0 and 1 (nodes 0, 1) send 1000 bytes each to rank 2
    (node 2) and rank 0 also 1000 bytes to rank 1: node 2's downlink and node 0's uplink carry
    two messages each, every message gets half the bandwidth and arrives after α + 2 s."""
    g = (0, 1, 2)
    p0 = [_p2p(0, 2, 1000, g), _p2p(0, 1, 1000, g), ["A", [0, 1]], ["S"]]
    p1 = [_p2p(1, 2, 1000, g), ["R", 0, 1000, 7, list(g)], ["A", [0, 1]], ["S"]]
    p2 = [["R", 0, 1000, 7, list(g)], ["R", 1, 1000, 7, list(g)], ["A", [0, 1]], ["S"]]
    sim = JobSim([p0, p1, p2], [0, 1, 2], _cost(0.05), [_charge({})] * 3, link_sharing="fair")
    b = sim.run()
    assert b[0] == pytest.approx([0.0])                      # eager sends complete at once
    assert b[1] == pytest.approx([2.05]) and b[2] == pytest.approx([2.05])
    # one connection per pair: two messages 0 -> 2 move one after the other
    p0 = [_p2p(0, 2, 1000, g), _p2p(0, 2, 1000, g), ["A", [0, 1]], ["S"]]
    p2 = [["R", 0, 1000, 7, list(g)], ["R", 0, 1000, 7, list(g)], ["A", [0, 1]], ["S"]]
    sim = JobSim([p0, [["S"]], p2], [0, 1, 2], _cost(0.05), [_charge({})] * 3,
                 link_sharing="fair")
    assert sim.run()[2] == pytest.approx([2.05])


def test_fifo_uplink_sends_one_message_at_a_time_in_arrival_order():
    """Ranks 0 and 1 share node 0 and post 1000 and 3000 bytes to ranks 2 and 3 (node 1) at
    once, rank 0 first.  A FIFO uplink sends rank 0's message whole first: rank 2 has it at
    α + 1 s, rank 3 at α + 4 s.  Max-min fair: both move at β/2 until 2 s, so α + 2 s and
    α + 4 s."""
    g = (0, 1, 2, 3)
    progs = [[_p2p(0, 2, 1000, g), ["A", [0]], ["S"]], [_p2p(1, 3, 3000, g), ["A", [0]], ["S"]],
             [["R", 0, 1000, 7, list(g)], ["A", [0]], ["S"]],
             [["R", 1, 3000, 7, list(g)], ["A", [0]], ["S"]]]
    for sharing, want2 in (("fifo", 1.05), ("fair", 2.05)):
        b = JobSim(progs, [0, 0, 1, 1], _cost(0.05), [_charge({})] * 4,
                   link_sharing=sharing).run()
        assert (b[2], b[3]) == (pytest.approx([want2]), pytest.approx([4.05])), sharing


def test_fifo_downlink_delivers_behind_the_bytes_waiting_there():
    """Node 0 sends a (2000 bytes to node 2), then b (2000 bytes to node 3); node 1 sends c
    (1000 bytes to node 2).  FIFO: a and c both reach node 2's downlink at β for 1 s, so 1000
    bytes wait there when c's last byte arrives (c: 1 + 1 = 2 s); a's last byte arrives at 2 s
    behind the same 1000 bytes (3 s); b moves 2-4 s on idle links (4 s).  Max-min fair: a, b
    and c all move at β/2; c ends at 2 s, then a and b share node 0's uplink: both at 4 s."""
    g = (0, 1, 2, 3)
    progs = [[_p2p(0, 2, 2000, g), _p2p(0, 3, 2000, g), ["A", [0, 1]], ["S"]],
             [_p2p(1, 2, 1000, g), ["A", [0]], ["S"]],
             [["R", 0, 2000, 7, list(g)], ["A", [0]], ["R", 1, 1000, 7, list(g)], ["A", [2]],
              ["S"]],
             [["R", 0, 2000, 7, list(g)], ["A", [0]], ["S"]]]
    progs_c_first = [progs[0], progs[1], [progs[2][2], progs[2][3], progs[2][0], ["A", [2]],
                                          ["S"]], progs[3]]
    for sharing, a, b in (("fifo", 3.0, 4.0), ("fair", 4.0, 4.0)):
        sim = JobSim(progs, [0, 1, 2, 3], _cost(), [_charge({})] * 4, link_sharing=sharing)
        t = sim.run()
        assert (t[2], t[3]) == (pytest.approx([a]), pytest.approx([b])), sharing
        t = JobSim(progs_c_first, [0, 1, 2, 3], _cost(), [_charge({})] * 4,
                   link_sharing=sharing).run()
        assert t[2] == pytest.approx([a]), sharing       # c (2 s) is in before a either way
        assert sim.moved == {"intra": 0.0, "inter": 5000.0}
    with pytest.raises(ValueError, match="link_sharing 'wfq' is not one of fifo, fair"):
        JobSim(progs, [0, 1, 2, 3], _cost(), [_charge({})] * 4, link_sharing="wfq")


@pytest.mark.parametrize("sharing", ["fifo", "fair"])
def test_acknowledgements_slow_a_link_only_where_its_reverse_carries_data(sharing):
    """``ack_overhead`` h: a message's arrival sends h x its bytes back.  Ranks 0 and 1 (two
    nodes) swap 1000 bytes twice: the first swap ends at 1 s, then each uplink carries the
    other direction's ACKs (100 bytes, 0.1 s) before the second swap's data: 2.1 s, not 2 s.
    Rank 0 sending rank 1 two messages one way is not slowed (its ACKs use the idle reverse)."""
    g = (0, 1)

    def swap(r, tag):
        return [["R", 1 - r, 1000, tag, list(g)], _p2p(r, 1 - r, 1000, g, tag=tag)]

    progs = [[*swap(r, 1), ["A", [0, 1]], *swap(r, 2), ["A", [3, 4]], ["S"]] for r in g]
    for h, want in ((0.0, 2.0), (0.1, 2.1)):
        sim = JobSim(progs, [0, 1], _cost(), [_charge({})] * 2, link_sharing=sharing,
                     ack_overhead=h)
        assert job_steps(sim.run()) == pytest.approx([want]), h
        assert sim.moved == {"intra": 0.0, "inter": 4000.0}      # payload only: the ledger's
        assert sim.ack_bytes == pytest.approx(h * 4000)
    one_way = [[_p2p(0, 1, 1000, g), _p2p(0, 1, 1000, g, tag=8), ["A", [0, 1]], ["S"]],
               [["R", 0, 1000, 7, list(g)], ["R", 0, 1000, 8, list(g)], ["A", [0, 1]], ["S"]]]
    sim = JobSim(one_way, [0, 1], _cost(), [_charge({})] * 2, link_sharing=sharing,
                 ack_overhead=0.1)
    assert sim.run()[1] == pytest.approx([2.0])
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"ack_overhead .* must be in \[0, 1\)"):
            JobSim(progs, [0, 1], _cost(), [_charge({})] * 2, ack_overhead=bad)


def test_the_labs_ack_overhead_is_tcps_delayed_ack_frames():
    """One 66-byte ACK frame (Ethernet 14, IP 20, TCP with timestamps 32) per two 1514-byte
    data frames."""
    from lab.analysis import tcp_ack_overhead

    assert tcp_ack_overhead() == pytest.approx(66 / 3028)


class _PacketFifo(JobSim):
    """An independent reference for ``link_sharing="fifo"``: the same programs, but every
    inter-node message cut into packets that cross a node's uplink one at a time in arrival
    order and then queue, packet by packet, at the destination's downlink (store and forward;
    no workload formula)."""

    PACKET = 10.0                               # bytes: 0.01 s at β

    def _move(self, m):
        a, b = self.node_of[m.src], self.node_of[m.dst]
        self.moved["intra" if a == b else "inter"] += m.nbytes
        if a == b or m.nbytes <= 0:
            self._pair_busy[(m.src, m.dst)] = m
            self._at(self.now + m.nbytes / self.cost.intra_bw, lambda: self._arrive(m))
            return
        n = max(1, math.ceil(m.nbytes / self.PACKET))
        m.left = n
        for _ in range(n):
            self._hop(("up", a), m.nbytes / n, lambda m=m, b=b: self._hop(
                ("down", b), m.nbytes / n, lambda m=m: self._delivered(m)))

    def _hop(self, port, size, then):
        """A packet joins ``port``'s queue; ``then`` runs when it has crossed."""
        q = self.__dict__.setdefault("ports", {}).setdefault(port, [])
        q.append((size, then))
        if len(q) == 1:
            self._serve(port)

    def _serve(self, port):
        size, then = self.ports[port][0]

        def done():
            self.ports[port].pop(0)
            then()
            if self.ports[port]:
                self._serve(port)
        self._at(self.now + size / self.cost.inter_bw, done)

    def _delivered(self, m):
        m.left -= 1
        if m.left == 0:
            self._arrive(m)


def test_fifo_links_follow_a_packet_level_simulation():
    """Uneven all-to-all exchanges (3 + 3 + 1 ranks on 3 nodes, odd sizes, staggered compute):
    the fluid FIFO links finish every rank's steps where a packet-by-packet store-and-forward
    simulation of the same queues does, within the packets' own granularity (one packet time
    per hop and message), and max-min sharing does not."""
    rng = __import__("random").Random(5)
    node_of = [0, 0, 0, 1, 1, 1, 2]
    n = len(node_of)
    g = list(range(n))
    progs = []
    sizes = {(s, d, k): rng.randrange(200, 3001) for s in g for d in g for k in range(3)}
    for r in g:
        prog = []
        for k in range(3):
            peers = [d for d in g if d != r]
            rng.shuffle(peers)
            prog += [*_block(f"c{r}")]
            first = len(prog)
            prog += [["R", s, sizes[s, r, k], k, g] for s in g if s != r]
            prog += [_p2p(r, d, sizes[r, d, k], g, tag=k) for d in peers]
            prog += [["A", list(range(first, len(prog)))], ["S"]]
        progs.append(prog)
    charges = [_charge({f"c{r}": 0.1 * r}) for r in g]
    fifo = JobSim(progs, node_of, _cost(0.02), charges).run()
    packets = _PacketFifo(progs, node_of, _cost(0.02), charges).run()
    fair = JobSim(progs, node_of, _cost(0.02), charges, link_sharing="fair").run()
    hop = _PacketFifo.PACKET / BETA
    for r in g:
        assert fifo[r] == pytest.approx(packets[r], abs=2 * n * hop), r
    worst = max(abs(x - y) for r in g for x, y in zip(fair[r], packets[r]))
    assert worst > 10 * n * hop


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


def test_offload_blocks_run_on_the_worker_beside_the_thread():
    """A block on the offload stream costs the rank's thread nothing: it runs on the worker
    (one block after the other), and a block that names it waits for it."""
    def off(label, deps):
        return [["B", "clock", label, label, deps, "offload", None], ["E"]]

    wait = [["B", "clock", "wait", "wait", [2, 4], "compute", None], ["E"]]
    prog = [*_block("bwd"), *off("w1", [0]), *off("w2", [0]), *_block("more"), *wait,
            *_block("opt"), ["S"]]
    charges = {"bwd": 1.0, "w1": 2.0, "w2": 1.5, "more": 1.0, "wait": 0.0, "opt": 0.5}
    # the worker: 1 + 2 + 1.5 = 4.5; the thread waits for it after "more" (2), then opt
    assert job_steps(JobSim([prog], [0], _cost(), [_charge(charges)]).run()) == \
        pytest.approx([5.0])
    charges["more"] = 4.0               # the worker is done before the thread needs it
    assert job_steps(JobSim([prog], [0], _cost(), [_charge(charges)]).run()) == \
        pytest.approx([5.5])


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
    outsider = ["C", _call("allreduce", g, 8), None, True, True, None]
    with pytest.raises(ValueError, match=r"rank 2 runs call t of group \(0, 1\)"):
        JobSim([[outsider]] * 3, [0, 1, 1], _cost(), [_charge({})] * 3).run()


def test_an_all_to_all_is_simulated_from_each_members_own_row():
    """A member's record of a personalized all-to-all holds its own row of the byte matrix
    (what it knows before the call): rank 0 sends 3000 bytes to rank 1, rank 1 sends rank 2
    1000 and rank 2 nothing.  Each receive completes when its sender's message arrives:
    rank 1 waits for rank 0's 3 s transfer, rank 2 for rank 1's 1 s one (one node each, every
    message inter-node at BETA bytes/s, no latency); rank 0 receives nothing and is done at
    once; the bytes moved are the matrix's."""
    g = (0, 1, 2)

    def row(i, r):
        m = [0] * 9
        m[3 * i:3 * i + 3] = r
        return ["C", {**_call("alltoallv", g, sum(r)), "blocks": m}, None, True, True, None]

    progs = [[row(0, [0, 3000, 0]), ["S"]], [row(1, [0, 0, 1000]), ["S"]],
             [row(2, [0, 0, 0]), ["S"]]]
    sim = JobSim(progs, [0, 1, 2], _cost(), [_charge({})] * 3)
    sim.run()
    want = {0: 0.0, 1: 3000 / BETA, 2: 1000 / BETA}
    for r in g:
        assert job_steps(sim.steps, r) == pytest.approx([want[r]]), r
    assert sim.moved["inter"] == pytest.approx(4000)


# -- python -m commvol simulate: a recorded job on another network, no MPI ----------------------
def _profile(path, c=0.25, steps=5):
    """A profile of the 2 x 2 ring all-gather job of the drift test (T = 1 s at 1000 B/s)."""
    from simulation.profile import write_profile

    prog = [*_block("c"), ["C", _call("allgather", range(4), 4000, blocks=[1000] * 4), None,
                           True, True, None], ["S"]] * steps
    write_profile(path, [{"c": [{"min_s": c, "median_s": c, "count": steps}]}] * 4,
                  {"system": "test"}, programs=[prog] * 4)
    return path


def test_commvol_simulate_prints_the_steps_on_any_placement(tmp_path, capsys):
    """Node-major, the ring drifts to max(3T, c + 2T) = 3 s after the lock-step first step.
    Round-robin (ranks 0, 2 on node 0; 1, 3 on node 1), every hop crosses nodes, with twice the
    inter-node bytes.  Max-min fair, both ranks of a node share its uplink at every ring step
    (2T a step): c + 6T, in lock step.  FIFO, a node's uplink sends rank 0's (rank 1's) block
    first, 0.25-1.25 s, then rank 2's (3's); the second ring step's blocks of ranks 1 and 2
    (posted at 1.25 s) wait behind them and move 2.25-3.25 s, ranks 3's and 0's (posted at
    2.25 s) 3.25-4.25 s; the third step's of ranks 2 and 3 (posted at 3.25 s) move 4.25-5.25
    s: rank 0 ends its first step after c + 5T, ranks 1 and 2 after c + 6T."""
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
    assert main([*common, "--node-map", "round-robin:2", "--skip", "0", "--link-sharing",
                 "fair"]) == 0
    out = capsys.readouterr().out
    assert "mean step after 0 warm-up: 6250.000" in out and "inter-node 60000" in out
    assert "fair links" in out
    assert main([*common, "--node-map", "round-robin:2", "--json", str(tmp_path / "b.json")]) == 0
    assert "fifo links" in capsys.readouterr().out
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["step_s"][0] == pytest.approx(5.25) and b["link_sharing"] == "fifo"
    assert b["bytes"]["inter"] == 60000


@pytest.mark.parametrize("extra,message", [
    (["--node-map", "block:3"], "block:R needs R ranks per node"),
    (["--node-map", "block:2", "--skip", "5"], "hold 5 steps; pass --skip 4 or fewer"),
    (["--node-map", "block:2", "--inter-bw", "0"], "--inter-bw must be > 0"),
    (["--node-map", "block:2", "--eager-limit", "-2"], "--eager-limit -2: must be >= 0"),
    (["--node-map", "block:2", "--ack-overhead", "-1"], "--ack-overhead -1: must be in [0, 1)"),
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
    from simulation.profile import write_profile

    write_profile(tmp_path / "old.json", [{"c": [{"min_s": 0.1, "count": 1}]}], {})
    with pytest.raises(ValueError, match="holds no programs"):
        main(["simulate", "--compute-profile", str(tmp_path / "old.json"), "--node-map", "0"])


# -- a job nobody recorded: programs generated from the plan ------------------------------------
def test_resnet152_ddp_at_64_ranks_is_simulated_from_its_plan():
    """Every rank's program of one ResNet-152 DDP step (25 MiB buckets) on 16 x 4 ranks,
    generated from the plan without any MPI run, simulated together on PruneX's cluster: the
    network moves the closed form's bytes, and the step lies between its compute and the
    compute plus every bucket's ring time (nothing overlapped)."""
    from commvol.job import Job
    from commvol.specs import resolve_model
    from commvol.systems import get_system
    from commvol.workload import DeviceModel, units_for_spec
    from dataparallel.ddp import DDPOptions, DDPPlan
    from simulation.cluster import Cluster
    from volume.dataparallel import ddp_step_bytes

    spec = resolve_model("resnet152")
    units, _ = units_for_spec(spec, "resnet152")
    cluster = Cluster.load("prunex-puhti")
    device = DeviceModel(cluster.device)
    options, _ = get_system("ddp").split({"bucket_mib": 25.0})
    got = Job("ddp", spec, 16, 4, options, units, device, 32).run(cluster)
    sizes = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=25.0), 4).bucket_sizes
    want = ddp_step_bytes(M=16, P=4, bucket_sizes=sizes)["grad_allreduce"]
    assert got["bytes"] == pytest.approx(want)
    busy = sum(device.forward(u, 32) + device.backward(u, 32) for u in units) + \
        device.optimizer(spec.layout.total)
    cost = cluster.cost_model()
    rings = sum(cost.ring_allreduce_time(4 * n, 64, INTER) for n in sizes)
    assert busy < got["step_s"] < busy + rings


def test_a_rank_that_starts_late_delays_what_waits_for_it():
    """``start``: each rank begins its program then (a job simulated in pieces carries its
    ranks' drift).  A two-node all-gather of 1000-byte blocks (1 s a block): together, both end
    at 1 s; rank 1 starting at 2 s sends its block at 2 s, so rank 0 (whose block reached rank
    1 at 1 s) waits until 3 s, while rank 1 (its send eager, rank 0's block already there)
    ends when it starts; a negative start is refused."""
    prog = [["C", _call("allgather", range(2), 2000, blocks=[1000, 1000]), None, True, True,
             None], ["S"]]
    both = JobSim([prog, prog], [0, 1], _cost(), [_charge({})] * 2)
    assert both.run() == [[pytest.approx(1.0)], [pytest.approx(1.0)]]
    late = JobSim([prog, prog], [0, 1], _cost(), [_charge({})] * 2, start=[0.0, 2.0])
    assert late.run() == [[pytest.approx(3.0)], [pytest.approx(2.0)]]
    with pytest.raises(ValueError, match="one time >= 0 per rank"):
        JobSim([prog, prog], [0, 1], _cost(), [_charge({})] * 2, start=[0.0, -1.0])
