"""SGD on flat buffers against a hand-written per-tensor reference; schedules; hooks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from models.optim import (
    SGD,
    AdamW,
    AdamWConfig,
    ConstantLR,
    CosineLR,
    MaskHook,
    ProximalHook,
    SGDConfig,
    StepLR,
    make_optimizer,
    make_schedule,
)
from models.params import FlatTensors, ParamLayout, ParamSpec

LAYOUT = ParamLayout([
    ParamSpec("conv.weight", "conv", (3, 2, 2, 2)),
    ParamSpec("bn.weight", "bn", (3,)),
    ParamSpec("bn.bias", "bn", (3,)),
    ParamSpec("fc.weight", "fc", (4, 3)),
    ParamSpec("fc.bias", "bias", (4,)),
])


def make_buffers(seed=0):
    rng = np.random.default_rng(seed)
    params = FlatTensors(LAYOUT, rng.standard_normal(LAYOUT.total), dtype=np.float64)
    grads = FlatTensors(LAYOUT, np.zeros(LAYOUT.total), dtype=np.float64)
    return params, grads


def reference_run(theta0: dict, grad_seq, *, lr_fn, mu, nesterov, wd, decay_kinds=None,
                  rho=None, center=None, mask=None):
    """PyTorch-style SGD written tensor by tensor with plain NumPy (the independent reference)."""
    theta = {n: v.copy() for n, v in theta0.items()}
    buf = {n: None for n in theta}
    for t, grads in enumerate(grad_seq):
        lr = lr_fn(t)
        for n in theta:  # noqa: PLC0206 (grads is another dict, indexed by theta's names)
            d = grads[n].copy()
            if decay_kinds is None or LAYOUT.kind(n) in decay_kinds:
                d = d + wd * theta[n]
            if rho is not None:
                d = d + rho[n] * (theta[n] - center[n])
            if mask is not None:
                d = d * mask[n]
            if mu > 0:
                buf[n] = d.copy() if buf[n] is None else mu * buf[n] + d
                if mask is not None:
                    buf[n] = buf[n] * mask[n]
                d = d + mu * buf[n] if nesterov else buf[n]
            theta[n] = theta[n] - lr * d
    return theta


def grad_sequence(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [{n: rng.standard_normal(LAYOUT.shape(n)) for n in LAYOUT.names} for _ in range(steps)]


def run_flat(opt, grads, seq):
    for g in seq:
        for n, v in g.items():
            grads[n][...] = v
        opt.step()


@pytest.mark.parametrize("mu,nesterov,wd,decay_kinds", [
    (0.0, False, 0.0, None),
    (0.9, False, 0.0, None),
    (0.9, True, 0.0, None),
    (0.9, False, 1e-2, None),
    (0.8, True, 5e-2, ("conv", "fc")),
])
def test_sgd_matches_reference(mu, nesterov, wd, decay_kinds):
    params, grads = make_buffers()
    theta0 = {n: v.copy() for n, v in params.items()}
    seq = grad_sequence(6)
    sched = StepLR(0.1, step_size=2, gamma=0.5)
    opt = SGD(params, grads, SGDConfig(lr=0.1, momentum=mu, nesterov=nesterov, weight_decay=wd,
                                       decay_kinds=decay_kinds), schedule=sched)
    run_flat(opt, grads, seq)
    ref = reference_run(theta0, seq, lr_fn=sched, mu=mu, nesterov=nesterov, wd=wd,
                        decay_kinds=decay_kinds)
    for n in LAYOUT.names:
        np.testing.assert_allclose(params[n], ref[n], rtol=1e-12, atol=1e-14)
    assert opt.step_count == 6


@pytest.mark.parametrize("mu,nesterov,wd,decay_kinds,hooks", [
    (0.9, False, 1e-2, None, False),
    (0.8, True, 5e-2, ("conv", "fc"), False),
    (0.0, False, 5e-2, ("conv", "fc"), False),
    (0.9, True, 1e-2, ("conv", "bn"), True),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_sgd_blocked_threaded_step_gives_the_reference_bits(monkeypatch, mu, nesterov, wd,
                                                            decay_kinds, hooks, threads):
    """The step in blocks (7 elements, so blocks split tensors and the last one is short) shared
    over 1 or 2 threads gives exactly the tensor-by-tensor reference (same element-wise
    operations), with and without hooks between the two halves of the pass."""
    from models import layers as L
    from models import optim
    k = L._kernels()
    if k is None:
        pytest.skip("Numba not installed")
    import numba
    monkeypatch.setattr(optim, "STEP_BLOCK", 7)
    monkeypatch.setattr("models.kernels_threads.MIN_PARALLEL", 0)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        params, grads = make_buffers(seed=5)
        theta0 = {n: v.copy() for n, v in params.items()}
        seq = grad_sequence(5, seed=6)
        rng = np.random.default_rng(7)
        rho = {n: float(r) for n, r in zip(LAYOUT.names, rng.uniform(0.1, 1.0, len(LAYOUT)))}
        center = {n: rng.standard_normal(LAYOUT.shape(n)) for n in LAYOUT.names}
        mask = {n: (rng.random(LAYOUT.shape(n)) < 0.7).astype(np.float64) for n in LAYOUT.names}
        hook_list = ()
        if hooks:
            prox = ProximalHook(LAYOUT, rho, dtype=np.float64)
            prox.set_center(np.concatenate([center[n].ravel() for n in LAYOUT.names]))
            hook_list = (prox, MaskHook(np.concatenate([mask[n].ravel() for n in LAYOUT.names])))
        sched = StepLR(0.1, step_size=2, gamma=0.5)
        opt = SGD(params, grads, SGDConfig(lr=0.1, momentum=mu, nesterov=nesterov,
                                           weight_decay=wd, decay_kinds=decay_kinds),
                  schedule=sched, hooks=hook_list)
        run_flat(opt, grads, seq)
    finally:
        numba.set_num_threads(before)
    ref = reference_run(theta0, seq, lr_fn=sched, mu=mu, nesterov=nesterov, wd=wd,
                        decay_kinds=decay_kinds, **({"rho": rho, "center": center, "mask": mask}
                                                    if hooks else {}))
    for n in LAYOUT.names:
        np.testing.assert_array_equal(params[n], ref[n])


def test_step_does_not_modify_gradients():
    params, grads = make_buffers()
    grads.flat[...] = 1.0
    SGD(params, grads, SGDConfig(lr=0.1, weight_decay=0.1)).step()
    assert np.all(grads.flat == 1.0)


def test_proximal_hook_per_tensor_rho_matches_reference():
    params, grads = make_buffers()
    theta0 = {n: v.copy() for n, v in params.items()}
    rng = np.random.default_rng(3)
    z = rng.standard_normal(LAYOUT.total)
    u = rng.standard_normal(LAYOUT.total)
    rho = {n: 0.1 * (i + 1) for i, n in enumerate(LAYOUT.names)}
    hook = ProximalHook(LAYOUT, rho, dtype=np.float64)
    hook.set_center(z, u)
    opt = SGD(params, grads, SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3), hooks=[hook])
    seq = grad_sequence(4)
    run_flat(opt, grads, seq)
    c = FlatTensors(LAYOUT, z - u)
    ref = reference_run(theta0, seq, lr_fn=lambda t: 0.05, mu=0.9, nesterov=False, wd=1e-3,
                        rho=rho, center={n: c[n] for n in LAYOUT.names})
    for n in LAYOUT.names:
        np.testing.assert_allclose(params[n], ref[n], rtol=1e-12, atol=1e-14)
    # other ways to give rho agree: per-tensor list in layout order, flat vector
    for alt in ([rho[n] for n in LAYOUT.names], LAYOUT.expand(rho)):
        hook.set_rho(alt)
        np.testing.assert_array_equal(hook.rho, LAYOUT.expand(rho))


def test_proximal_hook_inactive_until_center_set():
    """Before set_center the hook adds nothing, though theta != 0 (an active hook anchored at
    its zero-initialised centre would add rho * theta); once set it adds rho ⊙ (theta - z + u)
    per tensor (eq. 8), computed here tensor by tensor, and theta == z - u cancels it."""
    params, _grads = make_buffers()
    assert np.all(params.flat != 0)
    rho = {n: 0.5 + i for i, n in enumerate(LAYOUT.names)}
    hook = ProximalHook(LAYOUT, rho, dtype=np.float64)

    class Opt:
        pass
    opt = Opt()
    opt.params = params
    d = np.full(LAYOUT.total, 0.25)
    hook(d, opt)
    assert np.all(d == 0.25)
    rng = np.random.default_rng(8)
    z, u = rng.standard_normal(LAYOUT.total), rng.standard_normal(LAYOUT.total)
    hook.set_center(z, u)
    hook(d, opt)
    zs, us = FlatTensors(LAYOUT, z, dtype=np.float64), FlatTensors(LAYOUT, u, dtype=np.float64)
    got = FlatTensors(LAYOUT, d, dtype=np.float64)
    for n in LAYOUT.names:
        want = 0.25 + rho[n] * (params[n] - zs[n] + us[n])
        np.testing.assert_allclose(got[n], want, rtol=1e-14, atol=1e-14, err_msg=n)
    hook.set_center(params.flat.copy())          # theta == z: the term vanishes
    d[...] = 0.0
    hook(d, opt)
    assert np.all(d == 0)


def test_mask_hook_matches_reference_and_freezes_masked_weights():
    params, grads = make_buffers()
    rng = np.random.default_rng(4)
    mask_flat = rng.random(LAYOUT.total) < 0.5
    params.flat[~mask_flat] = 0.0                # pruned weights
    theta0 = {n: v.copy() for n, v in params.items()}
    opt = SGD(params, grads, SGDConfig(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
              hooks=[MaskHook(mask_flat)])
    seq = grad_sequence(5)
    run_flat(opt, grads, seq)
    m = FlatTensors(LAYOUT, mask_flat.astype(np.float64))
    ref = reference_run(theta0, seq, lr_fn=lambda t: 0.1, mu=0.9, nesterov=True, wd=1e-2,
                        mask={n: m[n] for n in LAYOUT.names})
    for n in LAYOUT.names:
        np.testing.assert_allclose(params[n], ref[n], rtol=1e-12, atol=1e-14)
    assert np.all(params.flat[~mask_flat] == 0.0)


def test_mask_then_momentum_state_is_masked():
    params, grads = make_buffers()
    opt = SGD(params, grads, SGDConfig(lr=0.1, momentum=0.9))
    grads.flat[...] = 1.0
    opt.step()                                   # momentum everywhere
    mask = np.zeros(LAYOUT.total, dtype=bool)
    mask[:5] = True
    frozen = params.flat[5:].copy()
    opt.add_hook(MaskHook(mask))
    opt.step()
    np.testing.assert_array_equal(params.flat[5:], frozen)
    assert np.all(opt.momentum_buffer[5:] == 0)


def test_optimizer_state_dict_round_trip():
    params, grads = make_buffers()
    seq = grad_sequence(4)
    opt = SGD(params, grads, SGDConfig(lr=0.1, momentum=0.9))
    run_flat(opt, grads, seq[:2])
    state, theta_mid = opt.state_dict(), params.flat.copy()
    run_flat(opt, grads, seq[2:])
    expected = params.flat.copy()
    params.flat[...] = theta_mid
    opt2 = SGD(params, grads, SGDConfig(lr=0.1, momentum=0.9))
    opt2.load_state_dict(state)
    run_flat(opt2, grads, seq[2:])
    np.testing.assert_array_equal(params.flat, expected)


def test_schedules_follow_their_formulas():
    c = ConstantLR(0.3)
    assert [c(t) for t in (0, 10, 1000)] == [0.3, 0.3, 0.3]
    s = StepLR(1.0, step_size=3, gamma=0.1)
    assert [s(t) for t in range(7)] == pytest.approx([1, 1, 1, 0.1, 0.1, 0.1, 0.01])
    cos = CosineLR(1.0, total_steps=10, min_lr=0.1, warmup_steps=2)
    assert cos(0) == pytest.approx(0.5) and cos(1) == pytest.approx(1.0)
    for t in range(2, 10):
        assert cos(t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 2) / 8)))
    assert cos(10) == 0.1 and cos(50) == 0.1
    assert make_schedule("step", 0.1, 30) == StepLR(0.1, 10, 0.1)
    assert make_schedule("cosine", 0.1, 30) == CosineLR(0.1, 30)
    with pytest.raises(ValueError, match="valid names"):
        make_schedule("linear", 0.1, 10)


def test_bad_configs_raise_with_fix():
    with pytest.raises(ValueError, match="nesterov"):
        SGDConfig(momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="lr"):
        SGDConfig(lr=0.0)
    with pytest.raises(ValueError, match="decay_kinds"):
        SGDConfig(decay_kinds=("weights",))
    with pytest.raises(ValueError, match="per-tensor"):
        ProximalHook(LAYOUT, np.ones(3))
    params, grads = make_buffers()
    opt = SGD(params, grads, hooks=[MaskHook(np.ones(LAYOUT.total + 1, dtype=bool))])
    with pytest.raises(ValueError, match="model.layout"):
        opt.step()


# --------------------------------------------------------------------------------------- AdamW
def test_adamw_single_scalar_step_by_hand():
    """θ0 = 1, g = 0.5, η = 0.1, λ = 0.1: m̂ = 0.5, v̂ = 0.25, so
    θ1 = 1 − η λ θ0 − η m̂ / (sqrt(v̂) + ε) = 1 − 0.01 − 0.1 · 0.5 / 0.50000001."""
    layout = ParamLayout([ParamSpec("w", "fc", (1,))])
    params = FlatTensors(layout, np.array([1.0]), dtype=np.float64)
    grads = FlatTensors(layout, np.array([0.5]), dtype=np.float64)
    opt = AdamW(params, grads, AdamWConfig(lr=0.1, weight_decay=0.1))
    assert opt.step() == 0.1
    assert params.flat[0] == pytest.approx(1 - 0.01 - 0.1 * 0.5 / 0.50000001, rel=1e-15)
    # second step, same gradient: m = 0.095, v = 0.00049975; bias corrections 0.19, 0.001999
    theta1 = params.flat[0]
    opt.step()
    m_hat, v_hat = 0.095 / 0.19, 0.00049975 / 0.001999
    expected = theta1 - 0.1 * 0.1 * theta1 - 0.1 * m_hat / (math.sqrt(v_hat) + 1e-8)
    assert params.flat[0] == pytest.approx(expected, rel=1e-14)


def adamw_reference(theta0, grad_seq, *, lr_fn, b1, b2, eps, wd, decay_kinds):
    """Loshchilov & Hutter, Algorithm 2, scalar by scalar per tensor (plain Python floats)."""
    theta = {n: [float(v) for v in t.ravel()] for n, t in theta0.items()}
    m = {n: [0.0] * len(v) for n, v in theta.items()}
    v2 = {n: [0.0] * len(v) for n, v in theta.items()}
    for t, grads in enumerate(grad_seq, start=1):
        lr = lr_fn(t - 1)
        for n in theta:  # noqa: PLC0206 (grads is another dict, indexed by theta's names)
            lam = wd if (decay_kinds is None or LAYOUT.kind(n) in decay_kinds) else 0.0
            for i, g in enumerate(grads[n].ravel()):
                m[n][i] = b1 * m[n][i] + (1 - b1) * g
                v2[n][i] = b2 * v2[n][i] + (1 - b2) * g * g
                mh, vh = m[n][i] / (1 - b1 ** t), v2[n][i] / (1 - b2 ** t)
                theta[n][i] -= lr * lam * theta[n][i]
                theta[n][i] -= lr * mh / (math.sqrt(vh) + eps)
    return {n: np.array(v).reshape(theta0[n].shape) for n, v in theta.items()}


@pytest.mark.parametrize("decay_kinds", [None, ("conv", "fc")])
def test_adamw_matches_scalar_reference_with_schedule(decay_kinds):
    params, grads = make_buffers()
    theta0 = {n: params[n].copy() for n in LAYOUT.names}
    seq = grad_sequence(5)
    sched = CosineLR(0.05, 5, min_lr=0.001, warmup_steps=2, warmup_start=0.1)
    opt = AdamW(params, grads, AdamWConfig(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6,
                                           weight_decay=0.2, decay_kinds=decay_kinds),
                schedule=sched)
    run_flat(opt, grads, seq)
    ref = adamw_reference(theta0, seq, lr_fn=sched, b1=0.8, b2=0.99, eps=1e-6, wd=0.2,
                          decay_kinds=decay_kinds)
    for n in LAYOUT.names:
        np.testing.assert_allclose(params[n], ref[n], rtol=1e-12, atol=1e-14, err_msg=n)
    assert opt.step_count == 5


def test_adamw_mask_hook_freezes_masked_weights_and_state_round_trips():
    params, grads = make_buffers()
    mask = np.ones(LAYOUT.total)
    mask[LAYOUT.slice("fc.weight")] = 0
    opt = AdamW(params, grads, AdamWConfig(lr=0.01, weight_decay=0.0), hooks=[MaskHook(mask)])
    frozen = params["fc.weight"].copy()
    run_flat(opt, grads, grad_sequence(3))
    np.testing.assert_array_equal(params["fc.weight"], frozen)
    assert not np.allclose(params["conv.weight"], make_buffers()[0]["conv.weight"])
    state = opt.state_dict()
    p2, g2 = make_buffers()
    p2.flat[...] = params.flat
    opt2 = AdamW(p2, g2, AdamWConfig(lr=0.01, weight_decay=0.0))
    opt2.load_state_dict(state)
    seq = grad_sequence(2, seed=5)
    opt.hooks.clear()
    run_flat(opt, grads, seq)
    run_flat(opt2, g2, seq)
    np.testing.assert_array_equal(params.flat, p2.flat)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt2.load_state_dict({"step_count": 1, "momentum_buffer": state["momentum_buffer"]})


def test_warmup_start_and_make_optimizer():
    s = CosineLR(1.0, 100, warmup_steps=10, warmup_start=0.1)
    assert s(0) == pytest.approx(0.1 + 0.9 * 1 / 10)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    # warmup_start = 0 keeps the old linear warm-up
    assert CosineLR(1.0, 100, warmup_steps=10)(4) == pytest.approx(0.5)
    params, grads = make_buffers()
    assert isinstance(make_optimizer("adamw", params, grads, lr=0.1), AdamW)
    assert isinstance(make_optimizer("sgd", params, grads, lr=0.1), SGD)
    with pytest.raises(ValueError, match="valid names"):
        make_optimizer("lamb", params, grads, lr=0.1)
    with pytest.raises(ValueError, match="beta2"):
        AdamWConfig(beta2=1.0)
    with pytest.raises(ValueError, match="warmup_start"):
        CosineLR(1.0, 10, warmup_start=1.0)


@pytest.mark.parametrize("mu,nesterov,wd,per_element", [
    # the update written out: d = g (1); d += wd θ (2); b = μ b + d (2); d += μ b (2); θ -= lr d (2)
    (0.0, False, 0.0, 1 + 2),
    (0.9, False, 0.0, 1 + 2 + 2),
    (0.9, True, 1e-2, 1 + 2 + 2 + 2 + 2),
])
def test_sgd_flops_count_the_update_per_element(mu, nesterov, wd, per_element):
    params, grads = make_buffers()
    opt = SGD(params, grads, SGDConfig(lr=0.1, momentum=mu, nesterov=nesterov, weight_decay=wd))
    assert opt.flops() == per_element * params.flat.size


def test_adamw_flops_count_the_update_per_element():
    # AdamW (Loshchilov & Hutter, Alg. 2): copy g (1); m = β1 m + (1-β1) g (3);
    # v = β2 v + (1-β2) g² (4); θ -= lr λ θ (3); θ -= lr m̂ / (√v̂ + ε) (6)
    params, grads = make_buffers()
    assert AdamW(params, grads, AdamWConfig(weight_decay=0.0)).flops() == 14 * params.flat.size
    assert AdamW(params, grads, AdamWConfig(weight_decay=0.1)).flops() == 17 * params.flat.size


@pytest.mark.parametrize("wd,decay_kinds,hooks", [(0.0, None, False), (0.1, None, False),
                                                  (0.2, ("conv", "fc"), False),
                                                  (0.2, ("conv", "fc"), True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_adamw_fused_kernel_gives_the_array_path_bits(monkeypatch, wd, decay_kinds, hooks,
                                                      threads):
    """float32: the fused Numba step (blocks of 7 elements, so blocks split tensors, shared
    over 1 or 2 threads) gives exactly the array path's bits over a scheduled run, with the
    decay scalar, per kind or absent, with and without a mask hook; both also follow the
    scalar reference (Algorithm 2) to float32 round-off."""
    from models import layers as L
    from models import optim
    k = L._kernels()
    if k is None:
        pytest.skip("Numba not installed")
    import numba
    monkeypatch.setattr(optim, "STEP_BLOCK", 7)
    monkeypatch.setattr("models.kernels_threads.MIN_PARALLEL", 0)
    seq = [{n: g.astype(np.float32) for n, g in step.items()} for step in grad_sequence(4)]
    sched = CosineLR(0.05, 4, warmup_steps=1)
    mask = (np.random.default_rng(3).random(LAYOUT.total) < 0.7).astype(np.float32)

    def run(kernels: bool):
        params = FlatTensors(LAYOUT, make_buffers()[0].flat, dtype=np.float32)
        grads = FlatTensors(LAYOUT, np.zeros(LAYOUT.total), dtype=np.float32)
        opt = AdamW(params, grads, AdamWConfig(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6,
                                               weight_decay=wd, decay_kinds=decay_kinds),
                    schedule=sched, hooks=[MaskHook(mask)] if hooks else ())
        with monkeypatch.context() as m:
            if not kernels:
                m.setattr(optim, "_numba_kernels", lambda xp: None)
            run_flat(opt, grads, seq)
        return params.flat.copy(), opt.momentum_buffer.copy(), opt.exp_avg_sq.copy()

    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        fused = run(True)
    finally:
        numba.set_num_threads(before)
    array = run(False)
    for got, want in zip(fused, array):
        np.testing.assert_array_equal(got, want)
    if not hooks:
        theta0 = {n: make_buffers()[0][n].astype(np.float32) for n in LAYOUT.names}
        ref = adamw_reference(theta0, seq, lr_fn=sched, b1=0.8, b2=0.99, eps=1e-6, wd=wd,
                              decay_kinds=decay_kinds)
        flat = np.concatenate([ref[n].ravel() for n in LAYOUT.names])
        np.testing.assert_allclose(fused[0], flat, rtol=2e-5, atol=1e-6)
