"""The :class:`Model`: a layer tree bound to one flat parameter and one flat gradient vector."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .layers import (
    BatchNorm2d,
    Conv2d,
    Flatten,
    GlobalAvgPool2d,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
    _Residual,
    softmax_cross_entropy,
)
from .modelspec import layer_tree_specs, spec_from_layers
from .params import FlatTensors, ParamLayout

__all__ = [
    "BACKWARD_FLOP_FACTOR",
    "ComputeUnit",
    "Model",
    "compute_units",
    "layer_flops",
    "layer_tree_specs",
]

#: Backward FLOPs per forward FLOP of a layer (input gradient + weight gradient, each about one
#: forward's worth: the usual 2x of Kaplan et al. 2020, §2.1).  An assumption of the FLOP model.
BACKWARD_FLOP_FACTOR = 2.0
#: FLOPs per element of the elementwise layers in the forward pass (assumptions of the FLOP
#: model): BatchNorm in training mode = mean + variance (3) + normalize (2) + scale/shift (2).
ELEMENTWISE_FLOPS = {BatchNorm2d: 7, ReLU: 1, GlobalAvgPool2d: 1, Flatten: 0}
#: The same for layers of other modules, by class name (no import: models.transformer builds on
#: this module): LayerNorm = mean + variance (3) + normalize (2) + scale/shift (2) + 1;
#: RMSNorm 5; GELU (tanh form) about 8; Tanh 4.
ELEMENTWISE_FLOPS_BY_NAME = {"LayerNorm": 8, "RMSNorm": 5, "GELU": 8, "Tanh": 4}


def layer_flops(layer: Layer, in_shape: tuple[int, ...]) -> int:
    """Forward FLOPs per sample of ``layer`` on per-sample input ``in_shape``.

    Convolution and fully connected layers: ``2 * macs`` (one multiply and one add per MAC, as
    :meth:`models.specs.ModelSpec.flops_per_sample`); elementwise layers:
    :data:`ELEMENTWISE_FLOPS` per input element; max pooling: one comparison per window element
    of each output; residual blocks: their branches plus the addition and the ReLU; any other
    layer (attention, transformer blocks, embeddings): ``2 * macs`` of its own ``macs()``.
    """
    if isinstance(layer, (Conv2d, Linear)):
        return 2 * int(layer.macs(in_shape))
    if isinstance(layer, Sequential):
        total, shape = 0, in_shape
        for _, child in layer.children():
            total += layer_flops(child, shape)
            shape = child.output_shape(shape)
        return total
    if isinstance(layer, _Residual):
        total, shape = 0, in_shape
        for child in layer._main:
            total += layer_flops(child, shape)
            shape = child.output_shape(shape)
        if layer.projection:
            total += layer_flops(layer.shortcut, in_shape)
        return total + 2 * int(np.prod(shape))          # h + s, then ReLU
    if isinstance(layer, MaxPool2d):
        kh, kw = layer.kernel_size
        return kh * kw * int(np.prod(layer.output_shape(in_shape)))
    for cls, per_elem in ELEMENTWISE_FLOPS.items():
        if isinstance(layer, cls):
            return per_elem * int(np.prod(in_shape))
    per_elem = ELEMENTWISE_FLOPS_BY_NAME.get(type(layer).__name__)
    if per_elem is not None:
        return per_elem * int(np.prod(in_shape))
    # anything else (embeddings, attention, transformer blocks): 2 FLOPs per MAC of its
    # ``macs()``, which for attention includes Q K^T and A V (2 T^2 d MACs)
    return 2 * int(layer.macs(in_shape))


@dataclass(frozen=True)
class ComputeUnit:
    """One top-level layer or block as the recorder sees it (nested ``Sequential`` containers
    are opened, so a ResNet's units are its stem layers, its residual blocks and its head).

    ``lo:hi`` is the slice of the flat parameter/gradient vector holding the unit's parameters
    (contiguous: the layout is the reverse pre-order; ``lo == hi`` when it has none).  FLOPs and
    bytes are per sample; bytes are the activations read and written plus the parameters read
    (itemsize of the model's dtype), for a roofline's memory term.
    """

    name: str
    layer: Layer
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    lo: int
    hi: int
    forward_flops: int
    backward_flops: int
    activation_bytes: int
    param_bytes: int


def compute_units(root: Layer, input_shape, itemsize: int = 4,
                  layout: ParamLayout | None = None) -> list[ComputeUnit]:
    """The :class:`ComputeUnit` s of a layer tree on per-sample ``input_shape``, in forward order,
    without allocating parameters (so a paper-scale tree, e.g. ResNet-152, costs only its
    shapes): for the FLOP model of the job simulation at any scale (:mod:`commvol.workload`)."""
    layout = layout if layout is not None else ParamLayout(layer_tree_specs(root))
    units: list[ComputeUnit] = []

    def visit(layer: Layer, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(layer, Sequential) and layer.children():
            for local, child in layer.children():
                shape = visit(child, f"{name}.{local}" if name else local, shape)
            return shape
        prefix = f"{name}." if name else ""
        names = [p + local for p, sub in layer.walk(prefix) for local, *_ in sub._param_decls]
        offs = [(layout.offsets[n], layout.offsets[n] + layout.sizes[n]) for n in names]
        lo = min((a for a, _ in offs), default=0)
        hi = max((b for _, b in offs), default=0)
        if offs and hi - lo != sum(b - a for a, b in offs):
            raise RuntimeError(f"parameters of unit {name!r} are not contiguous")
        out = layer.output_shape(shape)
        fwd = layer_flops(layer, shape)
        units.append(ComputeUnit(
            name=name or type(layer).__name__, layer=layer, in_shape=shape, out_shape=out,
            lo=lo, hi=hi, forward_flops=fwd, backward_flops=int(BACKWARD_FLOP_FACTOR * fwd),
            activation_bytes=(int(np.prod(shape)) + int(np.prod(out))) * int(itemsize),
            param_bytes=(hi - lo) * int(itemsize)))
        return out

    visit(root, "", tuple(int(s) for s in input_shape))
    return units


def _wrap_unit(u: ComputeUnit, rec) -> None:
    """Shadow ``u.layer.forward``/``backward`` with instance attributes that report to ``rec``
    (see :attr:`Model.recorder`)."""
    layer = u.layer
    fwd = type(layer).forward.__get__(layer)
    bwd = type(layer).backward.__get__(layer)

    def forward(x, training: bool = True):
        if not training:
            return fwd(x, training)
        n = x.shape[0]
        with rec.layer("forward", u.name, n * u.forward_flops,
                       n * u.activation_bytes + u.param_bytes):
            return fwd(x, training)

    subs = [sub for _, sub in layer.walk()]

    def backward(dy):
        # the unit's ready notifications are held until its event has closed: the hook (a
        # strategy handing a bucket to the network, or preparing it) runs between units, so
        # what it computes is not charged to this unit
        held: list = []
        hooks = [sub._ready for sub in subs]
        for sub, hook in zip(subs, hooks):
            if hook is not None:
                sub._ready = lambda name, hook=hook: held.append((hook, name))
        n = dy.shape[0]
        try:
            with rec.layer("backward", u.name, n * u.backward_flops,
                           2 * (n * u.activation_bytes + u.param_bytes)):
                dx = bwd(dy)
        finally:
            for sub, hook in zip(subs, hooks):
                sub._ready = hook
        rec.grads_ready(u.name, u.lo, u.hi)
        for hook, name in held:
            hook(name)
        return dx

    layer.forward = forward
    layer.backward = backward


class Model:
    """A network whose parameters live in one flat vector and gradients in another.

    Parameters
    ----------
    root : Layer
        The layer tree (usually a :class:`~models.layers.Sequential`).
    input_shape : tuple of int
        Per-sample input shape, e.g. ``(1, 8, 8)`` or ``(64,)``.
    num_classes : int or None
        Width of the output; ``None`` skips the output-shape check (a bare layer or block wrapped
        for testing or feature extraction).
    xp : module, default numpy
        ``numpy`` or ``cupy``: where the flat vectors live.
    dtype : dtype, default float32
        ``float64`` for gradient checks.
    seed : int, default 0
        Seed of the initializer (``numpy.random.default_rng(seed)``); identical on all ranks, so
        every rank starts from the same model.
    name : str
        Model name (for summaries).

    Attributes
    ----------
    layout : ParamLayout
        Names, kinds, shapes, offsets (flat layout = backward order).
    params : FlatTensors
        ``params.flat`` is the trainable vector; ``params[name]`` a view into it.
    grads : FlatTensors
        Same layout for the gradients, written by :meth:`backward`.
    buffers : dict of str -> array
        Non-trainable state (BatchNorm ``running_mean`` / ``running_var``), not in ``params``.
    """

    def __init__(self, root: Layer, input_shape, num_classes: int | None, *, xp=np,
                 dtype=np.float32, seed: int = 0, name: str = "model"):
        if not isinstance(root, Layer):
            raise ValueError(f"root must be a Layer, got {type(root).__name__}")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise ValueError(f"dtype must be a floating type (float32/float64), got {dtype}")
        self.root = root
        self.input_shape = tuple(int(s) for s in input_shape)
        self.num_classes = None if num_classes is None else int(num_classes)
        self.xp, self.dtype, self.seed, self.name = xp, dtype, int(seed), name
        out = root.output_shape(self.input_shape)
        if self.num_classes is not None and out != (self.num_classes,):
            raise ValueError(f"model output shape {out} does not match num_classes="
                             f"{self.num_classes}; fix the last layer's width")

        self.layout = ParamLayout(layer_tree_specs(root))
        host = np.zeros(self.layout.total, dtype=dtype)
        rng = np.random.default_rng(self.seed)
        host_views = FlatTensors(self.layout, host)
        for prefix, layer in root.walk():
            for local, _kind, shape, init in layer._param_decls:
                view = host_views[prefix + local]
                if init == "he":
                    fan_in = int(np.prod(shape[1:]))
                    view[...] = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
                elif init == "ones":
                    view[...] = 1.0
        self.params = FlatTensors(self.layout, xp.asarray(host))
        self.grads = FlatTensors(self.layout, xp.zeros(self.layout.total, dtype=dtype))
        self.buffers: dict = {}
        for prefix, layer in root.walk():
            ready_names = []
            for local, _kind, _shape, _ in layer._param_decls:
                layer.P[local] = self.params[prefix + local]
                layer.G[local] = self.grads[prefix + local]
                ready_names.append(prefix + local)
            layer._ready_names = tuple(reversed(ready_names))
            layer._ready = self._on_ready
            for local, shape, fill in layer._buffer_decls:
                buf = xp.full(shape, fill, dtype=dtype)
                self.buffers[prefix + local] = buf
                layer.B[local] = buf
        self._ready_cb: Callable[[str], None] | None = None
        self._units: list[ComputeUnit] | None = None
        self._recorder = None

    # -- basic info -----------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Number of trainable scalars (length of ``params.flat``)."""
        return self.layout.total

    def macs_per_sample(self) -> int:
        """Forward multiply-accumulates per sample (conv + fc)."""
        return self.root.macs(self.input_shape)

    def spec(self):
        """Shape-only :class:`~models.specs.ModelSpec` of this model."""
        return spec_from_layers(self.name, self.root, self.input_shape, self.num_classes)

    @property
    def recorder(self):
        """Optional per-layer event recorder (e.g. :class:`simulation.compute.LayerEvents`).

        While one is set, the forward and backward of every :class:`ComputeUnit` report to it:
        ``recorder.layer(phase, name, flops, nbytes)`` is a context manager around the unit's
        ``forward`` (phase ``"forward"``, training mode only) and ``backward`` (``"backward"``),
        with the unit's FLOPs and bytes for the whole batch, and
        ``recorder.grads_ready(name, lo, hi)`` follows the backward of a unit whose gradients
        are ``grads.flat[lo:hi]`` (so in backward order).  :meth:`loss_and_grad` also reports the
        loss (``"forward", "loss"``).  The units' own ``forward``/``backward`` are wrapped on the
        instances, so every caller (``Model.forward``, a subclass calling ``root.forward``)
        is seen.  ``None`` (the default) removes the wrappers: the code path and the numerics
        are then exactly those without a recorder.
        """
        return self._recorder

    @recorder.setter
    def recorder(self, rec) -> None:
        if rec is None and self._recorder is None:
            return
        units = self.compute_units()
        for u in units:
            u.layer.__dict__.pop("forward", None)
            u.layer.__dict__.pop("backward", None)
        self._recorder = rec
        if rec is not None:
            for u in units:
                _wrap_unit(u, rec)

    def compute_units(self) -> list[ComputeUnit]:
        """The units the recorder reports, in forward order (see :class:`ComputeUnit`)."""
        if self._units is None:
            self._units = compute_units(self.root, self.input_shape, self.dtype.itemsize,
                                        self.layout)
        return list(self._units)

    # -- compute --------------------------------------------------------------------------------
    def _on_ready(self, name: str) -> None:
        if self._ready_cb is not None:
            self._ready_cb(name)

    def forward(self, x, training: bool = True):
        """Logits ``(N, num_classes)`` for inputs ``(N, *input_shape)``.

        ``training`` selects batch statistics (and updates running statistics) in BatchNorm.
        """
        if tuple(x.shape[1:]) != self.input_shape:
            dims = ", ".join(map(str, self.input_shape))
            raise ValueError(f"{self.name} expects inputs (N, {dims}), got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            x = x.astype(self.dtype)
        return self.root.forward(x, training)

    def backward(self, dlogits, ready: Callable[[str], None] | None = None,
                 input_grad: bool = True):
        """Back-propagate ``dlogits``; writes ``grads`` and returns the input gradient.

        Parameters
        ----------
        dlogits : array (N, num_classes)
        ready : callable(name), optional
            Called with each parameter name as soon as its gradient is written, in exactly the
            order of ``layout.names`` (backward order): the hook for overlapping communication
            with the backward pass.
        input_grad : bool, default True
            ``False``: the input gradient is not wanted (training: the data has none), so a
            first layer that can skip it (a convolution: ``skips_input_grad``) does, and the
            call returns ``None`` for it.
        """
        first = None if input_grad else self._input_layer()
        self._ready_cb = ready
        if first is not None:
            first.input_grad = False
        try:
            return self.root.backward(dlogits)
        finally:
            self._ready_cb = None
            if first is not None:
                first.input_grad = True

    def _input_layer(self):
        """The layer that reads the model's input (first children through containers) when its
        class can skip the input gradient (declares ``skips_input_grad = True`` itself: a
        subclass that overrides ``backward``, e.g. H-SADMM's compact convolution, does not
        inherit it), else ``None``."""
        layer = self.root
        while isinstance(layer, Sequential) and layer.children():
            layer = layer.children()[0][1]
        return layer if type(layer).__dict__.get("skips_input_grad", False) else None

    def loss_and_grad(self, x, y, ready: Callable[[str], None] | None = None):
        """Forward in training mode, softmax cross-entropy, backward.

        Returns
        -------
        loss : float
        logits : array (N, num_classes)
        """
        logits = self.forward(x, training=True)
        if self.recorder is None:
            loss, dlogits = softmax_cross_entropy(logits, y)
        else:  # max, exp, sum, log, gradient: about 5 FLOPs per logit
            with self.recorder.layer("forward", "loss", 5 * logits.size,
                                     2 * logits.size * self.dtype.itemsize):
                loss, dlogits = softmax_cross_entropy(logits, y)
        self.backward(dlogits, ready=ready, input_grad=False)
        return loss, logits

    def zero_grad(self) -> None:
        """Zero ``grads.flat`` (backward overwrites every gradient it reaches, so this is only
        needed when part of the network is skipped)."""
        self.grads.zero_()

    def predict(self, x):
        """Class predictions in evaluation mode (running BatchNorm statistics)."""
        return self.forward(x, training=False).argmax(axis=1)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies (NumPy) of every parameter and buffer, keyed by name."""
        def host(a):
            return a.get() if hasattr(a, "get") else np.array(a, copy=True)
        out = {name: host(view) for name, view in self.params.items()}
        out.update({name: host(buf) for name, buf in self.buffers.items()})
        return out

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy values into the parameters (in place, views stay valid) and buffers.

        Parameters
        ----------
        state : dict name -> array
        strict : bool, default True
            Require exactly the model's parameter and buffer names.
        """
        expected = set(self.layout.names) | set(self.buffers)
        if strict:
            missing = sorted(expected - set(state))
            unexpected = sorted(set(state) - expected)
            if missing or unexpected:
                raise ValueError(f"state_dict mismatch: missing {missing}, unexpected {unexpected};"
                                 " pass strict=False to load a subset")
        for name, value in state.items():
            if name not in expected:
                continue
            target = self.params[name] if name in self.params else self.buffers[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target[...] = self.xp.asarray(value, dtype=self.dtype)

    def __repr__(self) -> str:
        return (f"Model({self.name!r}, input_shape={self.input_shape}, num_classes="
                f"{self.num_classes}, params={self.num_params}, dtype={self.dtype.name})\n"
                f"{self.root!r}")
