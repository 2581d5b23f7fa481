"""Layers: forward against independent references, backward against finite differences."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gradcheck import central_difference
from scipy import signal

from models.layers import (
    BasicBlock,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    Flatten,
    GlobalAvgPool2d,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
    SoftmaxCrossEntropy,
    softmax_cross_entropy,
)
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
    (lambda: Conv2d(3, 4, 1), (3, 4, 5)),                      # 1x1 stride 1: no im2col
    (lambda: Conv2d(2, 5, 3, padding=1), (2, 5, 4)),           # C_out > 2 C_in: col2im path
    (lambda: Conv2d(2, 3, 1, padding=1, bias=False), (2, 4, 4)),   # padding >= kernel: col2im
    (lambda: Conv2d(3, 3, (3, 2), padding=(2, 1)), (3, 5, 6)),  # full correlation, pad = k-1
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


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_softmax_cross_entropy_matches_definition(monkeypatch, threads):
    """The fused Numba pass (blocks of 7 rows, shared over 1 or 2 threads; huge and tiny
    logits) gives the float64 definition's loss and gradient to float32 round-off, and in
    float64 to 1e-12; the array path agrees; the loss does not depend on the thread count."""
    from models import layers as L
    k = L._kernels()
    if k is None:
        pytest.skip("Numba not installed")
    import numba
    monkeypatch.setattr("models.kernels_transformer.CE_ROWS", 7)
    monkeypatch.setattr("models.kernels_threads.MIN_PARALLEL", 0)
    monkeypatch.setattr(L, "CE_MIN_KERNEL", 0)
    rng = np.random.default_rng(41)
    X = rng.standard_normal((50, 13)) * 4
    X[3] += 1e4
    X[4] -= 80
    y = rng.integers(0, 13, 50)

    def reference(Z):
        sh = Z - Z.max(axis=1, keepdims=True)
        e = np.exp(sh)
        grad = e / e.sum(axis=1, keepdims=True)
        grad[np.arange(50), y] -= 1
        return float(np.mean(np.log(e.sum(axis=1)) - sh[np.arange(50), y])), grad / 50

    ref_loss, ref_grad = reference(X)
    ref_loss32, ref_grad32 = reference(X.astype(np.float32).astype(np.float64))
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        results = {dt: softmax_cross_entropy(X.astype(dt), y) for dt in (np.float64, np.float32)}
    finally:
        numba.set_num_threads(before)
    loss64, grad64 = results[np.float64]
    assert loss64 == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad64, ref_grad, rtol=1e-12, atol=1e-15)
    loss32, grad32 = results[np.float32]
    assert grad32.dtype == np.float32
    assert loss32 == pytest.approx(ref_loss32, rel=1e-6)
    np.testing.assert_allclose(grad32, ref_grad32, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(L, "_numba_kernels", lambda xp: None)
    loss_a, grad_a = softmax_cross_entropy(X.astype(np.float32), y)
    assert loss_a == pytest.approx(loss32, rel=1e-6)
    np.testing.assert_allclose(grad_a, grad32, rtol=1e-5, atol=1e-7)


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


@pytest.mark.parametrize("blocked", [False, True])
def test_training_step_skips_the_first_convs_input_gradient(monkeypatch, blocked):
    """loss_and_grad leaves out the stem conv's input gradient (the data has none): the same
    parameter gradients as a backward that computes it, the stem's backward returns ``None``
    only inside loss_and_grad, and a plain ``backward`` still returns the input gradient."""
    from models import conv as C
    if blocked:
        monkeypatch.setattr(C, "BLOCK_ROWS", 1)
        monkeypatch.setattr(C, "BLOCK_MIN_BLOCKS", 2)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 3, 8, 8))
    labels = rng.integers(0, 5, 4)

    def model():
        return resnet((3, 8, 8), 5, dtype=np.float64, depths=(1,), planes=(4,), seed=3)

    full = model()
    logits = full.forward(x, training=True)
    dx = full.backward(softmax_cross_entropy(logits, labels)[1])
    assert dx.shape == x.shape
    skip = model()
    stem = skip.root.children()[0][1]
    assert isinstance(stem, Conv2d) and skip._input_layer() is stem
    returned = []
    original = Conv2d.backward

    def spy(self, dy):
        out = original(self, dy)
        if self is stem:
            returned.append(out)
        return out

    monkeypatch.setattr(Conv2d, "backward", spy)
    skip.loss_and_grad(x, labels)
    assert returned == [None] and stem.input_grad
    np.testing.assert_array_equal(skip.grads.flat, full.grads.flat)
    assert skip.backward(softmax_cross_entropy(skip.forward(x), labels)[1]).shape == x.shape


def test_input_gradient_skip_is_opt_in_for_conv_subclasses():
    """A Conv2d subclass that post-processes backward's result (H-SADMM's compact conv) is not
    asked to skip the input gradient unless it says so; Conv2d itself is."""
    class Scaled(Conv2d):
        def backward(self, dy):
            return 2 * super().backward(dy)

    for cls, skipped in ((Conv2d, True), (Scaled, False)):
        root = Sequential([("conv", cls(3, 4, 3, padding=1)), ("flat", Flatten())])
        m = Model(root, (3, 4, 4), None, dtype=np.float64)
        assert (m._input_layer() is root.children()[0][1]) == skipped
        y = m.forward(np.ones((2, 3, 4, 4)))
        m.backward(np.ones_like(y), input_grad=False)          # no error either way


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
    from models.im2col import col2im, col2im_rows, im2col, im2col_rows
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 6, 7))
    if stride == (1, 1):
        cols, geom = im2col_rows(x, 3, 2, pad)
        C = rng.standard_normal(cols.shape)
        _Hp, Wp, Ho, Wo = geom
        C.reshape(-1, 2, Ho, Wp)[..., Wo:] = 0.0          # discarded columns hold zeros
        back = col2im_rows(C, x.shape, 3, 2, pad, geom)
    else:
        cols, _ = im2col(x, 3, 2, stride, pad)
        C = rng.standard_normal(cols.shape)
        back = col2im(C, x.shape, 3, 2, stride, pad)
    assert back.shape == x.shape
    assert float((cols * C).sum()) == pytest.approx(float((x * back).sum()), rel=1e-12)


def test_im2col_module_names_are_still_importable_from_layers():
    """im2col/col2im live in :mod:`models.im2col`; :mod:`models.layers` re-exports them (the
    same objects), so existing imports keep working."""
    from models import im2col as I
    from models import layers as L
    for name in I.__all__:
        if name != "transient":
            assert getattr(L, name) is getattr(I, name), name


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


# --------------------------------------------------------------------------- channels-last kernels
def im2col_nhwc_loops(x, kh, kw, stride, padding):
    """Definition by loops: row (n, ho, wo), column (i, j, c) = xpad[n, c, ho*sh+i, wo*sw+j]."""
    (sh, sw), (ph, pw) = stride, padding
    N, C, H, W = x.shape
    xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    Ho, Wo = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    out = np.zeros((N, Ho, Wo, kh, kw, C))
    for n, ho, wo, i, j, c in np.ndindex(N, Ho, Wo, kh, kw, C):
        out[n, ho, wo, i, j, c] = xpad[n, c, ho * sh + i, wo * sw + j]
    return out.reshape(N * Ho * Wo, kh * kw * C)


@pytest.mark.parametrize("k,stride,pad", [((3, 3), (1, 1), (1, 1)), ((3, 2), (2, 1), (0, 2)),
                                          ((1, 1), (2, 2), (0, 0)), ((2, 3), (1, 2), (1, 0))])
def test_im2col_nhwc_matches_definition_and_col2im_is_its_adjoint(k, stride, pad):
    from models.im2col import col2im_nhwc, im2col_nhwc
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 3, 6, 7))
    ref = im2col_nhwc_loops(x, *k, stride, pad)
    # channels-last input given as a transposed view of NCHW memory and as NHWC memory
    for xl in (x.transpose(0, 2, 3, 1), np.ascontiguousarray(x.transpose(0, 2, 3, 1))):
        np.testing.assert_array_equal(im2col_nhwc(xl, *k, stride, pad), ref)
    D = rng.standard_normal(ref.shape)
    back = col2im_nhwc(D, (2, 6, 7, 3), *k, stride, pad)
    assert back.shape == (2, 6, 7, 3)
    assert float((ref * D).sum()) == pytest.approx(
        float((x.transpose(0, 2, 3, 1) * back).sum()), rel=1e-12)


def conv_backward_loops(x, w, dy, stride, padding):
    """dL/dx and dL/dw of y = conv(x, w) by loops over the definition (float64)."""
    (sh, sw), (ph, pw) = stride, padding
    N, _C, H, W = x.shape
    c_out, _, kh, kw = w.shape
    xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dxpad = np.zeros_like(xpad)
    dw = np.zeros_like(w)
    for n, o, ho, wo in np.ndindex(N, c_out, *dy.shape[2:]):
        g = dy[n, o, ho, wo]
        patch = (slice(None), slice(ho * sh, ho * sh + kh), slice(wo * sw, wo * sw + kw))
        dw[o] += g * xpad[n][patch]
        dxpad[n][patch] += g * w[o]
    return dxpad[:, :, ph:ph + H, pw:pw + W], dw


@pytest.mark.parametrize("c_in,c_out,k,stride,pad", [
    (3, 4, 3, 1, 1),      # stride 1, C_out <= 2 C_in: input gradient as a full correlation
    (2, 5, 3, 1, 1),      # stride 1, C_out > 2 C_in: col2im
    (3, 2, 3, 2, 1),      # strided: col2im
    (4, 3, 1, 1, 0),      # 1x1 stride 1: plain GEMMs
    (3, 3, 5, 1, 2),
])
def test_conv_backward_paths_match_loops(c_in, c_out, k, stride, pad):
    rng = np.random.default_rng(14)
    layer = Conv2d(c_in, c_out, k, stride=stride, padding=pad, bias=False)
    m = wrap(layer, (c_in, 7, 6))
    x = rng.standard_normal((2, c_in, 7, 6))
    y = m.forward(x)
    dy = rng.standard_normal(y.shape)
    dx = m.backward(dy)
    ref_dx, ref_dw = conv_backward_loops(x, layer.P["weight"], dy, layer.stride, layer.padding)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.G["weight"], ref_dw, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- Winograd F(2x2, 3x3)
@pytest.fixture
def winograd_everywhere(monkeypatch):
    """Every 3x3 stride-1 padding-1 conv with even H, W takes the Winograd path (small test
    shapes included), with blocks of 2 images of 4x6 (6 tiles each) so blocks split the batch."""
    from models import conv as C
    from models import layers as L
    if L._kernels() is None:
        pytest.skip("Numba not installed")
    monkeypatch.setattr(C, "WINOGRAD_MIN_CHANNELS", 1)
    monkeypatch.setattr(C, "WINOGRAD_MIN_HW", 1)
    monkeypatch.setattr(C, "WINOGRAD_TILES", 12)
    return L


@pytest.mark.parametrize("c_in,c_out,bias,training", [(3, 5, True, True), (5, 2, False, True),
                                                      (4, 4, True, False)])
def test_winograd_conv_matches_loops(winograd_everywhere, c_in, c_out, bias, training):
    """Forward, input gradient and weight gradient of the Winograd path equal the loop
    definitions (float64; 5 images of 4x6: blocks of 2, 2, 1), after a training or an
    evaluation forward; the bias gradient too."""
    L = winograd_everywhere
    rng = np.random.default_rng(31)
    layer = Conv2d(c_in, c_out, 3, padding=1, bias=bias)
    m = wrap(layer, (c_in, 4, 6))
    assert layer._winograd(np, 4, 6)
    x = rng.standard_normal((5, c_in, 4, 6))
    y = m.forward(x, training=training)
    assert layer._cache[3] == "winograd"
    ref = conv_reference(x, layer.P["weight"], layer.P["bias"] if bias else None, (1, 1),
                         (1, 1))
    np.testing.assert_allclose(y, ref, rtol=1e-11, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = m.backward(dy)
    ref_dx, ref_dw = conv_backward_loops(x, layer.P["weight"], dy, (1, 1), (1, 1))
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(layer.G["weight"], ref_dw, rtol=1e-11, atol=1e-12)
    if bias:
        np.testing.assert_allclose(layer.G["bias"], dy.sum(axis=(0, 2, 3)), rtol=1e-12)
    del L


def test_winograd_float32_error_is_round_off():
    """At ResNet width (64 channels, 16x16: the default thresholds take Winograd), float32
    Winograd agrees with the float64 loop definition to a few float32 ulps relative to the
    output's scale, as the float32 im2col path does (within a factor 4 of its error)."""
    from models import conv as C
    from models import layers as L
    if L._kernels() is None:
        pytest.skip("Numba not installed")
    rng = np.random.default_rng(32)
    x = rng.standard_normal((2, 64, 16, 16))
    errs = {}
    for name, min_ch in (("winograd", C.WINOGRAD_MIN_CHANNELS), ("im2col", 10 ** 9)):
        layer = Conv2d(64, 64, 3, padding=1, bias=False)
        m = Model(layer, (64, 16, 16), None, dtype=np.float32, seed=5)
        old = C.WINOGRAD_MIN_CHANNELS
        C.WINOGRAD_MIN_CHANNELS = min_ch
        try:
            assert layer._winograd(np, 16, 16) == (name == "winograd")
            y = m.forward(x.astype(np.float32))
            dy = rng.standard_normal(y.shape)
            dx = m.backward(dy.astype(np.float32))
        finally:
            C.WINOGRAD_MIN_CHANNELS = old
        w = layer.P["weight"].astype(np.float64)
        ref_y = conv_reference(x, w, None, (1, 1), (1, 1))
        ref_dx, ref_dw = conv_backward_loops(x[:1], w, dy[:1], (1, 1), (1, 1))
        ref_dx2, ref_dw2 = conv_backward_loops(x[1:], w, dy[1:], (1, 1), (1, 1))
        errs[name] = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in (
            (y, ref_y), (dx, np.concatenate([ref_dx, ref_dx2])),
            (layer.G["weight"], ref_dw + ref_dw2))]
    for e_w, e_i in zip(errs["winograd"], errs["im2col"]):
        assert e_w < 2e-6 and e_w < 4 * max(e_i, 1e-7), errs


def test_winograd_transforms_match_their_matrices():
    """The transform kernels against the matrices of Lavin & Gray (2016) applied with NumPy:
    ``V = B^T d B`` per 4x4 patch, ``U = G g G^T``, ``Y = A^T m A`` (+ bias), the adjoints
    ``A dy A^T`` and ``G^T dU G``."""
    from models import layers as L
    k = L._kernels()
    if k is None:
        pytest.skip("Numba not installed")
    Bt = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], float)
    G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
    At = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], float)
    rng = np.random.default_rng(33)
    N, H, W, C, K = 3, 4, 6, 5, 7
    X = rng.standard_normal((N, H, W, C))
    Xp = np.zeros((N, H + 2, W + 2, C))
    k.pad1(X, Xp)
    np.testing.assert_array_equal(Xp[:, 1:-1, 1:-1], X)
    assert not Xp[:, 0].any() and not Xp[:, :, -1].any()
    P = (H // 2) * (W // 2)
    V = np.zeros((16, 2 * P, C))
    k.winograd_input(Xp, 1, 3, V)                       # images 1 and 2
    for t in range(2 * P):
        n, ty, tx = 1 + t // P, (t % P) // (W // 2), t % (W // 2)
        d = Xp[n, 2 * ty:2 * ty + 4, 2 * tx:2 * tx + 4]  # (4, 4, C)
        np.testing.assert_allclose(V[:, t].reshape(4, 4, C),
                                   np.einsum("ai,ijc,bj->abc", Bt, d, Bt), atol=1e-12)
    w = rng.standard_normal((K, C, 3, 3))
    U = np.zeros((16, C, K))
    k.winograd_weight(w, U)
    np.testing.assert_allclose(U.reshape(4, 4, C, K), np.einsum("ai,kcij,bj->abck", G, w, G),
                               atol=1e-12)
    # the kernel turned by 180 degrees, channels swapped, is U in the TURNED order, transposed
    Uf = U[k.TURNED].transpose(0, 2, 1)
    np.testing.assert_allclose(Uf.reshape(4, 4, K, C),
                               np.einsum("ai,kcij,bj->abkc", G, w[:, :, ::-1, ::-1], G),
                               atol=1e-12)
    Vt = np.zeros((16, 2 * P, C))
    k.winograd_input(Xp, 1, 3, Vt, k.TURNED)            # product e in slot TURNED[e]
    np.testing.assert_array_equal(Vt[k.TURNED], V)
    M = rng.standard_normal((16, P, K))
    bias = rng.standard_normal(K)
    Y = np.full((N, H, W, K), np.nan)
    k.winograd_output(M, 2, bias, Y)                    # image 2 only
    for t in range(P):
        ty, tx = t // (W // 2), t % (W // 2)
        ref = np.einsum("ai,ijk,bj->abk", At, M[:, t].reshape(4, 4, K), At) + bias
        np.testing.assert_allclose(Y[2, 2 * ty:2 * ty + 2, 2 * tx:2 * tx + 2], ref, atol=1e-12)
    assert np.isnan(Y[:2]).all()
    Yt = np.full((N, H, W, K), np.nan)
    k.winograd_output(M[k.TURNED], 2, bias, Yt, k.TURNED)  # read back in the same order
    np.testing.assert_array_equal(Yt, Y)
    dY = rng.standard_normal((N, H, W, K))
    dM = np.zeros((16, P, K))
    k.winograd_output_adjoint(dY, 0, dM)
    for t in range(P):
        ty, tx = t // (W // 2), t % (W // 2)
        g = dY[0, 2 * ty:2 * ty + 2, 2 * tx:2 * tx + 2]
        np.testing.assert_allclose(dM[:, t].reshape(4, 4, K),
                                   np.einsum("ai,abk,bj->ijk", At, g, At), atol=1e-12)
    dU = rng.standard_normal((16, C, K))
    dW = np.zeros((K, C, 3, 3))
    k.winograd_weight_grad(dU, dW)
    np.testing.assert_allclose(dW, np.einsum("ai,abck,bj->kcij", G, dU.reshape(4, 4, C, K), G),
                               atol=1e-12)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocked convolutions on small test shapes: blocks of ~84 im2col rows, 2 blocks enough."""
    from models import conv as C
    monkeypatch.setattr(C, "BLOCK_ROWS", 84)
    monkeypatch.setattr(C, "BLOCK_MIN_BLOCKS", 2)


@pytest.mark.parametrize("training", [True, False])
def test_blocked_conv_matches_loops_and_the_one_gemm_path(small_blocks, training):
    """The blocked path (2 images of 7x6 per block, 5 images: blocks of 2, 2, 1) gives the loop
    definition's output, input gradient and weight gradient, after a training or an evaluation
    forward, and agrees with the one-GEMM path to round-off."""
    from models import conv as C
    rng = np.random.default_rng(23)
    layer = Conv2d(3, 4, 3, padding=1, bias=True)
    m = wrap(layer, (3, 7, 6))
    x = rng.standard_normal((5, 3, 7, 6))
    y = m.forward(x, training=training)
    assert layer._cache[3] == 2                      # images per block: the blocked path ran
    dy = rng.standard_normal(y.shape)
    dx = m.backward(dy)
    ref_dx, ref_dw = conv_backward_loops(x, layer.P["weight"], dy, layer.stride, layer.padding)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.G["weight"], ref_dw, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.G["bias"], dy.sum(axis=(0, 2, 3)), rtol=1e-12)
    xpad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref_y = np.empty(y.shape)
    for n, o, h, w in np.ndindex(*y.shape):
        ref_y[n, o, h, w] = (xpad[n, :, h:h + 3, w:w + 3] * layer.P["weight"][o]).sum()
    np.testing.assert_allclose(y, ref_y + layer.P["bias"][:, None, None], rtol=1e-12,
                               atol=1e-12)
    blocked = (y.copy(), dx.copy(), layer.G["weight"].copy())
    C.BLOCK_ROWS = 10**9                             # one block is too few: the one-GEMM path
    y1 = m.forward(x, training=training)
    assert layer._cache[3] == 0
    dx1 = m.backward(dy)
    for got, want in zip(blocked, (y1, dx1, layer.G["weight"])):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_layers_give_the_same_results_for_any_memory_layout():
    """NCHW-contiguous and channels-last inputs (and gradients) give identical results: layouts
    are an implementation detail (conv/BN outputs are channels-last views)."""
    rng = np.random.default_rng(15)
    m = resnet((3, 8, 8), 5, dtype=np.float64, depths=(1, 1), planes=(4, 8), seed=4)
    x = rng.standard_normal((3, 3, 8, 8))
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    snap = snapshot(m)
    y1 = m.forward(x).copy()
    dx1 = m.backward(np.ones_like(y1)).copy()
    g1 = m.grads.flat.copy()
    restore(m, snap)
    y2 = m.forward(xl)
    dx2 = m.backward(np.ones_like(y2))
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(dx1, dx2)
    np.testing.assert_array_equal(g1, m.grads.flat)
    # a bare BatchNorm fed NCHW memory, and a conv fed a channels-last gradient
    bn = wrap(BatchNorm2d(4), (4, 3, 3))
    z = rng.standard_normal((2, 4, 3, 3))
    np.testing.assert_array_equal(bn.forward(z),
                                  bn.forward(np.ascontiguousarray(z.transpose(0, 2, 3, 1))
                                             .transpose(0, 3, 1, 2)))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batchnorm_numba_kernels_match_array_path(training, dtype):
    """The Numba channels-last path equals the NCHW array path (the paper's formulas written
    with whole-array operations) to round-off, running statistics included."""
    from models import layers as L
    if L._kernels() is None:
        pytest.skip("Numba not installed")
    rng = np.random.default_rng(16)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    a, b = BatchNorm2d(5), BatchNorm2d(5)
    ma = Model(a, (5, 4, 3), None, dtype=dtype, seed=0)
    mb = Model(b, (5, 4, 3), None, dtype=dtype, seed=0)
    for layer in (a, b):
        layer.P["weight"][...] = np.linspace(0.5, 2.0, 5)
        layer.P["bias"][...] = np.linspace(-1, 1, 5)
        layer.B["running_mean"][...] = np.linspace(-0.3, 0.3, 5)
        layer.B["running_var"][...] = np.linspace(0.5, 1.5, 5)
    x = (rng.standard_normal((6, 5, 4, 3)) * 3 + 1).astype(dtype)
    dy = rng.standard_normal((6, 5, 4, 3)).astype(dtype)
    ya = ma.forward(x, training=training)            # kernels
    yb = b._forward_xp(x, training)                  # reference array path
    dxa, dxb = a.backward(dy), b.backward(dy)
    for got, ref in ((ya, yb), (dxa, dxb), (ma.grads.flat, mb.grads.flat),
                     (a.B["running_mean"], b.B["running_mean"]),
                     (a.B["running_var"], b.B["running_var"])):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_batchnorm_statistics_survive_a_large_mean():
    """float32 activations with mean 1e4 and spread 1: the shifted float64 statistics give the
    batch variance to float32 precision of the data (a float32 E[x^2]-E[x]^2 would not)."""
    rng = np.random.default_rng(17)
    layer = BatchNorm2d(2, momentum=1.0)
    m = Model(layer, (2, 5, 5), None, seed=0)
    x = (1e4 + rng.standard_normal((8, 2, 5, 5))).astype(np.float32)
    y = m.forward(x)
    x64 = x.astype(np.float64)
    var = x64.var(axis=(0, 2, 3))
    ref = (x64 - x64.mean(axis=(0, 2, 3))[:, None, None]) / np.sqrt(var + 1e-5)[:, None, None]
    np.testing.assert_allclose(y, ref, atol=1e-5)
    np.testing.assert_allclose(layer.B["running_var"], var * 200 / 199, rtol=1e-6)


def test_float32_resnet_step_agrees_with_float64_to_round_off():
    """The float32 forward/backward of a small ResNet equals the float64 one to float32
    round-off (no float32-specific shortcut changes results)."""
    rng = np.random.default_rng(18)
    m64 = resnet((3, 8, 8), 5, dtype=np.float64, depths=(1, 1), planes=(8, 16), seed=5)
    m32 = resnet((3, 8, 8), 5, dtype=np.float32, depths=(1, 1), planes=(8, 16), seed=5)
    m32.params.flat[...] = m64.params.flat
    x = rng.standard_normal((6, 3, 8, 8))
    labels = rng.integers(0, 5, 6)
    l64, z64 = m64.loss_and_grad(x, labels)
    l32, z32 = m32.loss_and_grad(x.astype(np.float32), labels)
    assert l32 == pytest.approx(l64, rel=1e-5)
    np.testing.assert_allclose(z32, z64, atol=1e-5 * np.abs(z64).max())
    g64, g32 = m64.grads.flat, m32.grads.flat
    assert np.linalg.norm(g32 - g64) <= 1e-4 * np.linalg.norm(g64)


def test_conv_backward_after_evaluation_forward():
    """An evaluation forward keeps no im2col matrix; a backward after it (gradient checks in
    eval mode) rebuilds it, even when another layer reused the shared scratch in between."""
    rng = np.random.default_rng(19)
    a, b = Conv2d(2, 3, 3, padding=1), Conv2d(2, 3, 3, padding=1)
    ma, mb = wrap(a, (2, 5, 5)), wrap(b, (2, 5, 5), seed=1)
    x, x2 = rng.standard_normal((2, 2, 5, 5)), rng.standard_normal((2, 2, 5, 5))
    y = ma.forward(x, training=False)
    mb.forward(x2, training=False)              # same shape: overwrites the shared scratch
    dy = rng.standard_normal(y.shape)
    dx = ma.backward(dy)
    ref_dx, ref_dw = conv_backward_loops(x, a.P["weight"], dy, a.stride, a.padding)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a.G["weight"], ref_dw, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- threaded kernels
@pytest.fixture
def threaded_kernels(monkeypatch):
    """The Numba kernels with every pass shared out (no size threshold) on 2 threads, or 1
    where Numba's pool has 1; the previous thread count is restored afterwards."""
    from models import layers as L
    k = L._kernels()
    if k is None:
        pytest.skip("Numba not installed")
    import numba
    monkeypatch.setattr("models.kernels_threads.MIN_PARALLEL", 0)
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    yield k
    numba.set_num_threads(before)


def array_path(monkeypatch):
    """Make the layers take their NumPy array path for conv data movement, ReLU and sums."""
    from models import conv, im2col, layer_base
    from models import layers as L
    monkeypatch.setattr(L, "_numba_kernels", lambda xp: None)
    monkeypatch.setattr(layer_base, "_numba_kernels", lambda xp: None)
    monkeypatch.setattr(conv, "_numba_kernels", lambda xp: None)
    monkeypatch.setattr(im2col, "_numba_kernels", lambda xp: None)


@pytest.mark.parametrize("k,stride,pad", [((3, 3), (1, 1), (1, 1)), ((3, 2), (2, 1), (0, 2)),
                                          ((1, 1), (2, 2), (0, 0)), ((2, 3), (1, 2), (1, 0)),
                                          ((3, 3), (2, 2), (2, 1))])
def test_threaded_im2col_col2im_kernels_match_definition_and_array_path(threaded_kernels,
                                                                        monkeypatch, k, stride,
                                                                        pad):
    """The parallel kernels on odd shapes: im2col equals the loop definition exactly, col2im
    equals the array path's strided adds bit for bit (same summation order) and is the
    adjoint of im2col."""
    from models.layers import col2im_nhwc
    kern = threaded_kernels
    rng = np.random.default_rng(20)
    x = rng.standard_normal((3, 5, 7, 5)).astype(np.float32)     # (N, C, H, W)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    ref = im2col_nhwc_loops(x, *k, stride, pad).astype(np.float32)
    out = np.full(ref.shape, np.nan, np.float32)
    kern.im2col_nhwc(xl, *k, *stride, *pad, out)
    np.testing.assert_array_equal(out, ref)
    D = rng.standard_normal(ref.shape).astype(np.float32)
    got = np.full(xl.shape, np.nan, np.float32)
    kern.col2im_nhwc(D, *k, *stride, *pad, got)
    with monkeypatch.context() as m:
        array_path(m)
        want = col2im_nhwc(D, xl.shape, *k, stride, pad)
    np.testing.assert_array_equal(got, want)
    assert float((ref.astype(np.float64) * D).sum()) == pytest.approx(
        float((xl.astype(np.float64) * got).sum()), rel=1e-5)


@pytest.mark.parametrize("blocked", [False, True])
def test_threaded_kernels_give_the_array_path_bits_in_a_resnet(threaded_kernels, monkeypatch,
                                                               blocked):
    """A small ResNet step (odd spatial size, float32): conv data movement, ReLU and residual
    sums through the threaded kernels give exactly the array path's logits and gradients; the
    BatchNorm sums do not depend on the thread count.  Also with the stride-1 convs blocked
    (one image per block): both paths block alike."""
    import numba
    if blocked:
        from models import conv as C
        monkeypatch.setattr(C, "BLOCK_ROWS", 1)
        monkeypatch.setattr(C, "BLOCK_MIN_BLOCKS", 2)
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, 3, 9, 7)).astype(np.float32)
    labels = rng.integers(0, 5, 3)

    def step():
        m = resnet((3, 9, 7), 5, depths=(1, 1), planes=(4, 8), seed=4)
        _, logits = m.loss_and_grad(x, labels)
        return logits, m.grads.flat.copy(), m.buffers["bn1.running_var"].copy()

    threaded = step()
    numba.set_num_threads(1)
    one_thread = step()
    with monkeypatch.context() as m:
        array_path(m)
        reference = step()
    for got, one, want in zip(threaded, one_thread, reference):
        np.testing.assert_array_equal(got, one)
        np.testing.assert_array_equal(got, want)


def test_parallel_for_covers_the_range_once_and_reports_errors(threaded_kernels):
    kern = threaded_kernels
    hits = np.zeros(37, np.int64)

    def mark(h, lo, hi):
        h[lo:hi] += 1

    kern.parallel_for(mark, 37, 37, hits)
    np.testing.assert_array_equal(hits, 1)

    def fail(lo, hi):
        if lo == 0:
            raise RuntimeError("chunk failed")

    with pytest.raises(RuntimeError, match="chunk failed"):
        kern.parallel_for(fail, 8, 8)

    def fail_all(lo, hi):
        raise RuntimeError("every chunk failed")

    with pytest.raises(RuntimeError, match="every chunk failed"):    # returns, no hang
        kern.parallel_for(fail_all, 64, 64)


def test_kernel_threads_follow_omp_num_threads():
    """A process configured with ``OMP_NUM_THREADS=1`` (and no ``NUMBA_NUM_THREADS``) runs the
    kernels on one thread."""
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    env["OMP_NUM_THREADS"] = "1"
    code = "import numba, models.kernels; print(numba.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=False, timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


@pytest.mark.parametrize("shape_a,shape_b,transpose_a", [
    ((70, 33), (33, 20), False),        # rows cut
    ((20, 33), (33, 70), False),        # columns cut
    ((33, 70), (33, 20), True),         # a transposed view (the weight-gradient form)
    ((16, 40, 9), (16, 9, 24), False),  # a stack of 16 GEMMs (Winograd): cut into runs
    ((5, 40, 9), (9, 24), False),       # a stack of 5 against one shared operand
    ((3, 40, 9), (3, 9, 24), False),    # a stack shorter than the parts: rows cut
])
def test_threaded_matmul_matches_numpy(threaded_kernels, monkeypatch, shape_a, shape_b,
                                       transpose_a):
    """kernels.matmul cut into parts on 2 threads (every size split) equals one np.matmul to
    float32 round-off, for row and column cuts, a transposed operand and GEMM stacks; the BLAS
    pools get their thread counts back."""
    from models import kernels_threads
    kern = threaded_kernels
    monkeypatch.setattr("models.kernels_threads.GEMM_MIN_SPLIT", 0)
    rng = np.random.default_rng(40)
    a = rng.standard_normal(shape_a).astype(np.float32)
    a = a.T if transpose_a else a
    b = rng.standard_normal(shape_b).astype(np.float32)
    before = [lib.num_threads for lib in kernels_threads._blas_pools()]
    got = kern.matmul(a, b)
    out = np.full(got.shape, np.nan, np.float32)
    assert kern.matmul(a, b, out) is out
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out, got)
    assert [lib.num_threads for lib in kernels_threads._blas_pools()] == before
