"""Communication maps Xsend/Xrecv (eqs. 8-9) and Ssend/Srecv (Alg. 3) of one processor.

Built once per layer from the sparsity of W^k and the partition (plan once, run many).  The
local block W^k_m has its columns renumbered into the processor's x buffer

    [ x^{k-1}_m (owned entries, ascending global index) | x̂^{k-1}_{n1 m} | x̂^{k-1}_{n2 m} | ... ]

with the received blocks ordered by source rank and, inside a block, by global index, so SpFF
(Alg. 2) is ``W_local @ x_own`` plus ``W_remote @ x_recv`` and both are plain CSR @ dense.
Ssend^k_m uses the receive blocks of Xrecv^k_m (rows(s̄^k_mn) = rows(x̂^{k-1}_nm)) and Srecv^k_m the
send lists of Xsend^k_m.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from partition.partitioners import Partition

__all__ = ["LayerMaps", "build_layer_maps", "build_maps"]


@dataclass(frozen=True)
class LayerMaps:
    """Plan of layer k on processor m.

    Attributes
    ----------
    layer : int
        k (1-based).
    rank : int
        m.
    rows : np.ndarray
        Global indices of the rows of W^k_m (= the x^k entries m computes), ascending.
    prev_rows : np.ndarray
        Global indices of x^{k-1}_m, ascending (the first block of the x buffer).
    W_local : scipy.sparse.csr_matrix, shape (len(rows), len(prev_rows))
        Columns of W^k_m owned by m.
    W_remote : scipy.sparse.csr_matrix, shape (len(rows), recv_ptr[-1])
        Columns of W^k_m received from other processors, in x̂ buffer order.
    send_ranks : np.ndarray
        Destinations n of Xsend^k_m (ascending).
    send_index : tuple of np.ndarray
        For each destination, positions in x^{k-1}_m of x̄^{k-1}_{mn} (eq. 8), ascending global
        index; also the positions Srecv^k_m accumulates into.
    recv_ranks : np.ndarray
        Sources n of Xrecv^k_m (ascending).
    recv_ptr : np.ndarray
        Block of source ``recv_ranks[i]`` is rows ``recv_ptr[i]:recv_ptr[i+1]`` of the receive
        buffer (eq. 9); Ssend^k_m sends the same rows of s^k.
    recv_global : np.ndarray
        Global index of every row of the receive buffer.
    """

    layer: int
    rank: int
    rows: np.ndarray
    prev_rows: np.ndarray
    W_local: sp.csr_matrix
    W_remote: sp.csr_matrix
    send_ranks: np.ndarray
    send_index: tuple
    recv_ranks: np.ndarray
    recv_ptr: np.ndarray
    recv_global: np.ndarray

    @property
    def send_words(self) -> np.ndarray:
        """|x̄^{k-1}_{mn}| per destination."""
        return np.array([ix.size for ix in self.send_index], dtype=np.int64)


def build_layer_maps(W: sp.spmatrix, owner: np.ndarray, prev_owner: np.ndarray, rank: int,
                     layer: int = 1) -> LayerMaps:
    """Xsend^k_m, Xrecv^k_m (eqs. 8-9) and the reordered W^k_m of processor ``rank``.

    Parameters
    ----------
    W : scipy.sparse matrix, shape (N_k, N_{k-1})
        The full W^k (values are copied into W_local / W_remote).
    owner, prev_owner : np.ndarray
        Parts of x^k and x^{k-1}.
    rank : int
        The processor m.
    """
    W = sp.csr_matrix(W)
    W.sort_indices()
    owner = np.asarray(owner)
    prev_owner = np.asarray(prev_owner)
    rows = np.flatnonzero(owner == rank)
    prev_rows = np.flatnonzero(prev_owner == rank)
    Wm = W[rows]
    # --- Xrecv: columns of W^k_m owned by others, grouped by owner then global index
    used = np.unique(Wm.indices)
    remote = used[prev_owner[used] != rank]
    order = np.lexsort((remote, prev_owner[remote]))
    recv_global = remote[order]
    src = prev_owner[recv_global]
    recv_ranks, counts = np.unique(src, return_counts=True)
    recv_ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    # --- column renumbering into [local | received]
    n_prev = prev_owner.size
    local_pos = np.full(n_prev, -1, dtype=np.int64)
    local_pos[prev_rows] = np.arange(prev_rows.size)
    remote_pos = np.full(n_prev, -1, dtype=np.int64)
    remote_pos[recv_global] = np.arange(recv_global.size)
    is_local = prev_owner[Wm.indices] == rank
    rows_of_nz = np.repeat(np.arange(rows.size), np.diff(Wm.indptr))
    W_local = sp.csr_matrix((Wm.data[is_local], (rows_of_nz[is_local],
                                                 local_pos[Wm.indices[is_local]])),
                            shape=(rows.size, prev_rows.size))
    W_remote = sp.csr_matrix((Wm.data[~is_local], (rows_of_nz[~is_local],
                                                   remote_pos[Wm.indices[~is_local]])),
                             shape=(rows.size, recv_global.size))
    for M in (W_local, W_remote):
        M.sort_indices()
    # --- Xsend: for every other processor n, my x^{k-1} entries that rows of W^k_n use
    A = W.copy()
    A.data = np.ones_like(A.data)
    col_users = sp.csr_matrix(A[:, prev_rows].T)  # my columns x rows
    send_ranks_list, send_index = [], []
    user_part = owner[col_users.indices]
    col_of = np.repeat(np.arange(prev_rows.size), np.diff(col_users.indptr))
    keep = user_part != rank
    pairs = np.unique(user_part[keep].astype(np.int64) * (prev_rows.size + 1) + col_of[keep])
    dest = pairs // (prev_rows.size + 1)
    pos = pairs % (prev_rows.size + 1)
    for n in np.unique(dest):
        send_ranks_list.append(int(n))
        send_index.append(pos[dest == n].astype(np.int64))  # ascending local = ascending global
    return LayerMaps(layer=layer, rank=rank, rows=rows, prev_rows=prev_rows, W_local=W_local,
                     W_remote=W_remote, send_ranks=np.array(send_ranks_list, dtype=np.int64),
                     send_index=tuple(send_index), recv_ranks=recv_ranks.astype(np.int64),
                     recv_ptr=recv_ptr, recv_global=recv_global)


def build_maps(weights, partition: Partition, rank: int) -> list[LayerMaps]:
    """The plans of every layer of processor ``rank`` (computed once, before training)."""
    partition.check_network(weights)
    return [build_layer_maps(W, partition.owners[k], partition.owners[k - 1], rank, k)
            for k, W in enumerate(weights, start=1)]
