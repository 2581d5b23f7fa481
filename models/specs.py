"""Shape-only model specifications (no arrays allocated) for closed-form communication models.

The big models of the PruneX evaluation (paper 000, Table 2) at CIFAR-10 resolution, in the common
CIFAR variant (3x3 stride-1 stem conv, no max-pool, global average pool, fc to 10 classes):

* ``resnet18``: basic blocks (2, 2, 2, 2); 11,173,962 parameters (Table 2: ~11 M);
* ``resnet152``: bottlenecks (3, 8, 36, 3); 58,156,618 parameters (Table 2: ~60 M);
* ``wide_resnet50_2``: bottlenecks (3, 4, 6, 3), inner width x2; 66,847,050 parameters
  (Table 2: ~69 M).

The paper's counts are the torchvision ImageNet ones (11.69 M, 60.19 M, 68.88 M).  The CIFAR
variant differs only in the stem (3x3 instead of 7x7: 64·3·(49 − 9) = 7,680 fewer) and in the
head (10 instead of 1000 classes: (d + 1)·990 fewer, d = 512 or 2048).
``resnet152_spec(num_classes=1000)`` gives 60,185,128 = 60,192,808 − 7,680.  The table's GFLOPs
(1.8, 11.3, 11.4) are ImageNet-224 multiply-accumulates; at 32x32 without max-pool the same
networks need 0.56, 3.72 and 3.68 GMACs per sample.
``flops_per_sample`` counts the forward pass of the conv and fc layers as 2 FLOPs per
multiply-accumulate (BN, ReLU, pooling excluded).

Paper-scale transformer and ImageNet specs, for ``commvol predict`` / ``scale``; each
count equals the published one (tested):

===================== ============== ========================================================
spec                  parameters     source of the count
===================== ============== ========================================================
``bert-base``         109,482,240    HF ``BertModel`` bert-base-uncased (paper: 110 M)
``bert-large``        335,141,888    HF ``BertModel`` bert-large-uncased (paper: 340 M)
``gpt2-large``        774,030,080    HF ``GPT2Model`` gpt2-large, tied head (774 M)
``gpt2-xl``           1,557,611,200  HF ``GPT2Model`` gpt2-xl, tied head (1558 M)
``vit-base``          86,567,656     torchvision ``vit_b_16`` (PacTrain's ViT-Base-16)
``vit-large``         304,326,632    torchvision ``vit_l_16``
``swin-t``            28,288,354     torchvision ``swin_t``
``llama-134m``        134,105,856    SDP paper (003) §4.2 / App. D: "134M LLaMA-style", 32 K
                                     vocabulary, context 2048 (width/depth assumed, below)
``vgg19``             143,667,240    torchvision ``vgg19``
``resnet152-imagenet`` 60,192,808    torchvision ``resnet152``
``resnet50-imagenet``  25,557,032    torchvision ``resnet50`` (v1.5)
===================== ============== ========================================================

SSFusion (004) Table "model size" gives the fp32 sizes of the same models (BERT-base 420 MB,
BERT-large 1.32 GB, GPT2-large 3.2 GB, GPT2-XL 6 GB, ViT-large 1.2 GB, VGG-19 548 MB,
ResNet-152 230 MB), which these counts reproduce (``4 · num_params`` bytes).  The SDP paper does
not state the 134 M model's shape; ``llama-134m`` is the common LLaMA layout that gives 134 M with
its 32 K vocabulary: width 768, 12 layers, 12 heads, SwiGLU width 2048, RMSNorm, untied
embeddings.  Language-model specs count one sample as one sequence of ``context`` tokens
(``macs_per_sample`` includes the attention products ``2 T^2 d`` per layer); ``num_classes`` is
the vocabulary (BERT: the pooled width).  Swin-T's window attention is a shape-only layer tree
(it declares the right tensors; it has no forward).
"""

from __future__ import annotations

from collections.abc import Callable

from .layers import Conv2d, Flatten, Layer, Linear, MaxPool2d, ReLU, Sequential, conv_output_size
from .modelspec import ModelSpec, layer_tree_specs, spec_from_layers
from .transformer import (
    MLP,
    LayerNorm,
    TokenPool,
    bert_layers,
    gpt_layers,
    llama_layers,
    vit_layers,
)
from .zoo import resnet_layers

__all__ = [
    "PUBLISHED_PARAMS",
    "SPECS",
    "ModelSpec",
    "bert_spec",
    "get_spec",
    "gpt2_spec",
    "llama_spec",
    "resnet18_spec",
    "resnet50_imagenet_spec",
    "resnet152_imagenet_spec",
    "resnet152_spec",
    "spec_from_layers",
    "spec_layers",
    "swin_t_spec",
    "vgg19_spec",
    "vit_spec",
    "wide_resnet50_2_spec",
]


def resnet18_spec(num_classes: int = 10, input_shape=(3, 32, 32)) -> ModelSpec:
    """ResNet-18, CIFAR variant: basic blocks (2, 2, 2, 2), planes 64-128-256-512."""
    root = resnet_layers(input_shape, num_classes, block="basic", depths=(2, 2, 2, 2),
                         planes=(64, 128, 256, 512))
    return spec_from_layers("resnet18", root, input_shape, num_classes)


def resnet152_spec(num_classes: int = 10, input_shape=(3, 32, 32)) -> ModelSpec:
    """ResNet-152, CIFAR variant: bottleneck blocks (3, 8, 36, 3), planes 64-128-256-512."""
    root = resnet_layers(input_shape, num_classes, block="bottleneck", depths=(3, 8, 36, 3),
                         planes=(64, 128, 256, 512))
    return spec_from_layers("resnet152", root, input_shape, num_classes)


def wide_resnet50_2_spec(num_classes: int = 10, input_shape=(3, 32, 32)) -> ModelSpec:
    """WideResNet-50-2, CIFAR variant: bottlenecks (3, 4, 6, 3) with inner width 2·planes."""
    root = resnet_layers(input_shape, num_classes, block="bottleneck", depths=(3, 4, 6, 3),
                         planes=(64, 128, 256, 512), base_width=128)
    return spec_from_layers("wide_resnet50_2", root, input_shape, num_classes)


# ---------------------------------------------------------------------------------------------
# ImageNet CNNs
# ---------------------------------------------------------------------------------------------
class _ShapeOnly(Layer):
    """A layer that only declares tensors and shapes (paper-scale specs); no forward."""

    def forward(self, x, training: bool = True):
        raise NotImplementedError(f"{type(self).__name__} is shape-only (used by model specs); "
                                  "it cannot run")

    backward = forward


class _PaddedMaxPool(_ShapeOnly):
    """``MaxPool2d(k, stride=s, padding=p)`` shapes (torchvision's ResNet stem pool)."""

    def __init__(self, kernel: int, stride: int, padding: int):
        super().__init__()
        self.k, self.s, self.p = kernel, stride, padding

    def output_shape(self, in_shape):
        C, H, W = in_shape
        return (C, conv_output_size(H, self.k, self.s, self.p),
                conv_output_size(W, self.k, self.s, self.p))


def _resnet_imagenet(name: str, depths, num_classes: int, input_shape) -> ModelSpec:
    """A bottleneck ResNet as torchvision builds it: 7x7 stride-2 stem conv, 3x3 stride-2
    max-pool, bottlenecks of ``depths`` (stride in the 3x3 conv: v1.5), global average pool,
    fc."""
    cifar = resnet_layers(input_shape, num_classes, block="bottleneck", depths=tuple(depths),
                          planes=(64, 128, 256, 512))
    C = int(input_shape[0])
    stem = [("conv1", Conv2d(C, 64, 7, stride=2, padding=3, bias=False)),
            *[(n, layer) for n, layer in cifar.children() if n in ("bn1", "relu")],
            ("maxpool", _PaddedMaxPool(3, 2, 1))]
    rest = [(n, layer) for n, layer in cifar.children() if n not in ("conv1", "bn1", "relu")]
    return spec_from_layers(name, Sequential(stem + rest), input_shape, num_classes)


def resnet152_imagenet_spec(num_classes: int = 1000, input_shape=(3, 224, 224)) -> ModelSpec:
    """ResNet-152 as torchvision builds it: bottlenecks (3, 8, 36, 3) (60,192,808 parameters at
    1000 classes)."""
    return _resnet_imagenet("resnet152-imagenet", (3, 8, 36, 3), num_classes, input_shape)


def resnet50_imagenet_spec(num_classes: int = 1000, input_shape=(3, 224, 224)) -> ModelSpec:
    """ResNet-50 v1.5 as torchvision builds it: bottlenecks (3, 4, 6, 3) (25,557,032 parameters
    at 1000 classes; 4.09 GMACs at 224x224).  The model of NVIDIA's published training rates
    (DeepLearningExamples), from which the devices' achieved fraction of peak is taken."""
    return _resnet_imagenet("resnet50-imagenet", (3, 4, 6, 3), num_classes, input_shape)


#: VGG-19 convolution widths, ``"M"`` = 2x2 max-pool (Simonyan & Zisserman 2015, config E)
VGG19_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
                512, 512, 512, 512, "M")


def vgg19_spec(num_classes: int = 1000, input_shape=(3, 224, 224)) -> ModelSpec:
    """VGG-19 (config E) as torchvision builds it: 16 conv3x3 (+bias, ReLU), five max-pools,
    classifier ``512·7·7 -> 4096 -> 4096 -> num_classes`` (dropout has no parameters)."""
    C, H, W = (int(s) for s in input_shape)
    layers: list = []
    i, ch = 0, C
    for v in VGG19_CONFIG:
        if v == "M":
            layers.append((f"features.{i}", MaxPool2d(2)))
            i += 1
        else:
            layers += [(f"features.{i}", Conv2d(ch, v, 3, padding=1)),
                       (f"features.{i + 1}", ReLU())]
            ch, i = v, i + 2
    flat = ch * (H // 32) * (W // 32)
    layers += [("flatten", Flatten()), ("classifier.0", Linear(flat, 4096)), ("relu6", ReLU()),
               ("classifier.3", Linear(4096, 4096)), ("relu7", ReLU()),
               ("classifier.6", Linear(4096, int(num_classes)))]
    return spec_from_layers("vgg19", Sequential(layers), input_shape, num_classes)


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------
def _sequence_spec(name: str, root: Layer, context: int, width: int) -> ModelSpec:
    shape = (int(context),)
    return ModelSpec(name, shape, int(width), tuple(layer_tree_specs(root)),
                     int(root.macs(shape)), root)


#: (dim, depth, heads) of the ViT sizes (Dosovitskiy et al. 2021, Table 1)
VIT_SIZES = {"base": (768, 12, 12), "large": (1024, 24, 16)}


def vit_spec(size: str = "large", num_classes: int = 1000, input_shape=(3, 224, 224),
             patch: int = 16) -> ModelSpec:
    """ViT-B/16 or ViT-L/16 (``[class]`` token, learned positions, MLP ratio 4, LN eps 1e-6)."""
    root = _vit_root(size, num_classes, input_shape, patch)
    return spec_from_layers(f"vit-{size}", root, input_shape, num_classes)


def _vit_root(size: str = "large", num_classes: int = 1000, input_shape=(3, 224, 224),
              patch: int = 16) -> Layer:
    if size not in VIT_SIZES:
        raise ValueError(f"unknown ViT size {size!r}; valid: {sorted(VIT_SIZES)}")
    dim, depth, heads = VIT_SIZES[size]
    return vit_layers(input_shape, num_classes, patch=patch, dim=dim, depth=depth, heads=heads,
                      mlp_ratio=4.0, pool="cls", eps=1e-6)


#: (dim, depth, heads) of BERT (Devlin et al. 2019, §3)
BERT_SIZES = {"base": (768, 12, 12), "large": (1024, 24, 16)}


def bert_spec(size: str = "base", context: int = 512, vocab: int = 30522) -> ModelSpec:
    """BERT encoder with pooler (HF ``BertModel``), FFN width ``4 dim``."""
    return _sequence_spec(f"bert-{size}", _bert_root(size, context, vocab), context,
                          BERT_SIZES[size][0])


def _bert_root(size: str = "base", context: int = 512, vocab: int = 30522) -> Layer:
    if size not in BERT_SIZES:
        raise ValueError(f"unknown BERT size {size!r}; valid: {sorted(BERT_SIZES)}")
    dim, depth, heads = BERT_SIZES[size]
    return bert_layers(context, vocab, dim=dim, depth=depth, heads=heads)


#: (dim, depth, heads) of GPT-2 (Radford et al. 2019, Table 2; HF configs)
GPT2_SIZES = {"small": (768, 12, 12), "medium": (1024, 24, 16), "large": (1280, 36, 20),
              "xl": (1600, 48, 25)}


def gpt2_spec(size: str = "large", context: int = 1024, vocab: int = 50257) -> ModelSpec:
    """GPT-2 (HF ``GPT2Model``): token + position embeddings, pre-norm blocks, final LayerNorm,
    head tied to the token table (no parameters of its own)."""
    root = _gpt2_root(size, context, vocab)
    return _sequence_spec(f"gpt2-{size}" if size != "small" else "gpt2", root, context, vocab)


def _gpt2_root(size: str = "large", context: int = 1024, vocab: int = 50257) -> Layer:
    if size not in GPT2_SIZES:
        raise ValueError(f"unknown GPT-2 size {size!r}; valid: {sorted(GPT2_SIZES)}")
    dim, depth, heads = GPT2_SIZES[size]
    return gpt_layers(context, vocab, dim=dim, depth=depth, heads=heads, tie=True)


def llama_spec(context: int = 2048, vocab: int = 32000, dim: int = 768, depth: int = 12,
               heads: int = 12, hidden: int = 2048) -> ModelSpec:
    """The SDP paper's 134 M LLaMA-style model (see the module docstring for the assumed shape)."""
    root = _llama_root(context, vocab, dim, depth, heads, hidden)
    return _sequence_spec("llama-134m", root, context, vocab)


def _llama_root(context: int = 2048, vocab: int = 32000, dim: int = 768, depth: int = 12,
                heads: int = 12, hidden: int = 2048) -> Layer:
    return llama_layers(context, vocab, dim=dim, depth=depth, heads=heads, hidden=hidden)


class _SwinPatchEmbed(_ShapeOnly):
    """Swin stem: ``Conv2d(C, dim, 4, stride=4)`` then LayerNorm:
    ``(C, H, W) -> (H/4, W/4, dim)``."""

    def __init__(self, in_ch: int, dim: int, patch: int = 4):
        super().__init__()
        self.proj = self.add_child("proj", Conv2d(in_ch, dim, patch, stride=patch))
        self.add_child("norm", LayerNorm(dim))

    def output_shape(self, in_shape):
        C, H, W = self.proj.output_shape(in_shape)
        return (H, W, C)

    def macs(self, in_shape):
        return self.proj.macs(in_shape)


class _WindowAttention(_ShapeOnly):
    """Swin (shifted) window attention: ``qkv``, relative position bias table
    ``((2M - 1)^2, heads)``, ``proj``; attention products over ``M x M`` windows."""

    def __init__(self, dim: int, heads: int, window: int):
        super().__init__()
        self.dim, self.window = dim, window
        self.declare_param("relative_position_bias_table", "bias",
                           ((2 * window - 1) ** 2, heads), "zeros")
        self.qkv = self.add_child("qkv", Linear(dim, 3 * dim))
        self.proj = self.add_child("proj", Linear(dim, dim))

    def output_shape(self, in_shape):
        return tuple(in_shape)

    def macs(self, in_shape):
        H, W, C = in_shape
        m2 = min(self.window, H) * min(self.window, W)
        return H * W * (4 * C * C + 2 * m2 * C)


class _SwinBlock(_ShapeOnly):
    """``x + WA(LN x)``, ``h + MLP(LN h)`` on ``(H, W, C)`` tokens (Liu et al. 2021, eq. 3).
    A residual block: SDP's block unit (the paper's d = 12 blocks of Swin-T, §4.1.2)."""

    residual_block = True

    def __init__(self, dim: int, heads: int, window: int = 7):
        super().__init__()
        self.add_child("norm1", LayerNorm(dim))
        self.attn = self.add_child("attn", _WindowAttention(dim, heads, window))
        self.add_child("norm2", LayerNorm(dim))
        self.mlp = self.add_child("mlp", MLP(dim, 4 * dim))

    def output_shape(self, in_shape):
        return tuple(in_shape)

    def macs(self, in_shape):
        H, W, C = in_shape
        return self.attn.macs(in_shape) + H * W * 8 * C * C


class _PatchMerging(_ShapeOnly):
    """Concatenate 2x2 neighbours, LayerNorm(4C), ``Linear(4C, 2C, bias=False)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.add_child("norm", LayerNorm(4 * dim))
        self.reduction = self.add_child("reduction", Linear(4 * dim, 2 * dim, bias=False))

    def output_shape(self, in_shape):
        H, W, C = in_shape
        return ((H + 1) // 2, (W + 1) // 2, 2 * C)

    def macs(self, in_shape):
        H, W, C = in_shape
        return ((H + 1) // 2) * ((W + 1) // 2) * 8 * C * C


def swin_t_spec(num_classes: int = 1000, input_shape=(3, 224, 224), window: int = 7) -> ModelSpec:
    """Swin-T (Liu et al. 2021): C = 96, depths (2, 2, 6, 2), heads (3, 6, 12, 24), window 7,
    patch merging between stages, final LayerNorm, mean pool, linear head (torchvision
    ``swin_t`` naming order)."""
    return spec_from_layers("swin-t", _swin_t_root(num_classes, input_shape, window),
                            input_shape, num_classes)


def _swin_t_root(num_classes: int = 1000, input_shape=(3, 224, 224), window: int = 7) -> Layer:
    dims, depths, heads = (96, 192, 384, 768), (2, 2, 6, 2), (3, 6, 12, 24)
    layers: list = [("features.0", _SwinPatchEmbed(int(input_shape[0]), dims[0]))]
    for s, (d, n, h) in enumerate(zip(dims, depths, heads)):
        layers.append((f"features.{2 * s + 1}",
                       Sequential([(str(b), _SwinBlock(d, h, window)) for b in range(n)])))
        if s < 3:
            layers.append((f"features.{2 * s + 2}", _PatchMerging(d)))
    layers += [("norm", LayerNorm(dims[-1])), ("avgpool", TokenPool("mean")),
               ("head", Linear(dims[-1], int(num_classes)))]
    return _FlattenTokens(Sequential(layers))


class _FlattenTokens(_ShapeOnly):
    """Wraps a Swin tree so its ``(H, W, C)`` token grid reaches the pool as ``(H W, C)``."""

    def __init__(self, root: Sequential):
        super().__init__()
        self._root = root
        for name, layer in root.children():
            self.add_child(name, layer)

    def output_shape(self, in_shape):
        for name, layer in self._root.children():
            if name == "avgpool":
                H, W, C = in_shape
                in_shape = (H * W, C)
            in_shape = layer.output_shape(in_shape)
        return in_shape

    def macs(self, in_shape):
        total = 0
        for name, layer in self._root.children():
            if name == "avgpool":
                H, W, C = in_shape
                in_shape = (H * W, C)
            total += layer.macs(in_shape)
            in_shape = layer.output_shape(in_shape)
        return total


#: published parameter counts of the paper-scale specs (see the module docstring for sources)
PUBLISHED_PARAMS = {
    "bert-base": 109_482_240, "bert-large": 335_141_888, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200, "vit-base": 86_567_656, "vit-large": 304_326_632,
    "swin-t": 28_288_354, "llama-134m": 134_105_856, "vgg19": 143_667_240,
    "resnet152-imagenet": 60_192_808, "resnet50-imagenet": 25_557_032,
}


#: spec name -> ``fn(**kwargs) -> ModelSpec``; every default gives the published shape
#: (the CIFAR ResNets: ``fn(num_classes=10, input_shape=(3, 32, 32))``)
SPECS: dict[str, Callable[..., ModelSpec]] = {
    "resnet18": resnet18_spec,
    "resnet152": resnet152_spec,
    "wide_resnet50_2": wide_resnet50_2_spec,
    "resnet152-imagenet": resnet152_imagenet_spec,
    "resnet50-imagenet": resnet50_imagenet_spec,
    "vgg19": vgg19_spec,
    "vit-base": lambda **kw: vit_spec("base", **kw),
    "vit-large": lambda **kw: vit_spec("large", **kw),
    "swin-t": swin_t_spec,
    "bert-base": lambda **kw: bert_spec("base", **kw),
    "bert-large": lambda **kw: bert_spec("large", **kw),
    "gpt2-large": lambda **kw: gpt2_spec("large", **kw),
    "gpt2-xl": lambda **kw: gpt2_spec("xl", **kw),
    "llama-134m": llama_spec,
}


#: spec name -> ``fn(**kwargs) -> Layer``: the layer tree a transformer spec is declared from
#: (the same keyword arguments as its entry of :data:`SPECS`)
SPEC_LAYERS: dict[str, Callable[..., Layer]] = {
    "vit-base": lambda **kw: _vit_root("base", **kw),
    "vit-large": lambda **kw: _vit_root("large", **kw),
    "swin-t": _swin_t_root,
    "bert-base": lambda **kw: _bert_root("base", **kw),
    "bert-large": lambda **kw: _bert_root("large", **kw),
    "gpt2-large": lambda **kw: _gpt2_root("large", **kw),
    "gpt2-xl": lambda **kw: _gpt2_root("xl", **kw),
    "llama-134m": _llama_root,
}


def spec_layers(name: str, **kwargs) -> Layer:
    """The layer tree of the transformer spec ``name`` (what a plan that follows the model's
    blocks, e.g. SDP's, reads; shapes only).

    Raises
    ------
    ValueError
        For a spec without one here (the CIFAR ResNets are built by ``models.resnet``).
    """
    if name not in SPEC_LAYERS:
        raise ValueError(f"spec {name!r} has no layer tree here; the transformer specs that do: "
                         f"{sorted(SPEC_LAYERS)}")
    return SPEC_LAYERS[name](**kwargs)


def get_spec(name: str, **kwargs) -> ModelSpec:
    """``SPECS[name](**kwargs)``; ValueError listing the valid names for an unknown one."""
    if name not in SPECS:
        raise ValueError(f"unknown model spec {name!r}; valid names: {sorted(SPECS)}")
    return SPECS[name](**kwargs)
