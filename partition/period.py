"""Periods of a layer sequence, exact or up to a relabelling of the hidden neurons.

H-SGD's partitioner (§5) repeats the partition of one period when the layers repeat
(:func:`partition.partitioners.hypergraph_partition`, ``tile``).  A network read from files
repeats only up to a relabelling: the Graph Challenge RadiX-Nets are ``P_k W^k P_{k-1}^T`` with a
random permutation P_k of every hidden layer, so no two layers have the same sparsity pattern.
This module finds the period from the data alone.

A *relabelled period* p of W^1 .. W^L is a family of bijections sigma_j (layer j + p -> layer
j, j = 0 .. L - p) with

    (a, b) stored in W^{k+p}  <=>  (sigma_k(a), sigma_{k-1}(b)) stored in W^k   for k = 1 .. L - p,

on the sparsity pattern as stored (duplicates summed; an explicitly stored zero counts as an
entry, as it does in the partitioner's hypergraph, eq. 12).  It is an isomorphism of the
layered graph of neuron layers 0 .. L - p (chain A) onto that of layers
p .. L (chain B) that maps layer j to layer j + p.  Layer 0 is the input and layer L the output;
the chains use only their own layers' edges (layer p's in-edges from W^p are not part of B).

How it is found:

1. **Twins.**  Neurons of one layer with the same in-set (row of W^j) and the same out-set
   (column of W^{j+1}) are interchangeable in any isomorphism.  Each layer's neurons are grouped
   into twin classes (64-bit set hashes, then checked exactly), and every W^k becomes its
   *quotient*: class R of layer k is joined to class C of layer k-1 when one (then every) row of
   R has the columns of C.  A Kronecker-widened layer ``kron(ones(B, B), M)`` has quotient M.
2. **Individualisation-refinement** on the two quotient chains (the standard method of graph
   isomorphism, e.g. McKay & Piperno's nauty): colours start from the level and the class size;
   colour refinement (Gauss-Seidel sweeps over the levels, forward then backward, a colour
   becomes a hash of itself and the multisets of its in- and out-neighbours' colours) runs on A
   and B side by side and stops at the first level whose colour multisets differ (no isomorphism
   extends the choices made); while a colour holds several vertices, one vertex of A and a
   vertex of B of that colour get a new common colour and refinement runs again (the B
   vertices of that colour are tried in turn, depth first, backtracking out of a branch that
   finds no isomorphism; at most :data:`TRIALS_PER_PERIOD` failures per candidate period).  A discrete, matching colouring is an isomorphism of the
   quotient chains, checked edge by edge.
3. **Expansion**: the members of a class of B map onto the members of its image class in A in
   index order (twins are interchangeable).

Candidate periods p = 1, 2, ... with 2 p < L are tried in order; the first that yields an
isomorphism is returned.  The search runs only when the twin quotient holds at most
:data:`QUOTIENT_FRACTION` of the neurons: on a network without twins (a pruned network, random
regular layers) the candidates of an individualisation are not interchangeable, a search would
cost more than partitioning every layer, and such networks do not repeat in practice, so they
are partitioned layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from partition.hypergraph import set_hash

__all__ = [
    "QUOTIENT_FRACTION",
    "TRIALS_PER_PERIOD",
    "LayerPeriod",
    "find_period",
    "layer_period",
    "relabelled_period",
]

#: the relabelled-period search runs when the twin quotient has at most this fraction of the
#: neurons (a RadiX-Net widened by blocks of 16 has 1/16)
QUOTIENT_FRACTION = 0.5
#: failed individualisations (a B vertex tried for an A vertex whose refinement did not match,
#: or whose branch found no isomorphism) after which a candidate period is given up, counted
#: over the whole search of that period; with symmetric quotients (RadiX-Nets) the first
#: candidate of every choice succeeds, an asymmetric one needs up to a class's size per choice,
#: and a quotient of many components refinement cannot tell apart may need more than the budget
TRIALS_PER_PERIOD = 256

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class LayerPeriod:
    """A period p of a layer sequence and the maps that carry layer j + p onto layer j.

    ``maps[j][a]`` (j = 0 .. L - p) is the neuron of layer j that neuron a of layer j + p
    corresponds to; ``maps`` is None for an exact period (W^{k+p} has the sparsity of W^k, every
    map the identity).
    """

    period: int
    maps: tuple | None = None

    @property
    def relabelled(self) -> bool:
        return self.maps is not None

    def carry(self, owners_j: np.ndarray, j: int) -> np.ndarray:
        """Owners of layer j + p given the owners of layer j: neuron a of layer j + p gets the
        owner of ``maps[j][a]``."""
        return owners_j if self.maps is None else np.asarray(owners_j)[self.maps[j]]


def _sorted_csr(W) -> sp.csr_matrix:
    """CSR with sorted indices and no duplicate entries (a copy only when needed)."""
    A = sp.csr_matrix(W)
    if not A.has_canonical_format:
        A = A.copy()
        A.sum_duplicates()
    return A


def _same_pattern(A: sp.csr_matrix, B: sp.csr_matrix) -> bool:
    return (A.shape == B.shape and np.array_equal(A.indptr, B.indptr)
            and np.array_equal(A.indices, B.indices))


def layer_period(weights) -> int | None:
    """Smallest p < L with W^{k+p} of the same sparsity pattern as W^k for every k (exact
    comparison of the sorted CSR structure), or None when the sequence has no such period."""
    return _exact_period([_sorted_csr(W) for W in weights])


def _exact_period(mats: list) -> int | None:
    L = len(mats)
    for p in range(1, L):
        if all(_same_pattern(mats[k], mats[k - p]) for k in range(p, L)):
            return p
    return None


# ---------------------------------------------------------------------------------------------
# twin quotient


def _kernels():
    """:mod:`partition.kernels`, imported on first use (Numba starts only for a search)."""
    from . import kernels  # noqa: PLC0415 (Numba, only when there are twins)

    return kernels


#: seed of the random words of the set hashes (fixed: the same network, the same classes)
_SEED = 0x5EED


def _out_table(n: int) -> np.ndarray:
    """Random words of the out-set hashes (one per row of a layer)."""
    return np.random.default_rng(_SEED + 1).integers(1, 2**63 - 1, size=n,
                                                     dtype=np.int64).view(np.uint64)


@dataclass
class _Quotient:
    """Set hashes of every neuron and the twin classes / quotient layers built from them."""

    mats: list
    h_in: list    # h_in[j]: in-set hash of layer j's neurons (None for j = 0)
    h_out: list   # h_out[j]: out-set hash (None for j = L)

    def classes(self, j: int, use_in: bool = True, use_out: bool = True) -> np.ndarray:
        key = np.zeros(self.mats[j - 1].shape[0] if j else self.mats[0].shape[1], np.uint64)
        if use_in and self.h_in[j] is not None:
            key = key + self.h_in[j] * _GOLDEN
        if use_out and self.h_out[j] is not None:
            key = key + (self.h_out[j] ^ _M1) * _M2
        _, cls = np.unique(key, return_inverse=True)
        return cls.ravel().astype(np.int64)


def _row_hashes(mats: list) -> list:
    """In-set hash of every row of every layer (:func:`partition.hypergraph.set_hash`)."""
    return [set_hash(W.indptr, W.indices, W.shape[1], seed=_SEED) for W in mats]


def _hashes(mats: list, rows: list, t_out: np.ndarray) -> _Quotient:
    """Add the out-set hashes (columns of every layer, one compiled pass per layer)."""
    L = len(mats)
    h_out = [None] * (L + 1)
    for k, W in enumerate(mats, start=1):
        h_out[k - 1] = _kernels().column_hashes(W.indptr, W.indices, W.shape[1], t_out)
    return _Quotient(mats=mats, h_in=[None, *rows], h_out=h_out)


def _layer_quotient(W: sp.csr_matrix, row_cls: np.ndarray, col_cls: np.ndarray):
    """Edges (row class, column class) of the quotient of W, or None when a class is not a
    class of twins after all (a 64-bit hash collision)."""
    n_row, n_col = int(row_cls.max()) + 1, int(col_cls.max()) + 1
    ok, qptr, qidx = _kernels().quotient(W.indptr, W.indices, row_cls, n_row, col_cls,
                               np.bincount(col_cls, minlength=n_col))
    if not ok:
        return None
    return np.repeat(np.arange(n_row, dtype=np.int64), np.diff(qptr)), qidx


def _components(edges, n_rows: int, n_cols: int) -> tuple:
    """Edge count and the sorted (rows, columns) sizes of the connected components of a
    quotient layer (as a bipartite graph), a relabelling invariant."""
    r, c = edges
    return r.size, _kernels().component_sizes(r, c, n_rows, n_cols).tobytes()


def _chain(sizes: list, edges: list):
    """A chain of quotient levels as one graph: level offsets, class sizes and the edges
    (row class of level t, column class of level t - 1) in global vertex ids."""
    off = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum([s.size for s in sizes], out=off[1:])
    counts = [r.size for r, _ in edges]
    r = np.concatenate([r for r, _ in edges]) + np.repeat(off[1:-1], counts)
    c = np.concatenate([c for _, c in edges]) + np.repeat(off[:-2], counts)
    return off, np.concatenate(sizes), r, c


def _csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
    return ptr, dst[order].astype(np.int64)


def _isomorphism(chain_a, chain_b) -> list | None:
    """Class maps (B level -> A level) of an isomorphism of two quotient chains, or None."""
    off_a, size_a, ra, ca = chain_a
    off_b, size_b, rb, cb = chain_b
    if not np.array_equal(off_a, off_b) or ra.size != rb.size:
        return None
    n = int(off_a[-1])
    levels = off_a.size - 1
    src = np.concatenate((ra, rb + n))  # B's vertices follow A's in one graph
    dst = np.concatenate((ca, cb + n))
    in_ptr, in_idx = _csr(src, dst, 2 * n)
    out_ptr, out_idx = _csr(dst, src, 2 * n)
    level = np.repeat(np.arange(levels), np.diff(off_a))
    col = np.concatenate((_colour0(level, size_a), _colour0(level, size_b)))
    args = (off_a, off_a + n, in_ptr, in_idx, out_ptr, out_idx)
    distinct = np.zeros(levels, dtype=np.int64)
    if not _kernels().refine(col, *args, np.ones(levels, dtype=np.bool_), distinct):
        return None
    failed = [0]

    def leaf(col):
        oa, ob = np.argsort(col[:n]), np.argsort(col[n:])
        if not np.array_equal(col[:n][oa], col[n:][ob]):
            return None
        b_to_a = np.empty(n, dtype=np.int64)
        b_to_a[ob] = oa
        # the map must carry every class onto one as big and every edge of B onto an edge of A
        if not np.array_equal(size_a[b_to_a], size_b):
            return None
        if not np.array_equal(np.sort(ra * n + ca), np.sort(b_to_a[rb] * n + b_to_a[cb])):
            return None
        return [b_to_a[off_a[j]:off_a[j + 1]] - off_a[j] for j in range(levels)]

    def descend(col, distinct, depth):
        """Individualise one vertex of the smallest non-singleton colour of A against each B
        vertex of that colour in turn, refine, go deeper; backtrack when a branch fails."""
        vals, first, counts = np.unique(col[:n], return_index=True, return_counts=True)
        if counts.max() == 1:
            return leaf(col)
        if depth >= _MAX_DEPTH:
            raise _GiveUp
        multi = np.flatnonzero(counts > 1)
        pick = multi[np.lexsort((first[multi], counts[multi]))[0]]  # smallest class, lowest
        u = int(first[pick])
        j = int(level[u])
        dirty = np.zeros(levels, dtype=np.bool_)
        dirty[max(j - 1, 0):j + 2] = True
        dirty[j] = False
        mark = _kernels().mix_all(np.array([vals[pick] + np.uint64(depth + 1) * _GOLDEN]))[0]
        for v in (np.flatnonzero(col[n:] == vals[pick]) + n).tolist():
            trial, seen = col.copy(), distinct.copy()
            trial[u] = trial[v] = mark
            seen[j] += 1
            if _kernels().refine(trial, *args, dirty.copy(), seen):
                found = descend(trial, seen, depth + 1)
                if found is not None:
                    return found
            failed[0] += 1
            if failed[0] >= TRIALS_PER_PERIOD:
                raise _GiveUp
        return None

    try:
        return descend(col, distinct, 0)
    except _GiveUp:
        return None


class _GiveUp(Exception):
    """The search's budget (:data:`TRIALS_PER_PERIOD`, :data:`_MAX_DEPTH`) is spent."""


#: individualisations on one branch before a candidate period is given up (Python recursion)
_MAX_DEPTH = 500


def _colour0(level: np.ndarray, size: np.ndarray) -> np.ndarray:
    return _kernels().mix_all(level.astype(np.uint64) * _GOLDEN + size.astype(np.uint64))


def relabelled_period(weights) -> LayerPeriod | None:
    """The smallest relabelled period p (2 p < L) and its maps, or None (see the module
    docstring; ``None`` also when the twin quotient is too large to search)."""
    return _relabelled_period([_sorted_csr(W) for W in weights])


def _relabelled_period(mats: list) -> LayerPeriod | None:
    if len(mats) < 3 or any(0 in W.shape for W in mats):
        return None
    with np.errstate(over="ignore"):
        # the cheap test first, in NumPy (no compiler started): rows of W^k with the same
        # columns bound the twin classes from below, so when layers 1 .. L hold more distinct
        # rows than QUOTIENT_FRACTION of their neurons the twin quotient is too large
        rows = _row_hashes(mats)
        distinct = sum(np.unique(h).size for h in rows)
        if distinct > QUOTIENT_FRACTION * sum(h.size for h in rows):
            return None
        return _search(_hashes(mats, rows, _out_table(max(W.shape[0] for W in mats))))


def _search(q: _Quotient) -> LayerPeriod | None:
    mats = q.mats
    L = len(mats)
    full = [q.classes(j) for j in range(L + 1)]
    n_cls = [int(c.max()) + 1 for c in full]
    neurons = [c.size for c in full]
    if sum(n_cls) > QUOTIENT_FRACTION * sum(neurons):
        return None
    quot = [None] * (L + 1)  # quot[k]: quotient of W^k under the full classes
    for k in range(1, L + 1):
        quot[k] = _layer_quotient(mats[k - 1], full[k], full[k - 1])
        if quot[k] is None:  # a hash collision merged non-twins: no search
            return None
    # per-layer invariants of the quotient (shape, edges, class sizes) prune the candidates
    level_sig = [(neurons[j], n_cls[j]) for j in range(L + 1)]
    layer_sig = [(mats[k - 1].shape, mats[k - 1].nnz) for k in range(1, L + 1)]
    sizes = [np.bincount(c) for c in full]
    # the quotient of a layer between two interior levels is the same in every chain: its
    # connected components (as a bipartite graph) are an invariant; the first and last layers'
    # depend on the chain's end classes and are left to the isomorphism test
    shape = [None] + [_components(quot[k], sizes[k].size, sizes[k - 1].size)
                      for k in range(1, L + 1)]
    for p in range(1, (L - 1) // 2 + 1):
        La = L - p
        if any(layer_sig[k - 1] != layer_sig[k + p - 1] for k in range(1, La + 1)):
            continue
        if any(shape[k] != shape[k + p] for k in range(2, La)):
            continue
        if any(level_sig[j] != level_sig[j + p] for j in range(1, La)):
            continue
        # the chains' own end classes: A's level 0 and B's level p have no in-edges, A's level
        # L - p and B's level L no out-edges
        a_ends = (full[0], q.classes(La, use_out=False))
        b_ends = (q.classes(p, use_in=False), full[L])
        a_top = _layer_quotient(mats[La - 1], a_ends[1], full[La - 1])
        b_first = _layer_quotient(mats[p], full[p + 1], b_ends[0])
        if a_top is None or b_first is None:
            continue
        chain_a = _chain([sizes[0], *sizes[1:La], np.bincount(a_ends[1])],
                         [*quot[1:La], a_top])
        chain_b = _chain([np.bincount(b_ends[0]), *sizes[p + 1:L + 1]],
                         [b_first, *quot[p + 2:L + 1]])
        class_maps = _isomorphism(chain_a, chain_b)
        if class_maps is None:
            continue
        a_levels = [*full[:La], a_ends[1]]
        b_levels = [b_ends[0], *full[p + 1:L + 1]]
        maps = tuple(_kernels().expand(a_levels[j], b_levels[j], class_maps[j], int(a_levels[j].max()) + 1)
                     for j in range(La + 1))
        return LayerPeriod(period=p, maps=maps)
    return None


def find_period(weights, *, relabelled: bool = True) -> LayerPeriod | None:
    """The exact period (:func:`layer_period`) if there is one, else (``relabelled``) the
    relabelled period (:func:`relabelled_period`), else None; only periods with 2 p < L, the
    ones worth repeating, are returned."""
    mats = [_sorted_csr(W) for W in weights]
    p = _exact_period(mats)
    if p is not None and 2 * p < len(mats):
        return LayerPeriod(period=p)
    if relabelled:
        return _relabelled_period(mats)
    return None
