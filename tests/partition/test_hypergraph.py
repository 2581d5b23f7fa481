"""The fixed-vertex hypergraph model (§5): Fig. 3 example, compression, the Mt-KaHyPar and
KaHyPar engines, period tiling, determinism."""

import numpy as np
import pytest
import scipy.sparse as sp

from partition.hypergraph import build_layer_hypergraph, compress_hypergraph, connectivity_cutsize
from partition.metrics import pair_volumes
from partition.partitioners import (
    ENGINES,
    HypergraphConfig,
    Partition,
    _block_capacity,
    _run_kahypar,
    _run_mtkahypar,
    hypergraph_partition,
    input_owner_from_connectivity,
    layer_period,
    partition_layer,
    random_partition,
)
from sparse_sgd.radixnet import graph_challenge_network


def _pattern(rows_1based, n=4):
    r = [i for i, cols in enumerate(rows_1based) for _ in cols]
    c = [j - 1 for cols in rows_1based for j in cols]
    return sp.csr_matrix((np.ones(len(r)), (r, c)), shape=(n, n))


# Fig. 3: neuron 2 of layer 1 uses inputs 1, 2, 3; x0(2) is used only by part V2 = {v1, v2}
W1 = _pattern([[1, 2], [1, 2, 3], [1, 3, 4], [3, 4]])
W2 = _pattern([[1, 3], [2], [3, 4], [1, 4]])
PI1 = np.array([1, 1, 0, 0])  # v3, v4 in V1 (part 0); v1, v2 in V2 (part 1)


def _nets(hg):
    return [sorted(hg.net_pins(e).tolist()) for e in range(hg.num_nets)]


def test_fig3_phase1_hypergraph():
    hg = build_layer_hypergraph(W1)
    assert hg.num_rows == 4 and hg.num_vertices == 4 and not hg.has_fixed
    np.testing.assert_array_equal(hg.vertex_weight, [2, 3, 3, 2])  # nnz per row
    assert _nets(hg) == [[0, 1, 2], [0, 1], [1, 2, 3], [2, 3]]  # eq. 12 without fixed vertices
    np.testing.assert_array_equal(hg.net_cost, 2)
    # x0 inside the net connectivity sets: n2 only connects V2, n4 only V1; n1 connects both,
    # so x0(1) "can be stored by one of the processors" (§5): the balanced rule takes the one
    # with less to send, the most-pins rule the one holding most pins (V2)
    owner0 = input_owner_from_connectivity(W1, PI1, 2)
    assert owner0[1] == 1 and owner0[3] == 0 and owner0[0] in (0, 1)
    assert input_owner_from_connectivity(W1, PI1, 2, "most_pins")[0] == 1


def test_fig3_phase2_fixed_vertices():
    hg = build_layer_hypergraph(W2, PI1)
    assert hg.num_vertices == 8
    # vf1, vf2 fixed to V2 (part 1), vf3, vf4 to V1 (part 0)
    np.testing.assert_array_equal(hg.fixed, [-1, -1, -1, -1, 1, 1, 0, 0])
    assert _nets(hg) == [[0, 3, 4], [1, 5], [0, 2, 6], [2, 3, 7]]
    np.testing.assert_array_equal(hg.vertex_weight[:4], [2, 1, 2, 2])
    # cut size (eq. 1) = SpFF + SpBP words of the layer under any partition of the rows
    for owner2 in ([0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 0, 1]):
        part = np.concatenate((owner2, hg.fixed[4:]))
        D = pair_volumes(W2, np.array(owner2), PI1, 2)
        assert connectivity_cutsize(hg, part) == 2 * D.sum()


def test_compression_preserves_cut_size():
    W = graph_challenge_network(1024, 2, seed=1).weights[1]
    rng = np.random.default_rng(0)
    prev = rng.integers(0, 8, 1024)
    full = build_layer_hypergraph(W, prev)
    small, row_to_vertex = compress_hypergraph(W, prev, 8, max_chunk=4)
    assert small.num_rows < full.num_rows and small.num_nets < full.num_nets
    assert small.vertex_weight[:small.num_rows].sum() == 32 * 1024
    for _ in range(5):
        coarse = rng.integers(0, 8, small.num_rows)
        owner = coarse[row_to_vertex]
        cut_small = connectivity_cutsize(small, np.concatenate((coarse,
                                                               small.fixed[small.num_rows:])))
        cut_full = connectivity_cutsize(full, np.concatenate((owner, prev[full.columns])))
        assert cut_small == cut_full


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("compress", [True, False])
def test_engines_honour_fixed_vertices_and_balance(engine, compress):
    W = graph_challenge_network(1024, 2, seed=2).weights[1]
    prev = np.random.default_rng(1).integers(0, 8, 1024)  # an adversarial x^{k-1} placement
    cfg = HypergraphConfig(engine=engine, compress=compress, seed=3)
    hg = build_layer_hypergraph(W, prev, fixed_weight=1)
    cap = _block_capacity(32 * 1024, 8, 0.01)
    run = _run_mtkahypar if engine == "mtkahypar" else _run_kahypar
    part = run(hg, 8, cfg, 2, cap)  # raises if a fixed vertex moved
    assert np.bincount(part, weights=hg.vertex_weight[:1024], minlength=8).max() <= cap
    owner = partition_layer(W, prev, 8, cfg, 2)
    assert np.bincount(owner, minlength=8).max() * 32 <= cap
    # the model's objective is what the engine minimised: far below a random placement
    rand = np.random.default_rng(2).permutation(1024) % 8
    assert pair_volumes(W, owner, prev, 8).sum() < 0.7 * pair_volumes(W, rand, prev, 8).sum()


def _layer_volumes(W, part):
    return np.array([pair_volumes(W[k - 1], part.owners[k], part.owners[k - 1],
                                  part.parts).sum() for k in range(1, len(W) + 1)])


def test_tiling_a_periodic_network_repeats_the_period_exactly():
    """Unpermuted RadiX-Net layers repeat with period 6 (N = 1024): the tiled partition is a
    valid balanced partition of every layer, every layer but the first of a repeat has the
    volume of its layer in the first period (counted on the full network), and the total is
    within 3 % of partitioning every layer over four seeds (one seed's ratio spreads from 1.00
    to 1.035 with KaHyPar ``fast``)."""
    W = graph_challenge_network(1024, 20, permute=False).weights
    assert layer_period(W) == 6
    tiled = hypergraph_partition(W, 8, HypergraphConfig(seed=1))
    every = hypergraph_partition(W, 8, HypergraphConfig(seed=1, tile=False, phases="chained"))
    assert tiled.info["period"] == 6 and every.info["period"] == 0
    seeds = range(2, 5)
    sum_tiled = sum(_layer_volumes(W, hypergraph_partition(W, 8, HypergraphConfig(seed=s))).sum()
                    for s in seeds)
    sum_every = sum(_layer_volumes(W, hypergraph_partition(W, 8, HypergraphConfig(
        seed=s, tile=False, phases="chained"))).sum() for s in seeds)
    for k in range(1, 21):
        assert np.bincount(tiled.owners[k], minlength=8).max() * 32 <= 32 * 1024 / 8 * 1.01
    vt = _layer_volumes(W, tiled)
    for k in range(7, 21):
        if (k - 1) % 6:
            assert vt[k - 1] == vt[(k - 1) % 6], k
    assert vt.sum() + sum_tiled <= 1.03 * (_layer_volumes(W, every).sum() + sum_every)
    # no period: every layer is partitioned
    assert hypergraph_partition(W[:6] + W[:1], 8, HypergraphConfig(seed=1)).info["period"] == 0


@pytest.mark.parametrize("engine,preset", [("kahypar", None), ("mtkahypar", "deterministic")])
def test_same_seed_same_partition(engine, preset):
    W = graph_challenge_network(1024, 8, seed=5).weights
    cfg = HypergraphConfig(engine=engine, preset=preset, threads=1, seed=7)
    a, b = hypergraph_partition(W, 6, cfg), hypergraph_partition(W, 6, cfg)
    for x, y in zip(a.owners, b.owners):
        np.testing.assert_array_equal(x, y)


def test_hypergraph_partition_beats_random_and_is_balanced():
    W = graph_challenge_network(1024, 4, seed=3).weights
    h = hypergraph_partition(W, 8, HypergraphConfig(seed=1))
    r = random_partition(W, 8, seed=1)
    for k in range(1, 5):
        loads = np.bincount(h.owners[k], minlength=8) * 32
        assert loads.max() <= 32 * 1024 / 8 * 1.01
        sizes = np.bincount(r.owners[k], minlength=8)
        assert sizes.max() - sizes.min() <= 1
    hv = sum(pair_volumes(W[k - 1], h.owners[k], h.owners[k - 1], 8).sum() for k in range(1, 5))
    rv = sum(pair_volumes(W[k - 1], r.owners[k], r.owners[k - 1], 8).sum() for k in range(1, 5))
    assert hv < 0.5 * rv
    assert hypergraph_partition(W, 1).owners[2].max() == 0


def test_partition_validation_and_save_load(tmp_path):
    W = graph_challenge_network(1024, 2).weights
    r = random_partition(W, 4, seed=9)
    r.save(tmp_path / "p.npz")
    back = Partition.load(tmp_path / "p.npz")
    assert back.parts == 4 and back.method == "random"
    for a, b in zip(r.owners, back.owners):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="parts"):
        Partition(owners=(np.array([0, 5]),), parts=4)
    with pytest.raises(ValueError, match="layers"):
        back.check_network(W[:1])
    with pytest.raises(ValueError, match="preset"):
        HypergraphConfig(engine="mtkahypar", preset="large_k")
    with pytest.raises(ValueError, match="not a kahypar preset"):
        HypergraphConfig(engine="kahypar", preset="deterministic")
    with pytest.raises(ValueError, match="engine"):
        HypergraphConfig(engine="patoh")


def test_rebalance_repairs_an_overloaded_partition():
    from partition.partitioners import _rebalance

    W = graph_challenge_network(1024, 2, seed=4).weights[1]
    prev = np.arange(1024) % 4
    hg = build_layer_hypergraph(W, prev, fixed_weight=1)
    cap = _block_capacity(32 * 1024, 4, 0.01)
    owner = np.zeros(1024, dtype=np.int64)
    owner[600:] = np.arange(424) % 3 + 1  # block 0 holds 600 rows, far over 256
    fixed = _rebalance(hg, owner, 4, cap)
    assert np.bincount(fixed, minlength=4).max() * 32 <= cap
    assert np.all(fixed[600:] == owner[600:])  # only rows of the overloaded block moved


def test_one_default_partition_configuration_everywhere():
    """The library's HypergraphConfig() is what every command runs by default (the
    library defaulted to Mt-KaHyPar while the CLIs default to KaHyPar)."""
    from partition.cli import LayersConfig
    from sparse_sgd.plan import PartitionOptions

    lib = HypergraphConfig()
    assert lib.engine == "kahypar"
    assert PartitionOptions().hypergraph_config(0) == lib
    assert LayersConfig().hypergraph_config(0) == lib


def test_no_permute_help_says_what_the_flag_does():
    """``--no-permute`` keeps the generator's ids; its help must say so, not describe the
    default it turns off."""
    import argparse

    from sparse_sgd.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("train", "infer", "partition", "generate"):
        action = next(a for a in sub.choices[name]._actions if "--no-permute" in a.option_strings)
        assert action.help.startswith("keep the generator's neuron ids"), (name, action.help)
        assert "default: relabel" in action.help
