"""Physically compact export (hsadmm.export): exact logits, file round trip, counts, errors."""

import numpy as np
import pytest

from hsadmm.export import CompactConv2d, export_compact, load_compact_model, read_compact
from hsadmm.projection import parse_sparsity, structured_mask
from models import build_model, load_digits

KINDS = ["channel", "filter", "filter+channel", "shape"]


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def masked_model(name, sparsity, digits, seed=0):
    """A model with random parameters and BN statistics whose conv weights carry random
    structured masks (the masks are drawn from independent random tensors, so they do not
    follow the weights' magnitudes)."""
    rng = np.random.default_rng(seed)
    m = build_model(name, digits.train.input_shape, 10, seed=seed)
    m.params.flat[...] = rng.standard_normal(m.params.flat.size).astype(np.float32) * 0.3
    for n, buf in m.buffers.items():
        buf[...] = (rng.uniform(0.5, 1.5, buf.shape) if n.endswith("running_var")
                    else rng.standard_normal(buf.shape) * 0.1)
    masks = {}
    for n in m.layout.names_of_kind("conv"):
        masks[n] = structured_mask(rng.standard_normal(m.params[n].shape),
                                   parse_sparsity(sparsity), 0.5)
        m.params[n][...] *= masks[n]
    return m, masks


def assert_close_logits(a, b):
    scale = max(1.0, float(np.abs(a).max()))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["cnn", "resnet"])
@pytest.mark.parametrize("sparsity", KINDS)
def test_export_logits_equal_masked_model_and_survive_the_file(name, sparsity, digits, tmp_path):
    m, masks = masked_model(name, sparsity, digits)
    x = digits.test.x[:48]
    want = m.forward(x, training=False)
    exp = export_compact(m, masks)
    in_memory = exp.build_model()
    assert_close_logits(want, in_memory.forward(x, training=False))
    path = exp.save(tmp_path / "compact_model.npz")
    loaded = load_compact_model(path)
    np.testing.assert_array_equal(in_memory.forward(x, training=False),
                                  loaded.forward(x, training=False))
    # the rebuilt model really holds the compact weights, nothing dense
    assert loaded.num_params == sum(a.size for a in exp.params.values())
    convs = [layer for _, layer in loaded.root.walk() if isinstance(layer, CompactConv2d)]
    assert len(convs) == len(masks)
    assert loaded.macs_per_sample() <= m.macs_per_sample()


@pytest.mark.parametrize("name", ["cnn", "resnet"])
@pytest.mark.parametrize("sparsity", KINDS)
def test_removed_counts_match_the_masks(name, sparsity, digits):
    m, masks = masked_model(name, sparsity, digits, seed=3)
    exp = export_compact(m, masks)
    dense = compact = 0
    for layer in exp.manifest["layers"]:
        mk = masks[layer["name"]]
        k_out = np.flatnonzero(mk.any(axis=(1, 2, 3)))
        k_in = np.flatnonzero(mk.any(axis=(0, 2, 3)))
        got_out, got_in = exp.kept[layer["name"]]
        assert got_out.dtype == got_in.dtype == np.int32
        np.testing.assert_array_equal(got_out, k_out)
        np.testing.assert_array_equal(got_in, k_in)
        assert layer["filters_removed"] == mk.shape[0] - k_out.size
        assert layer["channels_removed"] == mk.shape[1] - k_in.size
        assert layer["compact_shape"] == [k_out.size, k_in.size, *mk.shape[2:]]
        dense += mk.size
        compact += k_out.size * k_in.size * mk.shape[2] * mk.shape[3]
    assert exp.dense_conv_params == dense and exp.compact_conv_params == compact
    assert exp.manifest["compact_conv_bytes"] == 4 * compact
    if "channel" in sparsity or "filter" in sparsity:
        assert compact < dense


def test_weight_support_defines_the_slices_without_masks(digits):
    m, masks = masked_model("cnn", "filter+channel", digits, seed=5)
    a, b = export_compact(m, masks), export_compact(m)
    for n in masks:
        for ka, kb in zip(a.kept[n], b.kept[n]):
            np.testing.assert_array_equal(ka, kb)


def test_compact_backward_matches_masked_gradients(digits):
    m, masks = masked_model("resnet", "filter+channel", digits, seed=7)
    c = export_compact(m, masks).build_model()
    x, y = digits.train.x[:16], digits.train.y[:16]
    m.loss_and_grad(x, y)
    c.loss_and_grad(x, y)
    exp_kept = export_compact(m, masks).kept
    for n in m.layout.names:
        g = m.grads[n]
        if n in exp_kept:
            k_out, k_in = exp_kept[n]
            g = g[np.ix_(k_out, k_in)]
        scale = max(1.0, float(np.abs(g).max()))
        np.testing.assert_allclose(c.grads[n], g, rtol=0, atol=1e-4 * scale, err_msg=n)


def test_weights_outside_the_mask_are_refused(digits):
    m, masks = masked_model("cnn", "channel", digits)
    n = next(iter(masks))
    m.params[n][...] = 1.0
    with pytest.raises(ValueError, match="nonzero weights outside its kept"):
        export_compact(m, masks)


def test_missing_and_corrupt_files_error_clearly(digits, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_compact(tmp_path / "nope.npz")
    m, masks = masked_model("cnn", "channel", digits)
    data = export_compact(m, masks).to_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_compact_model(cut)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_compact_model(junk)
    bare = tmp_path / "bare.npz"
    np.savez(bare, x=np.zeros(3))
    with pytest.raises(ValueError, match="no readable manifest"):
        load_compact_model(bare)


def test_compact_conv_validates_indices():
    with pytest.raises(ValueError, match="strictly increasing indices in"):
        CompactConv2d(4, 8, 3, k_out=[0, 9], k_in=[1])
    with pytest.raises(ValueError, match="non-empty"):
        CompactConv2d(4, 8, 3, k_out=[0], k_in=[])
