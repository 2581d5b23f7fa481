"""SSFusion (seed paper 004): DGC sampled threshold, Gaussian-k, fusion buffers (count and
Cupcake's FindOptFusion), eq. 2 selection, density-aware counts, interleave split (§IV-D),
offload plan (§IV-C), closed forms, flags; MPI: serial reference of the synchronized gradient,
residuals and DGC momentum correction, tensor-missing rate, measured == predicted bytes on 4
ranks / 2 virtual nodes, SSFusion-O's recorded steps == the plan's programs.  The plan against
the paper's second source: tests/dataparallel/test_ssfusion_plan.py."""

import itertools
import math

import numpy as np
import pytest
from mpi_helpers import assert_fails_on_every_rank, run_mpi

from dataparallel.sparsify import (
    dgc_topk,
    refine_threshold,
    sample_magnitudes,
    sample_rank,
    segment_rng,
)
from dataparallel.ssfusion import (
    SSFusionOptions,
    alpha_beta_times,
    count_buffers,
    density_aware_counts,
    feasible_dense,
    find_opt_fusion,
    gaussiank_select,
    interleave_split,
    needs_profile,
    plan_offload,
    plan_ssfusion,
    select_dense,
)
from substrate.calls import Placement
from substrate.costmodel import CostModel
from volume import collectives as cm
from volume import ssfusion as cv
from volume.dataparallel import topk_k, world_ring_bytes


# -- DGC sampled threshold -------------------------------------------------------------------------
@pytest.mark.parametrize("dist", ["normal", "laplace", "student"])
def test_sampled_threshold_selects_about_k(dist):
    n, k = 100_000, 1000
    rng = np.random.default_rng(0)
    counts = []
    for seed in range(12):
        x = {"normal": rng.standard_normal, "laplace": rng.laplace,
             "student": lambda size: rng.standard_t(3, size)}[dist](size=n).astype(np.float32)
        mag = np.abs(x)
        desc = sample_magnitudes(mag, 0.01, segment_rng(0, 0, seed, 0))  # dgc_topk's estimate
        tau = desc[sample_rank(k, n, desc.size) - 1]
        counts.append(int((mag >= tau).sum()))
    counts = np.array(counts)
    # 1 % sample, threshold at its 10th largest: each count within ~±30 % (1/sqrt(10))
    assert np.all((counts > k / 3) & (counts < 3 * k)), counts
    assert abs(counts.mean() / k - 1) < 0.2, counts


def test_refinement_and_trim_give_exact_topk():
    rng = np.random.default_rng(1)
    for n, k in [(50_000, 500), (20_000, 1), (4096, 40), (300, 3), (1000, 1000), (5000, 4999)]:
        x = rng.standard_normal(n).astype(np.float32)
        mag = np.abs(x)
        idx = dgc_topk(x, k, segment_rng(0, 1, 2, 3))
        assert idx.dtype == np.int64 and idx.size == k == np.unique(idx).size
        want = np.argsort(-mag, kind="stable")[:k]
        assert set(idx.tolist()) == set(want.tolist())
    # refinement from a good, a far too high and a far too low first rank
    mag = np.abs(rng.standard_normal(100_000))
    desc = sample_magnitudes(mag, 0.01, segment_rng(0, 0, 0, 0))
    k = 1000
    for r0 in (sample_rank(k, mag.size, desc.size), 1, desc.size // 2):
        tau, count, passes = refine_threshold(mag, k, desc, r0)
        assert count == int((mag >= tau).sum()) >= k
        assert count <= 1.25 * k and passes <= 4, (r0, count, passes)
    # no sampled rank gives >= k (k close to n): falls back to every entry
    tau, count, _ = refine_threshold(mag, 99_990, desc, 1)
    assert (tau, count) == (0.0, mag.size)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        dgc_topk(np.ones(5, np.float32), 0, segment_rng(0, 0, 0, 0))


def test_sampling_is_seeded_per_rank_step_and_segment():
    a = segment_rng(7, 1, 3, 2).integers(0, 1 << 30, 4)
    assert np.array_equal(a, segment_rng(7, 1, 3, 2).integers(0, 1 << 30, 4))
    assert not np.array_equal(a, segment_rng(7, 2, 3, 2).integers(0, 1 << 30, 4))
    assert not np.array_equal(a, segment_rng(7, 1, 4, 2).integers(0, 1 << 30, 4))


def test_tensor_missing_paper_fig3():
    """Fig. 3: two tensors of four entries, density 0.25; G2's entries are all larger than
    G1's.  Per-tensor keeps one entry of each; one top-2 over the fused buffer misses G1."""
    g2 = np.array([0.9, -0.7, 0.8, 0.6], np.float32)
    g1 = np.array([0.1, -0.2, 0.05, 0.15], np.float32)
    rng = segment_rng(0, 0, 0, 0)
    ks = topk_k([4, 4], 0.25)
    assert ks == [1, 1]
    assert dgc_topk(g1, ks[1], rng).size == 1  # per-tensor: G1 present
    fused = dgc_topk(np.concatenate([g2, g1]), sum(ks), rng)
    assert np.all(fused < 4)  # multi-tensor: every selected entry is G2's, G1 is missing


# -- plans ----------------------------------------------------------------------------------------
def test_fusion_buffers_by_count_and_bytes():
    sizes = [10, 640, 64, 32768, 32, 4608, 16, 144]
    assert count_buffers(sizes, buffers=4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert count_buffers(sizes, buffers=3) == [(0, 3), (3, 6), (6, 8)]
    assert count_buffers(sizes, buffers=1) == [(0, 8)]
    # 4 KiB budget: the 32768-element tensor gets a buffer of its own
    assert count_buffers(sizes, buffer_bytes=4096) == [(0, 3), (3, 4), (4, 5), (5, 6),
                                                        (6, 8)]
    with pytest.raises(ValueError, match="--buffers 9 must be between 1 and the model's 8"):
        count_buffers(sizes, buffers=9)


@pytest.mark.parametrize("dense", [set(), {0}, {0, 2}, {2}])
def test_density_aware_counts_keep_the_buffer_at_density(dense):
    sizes = [64, 32768, 32, 4608]
    d, floor = 0.01, 0.001
    k = density_aware_counts(sizes, dense, d, floor)
    target = sum(topk_k(sizes, d))
    kmin = topk_k(sizes, floor)
    if not dense:
        assert k == topk_k(sizes, d)
    sent = sum(sizes[j] if j in dense else k[j] for j in range(len(sizes)))
    assert sent == target
    for j in range(len(sizes)):
        assert (k[j] == 0) if j in dense else (kmin[j] <= k[j] <= sizes[j])


def test_density_floor_limits_dense_tensors():
    sizes = [10, 640]  # K = 1 + 7 = 8 < 10: the bias cannot stay dense
    assert not feasible_dense(sizes, {0}, 0.01, 0.001)
    with pytest.raises(ValueError, match="--density-floor"):
        density_aware_counts(sizes, {0}, 0.01, 0.001)
    # a dense 64-entry bias needs 64 of the 329 slots; the weight keeps 265 >= ceil(32.768)
    assert feasible_dense([64, 32768], {0}, 0.01, 0.001)
    assert not feasible_dense([64, 32768], {0}, 0.01, 0.009)


def test_select_dense_follows_eq2_smallest_first():
    sizes = [4608, 32, 16, 144, 64]
    T_b = np.full(5, 1e-3)
    T_sp = np.array([4e-3, 1e-3, 1e-3, 2e-3, 1e-3])
    d, floor = 0.05, 0.001
    # previous buffer's communication hides nothing: exclude smallest-first while feasible
    dense = select_dense(sizes, T_b, T_sp, 0.0, d, floor)
    order = sorted(range(5), key=lambda j: sizes[j])
    assert dense == set(order[:len(dense)]) and len(dense) >= 2
    assert feasible_dense(sizes, dense, d, floor)
    nxt = order[len(dense)]
    assert not feasible_dense(sizes, dense | {nxt}, d, floor)
    # eq. 2 already holds: nothing to exclude
    comp = T_b.sum() + T_sp.sum()
    assert select_dense(sizes, T_b, T_sp, comp, d, floor) == set()
    # eq. 2 holds once the smallest tensor (16 entries, T_sp 1 ms) is dense
    assert select_dense(sizes, T_b, T_sp, comp - 1e-3, d, floor) == {2}


def _split_reference(sizes, dense, k, T_b, T_sp, cost, p, link):
    """§IV-D written out: every split l', T1 + max(T_AR, rest) + T_AG by the eqs. 3-4."""
    best = None
    for lp in range(len(sizes) + 1):
        comp = [T_b[j] + (0 if j in dense else T_sp[j]) for j in range(len(sizes))]
        n_ar = sum(sizes[j] for j in dense if j < lp)
        n_agd = sum(sizes[j] for j in dense if j >= lp)
        ks = sum(k[j] for j in range(len(sizes)) if j not in dense)
        a, b = cost.alpha(link), cost.beta(link)
        t_ar = (2 * (p - 1) * a + 2 * (p - 1) / p * 4 * n_ar * b) if n_ar else 0.0
        blk = 4 * n_agd + 8 * ks
        t_ag = ((p - 1) * a + (p - 1) * blk * b) if blk else 0.0
        obj = sum(comp[:lp]) + max(t_ar, sum(comp[lp:])) + t_ag
        if best is None or obj < best[0] - 1e-15:
            best = (obj, lp)
    return best[1]


@pytest.mark.parametrize("lat_us,gbps,want_ar", [(5.0, 100.0, True), (5000.0, 1e6, False)])
def test_interleave_split_minimizes_t1_plus_t2(lat_us, gbps, want_ar):
    sizes, dense = [64, 32768, 4608, 16], {0, 3}
    k = density_aware_counts(sizes, dense, 0.05, 0.001)
    T_b, T_sp = [1e-5, 2e-5, 3e-5, 1e-5], [1e-5, 4e-5, 2e-5, 1e-5]
    cost = CostModel.from_cli(gbps, gbps, lat_us, lat_us)
    p = 8
    times = alpha_beta_times(cost, p, cm.INTER)
    lp, t_ar, _ = interleave_split(sizes, dense, k, T_b, T_sp, times)
    assert lp == _split_reference(sizes, dense, k, T_b, T_sp, cost, p, cm.INTER)
    # bandwidth-bound: the dense tensors go to the all-reduce; latency-bound: ride the gather
    assert (t_ar > 0) == want_ar


def test_offload_plan_fits_cpu_work_under_backward():
    T_b = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # weight+bias of one layer are ready together
    T_cpu = [0.1, 0.5, 0.1, 1.5, 0.1, 0.2]
    sparse = np.array([False, True, False, True, False, True])
    buffers = [(0, 2), (2, 4), (4, 6)]
    # whole backward (3.0): t=1 -> 1.5 ok, t=2 -> 3.5 no, t=3 -> 3.2 no
    assert plan_offload(T_b, T_cpu, sparse, buffers).tolist() == [0, 1, 0, 0, 0, 0]
    # per-buffer deadline (the paper's): a tensor ready at its buffer's end never fits
    assert not plan_offload(T_b, T_cpu, sparse, buffers, deadline="buffer").any()
    assert plan_offload([1, 1, 1, 1], [0.5] * 4, np.ones(4, bool), [(0, 2), (2, 4)],
                        deadline="buffer").tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("deadline", ["buffer", "backward"])
def test_plan_offloads_by_the_deadline_option(deadline):
    """--offload-deadline reaches the plan: buffer (the paper's, the default: the buffer is
    sent when its backward ends) or backward (for --overlap off)."""
    sizes = [10, 640, 64, 32768, 32, 4608, 16, 144]
    T_b = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]) * 1e-3
    T_cpu = np.full(8, 0.4e-3)
    o = SSFusionOptions(fusion_policy="count", buffers=2, offload=True,
                        offload_deadline=deadline)
    assert SSFusionOptions().offload_deadline == "buffer"
    plan = plan_ssfusion(sizes, 4, cm.INTER, o, CostModel(), profile=(T_b, T_cpu, T_cpu))
    sparse = np.array([k >= 0 for k in plan.k])
    want = plan_offload(T_b, T_cpu, sparse, plan.buffers, deadline=deadline)
    assert plan.offload == tuple(bool(v) for v in want) and any(plan.offload)


def test_plan_selective_and_roundtrip():
    sizes = [10, 640, 64, 32768, 32, 4608, 16, 144]
    prof = (np.full(8, 1e-3),) * 3
    o = SSFusionOptions(fusion_policy="count", offload=True, first_buffer="exclude")
    plan = plan_ssfusion(sizes, 4, cm.INTER, o, CostModel(), profile=prof)
    buffers = count_buffers(sizes, buffers=4)
    assert plan.buffers == plan.warmup_buffers == tuple(buffers)
    # compute-bound (1 ms per tensor vs microseconds of communication): the small tensors
    # stay dense exactly as far as the floor lets the large ones compensate
    assert plan.dense() == [2, 4]
    for t0, t1 in buffers:
        sent = sum(sizes[l] if plan.k[l] < 0 else plan.k[l] for l in range(t0, t1))
        assert sent == sum(topk_k(sizes[t0:t1], 0.01))
    assert plan.split == (0, 1, 1, 0)  # bandwidth wins: dense biases all-reduced
    back = plan.decode(plan.encode())
    assert back == plan and plan.encode().size == cv.plan_length(8) == 32
    naive = plan_ssfusion(sizes, 4, cm.INTER, SSFusionOptions(
        fusion_policy="count", interleave=False, first_buffer="exclude"), CostModel(),
        profile=prof)
    assert naive.split == (0, 0, 0, 0) and naive.dense() == plan.dense()
    # the paper's eq. 2 is for 2 <= i <= M: by default the first buffer stays per-tensor
    first = [64, 32768] + sizes[2:]  # a first buffer whose bias could be compensated
    excl = plan_ssfusion(first, 4, cm.INTER, o, CostModel(), profile=prof)
    paper = plan_ssfusion(first, 4, cm.INTER, SSFusionOptions(fusion_policy="count"),
                          CostModel(), profile=prof)
    assert excl.dense() == [0, 2, 4] and paper.dense() == [2, 4]
    assert paper.k[:2] == tuple(topk_k(first[:2], 0.01))
    # a decoded plan may have other buffers than the template it is decoded into
    cup = plan_ssfusion(sizes, 4, cm.INTER, SSFusionOptions(), CostModel(), profile=prof)
    assert plan.decode(cup.encode()) == cup and cup.buffers != plan.buffers


def _end_of_cut(cut, T_b, T_sp, k, t_ag):
    """The iteration a cut into buffers gives, simulated: buffer ``[a, b)``'s all-gather starts
    when its last tensor is ready and the previous all-gather is done."""
    end = 0.0
    for a, b in cut:
        ready = sum(T_b[:b]) + sum(T_sp[:b])
        end = max(ready, end) + float(t_ag(8 * sum(k[a:b])))
    return end


def _every_cut(L):
    for mask in range(1 << (L - 1)):
        cuts = [0] + [i + 1 for i in range(L - 1) if mask >> i & 1] + [L]
        yield list(itertools.pairwise(cuts))


@pytest.mark.parametrize("seed", range(6))
def test_find_opt_fusion_is_the_best_contiguous_cut(seed):
    rng = np.random.default_rng(seed)
    L = 7
    T_b, T_sp = rng.uniform(0, 1e-3, L), rng.uniform(0, 5e-4, L)
    k = rng.integers(1, 5000, L)
    cost = CostModel.from_cli(10.0, 10.0, float(rng.uniform(1, 500)), float(rng.uniform(1, 500)))

    def t_ag(block):
        return cost.ring_allgather_time(6 * np.asarray(block, float), 6, cm.INTER)

    cut = find_opt_fusion(T_b, T_sp, k, t_ag)
    best = min(_end_of_cut(c, T_b, T_sp, k, t_ag) for c in _every_cut(L))
    assert _end_of_cut(cut, T_b, T_sp, k, t_ag) == pytest.approx(best, rel=1e-12)
    assert cut[0][0] == 0 and cut[-1][1] == L
    # no communication cost: one buffer; free computation and latency-bound: one buffer too
    assert find_opt_fusion(T_b, T_sp, k, lambda b: 0.0 * np.asarray(b)) == [(0, L)]


def test_gaussiank_threshold():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(200_000).astype(np.float32)
    k = 2000
    idx = gaussiank_select(x, k)
    # a normal gradient: the fitted threshold keeps close to k, never more; all of them large
    assert 2 * k / 3 <= idx.size <= k
    assert np.abs(x[idx]).min() >= np.sort(np.abs(x))[-int(4 * k / 3)]
    # heavy tails: the threshold is rescaled, still at most k
    y = rng.standard_t(2, 100_000).astype(np.float32)
    assert 0 < gaussiank_select(y, 1000).size <= 1000
    assert gaussiank_select(x[:10], 10).size == 10


# -- closed forms ----------------------------------------------------------------------------------
@pytest.mark.parametrize("M,P", [(2, 2), (4, 2), (1, 4), (2, 4)])
def test_closed_forms(M, P):
    p = M * P
    nodes = np.arange(p) // P
    assert cm.bcast_split(80, nodes) == cm.bcast_wire_bytes(80, M, P)
    sel = cv.selection_bytes(M=M, P=P, num_tensors=8)
    assert sum(sel[cv.PROFILE].values()) == 2 * (p - 1) * 8 * (3 * 8 + 2)
    assert sum(sel[cv.SELECT].values()) == (p - 1) * 8 * 32
    step = cv.sparse_step_bytes(M=M, P=P, ar_counts=[0, 64, 32], ag_dense_counts=[10, 0, 0],
                                ag_sparse_counts=[8, 265, 0])
    assert sum(step[cv.DENSE].values()) == 2 * (p - 1) * 4 * 96
    assert sum(step[cv.SPARSE].values()) == p * (p - 1) * (4 * 10 + 8 * 273)
    assert step[cv.SPARSE]["inter"] == (M if M > 1 else 0) * (p - 1) * (4 * 10 + 8 * 273)
    assert cv.warmup_step_bytes(M=M, P=P, buffer_sizes=[650, 32832])[cv.WARMUP] == {
        k: world_ring_bytes(650, 4, M, P)[k] + world_ring_bytes(32832, 4, M, P)[k]
        for k in ("intra", "inter")}
    assert cv.sparse_step_bytes(M=M, P=P, ar_counts=[0], ag_dense_counts=[0],
                                ag_sparse_counts=[0]) == {}
    assert math.isclose(cv.payload_ratio(100, [10], [0], [5]), (40 + 40) / 400)


def test_run_bytes_sums_the_steps():
    kw = {"M": 2, "P": 2, "warmup_buffer_sizes": [650, 32832], "ar_counts": [0, 64],
          "ag_dense_counts": [0, 0], "ag_sparse_counts": [8, 265], "num_tensors": 4}
    whole = cv.run_bytes(steps=7, warmup_steps=3, **kw)
    w = cv.warmup_step_bytes(M=2, P=2, buffer_sizes=kw["warmup_buffer_sizes"])[cv.WARMUP]
    s = cv.sparse_step_bytes(M=2, P=2, ar_counts=[0, 64], ag_dense_counts=[0, 0],
                             ag_sparse_counts=[8, 265])
    sel = cv.selection_bytes(M=2, P=2, num_tensors=4)
    assert whole[cv.WARMUP] == {k: 3 * v for k, v in w.items()}
    assert whole[cv.SPARSE] == {k: 4 * v for k, v in s[cv.SPARSE].items()}
    assert whole[cv.SELECT] == sel[cv.SELECT] and whole[cv.PROFILE] == sel[cv.PROFILE]
    short = cv.run_bytes(steps=2, warmup_steps=3, **kw)  # warm-up never completes
    assert set(short) == {cv.WARMUP}


# -- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    ({"density": 0.0}, "--density must be in (0, 1]"),
    ({"density": 1.5}, "--density must be in (0, 1]"),
    ({"density": 0.0005}, "--density 0.0005 is below --density-floor 0.001"),
    ({"density_floor": 0.0}, "--density-floor must be in (0, 1]"),
    ({"fusion": "multi"}, "--fusion 'multi' unknown"),
    ({"fusion_policy": "omgs"}, "--fusion-policy 'omgs' unknown"),
    ({"first_buffer": "dense"}, "--first-buffer 'dense' unknown"),
    ({"sparsifier": "randomk"}, "--sparsifier 'randomk' unknown"),
    ({"buffers": 0}, "--buffers must be an integer >= 1"),
    ({"buffers": 1.5}, "--buffers takes a whole number"),
    ({"buffer_mib": -1.0}, "--buffer-mib must be >= 0"),
    ({"profile_steps": 0}, "--profile-steps must be >= 1"),
    ({"profile_steps": 0, "fusion": "per-tensor"}, "or use --fusion-policy count"),
    ({"profile_steps": -1, "fusion": "per-tensor", "fusion_policy": "count"},
     "--profile-steps must be an integer >= 0"),
    ({"error_feedback": False}, "add --no-momentum-correction to --no-error-feedback"),
    ({"sample_ratio": 0.0}, "--sample-ratio must be in (0, 1]"),
    ({"offload": True, "fusion": "per-tensor"}, "--offload is SSFusion-O on top of"),
    ({"offload": True, "profile_steps": 1}, "use --profile-steps >= 2"),
    ({"offload_deadline": "step"}, "--offload-deadline 'step' unknown"),
])
def test_bad_options(kw, message):
    with pytest.raises(ValueError, match=None) as exc:
        SSFusionOptions(**kw)
    assert message in str(exc.value)


def test_documented_options():
    """The documented ways around the option checks build options whose plan does what the
    help says."""
    sizes = [10, 640, 64, 32768]
    p4 = Placement.node_major(2, 2)
    # lower the floor to go below it: per-tensor counts at density 0.0005
    low = SSFusionOptions(density=0.0005, density_floor=0.0005, fusion="per-tensor",
                          fusion_policy="count", buffers=2)
    assert plan_ssfusion(sizes, 4, cm.INTER, low, CostModel()).k == (1, 1, 1, 17)
    # baselines on fixed buffers need no warm-up: no profile, no warm-up step, no decision
    multi = SSFusionOptions(fusion="multi-tensor", fusion_policy="count", profile_steps=0)
    assert not needs_profile(multi)
    plan = plan_ssfusion(sizes, 4, cm.INTER, multi, CostModel())
    assert not plan.profiled and plan.buffers == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert [c.phase for c in plan.calls(p4, "warmup", decided=True)] == [cv.WARMUP] * 4
    # no error feedback and no momentum correction: the compute items count neither
    bare = SSFusionOptions(error_feedback=False, momentum_correction=False,
                           fusion="per-tensor", fusion_policy="count")
    ef = SSFusionOptions(fusion="per-tensor", fusion_policy="count")
    bare_plan = plan_ssfusion(sizes, 4, cm.INTER, bare, CostModel())
    ef_plan = plan_ssfusion(sizes, 4, cm.INTER, ef, CostModel())
    assert not bare_plan.error_feedback and ef_plan.error_feedback
    assert ef_plan.segment_flops(32768, 328, False) - bare_plan.segment_flops(
        32768, 328, False) == 32768
    assert ef_plan.segment_flops(32768, 328, True) - ef_plan.segment_flops(
        32768, 328, False) == 2 * 32768
    # density 1: every entry is sent
    full = SSFusionOptions(density=1.0, fusion="per-tensor", fusion_policy="count")
    assert plan_ssfusion(sizes, 4, cm.INTER, full, CostModel()).k == tuple(sizes)


# -- MPI ------------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_mpi_reference_sum_residuals_and_missing_rate(tmp_path):
    assert "OK reference" in run_mpi("dp_ssfusion_checks.py", 4, "reference", tmp_path,
                                     timeout=300).stdout


@pytest.mark.mpi
def test_mpi_offload_steps_run_their_programs(tmp_path):
    """SSFusion-O from the step's program: what the run records of every step is the program
    generated from the plan's records, the worker's items on the offload stream."""
    assert "OK offload_program" in run_mpi("dp_ssfusion_checks.py", 4, "offload_program",
                                           tmp_path, timeout=300).stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,configs", [(4, "selective,per-tensor,multi-tensor"),
                                           (4, "naive,offload"),
                                           (8, "selective,per-tensor,multi-tensor")],
                         ids=["2x2", "2x2-naive-offload", "4x2"])
def test_mpi_measured_bytes_equal_predicted(tmp_path, ranks, configs):
    """Measured == the trainer's per-step records == volume.ssfusion's whole-run closed form,
    per phase and link class, on 2 and 4 virtual nodes of 2 ranks."""
    assert "OK traffic" in run_mpi("dp_ssfusion_checks.py", ranks, "traffic", tmp_path, configs,
                                   timeout=300).stdout


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", [
    (["--density", "0"], "--density must be in (0, 1]"),
    (["--buffers", "99"], "--buffers 99 must be between 1 and the model's 8 tensors"),
])
def test_bad_flags_fail_on_every_rank(tmp_path, args, message):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "ssfusion", *args], message,
                               tmp_path / "x")


def test_every_flag_the_messages_name_exists():
    """Every ``--flag`` a data-parallel help text, error message or docstring names is a flag
    of ``dataparallel train`` (a flag renamed without its messages leaves users a fix that
    does not parse); a default-on feature may be named by its flag when ``--no-FLAG`` exists."""
    import ast
    import re
    from pathlib import Path

    from dataparallel.train import build_parser

    flags = {o for a in build_parser()._actions for o in a.option_strings}
    root = Path(__file__).resolve().parents[2] / "dataparallel"
    unknown = {}
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])",
                                   node.value):
                if flag not in flags and "--no-" + flag[2:] not in flags:
                    unknown.setdefault(flag, set()).add(f.name)
    assert not unknown, f"flags named in dataparallel/ that `dataparallel train` lacks: {unknown}"
