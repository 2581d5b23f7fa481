"""Compiled kernels of the relabelled-period search (:mod:`partition.period`).

Imported only when a network has enough twins to search (NumPy decides that first), so the
partitioning of a network without structure never starts Numba's compiler.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["column_hashes", "component_sizes", "expand", "mix_all", "quotient", "refine"]


@numba.njit(cache=True)
def _mix(x):
    """splitmix64's finaliser: a bijection of uint64 with good avalanche."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True)
def mix_all(x):
    """:func:`_mix` of every element (the search's colours start from these)."""
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = _mix(x[i])
    return out


@numba.njit(cache=True)
def column_hashes(indptr, indices, n_cols, table):
    """Set hash of every column's rows, sum_r table[r] (wrapping), one pass over the CSR."""
    cols = np.zeros(n_cols, dtype=np.uint64)
    for r in range(indptr.size - 1):
        tr = table[r]
        for e in range(indptr[r], indptr[r + 1]):
            cols[indices[e]] += tr
    return cols


@numba.njit(cache=True)
def quotient(indptr, indices, row_cls, n_row_cls, col_cls, col_size):
    """Quotient of one layer under twin classes, checked exactly.

    Every row must equal the first row of its class, and a class representative must hold all
    columns of each class it touches; returns (ok, qptr, qidx) with the column classes of every
    row class, sorted.
    """
    n_rows = indptr.size - 1
    rep = np.full(n_row_cls, -1, dtype=np.int64)
    for r in range(n_rows):
        if rep[row_cls[r]] < 0:
            rep[row_cls[r]] = r
    empty = np.zeros(1, dtype=np.int64)
    for r in range(n_rows):
        a = rep[row_cls[r]]
        if a == r:
            continue
        if indptr[r + 1] - indptr[r] != indptr[a + 1] - indptr[a]:
            return False, empty, empty
        off = indptr[a] - indptr[r]
        for e in range(indptr[r], indptr[r + 1]):
            if indices[e] != indices[e + off]:
                return False, empty, empty
    count = np.zeros(col_size.size, dtype=np.int64)
    qptr = np.zeros(n_row_cls + 1, dtype=np.int64)
    buf = np.empty(indices.size, dtype=np.int64)
    n = 0
    for R in range(n_row_cls):
        a = rep[R]
        start = n
        for e in range(indptr[a], indptr[a + 1]):
            c = col_cls[indices[e]]
            if count[c] == 0:
                buf[n] = c
                n += 1
            count[c] += 1
        for t in range(start, n):
            if count[buf[t]] != col_size[buf[t]]:
                return False, empty, empty
            count[buf[t]] = 0
        buf[start:n] = np.sort(buf[start:n])
        qptr[R + 1] = n
    return True, qptr, buf[:n].copy()


@numba.njit(cache=True)
def _sweep_level(col, j, lo_a, hi_a, lo_b, hi_b, in_ptr, in_idx, out_ptr, out_idx):
    """Recolour level j of both chains from the current colours; False when the colour
    multisets of A and B differ there.  Returns (same multisets, distinct colours on A)."""
    na = hi_a - lo_a
    new = np.empty(2 * na, dtype=np.uint64)
    for side in range(2):
        lo = lo_a if side == 0 else lo_b
        for i in range(na):
            v = lo + i
            s_in = np.uint64(0)
            for e in range(in_ptr[v], in_ptr[v + 1]):
                s_in += _mix(col[in_idx[e]])
            s_out = np.uint64(0)
            for e in range(out_ptr[v], out_ptr[v + 1]):
                s_out += _mix(col[out_idx[e]] ^ np.uint64(0x9E3779B97F4A7C15))
            new[side * na + i] = _mix(col[v] + _mix(s_in ^ np.uint64(0xBF58476D1CE4E5B9))
                                      * np.uint64(3) + _mix(s_out))
    col[lo_a:hi_a] = new[:na]
    col[lo_b:hi_b] = new[na:]
    sa = np.sort(new[:na])
    sb = np.sort(new[na:])
    distinct = 0
    for i in range(na):
        if sa[i] != sb[i]:
            return False, 0
        if i == 0 or sa[i] != sa[i - 1]:
            distinct += 1
    return True, distinct


@numba.njit(cache=True)
def refine(col, off_a, off_b, in_ptr, in_idx, out_ptr, out_idx, dirty, distinct):
    """Colour refinement of both chains to the stable colouring.

    Levels marked ``dirty`` are recoloured in Gauss-Seidel sweeps (forward, then backward); a
    level whose colour classes split marks its neighbour levels dirty (a level whose partition
    did not change only renamed its colours, which changes no neighbour's partition).  The
    stable partition is the same for any order; both chains follow the same order, so equal
    colours mean the same thing on both.  False as soon as a level's colour multisets differ
    between A and B.  ``distinct[j]`` is the number of colours of level j.
    """
    levels = off_a.size - 1
    busy = True
    while busy:
        busy = False
        for direction in range(2):
            for t in range(levels):
                j = t if direction == 0 else levels - 1 - t
                if not dirty[j]:
                    continue
                dirty[j] = False
                ok, d = _sweep_level(col, j, off_a[j], off_a[j + 1], off_b[j], off_b[j + 1],
                                     in_ptr, in_idx, out_ptr, out_idx)
                if not ok:
                    return False
                if d != distinct[j]:
                    distinct[j] = d
                    busy = True
                    if j > 0:
                        dirty[j - 1] = True
                    if j + 1 < levels:
                        dirty[j + 1] = True
    return True


@numba.njit(cache=True)
def component_sizes(r, c, n_rows, n_cols):
    """Sorted keys rows * (n_cols + 1) + columns of the connected components of the bipartite
    graph with edges (r[e], c[e]) (union-find)."""
    n = n_rows + n_cols
    parent = np.arange(n)
    for e in range(r.size):
        a = r[e]
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        b = c[e] + n_rows
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        if a != b:
            parent[max(a, b)] = min(a, b)
    rows = np.zeros(n, dtype=np.int64)
    cols = np.zeros(n, dtype=np.int64)
    for v in range(n):
        a = v
        while parent[a] != a:
            a = parent[a]
        if v < n_rows:
            rows[a] += 1
        else:
            cols[a] += 1
    keys = np.empty(n, dtype=np.int64)
    m = 0
    for v in range(n):
        if rows[v] + cols[v] > 0 and parent[v] == v:
            keys[m] = rows[v] * (n_cols + 1) + cols[v]
            m += 1
    return np.sort(keys[:m])


@numba.njit(cache=True)
def expand(cls_a, cls_b, class_map, n_cls):
    """Neuron map of one level: the k-th member of class class_map[c] of A for the k-th member
    of class c of B (counting sort, index order inside a class)."""
    n = cls_a.size
    start = np.zeros(n_cls + 1, dtype=np.int64)
    for i in range(n):
        start[cls_a[i] + 1] += 1
    for c in range(n_cls):
        start[c + 1] += start[c]
    members = np.empty(n, dtype=np.int64)
    fill = start[:-1].copy()
    for i in range(n):
        members[fill[cls_a[i]]] = i
        fill[cls_a[i]] += 1
    out = np.empty(n, dtype=np.int64)
    nxt = start[:-1].copy()
    for a in range(n):
        c = class_map[cls_b[a]]
        out[a] = members[nxt[c]]
        nxt[c] += 1
    return out
