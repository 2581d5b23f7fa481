"""CuPy path: the same layers and optimizer on the GPU agree with NumPy (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from substrate.backend import cupy_available  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cupy_available(), reason="no CUDA device visible")]

from models.optim import SGD, MaskHook, ProximalHook, SGDConfig  # noqa: E402
from models.zoo import cnn, resnet  # noqa: E402


@pytest.mark.parametrize("factory", [cnn, lambda s, k, **kw: resnet(s, k, depths=(1, 1),
                                                                      planes=(4, 8), **kw)])
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
    np.testing.assert_allclose(cp.asnumpy(gpu.buffers["bn1.running_mean"]) if "bn1.running_mean"
                               in gpu.buffers else 0, cpu.buffers.get("bn1.running_mean", 0))
    sd = gpu.state_dict()
    assert all(isinstance(v, np.ndarray) for v in sd.values())
