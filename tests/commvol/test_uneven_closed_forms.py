"""The systems' closed forms when the rank count does not divide the element counts (3, 5, 6 or 7
ranks per node), against a brute-force walk of the rings and trees, and the phases
they list on one-rank communicators (one node, one rank per node)."""

import numpy as np
import pytest
from traffic_reference import simulated_bcast as tree
from traffic_reference import simulated_ring as ring

from commvol.hsgd import radixnet_config
from sparse_sgd.plan import HSGDPlan, partition_bytes
from sparse_sgd.radixnet import radixnet
from substrate.calls import Placement, bytes_by_phase, price
from volume import pactrain as cpt
from volume import sdp as csdp
from volume import ssfusion as cssf
from volume.dataparallel import (
    ddp_step_bytes,
    hierarchical_step_bytes,
    topk_step_bytes,
    world_ring_bytes,
)
from volume.hsadmm import RESIDUALS_PER_LAYER, flat_admm_iteration_bytes, hsadmm_iteration_bytes


def add(*parts):
    return {k: sum(x[k] for x in parts) for k in ("intra", "inter")}


def times(d, k):
    return {key: k * v for key, v in d.items()}


LAYOUTS = [(2, 3), (1, 3), (3, 3), (2, 6), (1, 6), (3, 5), (2, 7), (4, 1)]
IDS = [f"{M}x{P}" for M, P in LAYOUTS]
T = 38282  # the digits CNN: not a multiple of 3, 5, 6 or 7


@pytest.mark.parametrize("M,P", LAYOUTS, ids=IDS)
def test_hsadmm_and_flat_admm_uneven(M, P):
    p = M * P
    nodes = np.arange(p) // P
    buckets, B, L = [1001, 2002, 17], 99, 7
    C = sum(buckets)
    out = hsadmm_iteration_bytes(M=M, P=P, total_params=T, compact_sizes=buckets, mask_bytes=B,
                                 mask_synced=True, num_layers=L)
    assert out == {
        "intra_allreduce": times(ring(T, 4, np.zeros(P)), M),
        "mask_sync": ring(B, 1, np.arange(M)),
        "mask_bcast": times(tree(B, np.zeros(P)), M),
        "inter_allreduce": add(*(ring(n, 4, np.arange(M)) for n in buckets)),
        "bcast_z": times(tree(4 * C, np.zeros(P)), M),
        "residuals": ring(RESIDUALS_PER_LAYER * L, 8, nodes)}
    assert out["intra_allreduce"]["intra"] == M * 2 * (P - 1) * 4 * T
    flat = flat_admm_iteration_bytes(M=M, P=P, total_params=T, num_layers=L)
    assert flat == {"world_allreduce": ring(T, 4, nodes),
                    "residuals": ring(RESIDUALS_PER_LAYER * L, 8, nodes)}


@pytest.mark.parametrize("M,P", LAYOUTS, ids=IDS)
def test_data_parallel_uneven(M, P):
    p = M * P
    nodes = np.arange(p) // P
    buckets = [T, 1, p + 1, 2 * p - 1]
    assert world_ring_bytes(T, 4, M, P) == ring(T, 4, nodes)
    assert ddp_step_bytes(M=M, P=P, bucket_sizes=buckets) == \
        {"grad_allreduce": add(*(ring(n, 4, nodes) for n in buckets))}
    assert hierarchical_step_bytes(M=M, P=P, bucket_sizes=buckets) == {
        "intra_allreduce": add(*(times(ring(n, 4, np.zeros(P)), M) for n in buckets)),
        "inter_allreduce": add(*(ring(n, 4, np.arange(M)) for n in buckets)),
        "intra_bcast": add(*(times(tree(4 * n, np.zeros(P)), M) for n in buckets))}
    # Top-K: every rank's block (8K bytes) travels p - 1 links; M of the p links cross nodes
    K = 383
    per_link = (p - 1) * 8 * K
    x = M if M > 1 else 0
    assert topk_step_bytes(M=M, P=P, k_total=K) == \
        {"topk_allgather": {"intra": (p - x) * per_link, "inter": x * per_link}}


@pytest.mark.parametrize("M,P", LAYOUTS, ids=IDS)
def test_pactrain_sdp_ssfusion_uneven(M, P):
    p = M * P
    nodes = np.arange(p) // P
    K, chunk = 19141, 5000
    packed = cpt.pactrain_step_bytes(M=M, P=P, mode="packed", bucket_sizes=[T], kept=K,
                                     bucket_elems=chunk, grasp_total=T)
    assert packed == {"packed_allreduce": add(*(ring(n, 4, nodes)
                                               for n in cpt.packed_chunks(K, chunk))),
                      "grasp_allreduce": times(ring(T, 4, nodes), 2)}
    tern = cpt.pactrain_step_bytes(M=M, P=P, mode="ternary", bucket_sizes=[T], kept=K,
                                   bucket_elems=chunk, scales=7)
    assert tern["ternary_scale"] == ring(7, 4, nodes)
    # SDP: a holder set's ring follows ascending world rank, over any nodes
    members = [list(range(0, p, 2)), list(range(p)), [0, p - 1]]
    members = [m for m in members if len(m) >= 2]
    counts = [T, 1001, 7][:len(members)]
    assert csdp.gated_allreduce_bytes(members, counts, nodes) == \
        add(*(ring(n, 4, nodes[m]) for m, n in zip(members, counts)))
    groups = [(list(range(p)), p - 1)]
    assert csdp.param_bcast_bytes(groups, [333], nodes) == tree(4 * 333, nodes, p - 1)
    # SSFusion: warm-up rings, the profile ring and the plan broadcast
    sizes = [T, 4001, 13]
    assert cssf.warmup_step_bytes(M=M, P=P, buffer_sizes=sizes) == \
        {cssf.WARMUP: add(*(ring(n, 4, nodes) for n in sizes))}
    assert cssf.selection_bytes(M=M, P=P, num_tensors=5) == {
        cssf.PROFILE: ring(cssf.profile_length(5), 8, nodes),
        cssf.SELECT: tree(8 * cssf.plan_length(5), nodes)}


@pytest.mark.parametrize("M,P", LAYOUTS, ids=IDS)
def test_sparse_sgd_collectives_uneven(M, P):
    """The H-SGD plan's loss all-reduce (1 + 10 batch float64), score all-reduce (10 images
    float64) and category all-reduce (inputs + 1 float64), and its partition broadcast."""
    p = M * P
    nodes = np.arange(p) // P
    placement = Placement.node_major(M, P)
    weights = radixnet(radixnet_config(64, 2, seed=1))
    plan = HSGDPlan.build(weights, M, P, "random", seed=0)
    step = plan.calls(placement, 7, 4)
    loss = [c for c in step if c.phase == "loss"]
    count = 1 + 10 * 7  # the loss vector at --batch 7
    assert bytes_by_phase(loss, placement)["loss"] == ring(count, 8, nodes)
    assert price(loss, placement).messages["loss"] == p * 2 * (p - 1)
    ev = plan.calls(placement, 4, 4, interval="eval", samples=13)
    assert bytes_by_phase(ev, placement)["eval_scores"] == ring(10 * 13, 8, nodes)
    inf = plan.calls(placement, 4, 4, interval="infer", samples=13)
    assert bytes_by_phase(inf, placement)["categories"] == ring(14, 8, nodes)
    setup = plan.calls(placement, 7, 4, interval="setup")
    assert bytes_by_phase(setup, placement)["partition"] == tree(partition_bytes(weights), nodes)
    assert price(setup, placement).messages["partition"] == p - 1


def test_one_rank_communicators_list_their_phases_with_zero_bytes():
    """The ledger lists a call on a one-rank communicator (zero bytes); so do the closed forms:
    one node has no inter-node traffic, one rank per node no intra-node traffic."""
    one_node = hsadmm_iteration_bytes(M=1, P=3, total_params=T, compact_sizes=[10],
                                      mask_bytes=4, mask_synced=True, num_layers=2)
    assert one_node["inter_allreduce"] == one_node["mask_sync"] == {"intra": 0, "inter": 0}
    one_rank = hsadmm_iteration_bytes(M=3, P=1, total_params=T, compact_sizes=[10],
                                      mask_bytes=4, mask_synced=True, num_layers=2)
    for phase in ("intra_allreduce", "mask_bcast", "bcast_z"):
        assert one_rank[phase] == {"intra": 0, "inter": 0}, phase
    frozen = hsadmm_iteration_bytes(M=2, P=3, total_params=T, compact_sizes=[10],
                                    mask_bytes=4, mask_synced=False, num_layers=2)
    assert "mask_sync" not in frozen and "mask_bcast" not in frozen  # no call, no phase
    h = hierarchical_step_bytes(M=1, P=3, bucket_sizes=[T])
    assert set(h) == {"intra_allreduce", "inter_allreduce", "intra_bcast"}
    assert h["inter_allreduce"] == {"intra": 0, "inter": 0}
    assert hierarchical_step_bytes(M=2, P=3, bucket_sizes=[]) == {}
    solo = cpt.pactrain_step_bytes(M=1, P=1, mode="dense", bucket_sizes=[T], kept=0,
                                   bucket_elems=10)
    assert solo == {"dense_allreduce": {"intra": 0, "inter": 0}}
    assert cpt.pactrain_step_bytes(M=2, P=3, mode="packed", bucket_sizes=[T], kept=0,
                                   bucket_elems=10) == {}
