"""Placement of the vertices the hypergraph model leaves free: the input vector x^0 (§5, Fig. 3).

Phase phi_1 partitions the rows of W^1; x^0 is not a vertex of H(phi_1).  The paper stores
x^0(j) on "one of the processors" of the connectivity set Lambda(n_j) of net n_j (Fig. 3): then
it is sent to lambda(n_j) - 1 processors in layer 1's SpFF and no processor is added to the net,
whichever member of Lambda(n_j) is chosen.  *Which* member is free, and it decides two balances
the cut size does not see:

* the **load**: how many entries of x^0 (input rows of every mini-batch) a processor owns;
* the **layer-1 send volume** of a processor: the sum of lambda(n_j) - 1 over the x^0(j) it owns.

Two rules (:data:`INPUT_PLACEMENTS`):

``balanced`` (default)
    Entries in decreasing order of lambda(n_j) - 1 (the longest-processing-time order of
    makespan scheduling), each to the member of Lambda(n_j) with the smallest send volume so far
    among those owning fewer than ``ceil(N_0 / P) + slack`` entries (room being kept for the
    entries whose net lies in one processor only, which have no choice); when every member is
    full,
    to the processor with the smallest send volume that has room (that entry then costs one word
    more: the only departure from Fig. 3, bounded by the cap).  Entries no row uses (empty
    nets) fill the processors with the fewest entries.
``most_pins``
    The member of Lambda(n_j) holding most pins of n_j, ties to the lowest id; unused entries
    round-robin (the earlier rule: at P = 512 it left 465 processors without an entry
    and gave one 32).
"""

from __future__ import annotations

import heapq

import numpy as np
import scipy.sparse as sp

__all__ = ["INPUT_PLACEMENTS", "net_part_pins", "place_inputs"]

#: rules for placing x^0 (``HypergraphConfig.input_placement``)
INPUT_PLACEMENTS = ("balanced", "most_pins")


def net_part_pins(W1: sp.spmatrix, owner1: np.ndarray, parts: int) -> sp.csc_matrix:
    """``C[m, j]``: pins of net n_j of H(phi_1) in part m (rows of W^1 on m that use x^0(j))."""
    A = sp.csr_matrix(W1, copy=True)
    A.data[:] = 1.0
    owner1 = np.asarray(owner1, dtype=np.int64)
    onehot = sp.csr_matrix((np.ones(owner1.size), (owner1, np.arange(owner1.size))),
                           shape=(parts, owner1.size))
    C = sp.csc_matrix(onehot @ A)
    C.eliminate_zeros()
    C.sort_indices()
    return C


def place_inputs(W1: sp.spmatrix, owner1: np.ndarray, parts: int, rule: str = "balanced", *,
                 slack: int = 1) -> np.ndarray:
    """The processor of every entry of x^0 given the row partition ``owner1`` of W^1 (§5).

    Parameters
    ----------
    W1 : scipy.sparse matrix, shape (N_1, N_0)
    owner1 : np.ndarray of int, shape (N_1,)
        Part of every row of W^1 (Pi(phi_1)).
    parts : int
    rule : {"balanced", "most_pins"}
        See the module docstring.
    slack : int
        ``balanced``: no processor owns more than ``ceil(N_0 / parts) + slack`` entries.

    Returns
    -------
    np.ndarray of int64, shape (N_0,)
    """
    if rule not in INPUT_PLACEMENTS:
        raise ValueError(f"input placement must be one of {INPUT_PLACEMENTS}, got {rule!r}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    C = net_part_pins(W1, owner1, parts)
    n0 = C.shape[1]
    lam = np.diff(C.indptr)
    empty = np.flatnonzero(lam == 0)
    if rule == "most_pins":
        owner0 = np.asarray(C.argmax(axis=0)).ravel().astype(np.int64)
        owner0[empty] = np.arange(empty.size) % parts
        return owner0
    cap = -(-n0 // parts) + slack
    owner0 = np.full(n0, -1, dtype=np.int64)
    send = [0] * parts
    count = [0] * parts
    used = np.flatnonzero(lam > 0)
    # largest send first; among equals the entry with the fewest candidates first
    order = used[np.lexsort((lam[used], -(lam[used] - 1)))].tolist()
    indptr, members = C.indptr.tolist(), C.indices.tolist()
    all_parts = range(parts)
    # room kept for the entries whose net lies in one part only (they have no other choice)
    reserved = np.bincount(C.indices[C.indptr[:-1][lam == 1]], minlength=parts).tolist()
    for j in order:
        words = indptr[j + 1] - indptr[j] - 1
        if words == 0:
            m = members[indptr[j]]
            reserved[m] -= 1
            cand = [m] if count[m] < cap else []
        else:
            cand = [m for m in members[indptr[j]:indptr[j + 1]] if count[m] + reserved[m] < cap]
        if not cand:  # every member is full: one word more, to the least-sending part
            cand = [m for m in all_parts if count[m] + reserved[m] < cap] or \
                [m for m in all_parts if count[m] < cap]
            words += 1
        best = min(cand, key=lambda m: (send[m], count[m], m))
        owner0[j] = best
        send[best] += words
        count[best] += 1
    heap = [(count[m], m) for m in all_parts]
    heapq.heapify(heap)
    for j in empty.tolist():  # unused entries: no traffic, only load
        c, best = heapq.heappop(heap)
        owner0[j] = best
        heapq.heappush(heap, (c + 1, best))
    return owner0
