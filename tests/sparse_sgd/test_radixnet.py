"""RadiX-Net generator and the Graph Challenge family (structure against the definitions), the
relabelling P_k W^k P_{k-1}^T and the volume lower bound."""

import numpy as np
import pytest
import scipy.sparse as sp

from partition.metrics import partition_metrics
from partition.partitioners import Partition, layer_period, random_partition
from sparse_sgd.radixnet import (
    CHALLENGE_BIAS,
    RadixNetConfig,
    challenge_config,
    graph_challenge_network,
    mixed_radix_layer,
    period,
    place_values,
    radixnet,
    relabel_owners,
    relabelling,
    spff_lower_bound,
)


def _brute_radix_layer(radices, t):
    n = int(np.prod(radices))
    pv = int(np.prod(radices[:t]))
    M = np.zeros((n, n))
    for i in range(n):
        for j in range(radices[t]):
            M[i, (i - j * pv) % n] = 1
    return M


@pytest.mark.parametrize("radices", [(2, 2, 2), (3, 2, 4), (2,) * 6])
def test_mixed_radix_layer_matches_definition(radices):
    for t in range(len(radices)):
        np.testing.assert_array_equal(mixed_radix_layer(radices, t).toarray(),
                                      _brute_radix_layer(radices, t))


@pytest.mark.parametrize("radices", [(2, 3, 2), (4, 4), (2,) * 6])
def test_radix_layers_connect_every_input_to_every_output_once(radices):
    P = sp.identity(int(np.prod(radices)), format="csr")
    for t in range(len(radices)):
        P = mixed_radix_layer(radices, t) @ P
    np.testing.assert_array_equal(P.toarray(), np.ones(P.shape))  # exactly one path


def test_place_values():
    np.testing.assert_array_equal(place_values((2, 3, 4)), [1, 2, 6])
    with pytest.raises(ValueError, match="positive"):
        place_values((2, 0))


def _path_counts(weights):
    """Number of paths (product of the 0/1 patterns) from every input to every output."""
    P = None
    for W in weights:
        A = sp.csr_matrix(W, copy=True)
        A.data[:] = 1.0
        P = A if P is None else A @ P
    return P.toarray()


def test_challenge_1024_structure_and_relabelling():
    net = graph_challenge_network(1024, 14, seed=4)
    plain = graph_challenge_network(1024, 14, permute=False, seed=4).weights
    assert net.bias == CHALLENGE_BIAS[1024] == -0.3 and net.ymax == 32
    perms = relabelling(challenge_config(1024, 14, seed=4))
    np.testing.assert_array_equal(perms[0], np.arange(1024))  # inputs keep their pixels
    np.testing.assert_array_equal(perms[14], np.arange(1024))  # outputs keep their classes
    for k, W in enumerate(net.weights, start=1):
        assert W.shape == (1024, 1024)
        np.testing.assert_array_equal(np.diff(W.indptr), 32)  # 32 connections per neuron
        np.testing.assert_array_equal(np.diff(W.tocsc().indptr), 32)
        np.testing.assert_allclose(W.data, 1 / 16)
        # W'^k = P_k W^k P_{k-1}^T with permutation matrices built here from the index arrays
        Pk = sp.csr_matrix((np.ones(1024), (np.arange(1024), perms[k])), shape=(1024, 1024))
        Pk1 = sp.csr_matrix((np.ones(1024), (np.arange(1024), perms[k - 1])),
                            shape=(1024, 1024))
        assert abs(W - Pk @ plain[k - 1] @ Pk1.T).max() == 0
    assert not np.array_equal(perms[1], np.arange(1024))
    assert not np.array_equal(perms[1], perms[2])  # a fresh relabelling per hidden layer


def test_relabelled_network_is_isomorphic_to_the_unpermuted_one():
    """Same path counts through 6 layers (2^20 / 16^6 per pair: every input reaches every output
    equally), same function of the input, same volumes under the mapped partition."""
    cfg = challenge_config(1024, 6, seed=9)
    W = radixnet(cfg)
    plain = radixnet(challenge_config(1024, 6, permute=False))
    counts = _path_counts(W)
    np.testing.assert_array_equal(counts, _path_counts(plain))
    np.testing.assert_array_equal(counts, 2 ** 20)  # 16^5 dense blocks x one radix path
    x = np.random.default_rng(0).random((1024, 3))
    y, y0 = x, x
    for A, B in zip(W, plain):
        y, y0 = np.tanh(A @ y), np.tanh(B @ y0)
    np.testing.assert_allclose(y, y0, rtol=1e-12)
    # a partition of the plain network, mapped through the relabelling, sends the same words
    part = random_partition(plain, 5, seed=1)
    mapped = Partition(owners=relabel_owners(part.owners, relabelling(cfg)), parts=5)
    a, b = partition_metrics(plain, part), partition_metrics(W, mapped)
    np.testing.assert_array_equal(a.pair_words, b.pair_words)
    np.testing.assert_array_equal(a.flops, b.flops)


def test_period_and_lower_bound():
    assert period(challenge_config(1024, 14, permute=False)) == 6
    assert period(challenge_config(1024, 14)) is None
    assert layer_period(radixnet(challenge_config(1024, 14, permute=False))) == 6
    assert layer_period(radixnet(challenge_config(1024, 14))) is None
    # N = 1024, P = 32: 32 rows (two classes of 16 identical rows) need 3 column classes of 16
    # in radix layers with place value < 32, so at least 48 - 32 = 16 words per processor; the
    # layer with place value 32 pairs classes with equal columns (bound 0): 80 / 6 on average
    lb = spff_lower_bound(challenge_config(1024, 6), 32) / 32
    np.testing.assert_array_equal(lb, [16, 16, 16, 16, 16, 0])
    assert spff_lower_bound(challenge_config(1024, 6), 32).mean() / 32 == pytest.approx(40 / 3)
    # P = 512: two rows of one class use 32 columns, the processor owns 2
    np.testing.assert_array_equal(spff_lower_bound(challenge_config(1024, 6), 512) / 512, 30)
    # the bound holds for the partitions we find (brute-force counted volumes)
    W = radixnet(challenge_config(1024, 6, permute=False))
    for P in (8, 32):
        part = random_partition(W, P, seed=0)
        vol = partition_metrics(W, part).spff_volume.sum(axis=1)
        assert np.all(vol >= spff_lower_bound(challenge_config(1024, 6), P))


def test_unpermuted_network_is_the_kronecker_product():
    W = graph_challenge_network(1024, 7, permute=False).weights
    base = sp.kron(np.ones((16, 16)), mixed_radix_layer((2,) * 6, 0), format="csr") / 16
    assert (W[0] != base).nnz == 0 and (W[6] != base).nnz == 0


def test_seeded_and_configurable():
    a = graph_challenge_network(1024, 3, seed=1).weights
    b = graph_challenge_network(1024, 3, seed=1).weights
    c = graph_challenge_network(1024, 3, seed=2).weights
    assert all((x != y).nnz == 0 for x, y in zip(a, b))
    assert any((x != y).nnz > 0 for x, y in zip(a, c))
    W = radixnet(RadixNetConfig(radices=(3, 2), num_layers=3, blocks=(2, 3, 2, 1),
                                weight=0.5, permute=False))
    assert [w.shape for w in W] == [(18, 12), (12, 18), (6, 12)]
    np.testing.assert_array_equal(np.diff(W[0].indptr), 2 * 3)  # B_{k-1} * radix
    assert challenge_config(4096, 2).radices == (2,) * 8
    with pytest.raises(ValueError, match="Graph Challenge"):
        challenge_config(1000, 2)
    with pytest.raises(ValueError, match="blocks"):
        RadixNetConfig(num_layers=2, blocks=(1, 2))
