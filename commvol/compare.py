"""The headline comparison (``./run_mpi.sh`` with no arguments): every system on the same model,
data, shards and topology, one table.

Runs under MPI (``python -m commvol.compare`` on 4 ranks as 2 virtual nodes x 2 by default):
H-SADMM and flat ADMM (``hsadmm train``) and the data-parallel strategies DDP, Top-K, PacTrain,
SDP and SSFusion (``dataparallel train``), each with its own defaults for the embedded digits CNN and the same data budget
(8 passes over each rank's shard: 8 ADMM iterations of one local epoch, or 8 epochs of
synchronous steps), writes every run to ``OUT/<method>/`` and prints
:func:`commvol.report.comparison_table` of the runs on rank 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpi4py import MPI

__all__ = ["SYSTEM_RUNS", "main"]


def _hsadmm(method):
    def run(argv):
        from hsadmm.train import build_parser, train  # noqa: PLC0415

        return train(build_parser().parse_args(["--method", method, *argv]))
    return run


def _dataparallel(method):
    def run(argv):
        from dataparallel.train import build_parser, train  # noqa: PLC0415

        return train(build_parser().parse_args(["--method", method, *argv]))
    return run


#: method name -> runner taking the shared argv (``--out``, ``--ranks-per-node``, ...)
SYSTEM_RUNS = {"hsadmm": _hsadmm("hsadmm"), "flat-admm": _hsadmm("flat-admm"),
               **{m: _dataparallel(m) for m in ("ddp", "topk", "pactrain", "sdp", "ssfusion")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commvol.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results") / "headline",
                   help="one sub-directory per method (default %(default)s)")
    p.add_argument("--methods", nargs="+", default=list(SYSTEM_RUNS),
                   help=f"subset of {list(SYSTEM_RUNS)} (default: all)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="R")
    p.add_argument("--target", type=float, default=0.9,
                   help="accuracy for the simulated time-to-accuracy column")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true",
                   help="replace finished runs in OUT/<method> (otherwise a second comparison "
                        "into the same OUT stops before any work)")
    p.add_argument("--collectives", choices=("exact", "native"), default=None,
                   help="collectives mode of every run (default: $SPARDIST_COLLECTIVES or exact)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [m for m in args.methods if m not in SYSTEM_RUNS]
    if unknown:
        raise ValueError(f"--methods {unknown} unknown; valid: {list(SYSTEM_RUNS)}")
    rank = MPI.COMM_WORLD.Get_rank()
    shared = ["--seed", str(args.seed)]
    if args.ranks_per_node is not None:
        shared += ["--ranks-per-node", str(args.ranks_per_node)]
    if args.overwrite:
        shared.append("--overwrite")
    if args.collectives is not None:
        shared += ["--collectives", args.collectives]
    dirs = []
    for method in args.methods:
        t0 = time.perf_counter()
        out = args.out / method
        SYSTEM_RUNS[method]([*shared, "--out", str(out)])
        dirs.append(out)
        if rank == 0:
            print(f"spardist: {method} done in {time.perf_counter() - t0:.1f} s -> {out}",
                  flush=True)
    if rank == 0:
        from .report import comparison_table  # noqa: PLC0415

        print(comparison_table(dirs, target=args.target))
    return 0


if __name__ == "__main__":
    from substrate.cli import main_guard  # noqa: PLC0415

    sys.exit(main_guard(main)())
