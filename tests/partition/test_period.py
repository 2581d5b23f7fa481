"""Periods found from the data: a relabelled RadiX-Net, as read from the Graph
Challenge files, is recognised as periodic and partitioned one period at a time.

The maps are checked against the definition with SciPy (every layer W^{k+p}, relabelled by the
maps, must have exactly the sparsity of W^k), not against the finder's own bookkeeping.
"""

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp

from partition.metrics import pair_volumes
from partition.partitioners import HypergraphConfig, hypergraph_partition
from partition.period import LayerPeriod, find_period, layer_period, relabelled_period
from sparse_sgd.io import read_challenge_network, write_challenge_network
from sparse_sgd.plan import PartitionOptions, plan_partition
from sparse_sgd.radixnet import (
    RadixNetConfig,
    challenge_config,
    graph_challenge_network,
    mixed_radix_layer,
    radixnet,
    random_regular_network,
)


def _assert_isomorphism(weights, found: LayerPeriod) -> None:
    """W^{k+p}[a, b] != 0 <=> W^k[maps[k][a], maps[k-1][b]] != 0 for k = 1 .. L - p."""
    p, L = found.period, len(weights)
    assert len(found.maps) == L - p + 1
    for j, m in enumerate(found.maps):  # bijections of the right layers
        size = weights[j + p - 1].shape[0] if j + p else weights[0].shape[1]
        assert np.array_equal(np.sort(m), np.arange(size)), j
    for k in range(1, L - p + 1):
        A = sp.csr_matrix(weights[k - 1])
        B = sp.coo_matrix(weights[k + p - 1])
        mapped = sp.csr_matrix((np.ones(B.nnz), (found.maps[k][B.row], found.maps[k - 1][B.col])),
                               shape=A.shape)
        assert mapped.nnz == A.nnz and ((mapped != 0) != (A != 0)).nnz == 0, k


def test_relabelled_graph_challenge_network_has_its_period_found():
    """The relabelled N=1024 RadiX-Net (radices 2^6, blocks of 16): no exact period, relabelled
    period 6, and the maps are a true isomorphism of layers 0..L-6 onto 6..L.  Its last radix
    (place value 32) has neurons with the same inputs but other outputs, so matching rows by
    their inputs alone would fail there."""
    W = graph_challenge_network(1024, 20).weights
    assert layer_period(W) is None
    found = relabelled_period(W)
    assert found is not None and found.period == 6 and found.relabelled
    _assert_isomorphism(W, found)
    assert find_period(W).period == 6
    assert find_period(W, relabelled=False) is None


def test_uneven_blocks_and_radices():
    """Non-square layers of alternating widths (blocks 2, 3, 2, 3, ...) over radices (2, 3):
    period 2 after relabelling; 3 neurons per twin class where the block is 3."""
    cfg = RadixNetConfig(radices=(2, 3), num_layers=9, blocks=(2, 3) * 5, weight=1.0,
                         permute=True, seed=4)
    W = radixnet(cfg)
    assert {w.shape for w in W} == {(18, 12), (12, 18)}
    found = relabelled_period(W)
    assert found is not None and found.period == 2
    _assert_isomorphism(W, found)


def test_no_period_is_reported_as_none():
    # one layer of the second repeat is another radix: nothing repeats
    W = list(graph_challenge_network(1024, 14).weights)
    other = sp.kron(np.ones((16, 16)), mixed_radix_layer((2,) * 6, 3), format="csr") / 16
    W[9] = sp.csr_matrix(other)
    assert relabelled_period(W) is None
    # no twins: the search is not run (random regular layers have no structure to find)
    assert relabelled_period(random_regular_network(256, 9, 8, seed=1)) is None
    # too short to repeat
    assert relabelled_period(W[:2]) is None


def test_a_relabelled_random_network_with_twins_is_found():
    """Twin classes from a Kronecker widening of random 3-regular layers (no RadiX-Net
    structure), repeated with period 3 and relabelled: found, and the maps are exact."""
    rng = np.random.default_rng(3)
    base = [sp.kron(np.ones((4, 4)), random_regular_network(24, 1, 3, seed=s)[0], format="csr")
            for s in (1, 2, 3)]
    perms = [np.arange(96)] + [rng.permutation(96) for _ in range(9)] + [np.arange(96)]
    W = [sp.csr_matrix(base[(k - 1) % 3][perms[k]][:, perms[k - 1]]) for k in range(1, 11)]
    found = relabelled_period(W)
    assert found is not None and found.period == 3
    _assert_isomorphism(W, found)


def _layer_volumes(W, part):
    return np.array([pair_volumes(W[k - 1], part.owners[k], part.owners[k - 1],
                                  part.parts).sum() for k in range(1, len(W) + 1)])


def test_tiling_through_the_relabelling():
    """The relabelled network is partitioned one period at a time: every layer balanced, every
    layer inside a repeat has exactly the volume of its layer in the first period (measured on
    the full network), and the total is within 3 % of partitioning every layer (chained, §5)."""
    W = graph_challenge_network(1024, 20).weights
    tiled = hypergraph_partition(W, 8, HypergraphConfig(seed=1))
    every = hypergraph_partition(W, 8, HypergraphConfig(seed=1, tile=False, phases="chained"))
    assert tiled.info["period"] == 6 and tiled.info["relabelled"] is True
    assert every.info["period"] == 0 and every.info["relabelled"] is False
    for k in range(1, 21):
        assert np.bincount(tiled.owners[k], minlength=8).max() <= 1024 / 8 * 1.01
    vt = _layer_volumes(W, tiled)
    for k in range(7, 21):
        if (k - 1) % 6:
            assert vt[k - 1] == vt[(k - 1) % 6], k
    assert vt.sum() <= 1.03 * _layer_volumes(W, every).sum()


def test_files_partition_like_the_generated_network(tmp_path):
    """Read back from the challenge's TSV files (no generator at hand), the network is tiled
    like the generated one: its volume within 3 % of partitioning every layer of the files,
    and within 8 % of the generated path (which partitions the unpermuted twin, whose ordered
    ids KaHyPar's tie-breaking favours: 4-6 % lower at this size, 0.8 % at N=16384, L=120)."""
    net = challenge_config(1024, 14, seed=2)
    gen = radixnet(net)
    write_challenge_network(tmp_path, gen)
    files = read_challenge_network(tmp_path, 1024, 14)
    opts = PartitionOptions()
    from_files = plan_partition(files, 8, "hypergraph", opts)
    generated = plan_partition(gen, 8, "hypergraph", opts, network=net)
    assert from_files.info["period"] == 6 and from_files.info["relabelled"]
    v_files = _layer_volumes(files, from_files).sum()
    v_gen = _layer_volumes(gen, generated).sum()
    every = hypergraph_partition(files, 8, HypergraphConfig(tile=False, phases="chained"))
    assert v_files <= 1.03 * _layer_volumes(files, every).sum()
    assert v_files <= 1.08 * v_gen
    # the same network without relabelling has its exact period (no maps)
    plain = radixnet(dataclasses.replace(net, permute=False))
    assert find_period(plain) == LayerPeriod(period=6)


@pytest.mark.parametrize("L", [13, 12])
def test_only_periods_worth_repeating(L):
    """2 p < L: with L = 12 the period 6 is not worth tiling (every layer is partitioned)."""
    W = graph_challenge_network(1024, L).weights
    found = find_period(W)
    assert (found.period if found else None) == (6 if L == 13 else None)


def _relabelled(base: list, L: int, seed: int, widen: int = 2) -> list:
    """W^k = P_k kron(ones, base[(k-1) % p]) P_{k-1}^T with a random P_k for every level
    (inputs and outputs too)."""
    rng = np.random.default_rng(seed)
    mats = [sp.csr_matrix(sp.kron(np.ones((widen, widen)), base[(k - 1) % len(base)]))
            for k in range(1, L + 1)]
    for m in mats:
        m.eliminate_zeros()  # kron with a dense block goes through BSR and stores zeros
    widths = [mats[0].shape[1]] + [m.shape[0] for m in mats]
    perms = [rng.permutation(w) for w in widths]
    return [sp.csr_matrix(mats[k - 1][perms[k]][:, perms[k - 1]]) for k in range(1, L + 1)]


def _rook_and_shrikhande():
    """Two strongly regular graphs with the same parameters (16, 6, 2, 2), not isomorphic:
    colour refinement cannot tell them (or their vertices) apart."""
    cells = [(a, b) for a in range(4) for b in range(4)]
    rook = np.array([[int(u != v and (u[0] == v[0] or u[1] == v[1])) for v in cells]
                     for u in cells])
    steps = {(0, 1), (0, 3), (1, 0), (3, 0), (1, 1), (3, 3)}
    shrikhande = np.array([[int(((v[0] - u[0]) % 4, (v[1] - u[1]) % 4) in steps) for v in cells]
                           for u in cells])
    return rook + np.eye(16, dtype=int), shrikhande + np.eye(16, dtype=int)


@pytest.mark.parametrize("seed", range(6))
def test_backtracking_finds_a_period_refinement_cannot_see(seed):
    """Layers block_diag(rook, Shrikhande) repeated with period 1: refinement sees every vertex
    alike, a first individualisation may pick the wrong block, and only backtracking out of it
    finds the map (without it, half of these seeds were missed at L = 3, found by review)."""
    rook, shrikhande = _rook_and_shrikhande()
    W = _relabelled([sp.block_diag([rook, shrikhande], format="csr")], 3, seed)
    found = relabelled_period(W)
    assert found is not None and found.period == 1
    _assert_isomorphism(W, found)


def test_a_candidate_rejected_by_the_isomorphism_search(monkeypatch):
    """Rook and Shrikhande layers have every per-layer invariant in common, so the candidate
    period reaches the isomorphism search, which must reject it."""
    import partition.period as period_mod

    rook, shrikhande = _rook_and_shrikhande()
    W = _relabelled([rook, rook, shrikhande], 7, seed=1)  # R R S R R S R: p = 3 is real
    calls = []
    real = period_mod._isomorphism
    monkeypatch.setattr(period_mod, "_isomorphism", lambda a, b: calls.append(1) or real(a, b))
    found = relabelled_period(W)
    assert found is not None and found.period == 3
    _assert_isomorphism(W, found)
    assert len(calls) >= 2  # p = 1 and p = 2 reached the search and were refused there


def test_chain_ends_use_their_own_twins():
    """A's last level and B's first have in- or out-edges only inside their chain: neurons
    there with the same inputs but other outputs are twins of the chain, not of the network.
    Using the network's classes there loses this period (found by review)."""
    W = _relabelled([np.kron(np.ones((2, 2)), [[1, 0], [1, 0]])], 3, seed=0, widen=1)
    found = relabelled_period(W)
    assert found is not None and found.period == 1
    _assert_isomorphism(W, found)


def test_hash_collisions_are_caught(monkeypatch):
    """With degenerate hash tables (every neuron hashes alike) twin classes merge non-twins;
    the exact checks must refuse them or the maps must still be true."""
    import partition.period as period_mod

    def degree_only(indptr, indices, n_items, seed):  # every row's hash is its degree
        return np.diff(indptr).astype(np.uint64)

    monkeypatch.setattr(period_mod, "set_hash", degree_only)
    monkeypatch.setattr(period_mod, "_out_table", lambda n: np.ones(n, dtype=np.uint64))
    W = graph_challenge_network(1024, 14).weights
    found = relabelled_period(W)
    if found is not None:
        _assert_isomorphism(W, found)
    rng = np.random.default_rng(5)
    base = [sp.csr_matrix((rng.random((6, 6)) < 0.4).astype(float)) for _ in range(2)]
    W = _relabelled(base, 7, seed=3)
    found = relabelled_period(W)
    if found is not None:
        _assert_isomorphism(W, found)


def test_stored_pattern_degenerate_shapes_and_duplicates():
    """Duplicate entries are summed before the search (a CSR storing each entry twice still
    has its period); a zero-width layer has none and does not crash."""
    W = graph_challenge_network(1024, 14).weights
    doubled = []
    for w in W:  # every entry stored twice, side by side (not canonical)
        w = sp.csr_matrix(w)
        d = np.diff(w.indptr)
        doubled.append(sp.csr_matrix((np.repeat(w.data, 2), np.repeat(w.indices, 2),
                                      np.concatenate(([0], np.cumsum(2 * d)))), shape=w.shape))
        assert not doubled[-1].has_canonical_format
    found = relabelled_period(doubled)
    assert found is not None and found.period == 6
    empty = [sp.csr_matrix((0, 4)), sp.csr_matrix((4, 0)), sp.csr_matrix((0, 4))]
    assert find_period(empty) is None
