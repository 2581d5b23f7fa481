"""Independent phases: every layer partitioned without fixed vertices, in parallel,
then the part ids aligned to the previous layer by an exact assignment.  Volumes are counted
with ``partition.metrics.pair_volumes`` (eqs. 8-9), permutations checked by brute force."""

import itertools

import numpy as np
import pytest

from partition.metrics import pair_volumes
from partition.partitioners import HypergraphConfig, _align_parts, hypergraph_partition
from sparse_sgd.radixnet import random_regular_network


def _volume(W, part):
    return sum(pair_volumes(W[k - 1], part.owners[k], part.owners[k - 1], part.parts).sum()
               for k in range(1, len(W) + 1))


def test_align_parts_is_the_best_permutation():
    """The aligned owner has the smallest layer volume over all P! relabellings (P = 5)."""
    W = random_regular_network(60, 1, degree=6, seed=2)[0]
    rng = np.random.default_rng(0)
    owner, prev = rng.permutation(60) % 5, rng.permutation(60) % 5
    aligned = _align_parts(W, owner, prev, 5)
    best = min(pair_volumes(W, np.asarray(s)[owner], prev, 5).sum()
               for s in itertools.permutations(range(5)))
    assert pair_volumes(W, aligned, prev, 5).sum() == best
    assert sorted(np.bincount(aligned, minlength=5)) == sorted(np.bincount(owner, minlength=5))


@pytest.mark.parametrize("engine", ["kahypar", "mtkahypar"])
def test_independent_phases_close_to_chained(engine):
    """On a network without structure (random 16-regular layers) the independent phases are
    balanced and within 3 % of the chained phases of §5 (with KaHyPar they coincide up to
    part ids: KaHyPar's fixed vertices only choose the labels of a recursive bisection)."""
    n, L = (512, 5) if engine == "kahypar" else (256, 3)  # Mt-KaHyPar: seconds per call here
    W = random_regular_network(n, L, degree=16, seed=4)
    chained = hypergraph_partition(W, 8, HypergraphConfig(engine=engine, seed=1))
    free = hypergraph_partition(W, 8, HypergraphConfig(engine=engine, seed=1,
                                                       phases="independent"))
    assert free.info["phases"] == "independent" and chained.info["phases"] == "chained"
    for k in range(1, L + 1):
        assert np.bincount(free.owners[k], minlength=8).max() <= n / 8 * 1.01
    assert _volume(W, free) <= 1.03 * _volume(W, chained)


def test_workers_do_not_change_the_partition():
    W = random_regular_network(256, 6, degree=8, seed=5)
    one = hypergraph_partition(W, 4, HypergraphConfig(seed=3, phases="independent"))
    two = hypergraph_partition(W, 4, HypergraphConfig(seed=3, phases="independent", workers=2))
    for a, b in zip(one.owners, two.owners):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="phases"):
        HypergraphConfig(phases="parallel")
    with pytest.raises(ValueError, match="workers"):
        HypergraphConfig(workers=-1)
