"""An exchange of direct messages ends on the timeline when its busiest node link does (issue 24).

H-SGD's SpFF/SpBP exchanges are as slow as the busiest node link of the layer: a rank waits for
its receives, whose senders may sit on a busier node.  The one-NIC rule (each inter-node message
at 1/R of its node's link, R = the node's senders) is exact only when every sender of a node
sends alike; on the wire lab the random-partition H-SGD at 8 x 2 and 16 x 1 moved 4-7 % more
bytes on its busiest link, layer by layer, than rank 0's timeline assumed.  Here the busiest
link is counted by hand (a loop over the messages, not the vectorised rule) and the shares of
:func:`substrate.calls.exchange_shares` are checked to end every sender's messages there.
"""

from __future__ import annotations

import numpy as np
import pytest

from partition.partitioners import random_partition
from sparse_sgd.plan import HSGDPlan
from sparse_sgd.program import step_program
from sparse_sgd.radixnet import random_regular_network
from substrate.calls import Call, Placement, event_parts, exchange_shares
from substrate.costmodel import CostModel

COST = CostModel(intra_bw=10e9, inter_bw=1e8, intra_lat=1e-6, inter_lat=1e-5)


def _by_hand(pairs, node_of):
    """(busiest link bytes, inter-node bytes per sender): uplinks and downlinks apart."""
    up, down, own = {}, {}, {}
    for s, d, b in pairs:
        if node_of[s] == node_of[d] or b == 0:
            continue
        up[node_of[s]] = up.get(node_of[s], 0) + b
        down[node_of[d]] = down.get(node_of[d], 0) + b
        own[s] = own.get(s, 0) + b
    return max([*up.values(), *down.values()]), own


def _inter_seconds(call, placement, rank):
    """Bandwidth seconds of ``rank``'s inter-node messages on its timeline."""
    return sum(work * share for link, _, work, share, _, _ in
               event_parts(call, COST, placement, rank) if link == "inter")


def test_a_symmetric_exchange_gives_the_one_nic_share():
    node_of = (0, 0, 0, 1, 1, 1)
    pairs = [(s, d, 100) for s in range(6) for d in range(6) if node_of[s] != node_of[d]]
    call = Call("x", "p2p", tuple(range(6)), pairs=pairs)
    assert exchange_shares(call, Placement(node_of)) == {r: 3.0 for r in range(6)}
    # one rank's messages alone fall back to the same rule
    mine = call.sends_of(0)
    assert {share for _, _, _, share, _, _ in event_parts(mine, COST, Placement(node_of), 0)} \
        == {3}


def test_an_uneven_exchange_ends_with_its_busiest_link():
    node_of = (0, 0, 1, 1, 2)                      # uneven nodes
    pairs = [(0, 2, 100), (1, 3, 300), (1, 4, 50), (2, 0, 40), (3, 4, 10), (4, 1, 5),
             (0, 1, 999), (2, 3, 0)]               # an intra-node and an empty message
    placement = Placement(node_of)
    call = Call("x", "p2p", tuple(range(5)), pairs=pairs)
    busiest, own = _by_hand(pairs, node_of)
    assert busiest == 450                          # node 0's uplink: 100 + 300 + 50
    shares = exchange_shares(call, placement)
    assert shares == pytest.approx({r: max(1.0, busiest / b) for r, b in own.items()})
    for r in own:                                  # the whole exchange on r's timeline ...
        assert _inter_seconds(call, placement, r) == pytest.approx(busiest / COST.inter_bw)
        # ... and r's own messages, each a record carrying the exchange's share (a run)
        msgs = [Call("x", "p2p", call.group, pairs=[row], share=shares[r])
                for row in pairs if row[0] == r]
        assert sum(_inter_seconds(m, placement, r) for m in msgs) == \
            pytest.approx(busiest / COST.inter_bw)


def test_share_is_timing_not_identity():
    a = Call("x", "p2p", (0, 1), pairs=[(0, 1, 8)])
    b = Call("x", "p2p", (0, 1), pairs=[(0, 1, 8)], share=2.5)
    assert a == b and a.key() == b.key()           # the same messages, the same digest
    assert Call.from_dict(b.to_dict()).share == 2.5 and "share" not in a.to_dict()
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="share is for p2p records and must be a finite"):
            Call("x", "p2p", (0, 1), pairs=[(0, 1, 8)], share=bad)
    with pytest.raises(ValueError, match="share is for p2p records"):
        Call("x", "allreduce", (0, 1), 8, 4, share=2.0)
    with pytest.raises(ValueError, match="exchange_shares\\(\\) is for p2p records"):
        exchange_shares(Call("x", "allreduce", (0, 1), 8, 4), Placement((0, 1)))


@pytest.mark.parametrize("node_of", [(0, 0, 1, 1, 2, 2, 3, 3), (0, 1, 2, 0, 1, 2, 0, 1)])
def test_hsgd_program_shares_end_every_layer_on_its_busiest_link(node_of):
    """The shares a run's messages carry (the sends of every rank's step program, generated
    from the plan: sparse_sgd.program) put every sender's inter-node messages of a layer at the
    layer's busiest link, counted by hand from the plan's pairs, for block and round-robin
    placements of a random partition (uneven loads)."""
    weights = random_regular_network(256, 3, 8, seed=3)
    plan = HSGDPlan.from_partition(weights, random_partition(weights, 8, seed=1))
    placement = Placement(node_of)
    records = plan.tagged_calls(placement, 4, 4)
    layers = [("spff", k) for k in range(1, 4)] + [("spbp", k) for k in range(3, 1, -1)]
    exchanges = [(c, t) for c, t in records if c.algorithm == "p2p"]
    assert [c.phase for c, _ in exchanges] == [ph for ph, _ in layers]
    sends = {}                                     # (rank, tag) -> the shares of its sends
    for r in range(8):
        for e in step_program(records, plan.num_layers, placement, r):
            if e[0] == "C" and e[1].algorithm == "p2p":
                sends.setdefault((r, e[5]), set()).add(e[1].share)
    uneven = False
    for call, tag in exchanges:
        pairs = call.pairs.tolist()
        busiest, own = _by_hand(pairs, node_of)
        for r, b in own.items():
            share, = sends[r, tag]                 # every message of the layer alike
            assert share == pytest.approx(max(1.0, busiest / b))
            uneven |= not np.isclose(share, sum(n == node_of[r] for n in node_of))
    assert uneven                                  # the one-NIC rule would have been wrong
