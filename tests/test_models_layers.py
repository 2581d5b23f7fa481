"""Layers: forward against independent references, backward against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import signal

from models.layers import (BasicBlock, BatchNorm2d, Bottleneck, Conv2d, Flatten,
                           GlobalAvgPool2d, Linear, MaxPool2d, ReLU, Sequential,
                           SoftmaxCrossEntropy, softmax_cross_entropy)
from models.network import Model
from models.zoo import resnet


def wrap(layer, in_shape, seed=0):
    """A float64 Model around a bare layer (no output-shape check)."""
    return Model(layer, in_shape, None, dtype=np.float64, seed=seed, name="under_test")


def snapshot(model):
    return {k: v.copy() for k, v in model.buffers.items()}


def restore(model, snap):
    for k, v in snap.items():
        model.buffers[k][...] = v


def central_difference(vec, i, loss, eps):
    """``(loss(vec + eps e_i) - loss(vec - eps e_i)) / 2 eps``, restoring ``vec[i]``."""
    old = vec[i]
    vec[i] = old + eps
    lp = loss()
    vec[i] = old - eps
    lm = loss()
    vec[i] = old
    return (lp - lm) / (2 * eps)


def fd_check(model, x, *, training=True, n_param=40, n_input=40, seed=0, eps=1e-6, rtol=1e-6):
    """Compare analytic gradients of L = sum(R * f(x)) with central differences.

    Checks a random subset of parameter coordinates and of input coordinates.  BatchNorm
    running statistics are restored around every evaluation so the function is fixed.
    """
    rng = np.random.default_rng(seed)
    snap = snapshot(model)
    y = model.forward(x, training=training)
    R = rng.standard_normal(y.shape)
    dx = model.backward(R.copy())
    g = model.grads.flat.copy()
    restore(model, snap)

    def loss():
        val = float((R * model.forward(x, training=training)).sum())
        restore(model, snap)
        return val

    def central_differences(vec, grad, n):
        """(finite difference, analytic) pairs at ``n`` random coordinates of ``vec``."""
        return [(central_difference(vec, i, loss, eps), grad[i])
                for i in rng.choice(vec.size, min(n, vec.size), replace=False)]

    errs = central_differences(model.params.flat, g, n_param) if model.num_params else []
    errs += central_differences(x.reshape(-1), dx.reshape(-1), n_input)
    fd, an = np.array(errs).T
    scale = np.maximum(np.abs(fd).max(), 1e-3)
    np.testing.assert_allclose(an, fd, rtol=0, atol=rtol * scale * 10 + 1e-7)
    return fd, an


# --------------------------------------------------------------------------- forward references
def conv_reference(x, w, b, stride, padding):
    """Direct cross-correlation with scipy.signal.correlate (independent of im2col)."""
    sh, sw = stride
    ph, pw = padding
    xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    N, C_out = x.shape[0], w.shape[0]
    full = np.stack([
        np.stack([signal.correlate(xpad[n], w[o], mode="valid")[0] for o in range(C_out)])
        for n in range(N)])
    out = full[:, :, ::sh, ::sw]
    return out + (b[None, :, None, None] if b is not None else 0)


@pytest.mark.parametrize("k,stride,pad,bias", [
    (3, 1, 1, True), (3, 2, 1, False), (1, 2, 0, False), ((3, 2), (2, 1), (0, 1), True),
    (5, 1, 2, True),
])
def test_conv_forward_matches_scipy_correlate(k, stride, pad, bias):
    rng = np.random.default_rng(1)
    layer = Conv2d(3, 4, k, stride=stride, padding=pad, bias=bias)
    m = wrap(layer, (3, 7, 6))
    if bias:
        layer.P["bias"][...] = rng.standard_normal(4)
    x = rng.standard_normal((2, 3, 7, 6))
    y = m.forward(x)
    ref = conv_reference(x, layer.P["weight"], layer.P["bias"] if bias else None,
                         layer.stride, layer.padding)
    assert y.shape == ref.shape == (2, *layer.output_shape((3, 7, 6)))
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


def test_linear_forward_matches_definition():
    rng = np.random.default_rng(2)
    layer = Linear(5, 3)
    m = wrap(layer, (5,))
    layer.P["bias"][...] = rng.standard_normal(3)
    x = rng.standard_normal((4, 5))
    W, b = layer.P["weight"], layer.P["bias"]
    ref = np.array([[sum(W[o, i] * x[n, i] for i in range(5)) + b[o] for o in range(3)]
                    for n in range(4)])
    np.testing.assert_allclose(m.forward(x), ref, rtol=1e-12)


@pytest.mark.parametrize("k,stride", [(2, None), (3, 2), (2, 1)])
def test_maxpool_forward_matches_loops(k, stride):
    rng = np.random.default_rng(3)
    layer = MaxPool2d(k, stride)
    x = rng.standard_normal((2, 3, 7, 7))
    y = wrap(layer, (3, 7, 7)).forward(x)
    s = k if stride is None else stride
    Ho = (7 - k) // s + 1
    ref = np.empty((2, 3, Ho, Ho))
    for i in range(Ho):
        for j in range(Ho):
            ref[:, :, i, j] = x[:, :, i * s:i * s + k, j * s:j * s + k].max(axis=(2, 3))
    np.testing.assert_array_equal(y, ref)


def test_relu_gap_flatten_forward():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4, 5))
    np.testing.assert_array_equal(wrap(ReLU(), (3, 4, 5)).forward(x), np.where(x > 0, x, 0))
    np.testing.assert_allclose(wrap(GlobalAvgPool2d(), (3, 4, 5)).forward(x),
                               x.sum(axis=(2, 3)) / 20)
    np.testing.assert_array_equal(wrap(Flatten(), (3, 4, 5)).forward(x), x.reshape(2, 60))


# --------------------------------------------------------------------------- gradient checks
@pytest.mark.parametrize("make,in_shape", [
    (lambda: Linear(6, 4), (6,)),
    (lambda: Linear(6, 4, bias=False), (6,)),
    (lambda: Conv2d(2, 3, 3, padding=1), (2, 5, 5)),
    (lambda: Conv2d(2, 3, 3, stride=2, padding=1, bias=False), (2, 6, 5)),
    (lambda: Conv2d(2, 3, (2, 3), stride=(1, 2), padding=(1, 0)), (2, 5, 6)),
    (lambda: Conv2d(3, 2, 1, stride=2, bias=False), (3, 5, 5)),
    (lambda: ReLU(), (3, 4, 4)),
    (lambda: MaxPool2d(2), (2, 6, 6)),
    (lambda: MaxPool2d(3, 2), (2, 7, 7)),
    (lambda: MaxPool2d(2, 1), (2, 5, 5)),
    (lambda: GlobalAvgPool2d(), (3, 4, 5)),
    (lambda: Flatten(), (2, 3, 3)),
    (lambda: BasicBlock(3, 3, 1), (3, 5, 5)),
    (lambda: BasicBlock(2, 4, 2), (2, 6, 6)),
    (lambda: Bottleneck(4, 2, 2), (4, 6, 6)),
])
def test_layer_gradients_finite_differences(make, in_shape):
    rng = np.random.default_rng(5)
    m = wrap(make(), in_shape, seed=3)
    x = rng.standard_normal((3, *in_shape))
    fd_check(m, x)


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_gradients_finite_differences(training):
    rng = np.random.default_rng(6)
    layer = BatchNorm2d(3)
    m = wrap(layer, (3, 4, 4))
    layer.P["weight"][...] = rng.uniform(0.5, 2.0, 3)
    layer.P["bias"][...] = rng.standard_normal(3)
    layer.B["running_mean"][...] = rng.standard_normal(3)
    layer.B["running_var"][...] = rng.uniform(0.5, 2.0, 3)
    fd_check(m, rng.standard_normal((4, 3, 4, 4)) * 2 + 1, training=training)


def test_softmax_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((5, 4)) * 3
    labels = rng.integers(0, 4, 5)
    loss, grad = softmax_cross_entropy(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert loss == pytest.approx(-np.mean(np.log(p[np.arange(5), labels])), rel=1e-12)
    eps = 1e-6
    fd = np.zeros_like(logits)
    for idx in np.ndindex(*logits.shape):
        e = np.zeros_like(logits)
        e[idx] = eps
        fd[idx] = (softmax_cross_entropy(logits + e, labels)[0]
                   - softmax_cross_entropy(logits - e, labels)[0]) / (2 * eps)
    np.testing.assert_allclose(grad, fd, atol=1e-8)
    obj = SoftmaxCrossEntropy()
    assert obj.forward(logits, labels) == loss
    np.testing.assert_array_equal(obj.backward(), grad)
    # stable for huge logits
    big, _ = softmax_cross_entropy(np.array([[1e4, 0.0]]), np.array([1]))
    assert big == pytest.approx(1e4)


def test_whole_small_resnet_gradients():
    """Input and parameter gradients of a 2-stage ResNet (projection shortcut) through the loss."""
    rng = np.random.default_rng(8)
    m = resnet((3, 8, 8), 5, dtype=np.float64, depths=(1, 2), planes=(4, 6), seed=2)
    x = rng.standard_normal((4, 3, 8, 8))
    labels = rng.integers(0, 5, 4)
    snap = snapshot(m)
    logits = m.forward(x, training=True)
    _, dlogits = softmax_cross_entropy(logits, labels)
    dx = m.backward(dlogits)
    g = m.grads.flat.copy()
    restore(m, snap)

    def loss():
        val = softmax_cross_entropy(m.forward(x, training=True), labels)[0]
        restore(m, snap)
        return val

    eps = 1e-6
    theta = m.params.flat
    # a few coordinates from every tensor kind, plus random ones
    picks = [m.layout.offsets[n] for n in m.layout.names[::3]]
    picks += list(rng.choice(m.num_params, 30, replace=False))
    for i in picks:
        assert g[i] == pytest.approx(central_difference(theta, i, loss, eps), rel=1e-5,
                                     abs=1e-9), f"param coordinate {i}"
    xf = x.reshape(-1)
    for i in rng.choice(xf.size, 20, replace=False):
        assert dx.reshape(-1)[i] == pytest.approx(central_difference(xf, i, loss, eps),
                                                  rel=1e-5, abs=1e-9)


# --------------------------------------------------------------------------- BatchNorm semantics
def test_batchnorm_train_uses_batch_stats_and_updates_running_stats():
    rng = np.random.default_rng(9)
    layer = BatchNorm2d(2, momentum=0.3, eps=1e-5)
    m = wrap(layer, (2, 3, 3))
    gamma, beta = np.array([1.5, 0.5]), np.array([0.1, -0.2])
    layer.P["weight"][...] = gamma
    layer.P["bias"][...] = beta
    rm0, rv0 = np.array([0.2, -0.1]), np.array([1.3, 0.7])
    layer.B["running_mean"][...] = rm0
    layer.B["running_var"][...] = rv0
    x = rng.standard_normal((4, 2, 3, 3)) * 3 + 2
    y = m.forward(x, training=True)
    # reference: per channel, flatten everything but the channel
    xc = x.transpose(1, 0, 2, 3).reshape(2, -1)
    mu, var = xc.mean(axis=1), xc.var(axis=1)           # biased variance for normalization
    ref = ((x - mu[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5)
           * gamma[None, :, None, None] + beta[None, :, None, None])
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    M = xc.shape[1]
    np.testing.assert_allclose(layer.B["running_mean"], 0.7 * rm0 + 0.3 * mu, rtol=1e-12)
    np.testing.assert_allclose(layer.B["running_var"], 0.7 * rv0 + 0.3 * var * M / (M - 1),
                               rtol=1e-12)


def test_batchnorm_eval_uses_running_stats_and_leaves_them():
    rng = np.random.default_rng(10)
    layer = BatchNorm2d(2)
    m = wrap(layer, (2, 3, 3))
    rm, rv = np.array([0.5, -1.0]), np.array([2.0, 0.25])
    layer.B["running_mean"][...] = rm
    layer.B["running_var"][...] = rv
    x = rng.standard_normal((3, 2, 3, 3))
    y = m.forward(x, training=False)
    ref = (x - rm[None, :, None, None]) / np.sqrt(rv[None, :, None, None] + 1e-5)
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    np.testing.assert_array_equal(layer.B["running_mean"], rm)
    np.testing.assert_array_equal(layer.B["running_var"], rv)
    # a single-sample batch is fine in eval mode, but rejected in training mode
    layer.forward(x[:1, :, :1, :1], training=False)
    with pytest.raises(ValueError, match="more than one value"):
        layer.forward(x[:1, :, :1, :1], training=True)


# --------------------------------------------------------------------------- misc behaviour
def test_float32_is_default_and_preserved():
    m = resnet((1, 8, 8), 10, depths=(1,), planes=(4,))
    assert m.params.flat.dtype == np.float32 and m.grads.flat.dtype == np.float32
    x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
    logits = m.forward(x)
    assert logits.dtype == np.float32
    assert m.backward(np.ones_like(logits)).dtype == np.float32


def test_bad_arguments_raise_valueerror_with_fix():
    with pytest.raises(ValueError, match="too small"):
        Conv2d(1, 1, 5).output_shape((1, 3, 3))
    with pytest.raises(ValueError, match="expects input"):
        wrap(Conv2d(2, 1, 3), (2, 4, 4)).root.forward(np.zeros((1, 3, 4, 4)))
    with pytest.raises(ValueError, match="positive"):
        Linear(0, 3)
    with pytest.raises(ValueError, match="does not match num_classes"):
        Model(Sequential([Flatten(), Linear(4, 3)]), (4,), 5)
    with pytest.raises(ValueError, match="duplicate child"):
        Sequential([("a", ReLU()), ("a", ReLU())])


# --------------------------------------------------------------------------- im2col helpers
@pytest.mark.parametrize("stride,pad", [((1, 1), (1, 1)), ((2, 2), (1, 0)), ((1, 2), (0, 2))])
def test_im2col_col2im_are_adjoint(stride, pad):
    """<im2col(x), C> == <x, col2im(C)> for every path (the identity backward relies on)."""
    from models.layers import col2im, col2im_rows, im2col, im2col_rows
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 6, 7))
    if stride == (1, 1):
        cols, geom = im2col_rows(x, 3, 2, pad)
        C = rng.standard_normal(cols.shape)
        Hp, Wp, Ho, Wo = geom
        C.reshape(-1, 2, Ho, Wp)[..., Wo:] = 0.0          # discarded columns hold zeros
        back = col2im_rows(C, x.shape, 3, 2, pad, geom)
    else:
        cols, _ = im2col(x, 3, 2, stride, pad)
        C = rng.standard_normal(cols.shape)
        back = col2im(C, x.shape, 3, 2, stride, pad)
    assert back.shape == x.shape
    assert float((cols * C).sum()) == pytest.approx(float((x * back).sum()), rel=1e-12)


def test_conv_workspace_reuse_across_batch_sizes():
    """Scratch buffers are reused between calls; changing the batch size stays correct."""
    rng = np.random.default_rng(12)
    for stride in (1, 2):
        layer = Conv2d(2, 3, 3, stride=stride, padding=1)
        m = wrap(layer, (2, 6, 6))
        fresh = wrap(Conv2d(2, 3, 3, stride=stride, padding=1), (2, 6, 6))
        fresh.params.flat[...] = m.params.flat
        for n in (4, 2, 4, 3):
            x = rng.standard_normal((n, 2, 6, 6))
            y = m.forward(x)
            dy = rng.standard_normal(y.shape)
            dx = m.backward(dy)
            fresh.root._ws.clear()
            np.testing.assert_allclose(y, fresh.forward(x), rtol=1e-12)
            np.testing.assert_allclose(dx, fresh.backward(dy), rtol=1e-12)
            np.testing.assert_allclose(m.grads.flat, fresh.grads.flat, rtol=1e-12)
            ref = conv_reference(x, layer.P["weight"], layer.P["bias"], layer.stride,
                                 layer.padding)
            np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
