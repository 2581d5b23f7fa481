"""The H-SGD plan: one pure function from the network, the topology shape and the options to the
row partition and the words every processor pair exchanges (paper 001, §4-§5).

:func:`plan_partition` is the only place a sparse-SGD partition is computed: ``sparse_sgd
train``/``infer`` call it on rank 0 (then broadcast it), ``sparse_sgd partition`` calls it
serially and ``commvol predict --system hsgd|sgd`` calls it at any scale.  :class:`HSGDPlan`
holds the partition and its :class:`partition.PartitionMetrics` (``pair_words[k-1, m, n]`` =
|x̂^{k-1}_{nm}|, the size of the receive block of :mod:`partition.maps`) and hands over the call
records (:class:`substrate.calls.Call`) of one interval of a run on any placement
(:meth:`HSGDPlan.calls`): a training step (per layer the SpFF exchange, per layer k >= 2 the SpBP
exchange, the loss all-reduce), the set-up (the partition broadcast), the held-out evaluation and
an inference pass.  Every rank's program of an interval is generated from these records
(:meth:`HSGDPlan.tagged_calls`, each exchange with its message tag: :mod:`sparse_sgd.program`)
and run by the one executor; the run holds what it executed against them message by message
(:meth:`substrate.recorder.Recorder.account`), ``commvol predict`` prices them, and they are
tested against a brute-force count written from eqs. 8-9.

No MPI and no communicator here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from partition.metrics import PartitionMetrics, partition_metrics
from partition.partitioners import (
    Partition,
    PartitionOptions,
    hypergraph_partition,
    random_partition,
)
from sparse_sgd.radixnet import RadixNetConfig, radixnet, relabel_owners, relabelling
from substrate.calls import Call, Placement
from substrate.options import option

__all__ = [
    "INTERVALS",
    "METHODS",
    "NUM_CLASSES",
    "PHASE_CATEGORIES",
    "PHASE_EVAL",
    "PHASE_EVAL_SCORES",
    "PHASE_LOSS",
    "PHASE_PARTITION",
    "PHASE_SPBP",
    "PHASE_SPFF",
    "PHASE_SYNC",
    "HSGDOptions",
    "HSGDPlan",
    "PartitionOptions",
    "batches",
    "partition_broadcast",
    "partition_bytes",
    "plan_partition",
]

#: ledger phases of the SpFF (Alg. 2) and SpBP (Alg. 3) messages
PHASE_SPFF = "spff"
PHASE_SPBP = "spbp"
#: ledger phases of the sparse-SGD driver: the partition broadcast, the loss/score all-reduce of
#: a step, the held-out evaluation's SpFF and score all-reduce, inference's start barrier and
#: category all-reduce
PHASE_PARTITION = "partition"
PHASE_LOSS = "loss"
PHASE_EVAL = "eval"
PHASE_EVAL_SCORES = "eval_scores"
PHASE_SYNC = "sync"
PHASE_CATEGORIES = "categories"
#: the intervals a run accounts (:meth:`HSGDPlan.calls`)
INTERVALS = ("step", "setup", "eval", "infer")
#: digit classes: output neuron j scores class j mod 10
NUM_CLASSES = 10
#: row partitioners: the paper's H-SGD (hypergraph) and SGD (random rows) baselines
METHODS = ("hypergraph", "random")

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

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


def plan_partition(weights, parts: int, method: str,
                   options: PartitionOptions | None = None, *, seed: int = 0,
                   network: RadixNetConfig | None = None, cores: int | None = None) -> Partition:
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
    cfg = (options or PartitionOptions()).hypergraph_config(seed, cores=cores)
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
    """A row partition and the communication it implies.

    Attributes
    ----------
    partition : Partition
    metrics : PartitionMetrics
        ``pair_words[k-1, m, n]`` words of x^{k-1} that n sends to m in SpFF of layer k (and m
        sends back to n in SpBP for k >= 2).

    The plan does not depend on where the ranks run: :meth:`calls` takes the placement.
    """

    partition: Partition
    metrics: PartitionMetrics

    @classmethod
    def from_partition(cls, weights, partition: Partition) -> HSGDPlan:
        return cls(partition, partition_metrics(weights, partition))

    @classmethod
    def build(cls, weights, nodes: int, ranks_per_node: int, method: str,
              options: PartitionOptions | None = None, *, seed: int = 0,
              network: RadixNetConfig | None = None) -> HSGDPlan:
        """The plan of ``nodes`` x ``ranks_per_node`` processors (:func:`plan_partition`)."""
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"nodes and ranks per node must be >= 1, got {nodes}, "
                             f"{ranks_per_node}")
        part = plan_partition(weights, nodes * ranks_per_node, method, options, seed=seed,
                              network=network)
        return cls.from_partition(weights, part)

    @property
    def parts(self) -> int:
        return self.partition.parts

    @property
    def num_layers(self) -> int:
        return self.partition.num_layers

    @property
    def partition_bytes(self) -> int:
        """Bytes rank 0 broadcasts (:func:`partition_bytes`): every owner and the time."""
        return 8 * (sum(np.asarray(o).size for o in self.partition.owners) + 1)

    @cached_property
    def _words(self) -> tuple:
        """Per layer k (index k - 1): ``(spff, spbp)`` int64 rows ``(src, dst, words)`` of the
        non-empty pairs, in the order the ranks post their sends: by sender, then by receiver
        (:mod:`partition.maps` lists ``send_ranks`` and ``recv_ranks`` in ascending order).

        SpFF (Alg. 2, line 5): n sends D^k[m, n] words of x^{k-1} to m.  SpBP (Alg. 3, line 6,
        k >= 2): m sends the D^k[m, n] partial sums of the received rows back to n."""
        out = []
        for D in self.metrics.pair_words:
            n, m = np.nonzero(D.T)          # row-major over (sender n, receiver m)
            ff = np.stack([n, m, D[m, n]], axis=1).astype(np.int64)
            m2, n2 = np.nonzero(D)          # row-major over (sender m, receiver n)
            bp = np.stack([m2, n2, D[m2, n2]], axis=1).astype(np.int64)
            out.append((ff, bp))
        return tuple(out)

    def _exchange(self, world: tuple, k: int, direction: int, word_bytes: int, phase: str,
                  itemsize: int, after: tuple) -> Call | None:
        """The p2p record of layer ``k``'s SpFF (``direction`` 0) or SpBP (1) exchange
        (``None`` when no processor sends in it)."""
        rows = self._words[k - 1][direction]
        if not rows.shape[0]:
            return None
        pairs = rows.copy()
        pairs[:, 2] *= word_bytes
        return Call(phase, "p2p", world, pairs=pairs, itemsize=itemsize, after=after)

    def _forward(self, out: list, world: tuple, batch: int, itemsize: int, phase: str) -> None:
        """Append the SpFF records of one forward pass on ``batch`` input vectors, each after
        the previous record of ``out`` (layer k's sends wait for layer k-1's products), with
        their tags k."""
        for k in range(1, self.num_layers + 1):
            c = self._exchange(world, k, 0, batch * itemsize, phase, itemsize, _prev(out))
            if c is not None:
                out.append((c, k))

    def calls(self, placement: Placement, batch: int, itemsize: int, interval: str = "step", *,
              samples: int = 0) -> list[Call]:
        """The records of one interval of ``sparse_sgd train`` / ``infer`` on ``placement``.

        Parameters
        ----------
        placement : Placement
            Node of every world rank (one rank per part).
        batch : int
            Input vectors per mini-batch (a word is ``batch * itemsize`` bytes).
        itemsize : int
            Bytes per value (``--dtype``).
        interval : {"step", "setup", "eval", "infer"}
            ``"step"``: one SGD iteration: per layer k = 1..L the SpFF exchange (one ``p2p``
            record, phase ``spff``), per layer k = L..2 the SpBP exchange (``spbp``), then the
            loss/score all-reduce of ``1 + 10 batch`` float64 (``loss``).  ``"setup"``: the
            partition broadcast from rank 0 (``partition``).  ``"eval"``: the held-out
            evaluation of ``samples`` images in batches of ``batch``: SpFF of every batch
            (phase ``eval``), then the all-reduce of the ``10 samples`` float64 class scores
            (``eval_scores``; nothing at all without samples).  ``"infer"``: Graph Challenge
            inference of ``samples`` inputs: the start barrier (``sync``), SpFF of every batch
            (``spff``), the max all-reduce of ``samples + 1`` float64 (``categories``).
        samples : int
            Images (``eval``) or inputs (``infer``).

        Layers nobody sends in have no record.  Each record's ``after`` names the previous one
        (every exchange and collective of H-SGD waits for the compute the previous one fed).
        """
        return [c for c, _ in self.tagged_calls(placement, batch, itemsize, interval,
                                                samples=samples)]

    def tagged_calls(self, placement: Placement, batch: int, itemsize: int,
                     interval: str = "step", *, samples: int = 0) -> list[tuple[Call, int | None]]:
        """:meth:`calls`' records, each with the message tag of its exchange: ``k`` for the
        SpFF exchange of layer k (Alg. 2), ``L + k`` for the SpBP exchange of layer k (Alg. 3),
        ``None`` for a collective.  The tag names the layer whose maps a rank's program
        (:mod:`sparse_sgd.program`) sends from and receives into."""
        if not isinstance(placement, Placement):
            raise TypeError(f"calls() needs a substrate.calls.Placement, got "
                             f"{type(placement).__name__}")
        if placement.size != self.parts:
            raise ValueError(f"the placement has {placement.size} ranks, the partition "
                             f"{self.parts} parts")
        if interval not in INTERVALS:
            raise ValueError(f"unknown interval {interval!r}; use one of {INTERVALS}")
        for name, v in (("batch", batch), ("itemsize", itemsize)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) \
                or samples < 0:
            raise ValueError(f"samples must be an integer >= 0, got {samples!r}")
        batch, itemsize, samples = int(batch), int(itemsize), int(samples)
        world = placement.world
        L = self.num_layers
        out: list[tuple[Call, int | None]] = []
        if interval == "setup":
            out.append((partition_broadcast(placement, self.partition_bytes), None))
        elif interval == "step":
            self._forward(out, world, batch, itemsize, PHASE_SPFF)
            for k in range(L, 1, -1):  # s^1 would only give delta^0: not sent
                c = self._exchange(world, k, 1, batch * itemsize, PHASE_SPBP, itemsize,
                                   _prev(out))
                if c is not None:
                    out.append((c, L + k))
            out.append((Call(PHASE_LOSS, "allreduce", world, 8 * (1 + NUM_CLASSES * batch), 8,
                             op="sum", after=_prev(out)), None))
        elif interval == "eval":
            for b in batches(samples, batch):
                self._forward(out, world, b, itemsize, PHASE_EVAL)
            if samples:
                out.append((Call(PHASE_EVAL_SCORES, "allreduce", world,
                                 8 * NUM_CLASSES * samples, 8, op="sum", after=_prev(out)),
                            None))
        else:  # infer
            out.append((Call(PHASE_SYNC, "barrier", world), None))
            for b in batches(samples, batch):
                self._forward(out, world, b, itemsize, PHASE_SPFF)
            out.append((Call(PHASE_CATEGORIES, "allreduce", world, 8 * (samples + 1), 8,
                             op="max", after=_prev(out)), None))
        return out


def partition_broadcast(placement: Placement, nbytes: int) -> Call:
    """The set-up's record: rank 0 broadcasts the partition, ``nbytes`` of float64
    (:func:`partition_bytes`), before any rank has a plan."""
    return Call(PHASE_PARTITION, "bcast", placement.world, int(nbytes), 8, root=0)


def _prev(out: list) -> tuple:
    """``after`` of the next record: the last one of ``out``."""
    return (len(out) - 1,) if out else ()


def batches(samples: int, batch: int) -> list[int]:
    """Sizes of the batches of ``samples`` inputs taken ``batch`` at a time (last one short)."""
    return [min(batch, samples - s) for s in range(0, samples, batch)]
