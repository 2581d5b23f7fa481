"""SDP's plan (:class:`dataparallel.sdp.SDPPlan`) against the paper's closed forms
(:func:`volume.sdp.neuron_sdp_bytes`, :func:`volume.sdp.block_sdp_bytes`).

The closed-form side is computed here from the layer shapes by the paper's definitions only:
N-SDP at coverage ``p/n`` puts every masked parameter on exactly ``p`` of the ``n`` workers (§4),
the masked layers being hidden layers no two of which are adjacent (§3.2 masks a layer's
outputs with the next layer's inputs), chosen to mask the most parameters (enumerated here by
brute force); B-SDP deals ``b`` of ``d`` blocks to every worker.  A wrong plan (an extra holder,
a coordinate in the wrong group) changes the degrees or the bytes and fails here.
"""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from commvol.predict import predict
from dataparallel.sdp import SDPOptions, SDPPlan
from models import build_model, cnn, resnet
from substrate import costmodel as cm
from volume.sdp import block_sdp_bytes, neuron_sdp_bytes

SHAPE = (1, 8, 8)


def _models():
    """name -> model: the digits CNN, the small ResNet and odd widths (uneven chunks)."""
    return {"cnn": build_model("cnn", SHAPE, 10),
            "resnet": build_model("resnet", SHAPE, 10),
            "cnn-odd": cnn(SHAPE, 10, channels=(5, 7), hidden=11),
            "cnn-wide-conv2": cnn(SHAPE, 10, channels=(2, 60), hidden=3),  # masks conv2 only
            "resnet-odd": resnet(SHAPE, 10, depths=(2, 1), planes=(5, 7))}


MODELS = _models()


def _size(L, name):
    return int(np.prod(L.shape(name)))


def neuron_layers(model):
    """``[(width, params per neuron, buffers per neuron)]`` of the layers N-SDP masks, and the
    parameters left on every worker, from the layer shapes alone."""
    L = model.layout
    names = set(L.names)
    blocks = sorted({".".join(n.split(".")[:2]) for n in names if n.startswith("layer")})
    if blocks:  # ResNet: each block's inner channels (conv1's outputs, bn1, conv2's inputs)
        layers = []
        for b in blocks:
            w = L.shape(f"{b}.conv1.weight")[0]
            per = (_size(L, f"{b}.conv1.weight") + _size(L, f"{b}.bn1.weight")
                   + _size(L, f"{b}.bn1.bias") + _size(L, f"{b}.conv2.weight")) // w
            layers.append((w, per, 2))
    else:  # plain chain conv1 -> conv2 -> fc1 -> fc2: hidden layers conv1, conv2, fc1
        chain = ["conv1", "conv2", "fc1", "fc2"]
        hidden = []
        for a, nxt in zip(chain[:-1], chain[1:]):
            w = L.shape(f"{a}.weight")[0]
            per = (_size(L, f"{a}.weight") + _size(L, f"{a}.bias")
                   + _size(L, f"{nxt}.weight")) // w
            hidden.append((w, per, 0))
        # non-adjacent subsets, the one holding the most parameters (ties: earlier layers)
        best = max((s for r in range(len(hidden) + 1)
                    for s in itertools.combinations(range(len(hidden)), r)
                    if all(b - a > 1 for a, b in zip(s, s[1:]))),
                   key=lambda s: (sum(hidden[i][0] * hidden[i][1] for i in s),
                                  [-i for i in s]))
        layers = [hidden[i] for i in best]
    masked = sum(w * per for w, per, _ in layers)
    return layers, L.total - masked


def block_sizes(model):
    L = model.layout
    blocks = sorted({".".join(n.split(".")[:2]) for n in L.names if n.startswith("layer")})
    sizes = [sum(L.sizes[n] for n in L.names if n.startswith(b + ".") and ".shortcut." not in n)
             for b in blocks]
    return sizes, L.total - sum(sizes)


def _wire(b):
    return b["intra"] + b["inter"]


# -- N-SDP ---------------------------------------------------------------------------------------
NEURON_CASES = [(name, M, P, p) for name in MODELS for M, P in ((2, 2), (2, 3), (3, 3))
                for p in range(1, M * P + 1)]


@pytest.mark.parametrize("name,M,P,p", NEURON_CASES)
def test_neuron_plan_equals_paper_closed_form(name, M, P, p):
    model = MODELS[name]
    n = M * P
    plan = SDPPlan.for_model(model, M, P, SDPOptions(coverage=f"{p}/{n}"), seed=0)
    layers, rest = neuron_layers(model)
    masked = model.layout.total - rest
    # every masked parameter on exactly p workers, everything else on all n (paper §4)
    want_hist = {p: masked, n: rest} if p < n else {n: model.layout.total}
    assert plan.degree_histogram() == want_hist
    assert plan.coverage_realized == Fraction(p * masked + n * rest, n * model.layout.total)
    node_of = np.arange(n) // P
    closed = neuron_sdp_bytes(layers, rest, p, node_of)
    assert plan.gated_bytes() == closed["gated"]
    assert plan.assembly_bytes() == closed["assemble"]
    # §3.2: each parameter is all-reduced among its holders, 2 (d - 1) floats per parameter
    assert _wire(plan.gated_bytes()) == 8 * ((p - 1) * masked + (n - 1) * rest)
    assert plan.bcast_bytes() is None


def test_digits_cnn_masks_conv1_and_fc1():
    """Hand count (38,282 parameters): conv1 (16 x 9 + 16) with conv2's input columns
    (32 x 16 x 9) and fc1 (64 x 512 + 64) with fc2's columns (10 x 64) are masked; conv2's
    bias (32) and fc2's bias (10) stay on every worker."""
    layers, rest = neuron_layers(MODELS["cnn"])
    assert layers == [(16, 10 + 288, 0), (64, 513 + 10, 0)] and rest == 42
    plan = SDPPlan.for_model(MODELS["cnn"], 2, 2, SDPOptions(coverage="2/4"))
    assert plan.detail["masked"] == ["conv1", "fc1"]
    # the case: at 2/4 the gated traffic is (p-1)/(n-1) = 1/3 of DDP's, not 0.008
    ddp = 8 * 3 * 38282
    assert _wire(plan.gated_bytes()) / ddp == pytest.approx((38240 / 3 + 42) / 38282)


# -- B-SDP / B_b-SDP -----------------------------------------------------------------------------
BLOCK_CASES = [(name, mode, M, P, b, seed)
               for name in ("resnet", "resnet-odd") for mode in ("block", "block-backward")
               for M, P in ((2, 2), (2, 3)) for b in (1, 2, 3) for seed in (0, 7)]


@pytest.mark.parametrize("name,mode,M,P,b,seed", BLOCK_CASES)
def test_block_plan_equals_paper_closed_form(name, mode, M, P, b, seed):
    model = MODELS[name]
    n = M * P
    sizes, rest = block_sizes(model)
    d = len(sizes)
    if n * b < d:
        pytest.skip("blocks without holders")
    plan = SDPPlan.for_model(model, M, P, SDPOptions(sdp_mode=mode, active_blocks=f"{b}/{d}"),
                             seed=seed)
    order = plan.detail["order"]
    assert sorted(order) == list(range(d))
    closed = block_sdp_bytes(sizes, rest, b, order, np.arange(n) // P,
                             backward=mode == "block-backward")
    assert plan.gated_bytes() == closed["gated"]
    assert plan.bcast_bytes() == closed["bcast"]
    # every worker runs exactly b blocks (paper §4: A = b/d)
    L = model.layout
    firsts = [next(nm for nm in L.names if nm.startswith(blk + ".") and ".shortcut." not in nm)
              for blk in plan.detail["blocks"]]
    masks = np.array([plan.mask(r) for r in range(n)])
    assert [int(sum(masks[r, L.slice(nm).start] for nm in firsts)) for r in range(n)] == [b] * n
    assert sum(plan.detail["block_degrees"]) == n * b


# -- the prediction uses the same plan -----------------------------------------------------------
@pytest.mark.parametrize("model,kw,M,P", [("cnn", {"coverage": "2/6"}, 2, 3),
                                          ("resnet", {"sdp_mode": "block-backward",
                                                      "active_blocks": "2/3"}, 3, 3)])
def test_prediction_is_the_closed_form(model, kw, M, P):
    pred = predict("sdp", model, nodes=M, gpus_per_node=P, **kw)
    m = build_model(model, SHAPE, 10)
    n = M * P
    if model == "cnn":
        layers, rest = neuron_layers(m)
        closed = neuron_sdp_bytes(layers, rest, 2, np.arange(n) // P)
        assert pred.steady.phases == {"sdp_gated_allreduce": closed["gated"]}
        assert pred.evaluation.phases == {"sdp_assemble": closed["assemble"]}
    else:
        sizes, rest = block_sizes(m)
        order = SDPPlan.for_model(m, M, P, SDPOptions(**kw)).detail["order"]
        closed = block_sdp_bytes(sizes, rest, 2, order, np.arange(n) // P, backward=True)
        assert pred.steady.phases == {"sdp_gated_allreduce": closed["gated"],
                                      "sdp_param_bcast": closed["bcast"]}


def test_closed_forms_hand_computed():
    """N-SDP 2/4 on 2 x 2, one masked layer of 4 neurons with 3 parameters each, 5 others:
    windows {0,1} {1,2} {2,3} {3,0} carry 3 parameters each; rings of 2 send 2 x 3 floats each
    way: {0,1} and {2,3} intra, {1,2} and {0,3} inter; the world ring of 5 floats sends
    2 x 3 x 5 floats, half across the 2 node-crossing links.  Rank 0 lacks windows 1 and 2."""
    node_of = np.array([0, 0, 1, 1])
    out = neuron_sdp_bytes([(4, 3, 0)], 5, 2, node_of)
    world = cm.ring_allreduce_split(5, 4, node_of)
    assert out["gated"] == {"intra": 2 * 2 * 3 * 4 + world["intra"],
                            "inter": 2 * 2 * 3 * 4 + world["inter"]}
    assert out["assemble"] == {"intra": 3 * 4, "inter": 3 * 4}
    # blocks of 10 and 20 on 2 workers with b = 1, order (1, 0): worker 0 keeps block 1
    blk = block_sdp_bytes([10, 20], 0, 1, [1, 0], np.array([0, 1]), backward=True)
    assert blk == {"gated": {"intra": 0, "inter": 0},
                   "bcast": {"intra": 0, "inter": 4 * (10 + 20)}}
    assert math.isclose(_wire(neuron_sdp_bytes([(4, 3, 0)], 0, 4, node_of)["gated"]),
                        8 * 3 * 12)
