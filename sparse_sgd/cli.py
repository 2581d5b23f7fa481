"""``python -m sparse_sgd {train,infer,generate}``.

Run distributed as ``./run_mpi.sh -n 4 sparse_sgd train ...``
(= ``mpiexec -n 4 python -m mpi4py -m sparse_sgd train ...``).

``train`` checkpoints with ``--checkpoint-every N`` (every rank's rows of every W^k and b^k, the
partition, the mini-batch generator's state and the loss/accuracy history, after every N-th
iteration and at the end) and continues with ``--resume`` exactly as an uninterrupted run
(:class:`substrate.cli.RunCheckpoints`); rank 0 reports the iteration, loss, batch accuracy and
bytes so far every ``--progress-every`` iterations on stderr.
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

from partition.cli import partitioner_errors
from partition.metrics import partition_metrics
from partition.partitioners import PARTITIONERS, PRESETS, Partition, make_partition
from sparse_sgd.activations import ACTIVATIONS
from sparse_sgd.data import class_targets, digits_dataset, mnist_dataset
from sparse_sgd.distributed import PHASE_SPFF, DistributedSparseNet
from sparse_sgd.io import (read_categories, read_challenge_network, read_input_tsv,
                           write_categories, write_challenge_network, write_input_tsv)
from sparse_sgd.radixnet import (CHALLENGE_BIAS, CHALLENGE_YMAX, graph_challenge_network)
from sparse_sgd.serial import challenge_inference_serial
from sparse_sgd.traffic import TrafficPrediction, allreduce_phase, bcast_phase, p2p_phases
from substrate import add_common_args, main_guard, start_run
from substrate.cli import Progress, RunCheckpoints, add_training_args, check_range

__all__ = ["TrainConfig", "InferConfig", "main", "distribute_partition", "load_network"]

PHASE_PARTITION = "partition"
PHASE_LOSS = "loss"
PHASE_CATEGORIES = "categories"
NUM_CLASSES = 10


@dataclass(frozen=True)
class NetworkConfig:
    """Network and partition options shared by ``train`` and ``infer``."""

    neurons: int = 1024
    layers: int = 12
    partition: str = "hypergraph"
    partition_file: str | None = None
    preset: str = "default"
    epsilon: float = 0.01

    def __post_init__(self):
        if self.partition not in PARTITIONERS:
            raise ValueError(f"--partition must be one of {sorted(PARTITIONERS)}")
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        check_range("--epsilon", self.epsilon, ge=0, lt=1)


@dataclass(frozen=True)
class TrainConfig(NetworkConfig):
    """Configuration of ``sparse_sgd train`` (§6.1 defaults)."""

    batch: int = 32
    iterations: int = 100
    lr: float = 0.01
    activation: str = "sigmoid"
    init: str = "uniform"
    data: str = "digits"
    mnist_images: str | None = None
    mnist_labels: str | None = None
    threshold: float = 0.25
    permute: bool = True
    network_dir: str | None = None
    dtype: str = "float64"
    log_every: int = 10
    checkpoint_every: int = 0
    resume: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"--activation must be one of {sorted(ACTIVATIONS)}")
        if self.init not in ("uniform", "challenge"):
            raise ValueError("--init must be 'uniform' (U[-1, 1], §6.1) or 'challenge' (1/16)")
        for flag, value in (("--batch", self.batch), ("--iterations", self.iterations),
                            ("--log-every", self.log_every)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        check_range("--lr", self.lr, gt=0)
        check_threshold(self.threshold)
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got "
                             f"{self.checkpoint_every}")
        if self.data == "mnist" and not (self.mnist_images and self.mnist_labels):
            raise ValueError("--data mnist needs --mnist-images and --mnist-labels (IDX files)")
        if self.dtype not in ("float32", "float64"):
            raise ValueError("--dtype must be float32 or float64")


@dataclass(frozen=True)
class InferConfig(NetworkConfig):
    """Configuration of ``sparse_sgd infer`` (Graph Challenge semantics, §6.3)."""

    batch: int = 1000
    network_dir: str | None = None
    inputs: str | None = None
    num_inputs: int | None = None
    categories: str | None = None
    write_categories: str | None = None
    threshold: float = 0.25
    permute: bool = True
    dtype: str = "float32"
    check: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        check_threshold(self.threshold)


def check_threshold(threshold: float) -> None:
    """``--threshold``: pixels (scaled to [0, 1]) above it become 1."""
    check_range("--threshold", threshold, ge=0, lt=1)


def set_kernel_threads(run) -> int:
    """Give each rank's Numba kernels its share of the node's cores (cores / ranks on the node).

    Oversubscribed Numba thread pools spin against the MPI progress loops of the other ranks.
    """
    import numba  # noqa: PLC0415 - heavy, only where kernels run

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cores = os.cpu_count() or 1
    ranks_here = run.topo.intra.size if not getattr(run.topo, "virtual", False) else run.size
    n = max(1, min(numba.config.NUMBA_NUM_THREADS, cores // max(1, ranks_here)))
    numba.set_num_threads(n)
    return n


def load_network(neurons: int, layers: int, network_dir: str | None, permute: bool, seed: int):
    """Challenge network: generated (RadiX-Net, seeded) or read from ``n{N}-l{k}.tsv`` files."""
    if network_dir:
        return read_challenge_network(network_dir, neurons, layers), CHALLENGE_BIAS.get(
            neurons, -0.3)
    net = graph_challenge_network(neurons, layers, permute=permute, seed=seed)
    return net.weights, net.bias


def distribute_partition(run, weights, method: str, *, partition_file=None, seed=0,
                         preset="default", epsilon=0.01) -> tuple[Partition, int]:
    """Partition on rank 0 (or read ``partition_file`` everywhere) and broadcast the owners.

    Returns the partition and the number of bytes broadcast (0 when read from a file).
    """
    if partition_file:
        part = Partition.load(partition_file)
        if part.parts != run.size:
            raise ValueError(f"{partition_file} has {part.parts} parts; run with -n {part.parts} "
                             "or partition again for this rank count")
        part.check_network(weights)
        return part, 0
    sizes = [weights[0].shape[1]] + [W.shape[0] for W in weights]
    flat = np.empty(sum(sizes) + 1, dtype=np.float64)
    kw = {"preset": preset, "epsilon": epsilon} if method == "hypergraph" else {}
    if run.rank == 0:
        with partitioner_errors():
            part = make_partition(method, weights, run.size, seed=seed, **kw)
        flat[:-1] = np.concatenate(part.owners)
        flat[-1] = part.seconds
    run.world.bcast(flat, root=0, phase=PHASE_PARTITION)
    owners = np.split(flat[:-1].astype(np.int64), np.cumsum(sizes)[:-1])
    part = Partition(owners=tuple(owners), parts=run.size, method=method,
                     seconds=float(flat[-1]))
    return part, flat.nbytes


def _require_cpu(args) -> None:
    if getattr(args, "device", "cpu") != "cpu":
        raise ValueError("sparse_sgd runs on the CPU (SciPy sparse + Numba kernels); "
                         "use --device cpu")


#: configuration fields a resumed run may change (everything else must match the checkpoint)
RESUMABLE = ("iterations", "checkpoint_every", "resume", "log_every")


def _net_state(net: DistributedSparseNet, part: Partition, part_bytes: int) -> dict:
    """This rank's rows of every W^k and b^k and the partition, for a checkpoint."""
    state = {"partition/parts": np.int64(part.parts), "partition/method": part.method,
             "partition/seconds": np.float64(part.seconds),
             "partition/bytes": np.int64(part_bytes)}
    state.update({f"partition/owner_{k}": np.asarray(o) for k, o in enumerate(part.owners)})
    for k, mp in enumerate(net.maps):
        state[f"net/local_{k}"] = mp.W_local.data.copy()
        state[f"net/remote_{k}"] = mp.W_remote.data.copy()
        state[f"net/bias_{k}"] = net.b[k].copy()
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
    """Restore :func:`_net_state`'s weights and biases in place (same partition, same rows)."""
    for k, mp in enumerate(net.maps):
        mp.W_local.data[...] = state[f"net/local_{k}"]
        mp.W_remote.data[...] = state[f"net/remote_{k}"]
        net.b[k][...] = state[f"net/bias_{k}"]


def _train(args) -> dict:
    _require_cpu(args)
    cfg = TrainConfig(**{f: getattr(args, f) for f in TrainConfig.__dataclass_fields__})
    method = "hsgd" if cfg.partition == "hypergraph" else "sgd"  # the paper's names
    run = start_run(args, system="sparse_sgd", method=method, config=cfg)
    dtype = np.dtype(cfg.dtype)
    set_kernel_threads(run)
    weights, _ = load_network(cfg.neurons, cfg.layers, cfg.network_dir, cfg.permute, args.seed)
    if cfg.data == "mnist":
        ds = mnist_dataset(cfg.mnist_images, cfg.mnist_labels, cfg.neurons)
    else:
        ds = digits_dataset(cfg.neurons, cfg.threshold)
    if cfg.batch > ds.features.shape[0]:
        raise ValueError(f"--batch {cfg.batch} is larger than the {ds.name} data set "
                         f"({ds.features.shape[0]} images; a mini-batch draws without "
                         f"replacement): pass --batch {ds.features.shape[0]} or less")
    rng = np.random.default_rng([args.seed, 1])
    if cfg.init == "uniform":  # §6.1: U[-1, 1] on the fixed sparsity pattern, same on all ranks
        weights = [W.copy() for W in weights]
        for W in weights:
            W.data = rng.uniform(-1.0, 1.0, W.nnz)
    fingerprint = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE}
    ckpt = RunCheckpoints(run, every=cfg.checkpoint_every, fingerprint=fingerprint,
                          unit="iteration", flag="--iterations")
    batch_rng = np.random.default_rng([args.seed, 2])  # same mini-batches on every rank
    start, losses, accs, train_s = 0, [], [], 0.0
    if cfg.resume:
        start, state = ckpt.resume(cfg.iterations)
        part, part_bytes = _saved_partition(state)
        part.check_network(weights)
        batch_rng.bit_generator.state = json.loads(str(state["train/batch_rng"]))
        losses, accs = state["train/losses"].tolist(), state["train/accs"].tolist()
        train_s = float(state["train/train_s"])
    else:
        part, part_bytes = distribute_partition(run, weights, cfg.partition,
                                                partition_file=cfg.partition_file,
                                                seed=args.seed, preset=cfg.preset,
                                                epsilon=cfg.epsilon)
    metrics = partition_metrics(weights, part)
    with run.clock.compute():
        net = DistributedSparseNet(weights, part, run.world, activation=cfg.activation,
                                   dtype=dtype)
    if cfg.resume:
        _load_net_state(net, state)
    targets = class_targets(ds.labels, cfg.neurons, NUM_CLASSES)
    in_rows, out_rows = net.input_rows, net.output_rows
    out_class = out_rows % NUM_CLASSES
    class_size = np.bincount(np.arange(cfg.neurons) % NUM_CLASSES, minlength=NUM_CLASSES)
    red = np.zeros(1 + NUM_CLASSES * cfg.batch, dtype=np.float64)
    # wire bytes of one iteration (closed form, == measured: tested), for the progress report
    per_it = TrafficPrediction()
    for phase, e in p2p_phases(metrics, run.topo.node_of, batch=cfg.batch,
                               itemsize=dtype.itemsize, iterations=1).items():
        per_it.add(phase, e)
    per_it.add(PHASE_LOSS, allreduce_phase(red.size, red.itemsize, run.topo.node_of))
    per_it = per_it.as_dict()
    progress = Progress(run, total=cfg.iterations, unit="iteration",
                        every=getattr(args, "progress_every", 0), start=start)
    t0 = time.perf_counter()
    for it in range(start, cfg.iterations):
        idx = batch_rng.choice(ds.features.shape[0], size=cfg.batch, replace=False)
        with run.clock.compute():
            X0 = np.ascontiguousarray(ds.features[idx][:, in_rows].T, dtype=dtype)
            Y = np.ascontiguousarray(targets[idx][:, out_rows].T, dtype=dtype)
            loss_local = net.step(X0, Y, cfg.lr)
            red[0] = loss_local
            scores = np.zeros((NUM_CLASSES, cfg.batch))
            np.add.at(scores, out_class, net.X[-1])  # pre-update outputs of this batch
            red[1:] = scores.ravel()
        run.world.allreduce(red, "sum", phase=PHASE_LOSS)
        loss = float(red[0])
        pred = np.argmax(red[1:].reshape(NUM_CLASSES, cfg.batch) / class_size[:, None], axis=0)
        acc = float(np.mean(pred == ds.labels[idx]))
        losses.append(loss)
        accs.append(acc)
        if it % cfg.log_every == 0 or it == cfg.iterations - 1:
            run.log(iteration=it, loss=loss, batch_accuracy=acc)
        done = it + 1
        progress.update(done, loss=loss, batch_accuracy=acc,
                        inter_bytes=done * per_it["inter_node_bytes"],
                        total_bytes=done * (per_it["inter_node_bytes"]
                                            + per_it["intra_node_bytes"]))
        if ckpt.due(done, last=done == cfg.iterations):
            ckpt.save(done, {**_net_state(net, part, part_bytes),
                             "train/batch_rng": json.dumps(batch_rng.bit_generator.state),
                             "train/losses": np.array(losses), "train/accs": np.array(accs),
                             "train/train_s": train_s + time.perf_counter() - t0})
    progress.close()
    train_s += time.perf_counter() - t0
    pred = TrafficPrediction()
    for phase, e in p2p_phases(metrics, run.topo.node_of, batch=cfg.batch,
                               itemsize=dtype.itemsize, iterations=cfg.iterations).items():
        pred.add(phase, e)
    pred.add(PHASE_LOSS, allreduce_phase(red.size, red.itemsize, run.topo.node_of,
                                         calls=cfg.iterations))
    if part_bytes:
        pred.add(PHASE_PARTITION, bcast_phase(part_bytes, run.topo.node_of))
    nnz = sum(W.nnz for W in weights)
    tail = max(1, min(10, len(losses)))
    result = {"final_loss": losses[-1], "initial_loss": losses[0],
              "final_batch_accuracy": float(np.mean(accs[-tail:])),
              "loss_trajectory": losses, "iterations": cfg.iterations,
              "partition_method": part.method, "partition_seconds": part.seconds,
              "partition_table1": metrics.table1(),
              "train_seconds": train_s,
              "edges_per_second": 3 * nnz * cfg.batch * cfg.iterations / max(train_s, 1e-12)}
    if cfg.resume:
        result["resumed_from_iteration"] = start
    out = run.finish(metrics=result, predicted=pred.as_dict())
    if run.rank == 0:
        _print_traffic(out)
    return out


def _print_traffic(summary: dict) -> None:
    m, p = summary["traffic"]["measured"], summary["traffic"]["predicted"]
    print(f"{'phase':<12}{'measured bytes':>16}{'predicted bytes':>17}{'meas msgs':>11}"
          f"{'pred msgs':>11}")
    for ph in sorted(set(m["by_phase"]) | set(p["by_phase"])):
        a, b = m["by_phase"].get(ph, {}), p["by_phase"].get(ph, {})
        print(f"{ph:<12}{a.get('bytes', 0):>16d}{b.get('bytes', 0):>17d}"
              f"{a.get('messages', 0):>11d}{b.get('messages', 0):>11d}")
    tot_m = m["inter_node_bytes"] + m["intra_node_bytes"]
    tot_p = p["inter_node_bytes"] + p["intra_node_bytes"]
    print(f"{'total':<12}{tot_m:>16d}{tot_p:>17d}{m['messages']:>11d}{p['messages']:>11d}"
          f"   {'EQUAL' if (tot_m, m['messages']) == (tot_p, p['messages']) else 'DIFFERENT'}")


def _infer(args) -> dict:
    _require_cpu(args)
    cfg = InferConfig(**{f: getattr(args, f) for f in InferConfig.__dataclass_fields__})
    run = start_run(args, system="sparse_sgd", method=f"hspff_{cfg.partition}", config=cfg)
    dtype = np.dtype(cfg.dtype)
    set_kernel_threads(run)
    weights, bias = load_network(cfg.neurons, cfg.layers, cfg.network_dir, cfg.permute, args.seed)
    if cfg.inputs:
        Y0 = read_input_tsv(cfg.inputs, cfg.neurons, cfg.num_inputs)  # CSR, sliced per batch
    else:
        Y0 = digits_dataset(cfg.neurons, cfg.threshold).features
        if cfg.num_inputs:
            Y0 = Y0[:cfg.num_inputs]
    n_in = Y0.shape[0]
    part, part_bytes = distribute_partition(run, weights, cfg.partition,
                                            partition_file=cfg.partition_file, seed=args.seed,
                                            preset=cfg.preset, epsilon=cfg.epsilon)
    metrics = partition_metrics(weights, part)
    net = DistributedSparseNet(weights, part, run.world, dtype=dtype)
    in_rows = net.input_rows
    nonzero = np.zeros(n_in + 1, dtype=np.float64)  # categories, then the elapsed time
    batches = 0
    run.world.barrier(phase="sync")
    t0 = time.perf_counter()
    for s in range(0, n_in, cfg.batch):
        with run.clock.compute():
            block = Y0[s:s + cfg.batch][:, in_rows]
            block = block.toarray() if sp.issparse(block) else block
            X0 = np.ascontiguousarray(block.T, dtype=dtype)
            XL = net.infer_challenge(X0, bias, CHALLENGE_YMAX)
            nonzero[s:s + X0.shape[1]] = np.any(XL != 0, axis=0)
        batches += 1
    nonzero[-1] = time.perf_counter() - t0
    run.world.allreduce(nonzero, "max", phase=PHASE_CATEGORIES)  # any over ranks, slowest rank
    elapsed = float(nonzero[-1])
    categories = np.flatnonzero(nonzero[:-1])
    nnz = sum(W.nnz for W in weights)
    edges_per_s = n_in * nnz / max(elapsed, 1e-12)
    result = {"num_inputs": n_in, "num_categories": int(categories.size),
              "edges_per_second": edges_per_s, "inference_seconds": elapsed,
              "partition_method": part.method, "partition_table1": metrics.table1()}
    if cfg.categories:
        truth = read_categories(cfg.categories)
        result["categories_match"] = bool(np.array_equal(np.sort(truth), categories))
    if cfg.check:
        ref = challenge_inference_serial(weights, bias, CHALLENGE_YMAX, Y0)
        ref_cats = np.flatnonzero(np.diff(ref.indptr) > 0)
        result["serial_reference_match"] = bool(np.array_equal(ref_cats, categories))
    if cfg.write_categories and run.rank == 0:
        write_categories(cfg.write_categories, categories)
    pred = TrafficPrediction()
    for s in range(0, n_in, cfg.batch):
        b = min(cfg.batch, n_in - s)
        pred.add(PHASE_SPFF, p2p_phases(metrics, run.topo.node_of, batch=b,
                                        itemsize=dtype.itemsize, iterations=1,
                                        spbp=False)[PHASE_SPFF])
    pred.add(PHASE_CATEGORIES, allreduce_phase(n_in + 1, 8, run.topo.node_of))
    pred.add("sync", {"bytes": 0, "intra_bytes": 0, "inter_bytes": 0,
                      "messages": run.size * int(np.ceil(np.log2(run.size))) if run.size > 1
                      else 0})
    if part_bytes:
        pred.add(PHASE_PARTITION, bcast_phase(part_bytes, run.topo.node_of))
    out = run.finish(metrics=result, predicted=pred.as_dict())
    if run.rank == 0:
        print(f"inputs {n_in}  categories {categories.size}  edges/s {edges_per_s:.3e}  "
              f"({elapsed:.3f} s)")
        for k in ("categories_match", "serial_reference_match"):
            if k in result:
                print(f"{k}: {result[k]}")
        _print_traffic(out)
    return out


def _generate(args) -> None:
    """Write a generated challenge network, its inputs and the reference categories."""
    check_threshold(args.threshold)
    out = Path(args.dir)
    net = graph_challenge_network(args.neurons, args.layers, permute=args.permute, seed=args.seed)
    write_challenge_network(out, net.weights)
    Y0 = digits_dataset(args.neurons, args.threshold).features
    if args.num_inputs:
        Y0 = Y0[:args.num_inputs]
    write_input_tsv(out / f"sparse-images-{args.neurons}.tsv", Y0)
    ref = challenge_inference_serial(net.weights, net.bias, CHALLENGE_YMAX, Y0)
    cats = np.flatnonzero(np.diff(ref.indptr) > 0)
    write_categories(out / f"neuron{args.neurons}-l{args.layers}-categories.tsv", cats)
    print(f"wrote {args.layers} layers, {Y0.shape[0]} inputs, {cats.size} categories to {out}")


def _add_network_args(p) -> None:
    p.add_argument("--neurons", type=int, default=1024, choices=sorted(CHALLENGE_BIAS))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--no-permute", dest="permute", action="store_false",
                   help="RadiX-Net without the random row permutations")
    p.add_argument("--threshold", type=float, default=0.25,
                   help="pixel threshold of the binary input features")


def _add_partition_args(p) -> None:
    p.add_argument("--partition", choices=sorted(PARTITIONERS), default="hypergraph")
    p.add_argument("--partition-file", default=None,
                   help="partition saved by `python -m partition radixnet --save`")
    p.add_argument("--preset", choices=PRESETS, default="default", help="Mt-KaHyPar preset")
    p.add_argument("--epsilon", type=float, default=0.01, help="allowed imbalance (eq. 2)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparse_sgd",
                                     description="SpFF/SpBP sparse DNN training and inference")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="distributed SGD with SpFF + SpBP (Algs. 2-3)")
    _add_network_args(t)
    _add_partition_args(t)
    t.add_argument("--network-dir", default=None, help="read n{N}-l{k}.tsv instead of generating")
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--iterations", type=int, default=100)
    t.add_argument("--lr", type=float, default=0.01)
    t.add_argument("--activation", choices=sorted(ACTIVATIONS), default="sigmoid")
    t.add_argument("--init", choices=("uniform", "challenge"), default="uniform")
    t.add_argument("--data", choices=("digits", "mnist"), default="digits")
    t.add_argument("--mnist-images", default=None)
    t.add_argument("--mnist-labels", default=None)
    t.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    t.add_argument("--log-every", type=int, default=10,
                   help="iterations between metrics.jsonl lines (default %(default)s)")
    add_training_args(t, "iteration", progress_every=10)
    add_common_args(t)
    i = sub.add_parser("infer", help="H-SpFF inference with Graph Challenge semantics")
    _add_network_args(i)
    _add_partition_args(i)
    i.add_argument("--network-dir", default=None)
    i.add_argument("--inputs", default=None, help="input TSV (default: embedded digits)")
    i.add_argument("--num-inputs", type=int, default=None)
    i.add_argument("--categories", default=None, help="truth category file to compare with")
    i.add_argument("--write-categories", default=None)
    i.add_argument("--batch", type=int, default=1000)
    i.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    i.add_argument("--check", action="store_true", help="compare with the serial reference")
    add_common_args(i)
    g = sub.add_parser("generate", help="write a challenge network, inputs and categories")
    _add_network_args(g)
    g.add_argument("--dir", required=True)
    g.add_argument("--num-inputs", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    return parser


@main_guard
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "train":
        _train(args)
    elif args.command == "infer":
        _infer(args)
    else:
        _generate(args)
    return 0
