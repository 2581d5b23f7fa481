"""Dense DDP and Top-K plans against second sources written from the definitions.

The plans (:class:`dataparallel.ddp.DDPPlan`, :class:`dataparallel.topk.TopKPlan`) are what both
the run and ``commvol predict`` execute.  Here they are held against facts derived without the
plan code: the parameter count from the spec's shapes, DDP's bucketing rule (contiguous whole
tensors in backward order, at most the cap unless one tensor is larger), a ring all-reduce's
total ``2 (p-1) n`` bytes and its node-crossing share from a simulated ring
(:mod:`tests.traffic_reference`), DGC's ``k_l = max(1, ceil(d n_l))`` and a ring all-gather's
``(p-1)`` blocks on each of the ``p`` links.  A plan that sends one element more or less, or cuts
a bucket inside a tensor, fails here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from traffic_reference import simulated_bcast, simulated_ring

from commvol.predict import predict
from dataparallel.ddp import DDPOptions, DDPPlan
from dataparallel.topk import TopKOptions, TopKPlan
from models import get_spec
from models.specs import spec_from_layers
from models.zoo import build_model
from substrate.calls import Placement, bytes_by_phase

LAYOUTS = [(1, 3), (2, 2), (2, 3), (3, 3), (4, 1)]
#: placements a launcher produces: node-major (block), round-robin (a hostfile cycled), uneven
PLACEMENTS = [Placement.node_major(M, P) for M, P in LAYOUTS] + [
    Placement.round_robin(2, 2), Placement.round_robin(3, 2), Placement.round_robin(2, 3),
    Placement.from_sizes([3, 1]), Placement.from_sizes([1, 2, 3]),
    Placement((0, 1, 1, 0, 2, 1))]


def _plan_bytes(plan, placement: Placement) -> dict:
    """What the run executes and ``commvol`` predicts: the plan's records, priced."""
    return bytes_by_phase(plan.calls(placement), placement)


def _specs():
    yield get_spec("resnet18")
    for name, shape in (("cnn", (1, 8, 8)), ("mlp", (1, 8, 8)), ("resnet", (3, 8, 8))):
        model = build_model(name, input_shape=shape, num_classes=10)
        yield spec_from_layers(name, model.root, shape, 10)


SPECS = list(_specs())


def _sizes(spec):
    """Tensor sizes in the flat (backward) order, from the shapes alone."""
    layout = spec.layout
    return [int(np.prod(layout.shape(n), dtype=np.int64)) for n in layout.names]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("bucket_mib", [0.01, 0.25, 32.0])
def test_ddp_buckets_are_whole_tensors_under_the_cap(spec, bucket_mib):
    sizes = _sizes(spec)
    cap = int(bucket_mib * (1 << 20))
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=bucket_mib), itemsize=4)
    # contiguous, starting at 0, covering exactly the parameter count
    assert plan.buckets[0][0] == 0
    assert all(b0[1] == b1[0] for b0, b1 in zip(plan.buckets, plan.buckets[1:]))
    assert sum(plan.bucket_sizes) == sum(sizes) == spec.num_params
    # every boundary is a tensor boundary; a bucket over the cap holds one tensor
    ends = set(np.cumsum(sizes).tolist())
    assert all(b in ends for _, b in plan.buckets)
    for a, b in plan.buckets:
        if 4 * (b - a) > cap:
            assert a in {0, *ends} and b - a in sizes and len(
                [e for e in ends if a < e <= b]) == 1
    # greedy: no two neighbouring buckets would fit under the cap together
    for (a0, b0), (a1, b1) in zip(plan.buckets, plan.buckets[1:]):
        assert 4 * (b1 - a0) > cap


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.name)
@pytest.mark.parametrize("pl", PLACEMENTS, ids=lambda p: p.describe())
def test_ddp_ring_bytes_against_a_simulated_ring(spec, pl):
    """Any placement: the world ring visits the ranks in rank order, so a round-robin placement
    crosses nodes on every link (twice node-major's inter-node bytes at 2 x 2)."""
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=0.05), itemsize=4)
    got = _plan_bytes(plan, pl)["grad_allreduce"]
    p = pl.size
    # a ring moves 2 (p-1) n elements whatever the cut: the total is the parameter count's
    assert got["intra"] + got["inter"] == 2 * (p - 1) * 4 * spec.num_params
    want = {"intra": 0, "inter": 0}
    for n in plan.bucket_sizes:
        r = simulated_ring(n, 4, pl.node_of)
        want = {k: want[k] + r[k] for k in want}
    assert got == want


@pytest.mark.parametrize("M,P", LAYOUTS)
def test_ddp_hierarchical_bytes_from_the_three_phases(M, P):
    spec = SPECS[1]
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=0.05, allreduce="hierarchical"))
    got = _plan_bytes(plan, Placement.node_major(M, P))
    T = 4 * spec.num_params
    # every node's ring is intra; the leaders' ring (one per node) inter; a tree of P-1 edges
    assert got["intra_allreduce"] == {"intra": M * 2 * (P - 1) * T, "inter": 0}
    assert got["inter_allreduce"] == {"intra": 0, "inter": 2 * (M - 1) * T}
    assert got["intra_bcast"] == {"intra": M * (P - 1) * T, "inter": 0}


@pytest.mark.parametrize("pl", PLACEMENTS[5:], ids=lambda p: p.describe())
def test_ddp_hierarchical_on_any_placement(pl):
    """Round-robin and uneven nodes: each node's ring and tree stay inside the node, the
    leaders' ring crosses on every link, whatever ranks the nodes hold."""
    spec = SPECS[1]
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=0.05, allreduce="hierarchical"))
    got = _plan_bytes(plan, pl)
    T = 4 * spec.num_params
    sizes = np.bincount(np.asarray(pl.node_of))
    M = sizes.size
    want_ar = {"intra": 0, "inter": 0}
    for n in plan.bucket_sizes:
        for g in sizes:
            r = simulated_ring(n, 4, np.zeros(g, dtype=int))
            want_ar["intra"] += r["intra"]
    assert got["intra_allreduce"] == want_ar
    assert got["inter_allreduce"] == {"intra": 0, "inter": 2 * (M - 1) * T}
    want_bc = sum(simulated_bcast(T, np.zeros(g, dtype=int))["intra"] for g in sizes)
    assert got["intra_bcast"] == {"intra": want_bc, "inter": 0}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("density", [1e-4, 0.01, 0.3, 1.0])
def test_topk_k_is_dgc_per_tensor(spec, density):
    plan = TopKPlan.for_layout(spec.layout, TopKOptions(density=density))
    want = [min(n, max(1, math.ceil(density * n))) for n in _sizes(spec)]
    assert list(plan.ks) == want
    assert plan.K == sum(want)


@pytest.mark.parametrize("pl", PLACEMENTS, ids=lambda p: p.describe())
def test_topk_allgather_bytes(pl):
    spec = SPECS[1]
    plan = TopKPlan.for_layout(spec.layout, TopKOptions(density=0.01))
    p = pl.size
    block = 8 * plan.K                          # float32 value + int32 index per entry
    per_link = (p - 1) * block                  # a ring all-gather forwards p-1 blocks per link
    nodes = np.asarray(pl.node_of)
    inter_links = int(np.count_nonzero(nodes != np.roll(nodes, -1))) if p > 1 else 0
    assert _plan_bytes(plan, pl)["topk_allgather"] == {
        "intra": (p - inter_links) * per_link, "inter": inter_links * per_link}


def test_prediction_executes_the_plan():
    """``commvol predict`` prices the plan's records: its per-step bytes are the simulated
    ring's / the all-gather's (independent of the plan code)."""
    spec = SPECS[1]
    M, P = 2, 3
    nodes = np.repeat(np.arange(M), P)
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(0.05))
    pred = predict("ddp", spec=spec, nodes=M, gpus_per_node=P, bucket_mib=0.05)
    want = {"intra": 0, "inter": 0}
    for n in plan.bucket_sizes:
        r = simulated_ring(n, 4, nodes)
        want = {k: want[k] + r[k] for k in want}
    assert pred.steady.phases == {"grad_allreduce": want}
    pred = predict("topk", spec=spec, nodes=M, gpus_per_node=P, density=0.02)
    K = TopKPlan.for_layout(spec.layout, TopKOptions(0.02)).K
    assert pred.steady.phases == {"topk_allgather": {"intra": (6 - 2) * 5 * 8 * K,
                                                     "inter": 2 * 5 * 8 * K}}


def test_prediction_assumptions_are_not_options():
    with pytest.raises(ValueError, match="--ddp-steps-per-iter"):
        predict("ddp", spec=SPECS[1], nodes=2, gpus_per_node=2, steps_per_iter=0)
    with pytest.raises(ValueError, match="no option"):
        predict("ddp", spec=SPECS[1], nodes=2, gpus_per_node=2, density=0.1)
