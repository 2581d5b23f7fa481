"""Shape-only descriptions of models: :class:`ModelSpec` and its construction from a layer tree.

Below :mod:`models.network` and :mod:`models.specs` (imports only the layer and parameter
declarations), so a live :class:`~models.network.Model` and the paper-scale specs build the same
record without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layer_base import Layer
from .params import ParamLayout, ParamSpec

__all__ = ["ModelSpec", "layer_tree_specs", "spec_from_layers"]


def layer_tree_specs(root: Layer) -> list[ParamSpec]:
    """Parameter specs of a layer tree in forward order (pre-order traversal), no arrays."""
    return [
        ParamSpec(prefix + local, kind, shape)
        for prefix, layer in root.walk()
        for local, kind, shape, _ in layer._param_decls
    ]


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
    root : Layer or None
        The layer tree the spec was declared from (:func:`spec_from_layers`; shapes only, no
        arrays), for per-layer compute costs; not part of the spec's identity.
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    params: tuple[ParamSpec, ...]
    macs_per_sample: int
    root: Layer | None = field(default=None, compare=False, repr=False)

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
                     int(root.macs(input_shape)), root)
