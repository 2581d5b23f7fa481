"""H-SGD's GPU path (on the strict CuPy stand-in, or a GPU) against the CPU path and the
serial reference.

Usage: ``python -m mpi4py sparse_gpu_checks.py MODE METHOD RANKS_PER_NODE OUT`` with
``tests/strictcupy`` first on ``PYTHONPATH``.  MODE ``train``: two SpFF + SpBP iterations
(sigmoid and ReLU, two batch sizes) of a GPU net and a CPU net on the same run: forward
activations, deltas, weights, biases and loss equal within float64 round-off (1e-12 of each
array's scale) and the serial SciPy reference within 1e-5; both nets' calls are held against
the same plan records (so they are the same calls: sizes, tags, order), the ledger equals the
records, and the GPU path takes one host wait per layer and direction, not one per message.
MODE ``infer``: Graph Challenge inference outputs and categories equal the CPU net's and the
serial reference's.
"""

import sys

import cupy as cp
import numpy as np
from sparse_checks import TOL, Books, _err

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
from substrate.calls import Call

STRICT = hasattr(cp, "_strict")      # on the stand-in host waits are counted
ROUND = 1e-12 if STRICT else 1e-9     # cuSPARSE sums in another order than SciPy


def _host(a):
    return a.get() if isinstance(a, cp.ndarray) else np.asarray(a)


def check_train(method, R, out):
    run = start_run(CommonConfig(out=out, ranks_per_node=R, device="gpu"),
                    system="sparse_sgd", method="check")
    rng = np.random.default_rng(7)
    weights = [W.copy() for W in graph_challenge_network(1024, 4, seed=3).weights]
    for W in weights:
        W.data = rng.uniform(-1, 1, W.nnz)
    biases = [rng.uniform(-0.1, 0.1, W.shape[0]) for W in weights]
    part, _ = distribute_partition(run, weights, method, seed=5)
    plan = HSGDPlan.from_partition(weights, part)
    metrics = partition_metrics(weights, part)
    books = Books(run)
    books.account(plan.calls(run.topo.placement, 1, 8, interval="setup"), "setup")
    problems, batches = [], []
    L = len(weights)
    for act in ("sigmoid", "relu"):
        ser = SerialSparseNet(weights, biases, activation=act)
        cpu = DistributedSparseNet(weights, part, run, plan=plan, biases=biases, activation=act,
                                   device="cpu")
        gpu = DistributedSparseNet(weights, part, run, plan=plan, biases=biases, activation=act)
        if not gpu.gpu or cpu.gpu:
            problems.append("device selection: the GPU run's net is not on the GPU")
        for it, B in enumerate((6, 3)):
            X0 = (rng.random((1024, B)) < 0.4).astype(np.float64)
            Y = rng.random((1024, B))
            ser.forward(X0)
            ls = ser.backward(Y, lr=0.1)
            for net, name in ((cpu, "cpu"), (gpu, "gpu")):
                batches.append(B)
                syncs = cp._strict.syncs if STRICT else 0
                net.forward(X0[net.input_rows])
                ld = net.backward(Y[net.output_rows], lr=0.1)
                waits = cp._strict.syncs - syncs if STRICT else 0
                if name == "gpu":
                    # one wait per layer and direction for the sends (fewer where a layer
                    # sends nothing), none per message
                    if waits > 2 * L:
                        problems.append(f"{act} it{it}: {waits} host waits for {L} layers")
                    if not isinstance(ld, cp.ndarray):
                        problems.append("the GPU loss left the device")
                red = np.array([float(ld)])
                tot = run.world.allreduce(red, "sum", phase="check").result[0]
                step = [c for c in plan.calls(run.topo.placement, B, 8) if c.phase != PHASE_LOSS]
                books.account([*step, Call("check", "allreduce", run.topo.placement.world, 8, 8,
                                           op="sum")], f"{name} {act} it{it}")
                if abs(tot - ls) > TOL * max(1.0, abs(ls)):
                    problems.append(f"{name} {act} it{it} loss {tot} != serial {ls}")
            for k in range(1, L + 1):
                rows = cpu.rows_of_layer(k)
                err = _err(_host(gpu.X[k]), cpu.X[k])
                if err > ROUND:
                    problems.append(f"{act} it{it} x^{k} gpu vs cpu {err:.2e}")
                if _err(cpu.X[k], ser.X[k][rows]) > TOL:
                    problems.append(f"{act} it{it} x^{k} cpu vs serial")
                Wg = gpu.local_weights(k).tocsr()[rows].toarray()
                Wc = cpu.local_weights(k).tocsr()[rows].toarray()
                if _err(Wg, Wc) > ROUND:
                    problems.append(f"{act} it{it} W^{k} gpu vs cpu {_err(Wg, Wc):.2e}")
                if _err(gpu.host_biases()[k - 1], cpu.b[k - 1]) > ROUND:
                    problems.append(f"{act} it{it} b^{k} gpu vs cpu")
            for k in range(1, L):
                if _err(_host(gpu.delta[k]), cpu.delta[k]) > ROUND:
                    problems.append(f"{act} it{it} delta^{k} gpu vs cpu")
            sc = cpu.class_scores(cpu.output_rows % 10, 10)
            sg = gpu.class_scores(gpu.output_rows % 10, 10)
            if _err(_host(sg), sc) > ROUND:
                problems.append(f"{act} it{it} class scores gpu vs cpu")
    problems += books.check(metrics, sum(batches) * 8)
    collective_check(run.world, not problems, "; ".join(problems[:8]))
    if run.rank == 0:
        print(f"OK gpu train {method} P={run.size}")


def check_infer(method, R, out):
    run = start_run(CommonConfig(out=out, ranks_per_node=R, device="gpu"),
                    system="sparse_sgd", method="check")
    net = graph_challenge_network(1024, 6, seed=11)
    Y0 = digits_dataset(1024).features[:40].astype(np.float64)
    Y0[5] = 0.0
    part, _ = distribute_partition(run, net.weights, method, seed=5)
    plan = HSGDPlan.from_partition(net.weights, part)
    metrics = partition_metrics(net.weights, part)
    books = Books(run)
    books.account(plan.calls(run.topo.placement, 1, 8, interval="setup"), "setup")
    cpu = DistributedSparseNet(net.weights, part, run, plan=plan, dtype=np.float64, device="cpu")
    gpu = DistributedSparseNet(net.weights, part, run, plan=plan, dtype=np.float64)
    ref = challenge_inference_serial(net.weights, net.bias, CHALLENGE_YMAX, Y0).toarray()
    problems, batches = [], []
    nonzero = np.zeros(Y0.shape[0])
    outs = {}
    for name, d in (("cpu", cpu), ("gpu", gpu)):      # each over every batch, in turn
        for s in range(0, Y0.shape[0], 16):
            X0 = np.ascontiguousarray(Y0[s:s + 16][:, cpu.input_rows].T)
            batches.append(X0.shape[1])
            outs[name, s] = _host(d.infer_challenge(X0, net.bias, CHALLENGE_YMAX))
    for s in range(0, Y0.shape[0], 16):
        g, c = outs["gpu", s], outs["cpu", s]
        if _err(g, c) > ROUND:
            problems.append(f"batch {s}: gpu vs cpu {_err(g, c):.2e}")
        if _err(g, ref[s:s + 16][:, cpu.output_rows].T) > TOL:
            problems.append(f"batch {s}: gpu vs serial")
        nonzero[s:s + g.shape[1]] = np.any(g != 0, axis=0)
    run.world.allreduce(nonzero, "max", phase="check")
    spff = [c for c in plan.calls(run.topo.placement, 16, 8, interval="infer",
                                  samples=Y0.shape[0]) if c.phase == PHASE_SPFF]
    books.account([*spff, *spff, Call("check", "allreduce", run.topo.placement.world,
                                      8 * Y0.shape[0], 8, op="max")], "inference")
    cats = np.flatnonzero(nonzero)
    ref_cats = np.flatnonzero(np.any(ref != 0, axis=1))
    if not np.array_equal(cats, ref_cats):
        problems.append(f"categories {cats.tolist()} != reference {ref_cats.tolist()}")
    problems += books.check(metrics, sum(batches) * 8)
    collective_check(run.world, not problems, "; ".join(problems[:8]))
    if run.rank == 0:
        print(f"OK gpu infer {method} P={run.size} categories {cats.size}/{Y0.shape[0]}")


if __name__ == "__main__":
    mode, method, R, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    {"train": check_train, "infer": check_infer}[mode](method, R, out)
