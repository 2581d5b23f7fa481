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

import dataparallel.train as dp_train
import hsadmm.train as admm_train
from runner.errors import main_guard
from runner.options import CommonConfig, add_common_args
from substrate.options import flag_of

from .report import comparison_table

__all__ = ["SYSTEM_RUNS", "main"]


def _runner(trainer, method):
    def run(argv):
        return trainer.train(trainer.build_parser().parse_args(["--method", method, *argv]))
    return run


def _hsadmm(method):
    return _runner(admm_train, method)


def _dataparallel(method):
    return _runner(dp_train, method)


#: method name -> runner taking the shared argv (``--out``, ``--ranks-per-node``, ...)
SYSTEM_RUNS = {"hsadmm": _hsadmm("hsadmm"), "flat-admm": _hsadmm("flat-admm"),
               **{m: _dataparallel(m) for m in ("ddp", "topk", "pactrain", "sdp", "ssfusion")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commvol.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(SYSTEM_RUNS),
                   help=f"subset of {list(SYSTEM_RUNS)} (default: all)")
    p.add_argument("--target", type=float, default=0.9,
                   help="accuracy for the simulated time-to-accuracy column")
    add_common_args(p)
    p.set_defaults(out=Path("results") / "headline")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [m for m in args.methods if m not in SYSTEM_RUNS]
    if unknown:
        raise ValueError(f"--methods {unknown} unknown; valid: {list(SYSTEM_RUNS)}")
    rank = MPI.COMM_WORLD.Get_rank()
    # every shared option (seed, topology, collectives, device, cost model, --overwrite) is
    # handed to each run as given; --out becomes OUT/<method>
    shared = []
    for f in CommonConfig.__dataclass_fields__.values():
        value = getattr(args, f.name)
        if f.name == "out" or value is None or value == f.default:
            continue
        flag = flag_of(CommonConfig, f.name)
        shared += [flag] if isinstance(value, bool) else [flag, str(value)]
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
        print(comparison_table(dirs, target=args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main_guard(main)())
