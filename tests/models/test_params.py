"""Parameter registry: flat-buffer aliasing, layout order, state_dict, shape-only specs."""

from __future__ import annotations

import numpy as np
import pytest

from models.layers import softmax_cross_entropy
from models.optim import SGD, SGDConfig
from models.params import FlatTensors, ParamLayout, ParamSpec
from models.specs import SPECS, get_spec, resnet18_spec, resnet152_spec, wide_resnet50_2_spec
from models.zoo import MODELS, build_model, cnn, mlp, resnet


def small_resnet(**kw):
    return resnet((3, 8, 8), 4, depths=(1, 1), planes=(4, 8), **kw)


def test_views_alias_flat_buffer_both_ways():
    m = small_resnet()
    name = "layer2.0.conv1.weight"
    view = m.params[name]
    assert view.shape == (8, 4, 3, 3)
    assert np.shares_memory(view, m.params.flat)
    view[0, 0, 0, 0] = 123.0
    assert m.params.flat[m.layout.offsets[name]] == 123.0
    sl = m.layout.slice(name)
    m.params.flat[sl] = 7.0
    assert np.all(view == 7.0)
    # every view together tiles the flat buffer exactly once
    covered = np.zeros(m.num_params, dtype=int)
    for n in m.layout.names:
        covered[m.layout.slice(n)] += 1
        assert np.shares_memory(m.grads[n], m.grads.flat)
    assert np.all(covered == 1)


def test_layers_see_the_flat_buffer_and_optimizer_updates_views():
    m = small_resnet(seed=1)
    conv = m.root._children[0][1]          # stem conv
    assert conv.P["weight"] is m.params["conv1.weight"]
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 3])
    m.loss_and_grad(x, y)
    assert np.abs(m.grads["fc.weight"]).sum() > 0
    before = {n: v.copy() for n, v in m.params.items()}
    grads = {n: v.copy() for n, v in m.grads.items()}
    SGD(m.params, m.grads, SGDConfig(lr=0.5, momentum=0.0)).step()
    for n in m.layout.names:
        np.testing.assert_allclose(m.params[n], before[n] - 0.5 * grads[n], rtol=1e-6)
    # the layer computes with the updated weights: forward through the view changes output
    conv.P["weight"][...] = 0.0
    assert np.all(m.params.flat[m.layout.slice("conv1.weight")] == 0.0)


def test_layout_is_backward_order_and_ready_hook_follows_it():
    m = small_resnet()
    fwd = m.layout.forward_names
    assert m.layout.names == tuple(reversed(fwd))
    assert fwd[0] == "conv1.weight" and fwd[-1] == "fc.bias"
    offsets = [m.layout.offsets[n] for n in m.layout.names]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert m.layout.total == m.num_params == sum(m.layout.sizes.values())
    ready = []
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    m.loss_and_grad(x, np.array([0, 1, 2, 3]), ready=ready.append)
    assert ready == list(m.layout.names)


def test_kinds_shapes_and_names():
    m = small_resnet()
    kinds = {n: m.layout.kind(n) for n in m.layout.names}
    assert kinds["conv1.weight"] == "conv" and m.layout.shape("conv1.weight") == (4, 3, 3, 3)
    assert kinds["bn1.weight"] == "bn" and kinds["bn1.bias"] == "bn"
    assert kinds["fc.weight"] == "fc" and m.layout.shape("fc.weight") == (4, 8)
    assert kinds["fc.bias"] == "bias"
    assert kinds["layer2.0.shortcut.conv.weight"] == "conv"
    assert m.layout.shape("layer2.0.shortcut.conv.weight") == (8, 4, 1, 1)
    assert set(m.layout.names_of_kind("conv")) == {n for n, k in kinds.items() if k == "conv"}
    assert "bn1.running_mean" in m.buffers and "bn1.running_mean" not in m.params
    seg = m.layout.segment_ids()
    for t, n in enumerate(m.layout.names):
        assert np.all(seg[m.layout.slice(n)] == t)


def test_expand_per_tensor_values():
    layout = ParamLayout([ParamSpec("a", "conv", (2, 1, 1, 2)), ParamSpec("b", "bias", (3,))])
    assert layout.names == ("b", "a")
    np.testing.assert_array_equal(layout.expand({"a": 2.0, "b": 5.0}), [5, 5, 5, 2, 2, 2, 2])
    np.testing.assert_array_equal(layout.expand([1.0, 3.0]), [1, 1, 1, 3, 3, 3, 3])
    with pytest.raises(ValueError, match="no value"):
        layout.expand({"a": 1.0})
    with pytest.raises(ValueError, match="duplicate"):
        ParamLayout([ParamSpec("a", "fc", (1, 1)), ParamSpec("a", "fc", (1, 1))])
    with pytest.raises(ValueError, match="kind must be one of"):
        ParamSpec("a", "weights", (1,))


def test_flat_tensors_wrap_existing_buffer():
    layout = ParamLayout([ParamSpec("w", "fc", (2, 3)), ParamSpec("b", "bias", (2,))])
    buf = np.arange(8, dtype=np.float64)
    ft = FlatTensors(layout, buf)
    assert ft.flat is buf
    np.testing.assert_array_equal(ft["b"], [0, 1])
    np.testing.assert_array_equal(ft["w"], [[2, 3, 4], [5, 6, 7]])
    with pytest.raises(ValueError, match="length 8"):
        FlatTensors(layout, np.zeros(7))
    with pytest.raises(KeyError, match="valid names"):
        ft["nope"]


def test_state_dict_round_trip_includes_buffers():
    rng = np.random.default_rng(0)
    a = small_resnet(seed=1)
    x = rng.standard_normal((8, 3, 8, 8)).astype(np.float32)
    a.loss_and_grad(x, rng.integers(0, 4, 8))          # moves BN running stats off defaults
    sd = a.state_dict()
    assert set(sd) == set(a.layout.names) | set(a.buffers)
    assert not np.allclose(sd["bn1.running_mean"], 0.0)
    b = small_resnet(seed=2)
    assert not np.allclose(a.params.flat, b.params.flat)
    flat_before = b.params.flat
    b.load_state_dict(sd)
    assert b.params.flat is flat_before                  # loaded in place: views stay valid
    np.testing.assert_array_equal(a.params.flat, b.params.flat)
    for n in a.buffers:
        np.testing.assert_array_equal(a.buffers[n], b.buffers[n])
    np.testing.assert_array_equal(a.forward(x, training=False), b.forward(x, training=False))
    # state_dict values are copies
    sd["fc.bias"][...] = 99.0
    assert not np.any(a.params["fc.bias"] == 99.0)
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"fc.bias": sd["fc.bias"]})
    b.load_state_dict({"fc.bias": sd["fc.bias"]}, strict=False)
    assert np.all(b.params["fc.bias"] == 99.0)
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict({"fc.bias": np.zeros(3)}, strict=False)


def test_same_seed_same_init_and_he_scale():
    a, b = cnn((1, 8, 8), 10, seed=5), cnn((1, 8, 8), 10, seed=5)
    np.testing.assert_array_equal(a.params.flat, b.params.flat)
    w = resnet((3, 32, 32), 10, depths=(1,), planes=(64,), seed=0).params["layer1.0.conv2.weight"]
    assert w.std() == pytest.approx(np.sqrt(2.0 / (64 * 9)), rel=0.05)


def test_model_registry():
    assert set(MODELS) == {"mlp", "cnn", "resnet", "vit", "gpt"}
    for name in ("mlp", "cnn", "resnet", "vit"):     # the image models (gpt takes tokens)
        m = build_model(name, (1, 8, 8), 10)
        logits = m.forward(np.zeros((2, 1, 8, 8), np.float32))
        assert logits.shape == (2, 10)
    with pytest.raises(ValueError, match=r"valid names: \['cnn', 'gpt', 'mlp', 'resnet', 'vit'\]"):
        build_model("vgg", (1, 8, 8), 10)
    for shape in [(1, 28, 28), (3, 32, 32)]:
        m = resnet(shape, 10, depths=(1, 1, 1), planes=(4, 8, 16))
        assert m.forward(np.zeros((2, *shape), np.float32)).shape == (2, 10)
    assert mlp((64,), 10, hidden=(32,)).num_params == 64 * 32 + 32 + 32 * 10 + 10


# --------------------------------------------------------------------------- shape-only specs
def conv_bn(cin, cout, k):
    """Parameters of a bias-free conv followed by BatchNorm (gamma, beta)."""
    return cout * cin * k * k + 2 * cout


def basic_resnet_count(depths, planes, num_classes, in_ch=3):
    n = conv_bn(in_ch, planes[0], 3)
    c = planes[0]
    for s, (d, p) in enumerate(zip(depths, planes)):
        for b in range(d):
            stride = 2 if (s > 0 and b == 0) else 1
            n += conv_bn(c, p, 3) + conv_bn(p, p, 3)
            if stride != 1 or c != p:
                n += conv_bn(c, p, 1)
            c = p
    return n + c * num_classes + num_classes


def bottleneck_resnet_count(depths, planes, num_classes, width_mult=1, in_ch=3):
    n = conv_bn(in_ch, 64, 3)
    c = 64
    for s, (d, p) in enumerate(zip(depths, planes)):
        w, out = p * width_mult, 4 * p
        for b in range(d):
            stride = 2 if (s > 0 and b == 0) else 1
            n += conv_bn(c, w, 1) + conv_bn(w, w, 3) + conv_bn(w, out, 1)
            if stride != 1 or c != out:
                n += conv_bn(c, out, 1)
            c = out
    return n + c * num_classes + num_classes


def test_spec_parameter_counts_match_architecture_formula():
    planes = (64, 128, 256, 512)
    r18 = resnet18_spec()
    assert r18.num_params == basic_resnet_count((2, 2, 2, 2), planes, 10)
    assert abs(r18.num_params - 11.17e6) < 0.01e6                  # PruneX Table 2: ~11 M
    r152 = resnet152_spec()
    assert r152.num_params == bottleneck_resnet_count((3, 8, 36, 3), planes, 10)
    wrn = wide_resnet50_2_spec()
    assert wrn.num_params == bottleneck_resnet_count((3, 4, 6, 3), planes, 10, width_mult=2)
    # Table 2 quotes the torchvision (1000-class, 7x7-stem) counts: 60.19 M and 68.88 M
    stem_diff = 64 * 3 * (49 - 9)
    assert resnet152_spec(num_classes=1000).num_params + stem_diff == 60_192_808
    assert wide_resnet50_2_spec(num_classes=1000).num_params + stem_diff == 68_883_240
    assert resnet18_spec(num_classes=1000).num_params + stem_diff == 11_689_512
    assert 55e6 < r152.num_params < 61e6 and 64e6 < wrn.num_params < 70e6


def test_spec_contents_and_flops():
    spec = resnet18_spec()
    convs = spec.of_kind("conv")
    assert len(convs) == 20                                # 1 stem + 16 block + 3 shortcut
    assert all(len(p.shape) == 4 for p in convs)
    assert convs[0].shape == (64, 3, 3, 3)
    assert spec.as_tuples()[-2] == ("fc.weight", "fc", (10, 512))
    # MACs from the formula: sum over convs of H_out*W_out*C_out*C_in*k*k + fc
    macs = 32 * 32 * 64 * 3 * 9                            # stem
    hw, c = 32, 64
    for s, p in enumerate((64, 128, 256, 512)):
        for b in range(2):
            stride = 2 if (s > 0 and b == 0) else 1
            hw_out = hw // stride
            macs += hw_out ** 2 * p * c * 9 + hw_out ** 2 * p * p * 9
            if stride != 1 or c != p:
                macs += hw_out ** 2 * p * c
            hw, c = hw_out, p
    macs += 512 * 10
    assert spec.macs_per_sample == macs and spec.flops_per_sample == 2 * macs
    assert spec.layout.total == spec.num_params
    # a built model's spec agrees with its arrays
    m = small_resnet()
    s = m.spec()
    assert s.num_params == m.num_params and s.layout.names == m.layout.names
    assert {"resnet18", "resnet152", "wide_resnet50_2"} <= set(SPECS)
    with pytest.raises(ValueError, match="valid names"):
        get_spec("resnet50")


def test_every_factory_gives_finite_gradients():
    """A trained step on every factory keeps parameters finite (smoke test on all kinds)."""
    rng = np.random.default_rng(0)
    for name in [n for n in MODELS if n != "gpt"]:   # the LM is checked in its own tests
        m = build_model(name, (1, 8, 8), 10)
        x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
        loss, _ = m.loss_and_grad(x, np.array([0, 1, 2, 3]))
        assert np.isfinite(loss) and np.all(np.isfinite(m.grads.flat))
        _, dlogits = softmax_cross_entropy(m.forward(x), np.array([0, 1, 2, 3]))
        assert dlogits.shape == (4, 10)
