"""The H-SGD plan: one pure function from the network, the topology shape and the options to the
row partition and the words every processor pair exchanges (paper 001, §4-§5).

:func:`plan_partition` is the only place a sparse-SGD partition is computed: ``sparse_sgd
train``/``infer`` call it on rank 0 (then broadcast it), ``sparse_sgd partition`` calls it
serially and ``commvol predict --system hsgd|sgd`` calls it at any scale.  :class:`HSGDPlan`
holds the partition and its :class:`partition.PartitionMetrics` (``pair_words[k-1, m, n]`` =
|x̂^{k-1}_{nm}|, the size of the receive block of :mod:`partition.maps`) and gives the bytes and
messages per phase and link class of one training step or inference batch; the run's ledger is
tested against it and it is tested against a brute-force count written from eqs. 8-9.

No MPI and no communicator here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from partition.metrics import PartitionMetrics, partition_metrics
from partition.partitioners import (
    ENGINES,
    PRESETS,
    HypergraphConfig,
    Partition,
    hypergraph_partition,
    random_partition,
)
from sparse_sgd.radixnet import RadixNetConfig, radixnet, relabel_owners, relabelling
from sparse_sgd.traffic import allreduce_phase, bcast_phase, p2p_phases
from substrate.options import option

__all__ = [
    "METHODS",
    "NUM_CLASSES",
    "PHASE_CATEGORIES",
    "PHASE_LOSS",
    "PHASE_PARTITION",
    "HSGDOptions",
    "HSGDPlan",
    "PartitionOptions",
    "partition_bytes",
    "plan_partition",
]

#: ledger phases of the sparse-SGD driver besides "spff"/"spbp"
PHASE_PARTITION = "partition"
PHASE_LOSS = "loss"
PHASE_CATEGORIES = "categories"
#: digit classes: output neuron j scores class j mod 10
NUM_CLASSES = 10
#: row partitioners: the paper's H-SGD (hypergraph) and SGD (random rows) baselines
METHODS = ("hypergraph", "random")

PART = "row partition (H-SGD §5)"


@dataclass(frozen=True)
class PartitionOptions:
    """How the rows are partitioned (shared by ``train``, ``infer``, ``partition`` and
    ``commvol predict --system hsgd``)."""

    engine: str = option("kahypar", "hypergraph partitioner: sequential KaHyPar or Mt-KaHyPar",
                         choices=ENGINES, group=PART)
    preset: str | None = option(
        None, "engine preset (kahypar: fast, km1, km1_flows; mtkahypar: default, quality, "
        "highest_quality, deterministic, deterministic_quality; default: fast / deterministic)",
        choices=PRESETS, group=PART)
    epsilon: float = option(0.01, "allowed imbalance of eq. 2", group=PART)
    threads: int = option(1, "Mt-KaHyPar threads (0: all cores; more than one makes the "
                          "partition depend on thread timing)", group=PART)
    tile: bool = option(True, "partition every layer (default: partition one period of a "
                        "periodic or relabelled periodic network and repeat it)", group=PART)

    def __post_init__(self) -> None:
        self.hypergraph_config(0)  # validates engine/preset/epsilon/threads

    def hypergraph_config(self, seed: int) -> HypergraphConfig:
        return HypergraphConfig(epsilon=self.epsilon, engine=self.engine, preset=self.preset,
                                threads=self.threads, seed=seed, tile=self.tile)


@dataclass(frozen=True)
class HSGDOptions(PartitionOptions):
    """Options of ``sparse_sgd train`` that set its traffic (``SystemModel.Options`` of the
    hsgd/sgd systems)."""

    batch_size: int = option(32, "input vectors per mini-batch (one word = batch-size values)")
    dtype: str = option("float64", "value type of weights and activations",
                        choices=("float32", "float64"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype must be float32 or float64, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


def plan_partition(weights, parts: int, method: str,
                   options: PartitionOptions | None = None, *, seed: int = 0,
                   network: RadixNetConfig | None = None) -> Partition:
    """The row partition of ``weights`` into ``parts`` (``method``: hypergraph or random).

    When ``network`` generated ``weights`` with ``permute`` (a relabelling P_k W^k P_{k-1}^T),
    the hypergraph partition is computed on the unpermuted, periodic network (tiled, see
    :func:`partition.hypergraph_partition`) and mapped through the relabelling
    (:func:`sparse_sgd.radixnet.relabel_owners`): the same volumes, a fraction of the time.
    """
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}: choose one of {METHODS}")
    if method == "random":
        return random_partition(weights, parts, seed=seed)
    cfg = (options or PartitionOptions()).hypergraph_config(seed)
    tile = cfg.tile
    if network is not None and network.permute and tile:
        plain = radixnet(dataclasses.replace(network, permute=False))
        if [W.shape for W in plain] != [W.shape for W in weights]:
            raise ValueError("network does not describe the given weights; pass the "
                             "RadixNetConfig that generated them")
        part = hypergraph_partition(plain, parts, cfg)
        owners = relabel_owners(part.owners, relabelling(network))
        return Partition(owners=owners, parts=parts, method=part.method, seconds=part.seconds,
                         info={**part.info, "relabelled": True})
    return hypergraph_partition(weights, parts, cfg)


def partition_bytes(weights) -> int:
    """Bytes rank 0 broadcasts for a partition: every owner and the partitioning time, float64."""
    return 8 * (weights[0].shape[1] + sum(W.shape[0] for W in weights) + 1)


@dataclass(frozen=True)
class HSGDPlan:
    """A partition and the communication it implies, for ``node_of[r]`` the node of rank r.

    Attributes
    ----------
    partition : Partition
    metrics : PartitionMetrics
        ``pair_words[k-1, m, n]`` words of x^{k-1} that n sends to m in SpFF of layer k (and m
        sends back to n in SpBP for k >= 2).
    node_of : np.ndarray
    """

    partition: Partition
    metrics: PartitionMetrics
    node_of: np.ndarray

    @classmethod
    def from_partition(cls, weights, partition: Partition, node_of) -> HSGDPlan:
        node_of = np.asarray(node_of, dtype=np.int64)
        if node_of.size != partition.parts:
            raise ValueError(f"node_of has {node_of.size} ranks, the partition "
                             f"{partition.parts} parts")
        return cls(partition, partition_metrics(weights, partition), node_of)

    @classmethod
    def build(cls, weights, nodes: int, ranks_per_node: int, method: str,
              options: PartitionOptions | None = None, *, seed: int = 0,
              network: RadixNetConfig | None = None) -> HSGDPlan:
        """The plan of ``nodes`` x ``ranks_per_node`` processors (:func:`plan_partition`)."""
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"nodes and ranks per node must be >= 1, got {nodes}, "
                             f"{ranks_per_node}")
        p = nodes * ranks_per_node
        part = plan_partition(weights, p, method, options, seed=seed, network=network)
        return cls.from_partition(weights, part, np.arange(p) // ranks_per_node)

    def step_phases(self, batch: int, itemsize: int, steps: int = 1) -> dict:
        """``{"spff", "spbp", "loss": {"bytes", "intra_bytes", "inter_bytes", "messages"}}`` of
        ``steps`` training steps (SpFF + SpBP + the loss/score all-reduce of 1 + 10 batch
        float64 of ``sparse_sgd train``)."""
        out = p2p_phases(self.metrics, self.node_of, batch=batch, itemsize=itemsize,
                         iterations=steps)
        out[PHASE_LOSS] = allreduce_phase(1 + NUM_CLASSES * batch, 8, self.node_of, calls=steps)
        return out

    def setup_phase(self, weights) -> dict:
        """The partition broadcast from rank 0 (once per run, when not read from a file)."""
        return bcast_phase(partition_bytes(weights), self.node_of)
