"""Serial reference (finite differences) and the local Numba kernels (against SciPy)."""

import numpy as np
import scipy.sparse as sp

from sparse_sgd.kernels import challenge_layer, sddmm_update, spmm_add
from sparse_sgd.radixnet import RadixNetConfig, radixnet
from sparse_sgd.serial import SerialSparseNet, challenge_inference_serial, mse_loss


def _small_net(seed=0):
    rng = np.random.default_rng(seed)
    W = radixnet(RadixNetConfig(radices=(2, 3), num_layers=3, blocks=(2,), permute=True,
                                seed=seed))
    for w in W:
        w.data = rng.uniform(-1, 1, w.nnz)
    b = [rng.uniform(-0.2, 0.2, w.shape[0]) for w in W]
    return W, b, rng


def test_serial_gradient_matches_finite_differences():
    W, b, rng = _small_net()
    n = W[0].shape[1]
    X0, Y = rng.random((n, 4)), rng.random((W[-1].shape[0], 4))
    lr = 1e-3

    def loss(Ws, bs):
        return mse_loss(SerialSparseNet(Ws, bs).forward(X0), Y)

    net = SerialSparseNet(W, b)
    net.step(X0, Y, lr)
    for k in range(3):
        grad = (W[k].data - net.W[k].data) / lr  # the update applied lr * dJ/dW
        for p in rng.choice(W[k].nnz, 4, replace=False):
            Wp = [w.copy() for w in W]
            Wm = [w.copy() for w in W]
            Wp[k].data[p] += 1e-6
            Wm[k].data[p] -= 1e-6
            fd = (loss(Wp, b) - loss(Wm, b)) / 2e-6
            np.testing.assert_allclose(grad[p], fd, rtol=1e-4, atol=1e-8)
        gb = (b[k] - net.b[k]) / lr
        i = 1
        bp = [x.copy() for x in b]
        bm = [x.copy() for x in b]
        bp[k][i] += 1e-6
        bm[k][i] -= 1e-6
        np.testing.assert_allclose(gb[i], (loss(W, bp) - loss(W, bm)) / 2e-6, rtol=1e-4,
                                   atol=1e-8)


def test_serial_training_reduces_loss():
    W, b, rng = _small_net(1)
    n = W[0].shape[1]
    X0, Y = rng.random((n, 8)), rng.random((W[-1].shape[0], 8))
    net = SerialSparseNet(W, b)
    losses = [net.step(X0, Y, 0.5) for _ in range(20)]
    assert losses[-1] < losses[0]


def test_numba_kernels_match_scipy():
    rng = np.random.default_rng(2)
    A = sp.random(60, 40, density=0.2, format="csr", random_state=3)
    X = rng.random((40, 7))
    out = rng.random((60, 7))
    ref = out + A @ X
    spmm_add(A.indptr, A.indices, A.data, X, out)
    np.testing.assert_allclose(out, ref, rtol=1e-12)
    delta = rng.random((60, 7))
    B = A.copy()
    sddmm_update(B.indptr, B.indices, B.data, delta, X, 0.1)
    dense = A.toarray() - 0.1 * (delta @ X.T) * (A.toarray() != 0)
    np.testing.assert_allclose(B.toarray(), dense, rtol=1e-12, atol=1e-14)


def test_challenge_layer_bias_only_on_nonzeros():
    A = sp.csr_matrix(np.array([[1.0, 0, 0], [0, 0, 0], [0, 2.0, 40.0]]))
    X = np.array([[1.0, 0.0], [0.5, 0.0], [1.0, 0.0]])
    Y = challenge_layer(A, X, -0.3, 32.0)
    np.testing.assert_allclose(Y, [[0.7, 0.0], [0.0, 0.0], [32.0, 0.0]])
    ref = challenge_inference_serial([A], -0.3, 32.0, X.T).toarray().T
    np.testing.assert_allclose(Y, ref)


def test_fan_in_initialisation_and_held_out_accuracy():
    """The default workload learns: a 4-layer ReLU RadiX-Net with fan-in-scaled weights reaches
    >= 0.75 on held-out digits after 150 steps of 32 (chance: 0.1).  The fan-in scale is
    U[-a, a] with a = sqrt(6 / 32) for ReLU (32 connections per neuron)."""
    from sparse_sgd.data import class_targets, digits_dataset, train_test_split
    from sparse_sgd.radixnet import graph_challenge_network
    from sparse_sgd.serial import init_weights

    W = init_weights(graph_challenge_network(1024, 4, seed=0).weights, "fan-in", "relu",
                     np.random.default_rng(1))
    assert max(abs(w.data).max() for w in W) <= np.sqrt(6 / 32)
    assert min(abs(w.data).max() for w in W) > 0.9 * np.sqrt(6 / 32)
    train, test = train_test_split(digits_dataset(1024), 0.2, seed=0)
    T = class_targets(train.labels, 1024)
    net = SerialSparseNet(W, activation="relu")
    rng = np.random.default_rng(2)
    for _ in range(150):
        idx = rng.choice(train.labels.size, 32, replace=False)
        net.step(train.features[idx].T.astype(np.float64), T[idx].T.astype(np.float64), 0.05)
    out = net.forward(test.features.T.astype(np.float64))
    scores = np.zeros((10, test.labels.size))
    np.add.at(scores, np.arange(1024) % 10, out)
    assert np.mean(scores.argmax(axis=0) == test.labels) >= 0.75
