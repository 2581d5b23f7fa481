"""What each block of a generated program computes, and how long it takes on a device.

A program generated from a plan at paper scale (:mod:`commvol.job`) has the blocks a run has:
the model's units forward and backward, the plan's compute items
(:class:`substrate.calls.Work`: a selection, a packing, a decode, the ADMM updates), the
optimizer.  Each costs

* on the **device model** (:class:`DeviceModel`, a cluster file's device): its FLOPs at the
  device's float32 peak times the achieved fraction (``efficiency``), or its bytes at the
  memory bandwidth, whichever is longer (a roofline), plus a launch overhead per kernel; or
* a **measured time per sample** (:meth:`DeviceModel.from_seconds_per_sample`): a forward and
  backward pass that took ``t`` seconds per sample sets the rate the layers' FLOPs run at
  (the FLOPs then only spread ``t`` over the layers); compute items and the optimizer still
  stream their bytes at the device's memory bandwidth.

The units come from the model's layer tree (:func:`units_for_spec`: conv and fc ``2 x MACs``,
BatchNorm, ReLU, pooling and residual additions per element; backward ``2 x`` forward; a
kernel per layer forward, two per layer with parameters backward), or, for specs without one
(transformers, ImageNet variants), one unit per parameter tensor with the spec's FLOPs split by
size (an assumption, stated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models import MODELS, build_model
from models.network import BACKWARD_FLOP_FACTOR, compute_units
from models.zoo import resnet_layers
from simulation.cluster import Device

from .specs import DATASET_SHAPES, MODEL_ALIASES, SPEC_ARCH

__all__ = ["ITEMSIZE", "OPTIMIZER_BYTES_PER_PARAM", "OPTIMIZER_FLOPS_PER_PARAM",
           "OPTIMIZER_KERNELS", "DeviceModel", "Unit", "units_for_spec"]

ITEMSIZE = 4
#: SGD with momentum and weight decay per parameter: ``d = g + wd θ``, ``v = μ v + d``,
#: ``θ -= lr v`` (6 FLOPs), reading ``θ, g, v`` and writing ``θ, v`` (5 float32)
OPTIMIZER_FLOPS_PER_PARAM = 6
OPTIMIZER_BYTES_PER_PARAM = 5 * ITEMSIZE
#: kernels of one optimizer step: PyTorch's multi-tensor ("foreach") SGD launches a few kernels
#: over all tensors (weight decay, momentum, update), not one per tensor
OPTIMIZER_KERNELS = 3


@dataclass(frozen=True)
class Unit:
    """A compute unit: name, its flat-gradient slice ``[lo, hi)`` (backward order), and per
    sample its forward/backward FLOPs and bytes (activations read and written), its parameter
    bytes (read once a pass) and its kernels forward and backward."""

    name: str
    lo: int
    hi: int
    forward_flops: float
    backward_flops: float
    activation_bytes: float = 0.0
    param_bytes: float = 0.0
    forward_kernels: int = 1
    backward_kernels: int = 2


def _kernels(layer) -> tuple[int, int]:
    """Kernels of a unit's forward and backward: one per leaf layer forward (and one for a
    residual block's own addition and activation), two per leaf with parameters backward (input
    and weight gradients), one per leaf without."""
    leaves = [sub for _, sub in layer.walk() if not sub.children()]
    own = 0 if not layer.children() or type(layer).__name__ == "Sequential" else 1
    fwd = len(leaves) + own
    bwd = sum(2 if sub._param_decls else 1 for sub in leaves) + own
    return fwd, bwd


def units_for_spec(spec, model: str, dataset: str = "digits") -> tuple[list[Unit], str]:
    """Per-unit FLOPs, bytes and kernels of ``spec`` and how they were obtained (see the module
    docstring)."""
    canon = MODEL_ALIASES.get(model, model)
    root = None
    if canon in SPEC_ARCH and spec.name == canon:
        root = resnet_layers(spec.input_shape, spec.num_classes, **SPEC_ARCH[canon])
    elif model in MODELS and dataset in DATASET_SHAPES:
        shape, classes = DATASET_SHAPES[dataset]
        root = build_model(model, shape, classes).root
    elif getattr(spec, "root", None) is not None:   # a paper-scale spec's own layer tree
        root = spec.root
    layout = spec.layout
    if root is not None:
        us = compute_units(root, spec.input_shape, ITEMSIZE, layout=layout)
        units = [Unit(u.name, u.lo, u.hi, float(u.forward_flops), float(u.backward_flops),
                      float(u.activation_bytes), float(u.param_bytes), *_kernels(u.layer))
                 for u in us]
        if sum(u.hi - u.lo for u in units) == layout.total:
            return units, ("per compute unit from the layer tree (models.network.compute_units: "
                           "conv/fc 2 x MACs, BN 7, ReLU 1 per element, ...), backward "
                           f"{BACKWARD_FLOP_FACTOR:g} x forward, a kernel per layer")
    total = float(spec.flops_per_sample)
    units = []
    for p in spec.params:   # forward order
        lo = layout.offsets[p.name]
        f = total * p.size / layout.total
        units.append(Unit(p.name, lo, lo + p.size, f, BACKWARD_FLOP_FACTOR * f, 0.0,
                          float(ITEMSIZE * p.size)))
    return units, ("no layer tree for this spec: the spec's forward FLOPs split over its "
                   f"{len(units)} parameter tensors in proportion to their sizes, backward "
                   f"{BACKWARD_FLOP_FACTOR:g} x forward, a kernel per tensor")


@dataclass(frozen=True)
class DeviceModel:
    """How long a block takes on a device (see the module docstring).

    Attributes
    ----------
    device : simulation.cluster.Device
        Peak, memory bandwidth, launch overhead and achieved fraction of peak.
    layer_tflops : float or None
        The rate of the layers' FLOPs when a measured time per sample sets it
        (:meth:`from_seconds_per_sample`); ``None``: the device's ``peak x efficiency``.
    how : str
        Where the numbers come from (the summary prints it per block kind).
    """

    device: Device
    layer_tflops: float | None = None
    how: str = ""

    @classmethod
    def from_seconds_per_sample(cls, units, seconds: float, device: Device,
                                how: str = "") -> DeviceModel:
        """The rate at which forward + backward of one sample of ``units`` takes
        ``seconds`` (a measured or stated time), launch overheads aside."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"--compute-s-per-sample must be a finite number > 0, got "
                             f"{seconds!r}")
        flops = sum(u.forward_flops + u.backward_flops for u in units)
        return cls(device, flops / seconds / 1e12, how)

    @property
    def tflops(self) -> float:
        """The rate of the layers' FLOPs."""
        if self.layer_tflops is not None:
            return self.layer_tflops
        return self.device.peak_tflops * self.device.efficiency

    def seconds(self, flops: float, nbytes: float = 0.0, kernels: int = 0) -> float:
        """``max(FLOPs / rate, bytes / bandwidth) + kernels x launch`` (a roofline)."""
        t = max(float(flops) / (self.tflops * 1e12),
                float(nbytes) / (self.device.memory_gbs * 1e9))
        return t + kernels * self.device.launch_us * 1e-6

    def forward(self, u: Unit, batch: float) -> float:
        return self.seconds(batch * u.forward_flops, batch * u.activation_bytes + u.param_bytes,
                            u.forward_kernels)

    def backward(self, u: Unit, batch: float) -> float:
        return self.seconds(batch * u.backward_flops,
                            2 * (batch * u.activation_bytes + u.param_bytes),
                            u.backward_kernels)

    def optimizer(self, num_params: int) -> float:
        return self.seconds(OPTIMIZER_FLOPS_PER_PARAM * num_params,
                            OPTIMIZER_BYTES_PER_PARAM * num_params, OPTIMIZER_KERNELS)

    def work(self, item) -> float:
        """A plan's compute item (:class:`substrate.calls.Work`)."""
        return self.seconds(item.flops, item.nbytes, getattr(item, "kernels", 1))

    def seconds_per_sample(self, units) -> float:
        """Forward + backward of one sample (FLOPs only)."""
        return sum(u.forward_flops + u.backward_flops for u in units) / (self.tflops * 1e12)
