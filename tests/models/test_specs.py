"""Paper-scale shape specs: parameter counts against the published ones and against closed-form
counts written here from the architecture descriptions; forward cost against the published
GMACs; fp32 sizes against SSFusion's model table."""

from __future__ import annotations

import pytest

from models.specs import PUBLISHED_PARAMS, SPECS, get_spec, resnet152_spec


# ------------------------------------------------------------------ closed forms (second source)
def bert_count(d, L, V=30522, P=512, types=2):
    ff = 4 * d
    emb = (V + P + types) * d + 2 * d                       # three tables + LayerNorm
    layer = 4 * (d * d + d) + 2 * d + (d * ff + ff) + (ff * d + d) + 2 * d
    return emb + L * layer + d * d + d                      # + pooler


def gpt2_count(d, L, V=50257, P=1024):
    layer = (2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d)
             + (4 * d * d + d))
    return V * d + P * d + L * layer + 2 * d                # head tied to the token table


def vit_count(d, L, K=1000, C=3, p=16, img=224):
    n = (img // p) ** 2
    layer = 12 * d * d + 13 * d                             # 2 LN, qkv, proj, fc1, fc2
    return (C * p * p * d + d) + d + (n + 1) * d + L * layer + 2 * d + (d * K + K)


def swin_t_count(K=1000, window=7):
    rpb = (2 * window - 1) ** 2
    total = 3 * 16 * 96 + 96 + 2 * 96                       # 4x4 patch conv + LayerNorm
    for s, (d, n, h) in enumerate(zip((96, 192, 384, 768), (2, 2, 6, 2), (3, 6, 12, 24))):
        total += n * (12 * d * d + 13 * d + rpb * h)
        if s < 3:
            total += 8 * d + 4 * d * 2 * d                  # patch merging: LN(4d), 4d -> 2d
    return total + 2 * 768 + 768 * K + K


def llama_count(d=768, L=12, V=32000, ff=2048):
    return V * d + L * (2 * d + 4 * d * d + 3 * d * ff) + d + V * d


def vgg19_count(K=1000):
    widths = [64, 64, 128, 128, 256, 256, 256, 256] + [512] * 8
    total, cin = 0, 3
    for w in widths:
        total += cin * 9 * w + w
        cin = w
    return total + (512 * 49 * 4096 + 4096) + (4096 * 4096 + 4096) + (4096 * K + K)


CLOSED_FORM = {
    "bert-base": bert_count(768, 12), "bert-large": bert_count(1024, 24),
    "gpt2-large": gpt2_count(1280, 36), "gpt2-xl": gpt2_count(1600, 48),
    "vit-base": vit_count(768, 12), "vit-large": vit_count(1024, 24),
    "swin-t": swin_t_count(), "llama-134m": llama_count(), "vgg19": vgg19_count(),
}

#: published counts (HF model cards / torchvision weights tables)
PUBLISHED = {
    "bert-base": 109_482_240, "bert-large": 335_141_888, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200, "vit-base": 86_567_656, "vit-large": 304_326_632,
    "swin-t": 28_288_354, "llama-134m": 134_105_856, "vgg19": 143_667_240,
    "resnet152-imagenet": 60_192_808, "resnet50-imagenet": 25_557_032,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_equals_published(name):
    spec = get_spec(name)
    assert spec.num_params == PUBLISHED[name] == PUBLISHED_PARAMS[name]
    if name in CLOSED_FORM:
        assert CLOSED_FORM[name] == PUBLISHED[name]
    assert spec.layout.total == spec.num_params
    assert len(set(spec.layout.names)) == len(spec.params)


def test_resnet152_imagenet_differs_from_cifar_variant_by_the_stem_only():
    # 7x7 vs 3x3 stem conv on 3 channels, 64 filters: 64 * 3 * (49 - 9) parameters
    assert get_spec("resnet152-imagenet").num_params == (
        resnet152_spec(num_classes=1000).num_params + 64 * 3 * 40)


@pytest.mark.parametrize("name, gmacs", [
    # torchvision's published GFLOPS (multiply-accumulates) at 224x224
    ("vit-base", 17.56), ("vit-large", 61.55), ("swin-t", 4.49), ("vgg19", 19.63),
    ("resnet152-imagenet", 11.51),
])
def test_forward_cost_matches_published_gmacs(name, gmacs):
    assert get_spec(name).macs_per_sample / 1e9 == pytest.approx(gmacs, rel=0.005)


def test_language_model_cost_counts_weights_and_attention_per_sequence():
    spec = get_spec("gpt2-large")
    T, d, L, V = 1024, 1280, 36, 50257
    per_token = L * 12 * d * d + V * d                      # blocks + tied head
    assert spec.macs_per_sample == T * per_token + L * 2 * T * T * d
    assert spec.input_shape == (T,) and spec.num_classes == V


@pytest.mark.parametrize("name, size_bytes", [
    # SSFusion (paper 004) model table; MB / GB as printed there (mixed decimal and binary
    # prefixes, rounded), so 5 % tolerance
    ("bert-base", 420e6 * 1.048576), ("bert-large", 1.32e9), ("gpt2-large", 3.2e9),
    ("gpt2-xl", 6e9), ("vit-large", 1.2e9), ("vgg19", 548 * 2**20),
    ("resnet152-imagenet", 230 * 2**20),
])
def test_fp32_sizes_match_ssfusion_table(name, size_bytes):
    assert 4 * get_spec(name).num_params == pytest.approx(size_bytes, rel=0.05)


def test_registry_names_and_bad_names():
    for name in PUBLISHED:
        assert name in SPECS
    with pytest.raises(ValueError, match="valid names"):
        get_spec("gpt2-huge")


def test_shape_only_layers_refuse_to_run():
    import numpy as np

    from models.specs import _SwinBlock
    with pytest.raises(NotImplementedError, match="shape-only"):
        _SwinBlock(8, 2).forward(np.zeros((1, 4, 8)))
