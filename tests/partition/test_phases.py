"""Independent phases: every layer partitioned without fixed vertices, in parallel,
then the part ids aligned to the previous layer by an exact assignment.  Volumes are counted
with ``partition.metrics.pair_volumes`` (eqs. 8-9), permutations checked by brute force."""

import itertools

import numpy as np
import pytest
import scipy.sparse as sp

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
    chained = hypergraph_partition(W, 8, HypergraphConfig(engine=engine, seed=1,
                                                          phases="chained"))
    free = hypergraph_partition(W, 8, HypergraphConfig(engine=engine, seed=1))  # the default
    assert free.info["phases"] == "independent" and chained.info["phases"] == "chained"
    for k in range(1, L + 1):
        assert np.bincount(free.owners[k], minlength=8).max() <= n / 8 * 1.01
    assert _volume(W, free) <= 1.03 * _volume(W, chained)


def test_workers_do_not_change_the_partition():
    W = random_regular_network(256, 6, degree=8, seed=5)
    one = hypergraph_partition(W, 4, HypergraphConfig(seed=3, workers=1))
    two = hypergraph_partition(W, 4, HypergraphConfig(seed=3, workers=2))
    for a, b in zip(one.owners, two.owners):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="phases"):
        HypergraphConfig(phases="parallel")
    with pytest.raises(ValueError, match="workers"):
        HypergraphConfig(workers=-1)


def test_layers_whose_nets_have_one_pin_partition_balanced():
    """A layer where every column has one nonzero (each x^{k-1}(j) feeds one neuron) has no net
    that can be cut without fixed vertices: the compressed hypergraph keeps no net, the layer is
    packed for balance alone (KaHyPar 1.3 crashes on a hypergraph without nets), and the
    volume is the same whichever phase order is used."""
    n, L, P = 96, 4, 8
    rng = np.random.default_rng(7)
    W = random_regular_network(n, L, degree=4, seed=6)
    W[2] = sp.csr_matrix((np.ones(n), (rng.permutation(n), np.arange(n))), shape=(n, n))
    for workers in (1, 2):
        part = hypergraph_partition(W, P, HypergraphConfig(seed=2, workers=workers))
        for k in range(1, L + 1):
            assert np.bincount(part.owners[k], minlength=P).max() <= \
                np.ceil(W[k - 1].nnz / P * 1.01)
    chained = hypergraph_partition(W, P, HypergraphConfig(seed=2, phases="chained"))
    # layer 3 costs at most one word per column in either order (x^2(j) sent to one processor)
    for p in (part, chained):
        assert pair_volumes(W[2], p.owners[3], p.owners[2], P).sum() <= n


def _partition_in_daemon(W, queue):
    queue.put(hypergraph_partition(W, 4, HypergraphConfig(seed=3, workers=2)).owners)


def test_a_daemonic_process_partitions_in_itself():
    """A daemonic process (a ``multiprocessing.Pool`` worker) may not start workers: it
    partitions the independent phases itself, to the same partition."""
    import multiprocessing

    W = random_regular_network(128, 4, degree=8, seed=5)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_partition_in_daemon, args=(W, queue), daemon=True)
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=60)
    want = hypergraph_partition(W, 4, HypergraphConfig(seed=3, workers=1)).owners
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
