"""Cluster topology: nodes, node leaders, and the communicators of each level.

Built once per run with :meth:`Topology.from_comm`:

* real nodes: ``comm.Split_type(MPI.COMM_TYPE_SHARED)`` groups the ranks that share memory;
* virtual nodes (simulation on one host): ``ranks_per_node=R`` groups ranks ``rank // R``.

Nodes may hold different numbers of ranks (any placement a launcher or hostfile produces);
systems that need equal nodes (H-SADMM's γ counts P ranks per node) refuse others with
:meth:`Topology.require_uniform`.  A world size that is not a multiple of ``R`` raises
:class:`TopologyError` on every rank (every rank reaches the same verdict from the same data, so
nothing hangs).

The hierarchy is a list of :class:`Level` objects, bottom-up: level 0 is the node level (``intra``
= the node's ranks, ``inter`` = the node leaders).  ``nodes_per_rack=K`` adds a rack level above
it (the leaders of K consecutive nodes, and the rack leaders).  Link classes for the cost model
stay intra-node / inter-node.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .backend import Backend
from .calls import Placement
from .comm import Comm, Waiting
from .costmodel import CostModel
from .recorder import Recorder
from .stream import CommStream

__all__ = [
    "Level",
    "Topology",
    "TopologyError",
    "assign_nodes",
    "binding_slots",
    "shared_devices",
]


class TopologyError(ValueError):
    """Bad topology input (raised identically on every rank)."""


@dataclass
class Level:
    """One level of the hierarchy.

    Attributes
    ----------
    name : str
        ``"node"`` or ``"rack"``.
    group : Comm or None
        Communicator of the members of my unit at this level (``None`` if I am not a member,
        e.g. a follower at the rack level).
    leaders : Comm or None
        Communicator of the unit leaders (``None`` unless I lead my unit).
    unit_of : numpy.ndarray
        Unit id of every world rank.
    """

    name: str
    group: Comm | None
    leaders: Comm | None
    unit_of: np.ndarray


def assign_nodes(node_roots) -> tuple[np.ndarray, np.ndarray]:
    """Node id of every rank from the lowest world rank of its node (pure; same on every rank).

    Parameters
    ----------
    node_roots : array_like of int
        For each world rank, the world rank of its node's leader.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        ``node_of`` (ids ``0..M-1`` ordered by leader rank) and the leaders' world ranks.

    Nodes may hold different numbers of ranks (a hostfile with unequal slots); the systems that
    need equal nodes say so (:meth:`Topology.require_uniform`).
    """
    roots = np.asarray(node_roots, dtype=np.int64)
    leaders = np.unique(roots)
    node_of = np.searchsorted(leaders, roots)
    return node_of, leaders


def binding_slots(visible) -> list[int]:
    """Device slot of every rank of one real node (pure; same on every rank).

    ``visible`` lists, in node-local rank order, each rank's ``CUDA_VISIBLE_DEVICES`` (``None``
    when unset).  A rank's slot is its place among the node's ranks that see the same devices:
    with no variable (or one shared value) the node-local rank; with Slurm's per-task binding
    (``--gpus-per-task``, ``--gpu-bind``: each rank its own device) 0 for every rank.  The
    backend binds device ``slot % visible devices`` (:func:`substrate.backend.device_slot`).
    """
    seen: dict = {}
    out = []
    for key in visible:
        out.append(seen.get(key, 0))
        seen[key] = out[-1] + 1
    return out


def shared_devices(devices) -> list[dict]:
    """The devices more than one rank uses: ``[{"host", "device", "ranks"}]`` from the per-rank
    records of :meth:`Topology.bind_backend` (a device is its host and PCI bus id, else its
    host, visible list and ordinal)."""
    users: dict = {}
    for r, d in enumerate(devices):
        if d.get("device") != "gpu":
            continue
        dev = d.get("pci_bus_id") or f"{d.get('cuda_visible_devices')}#{d.get('ordinal')}"
        users.setdefault((d.get("host"), dev), []).append(r)
    return [{"host": h, "device": dev, "ranks": ranks}
            for (h, dev), ranks in sorted(users.items(), key=lambda kv: kv[1][0])
            if len(ranks) > 1]


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TopologyError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class Topology:
    """Ranks, nodes and the communicators of a run (see the module docstring).

    Attributes
    ----------
    world, intra, inter : Comm
        All ranks; my node's ranks; the node leaders (``None`` on followers).
    leaders : Comm or Waiting
        The node leaders' communicator as every rank sees it: :attr:`inter` on a leader; on a
        follower a :class:`~substrate.comm.Waiting` view whose calls only record the leaders'
        call in its program (a follower waits for its leader's inter-node phase).
    placement : Placement
        Node of every world rank (the pure description plans take).
    recorder : Recorder
        The run's books, shared by every communicator.
    rank, size, node, num_nodes, ranks_per_node, local_rank : int
    is_leader : bool
    node_of : numpy.ndarray
        Node id of every world rank.
    gpu_index : int
        Device slot to bind: the rank's place on its real (shared-memory) node among the
        ranks that see the same devices (``CUDA_VISIBLE_DEVICES``), also with virtual nodes
        (never ``rank % ngpus``, never a virtual node's local rank); :func:`binding_slots`.
    host : str
        ``MPI.Get_processor_name()``.
    devices, shared_devices : list of dict
        After :meth:`bind_backend`: every rank's device record and the devices several ranks
        share (oversubscription, allowed and reported).
    levels : list of Level
    virtual : bool
        True when nodes were formed with ``ranks_per_node`` instead of shared memory.
    """

    def __init__(self) -> None:  # use from_comm
        self.levels: list[Level] = []

    @classmethod
    def from_comm(cls, comm: MPI.Intracomm | None = None, ranks_per_node: int | None = None, *,
                  nodes_per_rack: int | None = None, node_map: str | None = None,
                  cost: CostModel | None = None,
                  backend: Backend | None = None,
                  collectives: str | None = None) -> Topology:
        """Discover (or simulate) the node structure of ``comm`` (collective).

        Parameters
        ----------
        comm : mpi4py communicator, optional
            Duplicated once here; defaults to ``MPI.COMM_WORLD``.
        ranks_per_node : int, optional
            Virtual nodes of ``R`` consecutive ranks; ``None`` uses shared-memory nodes.
        nodes_per_rack : int, optional
            Adds a rack level of ``K`` consecutive nodes.
        node_map : str, optional
            Virtual nodes of any placement (:meth:`substrate.calls.Placement.parse`:
            ``round-robin:R``, ``block:R`` or a node id per rank).
        cost : CostModel, optional
            The run's α–β model (its :class:`~substrate.recorder.Recorder` prices calls with it).
        backend : Backend, optional
            Shared by every communicator created here.
        collectives : {"exact", "native"}, optional
            How every communicator runs its collectives (:mod:`substrate.collectives`); default
            ``SPARDIST_COLLECTIVES`` or ``exact``.

        Raises
        ------
        TopologyError
            On every rank, when the world cannot be cut into equal nodes (or racks).
        """
        comm = MPI.COMM_WORLD if comm is None else comm
        self = cls()
        self.backend = backend
        world = comm.Dup()
        rank, size = world.Get_rank(), world.Get_size()
        self.rank, self.size = rank, size

        if node_map is not None:
            if ranks_per_node is not None:
                raise TopologyError("--node-map and --ranks-per-node both place ranks on "
                                    "virtual nodes: give one (--ranks-per-node R is "
                                    "--node-map block:R)")
            try:
                mapped = Placement.parse(node_map, size)
            except ValueError as exc:
                world.Free()
                raise TopologyError(str(exc)) from None
            intra_mpi = world.Split(mapped.node(rank), rank)
            self.virtual = True
        elif ranks_per_node is not None:
            r = _check_positive_int(ranks_per_node, "--ranks-per-node")
            if size % r:
                sizes = sorted({n for n in (r * (size // r), r * (size // r + 1)) if n > 0})
                raise TopologyError(
                    f"world size {size} is not a multiple of --ranks-per-node {r}: all nodes "
                    f"must hold the same number of ranks; launch with "
                    f"{' or '.join(f'-n {n}' for n in sizes)}, or pick a ranks-per-node that "
                    f"divides {size}")
            intra_mpi = world.Split(rank // r, rank)
            self.virtual = True
        else:
            intra_mpi = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            self.virtual = False
        node_root = intra_mpi.bcast(rank, root=0)
        roots = np.array(world.allgather(node_root), dtype=np.int64)
        try:
            node_of, uniq = assign_nodes(roots)
        except TopologyError:
            intra_mpi.Free()
            world.Free()
            raise
        counts = np.bincount(node_of)
        self.node_of = node_of
        self.node = int(node_of[rank])
        self.num_nodes = int(uniq.size)
        #: ranks of every node when they are equal, else ``None`` (uneven nodes)
        self.ranks_per_node = int(counts[0]) if counts.min() == counts.max() else None
        self.node_sizes = tuple(int(c) for c in counts)
        self.local_rank = intra_mpi.Get_rank()
        self.is_leader = self.local_rank == 0
        # GPUs belong to the real node: bind by the real node's local rank among the ranks
        # that see the same devices (CUDA_VISIBLE_DEVICES, as Slurm's GPU binding sets it)
        real = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank) if self.virtual else intra_mpi
        #: ranks sharing this rank's real (shared-memory) node: its cores and GPUs
        self.real_node_ranks = real.Get_size()
        #: this rank's place on its real node (what a node-local launcher calls local rank)
        self.real_local_rank = real.Get_rank()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.gpu_index = binding_slots(real.allgather(visible))[self.real_local_rank]
        if self.virtual:
            real.Free()
        self.host = MPI.Get_processor_name()
        #: every rank's device (:meth:`bind_backend`), and the devices ranks share
        self.devices: list[dict] | None = None
        self.shared_devices: list[dict] = []

        self.placement = placement = Placement(tuple(int(n) for n in node_of))
        self.recorder = recorder = Recorder(placement, rank, cost)
        ranks = np.arange(size)
        self.stream = stream = CommStream()
        mk = lambda c, members: Comm(c, placement, members, recorder,  # noqa: E731
                                     self.backend, collectives, stream)
        self.world = mk(world, ranks)
        self.intra = mk(intra_mpi, ranks[node_of == self.node])
        inter_mpi = world.Split(0 if self.is_leader else MPI.UNDEFINED, rank)
        leaders = uniq  # the lowest world rank of each node leads it (node ids sort by it)
        self.inter = mk(inter_mpi, leaders) if inter_mpi != MPI.COMM_NULL else None
        self.leaders = self.inter if self.inter is not None else Waiting(leaders, recorder)
        self.levels = [Level("node", self.intra, self.inter, node_of)]

        if nodes_per_rack is not None:
            k = _check_positive_int(nodes_per_rack, "--nodes-per-rack")
            if self.num_nodes % k:
                raise TopologyError(
                    f"{self.num_nodes} nodes cannot be cut into racks of {k}: pick a "
                    f"nodes-per-rack that divides {self.num_nodes}")
            rack_of = node_of // k
            group = rack_leaders = None
            if self.inter is not None:  # only node leaders take part in the rack level
                group = self.inter.sub(int(rack_of[rank]))
                rack_leaders = self.inter.sub(0 if group.rank == 0 else -1)
            self.levels.append(Level("rack", group, rack_leaders, rack_of))
        return self

    def require_uniform(self, what: str, why: str) -> int:
        """The ranks per node, or a :class:`TopologyError` (raised alike on every rank) naming
        ``what`` and ``why`` it needs equal nodes, with the fix."""
        if self.ranks_per_node is None:
            raise TopologyError(
                f"{what} needs every node to hold the same number of ranks ({why}), but the "
                f"nodes hold {list(self.node_sizes)}: launch the same number of ranks on every "
                "node (e.g. srun --ntasks-per-node, or --node-map round-robin:R / block:R)")
        return self.ranks_per_node

    # -- conveniences ----------------------------------------------------------------------------
    def bind_backend(self, backend: Backend) -> None:
        """Use ``backend`` to hand arrays to MPI on every communicator of this topology
        (collective: every rank records which device it uses, :attr:`devices`; ranks sharing
        a GPU are allowed and reported, :attr:`shared_devices`; device memory goes to MPI only
        when every rank's MPI is CUDA-aware)."""
        self.backend = backend
        for c in self.communicators():
            c.backend = backend
        mine = dict(backend.device_info(), host=self.host, real_local_rank=self.real_local_rank,
                    slurm_localid=os.environ.get("SLURM_LOCALID"),
                    slurm_gpus=os.environ.get("SLURM_STEP_GPUS",
                                              os.environ.get("SLURM_JOB_GPUS")),
                    cuda_aware=bool(backend.cuda_aware))
        self.devices = self.world.mpi.allgather(mine)
        if backend.is_gpu and backend.cuda_aware and \
                not all(d.get("cuda_aware") for d in self.devices):
            backend.cuda_aware = False       # one host-staging rank: every rank stages
        self.shared_devices = shared_devices(self.devices)
        if self.shared_devices and self.rank == 0:
            print("spardist: note: GPUs are oversubscribed (allowed; kernels of the ranks "
                  "sharing one device run interleaved): " + "; ".join(
                      f"ranks {','.join(map(str, s['ranks']))} share {s['device']} on "
                      f"{s['host']}" for s in self.shared_devices),
                  file=sys.stderr, flush=True)

    def communicators(self) -> list[Comm]:
        out = [self.world, self.intra]
        for lv in self.levels:
            out += [lv.group, lv.leaders]
        seen, uniq = set(), []
        for c in out:
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                uniq.append(c)
        return uniq

    def describe(self) -> dict:
        """The ``topology`` block of ``summary.json``."""
        return {
            "world": self.size,
            "nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "virtual_nodes": self.virtual,
            "placement": self.placement.describe(),
            "levels": [lv.name for lv in self.levels],
            "node_of": self.node_of.tolist(),
            **self._device_block(),
        }

    def _device_block(self) -> dict:
        """Which device every rank used and which ranks shared one (GPU runs)."""
        backend = getattr(self, "backend", None)
        if backend is None or not backend.is_gpu or self.devices is None:
            return {}
        return {"devices": self.devices, "oversubscribed": self.shared_devices,
                "backend": backend.describe()}
