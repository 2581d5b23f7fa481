"""The H-SADMM shrink plan against eq. 15 written from the paper (no MPI), the solver's options
as flags, keep counts and penalty groups.

The second source is :func:`volume.hsadmm.hsadmm_eq15_iteration_bytes`: bytes per phase from
layer shapes and keep rates alone (``|K_out| |K_in| K_H K_W`` per conv weight, every other tensor
whole, ``B = ceil(conv numel / 8)``), sharing no code with :class:`hsadmm.shrink.ShrinkPlan`,
whose buckets give the bytes the run books and ``commvol`` predicts.
"""

import dataclasses

import numpy as np
import pytest

from commvol.predict import predict
from hsadmm.config import PAPER_DEFAULTS, HSADMMConfig
from hsadmm.penalty import increase_penalty, penalty_groups
from hsadmm.projection import keep_count, parse_sparsity, structured_mask
from hsadmm.shrink import ShrinkPlan, kept_indices
from hsadmm.train import TrainConfig, build_parser, solver_config
from models import ModelSpec, ParamSpec, build_model
from substrate.options import option_flags
from volume.hsadmm import (
    eq15_kept_sets,
    hsadmm_eq15_iteration_bytes,
    hsadmm_iteration_bytes,
    kept_groups,
)

# odd shapes: 3, 5, 7, 9 channels, 1x1 and 3x3 and 5x3 kernels, an FC and BN tensors
ODD = ModelSpec("odd", (3, 8, 8), 10, (
    ParamSpec("c1.weight", "conv", (5, 3, 3, 3)), ParamSpec("c1.bias", "bias", (5,)),
    ParamSpec("bn1.weight", "bn", (5,)), ParamSpec("bn1.bias", "bn", (5,)),
    ParamSpec("c2.weight", "conv", (7, 5, 1, 1)),
    ParamSpec("c3.weight", "conv", (9, 7, 5, 3)), ParamSpec("c3.bias", "bias", (9,)),
    ParamSpec("fc.weight", "fc", (10, 9)), ParamSpec("fc.bias", "bias", (10,))), 0)
SPARSITIES = ["channel", "filter", "filter+channel", "shape", "channel+shape"]


def _layers(layout):
    return [(n, layout.kind(n), layout.shape(n)) for n in layout.names]


def _plan_bytes(plan, layout, cfg, M, P, synced):
    """What the run books and commvol predicts: the plan's buckets through the ring formulas."""
    L = len(penalty_groups(layout, cfg.rho_scope)[0])
    return hsadmm_iteration_bytes(M=M, P=P, total_params=layout.total,
                                  compact_sizes=[b - a for a, b in plan.buckets],
                                  mask_bytes=plan.mask_bytes, mask_synced=synced,
                                  num_layers=L)


def _eq15_bytes(layout, cfg, M, P, synced, overrides=None):
    L = len(penalty_groups(layout, cfg.rho_scope)[0])
    return hsadmm_eq15_iteration_bytes(M=M, P=P, layers=_layers(layout), keep=cfg.keep,
                                       sparsity=cfg.sparsity, mask_synced=synced, num_groups=L,
                                       keep_overrides=overrides)


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("keep", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("M,P", [(2, 3), (3, 1), (1, 3), (3, 5)])
def test_plan_bytes_equal_eq15_on_odd_shapes(sparsity, keep, M, P):
    cfg = HSADMMConfig(keep=keep, sparsity=sparsity, bucket_mib=0.0005)  # several buckets
    plan = ShrinkPlan.from_keep_rates(ODD.layout, cfg)
    assert len(plan.buckets) > 1
    for synced in (True, False):
        assert _plan_bytes(plan, ODD.layout, cfg, M, P, synced) == \
            _eq15_bytes(ODD.layout, cfg, M, P, synced)


@pytest.mark.parametrize("model", ["cnn", "resnet"])
@pytest.mark.parametrize("sparsity", ["channel", "filter+channel", "shape"])
def test_predicted_iterations_equal_eq15_for_the_trainers_models(model, sparsity):
    """``commvol predict``'s per-iteration bytes (before and after the freeze) for the digits
    models on 2 nodes x 3 ranks equal eq. 15's, also with a per-layer keep file."""
    spec = build_model(model, (1, 8, 8), 10).spec()
    pred = predict("hsadmm", spec=spec, nodes=2, gpus_per_node=3, keep=0.5, sparsity=sparsity,
                   freeze_iter=2)
    cfg = HSADMMConfig(keep=0.5, sparsity=sparsity)
    assert pred.per_iteration(0).phases == _eq15_bytes(spec.layout, cfg, 2, 3, True)
    assert pred.per_iteration(5).phases == _eq15_bytes(spec.layout, cfg, 2, 3, False)


def test_keep_file_overrides_reach_the_plan(tmp_path):
    spec = build_model("resnet", (1, 8, 8), 10).spec()
    over = {"layer2.0.conv1.weight": 0.25, "layer3.0.conv2.weight": 0.75}
    path = tmp_path / "keep.json"
    path.write_text(__import__("json").dumps(over))
    cfg = HSADMMConfig(keep=0.5, keep_file=str(path))
    pred = predict("hsadmm", spec=spec, nodes=3, gpus_per_node=3, keep=0.5, keep_file=str(path))
    assert pred.per_iteration(0).phases == _eq15_bytes(spec.layout, cfg, 3, 3, True, over)
    assert pred.per_iteration(0).phases != _eq15_bytes(spec.layout, cfg, 3, 3, True)


@pytest.mark.parametrize("sparsity", ["channel", "filter", "filter+channel"])
def test_eq15_sets_are_those_of_the_real_projection(sparsity):
    """|K_out|, |K_in| of the closed form = those of the projection of a random weight."""
    rng = np.random.default_rng(3)
    for shape in [(5, 3, 3, 3), (9, 7, 5, 3), (4, 9, 1, 1)]:
        w = rng.standard_normal(shape)
        ko, ki = kept_indices(structured_mask(w, parse_sparsity(sparsity), 0.5))
        assert (ko.size, ki.size) == eq15_kept_sets(shape, 0.5, sparsity)


def test_keep_count_rounds_to_nearest_ties_up():
    # keep 0.5 of 9 keeps 5 (not Python's round-half-to-even 4), of 11 keeps 6
    assert [keep_count(0.5, n) for n in (1, 2, 3, 9, 11)] == [1, 1, 2, 5, 6]
    assert keep_count(0.4, 64) == 26 and keep_count(0.01, 10) == 1 and keep_count(1.0, 7) == 7
    for n in range(1, 40):
        for keep in (0.1, 0.25, 0.3, 0.5, 0.7, 0.9):
            assert keep_count(keep, n) == kept_groups(keep, n)


def test_penalty_groups_are_layers():
    layout = build_model("resnet", (1, 8, 8), 10).layout
    groups, of = penalty_groups(layout, "layer")
    names = list(layout.names)
    # a layer's tensors share one group; BatchNorm's scale and shift are one layer
    assert of[names.index("layer1.0.bn1.weight")] == of[names.index("layer1.0.bn1.bias")]
    assert of[names.index("fc.weight")] == of[names.index("fc.bias")]
    assert of[names.index("layer1.0.bn1.weight")] != of[names.index("layer1.0.conv1.weight")]
    assert len(groups) == len({n.rsplit(".", 1)[0] for n in names}) < len(names)
    per_tensor, of_t = penalty_groups(layout, "tensor")
    assert per_tensor == names and list(of_t) == list(range(len(names)))


def test_train_flags_come_from_the_dataclasses():
    p = build_parser()
    text = p.format_help()
    for cls in (TrainConfig, HSADMMConfig):
        for name, flag in option_flags(cls).items():
            assert f"{flag} " in text or f"{flag}\n" in text, (name, flag)
    assert "--iters ITERS" in text and "--batch-size BATCH_SIZE" in text
    assert "--batch " not in text and "--iterations" not in text
    args = p.parse_args(["--rho-scope", "tensor", "--theta-weight-decay", "--keep", "0.3"])
    cfg = solver_config(args)
    assert (cfg.rho_scope, cfg.theta_weight_decay, cfg.keep) == ("tensor", True, 0.3)


def test_paper_defaults_fill_only_options_not_given():
    p = build_parser()
    cfg = solver_config(p.parse_args(["--paper-defaults", "--rho1", "0.5"]))
    assert cfg.rho1 == 0.5  # given on the command line
    want = {k: v for k, v in PAPER_DEFAULTS.items() if k != "rho1"}
    assert {k: getattr(cfg, k) for k in want} == want
    assert dataclasses.replace(cfg, rho1=0.05) != HSADMMConfig()


@pytest.mark.parametrize("bad,message", [
    ({"rho_scope": "model"}, "unknown --rho-scope 'model'"),
    ({"freeze_patience": -1}, "--freeze-patience must be >= 0"),
    ({"keep": 0.0}, "keep rate must be in (0, 1]"),
])
def test_bad_options_name_the_flag(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HSADMMConfig(**bad)


def test_increase_penalty_doubles_to_the_cap():
    """--rho-update increase: PruneX §5.1.5's rho1 = 1.5e-3 reaches the cap 10 after 13
    doublings; the scaled duals are rescaled by rho_old / rho_new."""
    rho, steps = np.array([1.5e-3, 20.0]), 0
    while rho[0] < 10:
        new, scale = increase_penalty(rho, rho_max=10.0)
        assert np.allclose(scale * new, rho) and new[1] == 20.0  # above the cap: left alone
        rho, steps = new, steps + 1
    assert steps == 13 and rho[0] == 10.0
    with pytest.raises(ValueError, match="tau > 1"):
        increase_penalty(rho, tau=1.0)
    with pytest.raises(ValueError, match="unknown --rho-update 'grow'"):
        HSADMMConfig(rho_update="grow")
