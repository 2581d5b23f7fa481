"""The H-SGD plan (:class:`sparse_sgd.plan.HSGDPlan`) against a second source written from the
paper: per layer k, processor n sends to processor m (SpFF, Alg. 2 / eq. 9) every x^{k-1}(j) it
owns that a row of W^k on m uses, one message per non-empty pair, and SpBP (Alg. 3) sends the same
counts back for k >= 2; every word is batch x itemsize bytes, on the intra- or inter-node link of
the pair.  The count loops over the dense pattern and owner arrays (no metrics code).  Odd shapes:
3 ranks per node, 7 and 6 processors on 64 rows (uneven parts), relabelled and plain networks.
Also: the partition the plan is built from is the same for the same seed (run and prediction
call one function) and the predicted hsgd prediction is the plan's."""

import numpy as np
import pytest

from commvol.hsgd import radixnet_config
from commvol.predict import predict
from sparse_sgd.plan import HSGDOptions, HSGDPlan, plan_partition
from sparse_sgd.radixnet import radixnet


def _brute_force(weights, owners, node_of, batch, itemsize):
    """``{phase: (intra bytes, inter bytes, messages)}`` of one step, counted pair by pair."""
    P = int(max(o.max() for o in owners)) + 1
    out = {"spff": [0, 0, 0], "spbp": [0, 0, 0]}
    for k, W in enumerate(weights, start=1):
        A = W.toarray() != 0
        rows, cols = owners[k], owners[k - 1]
        for m in range(P):
            for n in range(P):
                if m == n:
                    continue
                # x^{k-1}(j) owned by n and used by some row i of W^k owned by m
                words = sum(1 for j in range(A.shape[1]) if cols[j] == n
                            and any(A[i, j] for i in range(A.shape[0]) if rows[i] == m))
                if not words:
                    continue
                link = int(node_of[m] != node_of[n])
                for ph in (("spff", "spbp") if k > 1 else ("spff",)):
                    out[ph][link] += words * batch * itemsize
                    out[ph][2] += 1
    return out


@pytest.mark.parametrize("method", ["hypergraph", "random"])
@pytest.mark.parametrize("nodes,rpn,permute", [(2, 3, True), (7, 1, False), (1, 6, True)],
                         ids=["2x3-relabelled", "7x1-plain", "1x6-relabelled"])
def test_plan_bytes_equal_a_brute_force_count(method, nodes, rpn, permute):
    network = radixnet_config(64, 5, permute=permute, seed=3)
    weights = radixnet(network)
    opts = HSGDOptions(batch_size=5, dtype="float32")
    plan = HSGDPlan.build(weights, nodes, rpn, method, opts, seed=2, network=network)
    want = _brute_force(weights, plan.partition.owners, plan.node_of, 5, 4)
    got = plan.step_phases(5, 4)
    for ph in ("spff", "spbp"):
        assert (got[ph]["intra_bytes"], got[ph]["inter_bytes"], got[ph]["messages"]) == \
            tuple(want[ph]), ph
    # three steps are three times one
    assert plan.step_phases(5, 4, steps=3)["spff"]["bytes"] == 3 * got["spff"]["bytes"]


def test_same_seed_same_plan_and_the_prediction_is_the_plan():
    network = radixnet_config(1024, 8, seed=4)
    weights = radixnet(network)
    a = plan_partition(weights, 6, "hypergraph", seed=4, network=network)
    b = plan_partition(weights, 6, "hypergraph", seed=4, network=network)
    for x, y in zip(a.owners, b.owners):
        np.testing.assert_array_equal(x, y)
    plan = HSGDPlan.build(weights, 2, 3, "hypergraph", HSGDOptions(batch_size=7), seed=4,
                          network=network)
    it = predict("hsgd", nodes=2, gpus_per_node=3, neurons=1024, layers=8, seed=4,
                 batch_size=7).steady
    ph = plan.step_phases(7, 8)
    for p in ("spff", "spbp"):
        assert (it.phases[p]["intra"], it.phases[p]["inter"]) == \
            (ph[p]["intra_bytes"], ph[p]["inter_bytes"])
        assert it.messages[p] == ph[p]["messages"]


def test_relabelled_plan_moves_what_the_plain_plan_moves():
    """Partitioning the relabelled network through its plain twin gives the plain network's
    volumes (the relabelling is an isomorphism)."""
    plain_cfg = radixnet_config(1024, 14, permute=False, seed=1)
    cfg = radixnet_config(1024, 14, seed=1)
    plain = HSGDPlan.build(radixnet(plain_cfg), 4, 2, "hypergraph", seed=1)
    relab = HSGDPlan.build(radixnet(cfg), 4, 2, "hypergraph", seed=1, network=cfg)
    np.testing.assert_array_equal(plain.metrics.pair_words, relab.metrics.pair_words)
