"""Gradient codecs: what a data-parallel strategy puts on the wire instead of a dense float32
gradient, and the error feedback that carries what it left out into the next step.

A strategy's codec is its bindings of the step's program (:class:`substrate.executor.
Bindings`): what a call sends is encoded in ``buffer(call)`` or in a compute item of the plan
before it (Top-K's and SSFusion's selection, PacTrain's packing and ternary code, FP16's cast),
and decoded in ``received(call, result)`` or a compute item after it.  The pieces they share:

* a **sparse payload** is one ``int32`` array ``[values | indices]``: ``k`` float32 values
  bit-cast to int32 words, then their ``k`` int32 flat positions, so one all-gather carries both
  halves; :class:`SparseRow` lays out a fused buffer of several sparsified segments the same way
  (an optional prefix of dense float32 values, then every segment's values and indices in its
  slots), :func:`scatter_mean` decodes the gathered rows;
* :class:`ErrorFeedback`: ``e <- e + x``, send part of it, ``e <- e - sent`` (Seide et al. 2014;
  Aji & Heafield 2017; DGC).

Everything works on NumPy and CuPy arrays alike and allocates nothing per step where an ``out``
is given.
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
    "ErrorFeedback",
    "SparseRow",
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


# -- sparse rows ----------------------------------------------------------------------------------
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
    of ``a``, :meth:`sent` (the positions sent) leaves ``e = a - sparse(a)``.  Disabled,
    ``a = x`` and nothing is kept.
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
