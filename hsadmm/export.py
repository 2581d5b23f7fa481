"""Physically compact export of a structured-sparse model (PruneX §4.4, eq. 15, for deployment).

After H-SADMM the consensus model ``z`` has structured zeros in its conv weights: pruned input
channels (channel set), pruned output filters (filter set), pruned ``(c, kh, kw)`` positions
(shape set) and their intersections (§2.1).  :func:`export_compact` removes the pruned filters and
channels physically: every conv weight ``W[C_out, C_in, kh, kw]`` is stored as the dense compact
``W[K_out, K_in, kh, kw]`` (eq. 15) plus its kept output-filter indices ``K_out`` and kept
input-channel indices ``K_in`` (``int32``).  Shape-pruned positions inside kept channels stay as
zeros of the compact weight.  Everything else (conv/FC biases, BN affine parameters, FC weights,
BN running statistics) is stored as is.

The file (``OUT/compact_model.npz``, written atomically) holds

* ``manifest``: a JSON string (format tag, model name/arch/input shape/classes, dtype, per-layer
  dense and compact shapes, dense vs compact conv parameter counts and bytes);
* ``param/<name>``: every trainable tensor, compact for conv weights;
* ``buffer/<name>``: every model buffer (BN running statistics);
* ``k_out/<name>``, ``k_in/<name>``: the kept indices of every conv weight.

:func:`load_compact_model` rebuilds the ``models/`` network with each conv replaced by a
:class:`CompactConv2d`: it gathers the kept input channels, runs the existing
:class:`~models.layers.Conv2d` kernel on the compact weight and scatters the result into the full
channel count with zeros for the removed filters (then adds the full bias) — the recovery rule of
§4.4.3 applied to activations — so BN, residual additions and the head see exactly the masked
model's activations and the logits agree with the masked model to rounding (~1e-6).
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np

from models import zoo
from models.layers import Conv2d
from models.network import Model
from substrate.backend import array_module
from substrate.results import atomic_write_bytes

from .shrink import kept_indices

__all__ = [
    "FORMAT",
    "CompactConv2d",
    "CompactExport",
    "export_compact",
    "load_compact_model",
    "read_compact",
]

#: Format tag stored in the manifest; a reader refuses any other tag.
FORMAT = "spardist-hsadmm-compact/1"


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _check_index(k, n: int, what: str) -> np.ndarray:
    k = np.asarray(k)
    if k.ndim != 1 or k.size == 0 or k.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a non-empty 1-D integer index array, got shape "
                         f"{k.shape} dtype {k.dtype}")
    if k.min() < 0 or k.max() >= n or np.any(np.diff(k) <= 0):
        raise ValueError(f"{what} must be strictly increasing indices in [0, {n}), got {k}")
    return k.astype(np.int64)


class CompactConv2d(Conv2d):
    """A :class:`~models.layers.Conv2d` running on a physically compacted weight (eq. 15).

    The layer declares ``weight`` of shape ``(K_out, K_in, kh, kw)`` (and a full ``(C_out,)``
    ``bias`` when the dense conv had one) but keeps the dense conv's interface: input
    ``(N, C_in, H, W)``, output ``(N, C_out, Ho, Wo)``.  Forward gathers the ``K_in`` input
    channels, applies the inherited im2col + GEMM kernel, and scatters the ``K_out`` outputs into
    zeros (§4.4.3: removed filters produce exactly zero, plus their bias).  Backward is the
    adjoint, so a compact model can also be fine-tuned.

    Parameters
    ----------
    in_channels, out_channels : int
        Dense channel counts ``C_in``, ``C_out``.
    kernel_size, stride, padding
        As for :class:`~models.layers.Conv2d`.
    k_out, k_in : 1-D integer arrays
        Kept output filters / input channels, strictly increasing.
    bias : bool
        Whether the dense conv has a bias (kept whole, ``C_out`` entries).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, k_out, k_in, stride=1,
                 padding=0, bias: bool = True):
        k_out = _check_index(k_out, int(out_channels), "k_out")
        k_in = _check_index(k_in, int(in_channels), "k_in")
        super().__init__(k_in.size, k_out.size, kernel_size, stride=stride, padding=padding,
                         bias=False)
        self.full_in, self.full_out = int(in_channels), int(out_channels)
        self.has_bias = bool(bias)
        if self.has_bias:
            self.declare_param("bias", "bias", (self.full_out,), "zeros")
        self.k_out, self.k_in = k_out, k_in
        self._all_in = k_in.size == self.full_in
        self._all_out = k_out.size == self.full_out
        self._index: dict = {}

    @classmethod
    def from_conv(cls, conv: Conv2d, k_out, k_in) -> CompactConv2d:
        """The compact counterpart of a dense ``conv`` (same geometry and bias)."""
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, k_out, k_in,
                   stride=conv.stride, padding=conv.padding, bias=conv.bias)

    def _idx(self, xp):
        key = xp.__name__
        if key not in self._index:
            self._index[key] = (xp.asarray(self.k_out), xp.asarray(self.k_in))
        return self._index[key]

    def forward(self, x, training: bool = True):
        if x.ndim != 4 or x.shape[1] != self.full_in:
            raise ValueError(
                f"CompactConv2d expects input (N, {self.full_in}, H, W), got {tuple(x.shape)}")
        xp = array_module(x)
        k_out, k_in = self._idx(xp)
        xs = x if self._all_in else xp.take(x, k_in, axis=1)
        yc = super().forward(xs, training)
        if self._all_out:
            y = yc.copy() if self.has_bias else yc
        else:
            y = xp.zeros((yc.shape[0], self.full_out, *yc.shape[2:]), dtype=yc.dtype)
            y[:, k_out] = yc
        if self.has_bias:
            y += self.P["bias"][:, None, None]
        return y

    def backward(self, dy):
        xp = array_module(dy)
        k_out, k_in = self._idx(xp)
        if self.has_bias:
            self.G["bias"][...] = dy.sum(axis=(0, 2, 3))
        dyc = dy if self._all_out else xp.ascontiguousarray(xp.take(dy, k_out, axis=1))
        dxc = super().backward(dyc)
        if self._all_in:
            return dxc
        dx = xp.zeros((dxc.shape[0], self.full_in, *dxc.shape[2:]), dtype=dxc.dtype)
        dx[:, k_in] = dxc
        return dx

    def output_shape(self, in_shape):
        C, H, W = in_shape
        if C != self.full_in:
            raise ValueError(f"CompactConv2d expects {self.full_in} channels, got shape "
                             f"{in_shape}")
        return (self.full_out, *self._out_hw(H, W))

    def __repr__(self):
        return (f"CompactConv2d({self.full_in}->{self.in_channels}, "
                f"{self.full_out}->{self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.has_bias})")


def _replace_child(parent, local: str, new) -> None:
    """Swap ``parent``'s child ``local`` for ``new`` wherever ``parent`` refers to it."""
    old = dict(parent.children())[local]
    parent._children = [(n, new if n == local else c) for n, c in parent._children]
    for attr, val in list(vars(parent).items()):
        if val is old:
            setattr(parent, attr, new)
        elif isinstance(val, list) and any(v is old for v in val):
            setattr(parent, attr, [new if v is old else v for v in val])


class CompactExport:
    """A compact model in memory: manifest, compact parameters, buffers and kept indices.

    Build one with :func:`export_compact` or :func:`read_compact`; :meth:`save` writes it,
    :meth:`build_model` turns it into a runnable :class:`~models.network.Model`.

    Attributes
    ----------
    manifest : dict
        JSON-ready description (see the module docstring).
    params, buffers : dict name -> numpy array
    kept : dict conv weight name -> (k_out, k_in) int32 arrays
    """

    def __init__(self, manifest: dict, params: dict, buffers: dict, kept: dict) -> None:
        self.manifest, self.params, self.buffers, self.kept = manifest, params, buffers, kept

    @property
    def dense_conv_params(self) -> int:
        return int(self.manifest["dense_conv_params"])

    @property
    def compact_conv_params(self) -> int:
        return int(self.manifest["compact_conv_params"])

    def to_bytes(self) -> bytes:
        """The ``.npz`` file contents."""
        arrays = {"manifest": np.array(json.dumps(self.manifest))}
        arrays.update({f"param/{n}": a for n, a in self.params.items()})
        arrays.update({f"buffer/{n}": a for n, a in self.buffers.items()})
        for n, (k_out, k_in) in self.kept.items():
            arrays[f"k_out/{n}"], arrays[f"k_in/{n}"] = k_out, k_in
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def save(self, path) -> Path:
        """Write the ``.npz`` atomically (temp file + rename); returns the path."""
        path = Path(path)
        atomic_write_bytes(path, self.to_bytes())
        return path

    def build_model(self, xp=np) -> Model:
        """Rebuild the ``models/`` network with :class:`CompactConv2d` layers and load the
        exported values.

        Raises
        ------
        ValueError
            If the model name has no ``models.zoo.<name>_layers`` builder, or a tensor's name or
            shape does not fit the rebuilt network (an inconsistent file).
        """
        m = self.manifest
        name = m["model"]
        layers_fn = getattr(zoo, f"{name}_layers", None)
        if layers_fn is None:
            raise ValueError(f"compact export of model {name!r}: models.zoo has no "
                             f"{name}_layers builder; export models from models.zoo.MODELS")
        root = layers_fn(tuple(m["input_shape"]), int(m["num_classes"]), **m["arch"])
        parents = {id(c): (layer, local) for _, layer in root.walk()
                   for local, c in layer.children()}
        found = set()
        for prefix, layer in list(root.walk()):
            wname = prefix + "weight"
            if isinstance(layer, Conv2d) and wname in self.kept:
                if id(layer) not in parents:
                    raise ValueError(f"conv {wname!r} is the network root; nothing to compact")
                parent, local = parents[id(layer)]
                _replace_child(parent, local, CompactConv2d.from_conv(layer, *self.kept[wname]))
                found.add(wname)
        missing = sorted(set(self.kept) - found)
        if missing:
            raise ValueError(f"compact export names conv layers {missing} that the {name!r} "
                             f"network with arch {m['arch']} does not have; re-export the model")
        model = Model(root, tuple(m["input_shape"]), int(m["num_classes"]), xp=xp,
                      dtype=np.dtype(m["dtype"]), name=name)
        model.load_state_dict({**self.params, **self.buffers})
        return model


def export_compact(model: Model, masks: dict | None = None, *, arch: dict | None = None
                   ) -> CompactExport:
    """Physically compact ``model``'s conv weights (eq. 15) into a :class:`CompactExport`.

    Parameters
    ----------
    model : Model
        The masked model (e.g. the consensus ``z`` loaded into a ``models/`` network, with the
        BN buffers to deploy).  Its ``name`` must be a :data:`models.zoo.MODELS` key.
    masks : dict conv weight name -> bool array, optional
        Global masks (eq. 14); ``K_out`` / ``K_in`` are the filters / channels with any kept
        entry, as in :class:`~hsadmm.shrink.ShrinkPlan`.  Conv layers not in ``masks`` (or all,
        when ``None``) use their weight's nonzero support.
    arch : dict, optional
        Architecture keywords of the model factory (default: none, the factory defaults).

    Returns
    -------
    CompactExport

    Raises
    ------
    ValueError
        If a mask has the wrong shape, or a weight has nonzeros outside the kept
        ``K_out x K_in`` slices (the export would not reproduce the model).
    """
    masks = dict(masks or {})
    unknown = sorted(set(masks) - set(model.layout.names_of_kind("conv")))
    if unknown:
        raise ValueError(f"masks name {unknown}, which are not conv weights of {model.name!r}; "
                         f"conv weights: {list(model.layout.names_of_kind('conv'))}")
    state = model.state_dict()
    dtype = np.dtype(model.dtype)
    params, kept, layers = {}, {}, []
    dense_n = compact_n = index_bytes = 0
    for name in model.layout.forward_names:
        w = state[name]
        if model.layout.kind(name) != "conv":
            params[name] = w
            continue
        m = masks.get(name)
        m = (w != 0) if m is None else _host(m)
        if m.shape != w.shape:
            raise ValueError(f"mask of {name!r} has shape {m.shape}, weight has {w.shape}")
        k_out, k_in = kept_indices(m)
        # a layer with nothing kept still needs a (zero) 1x1 slice to stay a valid conv
        k_out = k_out if k_out.size else np.zeros(1, np.int64)
        k_in = k_in if k_in.size else np.zeros(1, np.int64)
        compact = np.ascontiguousarray(w[np.ix_(k_out, k_in)])
        if np.count_nonzero(compact) != np.count_nonzero(w):
            raise ValueError(f"{name!r} has nonzero weights outside its kept filters/channels; "
                             "export the consensus z (masked by the global masks) or pass "
                             "masks=None to use the weight's own support")
        params[name] = compact
        kept[name] = (k_out.astype(np.int32), k_in.astype(np.int32))
        dense_n += w.size
        compact_n += compact.size
        index_bytes += 4 * (k_out.size + k_in.size)
        layers.append({"name": name, "dense_shape": list(w.shape),
                       "compact_shape": list(compact.shape),
                       "filters_removed": int(w.shape[0] - k_out.size),
                       "channels_removed": int(w.shape[1] - k_in.size)})
    manifest = {
        "format": FORMAT, "model": model.name, "arch": dict(arch or {}),
        "input_shape": list(model.input_shape), "num_classes": model.num_classes,
        "dtype": dtype.name, "layers": layers,
        "dense_conv_params": int(dense_n), "compact_conv_params": int(compact_n),
        "dense_conv_bytes": int(dense_n * dtype.itemsize),
        "compact_conv_bytes": int(compact_n * dtype.itemsize), "index_bytes": int(index_bytes),
        "conv_ratio": compact_n / dense_n if dense_n else 1.0,
    }
    buffers = {n: state[n] for n in model.buffers}
    return CompactExport(manifest, params, buffers, kept)


def read_compact(path) -> CompactExport:
    """Read a file written by :meth:`CompactExport.save`.

    Raises
    ------
    ValueError
        If the file is missing, truncated/corrupt, not a compact export, or internally
        inconsistent; the message names the file and how to regenerate it.
    """
    path = Path(path)
    regen = "re-create it with `python -m hsadmm train --out DIR` (writes DIR/compact_model.npz)"
    if not path.is_file():
        raise ValueError(f"compact model {path} does not exist; {regen}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise ValueError(f"compact model {path} is truncated or corrupt ({type(exc).__name__}: "
                         f"{exc}); {regen}") from None
    try:
        manifest = json.loads(str(arrays.pop("manifest")))
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} has no readable manifest ({exc}); it is not a compact export: "
                         f"{regen}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise ValueError(f"{path} has format {got!r}, expected {FORMAT!r}; {regen}")
    groups: dict[str, dict] = {"param": {}, "buffer": {}, "k_out": {}, "k_in": {}}
    for key, a in arrays.items():
        kind, _, name = key.partition("/")
        if kind not in groups or not name:
            raise ValueError(f"{path}: unexpected entry {key!r}; {regen}")
        groups[kind][name] = a
    convs = [layer["name"] for layer in manifest.get("layers", [])]
    if set(groups["k_out"]) != set(convs) or set(groups["k_in"]) != set(convs):
        raise ValueError(f"{path}: kept-index entries do not match the manifest's conv layers "
                         f"{convs}; {regen}")
    kept = {}
    for layer in manifest["layers"]:
        n = layer["name"]
        w = groups["param"].get(n)
        k_out, k_in = groups["k_out"][n], groups["k_in"][n]
        if w is None or list(w.shape) != layer["compact_shape"] or w.shape[:2] != (
                k_out.size, k_in.size):
            raise ValueError(f"{path}: conv {n!r} has weight shape "
                             f"{None if w is None else w.shape}, indices ({k_out.size}, "
                             f"{k_in.size}) and manifest shape {layer['compact_shape']}; {regen}")
        kept[n] = (k_out, k_in)
    return CompactExport(manifest, groups["param"], groups["buffer"], kept)


def load_compact_model(path, xp=np) -> Model:
    """Read a compact export and rebuild it as a runnable :class:`~models.network.Model`
    (:meth:`CompactExport.build_model`); ValueError for a missing or corrupt file."""
    return read_compact(path).build_model(xp)
