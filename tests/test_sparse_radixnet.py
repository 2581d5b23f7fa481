"""RadiX-Net generator and the Graph Challenge family (structure against the definitions)."""

import numpy as np
import pytest
import scipy.sparse as sp

from sparse_sgd.radixnet import (CHALLENGE_BIAS, RadixNetConfig, challenge_config,
                                 graph_challenge_network, mixed_radix_layer, place_values, radixnet)


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


def _row_classes(W, pv, n=64):
    """Class b = (i mod n) of the base row every row of W came from: S = {b, b - pv} mod n."""
    out = []
    for p in range(W.shape[0]):
        S = set((W.indices[W.indptr[p]:W.indptr[p + 1]] % n).tolist())
        out.append([b for b in S if (b - pv) % n in S][0])
    return np.array(out)


def test_challenge_1024_structure_and_permutation():
    net = graph_challenge_network(1024, 14, seed=4)
    assert net.bias == CHALLENGE_BIAS[1024] == -0.3 and net.ymax == 32
    for k, W in enumerate(net.weights):
        assert W.shape == (1024, 1024)
        np.testing.assert_array_equal(np.diff(W.indptr), 32)  # 32 connections per neuron
        np.testing.assert_array_equal(np.diff(W.tocsc().indptr), 32)
        np.testing.assert_allclose(W.data, 1 / 16)
        # layer 6b + r is a row permutation of kron(ones(16, 16), M_r) / 16
        base = sp.kron(np.ones((16, 16)), mixed_radix_layer((2,) * 6, k % 6), format="csr")
        rows_w = sorted(tuple(W.indices[W.indptr[p]:W.indptr[p + 1]]) for p in range(1024))
        rows_b = sorted(tuple(base.indices[base.indptr[p]:base.indptr[p + 1]])
                        for p in range(1024))
        assert rows_w == rows_b
    c0 = _row_classes(net.weights[0], 1)
    c1 = _row_classes(net.weights[1], 2)
    c6 = _row_classes(net.weights[6], 1)
    assert not np.array_equal(c0, np.arange(1024) % 64)  # rows are permuted
    np.testing.assert_array_equal(c0, c1)  # one permutation for the block of layers 1..6
    assert not np.array_equal(c0, c6)  # a fresh one for the next block


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
