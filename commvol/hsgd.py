"""H-SGD / SGD communication from a row partition's metrics (H-SGD paper, §4–§5, Table 1).

Nothing is re-derived here: the per-pair word counts ``D^k[m, n]`` and the Table-1 metrics come
from :func:`partition.partition_metrics`, the bytes per link class and messages of SpFF/SpBP, the
loss all-reduce and the partition broadcast from :mod:`sparse_sgd.traffic` — the same functions
``python -m sparse_sgd train`` uses for its ``summary.json`` ``predicted`` block.  This module
adds the per-rank α–β time of the point-to-point pattern and the network/partition plumbing of
``python -m commvol predict --system hsgd|sgd`` and ``partition-table``.

One **iteration** is one SpFF + SpBP pass on a mini-batch of ``batch`` input vectors (each word of
Table 1 is ``batch · word_bytes`` bytes on the wire) followed by the loss/score all-reduce of
``1 + 10 batch`` float64.  Networks are RadiX-Nets of :mod:`sparse_sgd.radixnet`: the Graph
Challenge family for N in {1024, 4096, 16384, 65536}, the same construction (radix-2 layers,
16 x 16 dense Kronecker blocks, weight 1/16) for any other ``N = 16 · 2^m`` (small test sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from partition import PARTITIONERS, make_partition, partition_metrics
from partition.partitioners import PRESETS
from sparse_sgd.cli import NUM_CLASSES, PHASE_LOSS, PHASE_PARTITION
from sparse_sgd.radixnet import (CHALLENGE_BIAS, CHALLENGE_BLOCK, RadixNetConfig,
                                 graph_challenge_network, radixnet)
from sparse_sgd.traffic import allreduce_phase, bcast_phase, p2p_phases
from substrate import costmodel as cm
from substrate.costmodel import CostModel

__all__ = ["RadixNetSpec", "radixnet_weights", "HSGDPredictOptions", "partition_network",
           "iteration_phases", "p2p_rank_seconds", "predict_partitioned", "PAPER_LAYERS"]

#: layers of the paper's networks (§6.1: "four different sized sparse DNNs consisting of 120
#: layers")
PAPER_LAYERS = 120


def radixnet_weights(neurons: int, layers: int, *, permute: bool = True, seed: int = 0) -> list:
    """Weights ``W^1..W^L`` of the RadiX-Net with ``neurons`` per layer (see module docstring).

    Raises
    ------
    ValueError
        Unless ``neurons = 16 · 2^m`` (m >= 1) and ``layers >= 1``.
    """
    neurons, layers = int(neurons), int(layers)
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    if neurons in CHALLENGE_BIAS:
        return graph_challenge_network(neurons, layers, permute=permute, seed=seed).weights
    n = neurons // CHALLENGE_BLOCK
    if neurons % CHALLENGE_BLOCK or n < 2 or n & (n - 1):
        raise ValueError(f"--neurons must be 16 * 2^m (e.g. 64, 1024, 4096), got {neurons}; the "
                         f"Graph Challenge sizes are {sorted(CHALLENGE_BIAS)}")
    m = n.bit_length() - 1
    return radixnet(RadixNetConfig(radices=(2,) * m, num_layers=layers,
                                   blocks=(CHALLENGE_BLOCK,), weight=1.0 / CHALLENGE_BLOCK,
                                   permute=permute, seed=seed))


@dataclass(frozen=True)
class RadixNetSpec:
    """Shape-only description of a RadiX-Net (the "model" of the sparse-DNN systems)."""

    neurons: int = 1024
    layers: int = 12
    permute: bool = True
    seed: int = 0

    @property
    def name(self) -> str:
        return f"radixnet-{self.neurons}x{self.layers}"

    def weights(self) -> list:
        return radixnet_weights(self.neurons, self.layers, permute=self.permute, seed=self.seed)


@dataclass(frozen=True)
class HSGDPredictOptions:
    """Options of the H-SGD / SGD models (defaults: ``python -m sparse_sgd train``'s)."""

    batch: int = field(default=32, metadata={
        "help": "sparse SGD: input vectors per mini-batch (one word = batch values)"})
    word_bytes: int = field(default=8, metadata={
        "help": "sparse SGD: bytes per value (8: sparse_sgd's float64 default)"})
    epsilon: float = field(default=0.01, metadata={
        "help": "sparse SGD: allowed imbalance of the hypergraph partition (eq. 2)"})
    preset: str = field(default="default", metadata={
        "help": "sparse SGD: Mt-KaHyPar preset", "choices": PRESETS})
    threads: int = field(default=0, metadata={
        "help": "sparse SGD: Mt-KaHyPar threads (0: all cores)"})

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.word_bytes not in (4, 8):
            raise ValueError(f"--word-bytes must be 4 (float32) or 8 (float64), got "
                             f"{self.word_bytes}")
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"--epsilon must be in [0, 1), got {self.epsilon}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {PRESETS}, got {self.preset!r}")


def partition_network(weights, parts: int, method: str, *, seed: int = 0,
                      options: HSGDPredictOptions = HSGDPredictOptions()):
    """Row partition of ``weights`` into ``parts`` (``"hypergraph"``: H-SGD, ``"random"``: SGD),
    with the same call ``sparse_sgd train`` makes (:func:`partition.make_partition`)."""
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partition method {method!r}; valid: {sorted(PARTITIONERS)}")
    kw = ({"preset": options.preset, "epsilon": options.epsilon, "threads": options.threads}
          if method == "hypergraph" else {})
    return make_partition(method, weights, parts, seed=seed, **kw)


def iteration_phases(metrics, node_of, *, batch: int, word_bytes: int) -> dict:
    """``{phase: {"bytes", "intra_bytes", "inter_bytes", "messages"}}`` of one training iteration
    (:func:`sparse_sgd.traffic.p2p_phases` and the loss all-reduce of ``sparse_sgd train``)."""
    out = p2p_phases(metrics, node_of, batch=batch, itemsize=word_bytes, iterations=1)
    out[PHASE_LOSS] = allreduce_phase(1 + NUM_CLASSES * batch, 8, node_of)
    return out


def p2p_rank_seconds(metrics, node_of, *, batch: int, word_bytes: int,
                     cost: CostModel) -> dict:
    """α–β time of SpFF and SpBP on their busiest rank: every message ``n -> m`` of ``w`` words
    costs ``alpha_link + w · batch · word_bytes · beta_link`` on the sender (as the ledger's
    ``isend`` records it)."""
    node_of = np.asarray(node_of)
    same = node_of[:, None] == node_of[None, :]
    alpha = np.where(same, cost.alpha(cm.INTRA), cost.alpha(cm.INTER))
    beta = np.where(same, cost.beta(cm.INTRA), cost.beta(cm.INTER))
    D = metrics.pair_words.astype(np.float64)  # (L, m, n): SpFF n -> m, SpBP m -> n (k >= 2)
    t = (D > 0) * alpha + D * batch * word_bytes * beta  # time of message m <- n (or m -> n)
    spff = t.sum(axis=0).sum(axis=0)  # per sender n
    spbp = t[1:].sum(axis=0).sum(axis=1)  # per sender m
    return {"spff": float(spff.max(initial=0.0)), "spbp": float(spbp.max(initial=0.0))}


def predict_partitioned(spec: RadixNetSpec, nodes: int, gpus_per_node: int,
                        options: HSGDPredictOptions, cost: CostModel | None, method: str):
    """Prediction of one sparse-SGD iteration under a fresh ``method`` partition of ``spec``."""
    from .systems import CallCost, Prediction  # noqa: PLC0415 (systems imports us)

    cost = cost or CostModel()
    p = nodes * gpus_per_node
    node_of = np.arange(p) // gpus_per_node
    weights = spec.weights()
    part = partition_network(weights, p, method, seed=spec.seed, options=options)
    metrics = partition_metrics(weights, part)
    ph = iteration_phases(metrics, node_of, batch=options.batch, word_bytes=options.word_bytes)
    secs = p2p_rank_seconds(metrics, node_of, batch=options.batch,
                            word_bytes=options.word_bytes, cost=cost)
    calls = CallCost(nodes, gpus_per_node, cost)
    calls.add("spff", ph["spff"]["messages"], secs["spff"])
    calls.add("spbp", ph["spbp"]["messages"], secs["spbp"])
    calls.allreduce(PHASE_LOSS, 8 * (1 + NUM_CLASSES * options.batch), "world")
    phases = {k: {cm.INTRA: v["intra_bytes"], cm.INTER: v["inter_bytes"]} for k, v in ph.items()
              if v["bytes"]}
    p2p = sum(ph[k]["bytes"] for k in ("spff", "spbp"))
    it = calls.finish(phases, payload=p2p // max(p, 1))
    sizes = [weights[0].shape[1]] + [W.shape[0] for W in weights]
    nbytes = 8 * (sum(sizes) + 1)  # owners + partitioning time as float64 (distribute_partition)
    b = bcast_phase(nbytes, node_of)
    setup_calls = CallCost(nodes, gpus_per_node, cost)
    setup_calls.bcast(PHASE_PARTITION, nbytes, "world")
    setup = setup_calls.finish({PHASE_PARTITION: {cm.INTRA: b["intra_bytes"],
                                                  cm.INTER: b["inter_bytes"]}})
    t1 = metrics.table1()
    notes = (f"{method} row partition into p = {p} parts ({part.seconds:.2f} s); Table-1 per "
             f"processor per layer: avg volume {t1['avg_volume']:.1f} words, max "
             f"{t1['max_volume']:.1f}, avg messages {t1['avg_messages']:.2f}, imbalance "
             f"{t1['imbalance']:.3f}",
             f"one iteration = SpFF + SpBP on a batch of {options.batch} vectors "
             f"({options.word_bytes}-byte values) + loss all-reduce; payload = average bytes a "
             "processor sends",
             "setup: partition broadcast from rank 0 (counted once in totals)")
    nnz = int(sum(W.nnz for W in weights))
    return Prediction("hsgd" if method == "hypergraph" else "sgd", spec.name, nodes,
                      gpus_per_node, "iteration", ((None, it),), setup=setup, notes=notes,
                      num_params=nnz)
