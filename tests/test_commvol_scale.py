"""``commvol scale`` on the event timeline: one step of a tiny two-layer model against closed
forms written here (compute + ring time; two buckets overlapping the backward and sharing the
link: a max-plus formula), Top-K's selection chain, SSFusion's buffers on one channel, the
ADMM chain against the systems' predicted communication, the no-overlap sum against the earlier
additive model, speedup sanity, the paper comparison, and bad input."""

import dataclasses
import itertools
import json
import math

import pytest

from commvol.__main__ import main
from commvol.predict import predict, resolve_model
from commvol.scale import PRUNEX_FIG9, format_paper_comparison, strong_scaling, timeline_scaling
from commvol.systems import sdp_plan
from commvol.timeline_scale import (
    OPTIMIZER_BYTES_PER_PARAM,
    OPTIMIZER_FLOPS_PER_PARAM,
    ComputeModel,
    Unit,
    dp_step,
    epoch_timing,
    units_for_spec,
)
from dataparallel.ddp import DDPOptions, DDPPlan
from dataparallel.pactrain import PacTrainOptions
from dataparallel.sdp import SDPOptions
from dataparallel.topk import SELECT_PASSES, TopKOptions
from hsadmm.config import HSADMMConfig
from models.layers import Linear, Sequential
from models.modelspec import spec_from_layers
from substrate.calls import Placement, Ready
from substrate.costmodel import CostModel

RATE = 1.0          # TFLOP/s
GBS = 1.0           # GB/s of the memory-bound events
F1, F2 = 3e6, 1e6   # forward FLOPs per sample of fc1, fc2 (backward: twice)


@pytest.fixture(scope="module")
def tiny():
    """fc1 (4 -> 8) and fc2 (8 -> 2) without biases: 32 + 16 parameters; flat (backward) order
    puts fc2's 16 first."""
    spec = spec_from_layers("tiny", Sequential([("fc1", Linear(4, 8, bias=False)),
                                                ("fc2", Linear(8, 2, bias=False))]), (4,), 2)
    off = spec.layout.offsets
    units = (Unit("fc1", off["fc1.weight"], off["fc1.weight"] + 32, F1, 2 * F1),
             Unit("fc2", off["fc2.weight"], off["fc2.weight"] + 16, F2, 2 * F2))
    return spec, ComputeModel(units, RATE, GBS)


def _sec(flops):
    return flops / (RATE * 1e12)


def _opt(T):
    return max(OPTIMIZER_FLOPS_PER_PARAM * T / (RATE * 1e12),
               OPTIMIZER_BYTES_PER_PARAM * T / (GBS * 1e9))


def _ring(n, p, alpha, bw):
    """(L, W) of a ring all-reduce of n bytes over p ranks: 2(p-1) alpha, 2(p-1)/p n / bw."""
    return 2 * (p - 1) * alpha, 2 * (p - 1) / p * n / bw


def test_ddp_one_bucket_is_compute_plus_ring_time(tiny):
    spec, cm = tiny
    alpha, bw, batch = 1e-4, 1e6, 100
    cost = CostModel(inter_bw=bw, inter_lat=alpha)
    opts = DDPOptions(bucket_mib=1.0)
    assert DDPPlan.for_layout(spec.layout, opts).buckets == ((0, 48),)
    t = dp_step("ddp", spec, 2, 1, opts, cost, cm, batch)     # 2 nodes x 1 GPU: inter ring
    compute = batch * _sec(3 * F1 + 3 * F2)
    L, W = _ring(4 * 48, 2, alpha, bw)
    # the only bucket is ready when the backward ends; the update waits for it
    assert t.step_s == pytest.approx(compute + L + W + _opt(48), rel=1e-12)
    assert t.no_overlap_s == pytest.approx(t.step_s, rel=1e-12)
    assert t.comm_s == pytest.approx(cost.ring_allreduce_time(4 * 48, 2, "inter"), rel=1e-12)


@pytest.mark.parametrize("bw", [1e6, 2e4, 5e3])
def test_ddp_two_buckets_overlap_the_backward_on_one_stream(tiny, bw):
    """Bucket A (fc2, 16 floats) is ready after fc2's backward, bucket B (fc1, 32 floats) after
    fc1's.  The trainer issues the buckets in order on one communication stream (PyTorch DDP),
    so B starts when it is ready and A has ended: A ends at ready_A + L_A + W_A, B at
    max(ready_B, end_A) + L_B + W_B; the update waits for B (and the backward)."""
    spec, cm = tiny
    alpha, batch = 2e-5, 200
    cost = CostModel(inter_bw=bw, inter_lat=alpha)
    opts = DDPOptions(bucket_mib=64 / 2 ** 20)
    assert DDPPlan.for_layout(spec.layout, opts).buckets == ((0, 16), (16, 48))
    t = dp_step("ddp", spec, 2, 1, opts, cost, cm, batch, keep_events=True)
    fwd = batch * _sec(F1 + F2)
    ready_a = fwd + batch * _sec(2 * F2)
    ready_b = ready_a + batch * _sec(2 * F1)
    La, Wa = _ring(4 * 16, 2, alpha, bw)
    Lb, Wb = _ring(4 * 32, 2, alpha, bw)
    end_a = ready_a + La + Wa
    end_b = max(ready_b, end_a) + Lb + Wb
    fin = {e.label: e.finish for e in t.events}
    assert fin["grad_allreduce[0]"] == pytest.approx(end_a, rel=1e-9)
    assert fin["grad_allreduce[1]"] == pytest.approx(end_b, rel=1e-9)
    assert t.step_s == pytest.approx(max(end_b, ready_b) + _opt(48), rel=1e-9)
    # the additive clock's sum is never shorter, and longer by exactly the hidden part
    assert t.no_overlap_s == pytest.approx(ready_b + La + Wa + Lb + Wb + _opt(48), rel=1e-12)
    assert t.step_s <= t.no_overlap_s + 1e-15
    if end_a < ready_b:      # A hidden behind fc1's backward: the step is shorter
        assert t.step_s < t.no_overlap_s - 1e-12


def test_ddp_hierarchical_and_topk_chains(tiny):
    spec, cm = tiny
    cost = CostModel(intra_bw=4e6, intra_lat=1e-5, inter_bw=1e6, inter_lat=1e-4)
    batch, M, P = 50, 2, 2
    compute = batch * _sec(3 * F1 + 3 * F2)
    # one bucket: intra ring (P) -> leaders' ring (M) -> binomial bcast (ceil log2 P levels)
    t = dp_step("ddp-hierarchical", spec, M, P, DDPOptions(bucket_mib=1.0), cost, cm, batch)
    n = 4 * 48
    intra = 2 * (P - 1) * (1e-5 + n / P / 4e6)
    inter = 2 * (M - 1) * (1e-4 + n / M / 1e6)
    bcast = 1 * (1e-5 + n / 4e6)
    assert t.step_s == pytest.approx(compute + intra + inter + bcast + _opt(48), rel=1e-12)
    # Top-K at density 0.25: k = 8 of fc1, 4 of fc2; selection after the backward, then the
    # ring all-gather of p * 8K bytes over p = 4 ranks (crossing nodes: inter), then decoding
    K, p = 12, M * P
    t = dp_step("topk", spec, M, P, TopKOptions(density=0.25), cost, cm, batch)
    select = SELECT_PASSES * 4 * 48 / (GBS * 1e9)
    gather = (p - 1) * 1e-4 + (p - 1) / p * (p * 8 * K) / 1e6
    decode = (p * 8 * K + 4 * 48) / (GBS * 1e9)
    assert t.step_s == pytest.approx(compute + select + gather + decode + _opt(48), rel=1e-12)
    assert t.exposed_comm_s == pytest.approx(gather, rel=1e-9)


def test_ssfusion_buffers_chain_on_one_channel(tiny):
    """SSFusion per-tensor on two fusion buffers (fc2's 16 weights, then fc1's 32), k = 1 each:
    the plan's records at paper scale.  Each buffer's sparsification is a compute item after
    the backward wrote its tensors, on the compute stream (momentum 2n, error feedback n, the
    exact selection of a tensor too small to sample 3n, the gather of k entries 2k, each
    streaming 4 bytes an operation); each buffer's all-gather (8 bytes a rank) waits for its
    sparsification and the previous all-gather (one channel); decoding (p n_AGd + 2 p K + n
    operations) follows each all-gather; the update waits for everything.  Max-plus, with a
    buffer's sparsification placed on the compute stream right after the backward event that
    completes the buffer (:func:`substrate.calls.declare`), so it overlaps the rest of the
    backward and buffer 0's all-gather starts before fc1's backward ends."""
    from dataparallel.ssfusion import SSFusionOptions

    spec, cm = tiny
    cost = CostModel(intra_bw=4e6, intra_lat=1e-5, inter_bw=1e6, inter_lat=1e-4)
    batch, M, P = 50, 2, 2
    p = M * P
    o = SSFusionOptions(fusion="per-tensor", fusion_policy="count", buffers=2)
    t = dp_step("ssfusion", spec, M, P, o, cost, cm, batch, keep_events=True)

    def mem(ops):                       # roofline of a compute item (memory-bound here)
        return max(ops / (RATE * 1e12), 4 * ops / (GBS * 1e9))

    sp0, sp1 = mem(3 * 16 + 2 * 16 + 16 + 2), mem(3 * 32 + 2 * 32 + 32 + 2)
    gather = (p - 1) * 1e-4 + (p - 1) / p * (p * 8) / 1e6
    un0, un1 = mem(2 * p + 16), mem(2 * p + 32)
    # buffer 0 (fc2) is sparsified right after fc2's backward, before fc1's (the pipeline)
    s0 = batch * _sec(F1 + F2 + 2 * F2) + sp0
    backward_end = s0 + batch * _sec(2 * F1)
    s1 = backward_end + sp1
    g0 = s0 + gather
    g1 = max(s1, g0) + gather
    u0 = max(s1, g0) + un0
    u1 = max(u0, g1) + un1
    assert t.step_s == pytest.approx(max(u1, g1) + _opt(48), rel=1e-12)
    assert t.comm_s == pytest.approx(2 * gather, rel=1e-12)
    fin = {e.label: e.finish for e in t.events}
    assert fin["ssf_sparsify[0]"] == pytest.approx(s0, rel=1e-12)
    assert fin["ssf_unpack_sparse[1]"] == pytest.approx(u1, rel=1e-12)


def test_pactrain_packed_buckets_overlap_the_backward_like_ddps(tiny):
    """PacTrain's steady step all-reduces every bucket's survivors after the backward wrote the
    bucket, one bucket after the other on one stream (the strategy's order): with nothing
    pruned its records are DDP's (same buckets, sizes and dependencies: the same step); at
    ratio 0.5 bucket A (fc2: K = 8 of 16) starts when fc2's backward ends and overlaps fc1's
    backward, bucket B (fc1: K = 16 of 32) starts when both fc1's gradients and A are done."""
    spec, cm = tiny
    alpha, batch, bw = 2e-5, 200, 2e4
    cost = CostModel(inter_bw=bw, inter_lat=alpha)
    mib = 64 / 2 ** 20
    ddp = dp_step("ddp", spec, 2, 1, DDPOptions(bucket_mib=mib), cost, cm, batch)
    o = PacTrainOptions(prune_ratio=0.0, bucket_mib=mib, warmup_steps=0,
                        prune_score="magnitude")
    assert dp_step("pactrain", spec, 2, 1, o, cost, cm, batch).step_s == \
        pytest.approx(ddp.step_s, rel=1e-12)
    t = dp_step("pactrain", spec, 2, 1, dataclasses.replace(o, prune_ratio=0.5), cost, cm, batch)
    ready_a = batch * _sec(F1 + F2 + 2 * F2)
    ready_b = ready_a + batch * _sec(2 * F1)
    La, Wa = _ring(4 * 8, 2, alpha, bw)
    Lb, Wb = _ring(4 * 16, 2, alpha, bw)
    end_a = ready_a + La + Wa
    assert ready_a < ready_b < end_a             # A overlaps the backward, B waits for A
    assert t.step_s == pytest.approx(end_a + Lb + Wb + _opt(48), rel=1e-9)
    assert t.no_overlap_s == pytest.approx(ready_b + La + Wa + Lb + Wb + _opt(48), rel=1e-9)


@pytest.mark.parametrize("coverage", ["4/4", "3/4"])
def test_sdp_holder_groups_run_one_after_another_after_their_gradients(coverage):
    """N-SDP on one node of 4: the world ring of the unmasked coordinates and one ring per
    window of 3 holders.  Every rank runs its calls one after another and any two windows
    share a rank, so the records form one chain: each ring starts when the backward has
    written its coordinates (the span of its holder set) and the ring before it has ended;
    the update follows the last one.  At coverage 4/4 it is one world ring of all T."""
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    rate, batch = 0.02, 32
    cm = ComputeModel(tuple(units), rate, 10.0)
    cost = CostModel(intra_bw=50.0, intra_lat=1e-5)
    opts = SDPOptions(coverage=coverage)
    t = dp_step("sdp", spec, 1, 4, opts, cost, cm, batch)
    # backward in reverse unit order: unit k's gradients are written at fwd + its suffix sum
    fwd = batch * sum(u.forward_flops for u in units) / (rate * 1e12)
    done, acc = {}, fwd
    for u in reversed(units):
        acc += batch * u.backward_flops / (rate * 1e12)
        done[u.name] = acc

    def ready(lo, hi):
        return max(done[u.name] for u in units if u.lo < hi and u.hi > lo)

    calls = sdp_plan(spec, 1, 4, opts).calls(Placement.node_major(1, 4))
    assert len(calls) == (1 if coverage == "4/4" else 5)
    # rank 0's timeline (the scale's): up to its last ring, the window it is not in included
    # when one of its later rings waits for it
    last = max(i for i, c in enumerate(calls) if 0 in c.group)
    end, comm = 0.0, 0.0
    for i, c in enumerate(calls[:last + 1]):
        assert i == 0 or i - 1 in c.after               # one chain
        (r,) = [d for d in c.after if isinstance(d, Ready)]
        ring = cost.ring_allreduce_time(c.nbytes, c.size, "intra")
        end, comm = max(ready(r.lo, r.hi), end) + ring, comm + ring
    T = spec.layout.total
    assert t.step_s == pytest.approx(max(end, acc) + cm.optimizer_s(T), rel=1e-9)
    assert t.comm_s == pytest.approx(comm, rel=1e-9)


def test_cli_scales_pactrain_and_sdp_from_their_records(capsys):
    assert main(["scale", "--system", "pactrain", "sdp", "--model", "cnn", "--gpus", "4", "8",
                 "--gpus-per-node", "2", "--device-tflops", "1"]) == 0
    text = capsys.readouterr().out
    assert "| pactrain | 4 | 2 |" in text and "| sdp | 8 | 4 |" in text
    assert "no timeline plan" not in text
    assert "pactrain: " in text and "x packed_allreduce" in text
    assert "x sdp_gated_allreduce" in text


@pytest.mark.parametrize("system,freeze,bucket_mib,M", [
    ("hsadmm", 4, 32.0, 2), ("hsadmm", 0, 32.0, 2), ("hsadmm", 4, 0.02, 3),
    ("hsadmm", 0, 0.02, 1), ("flat-admm", 4, 32.0, 2)])
def test_admm_iteration_is_local_epochs_then_the_predicted_chain(system, freeze, bucket_mib, M):
    """No overlap is possible in an ADMM iteration (every phase waits for the one before, the
    compact buckets one after the other as the leaders' loop sends them), so its time is the
    local training plus the prediction's communication (commvol.systems)."""
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    cm = ComputeModel(tuple(units), 0.01, 5.0)
    cost = CostModel()
    D, b, E, P = 4000, 32, 2.0, 2
    o = HSADMMConfig(local_epochs=E, batch_size=b, freeze_iter=freeze, bucket_mib=bucket_mib)
    r = epoch_timing(system, spec, M, P, o, cost, cm, D / (M * P), b)
    steps = math.ceil(D / (M * P) / b)
    T = spec.layout.total
    flops = sum(u.forward_flops + u.backward_flops for u in units)
    epoch = D / (M * P) * flops / (0.01e12) + steps * max(6 * T / 0.01e12, 20 * T / 5e9)
    pred = predict(system, spec=spec, nodes=M, gpus_per_node=P, cost=cost, local_epochs=E,
                   batch_size=b, freeze_iter=freeze, bucket_mib=bucket_mib)
    comm = pred.steady.time_s
    if bucket_mib < 1:   # several compact buckets
        assert pred.steady.messages["inter_allreduce"] >= 3 * 2 * (M - 1) * M
    assert r["iterations_per_epoch"] == pytest.approx(1 / E)
    assert r["step_s"] == pytest.approx(E * epoch + comm, rel=1e-9)
    assert r["time_s"] == pytest.approx((E * epoch + comm) / E, rel=1e-9)
    assert r["comm_s"] == pytest.approx(comm / E, rel=1e-9)


def test_no_overlap_sum_is_the_earlier_additive_model_plus_the_update():
    """For DDP the no-overlap column adds exactly the optimizer update to the earlier closed
    form (D/p) t_s + ceil(D/(p b)) c(p); the timeline is never longer than either."""
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    cm = ComputeModel(tuple(units), 0.05, 20.0)
    D, b = 12_800, 32
    rows = timeline_scaling("ddp", spec, [4, 8, 16], 2, compute=cm, dataset_size=D,
                            batch_size=b)
    old = strong_scaling("ddp", spec, [4, 8, 16], 2, compute_s_per_sample=cm.seconds_per_sample,
                         dataset_size=D, batch_size=b)
    for r, o in zip(rows, old):
        steps = math.ceil(D / (r["gpus"] * b))
        assert r["iterations_per_epoch"] == steps
        assert r["no_overlap_time_s"] - steps * cm.optimizer_s(spec.layout.total) == \
            pytest.approx(o["time_s"], rel=1e-9)
        assert r["time_s"] <= r["no_overlap_time_s"] * (1 + 1e-12)
        assert r["time_s"] >= r["compute_s"] * (1 - 1e-12)


@pytest.mark.parametrize("system", ["ddp", "topk", "hsadmm"])
def test_speedup_grows_with_gpus_and_never_beats_ideal(system):
    spec = resolve_model("cnn")
    units, _ = units_for_spec(spec, "cnn")
    cm = ComputeModel(tuple(units), 0.02, 10.0)
    gpus = [2, 4, 8, 16, 32]
    rows = timeline_scaling(system, spec, gpus, 2, compute=cm, dataset_size=60_000,
                            batch_size=32, cost=CostModel.from_cli(100, 10, 2, 5))
    sp = [r["speedup"] for r in rows]
    assert sp[0] == 1.0 and all(a < b for a, b in itertools.pairwise(sp))
    for r in rows:
        assert r["speedup"] <= r["gpus"] / gpus[0] + 1e-9
        assert r["efficiency"] == pytest.approx(r["speedup"] * gpus[0] / r["gpus"])
        assert r["no_overlap_speedup"] <= r["gpus"] / gpus[0] + 1e-9


def test_units_cover_the_layout_and_match_the_spec_flops():
    spec = resolve_model("resnet18")
    units, how = units_for_spec(spec, "resnet18")
    assert "layer tree" in how
    assert sum(u.hi - u.lo for u in units) == spec.layout.total
    # conv + fc FLOPs are the spec's; BN, ReLU and the residual additions come on top
    fwd = sum(u.forward_flops for u in units)
    assert spec.flops_per_sample < fwd < 1.05 * spec.flops_per_sample
    assert all(u.backward_flops == 2 * u.forward_flops for u in units)
    # a spec without a layer tree here: FLOPs split by tensor size, all parameters covered
    vit = resolve_model("vit-base")
    units, how = units_for_spec(vit, "vit-base")
    assert "in proportion" in how
    assert sum(u.hi - u.lo for u in units) == vit.layout.total
    assert sum(u.forward_flops for u in units) == pytest.approx(vit.flops_per_sample)


def test_cli_prints_both_models_and_the_paper_comparison(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["scale", "--system", "hsadmm", "ddp", "topk", "--model", "resnet152", "--gpus",
                 "8", "64", "--gpus-per-node", "4", "--device-tflops", "15.7",
                 "--local-epochs", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no-overlap speedup" in text and "| ddp | 8 | 2 | 49 |" in text
    assert "differs from the paper's testbed" in text
    for name, paper in PRUNEX_FIG9.items():
        assert f"| {name} | {paper:.2f}x |" in text
    saved = json.loads(out.read_text())
    assert saved["paper"]["speedup"] == PRUNEX_FIG9
    assert set(saved["systems"]) == {"hsadmm", "ddp", "topk"}
    r = saved["systems"]["ddp"][-1]
    assert r["speedup"] == pytest.approx(saved["systems"]["ddp"][0]["time_s"] / r["time_s"])
    assert any("links:" in a for a in saved["assumptions"])
    # another model: no comparison with the paper's ResNet-152 figure
    assert main(["scale", "--system", "ddp", "--model", "cnn", "--gpus", "8", "64",
                 "--gpus-per-node", "4", "--device-tflops", "1"]) == 0
    assert "PruneX Fig. 9" not in capsys.readouterr().out


def test_paper_comparison_needs_both_gpu_counts():
    rows = [{"gpus": 8, "time_s": 8.0, "no_overlap_time_s": 9.0},
            {"gpus": 64, "time_s": 1.25, "no_overlap_time_s": 1.5}]
    text = format_paper_comparison({"ddp": rows})
    assert "| ddp | 5.81x | 6.40x | 6.00x | - |" in text
    assert format_paper_comparison({"ddp": rows[:1]}) is None
    assert format_paper_comparison({"ddp-hierarchical": rows}) is None


@pytest.mark.parametrize("argv,match", [
    (["--gpus", "6", "--gpus-per-node", "4"], "multiples of --gpus-per-node 4"),
    (["--device-tflops", "0"], "--device-tflops must be a finite number > 0"),
    (["--device-tflops", "1", "--compute-s-per-sample", "1"], "not both"),
    (["--compute-s-per-sample", "-1"], "--compute-s-per-sample must be a finite number > 0"),
    (["--device-tflops", "1", "--device-gbs", "0"], "--device-gbs must give a finite rate"),
    (["--device-tflops", "1", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--device-tflops", "1", "--dataset-size", "0"], "--dataset-size must be an integer >= 1"),
    (["--device-tflops", "1", "--system", "hsgd"], "model-parallel sparse SGD"),
    (["--device-tflops", "1", "--system", "nope"], "unknown system 'nope'"),
])
def test_bad_input_names_the_flag(argv, match):
    base = ["scale", "--model", "cnn", "--gpus", "4", "8", "--gpus-per-node", "2",
            "--system", "ddp"]
    with pytest.raises(ValueError, match=match):
        main(base + argv)


def test_compute_model_rejects_bad_rates(tiny):
    spec, cm = tiny
    with pytest.raises(ValueError, match="--device-gbs"):
        ComputeModel(cm.units, 1.0, float("nan"))
    with pytest.raises(ValueError, match="--compute-s-per-sample"):
        ComputeModel.from_seconds_per_sample(cm.units, 0.0, 1.0)
    with pytest.raises(ValueError, match="--batch-size must be > 0"):
        dp_step("ddp", spec, 2, 1, DDPOptions(), CostModel(), cm, 0)
