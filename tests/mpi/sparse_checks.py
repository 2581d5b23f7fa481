"""MPI checks of distributed SpFF/SpBP against the serial SciPy reference and the plan.

Usage: ``python -m mpi4py sparse_checks.py MODE:METHOD[,MODE:METHOD...] RANKS_PER_NODE OUT``
(one launch runs the checks one after the other, each into ``OUT/MODE-METHOD``).  MODE ``train``: forward, backward (delta), weight and bias updates on 2 iterations for sigmoid
and ReLU equal :class:`SerialSparseNet` to 1e-5; every interval's calls are held against the
plan's records, message by message (:meth:`substrate.recorder.Recorder.account`), and the
ledger's bytes per phase and link class and messages equal the records', its SpFF bytes the
partition metrics' per-processor volumes.  MODE ``infer``: H-SpFF outputs and category set equal
the serial Graph Challenge reference, with the same ledger checks.  MODE ``mutant``:
``sparse_sgd train`` with a plan whose SpFF messages are one word short (an off-by-one in the
pair words): the run must stop at the first step's account (``differs from the plan``).
"""

import sys

import numpy as np

from partition.metrics import partition_metrics
from runner.options import CommonConfig
from runner.run import start_run
from sparse_sgd.cli import distribute_partition
from sparse_sgd.data import digits_dataset
from sparse_sgd.distributed import DistributedSparseNet
from sparse_sgd.plan import PHASE_LOSS, PHASE_SPFF, HSGDPlan
from sparse_sgd.radixnet import CHALLENGE_YMAX, graph_challenge_network
from sparse_sgd.serial import SerialSparseNet, challenge_inference_serial
from substrate import collective_check
from substrate.calls import Call, price
from substrate.ledger import Predicted

TOL = 1e-5


def _err(a, b):
    """Max abs difference relative to the reference scale (1e-5 means 1e-5 of max(1, |b|))."""
    b = np.asarray(b)
    if b.size == 0:
        return 0.0
    return float(np.abs(np.asarray(a) - b).max() / max(1.0, float(np.abs(b).max())))


class Books:
    """The plan's records of every interval, accounted as the run goes."""

    def __init__(self, run):
        self.run, self.records, self.predicted, self.problems = run, [], Predicted(), []

    def account(self, records, what):
        records = list(records)
        self.records += records
        try:
            self.predicted.add(self.run.recorder.account(records))
        except ValueError as e:
            self.problems.append(f"{what}: {e}")

    def check(self, metrics, per_iter_words):
        """Ledger == the records (bytes per phase and link class, messages) and the SpFF
        bytes == the partition metrics' per-processor volumes (independent of the plan)."""
        tot = self.run.ledger.totals(self.run.world)["by_phase"]
        want = self.predicted.block()["by_phase"]
        msgs = price(self.records, self.run.topo.placement).messages
        problems = list(self.problems)
        if set(tot) != set(want):
            problems.append(f"phases: ledger {sorted(tot)} != records {sorted(want)}")
        for ph, e in want.items():
            got = tot.get(ph, {})
            for f in ("intra_bytes", "inter_bytes"):
                if got.get(f) != e[f]:
                    problems.append(f"{ph}.{f}: ledger {got.get(f)} != records {e[f]}")
            if got.get("messages") != msgs.get(ph, 0):
                problems.append(f"{ph}.messages: ledger {got.get('messages')} != records "
                                f"{msgs.get(ph, 0)}")
        spff = tot.get(PHASE_SPFF, {}).get("bytes", 0)
        if spff != int(metrics.spff_volume.sum()) * per_iter_words:
            problems.append(f"spff bytes {spff} != metrics.spff_volume "
                            f"{int(metrics.spff_volume.sum())} x {per_iter_words}")
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
    plan = HSGDPlan.from_partition(weights, part)
    metrics = partition_metrics(weights, part)
    books = Books(run)
    books.account(plan.calls(run.topo.placement, 1, 8, interval="setup"), "setup")
    problems = []
    batches = []
    for act in ("sigmoid", "relu"):
        ser = SerialSparseNet(weights, biases, activation=act)
        dist = DistributedSparseNet(weights, part, run, plan=plan, biases=biases, activation=act)
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
            tot = run.world.allreduce(np.array([ld]), "sum", phase="check").result[0]
            # the step's records (this script all-reduces its own one-float "check", not the
            # trainer's loss vector)
            step = [c for c in plan.calls(run.topo.placement, B, 8) if c.phase != PHASE_LOSS]
            books.account([*step, Call("check", "allreduce", run.topo.placement.world, 8, 8,
                                       op="sum")], f"{act} it{it}")
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
    problems += books.check(metrics, sum(batches) * 8)
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
    plan = HSGDPlan.from_partition(net.weights, part)
    metrics = partition_metrics(net.weights, part)
    books = Books(run)
    books.account(plan.calls(run.topo.placement, 1, 8, interval="setup"), "setup")
    dist = DistributedSparseNet(net.weights, part, run, plan=plan, dtype=np.float64)
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
    # inference's records without the CLI's barrier and category all-reduce, and this script's
    spff = [c for c in plan.calls(run.topo.placement, 16, 8, interval="infer",
                                  samples=Y0.shape[0]) if c.phase == PHASE_SPFF]
    books.account([*spff, Call("check", "allreduce", run.topo.placement.world,
                               8 * Y0.shape[0], 8, op="max")], "inference")
    cats = np.flatnonzero(nonzero)
    ref_cats = np.flatnonzero(np.any(ref != 0, axis=1))
    if not np.array_equal(cats, ref_cats):
        problems.append(f"categories {cats.tolist()} != reference {ref_cats.tolist()}")
    if 5 in cats.tolist():
        problems.append("the empty image has a category")
    problems += books.check(metrics, sum(batches) * 8)
    collective_check(run.world, not problems, "; ".join(problems[:8]))
    if run.rank == 0:
        print(f"OK infer {method} P={run.size} categories {cats.size}/{Y0.shape[0]}")


def check_mutant(method, R, out):
    """``sparse_sgd train`` on a plan whose SpFF messages are one word short."""
    from sparse_sgd.cli import main

    words = HSGDPlan._words.func

    def short(self):
        out = []
        for ff, bp in words(self):
            ff = ff.copy()
            ff[:, 2] -= 1
            out.append((ff, bp))
        return tuple(out)

    HSGDPlan._words = property(short)
    main(["train", "--neurons", "1024", "--layers", "3", "--partition", method, "--steps", "2",
          "--batch-size", "4", "--ranks-per-node", str(R), "--out", out])


if __name__ == "__main__":
    specs, R, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    for spec in specs.split(","):
        mode, method = spec.split(":")
        {"train": check_train, "infer": check_infer, "mutant": check_mutant}[mode](
            method, R, f"{out}/{mode}-{method}")
