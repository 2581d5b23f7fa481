"""A cluster as a file: its devices, its fabrics and its communication library.

The job simulation (:mod:`simulation.jobsim`) runs a job on a :class:`Cluster`; ``--cluster FILE``
names one on every command that simulates, and ``--intra-bw``/``--inter-bw``/``--intra-lat``/
``--inter-lat`` are the shorthand for a two-tier cluster (:meth:`Cluster.two_tier`).  A file is
TOML (the papers' clusters ship in ``simulation/clusters/``: ``--cluster NAME``)::

    name = "Puhti (CSC): 4 x V100 per node, HDR InfiniBand"
    described_by = "PruneX (seed 000), section 6.1"
    nodes = 16                      # optional: the machine's size (a job may use fewer)

    [device]                        # one accelerator (or a CPU socket)
    name = "NVIDIA V100 SXM2 32 GB"
    peak_tflops = 15.7              # float32 peak
    memory_gbs = 900                # memory bandwidth, GB/s
    memory_gib = 32
    launch_us = 4                   # a kernel's launch overhead
    efficiency = 0.5                # fraction of peak a dense layer achieves

    [node]
    devices = 4
    fabric = "nvlink"               # nvlink | pcie | shm
    fabric_gbps = 1200              # nvlink: each device's own, per direction; shm: a copy
                                    # between two ranks, each pair its own; pcie: the node's
                                    # one switch, shared by every message inside the node
    fabric_latency_us = 2
    nics = 1
    nic_gbps = 100                  # each NIC, per direction
    nic_latency_us = 5              # a message between two nodes under one switch

    [[switch]]                      # tiers above the nodes, lowest first (optional)
    nodes = 16                      # nodes under one switch of this tier
    oversubscription = 1.0
    latency_us = 0.2                # one more pass through a switch of this tier

    [library]
    name = "NCCL 2.25"
    call_us = 10                    # software overhead of one call, before its first message
    transport = "rdma"              # rdma | tcp (TCP's acknowledgements use the reverse links)

    [sources]                       # where every number comes from (required for each)
    "device.peak_tflops" = "NVIDIA Tesla V100 datasheet: 15.7 TFLOPS single precision (SXM2)"
    ...

Every number must have a source (the paper's text, a named datasheet, or a measurement named
by the command that took it): a file without one is refused, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from substrate.costmodel import CostModel

try:
    import tomllib
except ModuleNotFoundError:        # Python 3.10
    import tomli as tomllib

__all__ = [
    "FABRICS",
    "TCP_ACK_OVERHEAD",
    "TRANSPORTS",
    "Cluster",
    "Device",
    "Library",
    "Node",
    "Tier",
    "shipped",
]

#: the papers' clusters, shipped with the package (``--cluster NAME``)
SHIPPED = Path(__file__).resolve().parent / "clusters"
FABRICS = ("nvlink", "pcie", "shm")
TRANSPORTS = ("rdma", "tcp")
#: bytes of acknowledgement per byte of data on TCP with delayed ACKs: Linux acknowledges every
#: second full segment with a frame of 14 (Ethernet) + 20 (IP) + 32 (TCP with timestamps) = 66
#: bytes, against two data frames of 1514 (MTU 1500 + Ethernet): 66 / 3028 = 0.0218.  The wire
#: lab's counters agree: one host of a 2 x 2 ddp replay at 1 Gbit/s sent 55,749 frames for
#: 54.13 MB of payload (37,383 full segments), about 18,366 ACKs, 0.0214 of the link time
TCP_ACK_OVERHEAD = (14 + 20 + 32) / (2 * (1500 + 14))


def shipped() -> list[str]:
    """Names of the shipped clusters (``--cluster NAME``)."""
    return sorted(p.stem for p in SHIPPED.glob("*.toml"))


def _positive(v, key: str, where: str, *, zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            (v < 0 if zero else v <= 0):
        raise ValueError(f"{where}: {key} must be a finite number {'>= 0' if zero else '> 0'}, "
                         f"got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Device:
    """One accelerator: its float32 peak, memory bandwidth and size, a kernel's launch
    overhead, and the fraction of peak a dense layer achieves."""

    name: str = "device"
    peak_tflops: float = 15.7
    memory_gbs: float = 900.0
    memory_gib: float = 32.0
    launch_us: float = 0.0
    efficiency: float = 1.0


@dataclass(frozen=True)
class Node:
    """A node: its devices, the fabric between them and its NICs."""

    devices: int = 1
    fabric: str = "nvlink"
    fabric_gbps: float = 2400.0
    fabric_latency_us: float = 2.0
    nics: int = 1
    nic_gbps: float = 100.0
    nic_latency_us: float = 5.0


@dataclass(frozen=True)
class Tier:
    """A tier of switches above the nodes: ``nodes`` nodes under each, its uplinks
    ``oversubscription`` times narrower than what its nodes' NICs can send, ``latency_us`` per
    pass through one of its switches."""

    nodes: int
    oversubscription: float = 1.0
    latency_us: float = 0.0


@dataclass(frozen=True)
class Library:
    """The communication library: its per-call software overhead and transport."""

    name: str = "MPI"
    call_us: float = 0.0
    transport: str = "rdma"

    @property
    def ack_overhead(self) -> float:
        return TCP_ACK_OVERHEAD if self.transport == "tcp" else 0.0


@dataclass(frozen=True)
class Cluster:
    """A cluster (see the module docstring)."""

    name: str
    device: Device = field(default_factory=Device)
    node: Node = field(default_factory=Node)
    tiers: tuple = ()
    library: Library = field(default_factory=Library)
    nodes: int | None = None
    described_by: str = ""
    sources: dict = field(default_factory=dict, compare=False)
    path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        where = self.path or self.name
        n = self.node
        if n.fabric not in FABRICS:
            raise ValueError(f"{where}: node.fabric {n.fabric!r} is not one of {FABRICS}")
        if self.library.transport not in TRANSPORTS:
            raise ValueError(f"{where}: library.transport {self.library.transport!r} is not "
                             f"one of {TRANSPORTS}")
        for key in ("devices", "nics"):
            v = getattr(n, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: node.{key} must be an integer >= 1, got {v!r}")
        for key in ("fabric_gbps", "nic_gbps"):
            _positive(getattr(n, key), f"node.{key}", where)
        for key in ("fabric_latency_us", "nic_latency_us"):
            _positive(getattr(n, key), f"node.{key}", where, zero=True)
        d = self.device
        for key in ("peak_tflops", "memory_gbs", "memory_gib", "efficiency"):
            _positive(getattr(d, key), f"device.{key}", where)
        _positive(d.launch_us, "device.launch_us", where, zero=True)
        if d.efficiency > 1:
            raise ValueError(f"{where}: device.efficiency is a fraction of the peak, <= 1; got "
                             f"{d.efficiency}")
        _positive(self.library.call_us, "library.call_us", where, zero=True)
        below = 1
        for k, t in enumerate(self.tiers):
            if isinstance(t.nodes, bool) or not isinstance(t.nodes, int) or t.nodes <= below \
                    or t.nodes % below:
                raise ValueError(f"{where}: switch[{k}].nodes must be an integer multiple of "
                                 f"the tier below's {below} nodes, larger than it; got "
                                 f"{t.nodes!r}")
            _positive(t.oversubscription, f"switch[{k}].oversubscription", where)
            _positive(t.latency_us, f"switch[{k}].latency_us", where, zero=True)
            below = t.nodes

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def two_tier(cls, cost: CostModel | None = None, devices: int = 1) -> Cluster:
        """The cluster the cost model's two link classes describe (the ``--intra-bw``,
        ``--inter-bw``, ``--intra-lat``, ``--inter-lat`` shorthand): one fabric between a node's
        devices, unshared, one NIC per node, no switch tiers, no per-call overhead."""
        cost = cost or CostModel()
        node = Node(devices=devices, fabric="nvlink", fabric_gbps=cost.intra_bw * 8 / 1e9,
                    fabric_latency_us=cost.intra_lat * 1e6, nics=1,
                    nic_gbps=cost.inter_bw * 8 / 1e9, nic_latency_us=cost.inter_lat * 1e6)
        return cls("two-tier (cost-model flags)", node=node)

    @classmethod
    def load(cls, path) -> Cluster:
        """Read and check a cluster file (see the module docstring), or a shipped cluster by
        name (:func:`shipped`).

        Raises
        ------
        ValueError
            Naming the file and the fix: missing, not TOML, an unknown key, a value out of
            range, a number without a source.
        """
        path = Path(path)
        if not path.exists() and path.suffix == "" and (SHIPPED / f"{path}.toml").exists():
            path = SHIPPED / f"{path}.toml"
        try:
            doc = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"--cluster {path}: no such file; give a cluster file (see "
                             "simulation/cluster.py for the format) or the name of a shipped "
                             f"one: {', '.join(shipped())}") from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--cluster {path}: not a readable TOML file ({exc})") from None
        where = f"--cluster {path}"
        known = {"name", "described_by", "nodes", "device", "node", "switch", "library",
                 "sources"}
        extra = sorted(set(doc) - known)
        if extra:
            raise ValueError(f"{where}: unknown keys {extra}; known: {sorted(known)}")
        sources = doc.get("sources", {})
        if not isinstance(sources, dict):
            raise ValueError(f"{where}: [sources] must be a table of \"section.key\" = "
                             "\"where the number comes from\"")

        def section(name, kind, key=None):
            raw = doc.get(name, {})
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: [{name}] must be a table")
            allowed = {f.name for f in fields(kind)}
            bad = sorted(set(raw) - allowed)
            if bad:
                raise ValueError(f"{where}: [{name}] has unknown keys {bad}; known: "
                                 f"{sorted(allowed)}")
            for k, v in raw.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and \
                        not sources.get(f"{key or name}.{k}"):
                    raise ValueError(f"{where}: {key or name}.{k} = {v} has no source: add "
                                     f"\"{key or name}.{k}\" = \"...\" under [sources] (the "
                                     "paper's text, a named datasheet, or a measurement)")
            return kind(**raw)

        tiers = []
        raw_tiers = doc.get("switch", [])
        if not isinstance(raw_tiers, list):
            raise ValueError(f"{where}: switch tiers are [[switch]] tables, lowest first")
        for k, t in enumerate(raw_tiers):
            doc[f"switch[{k}]"] = t
            tiers.append(section(f"switch[{k}]", Tier))
        nodes = doc.get("nodes")
        if nodes is not None and not sources.get("nodes"):
            raise ValueError(f"{where}: nodes = {nodes} has no source: add \"nodes\" = \"...\" "
                             "under [sources]")
        return cls(str(doc.get("name", path.stem)), device=section("device", Device),
                   node=section("node", Node), tiers=tuple(tiers),
                   library=section("library", Library), nodes=nodes,
                   described_by=str(doc.get("described_by", "")), sources=dict(sources),
                   path=str(path))

    # -- what the job simulation reads -----------------------------------------------------------
    @property
    def intra_bw(self) -> float:
        """Bytes per second of the node's fabric (per device for NVLink)."""
        return self.node.fabric_gbps * 1e9 / 8

    @property
    def inter_bw(self) -> float:
        """Bytes per second of one NIC, per direction."""
        return self.node.nic_gbps * 1e9 / 8

    def cost_model(self) -> CostModel:
        """The α–β cost model of the two link classes (a bound, and what the ledger books
        as modeled seconds)."""
        return CostModel(self.intra_bw, self.inter_bw, self.node.fabric_latency_us * 1e-6,
                         self.node.nic_latency_us * 1e-6)

    def nic_of(self, local_rank: int, ranks_per_node: int) -> int:
        """The NIC a node's ``local_rank``-th rank sends through (ranks spread evenly)."""
        return local_rank * self.node.nics // max(1, ranks_per_node)

    def switches_between(self, a: int, b: int) -> list[int]:
        """The tiers a message from node ``a`` to node ``b`` climbs: every tier below the first
        whose switch holds both (``[]`` when one switch of the lowest tier holds both)."""
        out = []
        for k, t in enumerate(self.tiers):
            if a // t.nodes == b // t.nodes:
                return out
            out.append(k)
        return out

    def inter_latency(self, a: int, b: int) -> float:
        """Seconds of latency of a message between nodes ``a`` and ``b``: NIC to NIC through
        one lowest-tier switch (``nic_latency_us``), plus, for every tier it climbs, one more
        pass through a switch of that tier and one through the tier above."""
        t = self.tiers
        extra = sum(t[k].latency_us + (t[k + 1].latency_us if k + 1 < len(t) else 0.0)
                    for k in self.switches_between(a, b))
        return (self.node.nic_latency_us + extra) * 1e-6

    def describe(self) -> dict:
        d = {"name": self.name, "described_by": self.described_by, "path": self.path,
             "device": self.device.__dict__, "node": self.node.__dict__,
             "switch": [t.__dict__ for t in self.tiers], "library": self.library.__dict__}
        if self.nodes is not None:
            d["nodes"] = self.nodes
        return d
