"""Parameter registry: named tensors in one contiguous flat buffer.

Every strategy (H-SADMM, PacTrain, SDP, SSFusion, DDP, Top-K) works on the same two flat
vectors of a model: ``model.params.flat`` (all trainable parameters) and ``model.grads.flat``
(their gradients).  Each named tensor is a *view* into the flat vector, so bucketing, masking,
packing and compaction are slices of one array and need no copies.

Layout
------
Tensors are laid out in **backward order**: the order their gradients become ready during
back-propagation, i.e. the reverse of the forward order.  A prefix of ``grads.flat`` is therefore
complete first, which is what bucketed/fused communication overlapping the backward pass needs.
``ParamLayout.forward_names`` gives the forward order.

Kinds
-----
``"conv"``  convolution weight ``[C_out, C_in, kH, kW]`` (the tensors H-SADMM prunes),
``"fc"``    fully connected weight ``[d_out, d_in]``,
``"bias"``  bias vector of a conv or fc layer,
``"bn"``    batch-norm scale (gamma) or shift (beta).

BatchNorm running statistics are *buffers*, not parameters: they are not in the flat vector, but
``state_dict`` includes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import prod

import numpy as np

__all__ = ["PARAM_KINDS", "FlatTensors", "ParamLayout", "ParamSpec"]

#: The parameter kinds a layer may declare.
PARAM_KINDS = ("conv", "fc", "bias", "bn")


@dataclass(frozen=True)
class ParamSpec:
    """Name, kind and shape of one trainable tensor (no array attached).

    Parameters
    ----------
    name : str
        Dotted unique name, e.g. ``"layer1.0.conv1.weight"``.
    kind : {"conv", "fc", "bias", "bn"}
        What the tensor is (see module docstring).
    shape : tuple of int
        Tensor shape; conv weights are ``(C_out, C_in, kH, kW)``, fc weights ``(d_out, d_in)``.
    """

    name: str
    kind: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"parameter name must be a non-empty string, got {self.name!r}")
        if self.kind not in PARAM_KINDS:
            raise ValueError(
                f"parameter {self.name!r}: kind must be one of {PARAM_KINDS}, got {self.kind!r}"
            )
        shape = tuple(int(s) for s in self.shape)
        if any(s <= 0 for s in shape):
            raise ValueError(f"parameter {self.name!r}: shape must be positive, got {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return prod(self.shape)


class ParamLayout:
    """Offsets of named tensors inside one flat vector (pure metadata, no arrays).

    Parameters
    ----------
    specs : iterable of ParamSpec
        Tensors in **forward** order (the order layers run in the forward pass).  The flat layout
        is the reverse (backward order, see module docstring).

    Attributes
    ----------
    forward_names : tuple of str
        Names in forward order.
    names : tuple of str
        Names in backward order = flat-layout order (``offsets`` increase along it).
    specs : dict of str -> ParamSpec
    offsets : dict of str -> int
        Element offset of each tensor in the flat vector.
    sizes : dict of str -> int
        Element count of each tensor.
    total : int
        Length of the flat vector.
    """

    def __init__(self, specs: Iterable[ParamSpec]):
        specs = list(specs)
        seen: set[str] = set()
        for s in specs:
            if not isinstance(s, ParamSpec):
                raise ValueError(f"ParamLayout takes ParamSpec objects, got {type(s).__name__}")
            if s.name in seen:
                raise ValueError(f"duplicate parameter name {s.name!r}; names must be unique")
            seen.add(s.name)
        self.forward_names: tuple[str, ...] = tuple(s.name for s in specs)
        self.names: tuple[str, ...] = tuple(reversed(self.forward_names))
        self.specs: dict[str, ParamSpec] = {s.name: s for s in specs}
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        off = 0
        for name in self.names:
            self.offsets[name] = off
            self.sizes[name] = self.specs[name].size
            off += self.sizes[name]
        self.total: int = off

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __iter__(self) -> Iterator[ParamSpec]:
        """Iterate specs in backward (= flat-layout) order."""
        return (self.specs[n] for n in self.names)

    def slice(self, name: str) -> slice:
        """``slice`` of tensor ``name`` in the flat vector."""
        self._check(name)
        o = self.offsets[name]
        return slice(o, o + self.sizes[name])

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name``."""
        self._check(name)
        return self.specs[name].shape

    def kind(self, name: str) -> str:
        """Kind of tensor ``name``."""
        self._check(name)
        return self.specs[name].kind

    def names_of_kind(self, *kinds: str) -> tuple[str, ...]:
        """Names (backward order) whose kind is one of ``kinds``."""
        bad = [k for k in kinds if k not in PARAM_KINDS]
        if bad:
            raise ValueError(f"unknown kind(s) {bad}; valid kinds are {PARAM_KINDS}")
        return tuple(n for n in self.names if self.specs[n].kind in kinds)

    def segment_ids(self) -> np.ndarray:
        """Tensor index (position in ``names``) of every flat element, shape ``(total,)``."""
        return np.repeat(np.arange(len(self.names)), [self.sizes[n] for n in self.names])

    def expand(self, per_tensor: dict[str, float] | Iterable[float], dtype=np.float64,
               default: float | None = None) -> np.ndarray:
        """Broadcast one scalar per tensor to a flat per-element vector (NumPy).

        Parameters
        ----------
        per_tensor : dict name -> float, or sequence of floats in ``names`` order
            E.g. the per-layer penalty ρ of H-SADMM (eq. 8 uses ρ₁ ⊙ (θ − z + u)).
        dtype : numpy dtype
        default : float, optional
            Value for names missing from a dict (error if ``None``).

        Returns
        -------
        numpy.ndarray of shape ``(total,)``
        """
        if isinstance(per_tensor, dict):
            unknown = [k for k in per_tensor if k not in self.specs]
            if unknown:
                raise ValueError(f"unknown parameter names {unknown}; valid: {list(self.names)}")
            missing = [n for n in self.names if n not in per_tensor]
            if missing and default is None:
                raise ValueError(f"no value for parameters {missing}; pass default=... or add them")
            values = [per_tensor.get(n, default) for n in self.names]
        else:
            values = list(per_tensor)
            if len(values) != len(self.names):
                raise ValueError(
                    f"expected {len(self.names)} per-tensor values (one per name in backward "
                    f"order), got {len(values)}"
                )
        return np.repeat(np.asarray(values, dtype=dtype), [self.sizes[n] for n in self.names])

    def describe(self) -> list[dict]:
        """JSON-friendly list of ``{name, kind, shape, offset, size}`` in layout order."""
        return [
            {"name": n, "kind": self.specs[n].kind, "shape": list(self.specs[n].shape),
             "offset": self.offsets[n], "size": self.sizes[n]}
            for n in self.names
        ]

    def _check(self, name: str) -> None:
        if name not in self.specs:
            raise KeyError(f"no parameter named {name!r}; valid names: {list(self.names)}")


class FlatTensors:
    """A flat 1-D array plus named, shaped views into it.

    ``ft.flat`` is the contiguous vector; ``ft[name]`` is a view of shape ``layout.shape(name)``
    that aliases ``ft.flat`` (writing either changes both).  Never rebind the views: write in place
    (``ft.flat[...] = v``, ``ft[name][...] = w``).

    Parameters
    ----------
    layout : ParamLayout
    flat : array, optional
        Existing 1-D contiguous NumPy/CuPy array of length ``layout.total`` to wrap (shared, not
        copied).  When omitted, a zero vector is allocated with ``xp`` and ``dtype``.
    xp : module, optional
        ``numpy`` (default) or ``cupy``.
    dtype : dtype, default float32
    """

    def __init__(self, layout: ParamLayout, flat=None, *, xp=np, dtype=np.float32):
        if flat is None:
            flat = xp.zeros(layout.total, dtype=dtype)
        if flat.ndim != 1 or flat.shape[0] != layout.total:
            raise ValueError(
                f"flat buffer must be 1-D of length {layout.total}, got shape {tuple(flat.shape)}"
            )
        if not flat.flags.c_contiguous:
            raise ValueError("flat buffer must be contiguous; pass xp.ascontiguousarray(flat)")
        self.layout = layout
        self._flat = flat
        self._views = {n: flat[layout.slice(n)].reshape(layout.shape(n)) for n in layout.names}

    @property
    def flat(self):
        """The contiguous 1-D vector (read-only attribute; modify its contents in place)."""
        return self._flat

    @property
    def dtype(self):
        return self._flat.dtype

    @property
    def names(self) -> tuple[str, ...]:
        """Names in layout (backward) order."""
        return self.layout.names

    def __getitem__(self, name: str):
        if name not in self._views:
            raise KeyError(f"no tensor named {name!r}; valid names: {list(self.layout.names)}")
        return self._views[name]

    def __contains__(self, name: object) -> bool:
        return name in self._views

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self._views)

    def keys(self) -> tuple[str, ...]:
        return self.layout.names

    def items(self):
        """``(name, view)`` pairs in layout (backward) order."""
        return ((n, self._views[n]) for n in self.layout.names)

    def slice(self, name: str) -> slice:
        """``slice`` of ``name`` in :attr:`flat`."""
        return self.layout.slice(name)

    def zero_(self) -> None:
        """Set every element to zero in place."""
        self._flat.fill(0)
