"""Bitwise mask synchronization (PruneX §4.3, eq. 14) and physical shrinkage/recovery (§4.4,
eq. 15).

* :class:`MaskCodec` packs the boolean masks of every pruned layer into one ``uint8`` bit buffer
  (planned once), so the leaders' OR-sync is a single ``allreduce(op="bor")`` of
  ``ceil(sum(numel) / 8)`` bytes; unpacking restores per-layer boolean masks.
* :class:`ShrinkPlan` derives the kept index sets ``K_out`` / ``K_in`` of every layer from the
  global mask (``any`` over the complementary axes), lays the compact slices
  ``c[K_out, K_in, :, :]`` of all layers out back to back in one contiguous buffer (allocated once
  per mask; reused while masks are frozen), and cuts that buffer into ~32 MiB buckets at layer
  boundaries for the inter-node all-reduce.  :meth:`ShrinkPlan.expand` scatters the compact values
  back into zero-filled full tensors.  Layers without a mask (FC, biases, BN) travel whole.

The plan is pure (no MPI): :meth:`ShrinkPlan.for_layout` builds it from a parameter layout and
the global masks by weight name.  The solver builds its plan with it from the masks of eq. 14;
``commvol`` predicts with :meth:`ShrinkPlan.from_keep_rates`, the same plan for masks with the
support sizes eq. 10 keeps (:func:`keep_rate_mask`), at any scale.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module
from substrate.buckets import bucket_groups

from .projection import keep_count, parse_sparsity

__all__ = ["MaskCodec", "ShrinkPlan", "keep_rate_mask", "kept_indices", "pruned_names"]


class MaskCodec:
    """Pack/unpack the boolean masks of layers with fixed shapes into one bit buffer.

    Parameters
    ----------
    shapes : sequence of tuple
        Mask shape of each pruned layer, in a fixed order shared by every rank.
    """

    def __init__(self, shapes) -> None:
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        self.nbits = int(self.offsets[-1])
        self._bits = np.empty(self.nbits, dtype=bool)
        self.nbytes = (self.nbits + 7) // 8

    def pack(self, masks) -> np.ndarray:
        """One ``uint8`` buffer holding every mask's bits (a fresh array: it is reduced in place)."""
        if len(masks) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} masks, got {len(masks)}")
        for m, s, o, n in zip(masks, self.shapes, self.offsets, self.sizes):
            if tuple(m.shape) != s:
                raise ValueError(f"mask of shape {tuple(m.shape)} does not match the planned {s}")
            self._bits[o:o + n] = _host(m).reshape(-1)
        return np.packbits(self._bits)

    def unpack(self, packed: np.ndarray) -> list[np.ndarray]:
        bits = np.unpackbits(packed, count=self.nbits).astype(bool)
        return [bits[o:o + n].reshape(s) for s, o, n in zip(self.shapes, self.offsets,
                                                           self.sizes)]


def _host(a) -> np.ndarray:
    return a if array_module(a) is np else a.get()


def kept_indices(mask) -> tuple[np.ndarray, np.ndarray]:
    """``(K_out, K_in)`` of a 4-D (or 2-D) mask: filters / input channels with any kept entry."""
    m = _host(mask)
    m4 = m.reshape(m.shape[0], m.shape[1], -1)
    return (np.flatnonzero(m4.any(axis=(1, 2))).astype(np.int64),
            np.flatnonzero(m4.any(axis=(0, 2))).astype(np.int64))


def pruned_names(layout) -> list[str]:
    """The tensors eq. 10 projects: every conv weight (PruneX §5.1.5: convolutional layers
    only; FC, biases and BatchNorm stay dense), in layout order."""
    return [n for n in layout.names if layout.kind(n) == "conv"]


def keep_rate_mask(shape, kinds: tuple[str, ...], keep: float) -> np.ndarray:
    """A structured mask with the support sizes the projection of eq. 10 keeps at ``keep``.

    Which groups are kept does not matter for the volume, only how many: filter ``alpha_out``
    filters, channel ``alpha_in`` input channels (:func:`~hsadmm.projection.keep_count`), applied
    in the projection order (filter, channel, shape).  Shape sparsity keeps ``alpha_kern`` of the
    ``C_in K_H K_W`` kernel columns, dealt over the live channels position by position (the
    widest ``K_in`` a shape mask can have).

    Parameters
    ----------
    shape : tuple
        ``(C_out, C_in, K_H, K_W)`` (or ``(d_out, d_in)``).
    kinds : tuple of str
        From :func:`hsadmm.projection.parse_sparsity`.
    keep : float
        Keep rate in ``(0, 1]``.
    """
    shape = tuple(int(s) for s in shape)
    s4 = shape if len(shape) == 4 else (shape[0], shape[1], 1, 1)
    co, ci, kh, kw = s4
    mask = np.ones(s4, dtype=bool)
    if "filter" in kinds:
        mask[keep_count(keep, co):] = False
    if "channel" in kinds:
        mask[:, keep_count(keep, ci):] = False
    if "shape" in kinds:
        alpha = keep_count(keep, ci * kh * kw)
        live = np.flatnonzero(mask.any(axis=(0, 2, 3)))
        cols = np.zeros((ci, kh * kw), dtype=bool)
        for c, q in [(c, q) for q in range(kh * kw) for c in live][:alpha]:
            cols[c, q] = True
        mask &= cols.reshape(1, ci, kh, kw)
    return mask.reshape(shape)


class ShrinkPlan:
    """Compact layout of ``[K_out, K_in]`` slices for one set of global masks (eq. 15).

    Parameters
    ----------
    shapes : sequence of tuple
        Full shape of every tensor that travels between leaders, in a fixed order.
    masks : sequence of (bool array or None)
        Global mask per tensor; ``None`` sends the tensor whole.
    dtype, xp :
        Dtype and array module of the compact buffer.
    bucket_bytes : int
        Bucket size for the inter-node all-reduce (PruneX: ~32 MiB).
    """

    def __init__(self, shapes, masks, dtype=np.float32, xp=np, bucket_bytes: int = 32 << 20):
        if len(shapes) != len(masks):
            raise ValueError("one mask (or None) per tensor is needed")
        self.shapes = [tuple(s) for s in shapes]
        self.index = []  # (K_out, K_in) on the array module, or None for whole tensors
        sizes = []
        for s, m in zip(self.shapes, masks):
            if m is None:
                self.index.append(None)
                sizes.append(int(np.prod(s, dtype=np.int64)))
                continue
            if tuple(m.shape) != s:
                raise ValueError(f"mask shape {tuple(m.shape)} does not match tensor {s}")
            k_out, k_in = kept_indices(m)
            inner = int(np.prod(s[2:], dtype=np.int64))
            sizes.append(k_out.size * k_in.size * inner)
            self.index.append((xp.asarray(k_out), xp.asarray(k_in)))
        self.sizes = sizes
        self.offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.dense_size = int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))
        self.compact_size = int(self.offsets[-1])
        self.dtype = np.dtype(dtype)
        self.buffer = xp.empty(self.compact_size, dtype=self.dtype)  # allocated once
        groups = bucket_groups([n * self.dtype.itemsize for n in sizes], bucket_bytes)
        self.buckets = [(int(self.offsets[g[0]]), int(self.offsets[g[-1] + 1])) for g in groups]
        #: packed bytes of the global masks of eq. 14 (``ceil(sum of masked numel / 8)``)
        self.mask_bytes = MaskCodec([m.shape for m in masks if m is not None]).nbytes

    @classmethod
    def for_layout(cls, layout, masks: dict, *, bucket_mib: float = 32.0, dtype=np.float32,
                   xp=np) -> ShrinkPlan:
        """The plan of ``layout``'s tensors for global masks ``{weight name: mask}`` (eq. 15):
        named tensors travel as ``[K_out, K_in]`` slices, the others whole; buckets of
        ``bucket_mib`` MiB at tensor boundaries (§4.4.2)."""
        unknown = sorted(set(masks) - set(layout.names))
        if unknown:
            raise ValueError(f"masks name tensors {unknown} that the layout does not have")
        names = list(layout.names)
        return cls([layout.shape(n) for n in names], [masks.get(n) for n in names], dtype=dtype,
                   xp=xp, bucket_bytes=int(bucket_mib * (1 << 20)))

    @classmethod
    def from_keep_rates(cls, layout, cfg, keep_overrides: dict | None = None) -> ShrinkPlan:
        """The plan for masks with the support sizes eq. 10 keeps on every conv weight of
        ``layout`` (:func:`keep_rate_mask`) at ``cfg.keep`` (per-layer ``keep_overrides``), for
        ``cfg.sparsity`` and ``cfg.bucket_mib``; float32 on the host.  All nodes agree on these
        masks, so the OR of eq. 14 adds nothing."""
        kinds = parse_sparsity(cfg.sparsity)
        overrides = keep_overrides or {}
        masks = {n: keep_rate_mask(layout.shape(n), kinds, float(overrides.get(n, cfg.keep)))
                 for n in pruned_names(layout)}
        return cls.for_layout(layout, masks, bucket_mib=cfg.bucket_mib)

    @property
    def ratio(self) -> float:
        """Compact payload / dense payload."""
        return self.compact_size / self.dense_size if self.dense_size else 1.0

    def compact_shape(self, i: int) -> tuple:
        s = self.shapes[i]
        if self.index[i] is None:
            return s
        k_out, k_in = self.index[i]
        return (int(k_out.size), int(k_in.size), *s[2:])

    def shrink(self, tensors):
        """Pack ``c[K_out, K_in, ...]`` of every tensor into :attr:`buffer` and return it."""
        for i, t in enumerate(tensors):
            o, n = self.offsets[i], self.sizes[i]
            dst = self.buffer[o:o + n]
            if self.index[i] is None:
                dst[...] = t.reshape(-1)
            else:
                k_out, k_in = self.index[i]
                dst.reshape(self.compact_shape(i))[...] = t[k_out[:, None], k_in[None, :]]
        return self.buffer

    def expand(self, buffer, out) -> None:
        """Scatter the compact ``buffer`` into the full tensors ``out`` (zero elsewhere)."""
        for i, t in enumerate(out):
            o, n = self.offsets[i], self.sizes[i]
            src = buffer[o:o + n]
            if self.index[i] is None:
                t.reshape(-1)[...] = src
            else:
                k_out, k_in = self.index[i]
                t[...] = 0
                t[k_out[:, None], k_in[None, :]] = src.reshape(self.compact_shape(i))
