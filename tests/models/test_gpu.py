"""CuPy path: the same layers and optimizer on the GPU agree with NumPy (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from substrate.backend import cupy_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cupy_available(), reason="no CUDA device visible")]

from models.optim import SGD, MaskHook, ProximalHook, SGDConfig
from models.zoo import cnn, resnet


def small_resnet(shape, k, **kw):
    return resnet(shape, k, depths=(1, 1), planes=(4, 8), **kw)


@pytest.mark.parametrize("factory", [cnn, small_resnet])
def test_gpu_forward_backward_step_match_cpu(factory):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1, 8, 8))
    y = rng.integers(0, 10, 8)
    cpu = factory((1, 8, 8), 10, dtype=np.float64, seed=1)
    gpu = factory((1, 8, 8), 10, dtype=np.float64, seed=1, xp=cp)
    assert isinstance(gpu.params.flat, cp.ndarray)
    l_cpu, _ = cpu.loss_and_grad(x, y)
    l_gpu, _ = gpu.loss_and_grad(cp.asarray(x), cp.asarray(y))
    assert l_gpu == pytest.approx(l_cpu, rel=1e-10)
    np.testing.assert_allclose(cp.asnumpy(gpu.grads.flat), cpu.grads.flat, rtol=1e-8, atol=1e-12)
    mask = rng.random(cpu.num_params) < 0.7
    for m, xp in ((cpu, np), (gpu, cp)):
        prox = ProximalHook(m.layout, 0.01, dtype=np.float64, xp=xp)
        prox.set_center(xp.zeros(m.num_params))
        SGD(m.params, m.grads, SGDConfig(lr=0.1, weight_decay=1e-3),
            hooks=[prox, MaskHook(xp.asarray(mask))]).step()
    np.testing.assert_allclose(cp.asnumpy(gpu.params.flat), cpu.params.flat, rtol=1e-10)
    for name, buf in cpu.buffers.items():                  # BatchNorm running statistics
        np.testing.assert_allclose(cp.asnumpy(gpu.buffers[name]), buf, rtol=1e-10)
    sd = gpu.state_dict()
    assert all(isinstance(v, np.ndarray) for v in sd.values())


def test_gpu_data_pipeline_and_conv_strided():
    from models.data import iterate_batches, make_synthetic, shard
    from models.layers import Conv2d
    from models.network import Model

    train = make_synthetic(n_train=40, n_test=8).train
    dev = shard(train, 1, 2).to(cp)
    batches = list(iterate_batches(dev, 8, seed=3, epoch=1))
    host = list(iterate_batches(shard(train, 1, 2), 8, seed=3, epoch=1))
    for (xg, yg), (xh, yh) in zip(batches, host):
        assert isinstance(xg, cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(xg), xh)
        np.testing.assert_array_equal(cp.asnumpy(yg), yh)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 7, 7))
    cpu = Model(Conv2d(2, 3, 3, stride=2, padding=1), (2, 7, 7), None, dtype=np.float64)
    gpu = Model(Conv2d(2, 3, 3, stride=2, padding=1), (2, 7, 7), None, dtype=np.float64, xp=cp)
    gpu.params.flat[...] = cp.asarray(cpu.params.flat)
    y = cpu.forward(x)
    np.testing.assert_allclose(cp.asnumpy(gpu.forward(cp.asarray(x))), y, rtol=1e-12)
    dy = rng.standard_normal(y.shape)
    np.testing.assert_allclose(cp.asnumpy(gpu.backward(cp.asarray(dy))), cpu.backward(dy),
                               rtol=1e-12)
