"""Closed forms of the collectives' wire bytes, written from the algorithms alone.

The second source for :mod:`substrate.schedule`: the run's bytes come from the schedules'
messages, these are written from the rules below (chunk sizes, ring links, tree edges) without
them, and the tests hold the two equal.

Ring all-reduce (reduce-scatter + all-gather) of ``n`` bytes over ``p`` ranks, with the buffer cut
into ``p`` chunks ``c_0..c_{p-1}`` (``numpy.array_split`` sizes): in the reduce-scatter, rank
``i`` sends every chunk but ``c_{(i+1) % p}``; in the all-gather every chunk but
``c_{(i+2) % p}``.  Each rank therefore sends ``2n - c_{(i+1)%p} - c_{(i+2)%p}`` bytes, and the
wire total is exactly ``2 (p-1) n`` for any element count.  Which of those bytes cross nodes
follows from the same chunk sizes: a ring over ``M`` node leaders moves all ``2 (M-1) n`` bytes
across nodes, and a node-major ring over ``p = M P`` ranks crosses nodes on the ``M`` links
``i = mP - 1``, so ``Σ_m (2n - c_{mP % p} - c_{(mP+1) % p})`` elements go inter-node; only when
``p`` divides the element count is that ``M * 2 (p-1) / p * n``.
"""

from __future__ import annotations

import numpy as np

INTRA = "intra"
INTER = "inter"

__all__ = [
    "bcast_split",
    "bcast_wire_bytes",
    "ring_allgather_wire_bytes",
    "ring_allreduce_split",
    "ring_allreduce_wire_bytes",
]


def _ring_chunks(count: int, p: int, j) -> np.ndarray:
    """``c_j``: element count of ring chunk ``j`` of a ``count``-element buffer cut into ``p``
    chunks the way ``numpy.array_split`` cuts it (the first ``count mod p`` chunks one longer)."""
    q, r = divmod(int(count), int(p))
    j = np.asarray(j, dtype=np.int64)
    return q + (j < r).astype(np.int64)


def _ring_links_bytes(count: int, itemsize: int, p: int, links) -> int:
    """Bytes on the ring links ``i -> i+1`` for ``i`` in ``links`` in one ring all-reduce of
    ``count`` elements over ``p`` ranks: link ``i`` carries ``2n - c_{(i+1)%p} - c_{(i+2)%p}``
    elements (reduce-scatter: every chunk but ``c_{i+1}``; all-gather: every chunk but
    ``c_{i+2}``)."""
    links = np.asarray(links, dtype=np.int64)
    if p <= 1 or links.size == 0:
        return 0
    elems = 2 * int(count) * links.size - int(_ring_chunks(count, p, (links + 1) % p).sum()) \
        - int(_ring_chunks(count, p, (links + 2) % p).sum())
    return elems * int(itemsize)


def ring_allreduce_wire_bytes(nbytes: int, p: int, inter_links: int, itemsize: int = 1) -> dict:
    """Closed form of one ring all-reduce of ``nbytes`` (``nbytes / itemsize`` elements) over a
    node-major ring of ``p`` ranks whose ring crosses nodes on ``inter_links`` links, exact for
    any element count.

    The wire total is ``2 (p-1) · nbytes`` whatever the chunking.  ``inter_links`` is ``0`` (one
    node: all intra), ``p`` (one rank per node, e.g. the node leaders: all inter) or the node
    count ``M`` of a node-major layout of ``M`` nodes × ``p / M`` ranks, whose ring crosses nodes
    on the links ``i = m p/M - 1`` (``m = 1..M``); link ``i`` carries ``2n - c_{(i+1)%p} -
    c_{(i+2)%p}`` elements with the ``numpy.array_split`` chunk sizes ``c``.  When ``p`` divides
    the element count every link carries ``2 (p-1)/p · nbytes``.  ``itemsize`` (bytes per
    element) fixes the chunking; the default 1 is exact for the totals, and for the split when
    ``p`` divides the element count.

    Returns ``{"intra": .., "inter": ..}``.
    """
    p, nbytes, itemsize, M = int(p), int(nbytes), int(itemsize), int(inter_links)
    if p <= 1:
        return {INTRA: 0, INTER: 0}
    if itemsize < 1 or nbytes % itemsize:
        raise ValueError(f"nbytes {nbytes} is not a whole number of {itemsize}-byte elements")
    count = nbytes // itemsize
    if not 0 <= M <= p:
        raise ValueError(f"inter_links must be in [0, {p}], got {M}")
    total = 2 * (p - 1) * nbytes
    if M == 0:
        return {INTRA: total, INTER: 0}
    if p % M:
        if count % p:  # which links cross matters once the chunks differ
            raise ValueError(f"inter_links {M} does not divide p = {p}, so the ring is not "
                             f"node-major and its split of {count} elements depends on which "
                             "links cross nodes: use ring_allreduce_split(count, itemsize, "
                             "ring_nodes)")
        return {INTRA: (p - M) * (total // p), INTER: M * (total // p)}  # equal chunks
    P = p // M
    inter = _ring_links_bytes(count, itemsize, p, np.arange(1, M + 1) * P - 1)
    return {INTRA: total - inter, INTER: inter}


def ring_allreduce_split(count: int, itemsize: int, ring_nodes) -> dict:
    """Exact intra/inter wire bytes of one ring all-reduce of ``count`` elements whose ring
    visits ranks on nodes ``ring_nodes`` (in ring order), for any ``count`` and any layout: the
    total is ``2 (p-1) · count · itemsize`` and each node-crossing link ``i -> i+1`` carries
    ``2n - c_{(i+1)%p} - c_{(i+2)%p}`` elements (``numpy.array_split`` chunk sizes ``c``)."""
    nodes = np.asarray(ring_nodes)
    p = nodes.size
    if p <= 1:
        return {INTRA: 0, INTER: 0}
    total = 2 * (p - 1) * int(count) * int(itemsize)
    inter = _ring_links_bytes(count, itemsize, p, np.flatnonzero(nodes != np.roll(nodes, -1)))
    return {INTRA: total - inter, INTER: inter}


def ring_allgather_wire_bytes(block_bytes: int, p: int, inter_links: int) -> dict:
    """Closed form of a ring all-gather of equal blocks: every link carries ``(p-1) b``."""
    if p <= 1:
        return {INTRA: 0, INTER: 0}
    per_link = (p - 1) * block_bytes
    return {INTRA: (p - inter_links) * per_link, INTER: inter_links * per_link}


def _binomial_parents(p: int, root: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Edges ``(parent, child)`` of the binomial broadcast tree over ``p`` ranks from ``root``,
    as communicator ranks: relative rank ``r > 0`` receives from ``r`` with its lowest set bit
    cleared (``r & (r-1)``); relative rank ``r`` is communicator rank ``(r + root) % p``."""
    rel = np.arange(1, max(int(p), 1), dtype=np.int64)
    return (rel & (rel - 1)) + root, rel + root


def bcast_wire_bytes(nbytes: int, nodes: int, ranks_per_node: int) -> dict:
    """Closed form of a binomial broadcast from rank 0 over a node-major layout of ``nodes``
    nodes × ``ranks_per_node`` ranks, exact for any ``ranks_per_node``: the tree has ``p - 1``
    edges ``r & (r-1) -> r`` of ``n`` bytes; an edge crosses nodes when
    ``(r & (r-1)) // P != r // P``.  For a power-of-two ``P`` that is ``nodes - 1`` edges (only
    a cleared bit ``>= P`` changes the node); otherwise it can be more (e.g. ``M = 2, P = 3``:
    ``0 -> 4`` and ``2 -> 3``).
    """
    P = int(ranks_per_node)
    p = int(nodes) * P
    parent, child = _binomial_parents(p)
    inter = int(np.count_nonzero(parent // P != child // P))
    return {INTRA: (p - 1 - inter) * int(nbytes), INTER: inter * int(nbytes)}


def bcast_split(nbytes: int, nodes, root: int = 0) -> dict:
    """Exact intra/inter wire bytes of a binomial-tree broadcast of ``nbytes`` from ``root``
    over ranks on ``nodes`` (node id per rank, in communicator order), for any layout: each of
    the ``p - 1`` tree edges ``r & (r-1) -> r`` (relative ranks) carries ``nbytes``."""
    nodes = np.asarray(nodes)
    p = nodes.size
    parent, child = _binomial_parents(p, int(root))
    inter = int(np.count_nonzero(nodes[parent % max(p, 1)] != nodes[child % max(p, 1)]))
    return {INTRA: (max(p - 1, 0) - inter) * int(nbytes), INTER: inter * int(nbytes)}
