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
wire total is exactly ``2 (p-1) n``.  When ``p`` divides the element count every ring link
carries ``2 (p-1) / p * n`` bytes, so a ring over ``M`` node leaders moves ``2 (M-1) n`` bytes
across nodes, and a node-major ring over ``p = M P`` ranks (``M`` inter-node links) moves
``M * 2 (p-1) / p * n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INTRA = "intra"
INTER = "inter"
LINKS = (INTRA, INTER)

__all__ = [
    "INTRA",
    "INTER",
    "LINKS",
    "CostModel",
    "ring_chunk_counts",
    "ring_allreduce_sent",
    "ring_allgatherv_sent",
    "binomial_children",
    "binomial_depth",
    "ring_allreduce_wire_bytes",
    "ring_allreduce_split",
    "ring_allgather_wire_bytes",
    "bcast_wire_bytes",
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
                 inter_lat_us: float) -> "CostModel":
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


def ring_allreduce_sent(count: int, itemsize: int, p: int, i: int) -> int:
    """Bytes ring-rank ``i`` sends in one ring all-reduce of ``count`` elements."""
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
def ring_allreduce_wire_bytes(nbytes: int, p: int, inter_links: int) -> dict:
    """Closed form of one ring all-reduce of ``nbytes`` over ``p`` ranks whose ring has
    ``inter_links`` node-crossing links (``p`` divides the element count).

    Each of the ``p`` links carries ``2 (p-1)/p · n``; returns ``{"intra": .., "inter": ..}``.
    """
    if p <= 1:
        return {INTRA: 0, INTER: 0}
    per_link = 2 * (p - 1) * nbytes // p
    return {INTRA: (p - inter_links) * per_link, INTER: inter_links * per_link}


def ring_allreduce_split(count: int, itemsize: int, ring_nodes) -> dict:
    """Exact intra/inter wire bytes of one ring all-reduce of ``count`` elements whose ring
    visits ranks on nodes ``ring_nodes`` (in ring order), for any ``count``: link ``i -> i+1``
    carries ``2n - c_{(i+1)%p} - c_{(i+2)%p}`` bytes (chunks from :func:`ring_chunk_counts`)."""
    nodes = np.asarray(ring_nodes)
    p = nodes.size
    out = {INTRA: 0, INTER: 0}
    if p <= 1:
        return out
    crosses = nodes != np.roll(nodes, -1)
    for i in range(p):
        out[INTER if crosses[i] else INTRA] += ring_allreduce_sent(count, itemsize, p, i)
    return out


def ring_allgather_wire_bytes(block_bytes: int, p: int, inter_links: int) -> dict:
    """Closed form of a ring all-gather of equal blocks: every link carries ``(p-1) b``."""
    if p <= 1:
        return {INTRA: 0, INTER: 0}
    per_link = (p - 1) * block_bytes
    return {INTRA: (p - inter_links) * per_link, INTER: inter_links * per_link}


def bcast_wire_bytes(nbytes: int, nodes: int, ranks_per_node: int) -> dict:
    """Closed form of a binomial broadcast from rank 0 over a node-major layout of ``nodes``
    nodes × ``ranks_per_node`` ranks (``ranks_per_node`` a power of two): the tree has
    ``p - 1`` edges of ``n`` bytes, ``nodes - 1`` of which cross nodes.
    """
    p = nodes * ranks_per_node
    return {INTRA: (p - nodes) * nbytes, INTER: (nodes - 1) * nbytes}


def bcast_split(nbytes: int, nodes, root: int = 0) -> dict:
    """Exact intra/inter wire bytes of a binomial-tree broadcast of ``nbytes`` from ``root``
    over ranks on ``nodes`` (node id per rank, in communicator order), for any layout: every
    tree edge (:func:`binomial_children`) carries ``nbytes``."""
    nodes = np.asarray(nodes)
    p = nodes.size
    out = {INTRA: 0, INTER: 0}
    for rel in range(p):
        src = (rel + root) % p
        for kid in binomial_children(rel, p):
            dst = (kid + root) % p
            out[INTRA if nodes[src] == nodes[dst] else INTER] += int(nbytes)
    return out
