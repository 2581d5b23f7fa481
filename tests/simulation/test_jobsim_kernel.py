"""The compiled FIFO network (simulation.jobsim_kernel) against the Python loop of
simulation.jobsim.JobSim.run, the reference: every step time, the clock at the end, the bytes
moved and the acknowledgements' bytes must be equal bit for bit, on hand-built programs that use
every operation (blocks, clock blocks, stream and offload, point-to-point, rendezvous, every
compiled collective, sub-groups) and on ResNet-152's DDP step generated from its plan, on
uneven placements."""

import numpy as np
import pytest

pytest.importorskip("numba")

from simulation import jobsim_kernel
from simulation.cluster import Cluster
from simulation.jobsim import JobSim
from substrate import schedule
from substrate.calls import Call
from substrate.costmodel import CostModel


def _call(algorithm, group, nbytes, **kw):
    return {"phase": "t", "algorithm": algorithm, "group": list(group), "nbytes": nbytes,
            "itemsize": kw.pop("itemsize", 4), "root": kw.pop("root", 0), "op": None, **kw}


def _results(sim):
    return sim.steps, sim.now, sim.moved, sim.ack_bytes


def _both(programs, node_of, cost, charges, *, caps=None, **kw):
    """The Python loop's results and the kernel's (called directly, so that a fallback cannot
    hide), for the same JobSim."""
    ref = JobSim(programs, node_of, cost, charges, **kw)
    ref.compiled = False
    ref.run()
    sim = JobSim(programs, node_of, cost, charges, **kw)
    stuck = jobsim_kernel.simulate(sim, [sim._program_ops(r) for r in range(len(programs))],
                                   caps=caps)
    assert stuck is None
    return _results(ref), _results(sim)


def _mixed_programs(n, steps=2):
    """Every rank of ``n``: a layer block, an all-reduce on the stream (uneven chunks), an
    offloaded block after it, a point-to-point ring (700 bytes to the right), an all-gatherv,
    a broadcast from rank 4, the stream's wait, a clock block around a layer and a barrier,
    an all-reduce of the even ranks (the others skip it) and a two-rank broadcast."""
    world = tuple(range(n))
    evens = tuple(range(0, n, 2))
    ar = _call("allreduce", world, 4 * 1001)
    ag = _call("allgather", world, sum(range(5, 5 + 7 * n, 7)), itemsize=1,
               blocks=list(range(5, 5 + 7 * n, 7)))
    bc = _call("bcast", world, 333, root=4 % n, itemsize=1)
    bar = _call("barrier", world, 0)
    sub = _call("allreduce", evens, 4 * 77)
    pair = _call("bcast", (0, n - 1), 4000, itemsize=1)
    programs = []
    for r in range(n):
        prog = []
        for _ in range(steps):
            fwd = len(prog)
            prog += [["B", "layer", "fwd", "fwd", [], "compute", None], ["E"]]
            stream = len(prog)
            prog.append(["C", ar, [], True, False, None])
            prog += [["B", "clock", "w", "w", [fwd, stream], "offload", None], ["E"]]
            send = len(prog)
            prog.append(["C", _call("p2p", world, 700, pairs=[[r, (r + 1) % n, 700]]), [],
                         True, False, 3])
            prog.append(["R", (r - 1) % n, 700, 3, list(world)])
            prog.append(["A", [send, send + 1]])
            prog.append(["C", ag, None, True, True, None])
            prog.append(["C", bc, None, True, True, None])
            prog.append(["W", stream])
            prog += [["B", "clock", "opt", "opt", [], "compute", None],
                     ["B", "layer", "inner", "inner", [], "compute", None], ["E"], ["E"]]
            prog.append(["C", bar, None, True, True, None])
            prog.append(["C", sub, None, r in evens, True, None])
            prog.append(["C", pair, None, r in (0, n - 1), True, None])
            prog.append(["S"])
        programs.append(prog)
    return programs


def _charges(n):
    """Rank r's blocks cost a little more the further it is from rank 0 (the ranks drift)."""
    def charge(r):
        table = {"fwd": 0.002 * (1 + r % 5), "w": 0.003, "opt": 0.004, "inner": 0.001 * (r % 3)}
        return lambda key, k: table.get(key, 0.0) * (1 + k)
    return [charge(r) for r in range(n)]


UNEVEN = [0, 0, 0, 1, 2, 2, 2, 3, 3, 4, 4, 4]            # 3, 1, 3, 2, 3 ranks a node


@pytest.mark.parametrize("node_of", [[r // 3 for r in range(12)], UNEVEN,
                                     [r % 4 for r in range(12)]])
@pytest.mark.parametrize("kw", [{}, {"eager_limit": 500.0, "ack_overhead": 0.02}])
def test_mixed_programs_give_the_python_loops_times_bitwise(node_of, kw):
    cost = CostModel(intra_bw=5e6, inter_bw=1e6, intra_lat=2e-6, inter_lat=3e-5)
    ref, got = _both(_mixed_programs(12), node_of, cost, _charges(12), **kw)
    assert got == ref
    assert ref[0][0] and all(len(s) == 2 for s in ref[0])


@pytest.mark.parametrize("name", ["prunex-puhti", "ssfusion-local-v100s"])
def test_a_shipped_clusters_nics_tiers_and_fabric_give_the_same_times(name):
    """Switch tiers (latency by the tiers climbed), several NICs a node, a PCIe fabric shared
    by a node's ranks: 3 ranks a node and an uneven placement."""
    cluster = Cluster.load(name)
    for node_of in ([r // 3 for r in range(12)], UNEVEN):
        ref, got = _both(_mixed_programs(12, steps=1), node_of, cluster, _charges(12),
                         eager_limit=2000.0)
        assert got == ref, node_of


def test_pools_that_overflow_are_doubled_and_the_run_repeated():
    """Pools of 2 rows each: every pool overflows many times; the result is the same."""
    cost = CostModel(intra_bw=5e6, inter_bw=1e6, intra_lat=2e-6, inter_lat=3e-5)
    ref, got = _both(_mixed_programs(12, steps=1), UNEVEN, cost, _charges(12), caps=2)
    assert got == ref


def test_resnet152_ddp_at_64_ranks_is_the_python_loops_step_on_uneven_nodes():
    """Every rank's program of one ResNet-152 DDP step (25 MiB buckets, generated from the
    plan) on PruneX's cluster: 16 nodes x 4 ranks as planned, and 64 ranks placed unevenly
    (nodes of 3, 5, 1, 4, ... ranks)."""
    from commvol.job import Job
    from commvol.specs import resolve_model
    from commvol.systems import get_system
    from commvol.workload import DeviceModel, units_for_spec

    spec = resolve_model("resnet152")
    units, _ = units_for_spec(spec, "resnet152")
    cluster = Cluster.load("prunex-puhti")
    options, _ = get_system("ddp").split({"bucket_mib": 25.0})
    job = Job("ddp", spec, 16, 4, options, units, DeviceModel(cluster.device), 32)
    uneven, node = [], 0
    while len(uneven) < 64:
        uneven += [node] * min((3, 5, 1, 4)[node % 4], 64 - len(uneven))
        node += 1
    for node_of in (list(job.placement.node_of), uneven):
        ref, got = _both(job.programs, node_of, cluster, [job.charge] * 64)
        assert got == ref


def test_run_uses_the_kernel_where_it_applies_and_python_elsewhere():
    """``JobSim.run``: FIFO links without events use the kernel (the same results); fair
    sharing, recorded events and an all-to-all (not compiled: the kernel refuses it) run the
    Python loop."""
    cost = CostModel(intra_bw=5e6, inter_bw=1e6, intra_lat=2e-6, inter_lat=3e-5)
    progs = _mixed_programs(12, steps=1)
    ref = JobSim(progs, UNEVEN, cost, _charges(12))
    ref.compiled = False
    sim = JobSim(progs, UNEVEN, cost, _charges(12))
    sim.compiled = True                 # (by default from COMPILED_FROM_RANKS ranks on)
    assert sim.run() == ref.run() and sim.moved == ref.moved and sim.counts["messages"] > 0
    small = JobSim(progs, UNEVEN, cost, _charges(12))
    assert small.run() == ref.steps and small.counts is None      # 12 ranks: Python
    events = JobSim(progs, UNEVEN, cost, _charges(12), record_events=True)
    events.compiled = True
    assert events.run() == ref.steps and events.events[0] and events.counts is None
    a2a = _call("alltoallv", (0, 1, 2), 6 * 8, blocks=[0, 8, 16, 24, 0, 8, 16, 24, 0])
    progs = [[["C", a2a, None, True, True, None], ["S"]] for _ in range(3)]
    sim = JobSim(progs, [0, 0, 1], cost, _charges(3))
    with pytest.raises(NotImplementedError):
        jobsim_kernel.simulate(sim, [sim._program_ops(r) for r in range(3)])
    ref = JobSim(progs, [0, 0, 1], cost, _charges(3))
    ref.compiled = False
    sim = JobSim(progs, [0, 0, 1], cost, _charges(3))
    sim.compiled = True
    assert sim.run() == ref.run() and sim.counts is None


def test_programs_that_do_not_match_fail_as_in_python():
    cost = CostModel(intra_bw=5e6, inter_bw=1e6, intra_lat=2e-6, inter_lat=3e-5)
    g = [0, 1, 2]
    stuck = [[["S"]], [["R", 0, 10, 7, g], ["A", [0]], ["S"]], [["R", 1, 10, 7, g], ["S"]]]
    for compiled in (False, True):
        sim = JobSim(stuck, [0, 0, 1], cost, _charges(3))
        sim.compiled = compiled
        with pytest.raises(RuntimeError, match=r"ranks \[1\] wait"):
            sim.run()
    outsider = [[["C", _call("allreduce", (0, 1), 80), None, True, True, None], ["S"]]] * 3
    for compiled in (False, True):
        sim = JobSim(outsider, [0, 0, 1], cost, _charges(3))
        sim.compiled = compiled
        with pytest.raises(ValueError, match="rank 2 runs call t of group"):
            sim.run()


@pytest.mark.parametrize("call", [
    _call("allreduce", range(7), 4 * 1003), _call("allreduce", (0, 3, 5), 8 * 5, itemsize=8),
    _call("allgather", range(5), 63, blocks=[5, 9, 13, 1, 35], itemsize=1),
    _call("bcast", range(11), 333, root=4, itemsize=1), _call("bcast", range(2), 9, itemsize=1),
    _call("barrier", range(6), 0), _call("barrier", range(8), 0)])
def test_compiled_rounds_are_the_schedules_rounds(call):
    """:func:`jobsim_kernel.rounds` (the kernel's collectives) against :mod:`substrate.schedule`
    (what substrate.collectives executes), every member, every round, in bytes."""
    call = Call.from_dict(call)
    sim = JobSim([[["S"]]] * (max(call.group) + 1), [0] * (max(call.group) + 1),
                 CostModel(intra_bw=1.0, inter_bw=1.0, intra_lat=0.0, inter_lat=0.0),
                 _charges(max(call.group) + 1))
    enc = jobsim_kernel._Encoded(sim, [[] for _ in sim.programs])
    row, _ = enc._call(sim, call, call.group[0])
    calls = np.array(enc.calls, dtype=np.int64).reshape(-1, 8)
    data = np.array(enc.data, dtype=np.int64)
    sched = schedule.of_call(call)
    for i in range(call.size):
        want = []
        for s, rnd in enumerate(sched.rounds(i)):
            want += [(s, 0, q, hi - lo) for q, lo, hi in rnd.sends]
            want += [(s, 1, q, 0) for q, _, _ in rnd.recvs]
        assert jobsim_kernel.rounds(calls, data, row, i) == want, i
