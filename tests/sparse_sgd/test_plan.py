"""The H-SGD plan's records (:meth:`sparse_sgd.plan.HSGDPlan.calls`) against a second source
written from the paper: per layer k, processor n sends to processor m (SpFF, Alg. 2 / eq. 9)
every x^{k-1}(j) it owns that a row of W^k on m uses, one message per non-empty pair, posted in
ascending order of the receiver; SpBP (Alg. 3) sends the same counts back for k = L..2; every
word is batch x itemsize bytes, on the intra- or inter-node link of the pair.  The count loops
over the dense pattern and owner arrays (no metrics or plan code); the driver's collectives are
walked by :mod:`traffic_reference`.  Odd shapes: 3 ranks per node, 7 and 6 processors on 64 rows
(uneven parts), a round-robin placement, relabelled and plain networks, a short last batch.
Also: the partition the plan is built from is the same for the same seed (run and prediction
call one function), and ``commvol predict`` prices the records as the brute force does."""

import numpy as np
import pytest
from traffic_reference import simulated_bcast, simulated_ring

from commvol.hsgd import radixnet_config
from commvol.predict import predict
from sparse_sgd.plan import HSGDOptions, HSGDPlan, partition_bytes, plan_partition
from sparse_sgd.radixnet import radixnet
from substrate.calls import Placement, bytes_by_phase, price
from substrate.costmodel import CostModel


def _messages(weights, owners, k):
    """SpFF messages of layer k, ``[(src n, dst m, words)]`` by sender, then receiver."""
    A = weights[k - 1].toarray() != 0
    rows, cols = owners[k], owners[k - 1]
    P = int(max(o.max() for o in owners)) + 1
    out = []
    for n in range(P):
        for m in range(P):
            if m == n:
                continue
            # x^{k-1}(j) owned by n and used by some row i of W^k owned by m
            words = sum(1 for j in range(A.shape[1]) if cols[j] == n
                        and any(A[i, j] for i in range(A.shape[0]) if rows[i] == m))
            if words:
                out.append((n, m, words))
    return out


def _brute_force(weights, owners, batch, itemsize, ff_phase="spff", spbp=True):
    """``[(phase, [(src, dst, bytes), ...])]``: the exchanges of one forward (and backward)
    pass in the order a rank posts them, each message list by sender, then receiver."""
    L = len(weights)
    ff = [_messages(weights, owners, k) for k in range(1, L + 1)]
    word = batch * itemsize
    out = [(ff_phase, [(n, m, w * word) for n, m, w in msgs]) for msgs in ff]
    if spbp:
        # SpBP of layer k: m sends back to n the partial sums of the rows it received
        out += [("spbp", sorted((m, n, w * word) for n, m, w in ff[k - 1]))
                for k in range(L, 1, -1)]
    return [(ph, msgs) for ph, msgs in out if msgs]


def _links(exchanges, node_of):
    """``{phase: [intra bytes, inter bytes, messages]}`` of the brute-force exchanges."""
    out = {}
    for ph, msgs in exchanges:
        e = out.setdefault(ph, [0, 0, 0])
        for src, dst, nb in msgs:
            e[int(node_of[src] != node_of[dst])] += nb
            e[2] += 1
    return out


def _p2p(calls):
    return [(c.phase, [tuple(r) for r in c.pairs.tolist()]) for c in calls
            if c.algorithm == "p2p"]


PLACEMENTS = {"2x3-relabelled": (Placement.node_major(2, 3), True),
              "7x1-plain": (Placement.node_major(7, 1), False),
              "1x6-relabelled": (Placement.node_major(1, 6), True),
              "2x3-round-robin": (Placement.round_robin(2, 3), True)}


@pytest.mark.parametrize("method", ["hypergraph", "random"])
@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_step_records_equal_a_brute_force_count(method, where):
    """One step: the SpFF and SpBP records message by message (the order the ranks post
    them), bytes per link class and messages, and the loss all-reduce (a ring of 1 + 10 batch
    float64, uneven chunks over 6 or 7 ranks)."""
    placement, permute = PLACEMENTS[where]
    network = radixnet_config(64, 5, permute=permute, seed=3)
    weights = radixnet(network)
    opts = HSGDOptions(batch_size=5, dtype="float32")
    plan = HSGDPlan.build(weights, placement.num_nodes, placement.ranks_per_node, method, opts,
                          seed=2, network=network)
    want = _brute_force(weights, plan.partition.owners, 5, 4)
    calls = plan.calls(placement, 5, 4)
    assert _p2p(calls) == want
    node_of = placement.node_of
    got = bytes_by_phase(calls, placement)
    msgs = price(calls, placement).messages
    for ph, (intra, inter, n) in _links(want, node_of).items():
        assert (got[ph]["intra"], got[ph]["inter"], msgs[ph]) == (intra, inter, n), ph
    loss = calls[-1]
    assert (loss.phase, loss.algorithm, loss.op, loss.group) == ("loss", "allreduce", "sum",
                                                                placement.world)
    assert got["loss"] == simulated_ring(1 + 10 * 5, 8, node_of)
    # each exchange waits for the one before it (the compute it fed)
    assert [c.after for c in calls] == [()] + [(i,) for i in range(len(calls) - 1)]


@pytest.mark.parametrize("method", ["hypergraph", "random"])
def test_setup_eval_and_infer_records(method):
    """The set-up broadcast of the owners, the evaluation's SpFF of every batch (the last one
    short) and its score all-reduce, inference's barrier, SpFF and max all-reduce."""
    placement = Placement.node_major(2, 3)
    network = radixnet_config(64, 4, seed=5)
    weights = radixnet(network)
    plan = HSGDPlan.build(weights, 2, 3, method, seed=1, network=network)
    owners, nodes = plan.partition.owners, placement.node_of
    (setup,) = plan.calls(placement, 5, 4, interval="setup")
    assert (setup.phase, setup.algorithm, setup.root) == ("partition", "bcast", 0)
    assert setup.nbytes == plan.partition_bytes == partition_bytes(weights)
    assert bytes_by_phase([setup], placement)["partition"] == \
        simulated_bcast(partition_bytes(weights), nodes)
    # evaluation of 12 images in batches of 5: 5, 5, 2
    ev = plan.calls(placement, 5, 8, interval="eval", samples=12)
    want = [x for b in (5, 5, 2) for x in _brute_force(weights, owners, b, 8, "eval", False)]
    assert _p2p(ev) == want
    assert (ev[-1].phase, ev[-1].op) == ("eval_scores", "sum")
    assert bytes_by_phase(ev, placement)["eval_scores"] == simulated_ring(10 * 12, 8, nodes)
    assert plan.calls(placement, 5, 8, interval="eval", samples=0) == []
    # inference of 7 inputs in batches of 3: 3, 3, 1
    inf = plan.calls(placement, 3, 4, interval="infer", samples=7)
    assert (inf[0].phase, inf[0].algorithm) == ("sync", "barrier")
    assert _p2p(inf) == [x for b in (3, 3, 1) for x in _brute_force(weights, owners, b, 4,
                                                                     "spff", False)]
    assert (inf[-1].phase, inf[-1].op) == ("categories", "max")
    assert bytes_by_phase(inf, placement)["categories"] == simulated_ring(8, 8, nodes)


def test_one_rank_sends_nothing():
    """One processor: no exchange record at all (the run sends no message), the loss
    all-reduce on one rank moves nothing."""
    network = radixnet_config(64, 3, seed=1)
    weights = radixnet(network)
    plan = HSGDPlan.build(weights, 1, 1, "random", seed=0)
    calls = plan.calls(Placement.node_major(1, 1), 4, 8)
    assert [c.phase for c in calls] == ["loss"]
    assert bytes_by_phase(calls, Placement.node_major(1, 1)) == {"loss": {"intra": 0,
                                                                          "inter": 0}}


def test_calls_refuse_bad_input():
    network = radixnet_config(64, 3, seed=1)
    plan = HSGDPlan.build(radixnet(network), 2, 2, "random", seed=0)
    with pytest.raises(ValueError, match="placement has 6 ranks, the partition 4 parts"):
        plan.calls(Placement.node_major(2, 3), 4, 8)
    with pytest.raises(ValueError, match="unknown interval 'train'"):
        plan.calls(Placement.node_major(2, 2), 4, 8, interval="train")
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        plan.calls(Placement.node_major(2, 2), 0, 8)
    with pytest.raises(ValueError, match="samples must be an integer >= 0"):
        plan.calls(Placement.node_major(2, 2), 4, 8, interval="eval", samples=-1)
    with pytest.raises(TypeError, match="Placement"):
        plan.calls([0, 0, 1, 1], 4, 8)


def test_prediction_prices_the_brute_force_exchange():
    """``commvol predict --system hsgd|sgd``: bytes per link class, messages and the α-β time
    of the busiest sender per phase (every message costs its sender α + n β on its link)
    equal the brute-force count of the partition the run builds for the same seed."""
    cost = CostModel()
    for system, method in (("hsgd", "hypergraph"), ("sgd", "random")):
        pred = predict(system, nodes=2, gpus_per_node=3, neurons=64, layers=5, seed=4,
                       batch_size=7, dtype="float32", cost=cost)
        it = pred.steady
        network = radixnet_config(64, 5, seed=4)
        weights = radixnet(network)
        owners = plan_partition(weights, 6, method, HSGDOptions(batch_size=7), seed=4,
                                network=network).owners
        want = _brute_force(weights, owners, 7, 4)
        node_of = np.arange(6) // 3
        for ph, (intra, inter, n) in _links(want, node_of).items():
            assert (it.phases[ph]["intra"], it.phases[ph]["inter"], it.messages[ph]) == \
                (intra, inter, n), (system, ph)
            per_sender = np.zeros(6)
            for phase, msgs in want:
                if phase == ph:
                    for src, dst, nb in msgs:
                        link = "intra" if node_of[src] == node_of[dst] else "inter"
                        per_sender[src] += cost.alpha(link) + nb * cost.beta(link)
            assert it.modeled_s[ph] == pytest.approx(per_sender.max(), rel=1e-12), ph
        assert it.phases["loss"] == simulated_ring(1 + 10 * 7, 8, node_of)
        assert pred.setup.phases["partition"] == simulated_bcast(partition_bytes(weights),
                                                                 node_of)
        assert it.payload_bytes == sum(nb for _, msgs in want for _, _, nb in msgs) // 6


def test_same_seed_same_plan():
    network = radixnet_config(1024, 8, seed=4)
    weights = radixnet(network)
    a = plan_partition(weights, 6, "hypergraph", seed=4, network=network)
    b = plan_partition(weights, 6, "hypergraph", seed=4, network=network)
    for x, y in zip(a.owners, b.owners):
        np.testing.assert_array_equal(x, y)


def test_relabelled_plan_moves_what_the_plain_plan_moves():
    """Partitioning the relabelled network through its plain twin gives the plain network's
    volumes (the relabelling is an isomorphism)."""
    plain_cfg = radixnet_config(1024, 14, permute=False, seed=1)
    cfg = radixnet_config(1024, 14, seed=1)
    plain = HSGDPlan.build(radixnet(plain_cfg), 4, 2, "hypergraph", seed=1)
    relab = HSGDPlan.build(radixnet(cfg), 4, 2, "hypergraph", seed=1, network=cfg)
    np.testing.assert_array_equal(plain.metrics.pair_words, relab.metrics.pair_words)
