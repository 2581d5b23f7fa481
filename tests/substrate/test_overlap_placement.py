"""Real overlap and placement-true traffic.

* ``--overlap on`` hands DDP's buckets to the communication thread during the backward; the
  run must give bitwise the results of ``--overlap off`` (every call blocking where it is
  issued), with the same bytes, and its simulated step may only be shorter.
* Every placement a launcher can produce (round-robin, any node map) keeps measured ==
  predicted: the plans price their records on the run's real placement.
* Without ``MPI_THREAD_MULTIPLE`` the stream falls back to blocking calls and says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpi_helpers import (
    JobBatch,
    assert_fails_on_every_rank,
    assert_measured_equals_predicted,
    read_summary,
    run_mpi,
)

from substrate.calls import Placement

pytestmark = pytest.mark.mpi

DDP = ["train", "--method", "ddp", "--steps", 4, "--eval-every", 2, "--bucket-mib", 0.02,
       "--compute-source", "flops", "--device-tflops", 0.01]
#: links slow enough that the buckets' rings outlast the backward they overlap
SLOW = ["--inter-bw", 0.05, "--intra-bw", 0.2]


def _lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


#: DDP's all-reduce and the placement of the overlap runs
OVERLAPPED = [("ring", ("--ranks-per-node", 2)), ("hierarchical", ("--node-map", "0,1,0,1"))]
#: steps of the runs that send during the backward
BACKWARD_STEPS = 4


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every successful run of this module, in one MPI launch per world size."""
    b = JobBatch(tmp_path_factory.mktemp("placement_jobs"))
    root = b.root
    for allreduce, shape in OVERLAPPED:
        for mode in ("on", "off"):
            name = f"overlap-{allreduce}-{mode}"
            b.add(name, 4, "dataparallel", *DDP, "--allreduce", allreduce, *shape,
                  "--overlap", mode, *SLOW, "--out", root / name)
    for case, (n, args) in SENDING_IN_BACKWARD.items():
        base = ["--compute-source", "flops"]
        if "--device-tflops" not in args:
            base += ["--device-tflops", 0.01]
        for mode in ("on", "off"):
            name = f"backward-{case}-{mode}"
            b.add(name, n, "dataparallel", "train", *args, *base, "--steps", BACKWARD_STEPS,
                  "--eval-every", 2, "--checkpoint-every", BACKWARD_STEPS, "--overlap", mode,
                  "--progress-every", 0, "--trace", root / f"{name}.json", "--trace-steps",
                  "last", "--out", root / name)
    for method, extra in PLACED_METHODS:
        for n, node_map in NODE_MAPS:
            name = f"placed-{method}-{'-'.join(extra)}-{node_map}"
            b.add(name, n, "dataparallel", "train", "--method", method, "--steps", 3,
                  "--eval-every", 3, "--node-map", node_map, "--out", root / name, *extra)
    for i, (method, extra, shape) in enumerate(REPLAYED):
        prof = root / f"replay-{i}.json"
        args = ["train", "--method", method, "--steps", 4, "--eval-every", 2, *extra, *shape]
        b.add(f"replay-{i}-run", 4, "dataparallel", *args, "--out", root / f"replay-{i}-run",
              "--compute-profile-out", prof)
        b.add(f"replay-{i}-costed", 4, "dataparallel", *args, "--out",
              root / f"replay-{i}-costed", "--compute-source", "profile", "--compute-profile",
              prof)
        b.add(f"replay-{i}-replay", 4, "runner.replay", "--compute-profile", prof, "--sleep",
              "off", *shape, "--out", root / f"replay-{i}-replay")
    b.add("elsewhere-run", 4, "dataparallel", "train", "--method", "ddp", "--steps", 2,
          "--ranks-per-node", 2, "--out", root / "elsewhere-run", "--compute-profile-out",
          root / "elsewhere.json")
    b.add("elsewhere-rr", 4, "runner.replay", "--compute-profile", root / "elsewhere.json",
          "--sleep", "off", "--node-map", "round-robin:2", "--out", root / "elsewhere-rr")
    for system, (module, args) in SYSTEM_JOBS.items():
        for n, node_map in SYSTEM_PLACEMENTS:
            if _uneven(n, node_map) and system in UNIFORM_ONLY:
                continue   # refused: its own launch, in the test
            name = f"system-{system}-{node_map}"
            b.add(name, n, module, *args, "--node-map", node_map, "--progress-every", 0,
                  "--out", root / name)
    for name, (module, *rest) in JOB_SIMULATED:
        b.add(f"jobsim-{name}", 4, module, *rest, "--ranks-per-node", 2, "--progress-every",
              0, "--out", root / f"jobsim-{name}", "--compute-profile-out",
              root / f"jobsim-{name}.json")
    return b


@pytest.mark.parametrize("allreduce,shape", OVERLAPPED)
def test_overlap_on_equals_overlap_off_bitwise(jobs, allreduce, shape):
    runs = {}
    for mode in ("on", "off"):
        out = jobs.run(f"overlap-{allreduce}-{mode}")
        runs[mode] = (read_summary(out), _lines(out))
    (s_on, l_on), (s_off, l_off) = runs["on"], runs["off"]
    # the same numbers to the last bit: losses, accuracies, bytes of every interval
    keys = ("loss", "test_accuracy", "inter_node_bytes", "intra_node_bytes")
    assert [[x[k] for k in keys] for x in l_on] == [[x[k] for k in keys] for x in l_off]
    assert s_on["traffic"] == s_off["traffic"]
    assert_measured_equals_predicted(s_on)
    assert s_on["overlap"]["communication_thread"] is True
    assert s_on["overlap"]["mode"] == "on" and s_off["overlap"]["mode"] == "off"
    # off: every call blocks after the backward; on: the buckets (more than one) overlap the
    # backward in the job simulation, as in the run (the same FLOP-costed compute)
    assert s_on["timing"]["sim_s"] < s_off["timing"]["sim_s"] * (1 - 1e-3)


def _final_state(out, steps, ranks):
    """Every rank's parameters, optimizer and strategy arrays after the last step (its last
    checkpoint), timing statistics left out."""
    state = []
    for r in range(ranks):
        with np.load(out / "checkpoints" / f"ckpt-r{r}-s{steps:08d}.npz") as f:
            state.append({k: f[k] for k in f.files
                          if k.startswith(("model/", "opt/", "strategy/residual",
                                           "strategy/velocity", "strategy/mask",
                                           "strategy/hook_mask", "strategy/tracker/"))})
    return state


#: the systems whose runs send during the backward: method options, world and
#: placement; the flops source makes SSFusion's profile-based plan the same in both runs
SENDING_IN_BACKWARD = {
    "pactrain-3x1": (3, ["--method", "pactrain", "--warmup-steps", 1, "--stable-window", 1,
                         "--bucket-mib", 0.02, "--ranks-per-node", 3]),
    "pactrain-ternary-2x2": (4, ["--method", "pactrain", "--ternary", "--warmup-steps", 1,
                                 "--stable-window", 1, "--bucket-mib", 0.02,
                                 "--ranks-per-node", 2]),
    "pactrain-ternary-wait-backward-3x1": (3, ["--method", "pactrain", "--ternary",
                                               "--ternary-wait", "backward", "--warmup-steps",
                                               1, "--stable-window", 1, "--bucket-mib", 0.02,
                                               "--ranks-per-node", 3]),
    "sdp-2x2": (4, ["--method", "sdp", "--ranks-per-node", 2]),
    "ssfusion-2x2": (4, ["--method", "ssfusion", "--profile-steps", 2, "--ranks-per-node", 2]),
    # SSFusion-O: at 1e-7 TFLOP/s the worker's saving beats the measured slowdown (the
    # offload guard keeps it); two count buffers leave tensors that fit the buffer deadline
    "ssfusion-offload-3x1": (3, ["--method", "ssfusion", "--offload", "--fusion-policy",
                                 "count", "--buffers", 2, "--profile-steps", 2,
                                 "--ranks-per-node", 3, "--device-tflops", 1e-7]),
}


@pytest.mark.parametrize("case", sorted(SENDING_IN_BACKWARD))
def test_systems_send_during_the_backward_bitwise_as_without_overlap(jobs, case):
    """PacTrain (plain, ternary), SDP and SSFusion (selective, SSFusion-O) issue their calls
    from the backward's ready hook with ``--overlap on`` and block after the backward with
    ``--overlap off``: parameters, optimizer and strategy state, losses, accuracies, bytes
    and messages are bitwise the same; traffic is the plan's; the simulated steps of ``on``
    (``--trace``) have calls during the backward and ``off`` none, as the runs did."""
    n, _ = SENDING_IN_BACKWARD[case]
    runs = {}
    for mode in ("on", "off"):
        out = jobs.run(f"backward-{case}-{mode}")
        runs[mode] = (read_summary(out), _lines(out), _final_state(out, BACKWARD_STEPS, n))
    (s_on, l_on, st_on), (s_off, l_off, st_off) = runs["on"], runs["off"]
    keys = ("loss", "test_accuracy", "inter_node_bytes", "intra_node_bytes")
    assert [[x[k] for k in keys] for x in l_on] == [[x[k] for k in keys] for x in l_off]
    assert s_on["traffic"] == s_off["traffic"]                  # bytes and messages
    for a, b in zip(st_on, st_off):
        assert a.keys() == b.keys() and any(k.startswith("model/params") for k in a)
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), k
    assert_measured_equals_predicted(s_on)
    assert s_on["calls"]["per_rank"] == s_off["calls"]["per_rank"]
    for mode, during in (("on", True), ("off", False)):
        trace = json.loads((jobs.root / f"backward-{case}-{mode}.json").read_text())
        trace = trace["traceEvents"]
        events = [e for e in trace if e.get("ph") == "X" and e["pid"] == 0]
        end = max(e["ts"] + e["dur"] for e in events if e["name"].startswith("backward:"))
        first = min(e["ts"] for e in events if e["args"]["kind"] == "call")
        assert (first < end) is during, (mode, first, end)


def test_without_thread_multiple_the_stream_blocks_and_says_so(tmp_path):
    out = tmp_path / "serialized"
    env = {"MPI4PY_RC_THREAD_LEVEL": "serialized"}
    run_mpi(None, 2, *DDP, "--ranks-per-node", 1, "--out", out, module="dataparallel",
            timeout=180, env=env)
    s = read_summary(out)
    assert s["overlap"]["communication_thread"] is False
    assert "MPI_THREAD_MULTIPLE" in s["overlap"]["why_not"]
    assert_measured_equals_predicted(s)


PLACED_METHODS = [("ddp", []), ("ddp", ["--allreduce", "hierarchical"]),
                  ("topk", ["--density", "0.02"]), ("fp16", [])]
NODE_MAPS = [(4, "round-robin:2"), (6, "round-robin:3"), (6, "0,1,2,0,1,2"),
             (6, "2,2,0,1,1,0")]


@pytest.mark.parametrize("method,extra", PLACED_METHODS)
@pytest.mark.parametrize("n,node_map", NODE_MAPS)
def test_any_placement_measured_equals_predicted(jobs, method, extra, n, node_map):
    """Round-robin puts neighbouring ranks on different nodes: a world ring crosses nodes on
    every link, so the inter-node bytes are not node-major's; measured == predicted holds
    because the prediction prices the plan's records on the run's placement."""
    s = read_summary(jobs.run(f"placed-{method}-{'-'.join(extra)}-{node_map}"))
    assert_measured_equals_predicted(s)
    placement = Placement.parse(node_map, n)
    assert s["topology"]["node_of"] == list(placement.node_of)
    if method == "ddp" and not extra and node_map.startswith("round-robin"):
        # every ring link crosses nodes: inter = total = 2 (p-1) x the gradient bytes x steps
        tr = s["traffic"]["measured"]
        assert tr["intra_node_bytes"] == 0 and tr["inter_node_bytes"] > 0


@pytest.mark.parametrize("node_map,message", [
    ("round-robin:3", "positive divisor of the 4 ranks"),
    ("0,1,0", "gives 3 node ids for 4 ranks"),
    ("zero,one", "not a placement"),
    ("block:0", "positive divisor"),
    ("0,1,-1,0", "one non-negative id per rank"),
])
def test_bad_node_map_is_refused_on_every_rank(tmp_path, node_map, message):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "ddp", "--steps", 1,
                                                "--node-map", node_map],
                               message, tmp_path / "x", n=4)


def test_node_map_and_ranks_per_node_are_exclusive(tmp_path):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "ddp", "--steps", 1,
                                                "--node-map", "block:2", "--ranks-per-node",
                                                2],
                               "give one", tmp_path / "x", n=4)


# -- replay (compute from the profile, communication real) -------------------------------------
REPLAYED = [
    ("ddp", ["--bucket-mib", 0.02], ("--ranks-per-node", 2)),
    ("ddp", ["--allreduce", "hierarchical", "--bucket-mib", 0.02], ("--node-map", "0,1,0,1")),
    ("topk", ["--density", 0.02], ("--ranks-per-node", 2)),
    ("fp16", [], ("--node-map", "round-robin:2")),
    # calls issued from the backward's ready hook, compute between units
    ("pactrain", ["--ternary", "--warmup-steps", 1, "--stable-window", 1, "--bucket-mib", 0.02],
     ("--ranks-per-node", 2)),
    ("sdp", [], ("--ranks-per-node", 2)),
    ("ssfusion", ["--fusion", "per-tensor", "--fusion-policy", "count", "--profile-steps", 1],
     ("--ranks-per-node", 2)),
]


@pytest.mark.parametrize("i", range(len(REPLAYED)),
                         ids=[f"{m}-{'-'.join(map(str, e))}" for m, e, _ in REPLAYED])
def test_replay_repeats_the_calls_and_the_profiled_time(jobs, i):
    """A recorded run, the same job costed from its profile, and the replay of its programs:
    the replay's calls are the run's (per-rank digests), its ledger is the run's byte for byte,
    and its simulated time (one piece, when it finishes) is the profile-costed run's (in
    pieces at its metrics lines, each starting every rank where it ended the last) exactly."""
    real, costed, rep = (read_summary(jobs.run(f"replay-{i}-{d}"))
                         for d in ("run", "costed", "replay"))
    assert rep["calls"]["per_rank"] == real["calls"]["per_rank"]
    assert rep["traffic"]["measured"] == real["traffic"]["measured"]
    assert rep["timing"]["sim_s"] == pytest.approx(costed["timing"]["sim_s"], rel=1e-12)
    assert rep["metrics"]["steps"] == 4
    # the job simulation of the same programs: a step per step, the ledger's bytes moved
    job = rep["steps_max"]["step_s"]
    assert len(job) == 4 and min(job) > 0
    t = rep["traffic"]["measured"]
    assert rep["clock"]["bytes_moved"] == {"intra": pytest.approx(t["intra_node_bytes"]),
                                           "inter": pytest.approx(t["inter_node_bytes"])}


def test_replay_on_another_placement_moves_the_bytes_to_its_links(jobs):
    """The records carry world ranks: replayed round-robin, the same calls cross nodes on
    every ring link (the ledger follows the replay's placement, the calls do not change)."""
    real, rr = (read_summary(jobs.run(f"elsewhere-{d}")) for d in ("run", "rr"))
    assert rr["calls"]["per_rank"] == real["calls"]["per_rank"]
    m0, m1 = real["traffic"]["measured"], rr["traffic"]["measured"]
    total = m0["inter_node_bytes"] + m0["intra_node_bytes"]
    assert m1["inter_node_bytes"] + m1["intra_node_bytes"] == total
    assert m1["intra_node_bytes"] == 0 and m1["inter_node_bytes"] == total


def _old_profile(t):
    """A version-1 profile: compute tables, no programs."""
    p = t / "old.json"
    p.write_text(json.dumps({"format": "spardist-compute-profile", "version": 1,
                             "ranks": [{}, {}]}))
    return p


@pytest.mark.parametrize("make,message", [
    (lambda t: t / "missing.json", "no such file"),
    (_old_profile, "holds no programs to replay"),
])
def test_replay_refuses_what_it_cannot_replay(tmp_path, make, message):
    prof = make(tmp_path)
    assert_fails_on_every_rank("runner.replay", ["--compute-profile", prof], message,
                               tmp_path / "x", n=2)


def test_replay_refuses_another_world_size(tmp_path):
    prof = tmp_path / "prof.json"
    run_mpi(None, 2, "train", "--method", "ddp", "--steps", 1, "--ranks-per-node", 1,
            "--out", tmp_path / "run", "--compute-profile-out", prof, module="dataparallel",
            timeout=180)
    assert_fails_on_every_rank("runner.replay", ["--compute-profile", prof],
                               "recorded on 2 ranks; replay it on 2", tmp_path / "x", n=4)


# -- every system on round-robin and uneven placements ----------------------------------------
SYSTEM_JOBS = {
    "ddp": ("dataparallel", ["train", "--method", "ddp", "--steps", 2]),
    "topk": ("dataparallel", ["train", "--method", "topk", "--steps", 2]),
    "fp16": ("dataparallel", ["train", "--method", "fp16", "--steps", 2]),
    "pactrain": ("dataparallel", ["train", "--method", "pactrain", "--steps", 3,
                                  "--warmup-steps", 1, "--stable-window", 1]),
    "sdp": ("dataparallel", ["train", "--method", "sdp", "--steps", 2]),
    "ssfusion": ("dataparallel", ["train", "--method", "ssfusion", "--steps", 3,
                                  "--profile-steps", 1]),
    "hsadmm": ("hsadmm", ["train", "--iters", 2, "--local-steps", 2]),
    "flat-admm": ("hsadmm", ["train", "--method", "flat-admm", "--iters", 2,
                             "--local-steps", 2]),
    "sparse_sgd": ("sparse_sgd", ["train", "--neurons", 1024, "--layers", 3, "--steps", 2]),
}
#: systems whose algorithm needs equal nodes (they refuse others, naming why)
UNIFORM_ONLY = {"sdp", "hsadmm"}


SYSTEM_PLACEMENTS = [(4, "round-robin:2"), (5, "0,0,0,1,1")]


def _uneven(n: int, node_map: str) -> bool:
    """An explicit node map whose nodes hold different numbers of ranks."""
    ids = node_map.split(",")
    return len(ids) == n and len({ids.count(x) for x in set(ids)}) > 1


@pytest.mark.parametrize("system", sorted(SYSTEM_JOBS))
@pytest.mark.parametrize("n,node_map", SYSTEM_PLACEMENTS, ids=["round-robin-2x2", "uneven-3+2"])
def test_every_system_measured_equals_predicted_on_any_placement(jobs, tmp_path, system, n,
                                                                 node_map):
    module, args = SYSTEM_JOBS[system]
    if _uneven(n, node_map) and system in UNIFORM_ONLY:
        assert_fails_on_every_rank(module, [*args, "--node-map", node_map, "--progress-every", 0],
                                   "needs every node to hold the same number of ranks",
                                   tmp_path / "run", n=n)
        return
    s = read_summary(jobs.run(f"system-{system}-{node_map}"))
    assert_measured_equals_predicted(s)
    assert s["topology"]["node_of"] == list(Placement.parse(node_map, n).node_of)


def test_replay_sleeps_sum_to_the_profile(monkeypatch):
    """Many short compute blocks (H-SADMM's dozens a step): the sleeps add up to the profile's
    total within one timer overshoot, not one per block (a fake clock that oversleeps every
    call by 90 us, as this box's timer slack does)."""
    from runner import replay as rp

    now = [0.0]
    monkeypatch.setattr(rp.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(rp.time, "sleep", lambda s: now.__setitem__(0, now[0] + s + 9e-5))
    nap, blocks = rp.Sleeper(), [2e-4] * 200 + [5e-5] * 50      # 42.5 ms in 250 blocks
    for s in blocks:
        nap(s)
    assert sum(blocks) <= now[0] <= sum(blocks) + 9e-5 + 1e-12
    # without the debt: one overshoot per block (what the replay did before)
    assert sum(b + 9e-5 for b in blocks) - now[0] > 0.02
    # --dilation K: the same blocks sleep K times as long, still within one overshoot
    now[0] = 0.0
    nap = rp.Sleeper(dilation=16.0)
    for s in blocks:
        nap(s)
    assert 16 * sum(blocks) <= now[0] <= 16 * sum(blocks) + 9e-5 + 1e-12


@pytest.mark.parametrize("flag,value,message", [
    ("--dilation", "0.5", "--dilation 0.5: must be >= 1"),
    ("--eager-limit", "-1", "--eager-limit -1: must be >= 0 bytes"),
    ("--link-sharing", "wfq", "--link-sharing: invalid choice: 'wfq' (choose from"),
    ("--ack-overhead", "1.5", "--ack-overhead 1.5: must be in [0, 1) bytes per byte"),
])
def test_replay_refuses_a_bad_dilation_or_eager_limit(tmp_path, capsys, flag, value, message):
    from runner import replay as rp

    prof = tmp_path / "p.json"
    prof.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        rp.main(["--compute-profile", str(prof), flag, value, "--out", str(tmp_path / "o")])
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_lab_jobs_inherit_the_timer_slack():
    """A dilated lab sets its jobs' timer slack (K x 50 us): inherited by every process the
    job forks and execs (MPI's launcher, its proxies, the ranks)."""
    import subprocess

    from lab.jobs import _timer_slack_setter

    out = subprocess.run(["sh", "-c", "sh -c 'cat /proc/self/timerslack_ns'"],
                         preexec_fn=_timer_slack_setter(800.0), capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "800000"


JOB_SIMULATED = [
    ("hsadmm", ["hsadmm", "train", "--model", "cnn", "--iters", 2, "--local-steps", 1]),
    ("sparse_sgd", ["sparse_sgd", "train", "--neurons", 1024, "--layers", 3, "--batch-size",
                    16, "--partition", "random", "--steps", 2]),
]


@pytest.mark.parametrize("name,args", JOB_SIMULATED, ids=[n for n, _ in JOB_SIMULATED])
def test_job_simulation_of_hsadmm_and_hsgd_moves_the_ledgers_bytes(jobs, name, args):
    """H-SADMM (node and leader communicators, waiting followers) and H-SGD (direct messages,
    receives, wait-alls) programs, recorded on 2 nodes x 2 ranks and simulated together
    (simulation.jobsim, in this process): every step completes and the bytes moved inside and
    between the nodes are the run's measured ledger."""
    from simulation.jobsim import simulate_profile
    from simulation.profile import load_profile
    from substrate.costmodel import CostModel

    real = read_summary(jobs.run(f"jobsim-{name}"))
    prof = jobs.root / f"jobsim-{name}.json"
    job = simulate_profile(load_profile(prof), (0, 0, 1, 1), CostModel())
    t = real["traffic"]["measured"]
    assert job["bytes"] == {"intra": pytest.approx(t["intra_node_bytes"]),
                            "inter": pytest.approx(t["inter_node_bytes"])}
    assert len(job["step_s"]) == 2 and min(job["step_s"]) > 0
