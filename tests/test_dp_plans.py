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

from commvol.predict import predict
from dataparallel.ddp import DDPOptions, DDPPlan
from dataparallel.topk import TopKOptions, TopKPlan
from models import get_spec
from models.specs import spec_from_layers
from models.zoo import build_model

from traffic_reference import simulated_ring

LAYOUTS = [(1, 3), (2, 2), (2, 3), (3, 3), (4, 1)]


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


def _node_major(M, P):
    return np.repeat(np.arange(M), P)


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
@pytest.mark.parametrize("M,P", LAYOUTS)
def test_ddp_ring_bytes_against_a_simulated_ring(spec, M, P):
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=0.05), itemsize=4)
    got = plan.step_bytes(M, P)["grad_allreduce"]
    p = M * P
    # a ring moves 2 (p-1) n elements whatever the cut: the total is the parameter count's
    assert got["intra"] + got["inter"] == 2 * (p - 1) * 4 * spec.num_params
    want = {"intra": 0, "inter": 0}
    for n in plan.bucket_sizes:
        r = simulated_ring(n, 4, _node_major(M, P))
        want = {k: want[k] + r[k] for k in want}
    assert got == want


@pytest.mark.parametrize("M,P", LAYOUTS)
def test_ddp_hierarchical_bytes_from_the_three_phases(M, P):
    spec = SPECS[1]
    plan = DDPPlan.for_layout(spec.layout, DDPOptions(bucket_mib=0.05, allreduce="hierarchical"))
    got = plan.step_bytes(M, P)
    T = 4 * spec.num_params
    # every node's ring is intra; the leaders' ring (one per node) inter; a tree of P-1 edges
    assert got["intra_allreduce"] == {"intra": M * 2 * (P - 1) * T, "inter": 0}
    assert got["inter_allreduce"] == {"intra": 0, "inter": 2 * (M - 1) * T}
    assert got["intra_bcast"] == {"intra": M * (P - 1) * T, "inter": 0}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("density", [1e-4, 0.01, 0.3, 1.0])
def test_topk_k_is_dgc_per_tensor(spec, density):
    plan = TopKPlan.for_layout(spec.layout, TopKOptions(density=density))
    want = [min(n, max(1, math.ceil(density * n))) for n in _sizes(spec)]
    assert list(plan.ks) == want
    assert plan.K == sum(want)


@pytest.mark.parametrize("M,P", LAYOUTS)
def test_topk_allgather_bytes(M, P):
    spec = SPECS[1]
    plan = TopKPlan.for_layout(spec.layout, TopKOptions(density=0.01))
    p = M * P
    block = 8 * plan.K                          # float32 value + int32 index per entry
    per_link = (p - 1) * block                  # a ring all-gather forwards p-1 blocks per link
    inter_links = M if M > 1 else 0
    assert plan.step_bytes(M, P)["topk_allgather"] == {
        "intra": (p - inter_links) * per_link, "inter": inter_links * per_link}


def test_prediction_executes_the_plan():
    """``commvol predict`` reads the same plan: its per-step bytes are the plan's."""
    spec = SPECS[1]
    for system, opts, plan in (
            ("ddp", {"bucket_mib": 0.05}, DDPPlan.for_layout(spec.layout, DDPOptions(0.05))),
            ("topk", {"density": 0.02}, TopKPlan.for_layout(spec.layout, TopKOptions(0.02)))):
        pred = predict(system, spec=spec, nodes=2, gpus_per_node=3, **opts)
        assert pred.steady.phases == plan.step_bytes(2, 3)


def test_prediction_assumptions_are_not_options():
    with pytest.raises(ValueError, match="--ddp-steps-per-iter"):
        predict("ddp", spec=SPECS[1], nodes=2, gpus_per_node=2, steps_per_iter=0)
    with pytest.raises(ValueError, match="no option"):
        predict("ddp", spec=SPECS[1], nodes=2, gpus_per_node=2, density=0.1)
