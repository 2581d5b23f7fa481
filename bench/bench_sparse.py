"""Sparse-SGD benchmarks (prints ratios measured side by side; not a test).

1. Local SpMM of one Graph Challenge layer with bias, ReLU and clamp fused (Numba) against SciPy
   ``csr @ dense`` (alone, and with the same NumPy epilogue); python-graphblas if importable.
2. Hypergraph partitioning time of N=1024, L=120, P=32 (paper, Table 3, PaToH: 2.48 s).
3. H/R ratios of the Table-1 metrics for N in {1024, 4096}, P in {8, 16, 32, 64}
   (paper, Table 1, N=1024: volume ratios 0.29-0.62).

``python bench/bench_sparse.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partition.metrics import partition_metrics  # noqa: E402
from partition.partitioners import (HypergraphConfig, hypergraph_partition,  # noqa: E402
                                    random_partition)
from sparse_sgd.kernels import challenge_layer  # noqa: E402
from sparse_sgd.radixnet import CHALLENGE_YMAX, graph_challenge_network  # noqa: E402



def _best(fn, repeat):
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def bench_spmm(neurons: int, batch: int, repeat: int) -> None:
    net = graph_challenge_network(neurons, 1, seed=0)
    A = net.weights[0].astype(np.float32)
    X = (np.random.default_rng(0).random((neurons, batch)) < 0.3).astype(np.float32)
    out = np.empty((neurons, batch), dtype=np.float32)
    edges = A.nnz * batch

    def fused():
        challenge_layer(A, X, net.bias, CHALLENGE_YMAX, out=out)

    def scipy_plain():
        return A @ X

    def scipy_epilogue():
        Z = A @ X
        nz = Z != 0
        Z[nz] += net.bias
        np.clip(Z, 0, CHALLENGE_YMAX, out=Z)
        return Z

    ref = scipy_epilogue()
    fused()
    assert np.allclose(out, ref, atol=1e-5), "fused kernel disagrees with SciPy"
    t_f, t_s, t_se = (_best(f, repeat) for f in (fused, scipy_plain, scipy_epilogue))
    print(f"[spmm] N={neurons} batch={batch} nnz={A.nnz} float32, threads={_threads()}")
    print(f"  numba fused (SpMM+bias+ReLU+clamp) {edges / t_f:.3e} edges/s")
    print(f"  scipy csr @ dense                  {edges / t_s:.3e} edges/s   "
          f"ratio fused/scipy = {t_s / t_f:.2f}x (target >= 1.0)")
    print(f"  scipy csr @ dense + numpy epilogue {edges / t_se:.3e} edges/s   "
          f"ratio fused/(scipy+epilogue) = {t_se / t_f:.2f}x")
    try:
        import graphblas as gb  # noqa: PLC0415
    except ImportError:
        print("  python-graphblas not importable: GraphBLAS comparison skipped")
        return
    Ag = gb.io.from_scipy_sparse(A)
    Xg = gb.Matrix.from_dense(X, missing_value=0)

    def graphblas():
        return (Ag @ Xg).new()

    t_g = _best(graphblas, repeat)
    print(f"  python-graphblas mxm               {edges / t_g:.3e} edges/s   "
          f"ratio fused/graphblas = {t_g / t_f:.2f}x")


def _threads() -> int:
    import numba  # noqa: PLC0415

    return numba.get_num_threads()


def bench_partition_time(layers: int, parts: int) -> None:
    W = graph_challenge_network(1024, layers, seed=0).weights
    hypergraph_partition(W[:1], parts)  # initialise Mt-KaHyPar outside the timing
    t = time.perf_counter()
    h = hypergraph_partition(W, parts, HypergraphConfig())
    dt = time.perf_counter() - t
    cores = len(os.sched_getaffinity(0))
    print(f"[partition time] N=1024 L={layers} P={parts}: {dt:.2f} s on {cores} cores "
          f"(paper, PaToH, L=120: 2.48 s; ratio paper/ours = {2.48 * layers / 120 / dt:.2f}x)")
    return h


def bench_ratios(neurons_list, parts_list, layers: int) -> None:
    print(f"[table 1 ratios] H/R per processor per layer, L={layers}")
    print(f"  {'N':>6} {'P':>4} {'vol avg':>8} {'vol max':>8} {'msg avg':>8} {'msg max':>8} "
          f"{'imb H':>6} {'imb R':>6} {'H s':>7}")
    for N in neurons_list:
        W = graph_challenge_network(N, layers, seed=0).weights
        for P in parts_list:
            h = hypergraph_partition(W, P, HypergraphConfig())
            r = random_partition(W, P, seed=0)
            th, tr = partition_metrics(W, h).table1(), partition_metrics(W, r).table1()
            rat = [th[k] / tr[k] for k in ("avg_volume", "max_volume", "avg_messages",
                                           "max_messages")]
            print(f"  {N:>6} {P:>4} " + " ".join(f"{x:>8.3f}" for x in rat)
                  + f" {th['imbalance']:>6.3f} {tr['imbalance']:>6.3f} {h.seconds:>7.2f}",
                  flush=True)
    print("  paper Table 1 (N=1024, L=120): volume ratio 0.29-0.62, message ratio 0.49-0.96")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="reduced set: L=24, N=1024 only, P in {8, 32}, fewer repeats")
    args = ap.parse_args(argv)
    if args.quick:
        bench_spmm(1024, 256, 5)
        bench_partition_time(24, 32)
        bench_ratios([1024], [8, 32], 24)
    else:
        bench_spmm(1024, 1024, 10)
        bench_spmm(4096, 1024, 5)
        bench_partition_time(120, 32)
        bench_ratios([1024, 4096], [8, 16, 32, 64], 120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
