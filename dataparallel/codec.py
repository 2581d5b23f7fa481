"""Gradient codecs: what a data-parallel strategy puts on the wire instead of a dense float32
gradient, and the error feedback that carries what it left out into the next step.

Shared by Top-K (:mod:`dataparallel.topk`) and SSFusion (:mod:`dataparallel.ssfusion`);
PacTrain's ternary and FP16 packing are meant to move here too.  The shape is Horovod's
``compression.py`` — a small :class:`Compressor` with ``compress(x) -> (payload, ctx)`` and
``decompress(payload, ctx)`` — with what a plan, an all-gather and error feedback need beside it:

* :meth:`Compressor.wire_elements` / :meth:`Compressor.wire_bytes`: the payload of a tensor of
  ``n`` entries, known without data (a plan's records carry it; the run sends exactly it);
* :meth:`Compressor.combine`: what a receiver does with every rank's payload after an
  all-gather (the mean of the decoded payloads), so codecs that cannot be summed on the wire
  (sparse, ternary with per-rank scales) are one object too;
* :meth:`Compressor.residual` and :class:`ErrorFeedback`: ``e ← e + x``, send ``C(e)``,
  ``e ← e − D(C(e))`` (Seide et al. 2014; Aji & Heafield 2017; DGC), for any codec.

A **sparse payload** is one ``int32`` array ``[values | indices]``: the ``k`` float32 values
bit-cast to int32 words, then their ``k`` int32 flat positions, so one all-gather carries both
halves.  :class:`SparseRow` lays out a fused buffer of several sparsified segments the same way
(an optional prefix of dense float32 values, then every segment's values and indices in its
slots), :func:`scatter_mean` decodes the gathered rows.  Everything works on NumPy and CuPy
arrays alike and allocates nothing per step where an ``out`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from substrate.backend import array_module

__all__ = [
    "INDEX_BYTES",
    "INDEX_DTYPE",
    "VALUE_BYTES",
    "VALUE_DTYPE",
    "WORD_DTYPE",
    "Compressor",
    "ErrorFeedback",
    "FP16Compressor",
    "NoneCompressor",
    "SparseCtx",
    "SparseRow",
    "TopKCompressor",
    "exact_topk",
    "scatter_mean",
]

#: sparse values on the wire (float32, bit-cast into the int32 payload)
VALUE_DTYPE = np.dtype(np.float32)
#: flat positions on the wire (int32: models of up to 2**31 - 1 parameters)
INDEX_DTYPE = np.dtype(np.int32)
#: the payload's element type: one MPI datatype for values and indices
WORD_DTYPE = np.dtype(np.int32)
VALUE_BYTES = VALUE_DTYPE.itemsize
INDEX_BYTES = INDEX_DTYPE.itemsize


def exact_topk(x, k: int):
    """Positions of the ``k`` largest ``|x|`` (full selection; unordered int64)."""
    xp = array_module(x)
    n = int(x.size)
    if k >= n:
        return xp.arange(n, dtype=np.int64)
    return xp.argpartition(xp.abs(x), n - k)[n - k:].astype(np.int64, copy=False)


# -- the interface --------------------------------------------------------------------------------
class Compressor:
    """A gradient codec (Horovod's ``Compressor``, plus sizes, combining and error feedback).

    Subclasses set :attr:`wire_dtype` and implement :meth:`compress` / :meth:`decompress`;
    :meth:`wire_elements` defaults to the identity (a dense codec).
    """

    name = "none"
    wire_dtype = VALUE_DTYPE

    def wire_elements(self, n: int) -> int:
        """Payload elements (of :attr:`wire_dtype`) for a tensor of ``n`` entries."""
        return int(n)

    def wire_bytes(self, n: int) -> int:
        """Payload bytes for a tensor of ``n`` entries (what a plan's record carries)."""
        return self.wire_elements(n) * np.dtype(self.wire_dtype).itemsize

    def compress(self, x):
        """``(payload, ctx)``: the array to send and what :meth:`decompress` needs besides."""
        raise NotImplementedError

    def decompress(self, payload, ctx):
        """The dense float32 tensor ``payload`` stands for."""
        raise NotImplementedError

    def combine(self, rows, ctx, p: int):
        """Mean over ``p`` ranks of the decoded payloads ``rows`` (``(p, wire_elements)``, an
        all-gather's result), in float64."""
        total = self.decompress(rows[0], ctx).astype(np.float64)
        for j in range(1, p):
            total += self.decompress(rows[j], ctx)
        return total / p

    def residual(self, acc, payload, ctx) -> None:
        """Error feedback, in place: ``acc ← acc − D(C(acc))`` (what was not sent)."""
        acc -= self.decompress(payload, ctx)


class NoneCompressor(Compressor):
    """No compression: the float32 tensor itself."""

    def compress(self, x):
        return x, None

    def decompress(self, payload, ctx):
        return payload


class FP16Compressor(Compressor):
    """Half-precision values (PyTorch DDP's ``fp16_compress_hook``, Horovod's ``fp16``)."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)

    def compress(self, x):
        return x.astype(np.float16), x.dtype

    def decompress(self, payload, ctx):
        return payload.astype(ctx or np.float32)


@dataclass(frozen=True)
class SparseCtx:
    """What a sparse payload's receiver and the sender's error feedback need: the tensor's
    length and (sender only) the positions actually selected (a selector may return fewer
    than ``k``; the payload's padding slots are not sent entries)."""

    n: int
    idx: object = None


class TopKCompressor(Compressor):
    """The ``k`` largest ``|x|`` as one ``[values | indices]`` int32 payload of ``2k`` words.

    Parameters
    ----------
    k : int
        Entries sent (``1 <= k``; at most ``n`` are selected from a tensor of ``n``).
    select : callable, optional
        ``select(x, k) -> int64 positions`` (at most ``k``; fewer are padded with value 0 at
        position 0): :func:`exact_topk` by default, or a sampled threshold
        (:func:`dataparallel.sparsify.dgc_topk`), Gaussian-k, ...
    """

    name = "topk"
    wire_dtype = WORD_DTYPE

    def __init__(self, k: int, select=None) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"a top-k codec needs k >= 1 entries, got {k!r}")
        self.k = int(k)
        self.row = SparseRow(0, self.k)
        self.select = select or exact_topk

    def wire_elements(self, n: int) -> int:
        return self.row.words

    def compress(self, x):
        xp = array_module(x)
        idx = self.select(x, min(self.k, int(x.size)))
        payload = xp.empty(self.row.words, dtype=WORD_DTYPE)
        self.row.put(payload, 0, x[idx], idx, k=self.k)
        return payload, SparseCtx(int(x.size), idx)

    def decompress(self, payload, ctx):
        dense = scatter_mean(self.row.values(payload[None]), self.row.indices(payload[None]),
                             ctx.n, 1)
        return dense.astype(VALUE_DTYPE)

    def combine(self, rows, ctx, p: int):
        return scatter_mean(self.row.values(rows), self.row.indices(rows), ctx.n, p)

    def residual(self, acc, payload, ctx) -> None:
        """The sent entries are zeroed (``acc − sparse(acc)``, bit for bit: ``a − a = 0`` where
        sent, ``a − 0 = a`` elsewhere); padding slots send nothing."""
        acc[ctx.idx] = 0


# -- fused sparse buffers -------------------------------------------------------------------------
@dataclass(frozen=True)
class SparseRow:
    """One rank's int32 row of a fused buffer: ``[n_dense float32 values | K float32 values |
    K int32 indices]``, values and indices bit-cast into int32 words.

    A sparsified segment owns ``k`` consecutive *slots* (``slot .. slot + k - 1``) of the ``K``
    values and the same slots of the ``K`` indices.  Top-K's payload is ``SparseRow(0, K)``;
    an SSFusion ``Buffer_AG`` holds its dense tensors in the prefix.
    """

    n_dense: int = 0
    K: int = 0

    def __post_init__(self) -> None:
        for what, v in (("dense values", self.n_dense), ("sparse slots", self.K)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"a sparse row needs a whole number >= 0 of {what}, got {v!r}")

    @property
    def words(self) -> int:
        """int32 words of the row."""
        return int(self.n_dense) + 2 * int(self.K)

    @property
    def nbytes(self) -> int:
        """Bytes of the row: ``4 n_dense + 8 K`` (float32 values, int32 indices)."""
        return VALUE_BYTES * (int(self.n_dense) + int(self.K)) + INDEX_BYTES * int(self.K)

    def empty(self, xp=np):
        return xp.empty(self.words, dtype=WORD_DTYPE)

    def put_dense(self, row, offset: int, values) -> None:
        """float32 ``values`` into the dense prefix at ``offset``."""
        row[offset:offset + values.size] = values.astype(VALUE_DTYPE, copy=False).view(WORD_DTYPE)

    def put(self, row, slot: int, values, idx, base: int = 0, k: int | None = None) -> None:
        """A segment's selected ``values`` and positions ``idx`` (within the segment, which
        starts at flat position ``base``) into its slots; ``k`` slots when given, those a
        selector left empty carrying the value 0 at position ``base``."""
        v0 = int(self.n_dense) + int(slot)
        i0 = v0 + int(self.K)
        c = int(idx.size)
        row[v0:v0 + c] = values.astype(VALUE_DTYPE, copy=False).view(WORD_DTYPE)
        row[i0:i0 + c] = (idx + base if base else idx).astype(INDEX_DTYPE)
        if k is not None and c < k:
            row[v0 + c:v0 + k] = 0
            row[i0 + c:i0 + k] = base

    def dense(self, rows):
        """The dense prefixes of gathered ``rows`` (``(p, words)``) as float32 ``(p, n_dense)``."""
        return rows[:, :self.n_dense].view(VALUE_DTYPE)

    def dense_mean(self, rows, p: int):
        """Mean over the ``p`` ranks of the dense prefixes (float64)."""
        return self.dense(rows).astype(np.float64).sum(axis=0) / p

    def values(self, rows):
        """Every rank's sparse values, rank after rank (float32, ``p K``)."""
        nd = int(self.n_dense)
        return rows[:, nd:nd + self.K].reshape(-1).view(VALUE_DTYPE)

    def indices(self, rows):
        """Every rank's flat positions, rank after rank (int32, ``p K``)."""
        return rows[:, int(self.n_dense) + self.K:].reshape(-1)


def scatter_mean(values, indices, size: int, p: int, base: int = 0):
    """``(1/p) Σ`` of the entries ``values`` at flat positions ``indices - base`` of a dense
    vector of ``size`` (float64; duplicates add up: every rank's entries at once)."""
    xp = array_module(values)
    pos = indices - base if base else indices
    if xp is np:
        return xp.bincount(pos, weights=values.astype(np.float64), minlength=int(size)) / p
    # on a device bincount reads its input's sign and maximum back to the host (two syncs
    # per call); a scatter-add into the known size reads nothing
    import cupyx  # noqa: PLC0415  optional GPU backend

    out = xp.zeros(int(size), dtype=np.float64)
    cupyx.scatter_add(out, pos, values.astype(np.float64))
    return out / p


class ErrorFeedback:
    """Error feedback on a residual ``e`` (a view of the strategy's residual, updated in place).

    ``accumulate(x)`` returns ``a = e + x`` (stored in ``e``); once the codec has sent its part
    of ``a``, :meth:`sent` (sparse codecs: the positions sent) or :meth:`step` (any
    :class:`Compressor`) leaves ``e = a − D(C(a))``.  Disabled, ``a = x`` and nothing is kept.
    """

    __slots__ = ("enabled", "residual")

    def __init__(self, residual, enabled: bool = True) -> None:
        self.residual = residual
        self.enabled = bool(enabled)

    def accumulate(self, x, lo: int = 0, hi: int | None = None):
        """``a = e[lo:hi] + x`` (in ``e``; ``x`` when disabled)."""
        if not self.enabled:
            return x
        acc = self.residual[lo:hi]
        acc += x
        return acc

    def sent(self, idx, lo: int = 0, hi: int | None = None) -> None:
        """The entries ``idx`` of ``e[lo:hi]`` were sent: nothing of them is carried over."""
        if self.enabled:
            self.residual[lo:hi][idx] = 0

    def step(self, compressor: Compressor, x, lo: int = 0, hi: int | None = None):
        """``a = e + x``, ``(payload, ctx) = C(a)``, ``e = a − D(payload)``; returns
        ``(payload, ctx)``."""
        acc = self.accumulate(x, lo, hi)
        payload, ctx = compressor.compress(acc)
        if self.enabled:
            compressor.residual(acc, payload, ctx)
        return payload, ctx
