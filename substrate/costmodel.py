"""α–β cost model per link class and the named collective algorithms.

Link classes are ``"intra"`` (both ranks on one node: NVLink-class) and ``"inter"`` (different
nodes: InfiniBand-class).  A message of ``n`` bytes over a link of class ``c`` takes
``alpha_c + n * beta_c`` seconds (``beta_c = 1 / bandwidth_c``).

Two views of every algorithm live here:

* **per-rank exact accounting** (``*_sent``): the bytes one rank puts on its outgoing link(s) in
  one call.  The ledger records these on every rank; summing over ranks gives the wire total.
* **closed forms** (``*_wire_bytes``): the totals predicted from sizes and the topology alone,
  used by ``commvol`` and by the probe's self-check.  Tests hold the two equal.

Ring all-reduce (reduce-scatter + all-gather) of ``n`` bytes over ``p`` ranks, with the buffer cut
into ``p`` chunks ``c_0..c_{p-1}`` (``numpy.array_split`` sizes): in the reduce-scatter, rank
``i`` sends every chunk but ``c_{(i+1) % p}``; in the all-gather every chunk but
``c_{(i+2) % p}``.  Each rank therefore sends ``2n - c_{(i+1)%p} - c_{(i+2)%p}`` bytes, and the
wire total is exactly ``2 (p-1) n`` for any element count.  Which of those bytes cross nodes
follows from the same chunk sizes: a ring over ``M`` node leaders moves all ``2 (M-1) n`` bytes
across nodes, and a node-major ring over ``p = M P`` ranks crosses nodes on the ``M`` links
``i = mP - 1``, so ``Σ_m (2n - c_{mP % p} - c_{(mP+1) % p})`` elements go inter-node; only when
``p`` divides the element count is that ``M * 2 (p-1) / p * n``.  The closed forms below are
written from these rules, not from the per-rank accounting, so each checks the other.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

INTRA = "intra"
INTER = "inter"
LINKS = (INTRA, INTER)

__all__ = [
    "INTER",
    "INTRA",
    "LINKS",
    "CostModel",
    "bcast_split",
    "bcast_wire_bytes",
    "binomial_children",
    "binomial_depth",
    "ring_allgather_wire_bytes",
    "ring_allgatherv_sent",
    "ring_allreduce_sent",
    "ring_allreduce_split",
    "ring_allreduce_wire_bytes",
    "ring_chunk_counts",
]

#: Defaults (documented in the README): NVLink-3-class intra-node links, 100 Gb/s
#: InfiniBand-class inter-node links.
DEFAULT_INTRA_GBPS = 2400.0  # 300 GB/s
DEFAULT_INTER_GBPS = 100.0  # 12.5 GB/s
DEFAULT_INTRA_LAT_US = 2.0
DEFAULT_INTER_LAT_US = 5.0


@dataclass(frozen=True)
class CostModel:
    """α–β parameters per link class (SI units: bytes/s and seconds).

    Parameters
    ----------
    intra_bw, inter_bw : float
        Bandwidth in bytes per second.
    intra_lat, inter_lat : float
        Per-message latency α in seconds.
    """

    intra_bw: float = DEFAULT_INTRA_GBPS * 1e9 / 8
    inter_bw: float = DEFAULT_INTER_GBPS * 1e9 / 8
    intra_lat: float = DEFAULT_INTRA_LAT_US * 1e-6
    inter_lat: float = DEFAULT_INTER_LAT_US * 1e-6

    def __post_init__(self) -> None:
        for name in ("intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)}); pass a positive "
                                 f"--{name.replace('_', '-')} in Gbit/s")
        for name in ("intra_lat", "inter_lat"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)}); pass a "
                                 f"non-negative --{name.replace('_', '-')} in microseconds")

    @classmethod
    def from_cli(cls, intra_gbps: float, inter_gbps: float, intra_lat_us: float,
                 inter_lat_us: float) -> CostModel:
        """Build from CLI units (Gbit/s and microseconds)."""
        return cls(intra_gbps * 1e9 / 8, inter_gbps * 1e9 / 8, intra_lat_us * 1e-6,
                   inter_lat_us * 1e-6)

    def alpha(self, link: str) -> float:
        return self.intra_lat if link == INTRA else self.inter_lat

    def beta(self, link: str) -> float:
        return 1.0 / (self.intra_bw if link == INTRA else self.inter_bw)

    # -- times of the named algorithms --------------------------------------------------------
    def p2p_time(self, nbytes: float, link: str) -> float:
        """One message: ``α + n β``."""
        return self.alpha(link) + nbytes * self.beta(link)

    def ring_allreduce_time(self, nbytes: float, p: int, link: str) -> float:
        """Ring all-reduce: ``2 (p-1) (α + n/p β)``; ``link`` is the ring's slowest class."""
        if p <= 1:
            return 0.0
        return 2 * (p - 1) * (self.alpha(link) + nbytes / p * self.beta(link))

    def ring_allgather_time(self, total_bytes: float, p: int, link: str) -> float:
        """Ring all-gather(v) of ``total_bytes`` gathered: ``(p-1) α + (p-1)/p · N β``."""
        if p <= 1:
            return 0.0
        return (p - 1) * self.alpha(link) + (p - 1) / p * total_bytes * self.beta(link)

    def bcast_time(self, nbytes: float, p: int, link: str) -> float:
        """Binomial-tree broadcast: ``ceil(log2 p) (α + n β)``."""
        return binomial_depth(p) * (self.alpha(link) + nbytes * self.beta(link))

    def barrier_time(self, p: int, link: str) -> float:
        """Dissemination barrier: ``ceil(log2 p) α``."""
        return binomial_depth(p) * self.alpha(link)

    def describe(self) -> dict:
        return {
            "intra_gbps": self.intra_bw * 8 / 1e9,
            "inter_gbps": self.inter_bw * 8 / 1e9,
            "intra_lat_us": self.intra_lat * 1e6,
            "inter_lat_us": self.inter_lat * 1e6,
            "algorithms": {"allreduce": "ring", "allgather": "ring", "bcast": "binomial tree",
                           "p2p": "direct", "alltoallv": "pairwise direct"},
        }


# -- per-rank exact accounting ---------------------------------------------------------------
def ring_chunk_counts(count: int, p: int) -> np.ndarray:
    """Element counts of the ``p`` ring chunks of a ``count``-element buffer (array_split)."""
    base, extra = divmod(count, p)
    sizes = np.full(p, base, dtype=np.int64)
    sizes[:extra] += 1
    return sizes


@functools.lru_cache(maxsize=1024)
def ring_allreduce_sent(count: int, itemsize: int, p: int, i: int) -> int:
    """Bytes ring-rank ``i`` sends in one ring all-reduce of ``count`` elements (cached: a
    native-mode run books the same few sizes every step)."""
    if p <= 1:
        return 0
    c = ring_chunk_counts(count, p)
    return int((2 * count - c[(i + 1) % p] - c[(i + 2) % p]) * itemsize)


def ring_allgatherv_sent(block_bytes, i: int) -> int:
    """Bytes ring-rank ``i`` sends in a ring all-gather(v) of blocks ``block_bytes[j]``.

    Rank ``i`` forwards every block except ``(i + 1) % p`` (the one it never holds before the
    last step): ``N - b_{(i+1) % p}``.
    """
    b = np.asarray(block_bytes, dtype=np.int64)
    p = b.size
    if p <= 1:
        return 0
    return int(b.sum() - b[(i + 1) % p])


def binomial_children(rel: int, p: int) -> list[int]:
    """Children (relative ranks) of relative rank ``rel`` in the binomial broadcast tree.

    The parent of ``r > 0`` is ``r - lowbit(r)``; a rank sends to ``r + mask`` for every
    power of two ``mask`` below ``lowbit(r)`` (all powers below ``p`` for the root).
    """
    low = rel & -rel if rel else 1 << max(p - 1, 0).bit_length()
    kids = []
    mask = 1
    while mask < low and rel + mask < p:
        kids.append(rel + mask)
        mask <<= 1
    return kids


def binomial_depth(p: int) -> int:
    """``ceil(log2 p)``: rounds of a binomial tree / dissemination barrier."""
    return 0 if p <= 1 else math.ceil(math.log2(p))


# -- closed forms (predictions) ----------------------------------------------------------------
# Written from the algorithms alone (chunk sizes, ring links, tree edges); they do not call the
# per-rank accounting above, so the tests that hold the two equal check one against the other.
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
