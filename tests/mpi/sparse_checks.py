"""MPI checks of distributed SpFF/SpBP against the serial SciPy reference.

Usage: ``python -m mpi4py sparse_checks.py MODE METHOD RANKS_PER_NODE OUT``
MODE ``train``: forward, backward (delta), weight and bias updates on 2 iterations for sigmoid
and ReLU equal :class:`SerialSparseNet` to 1e-5, and the ledger's spff/spbp bytes and messages
equal the partition metrics exactly.  MODE ``infer``: H-SpFF outputs and category set equal the
serial Graph Challenge reference, and the spff ledger equals the metrics.
"""

import sys

import numpy as np

from partition.metrics import partition_metrics
from sparse_sgd.cli import distribute_partition
from sparse_sgd.data import digits_dataset
from sparse_sgd.distributed import DistributedSparseNet
from sparse_sgd.radixnet import CHALLENGE_YMAX, graph_challenge_network
from sparse_sgd.serial import SerialSparseNet, challenge_inference_serial
from sparse_sgd.traffic import p2p_phases
from substrate import CommonConfig, collective_check, start_run

TOL = 1e-5


def _err(a, b):
    """Max abs difference relative to the reference scale (1e-5 means 1e-5 of max(1, |b|))."""
    b = np.asarray(b)
    if b.size == 0:
        return 0.0
    return float(np.abs(np.asarray(a) - b).max() / max(1.0, float(np.abs(b).max())))


def _ledger_check(run, metrics, *, batch_sizes, itemsize, spbp):
    tot = run.ledger.totals(run.world)["by_phase"]
    problems = []
    expect = {}
    for b in batch_sizes:
        for ph, e in p2p_phases(metrics, run.topo.node_of, batch=b, itemsize=itemsize,
                                iterations=1, spbp=spbp).items():
            cur = expect.setdefault(ph, {"bytes": 0, "intra_bytes": 0, "inter_bytes": 0,
                                         "messages": 0})
            for f in cur:
                cur[f] += e[f]
    # independent of p2p_phases: the per-processor sums of the Table-1 metrics
    per_iter = sum(b * itemsize for b in batch_sizes)
    if expect["spff"]["bytes"] != int(metrics.spff_volume.sum()) * per_iter:
        problems.append("p2p_phases spff bytes disagree with metrics.spff_volume")
    for ph, e in expect.items():
        got = tot.get(ph, {"bytes": 0, "intra_bytes": 0, "inter_bytes": 0, "messages": 0})
        for f in e:
            if got[f] != e[f]:
                problems.append(f"{ph}.{f}: ledger {got[f]} != predicted {e[f]}")
    return problems


def check_train(method, R, out):
    run = start_run(CommonConfig(out=out, ranks_per_node=R), system="sparse_sgd",
                    method="check")
    rng = np.random.default_rng(7)
    weights = [W.copy() for W in graph_challenge_network(1024, 4, seed=3).weights]
    for W in weights:
        W.data = rng.uniform(-1, 1, W.nnz)
    biases = [rng.uniform(-0.1, 0.1, W.shape[0]) for W in weights]
    # ReLU on U[-1, 1] weights grows ~|W| per layer; errors are relative to each array's scale
    part, _ = distribute_partition(run, weights, method, seed=5)
    metrics = partition_metrics(weights, part)
    problems = []
    batches = []
    for act in ("sigmoid", "relu"):
        ser = SerialSparseNet(weights, biases, activation=act)
        dist = DistributedSparseNet(weights, part, run.world, biases=biases, activation=act)
        for it, B in enumerate((6, 3)):
            batches.append(B)
            X0 = (rng.random((1024, B)) < 0.4).astype(np.float64)
            Y = rng.random((1024, B))
            xs = ser.forward(X0)
            xd = dist.forward(X0[dist.input_rows])
            for k in range(1, len(weights) + 1):
                rows = dist.rows_of_layer(k)
                err = _err(dist.X[k], ser.X[k][rows])
                if err > TOL:
                    problems.append(f"{act} it{it} forward x^{k} err {err:.2e}")
            ls = ser.backward(Y, lr=0.1)
            ld = dist.backward(Y[dist.output_rows], lr=0.1)
            tot = run.world.allreduce(np.array([ld]), "sum", phase="check")[0]
            if abs(tot - ls) > TOL * max(1.0, abs(ls)):
                problems.append(f"{act} it{it} loss {tot} != {ls}")
            for k in range(2, len(weights) + 1):
                rows = dist.rows_of_layer(k - 1)
                err = _err(dist.delta[k - 1], ser.delta[k - 1][rows])
                if err > TOL:
                    problems.append(f"{act} it{it} delta^{k - 1} err {err:.2e}")
            for k in range(1, len(weights) + 1):
                rows = dist.rows_of_layer(k)
                Wd = dist.local_weights(k).tocsr()[rows].toarray()
                Ws = ser.W[k - 1][rows].toarray()
                err = _err(Wd, Ws)
                if err > TOL:
                    problems.append(f"{act} it{it} W^{k} err {err:.2e}")
                err = _err(dist.b[k - 1], ser.b[k - 1][rows])
                if err > TOL:
                    problems.append(f"{act} it{it} b^{k} err {err:.2e}")
            del xs, xd
    problems += _ledger_check(run, metrics, batch_sizes=batches, itemsize=8, spbp=True)
    collective_check(run.world, not problems, "; ".join(problems[:8]))
    if run.rank == 0:
        print(f"OK train {method} P={run.size}")


def check_infer(method, R, out):
    run = start_run(CommonConfig(out=out, ranks_per_node=R), system="sparse_sgd",
                    method="check")
    net = graph_challenge_network(1024, 6, seed=11)
    Y0 = digits_dataset(1024).features[:40].astype(np.float64)
    Y0[5] = 0.0  # an all-zero image stays out of the categories
    Y0[17, :] = 0.0
    Y0[17, :3] = 1.0  # a nearly empty one dies in the first layers
    part, _ = distribute_partition(run, net.weights, method, seed=5)
    metrics = partition_metrics(net.weights, part)
    dist = DistributedSparseNet(net.weights, part, run.world, dtype=np.float64)
    ref = challenge_inference_serial(net.weights, net.bias, CHALLENGE_YMAX, Y0).toarray()
    problems, batches = [], []
    nonzero = np.zeros(Y0.shape[0])
    for s in range(0, Y0.shape[0], 16):
        X0 = np.ascontiguousarray(Y0[s:s + 16][:, dist.input_rows].T)
        batches.append(X0.shape[1])
        XL = dist.infer_challenge(X0, net.bias, CHALLENGE_YMAX)
        err = _err(XL, ref[s:s + 16][:, dist.output_rows].T)
        if err > TOL:
            problems.append(f"batch {s}: output err {err:.2e}")
        nonzero[s:s + X0.shape[1]] = np.any(XL != 0, axis=0)
    run.world.allreduce(nonzero, "max", phase="check")
    cats = np.flatnonzero(nonzero)
    ref_cats = np.flatnonzero(np.any(ref != 0, axis=1))
    if not np.array_equal(cats, ref_cats):
        problems.append(f"categories {cats.tolist()} != reference {ref_cats.tolist()}")
    if 5 in cats.tolist():
        problems.append("the empty image has a category")
    problems += _ledger_check(run, metrics, batch_sizes=batches, itemsize=8, spbp=False)
    collective_check(run.world, not problems, "; ".join(problems[:8]))
    if run.rank == 0:
        print(f"OK infer {method} P={run.size} categories {cats.size}/{Y0.shape[0]}")


if __name__ == "__main__":
    mode, method, R, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    {"train": check_train, "infer": check_infer}[mode](method, R, out)
