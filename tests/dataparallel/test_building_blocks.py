import dataclasses

"""Serial tests of the data-parallel building blocks: buckets, top-k selection, option flags and
the closed forms of volume.dataparallel against hand-computed cases."""

import argparse
import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

from dataparallel import STRATEGIES
from dataparallel.ddp import DDPOptions, flat_buckets
from dataparallel.strategy import add_options_args, options_from_args
from dataparallel.topk import TopKOptions, topk_select
from dataparallel.train import DPConfig, build_parser
from models import build_model
from volume.dataparallel import ddp_step_bytes, hierarchical_step_bytes, topk_k, topk_step_bytes


def test_flat_buckets_are_contiguous_whole_tensors_within_budget():
    layout = build_model("cnn", (1, 8, 8), 10).layout
    sizes = [layout.sizes[n] for n in layout.names]
    budget = 4 * 300
    b = flat_buckets(layout, budget, 4)
    assert b[0][0] == 0 and b[-1][1] == layout.total
    assert all(x[1] == y[0] for x, y in itertools.pairwise(b))
    bounds = set(np.cumsum([0] + sizes).tolist())
    for a, c in b:  # bucket edges are tensor edges; over budget only for a single tensor
        assert a in bounds and c in bounds
        assert 4 * (c - a) <= budget or (c - a) in sizes


def test_topk_select_matches_sorting():
    rng = np.random.default_rng(0)
    acc = rng.standard_normal(50).astype(np.float32)
    offsets = np.array([0, 7, 20, 50])
    ks = [2, 13, 3]
    idx = np.empty(sum(ks), np.int64)
    topk_select(acc, offsets, ks, idx)
    want = []
    for l, k in enumerate(ks):
        seg = acc[offsets[l]:offsets[l + 1]]
        want += (np.argsort(-np.abs(seg))[:k] + offsets[l]).tolist()
    assert sorted(idx.tolist()) == sorted(want)


def test_topk_k_rounds_up_with_floor_one():
    assert topk_k([10, 1000, 3], 0.01) == [1, 10, 1]
    assert topk_k([4], 1.0) == [4]


def test_closed_forms_hand_computed():
    # 2 nodes x 2 ranks, one bucket of 8 float32 (32 B): ring of 4 carries 2 (p-1)/p n per link
    # = 48 B on each of 4 links, 2 of which cross nodes
    assert ddp_step_bytes(M=2, P=2, bucket_sizes=[8]) == {
        "grad_allreduce": {"intra": 96, "inter": 96}}
    # hierarchical: intra ring of 2 per node (2 x 32 B per node), leaders' ring of 2 (2 x 32 B),
    # bcast 32 B per node
    assert hierarchical_step_bytes(M=2, P=2, bucket_sizes=[8]) == {
        "intra_allreduce": {"intra": 128, "inter": 0},
        "inter_allreduce": {"intra": 0, "inter": 64},
        "intra_bcast": {"intra": 64, "inter": 0}}
    # top-k all-gather: K = 5 pairs of 8 B = 40 B per rank, each link carries (p-1) blocks
    assert topk_step_bytes(M=2, P=2, k_total=5) == {
        "topk_allgather": {"intra": 240, "inter": 240}}
    assert topk_step_bytes(M=1, P=4, k_total=5)["topk_allgather"]["inter"] == 0


def test_every_strategy_option_is_a_cli_flag():
    p = build_parser()
    args = p.parse_args(["--method", "topk", "--density", "0.05", "--no-error-feedback"])
    opts = options_from_args(STRATEGIES["topk"].Options, args)
    assert opts == TopKOptions(density=0.05, error_feedback=False)
    assert options_from_args(DDPOptions, p.parse_args([])) == DDPOptions()


def test_conflicting_shared_flag_defaults_are_refused():
    @dataclass(frozen=True)
    class Other:
        density: float = field(default=0.5, metadata={"help": "x"})

    p = argparse.ArgumentParser()
    add_options_args(p, TopKOptions, "topk")
    with pytest.raises(ValueError, match="declared twice"):
        add_options_args(p, Other, "other")


def test_shared_flag_help_names_every_method_that_reads_it():
    """--density sits in one method's group but topk and ssfusion both read it: the help says
    so, and a flag only one method reads is not labelled."""
    from dataparallel.strategy import STRATEGIES
    from dataparallel.train import build_parser
    readers = sorted(n for n, c in STRATEGIES.items()
                     if "density" in {f.name for f in dataclasses.fields(c.Options)})
    assert len(readers) >= 2
    helps = {a.dest: a.help or "" for a in build_parser()._actions}
    assert f"[used by --method {', '.join(readers)}]" in helps["density"]
    assert "used by --method" not in helps["density_floor"]


@pytest.mark.parametrize("kw,msg", [
    ({"method": "nope"}, "unknown --method"), ({"steps": 0}, "--steps must be >= 1"),
    ({"epochs": 0}, "--epochs must be > 0"), ({"target_accuracy": 1.5}, "--target-accuracy"),
])
def test_bad_trainer_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DPConfig(**kw)


@pytest.mark.parametrize("cls,kw,msg", [
    (TopKOptions, {"density": 0.0}, "--density must be in"),
    (TopKOptions, {"density": 1.5}, "--density must be in"),
    (DDPOptions, {"allreduce": "tree"}, "--allreduce 'tree' unknown"),
])
def test_bad_strategy_options(cls, kw, msg):
    with pytest.raises(ValueError, match=msg):
        cls(**kw)
