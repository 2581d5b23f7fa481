"""``commvol scale`` from the job simulation of every rank's generated program: one step of a
tiny two-layer model against closed forms written here (compute + ring time; two buckets
overlapping the backward and sharing the link: a max-plus formula), Top-K's selection chain,
SSFusion's buffers on one channel, PacTrain's packed buckets, SDP's holder rings, the ADMM
chain against the systems' α–β communication, speedup sanity, the device model, and bad
input."""

import dataclasses
import itertools
import json
import math

import pytest

from commvol.__main__ import main
from commvol.job import Job
from commvol.predict import predict, resolve_model
from commvol.scale import scaling
from commvol.systems import sdp_plan
from commvol.workload import DeviceModel, Unit, units_for_spec
from dataparallel.ddp import DDPOptions, DDPPlan
from dataparallel.pactrain import PacTrainOptions
from dataparallel.sdp import SDPOptions
from dataparallel.topk import SELECT_PASSES, TopKOptions
from hsadmm.config import HSADMMConfig
from models.layers import Linear, Sequential
from models.modelspec import spec_from_layers
from simulation.cluster import SHIPPED, Cluster, Device
from substrate.calls import Placement, Ready
from substrate.costmodel import CostModel

RATE = 1.0          # TFLOP/s
GBS = 1.0           # GB/s of the memory-bound blocks
F1, F2 = 3e6, 1e6   # forward FLOPs per sample of fc1, fc2 (backward: twice)
DEVICE = DeviceModel(Device(peak_tflops=RATE, memory_gbs=GBS))


@pytest.fixture(scope="module")
def tiny():
    """fc1 (4 -> 8) and fc2 (8 -> 2) without biases: 32 + 16 parameters; flat (backward) order
    puts fc2's 16 first."""
    spec = spec_from_layers("tiny", Sequential([("fc1", Linear(4, 8, bias=False)),
                                                ("fc2", Linear(8, 2, bias=False))]), (4,), 2)
    off = spec.layout.offsets
    units = (Unit("fc1", off["fc1.weight"], off["fc1.weight"] + 32, F1, 2 * F1),
             Unit("fc2", off["fc2.weight"], off["fc2.weight"] + 16, F2, 2 * F2))
    return spec, units


def _step(system, spec, M, P, options, units, cost, batch, device=DEVICE):
    """Two steps of the job; ``first``: the first one, all ranks starting together (what the
    closed forms here describe); the second (``step_s``, the steady one) is never longer: the
    ranks that finished early go on (the drift of a real job)."""
    r = Job(system, spec, M, P, options, units, device, batch).run(Cluster.two_tier(cost))
    r["first"] = r["steps_s"][0]
    assert r["step_s"] <= r["first"] * (1 + 1e-12)
    return r


def _sec(flops):
    return flops / (RATE * 1e12)


def _opt(T):
    return max(6 * T / (RATE * 1e12), 20 * T / (GBS * 1e9))


def _ring(n, p, alpha, bw):
    """(L, W) of a ring all-reduce of n bytes over p ranks: 2(p-1) alpha, 2(p-1)/p n / bw."""
    return 2 * (p - 1) * alpha, 2 * (p - 1) / p * n / bw


def _eager_ring(count, itemsize, p, start, alpha, bw):
    """When the last member finishes a ring all-reduce of ``count`` elements started by every
    member at ``start``, every hop alike: a walk of its 2 (p-1) rounds (chunks of the
    numpy.array_split cut), written here from the algorithm.  A member sends round s as soon
    as it has round s-1's message (eager sends); a message waits its latency, then for the
    hop's previous message, then moves its bytes."""
    chunks = [len(c) for c in __import__("numpy").array_split(range(count), p)]
    t = [start] * p                   # when each member has its previous round's message
    free = [start] * p                # when each hop (member i -> i+1) is free again
    for s in range(2 * (p - 1)):
        got = [0.0] * p
        for i in range(p):
            c = chunks[(i - s) % p] if s < p - 1 else chunks[(i + 1 - (s - p + 1)) % p]
            arrive = max(t[i] + alpha, free[i]) + c * itemsize / bw
            free[i] = arrive
            got[(i + 1) % p] = arrive
        t = got
    return max(t)


def test_ddp_one_bucket_is_compute_plus_ring_time(tiny):
    spec, units = tiny
    alpha, bw, batch = 1e-4, 1e6, 100
    opts = DDPOptions(bucket_mib=1.0)
    assert DDPPlan.for_layout(spec.layout, opts).buckets == ((0, 48),)
    r = _step("ddp", spec, 2, 1, opts, units, CostModel(inter_bw=bw, inter_lat=alpha), batch)
    compute = batch * _sec(3 * F1 + 3 * F2)
    L, W = _ring(4 * 48, 2, alpha, bw)
    # the only bucket is ready when the backward ends; the update waits for it; both steps
    assert r["steps_s"] == pytest.approx([compute + L + W + _opt(48)] * 2, rel=1e-12)


@pytest.mark.parametrize("bw", [1e6, 2e4, 5e3])
def test_ddp_two_buckets_overlap_the_backward_on_one_stream(tiny, bw):
    """Bucket A (fc2, 16 floats) is ready after fc2's backward, bucket B (fc1, 32 floats) after
    fc1's.  The trainer issues the buckets in order on one communication stream (PyTorch DDP),
    so B starts when it is ready and A has ended: A ends at ready_A + L_A + W_A, B at
    max(ready_B, end_A) + L_B + W_B; the update waits for B (and the backward)."""
    spec, units = tiny
    alpha, batch = 2e-5, 200
    opts = DDPOptions(bucket_mib=64 / 2 ** 20)
    assert DDPPlan.for_layout(spec.layout, opts).buckets == ((0, 16), (16, 48))
    r = _step("ddp", spec, 2, 1, opts, units, CostModel(inter_bw=bw, inter_lat=alpha), batch)
    fwd = batch * _sec(F1 + F2)
    ready_a = fwd + batch * _sec(2 * F2)
    ready_b = ready_a + batch * _sec(2 * F1)
    La, Wa = _ring(4 * 16, 2, alpha, bw)
    Lb, Wb = _ring(4 * 32, 2, alpha, bw)
    end_a = ready_a + La + Wa
    end_b = max(ready_b, end_a) + Lb + Wb
    assert r["first"] == pytest.approx(max(end_b, ready_b) + _opt(48), rel=1e-9)
    if end_a < ready_b:      # A hidden behind fc1's backward: shorter than nothing overlapped
        assert r["first"] < ready_b + La + Wa + Lb + Wb + _opt(48) - 1e-12


def test_ddp_hierarchical_and_topk_chains(tiny):
    spec, units = tiny
    cost = CostModel(intra_bw=4e6, intra_lat=1e-5, inter_bw=1e6, inter_lat=1e-4)
    batch, M, P = 50, 2, 2
    compute = batch * _sec(3 * F1 + 3 * F2)
    # one bucket: intra ring (P) -> leaders' ring (M) -> binomial bcast (ceil log2 P levels)
    r = _step("ddp-hierarchical", spec, M, P, DDPOptions(bucket_mib=1.0), units, cost, batch)
    n = 4 * 48
    intra = 2 * (P - 1) * (1e-5 + n / P / 4e6)
    inter = 2 * (M - 1) * (1e-4 + n / M / 1e6)
    bcast = 1 * (1e-5 + n / 4e6)
    assert r["first"] == pytest.approx(compute + intra + inter + bcast + _opt(48), rel=1e-9)
    # Top-K at density 0.25: k = 8 of fc1, 4 of fc2; selection after the backward, then the
    # ring all-gather of 8K bytes a rank over ranks 0 -> 1 (intra) -> 2 (inter) -> 3 (intra)
    # -> 0 (inter), then decoding.  A rank forwards a block as soon as it has it (eager): rank
    # i+1 has round s's block at t_i(s-1) + hop_i, so after p - 1 = 3 rounds the last rank
    # has waited for two inter hops and one intra hop, not 3 of the slowest (the α–β bound)
    K, p = 12, M * P
    r = _step("topk", spec, M, P, TopKOptions(density=0.25), units, cost, batch)
    select = SELECT_PASSES * 4 * 48 / (GBS * 1e9)
    hop_inter, hop_intra = 1e-4 + 8 * K / 1e6, 1e-5 + 8 * K / 4e6
    gather = 2 * hop_inter + hop_intra
    assert gather < cost.ring_allgather_time(p * 8 * K, p, "inter")
    decode = (p * 8 * K + 4 * 48) / (GBS * 1e9)
    assert r["first"] == pytest.approx(compute + select + gather + decode + _opt(48),
                                        rel=1e-9)


def test_ssfusion_buffers_chain_on_one_channel(tiny):
    """SSFusion per-tensor on two fusion buffers (fc2's 16 weights, then fc1's 32), k = 1 each:
    each buffer's sparsification runs on the compute stream right after the backward wrote its
    tensors (the pipeline), its all-gather (8 bytes a rank) after it and the previous
    all-gather (one channel); decoding follows each all-gather; the update waits for all."""
    from dataparallel.ssfusion import SSFusionOptions

    spec, units = tiny
    cost = CostModel(intra_bw=4e6, intra_lat=1e-5, inter_bw=1e6, inter_lat=1e-4)
    batch, M, P = 50, 2, 1          # two ranks alike: every message one inter hop
    p = M * P
    o = SSFusionOptions(fusion="per-tensor", fusion_policy="count", buffers=2)
    r = _step("ssfusion", spec, M, P, o, units, cost, batch)

    def mem(ops):                       # roofline of a compute item (memory-bound here)
        return max(ops / (RATE * 1e12), 4 * ops / (GBS * 1e9))

    sp0, sp1 = mem(3 * 16 + 2 * 16 + 16 + 2), mem(3 * 32 + 2 * 32 + 32 + 2)
    gather = (p - 1) * 1e-4 + (p - 1) / p * (p * 8) / 1e6
    un0, un1 = mem(2 * p + 16), mem(2 * p + 32)
    s0 = batch * _sec(F1 + F2 + 2 * F2) + sp0          # buffer 0 before fc1's backward
    s1 = s0 + batch * _sec(2 * F1) + sp1
    g0 = s0 + gather
    g1 = max(s1, g0) + gather
    u0 = max(s1, g0) + un0
    u1 = max(u0, g1) + un1
    assert r["first"] == pytest.approx(max(u1, g1) + _opt(48), rel=1e-9)


def test_pactrain_packed_buckets_overlap_the_backward_like_ddps(tiny):
    """PacTrain's steady step all-reduces every bucket's survivors after the backward wrote the
    bucket, one bucket after the other on one stream: with nothing pruned its step is DDP's; at
    ratio 0.5 bucket A (fc2: K = 8 of 16) overlaps fc1's backward, bucket B (fc1: K = 16 of
    32) starts when both fc1's gradients and A are done."""
    spec, units = tiny
    alpha, batch, bw = 2e-5, 200, 2e4
    cost = CostModel(inter_bw=bw, inter_lat=alpha)
    mib = 64 / 2 ** 20
    ddp = _step("ddp", spec, 2, 1, DDPOptions(bucket_mib=mib), units, cost, batch)
    o = PacTrainOptions(prune_ratio=0.0, bucket_mib=mib, warmup_steps=0,
                        prune_score="magnitude")
    assert _step("pactrain", spec, 2, 1, o, units, cost, batch)["step_s"] == \
        pytest.approx(ddp["step_s"], rel=1e-12)
    r = _step("pactrain", spec, 2, 1, dataclasses.replace(o, prune_ratio=0.5), units, cost,
              batch)
    ready_a = batch * _sec(F1 + F2 + 2 * F2)
    ready_b = ready_a + batch * _sec(2 * F1)
    La, Wa = _ring(4 * 8, 2, alpha, bw)
    Lb, Wb = _ring(4 * 16, 2, alpha, bw)
    end_a = ready_a + La + Wa
    assert ready_a < ready_b < end_a             # A overlaps the backward, B waits for A
    assert r["first"] == pytest.approx(end_a + Lb + Wb + _opt(48), rel=1e-9)


@pytest.mark.parametrize("coverage", ["4/4", "3/4"])
def test_sdp_holder_groups_run_one_after_another_after_their_gradients(coverage):
    """N-SDP on one node of 4: the world ring of the unmasked coordinates and one ring per
    window of 3 holders, chained (any two windows share a rank): each ring starts when the
    backward has written its coordinates and the ring before it has ended; the update follows
    the last one.  With windows the job's messages are eager, so a rank outside one window
    starts its next ring's sends before that window's ring ends: the step is at most the
    chain of whole rings and at least the last ring alone after its gradients."""
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    rate, batch = 0.02, 32
    dev = DeviceModel(Device(peak_tflops=rate, memory_gbs=10.0))
    cost = CostModel(intra_bw=50.0, intra_lat=1e-5)
    opts = SDPOptions(coverage=coverage)
    r = _step("sdp", spec, 1, 4, opts, units, cost, batch, dev)
    fwd = sum(dev.forward(u, batch) for u in units)
    done, acc = {}, fwd
    for u in reversed(units):
        acc += dev.backward(u, batch)
        done[u.name] = acc

    def ready(lo, hi):
        return max(done[u.name] for u in units if u.lo < hi and u.hi > lo)

    calls = sdp_plan(spec, 1, 4, opts).calls(Placement.node_major(1, 4))
    assert len(calls) == (1 if coverage == "4/4" else 5)
    end = last = 0.0
    for i, c in enumerate(calls):
        assert i == 0 or i - 1 in c.after               # one chain
        (rd,) = [d for d in c.after if isinstance(d, Ready)]
        end = _eager_ring(c.nbytes // 4, 4, c.size, max(ready(rd.lo, rd.hi), end), 1e-5, 50.0)
        last = _eager_ring(c.nbytes // 4, 4, c.size, ready(rd.lo, rd.hi), 1e-5, 50.0)
    opt = dev.optimizer(spec.layout.total)
    if coverage == "4/4":
        assert r["first"] == pytest.approx(max(end, acc) + opt, rel=1e-9)
    else:
        assert max(last, acc) + opt < r["first"] < max(end, acc) + opt


@pytest.mark.parametrize("system,freeze,bucket_mib,M,P", [
    ("hsadmm", 4, 32.0, 2, 1), ("hsadmm", 0, 0.02, 3, 1), ("flat-admm", 4, 32.0, 2, 1),
    ("hsadmm", 4, 32.0, 2, 2), ("flat-admm", 4, 32.0, 2, 2)])
def test_admm_iteration_is_local_epochs_then_the_chain(system, freeze, bucket_mib, M, P):
    """No overlap is possible in an ADMM iteration (every phase waits for the one before, the
    compact buckets one after the other as the leaders' loop sends them), and nothing else
    shares the links.  With one rank a node every ring's hops cross nodes alike and the
    iteration is the local training plus every call's α–β time; with two, a world ring's
    intra-node hops let ranks run ahead (eager messages) and it is shorter than that bound."""
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    dev = DeviceModel(Device(peak_tflops=0.01, memory_gbs=5.0))
    cost = CostModel()
    D, b, E = 4000, 32, 2.0
    rows = scaling(system, spec, [M * P], P, units=units, device=dev,
                   cluster=Cluster.two_tier(cost), dataset_size=D, batch_size=b,
                   local_epochs=E, freeze_iter=freeze, bucket_mib=bucket_mib)
    (r,) = rows
    per_rank = D / (M * P)
    steps = math.ceil(per_rank / b)
    batches = [b] * (steps - 1) + [per_rank - (steps - 1) * b]
    epoch = sum(dev.forward(u, x) + dev.backward(u, x) for u in units for x in batches) + \
        steps * dev.optimizer(spec.layout.total)
    pred = predict(system, spec=spec, nodes=M, gpus_per_node=P, cost=cost, local_epochs=E,
                   batch_size=b, freeze_iter=freeze, bucket_mib=bucket_mib)
    o = HSADMMConfig(local_epochs=E, batch_size=b, freeze_iter=freeze, bucket_mib=bucket_mib)
    first = Job(system, spec, M, P, o, units, dev, batches * 2).run(Cluster.two_tier(cost))
    bound = E * epoch + pred.steady.time_s
    if P == 1:
        assert first["steps_s"][0] == pytest.approx(bound, rel=1e-9)
    else:
        assert E * epoch < first["steps_s"][0] < bound
    assert r["iterations_per_epoch"] == pytest.approx(1 / E)
    assert r["step_s"] <= first["steps_s"][0] * (1 + 1e-12)
    assert r["time_s"] == pytest.approx(r["step_s"] / E, rel=1e-12)


@pytest.mark.parametrize("system", ["ddp", "topk", "hsadmm"])
def test_speedup_grows_with_gpus_and_never_beats_ideal(system):
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    dev = DeviceModel(Device(peak_tflops=0.02, memory_gbs=10.0))
    gpus = [2, 4, 8, 16]
    rows = scaling(system, spec, gpus, 2, units=units, device=dev,
                   cluster=Cluster.two_tier(CostModel.from_cli(100, 10, 2, 5)),
                   dataset_size=60_000, batch_size=32)
    sp = [r["speedup"] for r in rows]
    assert sp[0] == 1.0 and all(a < b for a, b in itertools.pairwise(sp))
    for r in rows:
        assert r["speedup"] <= r["gpus"] / gpus[0] + 1e-9
        assert r["efficiency"] == pytest.approx(r["speedup"] * gpus[0] / r["gpus"])
        assert r["compute_s"] * (1 - 1e-12) <= r["time_s"] <= r["bound_time_s"] * (1 + 1e-9)


def test_units_cover_the_layout_and_match_the_spec_flops():
    spec = resolve_model("resnet18")
    units, how = units_for_spec(spec, "resnet18")
    assert "layer tree" in how
    assert sum(u.hi - u.lo for u in units) == spec.layout.total
    # conv + fc FLOPs are the spec's; BN, ReLU and the residual additions come on top
    fwd = sum(u.forward_flops for u in units)
    assert spec.flops_per_sample < fwd < 1.05 * spec.flops_per_sample
    assert all(u.backward_flops == 2 * u.forward_flops for u in units)
    # a basic block: 2 convs, 2 BNs, a ReLU (+ its addition and final ReLU); backward 2 per
    # layer with parameters, 1 per layer without
    block = next(u for u in units if u.name == "layer1.0")
    assert (block.forward_kernels, block.backward_kernels) == (5 + 1, 2 * 4 + 1 + 1)
    # a paper-scale spec declared from a layer tree is costed per layer: a transformer block
    # is one unit (its MACs the spec's, with the norms and activations on top)
    vit = resolve_model("vit-base")
    units, how = units_for_spec(vit, "vit-base")
    assert "layer tree" in how
    assert sum(u.hi - u.lo for u in units) == vit.layout.total
    assert vit.flops_per_sample <= sum(u.forward_flops for u in units) \
        < 1.01 * vit.flops_per_sample
    # without its tree, the spec's FLOPs are split over its tensors by size
    bare = dataclasses.replace(vit, root=None)
    units, how = units_for_spec(bare, "vit-base")
    assert "in proportion" in how
    assert sum(u.hi - u.lo for u in units) == vit.layout.total
    assert sum(u.forward_flops for u in units) == pytest.approx(vit.flops_per_sample)


def test_the_device_model_is_a_roofline_plus_launches():
    d = Device(peak_tflops=10.0, memory_gbs=100.0, launch_us=5.0, efficiency=0.5)
    m = DeviceModel(d)
    assert m.seconds(1e12) == pytest.approx(0.2)                   # 5 TFLOP/s achieved
    assert m.seconds(1e6, nbytes=1e9, kernels=4) == pytest.approx(0.01 + 20e-6)
    u = Unit("u", 0, 1, 1e9, 2e9, 0.0, 0.0, 3, 5)
    assert m.forward(u, 10) == pytest.approx(1e10 / 5e12 + 15e-6)
    with pytest.raises(ValueError, match="--compute-s-per-sample"):
        DeviceModel.from_seconds_per_sample([u], 0.0, d)
    with pytest.raises(ValueError, match="efficiency is a fraction"):
        Cluster("x", device=Device(efficiency=2.0))


def test_cli_scales_every_data_parallel_system_and_admm_on_a_cluster(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["scale", "--system", "hsadmm", "ddp", "pactrain", "sdp", "--model", "cnn",
                 "--gpus", "4", "8", "--gpus-per-node", "2", "--cluster", "prunex-puhti",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| pactrain | 4 | 2 |" in text and "| sdp | 8 | 4 |" in text
    assert "x packed_allreduce" in text and "x sdp_gated_allreduce" in text
    assert "Puhti-AI" in text and "job simulation" in text
    saved = json.loads(out.read_text())
    assert saved["cluster"]["name"].startswith("Puhti-AI")
    r = saved["systems"]["ddp"][-1]
    assert r["speedup"] == pytest.approx(saved["systems"]["ddp"][0]["time_s"] / r["time_s"])


@pytest.mark.parametrize("argv,match", [
    (["--gpus", "6", "--gpus-per-node", "4"], "multiples of --gpus-per-node 4"),
    (["--compute-s-per-sample", "-1"], "--compute-s-per-sample must be a finite number > 0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--dataset-size", "0"], "--dataset-size must be an integer >= 1"),
    (["--system", "hsgd"], "H-SGD.s blocks are costed from their FLOPs"),
    (["--system", "nope"], "unknown system 'nope'"),
    (["--cluster", "nowhere"], "--cluster nowhere: no such file"),
    (["--link-sharing", "roulette"], "invalid choice"),
])
def test_bad_input_names_the_flag(argv, match, capsys):
    base = ["scale", "--model", "cnn", "--gpus", "4", "8", "--gpus-per-node", "2",
            "--system", "ddp", "--compute-s-per-sample", "0.001"]
    try:
        main(base + argv)
    except ValueError as e:
        assert re_search(match, str(e))
        return
    except SystemExit:
        assert re_search(match, capsys.readouterr().err)
        return
    pytest.fail(f"{argv} was accepted")


def re_search(pattern, text):
    import re

    return re.search(pattern, text) is not None


CLUSTER_FILES = sorted(p.stem for p in SHIPPED.glob("*.toml"))


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_every_shipped_cluster_scales_every_system(name, capsys):
    """Each of the papers' cluster files loads and carries a job of every data-parallel and ADMM
    system on two sizes of whole nodes (its own devices per node), one row each."""
    cluster = Cluster.load(name)
    gpn = cluster.node.devices
    g = gpn * 4 // math.gcd(gpn, 4)          # whole nodes, and SDP's 3/4 coverage whole
    systems = ["ddp", "topk", "fp16", "pactrain", "sdp", "ssfusion", "hsadmm", "flat-admm"]
    assert main(["scale", "--system", *systems, "--model", "cnn", "--gpus", str(g),
                 str(2 * g), "--gpus-per-node", str(gpn), "--cluster", name]) == 0
    text = capsys.readouterr().out
    assert cluster.name in text and "job simulation" in text
    for s in systems:
        rows = [ln for ln in text.splitlines() if ln.startswith(f"| {s} |")]
        assert len(rows) == 2, (s, text)
