"""``python -m sparse_sgd {train,infer,partition,generate}``.

Run distributed as ``./run_mpi.sh -n 4 sparse_sgd train ...``
(= ``mpiexec -n 4 python -m mpi4py -m sparse_sgd train ...``).

* ``train``: SGD with SpFF + SpBP (Algs. 2-3) on digits or MNIST in
  :class:`runner.loop.RunLoop`, a held-out test accuracy after the last step (and every
  ``--eval-every`` steps; its messages are accounted like a step's, in the line that
  evaluates).  ``metrics.jsonl`` (the schema of ``runner/metrics.schema.json``) has a line
  after steps 1, 1 + N, 1 + 2N, ... (``--log-every N``) and the last, with the interval's mean
  loss and mini-batch accuracy; ``summary.json``'s ``metrics.final_test_accuracy`` is the
  held-out accuracy after the last step, as for every trainer (``test_accuracy``, its older
  name here, is kept for compatibility).  The default workload learns (ReLU, fan-in-scaled initial weights);
  ``--paper-timing`` runs the paper's timing workload instead (sigmoid, U[-1, 1] weights, §6.1).
  ``--checkpoint-every N`` / ``--resume`` continue exactly as an uninterrupted run
  (:class:`runner.checkpoints.RunCheckpoints`); rank 0 reports progress every ``--progress-every``
  steps on stderr.
* ``infer``: H-SpFF inference with Graph Challenge semantics (§6.3).
* ``partition``: Table 1 of the paper for a RadiX-Net (serial): H-SGD's hypergraph partition
  and SGD's random rows side by side with the closed form E[R] of the random row and a lower
  bound; writes ``OUT/partition.npz`` for ``train --partition-file``.
* ``generate``: a challenge network, its inputs and truth categories in the challenge's folder
  layout (:mod:`sparse_sgd.io`).

``train`` and ``infer`` issue no call themselves: each interval (the set-up, a step, the
evaluation, inference) is a program generated from the plan's records
(:mod:`sparse_sgd.program`) and run by the one executor (:class:`substrate.executor.Executor`),
bound to the net's buffers and compute and to the trainer's batches and reductions.

Every command takes the common options (``--out``, ``--seed``, ``--overwrite``, ``--device``,
the cost model) and writes ``OUT/summary.json`` atomically; a finished run is not replaced
without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from partition.hmetis import load_partition as load_hmetis
from partition.hmetis import save_partition as save_hmetis
from partition.partitioners import Partition, partitioner_errors
from runner.errors import main_guard
from runner.loop import Evaluation, LoopBody, RunLoop
from runner.options import add_common_args, add_training_args
from runner.run import start_run
from sparse_sgd.activations import ACTIVATIONS
from sparse_sgd.data import class_targets, digits_dataset, mnist_dataset, train_test_split
from sparse_sgd.distributed import DistributedSparseNet
from sparse_sgd.io import (
    categories_path,
    images_path,
    read_categories,
    read_challenge_network,
    read_input_tsv,
    write_categories,
    write_challenge_network,
    write_input_tsv,
)
from sparse_sgd.plan import (
    METHODS,
    NUM_CLASSES,
    HSGDOptions,
    HSGDPlan,
    PartitionOptions,
    batches,
    partition_broadcast,
    partition_bytes,
    plan_partition,
)
from sparse_sgd.program import (
    BATCH,
    CLASS_SCORES,
    EVAL_BATCH,
    EVAL_SCORES,
    INFER_BATCH,
    INFER_CATEGORIES,
    NET_SETUP,
    eval_program,
    infer_program,
    setup_program,
    step_program,
)
from sparse_sgd.radixnet import (
    CHALLENGE_BIAS,
    CHALLENGE_YMAX,
    RadixNetConfig,
    challenge_config,
    radixnet,
)
from sparse_sgd.serial import INITS, challenge_inference_serial, init_weights
from sparse_sgd.table1 import format_table1, table1_rows
from substrate.executor import Bindings, Executor
from substrate.ledger import Predicted
from substrate.options import add_dataclass_args, check_choices, check_range, from_args, option

__all__ = [
    "GenerateConfig",
    "InferConfig",
    "PartitionConfig",
    "TrainConfig",
    "build_parser",
    "distribute_partition",
    "load_network",
    "main",
]

NET = "network"
TRAIN = "training"
#: the paper's timing workload (§6.1) and the default workload that learns
PAPER_WORKLOAD = {"activation": "sigmoid", "init": "uniform"}
LEARNING_WORKLOAD = {"activation": "relu", "init": "fan-in"}


def check_threshold(threshold: float) -> None:
    """``--threshold``: pixels (scaled to [0, 1]) above it become 1."""
    check_range("--threshold", threshold, ge=0, lt=1)


@dataclass(frozen=True)
class NetworkConfig(PartitionOptions):
    """The network and its partition (``train``, ``infer``, ``partition``)."""

    neurons: int = option(1024, "neurons per layer N (a Graph Challenge size)",
                          choices=sorted(CHALLENGE_BIAS), group=NET)
    layers: int = option(12, "layers L", group=NET)
    permute: bool = option(True, "keep the generator's neuron ids (default: relabel the hidden "
                           "neurons at random, P_k W^k P_{k-1}^T: the same network under other "
                           "neuron ids)", group=NET)
    network_dir: str | None = option(None, "read the challenge network from DIR (or "
                                     "DIR/neuron{N}) instead of generating it", group=NET,
                                     metavar="DIR")
    sum_duplicates: bool = option(False, "add repeated entries of network/input files instead "
                                  "of refusing them", group=NET)
    threshold: float = option(0.25, "pixel threshold of the binary input features", group=NET)
    partition: str = option("hypergraph", "row partition: hypergraph (H-SGD) or random (SGD)",
                            choices=METHODS, group=NET)
    partition_file: str | None = option(
        None, "partition written by `python -m sparse_sgd partition` (OUT/partition.npz), or a "
        "directory of hMetis layer_K.part.P files (OUT/hmetis, or a partitioner's output on "
        "its .hgr files)", group=NET, metavar="FILE|DIR")

    def __post_init__(self):
        super().__post_init__()
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        check_threshold(self.threshold)

    def radixnet_config(self, seed: int) -> RadixNetConfig | None:
        """The generator's configuration (None for a network read from files)."""
        if self.network_dir:
            return None
        return challenge_config(self.neurons, self.layers, permute=self.permute, seed=seed)


@dataclass(frozen=True)
class TrainConfig(NetworkConfig, HSGDOptions):
    """Configuration of ``sparse_sgd train``."""

    steps: int = option(300, "optimizer steps (mini-batches)", group=TRAIN)
    lr: float = option(0.05, "learning rate", group=TRAIN)
    activation: str | None = option(
        None, "activation f (default relu; sigmoid with --paper-timing)",
        choices=sorted(ACTIVATIONS), group=TRAIN)
    init: str | None = option(
        None, "initial weights on the sparsity pattern: fan-in (U[-a, a], a = sqrt(6/fan-in) "
        "for relu, sqrt(3/fan-in) for sigmoid), uniform (U[-1, 1], the paper's) or challenge "
        "(the network's 1/16); default fan-in, uniform with --paper-timing",
        choices=INITS, group=TRAIN)
    paper_timing: bool = option(False, "the paper's timing workload (§6.1): sigmoid, U[-1, 1] "
                                "weights (MSE loss as always); it does not learn", group=TRAIN)
    data: str = option("digits", "training images: scikit-learn's digits or MNIST IDX files",
                       choices=("digits", "mnist"), group=TRAIN)
    mnist_images: str | None = option(None, "MNIST images IDX file (--data mnist)", group=TRAIN)
    mnist_labels: str | None = option(None, "MNIST labels IDX file (--data mnist)", group=TRAIN)
    test_fraction: float = option(0.2, "fraction of the images held out for the test accuracy",
                                  group=TRAIN)
    log_every: int = option(10, "steps between metrics.jsonl lines (after steps 1, 1 + N, "
                            "...; and the last)", group=TRAIN, metavar="N")
    eval_every: int = option(0, "held-out accuracy after every N-th step and after the last "
                             "(0: after the last only)", group=TRAIN, metavar="N")
    checkpoint_every: int = option(0, cli=False)
    resume: bool = option(False, cli=False)

    def __post_init__(self):
        super().__post_init__()
        workload = PAPER_WORKLOAD if self.paper_timing else LEARNING_WORKLOAD
        for name, value in workload.items():
            given = getattr(self, name)
            if given is None:
                object.__setattr__(self, name, value)
            elif self.paper_timing and given != value:
                raise ValueError(f"--paper-timing uses --{name} {value}; drop --{name} "
                                 f"{given} or --paper-timing")
        check_choices(self)
        for flag, value in (("--steps", self.steps), ("--log-every", self.log_every)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: after the last step only), got "
                             f"{self.eval_every}")
        check_range("--lr", self.lr, gt=0)
        if not 0 <= self.test_fraction < 1:
            raise ValueError(f"--test-fraction must be >= 0 and < 1, got {self.test_fraction}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got "
                             f"{self.checkpoint_every}")
        if self.data == "mnist" and not (self.mnist_images and self.mnist_labels):
            raise ValueError("--data mnist needs --mnist-images and --mnist-labels (IDX files)")


@dataclass(frozen=True)
class InferConfig(NetworkConfig):
    """Configuration of ``sparse_sgd infer`` (Graph Challenge semantics, §6.3)."""

    batch_size: int = option(1000, "input vectors per batch")
    dtype: str = option("float32", "value type", choices=("float32", "float64"))
    inputs: str | None = option(None, "input TSV (default: the embedded digits)", metavar="FILE")
    num_inputs: int | None = option(None, "use the first N inputs", metavar="N")
    categories: str | None = option(None, "truth category file to compare with", metavar="FILE")
    write_categories: str | None = option(None, "write the categories found", metavar="FILE")
    check: bool = option(False, "compare with the serial reference")

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.num_inputs is not None and self.num_inputs < 1:
            raise ValueError(f"--num-inputs must be >= 1, got {self.num_inputs}")


@dataclass(frozen=True)
class PartitionConfig(NetworkConfig):
    """Configuration of ``sparse_sgd partition`` (Table 1)."""

    parts: int = option(32, "processors P")
    method: str = option("both", "partitions to compute", choices=(*METHODS, "both"))
    partition: str = option("hypergraph", cli=False)
    partition_file: str | None = option(None, cli=False)
    threshold: float = option(0.25, cli=False)
    hmetis: bool = option(False, "also write OUT/hmetis/: every phase's hypergraph as hMetis "
                          ".hgr/.fix and the partition as .part.P files (partition.hmetis)")

    def __post_init__(self):
        super().__post_init__()
        if self.parts < 1:
            raise ValueError(f"--parts must be >= 1, got {self.parts}")
        if self.parts > self.neurons:
            raise ValueError(f"--parts {self.parts} is larger than the {self.neurons} neurons of "
                             f"a layer: every part needs at least one row; pass --parts "
                             f"{self.neurons} or less")


@dataclass(frozen=True)
class GenerateConfig:
    """Configuration of ``sparse_sgd generate``."""

    neurons: int = option(1024, "neurons per layer N", choices=sorted(CHALLENGE_BIAS))
    layers: int = option(12, "layers L")
    permute: bool = option(True, "keep the generator's neuron ids (default: relabel the hidden "
                           "neurons at random)")
    threshold: float = option(0.25, "pixel threshold of the binary input features")
    num_inputs: int | None = option(None, "write the first N digits images", metavar="N")

    def __post_init__(self):
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        check_threshold(self.threshold)
        if self.num_inputs is not None and self.num_inputs < 1:
            raise ValueError(f"--num-inputs must be >= 1, got {self.num_inputs}")


def set_kernel_threads(run) -> int:
    """Give each rank's Numba kernels its share of the node's cores (cores / ranks on the node).

    Oversubscribed Numba thread pools spin against the MPI progress loops of the other ranks.
    """
    import numba  # noqa: PLC0415 (LLVM start-up: only commands that run the kernels)

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cores = os.cpu_count() or 1
    ranks_here = run.topo.intra.size if not getattr(run.topo, "virtual", False) else run.size
    n = max(1, min(numba.config.NUMBA_NUM_THREADS, cores // max(1, ranks_here)))
    numba.set_num_threads(n)
    return n


def load_network(cfg: NetworkConfig, seed: int):
    """``(weights, bias, generator config)``: generated (RadiX-Net, seeded) or read from the
    challenge files of ``cfg.network_dir`` (then the generator config is None)."""
    if cfg.network_dir:
        weights = read_challenge_network(cfg.network_dir, cfg.neurons, cfg.layers,
                                         sum_duplicates=cfg.sum_duplicates)
        return weights, CHALLENGE_BIAS.get(cfg.neurons, -0.3), None
    network = cfg.radixnet_config(seed)
    return radixnet(network), CHALLENGE_BIAS[cfg.neurons], network


class _SetUp(Bindings):
    """The set-up's bindings: the partition rank 0 broadcasts (every layer's owners, then the
    partitioning time, float64: :func:`~sparse_sgd.plan.partition_bytes`), read back on
    every rank, and the net's set-up once every rank has it (``build(partition)``)."""

    def __init__(self, part, flat, sizes, parts: int, method: str, build) -> None:
        self.part, self.flat, self.sizes, self.build = part, flat, sizes, build
        self.parts, self.method = parts, method

    def buffer(self, call):
        return self.flat

    def received(self, call, result) -> None:
        flat = self.flat
        owners = np.split(flat[:-1].astype(np.int64), np.cumsum(self.sizes)[:-1])
        self.part = Partition(owners=tuple(owners), parts=self.parts, method=self.method,
                              seconds=float(flat[-1]))

    def compute(self, label: str):
        if label != NET_SETUP:
            return super().compute(label)
        return lambda: self.build(self.part)


def distribute_partition(run, weights, method: str, *, partition_file=None, seed=0,
                         options: PartitionOptions | None = None,
                         network: RadixNetConfig | None = None, saved: Partition | None = None,
                         executor: Executor | None = None, build=None) -> tuple[Partition, int]:
    """The set-up: :func:`~sparse_sgd.plan.plan_partition` on rank 0 and the owners broadcast
    (or ``partition_file`` read on every rank, or a checkpoint's partition, ``saved``), then
    with ``build`` the net's set-up, ``build(partition)``: the set-up's program
    (:func:`sparse_sgd.program.setup_program`) run by ``executor`` (a new one if omitted).

    Returns the partition and the number of bytes broadcast (0 when read from a file or a
    checkpoint).
    """
    part, flat = saved, None
    sizes = [weights[0].shape[1]] + [W.shape[0] for W in weights]
    if part is None and partition_file and Path(partition_file).is_dir():
        part = load_hmetis(weights, partition_file, run.size)
    elif part is None and partition_file:
        part = Partition.load(partition_file)
        if part.parts != run.size:
            raise ValueError(f"{partition_file} has {part.parts} parts; run with -n {part.parts} "
                             "or partition again for this rank count")
        part.check_network(weights)
    elif part is None:
        flat = np.empty(sum(sizes) + 1, dtype=np.float64)
        if run.rank == 0:
            with partitioner_errors():
                mine = plan_partition(weights, run.size, method, options or PartitionOptions(),
                                      seed=seed, network=network, cores=run.threads["threads"])
            flat[:-1] = np.concatenate(mine.owners)
            flat[-1] = mine.seconds
        assert flat.nbytes == partition_bytes(weights)
    records = [] if flat is None else \
        [(partition_broadcast(run.topo.placement, partition_bytes(weights)), None)]
    if records or build is not None:
        bind = _SetUp(part, flat, sizes, run.size, method, build)
        program = setup_program(records, run.topo.placement, run.rank, net=build is not None)
        (executor if executor is not None else Executor(run)).run_step(program, bind)
        part = bind.part
    return part, 0 if flat is None else flat.nbytes


def _require_cpu(args) -> None:
    if getattr(args, "device", "cpu") != "cpu":
        raise ValueError("sparse_sgd partition runs on the CPU (a serial partitioner); "
                         "use --device cpu")


def _staged(net: DistributedSparseNet, *arrays):
    """Host arrays on the net's device, one copy each (as they are on the CPU)."""
    return arrays if not net.gpu else tuple(net.xp.asarray(a) for a in arrays)


def _host_floats(net: DistributedSparseNet, *values) -> list[float]:
    """Scalars (0-d arrays) as Python floats; on the GPU with one host read for them all."""
    if not net.gpu:
        return [float(v) for v in values]
    return [float(v) for v in net.backend.asnumpy(net.xp.stack(values))]


#: configuration fields a resumed run may change (everything else must match the checkpoint)
RESUMABLE = ("steps", "checkpoint_every", "resume", "log_every")


def _net_state(net: DistributedSparseNet, part: Partition, part_bytes: int) -> dict:
    """This rank's rows of every W^k and b^k and the partition, for a checkpoint."""
    state = {"partition/parts": np.int64(part.parts), "partition/method": part.method,
             "partition/seconds": np.float64(part.seconds),
             "partition/bytes": np.int64(part_bytes)}
    state.update({f"partition/owner_{k}": np.asarray(o) for k, o in enumerate(part.owners)})
    net.pull_weights()                  # a GPU net's rows into its host maps (host copies)
    biases = net.host_biases()
    for k, mp in enumerate(net.maps):
        state[f"net/local_{k}"] = mp.W_local.data.copy()
        state[f"net/remote_{k}"] = mp.W_remote.data.copy()
        state[f"net/bias_{k}"] = np.array(biases[k], copy=True)
    return state


def _saved_partition(state: dict) -> tuple[Partition, int]:
    """The partition of a checkpoint (a resumed run keeps its rows) and its broadcast bytes."""
    owners = []
    while f"partition/owner_{len(owners)}" in state:
        owners.append(state[f"partition/owner_{len(owners)}"].astype(np.int64))
    part = Partition(owners=tuple(owners), parts=int(state["partition/parts"]),
                     method=str(state["partition/method"]),
                     seconds=float(state["partition/seconds"]))
    return part, int(state["partition/bytes"])


def _load_net_state(net: DistributedSparseNet, state: dict) -> None:
    """Restore :func:`_net_state`'s weights and biases in place (same partition, same rows;
    a GPU net's onto its device)."""
    for k, mp in enumerate(net.maps):
        mp.W_local.data[...] = state[f"net/local_{k}"]
        mp.W_remote.data[...] = state[f"net/remote_{k}"]
        net.b[k][...] = net.xp.asarray(state[f"net/bias_{k}"])
    net.push_weights()


def _setup_calls(run, plan: HSGDPlan, part_bytes: int) -> list:
    """The plan's records of the set-up: the partition broadcast when rank 0 partitioned
    (``part_bytes``), nothing when every rank read the partition from a file."""
    return plan.calls(run.topo.placement, 1, 8, interval="setup") if part_bytes else []


class _Around(Bindings):
    """The bindings of an interval around the net's passes: the trainer's own blocks
    (``blocks``) and the buffer of its collective (:meth:`reduced`); the net's blocks and
    messages are the net's (:class:`~sparse_sgd.distributed.DistributedSparseNet`)."""

    def __init__(self, net: DistributedSparseNet, blocks: dict) -> None:
        self.net, self.blocks = net, blocks

    def compute(self, label: str):
        fn = self.blocks.get(label)
        return fn if fn is not None else self.net.compute(label)

    def flops(self, label: str):
        return None if label in self.blocks else self.net.flops(label)

    def buffer(self, call):
        return self.net.buffer(call) if call.algorithm == "p2p" else self.reduced(call)

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        return self.net.receive_buffer(source, nbytes, tag)

    def reduced(self, call):
        """The array the interval's collective works on."""
        return super().buffer(call)


class _Evaluation(_Around):
    """The held-out evaluation's bindings: each batch of ``--batch-size`` test images staged
    and fed to the net (``eval_batch``), its class scores (``eval_scores``) and their
    all-reduce.  On a GPU each batch is staged once and the scores stay on the device
    (``out_class`` is on the net's device)."""

    def __init__(self, net, ds, batch: int, dtype, in_rows, out_class) -> None:
        super().__init__(net, {EVAL_BATCH: self._batch, EVAL_SCORES: self._scores})
        self.ds, self.batch, self.dtype, self.in_rows, self.out_class = (ds, batch, dtype,
                                                                         in_rows, out_class)
        self.scores = net.xp.zeros((NUM_CLASSES, max(ds.features.shape[0], 1)))
        self.s = 0                      # the first image of the batch

    def _batch(self) -> None:
        s = self.s
        X0, = _staged(self.net, np.ascontiguousarray(
            self.ds.features[s:s + self.batch][:, self.in_rows].T, dtype=self.dtype))
        self.net.feed(X0)

    def _scores(self) -> None:
        B = self.net.X[0].shape[1]
        self.scores[:, self.s:self.s + B] = self.net.class_scores(self.out_class, NUM_CLASSES)
        self.s += B

    def reduced(self, call):
        return self.scores


class _Step(_Around):
    """A training step's bindings: the mini-batch ``idx`` staged and fed to the net with its
    targets (``batch``), the class scores of x^L before the update next to this rank's share
    of the loss (``class_scores``) and their all-reduce, ``[J_m, scores]`` (on a GPU on the
    device)."""

    def __init__(self, body: _Steps) -> None:
        super().__init__(body.net, {BATCH: self._batch, CLASS_SCORES: self._scores})
        self.body = body
        self.idx = self.labels = None

    def _batch(self) -> None:
        b, idx = self.body, self.idx
        X0, Y, self.labels = _staged(
            b.net, np.ascontiguousarray(b.ds.features[idx][:, b.in_rows].T, dtype=b.dtype),
            np.ascontiguousarray(b.targets[idx][:, b.out_rows].T, dtype=b.dtype),
            b.ds.labels[idx])
        b.net.feed(X0)
        b.net.target(Y, b.cfg.lr)

    def _scores(self) -> None:
        b = self.body
        b.red[0] = b.net.loss
        b.red[1:] = b.net.class_scores(b.out_class, NUM_CLASSES).ravel()   # pre-update

    def reduced(self, call):
        return self.body.red


class _Steps(LoopBody):
    """One SpFF + SpBP step of ``sparse_sgd train`` for :class:`runner.loop.RunLoop`: the
    step's program (:func:`sparse_sgd.program.step_program`, generated from the plan's
    records) run by the executor; the evaluation is the held-out accuracy (its program,
    :func:`sparse_sgd.program.eval_program`)."""

    def __init__(self, run, cfg: TrainConfig, plan: HSGDPlan, net: DistributedSparseNet,
                 partition: tuple[Partition, int], ds, test, targets, batch_rng,
                 dtype, executor: Executor) -> None:
        self.run, self.cfg, self.plan, self.net = run, cfg, plan, net
        self.executor = executor
        self.partition = partition      # (the partition, its broadcast bytes): checkpointed
        self.ds, self.test, self.targets, self.batch_rng, self.dtype = (ds, test, targets,
                                                                        batch_rng, dtype)
        self.in_rows, out_rows = net.input_rows, net.output_rows
        self.out_rows = out_rows
        # on a GPU the class map, the class sizes, the test labels and the reduced loss and
        # scores live on the device (staged once; a step reads its loss and accuracy once)
        self.out_class, self.class_size, self.test_labels = _staged(
            net, out_rows % NUM_CLASSES,
            np.bincount(np.arange(cfg.neurons) % NUM_CLASSES, minlength=NUM_CLASSES),
            test.labels)
        self.red = net.xp.zeros(1 + NUM_CLASSES * cfg.batch_size, dtype=np.float64)
        placement, rank = run.topo.placement, run.rank
        overlap, first = run.recorder.overlap, net.receives_first
        # the plan's records of one step and of the evaluation (held against the calls each
        # runs) and the programs generated from them
        step = plan.tagged_calls(placement, cfg.batch_size, dtype.itemsize)
        self.step_calls = [c for c, _ in step]
        self.step_program = step_program(step, plan.num_layers, placement, rank,
                                         overlap=overlap, receives_first=first)
        n = test.features.shape[0]
        evaluation = plan.tagged_calls(placement, cfg.batch_size, dtype.itemsize,
                                       interval="eval", samples=n)
        self.eval_calls = [c for c, _ in evaluation]
        self.eval_program = eval_program(evaluation, plan.num_layers,
                                         len(batches(n, cfg.batch_size)), placement, rank,
                                         overlap=overlap, receives_first=first)
        self.step_bind = _Step(self)
        #: every step's loss and mini-batch accuracy (the summary's trajectory)
        self.losses: list[float] = []
        self.accs: list[float] = []
        self._line_from = 0     # the first step of the next metrics line

    def unit(self, due):
        cfg, net, red, bind = self.cfg, self.net, self.red, self.step_bind
        bind.idx = self.batch_rng.choice(self.ds.features.shape[0], size=cfg.batch_size,
                                         replace=False)
        self.executor.run_step(self.step_program, bind)
        xp = net.xp
        pred = xp.argmax(red[1:].reshape(NUM_CLASSES, cfg.batch_size)
                         / self.class_size[:, None], axis=0)
        loss, acc = _host_floats(net, red[0], xp.mean(pred == bind.labels))  # one host read
        self.losses.append(loss)
        self.accs.append(acc)
        return self.step_calls

    def evaluate(self) -> Evaluation:
        """Held-out accuracy: SpFF of the test images in batches of ``--batch-size`` (phase
        ``eval``) and one all-reduce of the class scores (``eval_scores``); on a GPU the
        accuracy is the one host read."""
        net, test = self.net, self.test
        n = test.features.shape[0]
        bind = _Evaluation(net, test, self.cfg.batch_size, self.dtype, self.in_rows,
                           self.out_class)
        self.executor.run_step(self.eval_program, bind)
        xp = net.xp
        pred = xp.argmax(bind.scores[:, :n] / self.class_size[:, None], axis=0)
        acc = _host_floats(net, xp.mean(pred == self.test_labels))[0] if n else float("nan")
        return Evaluation(acc, records=self.eval_calls)

    def line(self, interval) -> dict:
        lo, self._line_from = self._line_from, len(self.losses)
        return {"loss": float(np.mean(self.losses[lo:])),
                "batch_accuracy": float(np.mean(self.accs[lo:]))}

    def progress(self) -> dict:
        return {"loss": self.losses[-1], "batch_accuracy": self.accs[-1]}

    def state_dict(self) -> dict:
        return {**_net_state(self.net, *self.partition),
                "train/batch_rng": json.dumps(self.batch_rng.bit_generator.state),
                "train/losses": np.array(self.losses), "train/accs": np.array(self.accs),
                "train/line_from": np.int64(self._line_from)}

    def load_state_dict(self, state: dict) -> None:
        _load_net_state(self.net, state)
        self.batch_rng.bit_generator.state = json.loads(str(state["train/batch_rng"]))
        self.losses, self.accs = state["train/losses"].tolist(), state["train/accs"].tolist()
        self._line_from = int(state["train/line_from"])


def _train(args) -> dict:
    cfg = from_args(TrainConfig, args)
    method = "hsgd" if cfg.partition == "hypergraph" else "sgd"  # the paper's names
    run = start_run(args, system="sparse_sgd", method=method, config=cfg, unit="step")
    dtype = np.dtype(cfg.dtype)
    set_kernel_threads(run)
    weights, _, network = load_network(cfg, args.seed)
    if cfg.data == "mnist":
        ds = mnist_dataset(cfg.mnist_images, cfg.mnist_labels, cfg.neurons)
    else:
        ds = digits_dataset(cfg.neurons, cfg.threshold)
    ds, test = train_test_split(ds, cfg.test_fraction, args.seed)
    if cfg.batch_size > ds.features.shape[0]:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the {ds.name} training "
                         f"set ({ds.features.shape[0]} images; a mini-batch draws without "
                         f"replacement): pass --batch-size {ds.features.shape[0]} or less")
    weights = init_weights(weights, cfg.init, cfg.activation, np.random.default_rng([args.seed, 1]))
    fingerprint = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE}
    # a metrics line after steps 1, 1 + N, 1 + 2N, ... (--log-every N) and the last; the
    # held-out accuracy every --eval-every steps (default: after the last only)
    loop = RunLoop(run, total=cfg.steps, flag="--steps", may_change=("--log-every",),
                   fingerprint=fingerprint,
                   checkpoint_every=cfg.checkpoint_every,
                   progress_every=getattr(args, "progress_every", 0),
                   eval_every=cfg.eval_every, log_every=cfg.log_every, log_phase=1,
                   resume=cfg.resume)
    state = loop.resume()
    executor = Executor(run)
    built = {}

    def build(part: Partition) -> None:
        """The net's set-up: the plan, the maps and every layer's row block."""
        built["plan"] = plan = HSGDPlan.from_partition(weights, part)
        built["net"] = DistributedSparseNet(weights, part, run, plan=plan,
                                            activation=cfg.activation, dtype=dtype,
                                            executor=executor)

    saved, part_bytes = _saved_partition(state) if state is not None else (None, 0)
    if saved is not None:
        saved.check_network(weights)
    part, sent = distribute_partition(run, weights, cfg.partition,
                                      partition_file=cfg.partition_file, seed=args.seed,
                                      options=cfg, network=network, saved=saved,
                                      executor=executor, build=build)
    plan, net = built["plan"], built["net"]
    if state is None:
        part_bytes = sent
        loop.account(_setup_calls(run, plan, part_bytes))
    batch_rng = np.random.default_rng([args.seed, 2])  # same mini-batches on every rank
    body = _Steps(run, cfg, plan, net, (part, part_bytes), ds, test,
                  class_targets(ds.labels, cfg.neurons, NUM_CLASSES), batch_rng, dtype,
                  executor)
    if state is not None:
        body.load_state_dict(state)
    loop.run(body)
    executor.verify()               # the last interval, closed by the loop
    train_s = loop.units_wall_s
    losses, accs = body.losses, body.accs
    nnz = sum(W.nnz for W in weights)
    tail = max(1, min(10, len(losses)))
    # final_test_accuracy is every trainer's key (commvol report reads it); test_accuracy,
    # this command's older name for the same value, is kept for existing readers
    result = {"final_loss": losses[-1], "initial_loss": losses[0],
              "final_batch_accuracy": float(np.mean(accs[-tail:])),
              "final_test_accuracy": loop.final_accuracy, "test_accuracy": loop.final_accuracy,
              "test_images": int(test.features.shape[0]),
              "loss_trajectory": losses, "steps": cfg.steps,
              "activation": cfg.activation, "init": cfg.init, "paper_timing": cfg.paper_timing,
              "partition_method": part.method, "partition_seconds": part.seconds,
              "partition_table1": plan.metrics.table1(),
              "partition_spff_spbp": plan.metrics.table1_spff_spbp(),
              "train_seconds": train_s,
              "edges_per_second": 3 * nnz * cfg.batch_size * cfg.steps / max(train_s, 1e-12)}
    if cfg.resume:
        result["resumed_from_step"] = loop.start
    if run.recorder.program is not None:   # every interval's recording held to its program
        result["program_steps_verified"] = executor.steps_verified
    out = run.finish(metrics=result, predicted=loop.predicted.block())
    if run.rank == 0:
        print(f"test accuracy {loop.final_accuracy:.3f} on {test.features.shape[0]} held-out "
              f"images ({cfg.activation}, init {cfg.init}, {cfg.steps} steps)")
        _print_traffic(out)
    return out


def _print_traffic(summary: dict) -> None:
    """Measured (ledger) and predicted (the plan's records, accounted call by call: the
    messages are the plan's or the run stopped) bytes per phase."""
    m, p = summary["traffic"]["measured"], summary["traffic"]["predicted"]
    print(f"{'phase':<12}{'measured bytes':>16}{'predicted bytes':>17}{'messages':>11}")
    for ph in sorted(set(m["by_phase"]) | set(p["by_phase"])):
        a, b = m["by_phase"].get(ph, {}), p["by_phase"].get(ph, {})
        got = a.get("intra_bytes", 0) + a.get("inter_bytes", 0)
        want = b.get("intra_bytes", 0) + b.get("inter_bytes", 0)
        print(f"{ph:<12}{got:>16d}{want:>17d}{a.get('messages', 0):>11d}")
    same = all((m["by_phase"].get(ph, {}).get(f, 0) == p["by_phase"].get(ph, {}).get(f, 0))
               for ph in set(m["by_phase"]) | set(p["by_phase"])
               for f in ("intra_bytes", "inter_bytes"))
    tot_m = m["inter_node_bytes"] + m["intra_node_bytes"]
    tot_p = p["inter_node_bytes"] + p["intra_node_bytes"]
    print(f"{'total':<12}{tot_m:>16d}{tot_p:>17d}{m['messages']:>11d}"
          f"   {'EQUAL' if same else 'DIFFERENT'}")


class _Inference(_Around):
    """Inference's bindings: the start of the clock at the barrier, each batch of inputs
    staged and fed to the net (``infer_batch``), its categories (``infer_categories``: the
    inputs with a non-zero output, and a metrics line with the batch's wall time) and their
    max all-reduce, the elapsed time last (the slowest rank's).  On a GPU the categories stay
    on the device until the one host read after the reduction."""

    def __init__(self, run, net, Y0, batch: int, dtype) -> None:
        super().__init__(net, {INFER_BATCH: self._batch, INFER_CATEGORIES: self._categories})
        self.run, self.Y0, self.batch, self.dtype = run, Y0, batch, dtype
        self.nonzero = net.xp.zeros(Y0.shape[0] + 1, dtype=np.float64)
        self.s = 0                      # the first input of the batch
        self.t0 = self.t_batch = None

    def received(self, call, result) -> None:
        if call.algorithm == "barrier":  # every rank starts the clock together
            self.t0 = self.t_batch = time.perf_counter()

    def _batch(self) -> None:
        s, net = self.s, self.net
        block = self.Y0[s:s + self.batch][:, net.input_rows]
        block = block.toarray() if sp.issparse(block) else block
        X0, = _staged(net, np.ascontiguousarray(block.T, dtype=self.dtype))
        net.feed(X0)

    def _categories(self) -> None:
        net, s = self.net, self.s
        B = net.X[0].shape[1]
        self.nonzero[s:s + B] = net.xp.any(net.x != 0, axis=0)
        if net.gpu:
            net.backend.synchronize()   # the batch's wall time includes its device work
        # a line per batch: its wall time and the inference's so far (the traffic of the whole
        # inference is accounted once, after the last batch)
        now = time.perf_counter()
        self.run.log(s // self.batch + 1, interval_units=1, step_wall_s=now - self.t_batch,
                     elapsed_s=now - self.t0)
        self.t_batch = now
        self.s += B

    def reduced(self, call):
        if call.algorithm == "barrier":
            return None
        self.nonzero[-1] = time.perf_counter() - self.t0  # any over ranks, slowest rank
        return self.nonzero


def _infer(args) -> dict:
    cfg = from_args(InferConfig, args)
    run = start_run(args, system="sparse_sgd", method=f"hspff_{cfg.partition}", config=cfg,
                    unit="step")
    dtype = np.dtype(cfg.dtype)
    set_kernel_threads(run)
    weights, bias, network = load_network(cfg, args.seed)
    if cfg.inputs:
        Y0 = read_input_tsv(cfg.inputs, cfg.neurons, cfg.num_inputs,
                            sum_duplicates=cfg.sum_duplicates)  # CSR, sliced per batch
    else:
        Y0 = digits_dataset(cfg.neurons, cfg.threshold).features
        if cfg.num_inputs:
            Y0 = Y0[:cfg.num_inputs]
    n_in = Y0.shape[0]
    executor = Executor(run)
    part, part_bytes = distribute_partition(run, weights, cfg.partition,
                                            partition_file=cfg.partition_file, seed=args.seed,
                                            options=cfg, network=network, executor=executor)
    plan = HSGDPlan.from_partition(weights, part)
    predicted = Predicted()
    predicted.add(run.recorder.account(_setup_calls(run, plan, part_bytes)))
    net = DistributedSparseNet(weights, part, run, plan=plan, dtype=dtype, executor=executor)
    net.set_challenge(bias, CHALLENGE_YMAX)
    records = plan.tagged_calls(run.topo.placement, cfg.batch_size, dtype.itemsize,
                                interval="infer", samples=n_in)
    program = infer_program(records, plan.num_layers, len(batches(n_in, cfg.batch_size)),
                            run.topo.placement, run.rank, overlap=run.recorder.overlap,
                            receives_first=net.receives_first)
    bind = _Inference(run, net, Y0, cfg.batch_size, dtype)
    executor.run_step(program, bind)
    nonzero = net.backend.asnumpy(bind.nonzero) if net.gpu else bind.nonzero
    predicted.add(run.recorder.account([c for c, _ in records]))
    elapsed = float(nonzero[-1])
    categories = np.flatnonzero(nonzero[:-1])
    nnz = sum(W.nnz for W in weights)
    edges_per_s = n_in * nnz / max(elapsed, 1e-12)
    result = {"num_inputs": n_in, "num_categories": int(categories.size),
              "edges_per_second": edges_per_s, "inference_seconds": elapsed,
              "partition_method": part.method, "partition_table1": plan.metrics.table1()}
    if cfg.categories:
        truth = read_categories(cfg.categories)
        result["categories_match"] = bool(np.array_equal(np.sort(truth), categories))
    if cfg.check:
        ref = challenge_inference_serial(weights, bias, CHALLENGE_YMAX, Y0)
        ref_cats = np.flatnonzero(np.diff(ref.indptr) > 0)
        result["serial_reference_match"] = bool(np.array_equal(ref_cats, categories))
    executor.verify()
    if run.recorder.program is not None:   # every interval's recording held to its program
        result["program_steps_verified"] = executor.steps_verified
    if cfg.write_categories and run.rank == 0:
        write_categories(cfg.write_categories, categories)
    out = run.finish(metrics=result, predicted=predicted.block())
    if run.rank == 0:
        print(f"inputs {n_in}  categories {categories.size}  edges/s {edges_per_s:.3e}  "
              f"({elapsed:.3f} s)")
        for k in ("categories_match", "serial_reference_match"):
            if k in result:
                print(f"{k}: {result[k]}")
        _print_traffic(out)
    return out


def _partition(args) -> dict:
    _require_cpu(args)
    cfg = from_args(PartitionConfig, args)
    run = start_run(args, system="sparse_sgd", method="partition", config=cfg, unit="step")
    if run.size != 1:
        raise ValueError("python -m sparse_sgd partition runs serially: start it without "
                         "mpiexec (or with -n 1)")
    t0 = time.perf_counter()
    weights, _, network = load_network(cfg, args.seed)
    load_s = time.perf_counter() - t0
    methods = METHODS if cfg.method == "both" else (cfg.method,)
    rows, parts = table1_rows(weights, cfg.parts, methods, cfg, seed=args.seed, network=network)
    source = f"read from {cfg.network_dir}" if cfg.network_dir else "generated (RadiX-Net)"
    print(f"network: {source}, {sum(W.nnz for W in weights)} connections, in {load_s:.2f} s; "
          "wall s / cpu s: the whole partitioning step")
    print(f"N={cfg.neurons} L={cfg.layers} P={cfg.parts}: per processor per layer, SpFF words "
          "and messages of one input vector (Table 1's convention); ff+bp: SpFF + SpBP words")
    print(format_table1(rows))
    by = {r["label"][0]: r for r in rows}
    if "H" in by and "R" in by:
        print("H/R ratios: " + "  ".join(
            f"{k} {by['H'][k] / by['R'][k]:.3f}" for k in ("avg_volume", "max_volume",
                                                          "avg_messages", "max_messages")
            if by["R"][k]))
    saved = parts.get("hypergraph") or parts["random"]
    path = Path(run.out) / "partition.npz"
    hmetis = Path(run.out) / "hmetis"
    if run.rank == 0:
        saved.save(path)
        print(f"saved the {saved.method} partition to {path} (train --partition-file)")
        if cfg.hmetis:
            save_hmetis(weights, saved, hmetis)
            print(f"wrote its hMetis files to {hmetis} (train --partition-file {hmetis})")
    table = [{k: v for k, v in r.items() if k != "metrics"} for r in rows]
    return run.finish(metrics={"table1": table, "partition_file": str(path),
                               "hmetis_dir": str(hmetis) if cfg.hmetis else None,
                               "partition_info": saved.info, "network_seconds": load_s})


def _generate(args) -> dict:
    cfg = from_args(GenerateConfig, args)
    run = start_run(args, system="sparse_sgd", method="generate", config=cfg, unit="step")
    out = Path(run.out)
    network = challenge_config(cfg.neurons, cfg.layers, permute=cfg.permute, seed=args.seed)
    weights = radixnet(network)
    Y0 = digits_dataset(cfg.neurons, cfg.threshold).features
    if cfg.num_inputs:
        Y0 = Y0[:cfg.num_inputs]
    ref = challenge_inference_serial(weights, CHALLENGE_BIAS[cfg.neurons], CHALLENGE_YMAX, Y0)
    cats = np.flatnonzero(np.diff(ref.indptr) > 0)
    if run.rank == 0:
        folder = write_challenge_network(out, weights)
        write_input_tsv(images_path(out, cfg.neurons), Y0)
        write_categories(categories_path(out, cfg.neurons, cfg.layers), cats)
        print(f"wrote {cfg.layers} layers to {folder}, {Y0.shape[0]} inputs and {cats.size} "
              f"categories to {out}")
    return run.finish(metrics={"layers": cfg.layers, "inputs": int(Y0.shape[0]),
                               "categories": int(cats.size)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparse_sgd",
                                     description="SpFF/SpBP sparse DNN training and inference")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="distributed SGD with SpFF + SpBP (Algs. 2-3)")
    add_dataclass_args(t, TrainConfig, "training")
    add_training_args(t, "step", progress_every=10)
    add_common_args(t)
    i = sub.add_parser("infer", help="H-SpFF inference with Graph Challenge semantics")
    add_dataclass_args(i, InferConfig, "inference")
    add_common_args(i)
    p = sub.add_parser("partition", help="Table 1: hypergraph vs random row partitions")
    add_dataclass_args(p, PartitionConfig, "partition")
    add_common_args(p)
    g = sub.add_parser("generate", help="write a challenge network, inputs and categories in "
                       "the challenge's folder layout to --out")
    add_dataclass_args(g, GenerateConfig, "generate")
    add_common_args(g)
    return parser


@main_guard
def main(argv=None):
    args = build_parser().parse_args(argv)
    {"train": _train, "infer": _infer, "partition": _partition,
     "generate": _generate}[args.command](args)
    return 0
