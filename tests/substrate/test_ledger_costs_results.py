"""Substrate pieces that need no MPI launch: cost-model math, ledger, buckets, results, launcher."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

from runner import launch
from substrate import (
    Checkpointer,
    CostModel,
    Ledger,
    RunWriter,
    Topology,
    TopologyError,
    atomic_write_json,
    schedule,
)
from substrate.buckets import BucketPlan
from substrate.ledger import merge_phase_dicts
from volume import collectives as cm

ROOT = Path(__file__).resolve().parents[2]


def _ring_sent(count: int, itemsize: int, p: int, i: int) -> int:
    """Bytes ring member ``i`` sends in one all-reduce of ``count`` elements (its schedule's
    messages: what the ledger books)."""
    return sum(b for _, b in schedule.sent(schedule.allreduce(count, p), i, itemsize))


# -- cost model ------------------------------------------------------------------------------
@given(count=st.integers(0, 10_000), p=st.integers(1, 64), itemsize=st.sampled_from([1, 4, 8]))
def test_ring_allreduce_per_rank_bytes_sum_to_2_p_minus_1_n(count, p, itemsize):
    sent = [_ring_sent(count, itemsize, p, i) for i in range(p)]
    assert sum(sent) == 2 * (p - 1) * count * itemsize
    assert all(s >= 0 for s in sent)


@given(p=st.integers(2, 32), k=st.integers(1, 50))
def test_ring_allreduce_divisible_every_link_carries_2_p_minus_1_over_p(p, k):
    count = p * k
    for i in range(p):
        assert _ring_sent(count, 4, p, i) == 2 * (p - 1) * k * 4


def test_ring_allreduce_closed_form_hierarchical_and_node_major():
    n, M, P = 4000, 4, 2
    assert cm.ring_allreduce_wire_bytes(n, M, M) == {"intra": 0, "inter": 2 * (M - 1) * n}
    p = M * P
    w = cm.ring_allreduce_wire_bytes(n, p, M)
    assert w["inter"] == M * 2 * (p - 1) * n // p
    assert w["inter"] + w["intra"] == 2 * (p - 1) * n


@given(blocks=st.lists(st.integers(0, 1000), min_size=1, max_size=20))
def test_ring_allgatherv_bytes_total(blocks):
    p = len(blocks)
    assert sum(sum(b for _, b in schedule.allgatherv(tuple(blocks)).sent(i)) for i in range(p)) == (p - 1) * sum(blocks)


@pytest.mark.parametrize("p", range(1, 40))
def test_binomial_tree_spans_every_rank_once_with_log_depth(p):
    parent = {}
    for r in range(p):
        for c in schedule.binomial_children(r, p):
            assert c not in parent and 0 < c < p
            parent[c] = r
    assert sorted(parent) == list(range(1, p))

    # rounds: a rank that has the data at round t sends to its children one per round, largest
    # subtree first; the last rank is reached after ceil(log2 p) rounds
    have = {0: 0}
    for r in range(p):  # parents precede children in rank order
        for k, c in enumerate(sorted(schedule.binomial_children(r, p), reverse=True)):
            have[c] = have[r] + k + 1
    assert max(have.values()) == schedule.binomial_depth(p)


@pytest.mark.parametrize("M,P", [(1, 4), (2, 2), (4, 1), (3, 4), (5, 8)])
def test_bcast_closed_form_counts_node_crossing_tree_edges(M, P):
    p = M * P
    node = np.arange(p) // P
    inter = sum(node[r] != node[c] for r in range(p) for c in schedule.binomial_children(r, p))
    assert cm.bcast_wire_bytes(10, M, P) == {"intra": (p - 1 - inter) * 10, "inter": inter * 10}


def test_cost_model_times_and_units():
    c = CostModel.from_cli(intra_gbps=800, inter_gbps=80, intra_lat_us=1, inter_lat_us=10)
    assert c.inter_bw == 10e9 and c.intra_bw == 100e9
    assert c.p2p_time(1e6, "inter") == pytest.approx(10e-6 + 1e6 / 10e9)
    assert c.ring_allreduce_time(8e6, 4, "inter") == pytest.approx(6 * (10e-6 + 2e6 / 10e9))
    assert c.bcast_time(1e3, 5, "intra") == pytest.approx(3 * (1e-6 + 1e3 / 100e9))
    assert c.ring_allgather_time(4e6, 4, "inter") == pytest.approx(3 * 10e-6 + 3e6 / 10e9)
    assert c.ring_allreduce_time(1e9, 1, "inter") == 0.0
    assert c.describe()["inter_gbps"] == pytest.approx(80)


@pytest.mark.parametrize("kw", [{"inter_bw": 0}, {"intra_bw": -1}, {"inter_lat": -1e-6}])
def test_cost_model_rejects_bad_values(kw):
    with pytest.raises(ValueError, match="must be"):
        CostModel(**kw)


# -- ledger ------------------------------------------------------------------------------------
def test_ledger_records_and_merges_sum_bytes_max_calls():
    a, b = Ledger(), Ledger()
    a.record("x", payload=10, inter=30, messages=2, modeled_s=1.0, links=("inter",))
    a.record("x", payload=10, inter=30, messages=2, modeled_s=1.0, links=("inter",))
    b.record("x", payload=10, intra=5, messages=1, modeled_s=3.0, links=("intra",))
    tot = merge_phase_dicts([a.local(), b.local()])
    e = tot["by_phase"]["x"]
    assert (e["inter_bytes"], e["intra_bytes"], e["bytes"]) == (60, 5, 65)
    assert e["calls"] == 2 and e["messages"] == 5 and e["modeled_s"] == 3.0
    assert e["link"] == "mixed" and e["payload_bytes"] == 30
    assert tot["inter_node_bytes"] == 60 and tot["intra_node_bytes"] == 5
    snap = a.local()
    a.record("x", payload=1, inter=7, links=("inter",))
    assert a.since(snap)["x"]["inter_bytes"] == 7 and a.since(snap)["x"]["calls"] == 1
    with pytest.raises(ValueError, match="phase label"):
        a.record("", payload=0)


# -- buckets -----------------------------------------------------------------------------------
def test_bucket_plan_respects_budget_and_dtype_boundaries():
    shapes = [((100,), "<f4"), ((100,), "<f4"), ((1000,), "<f4"), ((10,), "<f8"), ((3,), "<f8")]
    plan = BucketPlan(shapes, bucket_bytes=800, xp=np)
    assert [[i for i, _, _ in b] for b in plan.buckets] == [[0, 1], [2], [3, 4]]
    assert [b.dtype for b in plan.buffers] == [np.float32, np.float32, np.float64]
    assert [b.size for b in plan.buffers] == [200, 1000, 13]
    assert [off for _, off, _ in plan.buckets[0]] == [0, 100]
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPlan(shapes, 0, np)


def test_single_rank_topology_and_bad_inputs():
    t = Topology.from_comm(MPI.COMM_SELF, ranks_per_node=1)
    assert (t.num_nodes, t.ranks_per_node, t.is_leader, t.inter.size) == (1, 1, True, 1)
    with pytest.raises(TopologyError, match="not a multiple"):
        Topology.from_comm(MPI.COMM_SELF, ranks_per_node=2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(TopologyError, match="positive integer"):
            Topology.from_comm(MPI.COMM_SELF, ranks_per_node=bad)


def test_assign_nodes_orders_by_leader_and_keeps_unequal_nodes():
    from substrate.topology import assign_nodes

    node_of, leaders = assign_nodes([0, 0, 2, 2, 4, 4])
    assert node_of.tolist() == [0, 0, 1, 1, 2, 2] and leaders.tolist() == [0, 2, 4]
    node_of, _ = assign_nodes([0, 1, 0, 1])  # round-robin placement: ids still by leader rank
    assert node_of.tolist() == [0, 1, 0, 1]
    node_of, leaders = assign_nodes([0, 0, 0, 3])  # 3 + 1: allowed, the systems decide
    assert node_of.tolist() == [0, 0, 0, 1] and leaders.tolist() == [0, 3]


def test_comm_rejects_bad_arguments():
    t = Topology.from_comm(MPI.COMM_SELF)
    with pytest.raises(ValueError, match="unknown all-reduce op"):
        t.world.allreduce(np.zeros(2), "prod", phase="x")
    with pytest.raises(ValueError, match="C-contiguous"):
        t.world.allreduce(np.zeros((4, 4))[:, 0], phase="x")
    with pytest.raises(ValueError, match="floating-point"):
        t.world.allreduce(np.zeros(2, dtype=np.int64), "avg", phase="x")
    with pytest.raises(ValueError, match="phase label"):
        t.world.allreduce(np.zeros(2), phase="")


# -- results -----------------------------------------------------------------------------------
def test_atomic_json_keeps_old_file_when_serialization_fails(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_json_keeps_old_file_when_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"v": "old"})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_json(path, {"v": "new"})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": "old"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_run_writer_publishes_only_on_finish(tmp_path):
    old = RunWriter(tmp_path)
    old.log({"it": 0})
    old.finish({"run": "old"})
    failed = RunWriter(tmp_path)
    failed.log({"it": 0, "new": True})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"it": 0}\n'  # not yet replaced
    failed.abandon()
    assert json.loads((tmp_path / "summary.json").read_text())["run"] == "old"
    assert (tmp_path / "metrics.jsonl").read_text() == '{"it": 0}\n'
    assert not (tmp_path / ".metrics.jsonl.part").exists()
    # a summary that cannot be serialized fails before any file is touched
    bad = RunWriter(tmp_path)
    bad.log({"it": 1})
    with pytest.raises(TypeError):
        bad.finish({"x": object()})
    assert json.loads((tmp_path / "summary.json").read_text())["run"] == "old"


def test_checkpointer_roundtrip_keep_and_missing(tmp_path):
    ck = Checkpointer(tmp_path / "ck", rank=3, keep=2)
    assert ck.steps() == []
    for step in (1, 5, 9):
        ck.save({"w": np.arange(4) * step, "it": step}, step)
    assert ck.steps() == [5, 9]
    state = ck.load(9)
    assert np.array_equal(state["w"], np.arange(4) * 9) and state["it"] == 9
    with pytest.raises(FileNotFoundError, match="available steps"):
        ck.load(1)
    assert not list((tmp_path / "ck").glob("*.tmp"))


# -- launcher ----------------------------------------------------------------------------------
def test_launch_command_mpich_and_openmpi_oversubscribe(monkeypatch):
    monkeypatch.delenv("SPARDIST_LAUNCHER", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(launch, "find_mpiexec", lambda: "/x/mpiexec")
    many = (os.cpu_count() or 1) + 2
    monkeypatch.setattr(launch, "mpi_flavor", lambda m: "mpich")
    cmd = launch.launch_command(many, "hsadmm", ["train"], hostfile="hosts")
    assert cmd[:3] == ["/x/mpiexec", "-n", str(many)] and "-f" in cmd
    assert cmd[-5:] == ["-m", "mpi4py", "-m", "hsadmm", "train"]
    monkeypatch.setattr(launch, "mpi_flavor", lambda m: "openmpi")
    cmd = launch.launch_command(many, "hsadmm")
    assert "--oversubscribe" in cmd
    assert "--oversubscribe" not in launch.launch_command(1, "hsadmm")
    monkeypatch.setattr(launch, "mpi_flavor", lambda m: "openmpi5")
    assert ":OVERSUBSCRIBE" in launch.launch_command(many, "hsadmm")
    monkeypatch.setenv("SPARDIST_LAUNCHER", "srun --mpi=pmix")
    assert launch.launch_command(8, "hsadmm")[:4] == ["srun", "--mpi=pmix", "-n", "8"]
    with pytest.raises(ValueError, match="-n must be"):
        launch.launch_command(0, "hsadmm")


def test_run_mpi_sh_dry_run_passes_ranks_per_node():
    out = subprocess.run([str(ROOT / "run_mpi.sh"), "--dry-run", "-n", "4", "--ranks-per-node",
                          "2", "runner.probe", "--seed", "3"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert " -n 4 " in line
    assert line.endswith("-m mpi4py -m runner.probe --seed 3 --ranks-per-node 2")


def test_mpi_env_caps_threads_per_rank(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = launch.mpi_env(4, {})
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
    assert launch.mpi_env(4, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    assert int(env["NUMBA_NUM_THREADS"]) >= 1
    # OpenBLAS workers do not spin after a GEMM (a user's own setting wins)
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert launch.mpi_env(4, {"OPENBLAS_THREAD_TIMEOUT": "28"})["OPENBLAS_THREAD_TIMEOUT"] == "28"



def test_ranks_sharing_the_cores_wait_by_sleeping(monkeypatch):
    """More ranks than cores: MPICH's waiting ranks sleep instead of spinning (a user's own
    setting wins); ranks with cores of their own, a hostfile's or srun's ranks keep spinning."""
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    shared = launch.mpi_env(4, {})
    assert all(shared[k] == v for k, v in launch.YIELD_ENV.items())
    mine = launch.mpi_env(4, {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "0"})
    assert mine["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "0"
    assert not set(launch.YIELD_ENV) & set(launch.mpi_env(2, {}))
    assert launch.oversubscribed(4) and not launch.oversubscribed(2)
    assert not launch.oversubscribed(4, hostfile="hosts")
    assert not launch.oversubscribed(4, cmd=["/usr/bin/srun", "-n", "4"])
    assert not set(launch.YIELD_ENV) & set(launch.mpi_env(4, {}, shared_cores=False))

# -- closed forms for uneven chunks (rank counts that do not divide the count) -------
from traffic_reference import simulated_bcast as _simulated_bcast
from traffic_reference import simulated_ring as _simulated_ring

UNEVEN = [(M, P, r) for M, P in [(1, 3), (2, 3), (3, 3), (1, 6), (2, 6), (4, 3), (3, 5), (5, 1),
                                 (2, 7)] for r in (1, 2, M * P - 1) if r < M * P]


@pytest.mark.parametrize("M,P,r", UNEVEN, ids=[f"{M}x{P}+{r}" for M, P, r in UNEVEN])
@pytest.mark.parametrize("itemsize", [1, 4, 8])
def test_ring_allreduce_closed_forms_uneven_counts(M, P, r, itemsize):
    p = M * P
    nodes = np.arange(p) // P
    for count in (r, 7 * p + r, 38282 if 38282 % p else 38283):
        want = _simulated_ring(count, itemsize, nodes)
        assert want["intra"] + want["inter"] == 2 * (p - 1) * count * itemsize
        # node-major world ring, one node's ring, the leaders' ring
        assert cm.ring_allreduce_wire_bytes(count * itemsize, p, M if M > 1 else 0,
                                            itemsize) == want
        assert cm.ring_allreduce_split(count, itemsize, nodes) == want
        assert cm.ring_allreduce_wire_bytes(count * itemsize, P, 0, itemsize) == \
            {"intra": 2 * (P - 1) * count * itemsize, "inter": 0}
        assert cm.ring_allreduce_wire_bytes(count * itemsize, M, M, itemsize) == \
            {"intra": 0, "inter": 2 * (M - 1) * count * itemsize}
        # the ledger's per-rank accounting agrees link by link
        sent = {"intra": 0, "inter": 0}
        for i in range(p):
            link = "inter" if nodes[i] != nodes[(i + 1) % p] else "intra"
            sent[link] += _ring_sent(count, itemsize, p, i)
        assert sent == want


@given(nodes=st.lists(st.integers(0, 3), min_size=1, max_size=12), count=st.integers(0, 500),
       itemsize=st.sampled_from([1, 2, 4, 8]))
def test_ring_allreduce_split_any_ring_any_count(nodes, count, itemsize):
    assert cm.ring_allreduce_split(count, itemsize, nodes) == \
        _simulated_ring(count, itemsize, nodes)


@pytest.mark.parametrize("T,M,P", [(38282, 1, 3), (38282, 2, 3), (1001, 2, 2), (7, 3, 3),
                                    (600, 2, 3)])
def test_ring_allreduce_closed_form_is_the_ring_not_the_divisible_formula(T, M, P):
    """The uneven case that once broke the closed form (digits CNN, T = 38,282 float32, 3 ranks per node): the
    closed form equals a ring walked message by message (:func:`simulated_ring`), and where
    ``p`` does not divide the element count it is not ``M * 2 (p-1)/p * n`` (the old booking,
    612,510 instead of 612,512 bytes per node's ring)."""
    p = M * P
    nodes = np.arange(p) // P
    walked = _simulated_ring(T, 4, nodes)
    got = cm.ring_allreduce_wire_bytes(4 * T, p, M if M > 1 else 0, 4)
    assert got == walked
    divisible = {"intra": (p - (M if M > 1 else 0)) * (2 * (p - 1) * 4 * T // p),
                 "inter": (M if M > 1 else 0) * (2 * (p - 1) * 4 * T // p)}
    if T % p == 0:
        assert got == divisible
    if T == 38282:          # the reproduction's shapes: the ring is not the divisible formula
        assert got != divisible
    # without itemsize the chunks are cut in bytes: still exact when p divides the count
    if T % p == 0:
        assert cm.ring_allreduce_wire_bytes(4 * T, p, M if M > 1 else 0) == walked


def test_ring_allreduce_closed_form_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="ring_allreduce_split"):
        cm.ring_allreduce_wire_bytes(4 * 38282, 6, 4, 4)
    with pytest.raises(ValueError, match="whole number"):
        cm.ring_allreduce_wire_bytes(10, 3, 0, 4)


@pytest.mark.parametrize("M,P", [(1, 3), (2, 3), (3, 3), (2, 5), (2, 6), (3, 7), (4, 3)])
def test_bcast_closed_forms_any_ranks_per_node(M, P):
    p = M * P
    nodes = np.arange(p) // P
    assert cm.bcast_wire_bytes(10, M, P) == _simulated_bcast(10, nodes, 0)
    for root in range(p):
        assert cm.bcast_split(10, nodes, root) == _simulated_bcast(10, nodes, root)
    # 2 x 3: edges 0->1, 0->2, 0->4, 2->3, 4->5: two cross nodes, not M - 1 = 1
    assert cm.bcast_wire_bytes(1, 2, 3) == {"intra": 3, "inter": 2}


@given(nodes=st.lists(st.integers(0, 3), min_size=1, max_size=16), data=st.data())
def test_bcast_split_any_layout_any_root(nodes, data):
    root = data.draw(st.integers(0, len(nodes) - 1))
    assert cm.bcast_split(3, nodes, root) == _simulated_bcast(3, nodes, root)


@pytest.mark.parametrize("ran,planned,message", [
    ([("a", "allreduce", 8)], [("a", "allreduce", 12)], "call 0 of the interval differs"),
    ([("a", "allgather", 8)], [("a", "bcast", 8)], "blocks"),
    ([("a", "barrier", 0)], [], "1 calls ran, 0 planned; first ran only: a (barrier"),
    ([], [("p", "p2p", 8)], "0 calls ran, 1 planned; first planned only: p (p2p"),
])
def test_call_log_check_names_the_first_difference(ran, planned, message):
    """A run that executes anything but its plan stops with one line naming the first
    difference (every algorithm is shown without failing itself)."""
    from substrate.calls import Call, CallLog

    def make(phase, algorithm, n):
        if algorithm == "allgather":
            return Call(phase, algorithm, (0, 1), blocks=(n, n))
        if algorithm == "p2p":
            return Call(phase, algorithm, (0, 1), pairs=((0, 1, n),))
        return Call(phase, algorithm, (0, 1), nbytes=n)

    log = CallLog()
    for c in ran:
        log.add(make(*c))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        log.check([make(*c) for c in planned], 0)


def _records(n: int, seed: int = 0) -> list:
    """``n`` (record, member) pairs: collective records that come back (the same objects) and
    direct messages (new records)."""
    from substrate.calls import Call

    rng = np.random.default_rng(seed)
    kept = [Call("a", "allreduce", (0, 1), nbytes=8, itemsize=4, op="sum"),
            Call("b", "bcast", (0, 1, 2), nbytes=24, root=1),
            Call("c", "allgather", (0, 1), blocks=(4, 4))]
    out = []
    for k in range(n):
        if k % 5 == 4:
            out.append((Call("p", "p2p", (0, 1), pairs=((0, 1, int(rng.integers(1, 9))),)),
                        True))
        else:
            out.append((kept[int(rng.integers(3))], bool(k % 7)))
    return out


def test_chained_call_log_resumes_and_detects_any_difference():
    """The recorder's call log: its state taken after any number of records (inside a block or
    at its end) continues to the digest of the uninterrupted log, through JSON; a changed,
    missing or extra record changes the digest; the checks against a plan are the CallLog's."""
    from substrate.calls import Call
    from substrate.recorder import ChainedLog

    recs = _records(3 * ChainedLog.BLOCK + 5)

    def log_of(records, start=None):
        log = ChainedLog()
        if start is not None:
            log.load_state(json.loads(json.dumps(start)))
        for c, m in records:
            log.add(c, m)
        return log

    whole = log_of(recs)
    assert whole.count == len(recs) and whole.describe()["count"] == len(recs)
    for k in (0, 1, ChainedLog.BLOCK - 1, ChainedLog.BLOCK, 2 * ChainedLog.BLOCK + 3, len(recs)):
        first = log_of(recs[:k])
        assert first.state()["count"] == k and len(first.state()["tail"]) < ChainedLog.BLOCK
        resumed = log_of(recs[k:], first.state())
        assert (resumed.count, resumed.digest) == (whole.count, whole.digest)
        assert resumed.state() == whole.state()
    other = Call("a", "allreduce", (0, 1), nbytes=8, itemsize=4, op="max")
    changed = list(recs)
    changed[7] = (other, changed[7][1])
    member = list(recs)
    member[8] = (member[8][0], not member[8][1])
    digests = {log_of(r).digest for r in (recs, changed, member, recs[:-1], recs + recs[:1],
                                          recs[1:], recs[:10] + recs[11:])}
    assert len(digests) == 7
    # an older checkpoint (count and digest only) still loads and goes on deterministically
    old = {"count": 4, "sha256": whole.digest}
    assert log_of(recs[:3], old).digest == log_of(recs[:3], old).digest
    assert log_of(recs[:3], old).count == 7
    # the plan check is the CallLog's
    log = log_of([(recs[0][0], True)])
    with pytest.raises(ValueError, match="0 calls ran, 1 planned"):
        log_of([]).check([recs[0][0]], 0)
    log.check([recs[0][0]], 0)


def test_recorder_bookings_equal_its_bookings_made_every_call():
    """A booking worked out once and booked again is the booking made every call, to the
    modeled second, also after the recorder's cost model or placement is replaced."""
    from substrate.calls import Call, Placement
    from substrate.recorder import Recorder

    pl = Placement.node_major(2, 2)
    calls = [Call("a", "allreduce", pl.world, nbytes=4000, itemsize=4, op="sum"),
             Call("b", "bcast", (0, 2), nbytes=64, root=1),
             Call("c", "allgather", (1, 3), blocks=(8, 8))]
    every, once = Recorder(pl, 2), Recorder(pl, 2)
    books = [once.booking(c, payload=c.nbytes, intra=5, inter=7, messages=3, links={"inter"})
             for c in calls]
    for rnd in range(3):
        if rnd == 2:
            for r in (every, once):
                r.cost = CostModel(inter_lat=1e-3)
                r.placement = Placement.node_major(1, 4)
        for c, b in zip(calls, books):
            every.book(c, payload=c.nbytes, intra=5, inter=7, messages=3, links=("inter",))
            once.book_fixed(b)
    assert every.ledger.local() == once.ledger.local()
    a = Ledger()
    a.record("x", payload=3, intra=np.int64(2), messages=1, modeled_s=0.5, links=("intra",))
    b = Ledger()
    b.add("x", 3, 2, 0, 1, 0.5, ("intra",))
    assert a.local() == b.local()
    with pytest.raises(ValueError, match="non-empty phase"):
        b.add("", 1, 0, 0, 0, 0.0)
