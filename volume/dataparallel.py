"""Closed-form communication volume of the data-parallel gradient-sync strategies.

All ranks are laid out node-major: ``M`` nodes × ``P`` ranks, ``p = M P``.  A ring over all ranks
crosses nodes on ``M`` of its ``p`` links (none when ``M = 1``).

===================  ===============================  ========================================
strategy / phase     call                             bytes on the wire per step
===================  ===============================  ========================================
DDP ring             ring all-reduce per bucket        ``2 (p-1) · 4 n_b`` in total, exactly
(``grad_allreduce``)                                    split per link with the ring's chunking
DDP hierarchical     intra ring all-reduce,            intra ``M · 2 (P-1) · 4 n_b``;
                     leaders' inter ring all-reduce,   inter ``2 (M-1) · 4 n_b``;
                     binomial bcast in each node       intra ``M (P-1) · 4 n_b``
Top-K                ring all-gather of ``K`` values   every link ``(p-1) · 8 K``:
(``topk_allgather``) (float32) + ``K`` indices (int32) ``M`` of the ``p`` links inter-node
===================  ===============================  ========================================

``n_b`` is a bucket's element count (the sum over buckets is the parameter count ``T``);
Top-K's ``K = Σ_l max(1, ⌈d · n_l⌉)`` over the tensors ``l`` at density ``d``.
"""

from __future__ import annotations

import math

from . import collectives as cm
from .hsadmm import add_bytes

__all__ = [
    "ddp_step_bytes",
    "hierarchical_step_bytes",
    "topk_k",
    "topk_step_bytes",
    "world_allgather_bytes",
    "world_ring_bytes",
]


def world_ring_bytes(count: int, itemsize: int, M: int, P: int) -> dict:
    """Ring all-reduce of ``count`` elements over all ``M P`` ranks (node-major), exact for any
    ``count``: ``2 (p-1) · itemsize · count`` in total, of which the ``M`` node-crossing links
    ``mP - 1`` carry ``Σ_m (2 count - c_{mP%p} - c_{(mP+1)%p})`` elements
    (:func:`substrate.costmodel.ring_allreduce_wire_bytes`)."""
    return cm.ring_allreduce_wire_bytes(int(count) * int(itemsize), M * P, M if M > 1 else 0,
                                        int(itemsize))


def world_allgather_bytes(block_bytes: int, M: int, P: int) -> dict:
    """Ring all-gather of one equal block per rank over all ``M P`` ranks (node-major)."""
    p = M * P
    return cm.ring_allgather_wire_bytes(int(block_bytes), p, M if M > 1 else 0)


def ddp_step_bytes(*, M: int, P: int, bucket_sizes, itemsize: int = 4) -> dict[str, dict]:
    """Dense DDP, one step: a ring all-reduce per gradient bucket over all ranks.

    Parameters
    ----------
    M, P : int
        Nodes and ranks per node.
    bucket_sizes : sequence of int
        Element count of each bucket (in backward order; their sum is the parameter count).
    itemsize : int
        Bytes per gradient element (4 for float32).

    Returns
    -------
    dict
        ``{"grad_allreduce": {"intra": bytes, "inter": bytes}}``.
    """
    total = add_bytes(*(world_ring_bytes(n, itemsize, M, P) for n in bucket_sizes))
    return {"grad_allreduce": total}


def hierarchical_step_bytes(*, M: int, P: int, bucket_sizes,
                            itemsize: int = 4) -> dict[str, dict]:
    """Hierarchical all-reduce, one step: per bucket a SUM ring all-reduce inside each node,
    a ring all-reduce over the ``M`` node leaders, and a binomial broadcast in each node.  The
    three phases are listed whenever there is a bucket, with zero bytes on a one-rank
    communicator (one node, or one rank per node), as the ledger lists them."""
    intra = inter = bcast = 0
    for n in bucket_sizes:
        nbytes = int(n) * itemsize
        # a ring's total is 2 (g-1) n for any element count: each node's ring is all intra,
        # the leaders' ring (one rank per node) all inter; the tree has P - 1 intra edges
        intra += M * cm.ring_allreduce_wire_bytes(nbytes, P, 0, itemsize)[cm.INTRA]
        inter += cm.ring_allreduce_wire_bytes(nbytes, M, M, itemsize)[cm.INTER]
        bcast += M * (P - 1) * nbytes
    if not len(bucket_sizes):
        return {}
    return {"intra_allreduce": {cm.INTRA: intra, cm.INTER: 0},
            "inter_allreduce": {cm.INTRA: 0, cm.INTER: inter},
            "intra_bcast": {cm.INTRA: bcast, cm.INTER: 0}}


def topk_k(sizes, density: float) -> list[int]:
    """Per-tensor selection counts ``k_l = max(1, ⌈d n_l⌉)`` (capped at ``n_l``)."""
    return [min(int(n), max(1, math.ceil(density * int(n)))) for n in sizes]


def topk_step_bytes(*, M: int, P: int, k_total: int, value_bytes: int = 4,
                    index_bytes: int = 4) -> dict[str, dict]:
    """Top-K, one step: a ring all-gather of every rank's ``k_total`` values and indices."""
    return {"topk_allgather": world_allgather_bytes(k_total * (value_bytes + index_bytes), M, P)}
