"""α–β cost model per link class and the named collective algorithms.

Link classes are ``"intra"`` (both ranks on one node: NVLink-class) and ``"inter"`` (different
nodes: InfiniBand-class).  A message of ``n`` bytes over a link of class ``c`` takes
``alpha_c + n * beta_c`` seconds (``beta_c = 1 / bandwidth_c``).

The times below are the α–β closed forms of the named algorithms (their messages are
written once, in :mod:`substrate.schedule`): what the ledger books as modeled seconds and what
SSFusion's own selection rule (its eq. 2) assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedule import binomial_depth

INTRA = "intra"
INTER = "inter"
LINKS = (INTRA, INTER)

__all__ = ["INTER", "INTRA", "LINKS", "CostModel"]

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
