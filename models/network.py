"""The :class:`Model`: a layer tree bound to one flat parameter and one flat gradient vector."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .layers import Layer, softmax_cross_entropy
from .params import FlatTensors, ParamLayout, ParamSpec

__all__ = ["Model", "layer_tree_specs"]


def layer_tree_specs(root: Layer) -> list[ParamSpec]:
    """Parameter specs of a layer tree in forward order (pre-order traversal), no arrays."""
    return [
        ParamSpec(prefix + local, kind, shape)
        for prefix, layer in root.walk()
        for local, kind, shape, _ in layer._param_decls
    ]


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
        from .specs import spec_from_layers  # noqa: PLC0415 (avoid a cycle at import time)

        return spec_from_layers(self.name, self.root, self.input_shape, self.num_classes)

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

    def backward(self, dlogits, ready: Callable[[str], None] | None = None):
        """Back-propagate ``dlogits``; writes ``grads`` and returns the input gradient.

        Parameters
        ----------
        dlogits : array (N, num_classes)
        ready : callable(name), optional
            Called with each parameter name as soon as its gradient is written, in exactly the
            order of ``layout.names`` (backward order): the hook for overlapping communication
            with the backward pass.
        """
        self._ready_cb = ready
        try:
            return self.root.backward(dlogits)
        finally:
            self._ready_cb = None

    def loss_and_grad(self, x, y, ready: Callable[[str], None] | None = None):
        """Forward in training mode, softmax cross-entropy, backward.

        Returns
        -------
        loss : float
        logits : array (N, num_classes)
        """
        logits = self.forward(x, training=True)
        loss, dlogits = softmax_cross_entropy(logits, y)
        self.backward(dlogits, ready=ready)
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
