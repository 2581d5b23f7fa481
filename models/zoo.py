"""Model factories (MLP, small CNN, ResNet, ViT, GPT) and the ``MODELS`` registry keyed by
``--model``.

Every factory has the signature::

    factory(input_shape, num_classes, *, xp=numpy, dtype=numpy.float32, seed=0, **arch) -> Model

and the matching ``*_layers(input_shape, num_classes, **arch)`` builds the bare layer tree (no
arrays), which :mod:`models.specs` uses for shape-only specifications.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import numpy as np

from .layers import (
    BasicBlock,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    Flatten,
    GlobalAvgPool2d,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
)
from .network import Model
from .transformer import gpt, vit

__all__ = [
    "MODELS",
    "build_model",
    "cnn",
    "cnn_layers",
    "mlp",
    "mlp_layers",
    "resnet",
    "resnet_layers",
]


def _check_shape(input_shape, ndim: int | None, what: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in input_shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{what} needs input_shape with {ndim} dims (C, H, W), got {shape}")
    if any(s <= 0 for s in shape):
        raise ValueError(f"input_shape must be positive, got {shape}")
    return shape


def mlp_layers(input_shape, num_classes: int, hidden: Sequence[int] | int = (128, 64)) -> Layer:
    """Flatten → [Linear → ReLU] per hidden width → Linear(num_classes).

    Parameters
    ----------
    input_shape : tuple of int
        Per-sample shape (flattened by the first layer).
    num_classes : int
    hidden : sequence of int, or int
        Hidden widths (empty: a linear classifier).
    """
    shape = _check_shape(input_shape, None, "mlp")
    if isinstance(hidden, int):
        hidden = (hidden,)
    widths = [prod(shape), *[int(h) for h in hidden], int(num_classes)]
    if any(w <= 0 for w in widths):
        raise ValueError(f"mlp widths must be positive, got hidden={tuple(hidden)}")
    layers: list = [("flatten", Flatten())]
    for i in range(len(widths) - 1):
        layers.append((f"fc{i + 1}", Linear(widths[i], widths[i + 1])))
        if i < len(widths) - 2:
            layers.append((f"relu{i + 1}", ReLU()))
    return Sequential(layers)


def cnn_layers(input_shape, num_classes: int, channels: Sequence[int] = (16, 32),
               hidden: int = 64) -> Layer:
    """Small CNN for 8x8 digits (any H, W >= 2).

    conv3x3(C→c1, pad 1) → ReLU → conv3x3(c1→c2, pad 1) → ReLU → maxpool 2 → flatten →
    fc(c2·H/2·W/2 → hidden) → ReLU → fc(hidden → num_classes).

    Parameters
    ----------
    input_shape : (C, H, W)
    num_classes : int
    channels : (c1, c2)
        Output channels of the two convolutions.
    hidden : int
        Width of the hidden fully connected layer.
    """
    C, H, W = _check_shape(input_shape, 3, "cnn")
    if len(tuple(channels)) != 2:
        raise ValueError(f"cnn needs two conv widths, e.g. channels=(16, 32); got {channels}")
    c1, c2 = (int(c) for c in channels)
    if H < 2 or W < 2:
        raise ValueError(f"cnn needs H, W >= 2 for its 2x2 max-pool, got {(H, W)}")
    flat = c2 * (H // 2) * (W // 2)
    return Sequential([
        ("conv1", Conv2d(C, c1, 3, padding=1)),
        ("relu1", ReLU()),
        ("conv2", Conv2d(c1, c2, 3, padding=1)),
        ("relu2", ReLU()),
        ("pool", MaxPool2d(2)),
        ("flatten", Flatten()),
        ("fc1", Linear(flat, int(hidden))),
        ("relu3", ReLU()),
        ("fc2", Linear(int(hidden), int(num_classes))),
    ])


def resnet_layers(input_shape, num_classes: int, *, block: str = "basic",
                  depths: Sequence[int] = (1, 1, 1), planes: Sequence[int] = (16, 32, 64),
                  stem_channels: int | None = None, base_width: int = 64) -> Layer:
    """CIFAR-style ResNet layer tree: 3x3 stem conv (stride 1, no max-pool) → stages → GAP → fc.

    Parameters
    ----------
    input_shape : (C, H, W)
        Any resolution (8x8, 28x28, 32x32, ...): the head is a global average pool.
    num_classes : int
    block : {"basic", "bottleneck"}
    depths : sequence of int, or int
        Blocks per stage (an int: the same for every stage).  ResNet-18: (2, 2, 2, 2);
        ResNet-152: (3, 8, 36, 3).
    planes : sequence of int
        Planes per stage (stage output channels are ``planes * expansion``).  Stage 1 has stride
        1, later stages stride 2.
    stem_channels : int, optional
        Output channels of the stem conv (default ``planes[0]``).
    base_width : int, default 64
        Bottleneck inner width is ``planes * base_width / 64`` (WideResNet-50-2: 128).

    Names follow torchvision: ``conv1``, ``bn1``, ``layer{s}.{b}.conv1`` ..., ``fc``.
    """
    C, _, _ = _check_shape(input_shape, 3, "resnet")
    if block not in ("basic", "bottleneck"):
        raise ValueError(f"block must be 'basic' or 'bottleneck', got {block!r}")
    if isinstance(planes, int):
        planes = (planes,)
    if isinstance(depths, int):
        depths = (depths,) * len(planes)
    depths, planes = [int(d) for d in depths], [int(p) for p in planes]
    if len(depths) != len(planes) or not depths or min(depths) < 1 or min(planes) < 1:
        raise ValueError(f"depths and planes must be equally long positive sequences, got "
                         f"depths={depths}, planes={planes}")
    stem = planes[0] if stem_channels is None else int(stem_channels)
    layers: list = [
        ("conv1", Conv2d(C, stem, 3, stride=1, padding=1, bias=False)),
        ("bn1", BatchNorm2d(stem)),
        ("relu", ReLU()),
    ]
    in_ch = stem
    for s, (depth, p) in enumerate(zip(depths, planes)):
        blocks = []
        for b in range(depth):
            stride = 1 if (s == 0 or b > 0) else 2
            if block == "basic":
                blk: Layer = BasicBlock(in_ch, p, stride)
            else:
                blk = Bottleneck(in_ch, p, stride, width=p * base_width // 64)
            blocks.append((str(b), blk))
            in_ch = blk.out_channels
        layers.append((f"layer{s + 1}", Sequential(blocks)))
    layers += [("avgpool", GlobalAvgPool2d()), ("fc", Linear(in_ch, int(num_classes)))]
    return Sequential(layers)


def mlp(input_shape, num_classes: int, *, xp=np, dtype=np.float32, seed: int = 0,
        hidden: Sequence[int] = (128, 64)) -> Model:
    """Multi-layer perceptron (see :func:`mlp_layers`)."""
    return Model(mlp_layers(input_shape, num_classes, hidden), input_shape, num_classes,
                 xp=xp, dtype=dtype, seed=seed, name="mlp")


def cnn(input_shape, num_classes: int, *, xp=np, dtype=np.float32, seed: int = 0,
        channels: Sequence[int] = (16, 32), hidden: int = 64) -> Model:
    """Small CNN for 8x8 digits (see :func:`cnn_layers`)."""
    return Model(cnn_layers(input_shape, num_classes, channels, hidden), input_shape,
                 num_classes, xp=xp, dtype=dtype, seed=seed, name="cnn")


def resnet(input_shape, num_classes: int, *, xp=np, dtype=np.float32, seed: int = 0,
           block: str = "basic", depths: Sequence[int] = (1, 1, 1),
           planes: Sequence[int] = (16, 32, 64), stem_channels: int | None = None,
           base_width: int = 64) -> Model:
    """ResNet with configurable width/depth (see :func:`resnet_layers`)."""
    root = resnet_layers(input_shape, num_classes, block=block, depths=depths, planes=planes,
                         stem_channels=stem_channels, base_width=base_width)
    return Model(root, input_shape, num_classes, xp=xp, dtype=dtype, seed=seed, name="resnet")


#: ``--model`` name -> factory ``(input_shape, num_classes, *, xp, dtype, seed, **arch) -> Model``
#: (``vit``: images, e.g. the 8x8 digits; ``gpt``: byte windows of the ``text`` dataset)
MODELS: dict[str, Callable[..., Model]] = {"mlp": mlp, "cnn": cnn, "resnet": resnet,
                                           "vit": vit, "gpt": gpt}


def build_model(name: str, input_shape, num_classes: int, **kwargs) -> Model:
    """Build ``MODELS[name](input_shape, num_classes, **kwargs)``.

    Raises
    ------
    ValueError
        For an unknown name; the message lists the valid names.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {sorted(MODELS)}")
    return MODELS[name](input_shape, num_classes, **kwargs)
