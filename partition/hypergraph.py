"""The multi-phase hypergraph model with fixed vertices of the H-SGD paper (§5).

Phase phi_k partitions the rows of W^k.  The hypergraph H(phi_k) = (V^k u F^k, N^k) has

* a vertex v_i per row W^k(i, :), weighted by nnz(W^k(i, :)) (the work of eq. 10 and eq. 11);
* a net n_j per column W^k(:, j) that has at least one nonzero, of cost 2 (one word in SpFF and
  one in SpBP, so that the connectivity-1 cut size (eq. 1) is the communication volume);
* a fixed vertex v^f_j per such column, pinned to the part that computed x^{k-1}(j) in phase
  phi_{k-1} (absent in phi_1, where x^0 is placed afterwards from the net connectivity).

pins(n_j) = {v_i : W^k(i, j) != 0} u {v^f_j}                                    (eq. 12)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["LayerHypergraph", "build_layer_hypergraph", "connectivity_cutsize", "set_hash"]

#: net cost of the model: one word in SpFF plus one word in SpBP (§5)
NET_COST = 2


@dataclass(frozen=True)
class LayerHypergraph:
    """H(phi_k) in CSR-like pin lists.

    Attributes
    ----------
    num_rows : int
        Number of free vertices |V^k| (rows of W^k); vertex ids 0 .. num_rows-1.
    columns : np.ndarray
        Global column index j of every net, in net order.
    net_ptr, pins : np.ndarray
        Pins of net e are ``pins[net_ptr[e]:net_ptr[e+1]]``; the fixed vertex of a net (if any)
        is its last pin and has vertex id ``num_rows + e``.
    vertex_weight : np.ndarray
        Weight of all vertices (free: nnz of the row; fixed: ``fixed_weight``).
    net_cost : np.ndarray
        Cost of every net (2).
    fixed : np.ndarray
        Block of every vertex, -1 for free vertices (empty blocks array when there are none).
    """

    num_rows: int
    columns: np.ndarray
    net_ptr: np.ndarray
    pins: np.ndarray
    vertex_weight: np.ndarray
    net_cost: np.ndarray
    fixed: np.ndarray

    @property
    def num_nets(self) -> int:
        return int(self.columns.size)

    @property
    def num_vertices(self) -> int:
        return int(self.vertex_weight.size)

    @property
    def has_fixed(self) -> bool:
        return bool(np.any(self.fixed >= 0))

    def net_pins(self, e: int) -> np.ndarray:
        return self.pins[self.net_ptr[e]:self.net_ptr[e + 1]]


def build_layer_hypergraph(W: sp.spmatrix, prev_owner: np.ndarray | None = None, *,
                           fixed_weight: int = 0) -> LayerHypergraph:
    """Build H(phi_k) for the weight matrix W^k (§5, eq. 12).

    Parameters
    ----------
    W : scipy.sparse matrix, shape (N_k, N_{k-1})
        Sparsity pattern of W^k (rows = neurons of layer k).
    prev_owner : np.ndarray of int, shape (N_{k-1},), optional
        Part that computed x^{k-1}(j) in phase phi_{k-1}; ``None`` for phi_1 (no fixed vertices).
    fixed_weight : int
        Weight given to fixed vertices.  The model gives them no weight; Mt-KaHyPar 1.7 does not
        keep zero-weight fixed vertices in their block, so its backend passes 1 and raises the
        block capacities by the number of fixed vertices of each block.

    Returns
    -------
    LayerHypergraph
    """
    A = sp.csc_matrix(W, copy=False)
    n_rows, n_cols = A.shape
    if prev_owner is not None:
        prev_owner = np.asarray(prev_owner)
        if prev_owner.shape != (n_cols,):
            raise ValueError(f"prev_owner must have one part per column of W ({n_cols}), got "
                             f"shape {prev_owner.shape}")
    A.sort_indices()
    counts = np.diff(A.indptr)
    columns = np.flatnonzero(counts > 0)
    nnz_row = np.diff(sp.csr_matrix(W).indptr).astype(np.int64)
    vw = np.maximum(nnz_row, 1)  # a row with no nonzero still owns x^k(i); keep it placeable
    row_pins = A.indices.astype(np.int64)  # CSC: pins of the non-empty columns, net by net
    if prev_owner is None:
        net_ptr = np.concatenate(([0], np.cumsum(counts[columns]))).astype(np.int64)
        pins = row_pins
        fixed = np.full(n_rows, -1, dtype=np.int64)
    else:
        sizes = counts[columns] + 1
        net_ptr = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        pins = np.empty(net_ptr[-1], dtype=np.int64)
        net_of_pin = np.repeat(np.arange(columns.size), counts[columns])
        pins[np.arange(row_pins.size) + net_of_pin] = row_pins
        pins[net_ptr[1:] - 1] = n_rows + np.arange(columns.size)
        vw = np.concatenate((vw, np.full(columns.size, fixed_weight, dtype=np.int64)))
        fixed = np.concatenate((np.full(n_rows, -1), prev_owner[columns])).astype(np.int64)
    return LayerHypergraph(num_rows=n_rows, columns=columns, net_ptr=net_ptr, pins=pins,
                           vertex_weight=vw, net_cost=np.full(columns.size, NET_COST, np.int64),
                           fixed=fixed)


def connectivity_cutsize(hg: LayerHypergraph, part: np.ndarray) -> int:
    """Connectivity-1 cut size chi(Pi) = sum_n cost(n) (lambda(n) - 1) (eq. 1).

    ``part`` gives the block of every vertex (free and fixed) of ``hg``.
    """
    part = np.asarray(part)
    net_of_pin = np.repeat(np.arange(hg.num_nets), np.diff(hg.net_ptr))
    pairs = np.unique(net_of_pin * (int(part.max()) + 1) + part[hg.pins])
    lam = np.bincount(pairs // (int(part.max()) + 1), minlength=hg.num_nets)
    return int(np.sum(hg.net_cost * (lam - 1)))


def set_hash(indptr: np.ndarray, indices: np.ndarray, n_items: int, seed: int) -> np.ndarray:
    """64-bit hash of each CSR row's index set (sum of random words, wrapping): equal sets hash
    alike, different ones collide with probability ~2^-64."""
    rnd = np.random.default_rng(seed).integers(1, 2**63 - 1, size=n_items, dtype=np.int64)
    vals = rnd.view(np.uint64)[indices]
    counts = np.diff(indptr)
    if counts.size and counts[0] > 0 and np.all(counts == counts[0]):  # regular rows
        out = vals.reshape(counts.size, int(counts[0])).sum(axis=1, dtype=np.uint64)
    else:
        out = np.zeros(indptr.size - 1, dtype=np.uint64)
        rows = np.flatnonzero(counts)
        if rows.size:  # reduceat over the non-empty rows (wrapping uint64 sums)
            out[rows] = np.add.reduceat(vals, indptr[:-1][rows])
    return out + counts.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def compress_hypergraph(W: sp.spmatrix, prev_owner: np.ndarray | None, parts: int,
                        max_chunk: int) -> tuple[LayerHypergraph, np.ndarray]:
    """A smaller hypergraph with the same connectivity cut size as H(phi_k) (eq. 12).

    Three reductions, each exact for the partitions the result can express:

    * rows of W^k with identical column sets (identical net memberships) are grouped into chunks
      of at most ``max_chunk`` rows, one vertex per chunk weighted by the sum of the rows' nnz;
    * all fixed vertices pinned to the same part are one vertex (a net only needs to contain
      *a* vertex of the part that computed x^{k-1}(j));
    * nets with identical pins after the two steps are merged, their costs summed, and a net
      left with one pin (no fixed vertex, its rows in one vertex) is dropped.

    Returns
    -------
    (hypergraph, row_to_vertex)
        ``row_to_vertex[i]`` is the compressed vertex that holds row i.
    """
    A = sp.csr_matrix(W, copy=False)
    A.sort_indices()
    n_rows, n_cols = A.shape
    nnz_row = np.diff(A.indptr).astype(np.int64)
    # group identical rows, then cut each group into chunks
    h = set_hash(A.indptr, A.indices, n_cols, seed=12345)
    _, group = np.unique(h, return_inverse=True)
    group = group.reshape(-1)
    if n_rows == 0 or int(group.max()) + 1 == n_rows or max_chunk <= 1:
        # no two rows alike (a random or trained layer) or chunks of one row: a vertex per row
        row_to_vertex = np.arange(n_rows, dtype=np.int64)
        n_v = n_rows
        vw = np.maximum(nnz_row, 1)
        B = A.tocsc()  # the columns' rows, sorted (A's indices are)
    else:
        order = np.argsort(group, kind="stable")
        g_sorted = group[order]
        first = np.concatenate(([0], np.flatnonzero(np.diff(g_sorted)) + 1))
        pos_in_group = np.arange(n_rows) - np.repeat(first, np.diff(np.append(first, n_rows)))
        chunk_key = g_sorted.astype(np.int64) * (n_rows + 1) + pos_in_group // max_chunk
        _, chunk_sorted = np.unique(chunk_key, return_inverse=True)
        row_to_vertex = np.empty(n_rows, dtype=np.int64)
        row_to_vertex[order] = chunk_sorted.reshape(-1)
        n_v = int(chunk_sorted.max()) + 1
        vw = np.bincount(row_to_vertex, weights=np.maximum(nnz_row, 1), minlength=n_v)
        vw = vw.astype(np.int64)
        # coarse incidence: vertex x column
        S = sp.csr_matrix((np.ones(n_rows), (row_to_vertex, np.arange(n_rows))),
                          shape=(n_v, n_rows))
        B = sp.csc_matrix(S @ A)
        B.sort_indices()
    cols = np.flatnonzero(np.diff(B.indptr) > 0)
    if cols.size < n_cols:
        B = sp.csc_matrix(B[:, cols])
        B.sort_indices()
    ptr, idx = B.indptr.astype(np.int64), B.indices.astype(np.int64)
    if prev_owner is not None:
        fixed_part = np.asarray(prev_owner)[cols].astype(np.int64)
        present = np.unique(fixed_part)
        fixed_vertex = np.full(parts, -1, dtype=np.int64)
        fixed_vertex[present] = n_v + np.arange(present.size)
        sizes = np.diff(ptr) + 1
        new_ptr = np.concatenate(([0], np.cumsum(sizes)))
        pins = np.empty(new_ptr[-1], dtype=np.int64)
        net_of_pin = np.repeat(np.arange(cols.size), np.diff(ptr))
        pins[np.arange(idx.size) + net_of_pin] = idx
        pins[new_ptr[1:] - 1] = fixed_vertex[fixed_part]
        ptr, idx = new_ptr, pins
        fixed = np.concatenate((np.full(n_v, -1), present)).astype(np.int64)
        vw = np.concatenate((vw, np.zeros(present.size, dtype=np.int64)))
    else:
        fixed = np.full(n_v, -1, dtype=np.int64)
        # a net of one pin is never cut (lambda = 1 under every partition): dropped
        sizes = np.diff(ptr)
        if np.any(sizes < 2):
            cut = sizes >= 2
            cols, idx = cols[cut], idx[np.repeat(cut, sizes)]
            ptr = np.concatenate(([0], np.cumsum(sizes[cut]))).astype(np.int64)
    # merge identical nets
    hn = set_hash(ptr, idx, n_v + parts, seed=54321)
    _, first_net, mult = np.unique(hn, return_index=True, return_counts=True)
    if first_net.size == cols.size:  # no two nets alike
        return LayerHypergraph(num_rows=n_v, columns=cols, net_ptr=ptr, pins=idx,
                               vertex_weight=vw, net_cost=np.full(cols.size, NET_COST, np.int64),
                               fixed=fixed), row_to_vertex
    by_first = np.argsort(first_net)
    keep = first_net[by_first]
    cost = (NET_COST * mult[by_first]).astype(np.int64)
    sizes = ptr[keep + 1] - ptr[keep]
    new_ptr = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    starts = np.repeat(ptr[keep], sizes) + (np.arange(new_ptr[-1]) - np.repeat(new_ptr[:-1], sizes))
    hg = LayerHypergraph(num_rows=n_v, columns=cols[keep], net_ptr=new_ptr, pins=idx[starts],
                         vertex_weight=vw, net_cost=cost, fixed=fixed)
    return hg, row_to_vertex
