"""commvol.systems / commvol.predict: closed forms against hand-computed small cases, keep-rate
masks against the real projection, paper-scale numbers, names, and the ``predict`` CLI."""

import math

import numpy as np
import pytest
from prediction_helpers import iteration_cost

from commvol.__main__ import main
from commvol.predict import DATASET_SHAPES, model_names, predict, resolve_model
from commvol.systems import SYSTEMS, keep_rate_mask
from hsadmm.projection import parse_sparsity, structured_mask
from hsadmm.shrink import kept_indices
from models import ModelSpec, ParamSpec, build_model, get_spec
from substrate.calls import Work
from substrate.costmodel import CostModel

# T = 144 + 4 + 4 + 80 + 10 = 242 parameters, L = 5 tensors, one conv layer (4, 4, 3, 3)
TINY = ModelSpec("tiny", (4, 8, 8), 10, (
    ParamSpec("conv.weight", "conv", (4, 4, 3, 3)), ParamSpec("bn.weight", "bn", (4,)),
    ParamSpec("bn.bias", "bn", (4,)), ParamSpec("fc.weight", "fc", (10, 8)),
    ParamSpec("fc.bias", "bias", (10,))), 0)
# round numbers: intra 1 GB/s, 1 us; inter 0.1 GB/s, 10 us
COST = CostModel(intra_bw=1e9, inter_bw=1e8, intra_lat=1e-6, inter_lat=1e-5)
A_I, B_I, A_X, B_X = 1e-6, 1e-9, 1e-5, 1e-8


def _p(system, **kw):
    return predict(system, spec=TINY, nodes=2, gpus_per_node=2, cost=COST, **kw)


def test_hsadmm_hand_computed_iteration():
    pred = _p("hsadmm", keep=0.5, sparsity="channel", freeze_iter=1)
    synced, frozen = iteration_cost(pred, 0), iteration_cost(pred, 1)
    # channel keep 0.5: conv compact 4 x 2 x 9 = 72, C = 242 - 144 + 72 = 170; B = 144 bits
    assert synced.phases == {
        "intra_allreduce": {"intra": 2 * 2 * 1 * 4 * 242, "inter": 0},   # M 2(P-1) 4T
        "mask_sync": {"intra": 0, "inter": 2 * 1 * 18},                 # 2(M-1) B
        "mask_bcast": {"intra": 2 * 1 * 18, "inter": 0},                # M(P-1) B
        "inter_allreduce": {"intra": 0, "inter": 2 * 1 * 4 * 170},      # 2(M-1) 4C
        "bcast_z": {"intra": 2 * 1 * 4 * 170, "inter": 0},              # M(P-1) 4C
        # world ring of 27 float64 (9 per penalty group: conv, bn, fc) over 4 ranks, chunks
        # (7, 7, 7, 6): ranks 0, 2 send over intra links 40 + 41 elements, ranks 1, 3 over
        # inter links 41 + 40
        "residuals": {"intra": 81 * 8, "inter": 81 * 8}}
    assert set(frozen.phases) == set(synced.phases) - {"mask_sync", "mask_bcast"}
    assert synced.messages == {"intra_allreduce": 2 * 2 * 2, "mask_sync": 2 * 2,
                               "mask_bcast": 2, "inter_allreduce": 2 * 2, "bcast_z": 2,
                               "residuals": 4 * 2 * 3}
    want = {"intra_allreduce": 2 * (A_I + 4 * 242 / 2 * B_I),
            "mask_sync": 2 * (A_X + 18 / 2 * B_X), "mask_bcast": A_I + 18 * B_I,
            "inter_allreduce": 2 * (A_X + 4 * 170 / 2 * B_X), "bcast_z": A_I + 680 * B_I,
            "residuals": 6 * (A_X + 216 / 4 * B_X)}
    assert synced.modeled_s == pytest.approx(want, rel=1e-12)
    assert (synced.payload_bytes, synced.dense_payload_bytes) == (680, 968)
    total = pred.total(3)
    assert total.inter == synced.inter + 2 * frozen.inter
    assert [(a, b) for a, b, _ in pred.schedule(3)] == [(0, 0), (1, 2)]


def test_hsadmm_measured_compact_sizes_give_one_stage_each():
    """``--compact-elems`` (a run's per-iteration compact sizes, the OR of eq. 14 included):
    each iteration's bytes are the closed form's with that C, masks synced before the freeze;
    the last size repeats; the stage's records are laid after the local epochs."""
    from volume.hsadmm import hsadmm_iteration_bytes

    pred = _p("hsadmm", keep=0.5, freeze_iter=2, compact_elems=[170, 206, 242])
    for k, (c, synced) in enumerate([(170, True), (206, True), (242, False), (242, False)]):
        it = iteration_cost(pred, k)
        assert it.phases == hsadmm_iteration_bytes(M=2, P=2, total_params=242,
                                                   compact_sizes=[c], mask_bytes=18,
                                                   mask_synced=synced, num_layers=3), k
        assert it.payload_bytes == 4 * c
        assert it.calls[0].after == ("local",)
    assert [(a, b) for a, b, _ in pred.schedule(5)] == [(0, 0), (1, 1), (2, 2), (3, 4)]


def test_data_parallel_hand_computed_steps():
    ddp = _p("ddp").steady
    # ring of 242 floats over 4 ranks, chunks (61, 61, 60, 60): ranks send 363, 364, 363, 362
    assert ddp.phases == {"grad_allreduce": {"intra": 4 * 726, "inter": 4 * 726}}
    assert ddp.messages == {"grad_allreduce": 24}
    assert ddp.time_s == pytest.approx(6 * (A_X + 968 / 4 * B_X), rel=1e-12)
    hier = _p("ddp-hierarchical").steady
    assert hier.phases == {"intra_allreduce": {"intra": 3872, "inter": 0},
                           "inter_allreduce": {"intra": 0, "inter": 1936},
                           "intra_bcast": {"intra": 1936, "inter": 0}}
    top = _p("topk", density=0.01).steady  # k = 2 + 1 + 1 + 1 + 1 = 6 of 242
    assert top.phases == {"topk_allgather": {"intra": 2 * 3 * 48, "inter": 2 * 3 * 48}}
    assert top.messages == {"topk_allgather": 12} and top.payload_bytes == 48
    flat = _p("flat-admm").steady
    assert flat.phases["world_allreduce"] == ddp.phases["grad_allreduce"]
    # an iteration of several DDP steps is that many steps
    assert _p("ddp", steps_per_iter=3).steady.phases["grad_allreduce"]["inter"] == 3 * 4 * 726


@pytest.mark.parametrize("sparsity", ["channel", "filter", "filter+channel", "shape"])
def test_keep_rate_masks_match_the_projection(sparsity):
    kinds = parse_sparsity(sparsity)
    w = np.random.default_rng(1).standard_normal((8, 6, 3, 3)).astype(np.float32)
    real = structured_mask(w, kinds, 0.5)
    ours = keep_rate_mask(w.shape, kinds, 0.5)
    assert ours.sum() == real.sum()
    (ko, ki), (ro, ri) = kept_indices(ours), kept_indices(real)
    assert ko.size == ro.size
    if sparsity == "shape":  # spread over the channels: the widest K_in a shape mask can have
        assert ki.size >= ri.size
    else:
        assert ki.size == ri.size


def test_paper_scale_payload():
    """PruneX Fig. 6: the dense ResNet-152 payload over 60 iterations is 13.00 GiB; eq. 15 at
    channel keep 0.5 gives a compact ratio of 0.50 (the paper reports ~0.40, which keep 0.4
    reproduces); ResNet-18's dense payload is 2.50 GiB (paper: 2.53)."""
    r152 = predict("hsadmm", "resnet152", nodes=16, gpus_per_node=4, keep=0.5)
    t = r152.total(60)
    assert round(t.dense_payload_bytes / 2**30, 2) == 13.00
    assert 0.50 < t.payload_bytes / t.dense_payload_bytes < 0.51
    r04 = predict("hsadmm", "resnet152", nodes=16, gpus_per_node=4, keep=0.4).total(60)
    assert 0.40 < r04.payload_bytes / r04.dense_payload_bytes < 0.41
    r18 = predict("ddp", "resnet18", nodes=16, gpus_per_node=4).total(60)
    assert round(r18.payload_bytes / 2**30, 2) == 2.50
    ddp = predict("ddp", "resnet152", nodes=16, gpus_per_node=4).total(60)
    assert t.inter < 0.5 * ddp.inter


def test_model_specs_match_the_trainers_models():
    # (the digits shapes themselves are checked by the MPI test: predicted == measured)
    for name in ("cnn", "resnet", "mlp"):
        spec = resolve_model(name, "digits")
        model = build_model(name, *DATASET_SHAPES["digits"])
        assert [(n, model.layout.shape(n)) for n in model.layout.names] == \
            [(n, spec.layout.shape(n)) for n in spec.layout.names]
    assert resolve_model("wrn50_2").num_params == get_spec("wide_resnet50_2").num_params


def test_spec_arch_builds_the_spec_models():
    from commvol.specs import SPEC_ARCH
    from models.specs import spec_from_layers
    from models.zoo import resnet_layers

    for name, arch in SPEC_ARCH.items():
        spec = spec_from_layers(name, resnet_layers((3, 32, 32), 10, **arch), (3, 32, 32), 10)
        assert spec.params == get_spec(name).params


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid systems: .*hsadmm.*topk"):
        predict("hsdamm", "cnn", nodes=1, gpus_per_node=2)
    with pytest.raises(ValueError, match="valid models: .*resnet152.*wrn50_2"):
        predict("ddp", "resnet50", nodes=1, gpus_per_node=2)
    with pytest.raises(ValueError, match="no option.*'keep'"):
        predict("ddp", "cnn", nodes=1, gpus_per_node=2, keep=0.5)
    with pytest.raises(ValueError, match="--nodes must be a positive integer"):
        predict("ddp", "cnn", nodes=0, gpus_per_node=2)
    with pytest.raises(ValueError, match="keep rate must be in"):
        predict("hsadmm", "cnn", nodes=1, gpus_per_node=2, keep=1.5)
    with pytest.raises(ValueError, match="unknown system 'bogus'"):
        main(["predict", "--system", "bogus", "--model", "cnn"])
    assert "resnet152" in model_names() and "cnn" in model_names()


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_predict_cli_every_system(system, capsys, tmp_path):
    args = ["predict", "--system", system, "--nodes", "2", "--gpus-per-node", "2", "--iters",
            "3", "--out", str(tmp_path / "p.json")]
    if SYSTEMS[system].spec_kind == "radixnet":
        args += ["--neurons", "64", "--layers", "2"]
    else:
        args += ["--model", "cnn"]
    main(args)
    out = capsys.readouterr().out
    assert f"| {system} |" in out and "## assumptions" in out
    base = SYSTEMS[system].baseline
    if base and base != system:
        assert f"| {base} |" in out
    import json

    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["prediction"]["total"]["inter_node_bytes"] > 0
    assert math.isfinite(doc["prediction"]["total"]["modeled_s"])


# ---------------------------------------------------------------------------------------------
# PacTrain and SDP
# ---------------------------------------------------------------------------------------------
def test_pactrain_hand_computed_steps():
    pred = _p("pactrain", prune_ratio=0.5, warmup_steps=1, stable_window=2, prune_score="grasp")
    # dense in steps 0 .. w + W - 1 = 2; GraSP's two all-reduces of T at step max(w - 1, 0) = 0
    assert [(a, b) for a, b, _ in pred.schedule(6)] == [(0, 0), (1, 2), (3, 5)]
    first, packed = iteration_cost(pred, 0), iteration_cost(pred, 3)
    assert first.phases == {"dense_allreduce": {"intra": 4 * 726, "inter": 4 * 726},
                            "grasp_allreduce": {"intra": 8 * 726, "inter": 8 * 726}}
    assert first.messages == {"dense_allreduce": 24, "grasp_allreduce": 48}
    assert iteration_cost(pred, 2).phases == {"dense_allreduce": first.phases["dense_allreduce"]}
    # K = 72 of the conv's 144 + 40 of the fc's 80 + 4 + 4 (BN) + 10 (bias) = 130: a ring of
    # 130 floats over 4 ranks, chunks (33, 33, 32, 32): ranks send 195, 196, 195, 194
    assert packed.phases == {"packed_allreduce": {"intra": 4 * (195 + 195),
                                                  "inter": 4 * (196 + 194)}}
    assert packed.messages == {"packed_allreduce": 24}
    assert packed.time_s == pytest.approx(6 * (A_X + 520 / 4 * B_X), rel=1e-12)
    assert (packed.payload_bytes, packed.dense_payload_bytes) == (520, 968)
    tern = _p("pactrain", ternary=True, stable_window=0, warmup_steps=0,
              prune_score="magnitude")
    assert len(tern.stages) == 1  # packed from the first step
    # 5 scales, chunks (2, 1, 1, 1): ranks send 8, 8, 7, 7 floats; ceil(130 / 4) = 33 code
    # bytes per rank, (p - 1) 33 = 99 bytes on each of the 2 intra and 2 inter ring links
    assert tern.steady.phases == {"ternary_scale": {"intra": 4 * 15, "inter": 4 * 15},
                                  "ternary_allgather": {"intra": 198, "inter": 198}}
    assert tern.steady.messages == {"ternary_scale": 24, "ternary_allgather": 12}
    assert tern.steady.modeled_s == pytest.approx(
        {"ternary_scale": 6 * (A_X + 20 / 4 * B_X), "ternary_allgather": 3 * (A_X + 33 * B_X)},
        rel=1e-12)
    assert tern.steady.payload_bytes == 33 + 4 * 5
    # a global scale is one float; grasp without warm-up is charged to the first step
    glob = _p("pactrain", ternary=True, ternary_scale="global", stable_window=1, warmup_steps=0,
              prune_score="grasp")
    assert glob.steady.phases["ternary_scale"]["inter"] + \
        glob.steady.phases["ternary_scale"]["intra"] == 2 * 3 * 4
    assert "grasp_allreduce" in iteration_cost(glob, 0).phases
    assert "grasp_allreduce" not in iteration_cost(glob, 1).phases


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 0.97])
def test_pactrain_kept_matches_the_pruning(ratio):
    from commvol.systems import pactrain_kept
    from dataparallel.pactrain import prune_mask

    for name in ("cnn", "resnet"):
        layout = build_model(name, *DATASET_SHAPES["digits"]).layout
        imp = np.random.default_rng(0).random(layout.total)
        assert pactrain_kept(layout, ratio) == int(prune_mask(imp, layout, ratio).sum())


def test_predictions_take_the_runs_own_options():
    """One options class per system: a prediction takes exactly the dataclass the run takes
    (no copy to keep in step), and prediction-only assumptions repeat no option."""
    from commvol.systems import get_system
    from dataparallel import ddp, pactrain, sdp, ssfusion, topk
    from hsadmm.config import HSADMMConfig

    for name, cls in (("ddp", ddp.DDPOptions), ("ddp-hierarchical", ddp.DDPOptions),
                      ("topk", topk.TopKOptions), ("sdp", sdp.SDPOptions),
                      ("pactrain", pactrain.PacTrainOptions),
                      ("ssfusion", ssfusion.SSFusionOptions), ("flat-admm", HSADMMConfig),
                      ("hsadmm", HSADMMConfig)):
        sm = get_system(name)
        assert sm.Options is cls, name
        if sm.Assumptions is not None:
            assert not set(sm.Assumptions.__dataclass_fields__) & set(cls.__dataclass_fields__)


@pytest.mark.parametrize("model,kw", [("cnn", {"coverage": "4/4"}),
                                      ("resnet", {"sdp_mode": "block", "active_blocks": "3/3"})])
def test_sdp_full_coverage_is_ddp(model, kw):
    """Every coordinate on every worker: the gated average is DDP's world ring all-reduce."""
    pred = predict("sdp", model, nodes=2, gpus_per_node=2, cost=COST, **kw)
    ddp = predict("ddp", model, nodes=2, gpus_per_node=2, cost=COST).steady
    step = pred.steady
    assert step.phases == {"sdp_gated_allreduce": ddp.phases["grad_allreduce"]}
    assert step.messages == {"sdp_gated_allreduce": ddp.messages["grad_allreduce"]}
    assert step.time_s == pytest.approx(ddp.time_s, rel=1e-12)
    assert pred.evaluation is None and step.payload_bytes == step.dense_payload_bytes


def test_sdp_evaluations_follow_the_trainer():
    pred = predict("sdp", "cnn", nodes=2, gpus_per_node=2, eval_every=2)
    step, ev = pred.steady, pred.evaluation
    # dataparallel.train evaluates after steps k + 1 = 2, 4 and after the last one
    assert pred.eval_iterations(5) == [1, 3, 4] and pred.eval_iterations(4) == [1, 3]
    assert [(a, b) for a, b, _ in pred.schedule(5)] == [(0, 0), (1, 1), (2, 2), (3, 4)]
    total = pred.total(5)
    assert (total.inter, total.intra) == (5 * step.inter + 3 * ev.inter,
                                          5 * step.intra + 3 * ev.intra)
    assert total.messages["sdp_assemble"] == 3 * ev.messages["sdp_assemble"]
    assert "sdp_assemble" in iteration_cost(pred, 3).phases
    assert iteration_cost(pred, 4).phases == step.phases  # of a longer run: no evaluation
    assert predict("sdp", "cnn", nodes=2, gpus_per_node=2).eval_iterations(5) == [4]
    # one message per sending rank; rank 0 receives (the sender records)
    senders = [r for r, t in enumerate(ev.rank_s) if t > 0]
    assert ev.rank_s[0] == 0 and ev.messages == {"sdp_assemble": len(senders)} and senders
    assert set(step.phases) == {"sdp_gated_allreduce"}  # steady (scale): training only


def test_sdp_time_is_the_busiest_ranks():
    """B-SDP: ranks sit in different holder sets and only the senders spend time at the
    assembly, so the run's time (the maximum over ranks of their sums, as ``timing``) is below
    the sum of the phases' maxima; B_b-SDP adds the parameter broadcasts, assembles nothing."""
    pred = predict("sdp", "resnet", nodes=2, gpus_per_node=2, sdp_mode="block")
    total = pred.total(3)
    assert total.time_s == pytest.approx(max(total.rank_s), rel=1e-12)
    assert total.time_s < sum(total.modeled_s.values())
    back = predict("sdp", "resnet", nodes=2, gpus_per_node=2, sdp_mode="block-backward")
    assert back.evaluation is None
    assert set(back.steady.phases) == {"sdp_gated_allreduce", "sdp_param_bcast"}
    assert back.steady.phases["sdp_gated_allreduce"] == pred.steady.phases["sdp_gated_allreduce"]


def test_sdp_seed_reaches_the_block_order(tmp_path, capsys):
    import json

    kw = {"nodes": 2, "gpus_per_node": 2, "sdp_mode": "block"}
    by_seed = {s: predict("sdp", "resnet", seed=s, **kw).steady.inter for s in range(6)}
    assert len(set(by_seed.values())) > 1  # which block two workers share moves the bytes
    main(["predict", "--system", "sdp", "--model", "resnet", "--sdp-mode", "block", "--seed",
          "3", "--nodes", "2", "--gpus-per-node", "2", "--iters", "1", "--out",
          str(tmp_path / "p.json")])
    capsys.readouterr()
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["prediction"]["schedule"][0]["by_phase"]["sdp_gated_allreduce"][
        "inter_bytes"] == by_seed[3]


def test_pactrain_and_sdp_bad_options(capsys):
    def bad(system, match, model="cnn", **kw):
        with pytest.raises(ValueError, match=match):
            predict(system, model, nodes=2, gpus_per_node=2, **kw)

    bad("pactrain", r"--prune-ratio must be in \[0, 1\)", prune_ratio=1.0)
    bad("pactrain", "--prune-score 'bogus' unknown; use one of", prune_score="bogus")
    bad("pactrain", "--ternary-scale 'layer' unknown", ternary_scale="layer")
    bad("pactrain", "--stable-window must be >= 0", stable_window=-1)
    bad("pactrain", "--warmup-steps takes a whole number", warmup_steps=1.5)
    bad("sdp", "--sdp-mode 'bogus' unknown; use one of", sdp_mode="bogus")
    bad("sdp", "--coverage 'x' is malformed", coverage="x")
    bad("sdp", r"gives p = 1.33333 workers per parameter", coverage="1/3")
    bad("sdp", "--active-blocks applies to --sdp-mode block", active_blocks="2/3")
    bad("sdp", "model 'cnn' has none; use --model resnet", sdp_mode="block")
    bad("sdp", "has d = 3 residual blocks", model="resnet", sdp_mode="block",
        active_blocks="2/4")
    bad("sdp", "--eval-every must be an integer >= 0", eval_every=-1)
    with pytest.raises(ValueError, match="plans its masks on the model's layers"):
        _p("sdp")
    with pytest.raises(SystemExit):    # the flag's declared choices, refused by the parser
        main(["predict", "--system", "sdp", "--model", "cnn", "--sdp-mode", "bogus"])
    assert "argument --sdp-mode: invalid choice: 'bogus'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# SSFusion
# ---------------------------------------------------------------------------------------------
def test_ssfusion_per_tensor_hand_computed():
    # TINY in backward order: fc.bias 10, fc.weight 80, bn.bias 4, bn.weight 4, conv 144;
    # --fusion-policy count --buffers 2: [fc.bias, fc.weight, bn.bias] (94) and [bn.weight,
    # conv.weight] (148); k_l = max(1, ceil(0.01 n_l)) = 1, 1, 1 | 1, 2: K = 3 and 3
    pred = _p("ssfusion", fusion="per-tensor", fusion_policy="count", buffers=2,
              profile_steps=2)
    assert [(a, b) for a, b, _ in pred.schedule(5)] == [(0, 1), (2, 4)]
    warm, step = iteration_cost(pred, 0), pred.steady
    assert warm.messages == {"ssf_warmup_allreduce": 2 * 24}
    assert sum(warm.phases["ssf_warmup_allreduce"].values()) == 2 * 3 * 4 * (94 + 148)
    assert warm.modeled_s["ssf_warmup_allreduce"] == pytest.approx(
        6 * (A_X + 4 * 94 / 4 * B_X) + 6 * (A_X + 4 * 148 / 4 * B_X), rel=1e-12)
    # all-gather of 8 K = 24 bytes per rank per buffer: (p - 1) 24 on every one of the 2 intra
    # and 2 inter ring links
    assert step.phases == {"ssf_sparse_allgather": {"intra": 2 * 2 * 3 * 24,
                                                    "inter": 2 * 2 * 3 * 24}}
    assert step.messages == {"ssf_sparse_allgather": 2 * 12}
    assert step.modeled_s["ssf_sparse_allgather"] == pytest.approx(2 * 3 * (A_X + 24 * B_X),
                                                                   rel=1e-12)
    assert (step.payload_bytes, step.dense_payload_bytes) == (48, 968)
    # multi-tensor: one top-K_i per buffer, the same K_i: the same traffic (its compute items
    # launch one selection a buffer instead of one a tensor)
    multi = _p("ssfusion", fusion="multi-tensor", fusion_policy="count", buffers=2,
               profile_steps=2)

    def traffic(c):
        return c.phases, c.messages, c.modeled_s, c.payload_bytes, c.dense_payload_bytes

    assert traffic(multi.steady) == traffic(step)
    assert iteration_cost(multi, 1) == iteration_cost(pred, 1)
    kernels = {w.label: w.kernels for w in step.calls if isinstance(w, Work)}
    multi_kernels = {w.label: w.kernels for w in multi.steady.calls if isinstance(w, Work)}
    assert kernels["ssf_sparsify[0]"] == 3 * multi_kernels["ssf_sparsify[0]"]  # 3 tensors
    assert kernels["ssf_sparsify[1]"] == 2 * multi_kernels["ssf_sparsify[1]"]  # 2 tensors
    # the whole run equals volume.ssfusion.run_bytes (no decision with fixed buffers)
    from volume.ssfusion import run_bytes

    assert pred.total(5).phases == run_bytes(
        M=2, P=2, steps=5, warmup_steps=2, warmup_buffer_sizes=[94, 148], ar_counts=[0, 0],
        ag_dense_counts=[0, 0], ag_sparse_counts=[3, 3], num_tensors=5, selection=False)
    # the default (Cupcake) buffers depend on the profile: the run decides them after warm-up
    cupcake = _p("ssfusion", fusion="per-tensor", profile_steps=2)
    assert "ssf_select_bcast" in iteration_cost(cupcake, 1).phases


def test_ssfusion_selective_given_selection_hand_computed():
    # --density 0.2: k = 2, 16, 1 | 1, 29 (K = 19, 30); fc.bias and bn.bias dense: fc.weight
    # absorbs them (k' = 19 - 14 = 5); l'_0 = 1 puts fc.bias into Buffer_AR, bn.bias into
    # Buffer_AG
    from commvol.systems.ssfusion import SSFusionAssumptions, predict_ssfusion
    from dataparallel.ssfusion import SSFusionOptions

    def sel(**kw):
        o = SSFusionOptions(**{"buffers": 2, "profile_steps": 3, "density": 0.2,
                               "fusion_policy": "count", **kw})
        return predict_ssfusion(TINY, 2, 2, o, COST, SSFusionAssumptions(
            dense_tensors="fc.bias,bn.bias", interleave_split="1,0" if o.interleave else None))

    pred = sel()
    assert [(a, b) for a, b, _ in pred.schedule(6)] == [(0, 1), (2, 2), (3, 5)]
    decide, step = iteration_cost(pred, 2), pred.steady
    # profile: 3L + 2 = 17 float64 MAX all-reduce; plan: 4L = 20 int64 from rank 0
    # (binomial tree 0 -> 2 over the inter link, 0 -> 1 and 2 -> 3 intra)
    assert sum(decide.phases["ssf_profile_allreduce"].values()) == 2 * 3 * 8 * 17
    assert decide.phases["ssf_select_bcast"] == {"intra": 2 * 160, "inter": 160}
    assert decide.messages["ssf_select_bcast"] == 3
    assert "ssf_profile_allreduce" not in iteration_cost(pred, 1).phases
    # AR: 10 floats, 2 (p-1) 40 / p = 60 B per rank; AG blocks 4 * 4 + 8 * 5 = 56 and
    # 8 * 30 = 240 B per rank
    assert sum(step.phases["ssf_dense_allreduce"].values()) == 4 * 60
    assert step.phases["ssf_sparse_allgather"] == {"intra": 2 * 3 * (56 + 240),
                                                   "inter": 2 * 3 * (56 + 240)}
    assert step.messages == {"ssf_dense_allreduce": 24, "ssf_sparse_allgather": 24}
    assert step.modeled_s == pytest.approx(
        {"ssf_dense_allreduce": 6 * (A_X + 10 * B_X),
         "ssf_sparse_allgather": 3 * (A_X + 56 * B_X) + 3 * (A_X + 240 * B_X)}, rel=1e-12)
    from volume.ssfusion import run_bytes

    assert pred.total(6).phases == run_bytes(
        M=2, P=2, steps=6, warmup_steps=3, warmup_buffer_sizes=[94, 148], ar_counts=[10, 0],
        ag_dense_counts=[4, 0], ag_sparse_counts=[5, 30], num_tensors=5)
    # --no-interleave all-gathers the dense tensors too
    naive = sel(interleave=False).steady
    assert naive.phases == {"ssf_sparse_allgather": {"intra": 2 * 3 * (96 + 240),
                                                     "inter": 2 * 3 * (96 + 240)}}


def test_ssfusion_default_selection_is_the_eq2_rule():
    """Without a recorded selection the eq. 2 rule runs on the assumed profile: with no
    compute at all eq. 2 holds at once (nothing to hide), every tensor is sparse and the
    traffic is per-tensor's; the chosen selection, passed back explicitly, gives the same."""
    from commvol.systems.ssfusion import SSFusionAssumptions, predict_ssfusion, ssfusion_plan
    from dataparallel.ssfusion import SSFusionOptions

    o = SSFusionOptions(buffers=2, fusion_policy="count")
    free = predict_ssfusion(TINY, 2, 2, o, COST, SSFusionAssumptions(backward_ns=0,
                                                                      sparsify_ns=0))
    assert free.steady == _p("ssfusion", buffers=2, fusion="per-tensor",
                             fusion_policy="count").steady
    assert any("assumed profile" in n for n in free.notes)
    o = SSFusionOptions(buffers=2, density=0.1, fusion_policy="count", first_buffer="exclude")
    slow = SSFusionAssumptions(backward_ns=1e4, sparsify_ns=1e4)
    plan, _ = ssfusion_plan(TINY, 4, "inter", o, slow, COST)
    assert plan.dense()  # slow compute: small tensors stay dense to shorten the backward
    names = [TINY.layout.names[l] for l in plan.dense()]
    again = predict_ssfusion(TINY, 2, 2, o, COST, SSFusionAssumptions(
        dense_tensors=names, interleave_split=list(plan.split)))
    assert again.steady == predict_ssfusion(TINY, 2, 2, o, COST, slow).steady


def test_ssfusion_predicts_with_the_strategy_options():
    from dataparallel import ssfusion

    assert SYSTEMS["ssfusion"].Options is ssfusion.SSFusionOptions


def test_ssfusion_bad_options(tmp_path):
    from commvol.systems.ssfusion import SSFusionAssumptions, predict_ssfusion
    from dataparallel.ssfusion import SSFusionOptions

    def bad(match, **kw):
        with pytest.raises(ValueError, match=match):
            _p("ssfusion", **kw)

    def bad_assumed(match, options=None, **kw):
        with pytest.raises(ValueError, match=match):
            predict_ssfusion(TINY, 2, 2, options or SSFusionOptions(), COST,
                             SSFusionAssumptions(**kw))

    bad("--fusion 'bogus' unknown; use one of", fusion="bogus")
    bad("--buffers must be an integer >= 1", buffers=0)
    bad("--buffers takes a whole number", buffers=1.5)
    bad("--buffers 9 must be between 1 and the model's 5 tensors", buffers=9)
    bad("below --density-floor", density=0.0005)
    bad("--profile-steps must be >= 1", profile_steps=0)
    bad_assumed("--backward-ns must be a finite time >= 0", backward_ns=-1.0)
    bad_assumed(r"--dense-tensors: \['conv.w'\] are not tensors of model 'tiny'",
                dense_tensors="conv.w")
    bad_assumed("cannot be compensated at --density-floor", dense_tensors="fc.weight")
    bad_assumed("use --fusion selective or drop them", SSFusionOptions(fusion="per-tensor"),
                dense_tensors="bn.bias")
    bad_assumed("--interleave-split needs --dense-tensors", interleave_split="0,0,0,0")
    bad_assumed("interleave split", SSFusionOptions(fusion_policy="count", buffers=2),
                dense_tensors="bn.bias", interleave_split="0")
    bad_assumed("--interleave-split takes one integer", dense_tensors="bn.bias",
                interleave_split="a")
    bad_assumed("no summary.json there", selection_from=str(tmp_path))
    with pytest.raises(SystemExit):  # argparse: invalid choice 'bogus' for --fusion
        main(["predict", "--system", "ssfusion", "--model", "cnn", "--fusion", "bogus"])


def test_ssfusion_cli_selection_flags(capsys):
    # the embedded CNN's --fusion-policy count buffers: [fc2.*], [fc1.bias, fc1.weight],
    # [conv2.*], [conv1.*]
    main(["predict", "--system", "ssfusion", "--model", "cnn", "--nodes", "2",
          "--gpus-per-node", "2", "--iters", "7", "--fusion-policy", "count",
          "--dense-tensors", "fc1.bias", "--interleave-split", "0,1,0,0", "--density", "0.05"])
    out = capsys.readouterr().out
    assert "dense tensors ['fc1.bias'], splits l'_i = [0, 1, 0, 0]" in out
    assert "| ssfusion (1 step) | 5-6 | ssf_dense_allreduce |" in out
    assert "timing-dependent parts: given" in out
