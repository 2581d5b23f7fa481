"""Data-parallel strategies side by side on 4 ranks (2 virtual nodes x 2), digits CNN.

    ./run_mpi.sh -n 4 --ranks-per-node 2 bench.bench_dataparallel [--epochs 8]

Per strategy (same model, shards, seed and data budget): bytes per step relative to DDP (total
and inter-node), test accuracy after the budget relative to DDP, modeled step time (measured
compute per step + modeled communication per step) at 10 and 100 Gbit/s inter-node bandwidth,
and, where the strategy reports it, its sparsification overhead per step.  Each variant runs once
per bandwidth; the compute column is the median of the two runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from mpi4py import MPI

from dataparallel import STRATEGIES
from dataparallel.train import build_parser, train

#: (label, method, extra flags)
VARIANTS = [
    ("ddp", "ddp", []),
    ("ddp hierarchical", "ddp", ["--allreduce", "hierarchical"]),
    ("topk 1%", "topk", []),
    ("pactrain", "pactrain", []),
    ("pactrain ternary", "pactrain", ["--ternary"]),
    ("sdp neuron 3/4", "sdp", []),
    ("sdp neuron 2/4, flop-matched", "sdp", ["--coverage", "2/4", "--flop-match"]),
    ("ssfusion selective", "ssfusion", []),
    ("ssfusion per-tensor", "ssfusion", ["--fusion", "per-tensor"]),
    ("ssfusion multi-tensor", "ssfusion", ["--fusion", "multi-tensor"]),
]
BANDWIDTHS = (10.0, 100.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=8.0)
    ap.add_argument("--ranks-per-node", type=int, default=None)
    args = ap.parse_args(argv)
    rank = MPI.COMM_WORLD.Get_rank()
    tmp = Path(tempfile.mkdtemp(prefix="bench_dp_")) if rank == 0 else None
    tmp = MPI.COMM_WORLD.bcast(tmp, root=0)
    rows = []
    for label, method, extra in VARIANTS:
        if method not in STRATEGIES:
            if rank == 0:
                print(f"(skipping {label}: strategy {method!r} not registered)")
            continue
        runs = {}
        for bw in BANDWIDTHS:
            argv_ = ["--method", method, "--epochs", str(args.epochs), "--inter-bw", str(bw),
                     "--out", str(tmp / f"{label.replace(' ', '_')}_{bw:g}"), *extra]
            if args.ranks_per_node:
                argv_ += ["--ranks-per-node", str(args.ranks_per_node)]
            runs[bw] = train(build_parser().parse_args(argv_))
        rows.append((label, runs))
    if rank != 0:
        return
    base = rows[0][1][BANDWIDTHS[-1]]
    steps = base["metrics"]["steps"]

    def per_step(s, key):
        return s["traffic"]["measured"][key] / s["metrics"]["steps"]

    base_total = per_step(base, "inter_node_bytes") + per_step(base, "intra_node_bytes")
    base_inter = per_step(base, "inter_node_bytes")
    base_acc = base["metrics"]["final_test_accuracy"]
    print(f"\n{base['topology']['world']} ranks as {base['topology']['nodes']} nodes x "
          f"{base['topology']['ranks_per_node']}, digits CNN, {steps} steps "
          f"({args.epochs:g} epochs), DDP: {base_total:,.0f} B/step, accuracy {base_acc:.4f}\n")
    print("| strategy | bytes/step vs DDP | inter-node bytes/step vs DDP | accuracy | "
          "accuracy vs DDP | step time @10 Gb/s (ms) | step time @100 Gb/s (ms) | "
          "sparsification overhead/step (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, runs in rows:
        s = runs[BANDWIDTHS[-1]]
        n = s["metrics"]["steps"]
        compute = statistics.median(r["timing"]["compute_s"] / n for r in runs.values())
        times = [1e3 * (compute + runs[bw]["timing"]["comm_modeled_s"] / n) for bw in BANDWIDTHS]
        total = per_step(s, "inter_node_bytes") + per_step(s, "intra_node_bytes")
        acc = s["metrics"]["final_test_accuracy"]
        over = s["metrics"].get("sparsify_s_per_step")
        print(f"| {label} | {total / base_total:.4f} | "
              f"{per_step(s, 'inter_node_bytes') / base_inter:.4f} | {acc:.4f} | "
              f"{acc / base_acc:.3f} | {times[0]:.2f} | {times[1]:.2f} | "
              f"{'' if over is None else f'{1e3 * over:.3f}'} |")


if __name__ == "__main__":
    main()
