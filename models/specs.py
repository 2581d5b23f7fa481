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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .layers import Layer
from .network import layer_tree_specs
from .params import ParamLayout, ParamSpec
from .zoo import resnet_layers

__all__ = ["ModelSpec", "spec_from_layers", "resnet18_spec", "resnet152_spec",
           "wide_resnet50_2_spec", "SPECS", "get_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """Names, kinds and shapes of a model's trainable tensors, plus its forward cost.

    Attributes
    ----------
    name : str
    input_shape : tuple of int
        Per-sample input, e.g. ``(3, 32, 32)``.
    num_classes : int
    params : tuple of ParamSpec
        In **forward** order; ``layout.names`` gives the backward (flat-buffer) order.
    macs_per_sample : int
        Forward multiply-accumulates of conv and fc layers per sample.
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    params: tuple[ParamSpec, ...]
    macs_per_sample: int

    @property
    def num_params(self) -> int:
        """Total trainable scalars (conv + fc + bias + BN affine)."""
        return sum(p.size for p in self.params)

    @property
    def flops_per_sample(self) -> int:
        """Forward FLOPs per sample, ``2 * macs_per_sample``."""
        return 2 * self.macs_per_sample

    @property
    def layout(self) -> ParamLayout:
        """Flat-buffer layout (same as the one a built :class:`~models.network.Model` uses)."""
        return ParamLayout(self.params)

    def of_kind(self, *kinds: str) -> tuple[ParamSpec, ...]:
        """Specs whose kind is in ``kinds`` (forward order), e.g. ``of_kind("conv")``."""
        return tuple(p for p in self.params if p.kind in kinds)

    def as_tuples(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``[(name, kind, shape), ...]`` in forward order."""
        return [(p.name, p.kind, p.shape) for p in self.params]


def spec_from_layers(name: str, root: Layer, input_shape, num_classes: int | None) -> ModelSpec:
    """Build a :class:`ModelSpec` from a layer tree (declarations only, nothing allocated).

    ``num_classes=None`` skips the output-width check (a bare block); the spec then records
    the width of a 1-D output, or 0.
    """
    input_shape = tuple(int(s) for s in input_shape)
    out = root.output_shape(input_shape)
    if num_classes is None:
        num_classes = out[0] if len(out) == 1 else 0
    elif out != (int(num_classes),):
        raise ValueError(f"layer tree output {out} does not match num_classes={num_classes}")
    return ModelSpec(name, input_shape, int(num_classes), tuple(layer_tree_specs(root)),
                     int(root.macs(input_shape)))


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


#: spec name -> ``fn(num_classes=10, input_shape=(3, 32, 32)) -> ModelSpec``
SPECS: dict[str, Callable[..., ModelSpec]] = {
    "resnet18": resnet18_spec,
    "resnet152": resnet152_spec,
    "wide_resnet50_2": wide_resnet50_2_spec,
}


def get_spec(name: str, **kwargs) -> ModelSpec:
    """``SPECS[name](**kwargs)``; ValueError listing the valid names for an unknown one."""
    if name not in SPECS:
        raise ValueError(f"unknown model spec {name!r}; valid names: {sorted(SPECS)}")
    return SPECS[name](**kwargs)
