"""A resumed run reuses the plan its timings decided; run with ``mpiexec -n 2``.

``python -m mpi4py resume_plan_checks.py OUT REPEATS`` trains SSFusion (selective
sparsification on Cupcake fusion buffers: both decided from the warm-up timings, max-reduced
over the ranks) REPEATS times on 2 virtual nodes of 1 rank: A, 6 steps in one go with
checkpoints after steps 3 and 6 (the plan was decided in step 2); B, a new ``--out`` holding
only A's checkpoints of step 3, resumed with ``--resume`` to step 6.  B must end exactly as A
but measured times: every rank's final checkpoint (parameters, residuals, momentum, the plan),
the metrics lines, the summary's traffic (bytes and messages per phase, measured and
predicted), the call log (count and chained digest of every call) and the metrics (test
accuracy, the selection and buffers the report lists).  A plan decided again on B's own timings
would differ from A's whenever the load moved them.

Prints ``OK plan repeat I`` per repeat and, last, ``PLANS N distinct of REPEATS`` (how many
different plans the timings gave A: more than one shows they are timing-derived) on rank 0.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dataparallel.train import build_parser, train
from substrate import collective_check

COMM = MPI.COMM_WORLD
#: checkpoint entries that hold measured times (or timings) and differ run to run
TIMED_KEYS = ("run/clock", "run/metrics", "loop/timing", "train/time_to_target",
              "strategy/stats", "strategy/profile", "strategy/offload_guard",
              "strategy/counts_prof")
TIMED_FIELDS = ("sim_s", "compute_s", "step_wall_s", "step_sim_s", "step_no_overlap_s",
                "eval_wall_s")
#: summary metrics that are measured times or timings
TIMED_METRICS = ("sim_s_to_target", "sparsify_s_per_step", "offload_worker_s_per_step",
                 "profile", "profile_s")
#: wall-clock compute times (they grow with the load) and a slow, high-latency link: the
#: costs the plan weighs are close, so the load moves the plan between runs now and then
ARGS = ["--method", "ssfusion", "--fusion", "selective", "--fusion-policy", "cupcake",
        "--profile-steps", "2", "--model", "mlp", "--arch", "hidden=64,64,32",
        "--compute-source", "wall", "--inter-bw", "10", "--inter-lat", "50",
        "--steps", "6", "--eval-every", "3", "--ranks-per-node", "1", "--progress-every", "0",
        "--checkpoint-every", "3"]


def _train(out: Path, *extra) -> dict:
    return train(build_parser().parse_args([*ARGS, "--out", str(out), *extra]))


def _lines(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in rec.items() if k not in TIMED_FIELDS} for rec in lines]


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in TIMED_METRICS}


def _differences(a: Path, b: Path, sa: dict, sb: dict) -> list[str]:
    """What differs between the runs in ``a`` and ``b`` on this rank (rank 0: the files too)."""
    rank = COMM.rank
    ckpt = f"checkpoints/ckpt-r{rank}-s00000006.npz"
    with np.load(a / ckpt) as x, np.load(b / ckpt) as y:
        differ = sorted(set(x.files) ^ set(y.files)) + [
            k for k in x.files if k in y.files and k not in TIMED_KEYS
            and not k.startswith("strategy/sums/")
            and not np.array_equal(x[k], y[k], equal_nan=x[k].dtype.kind == "f")]
    if rank == 0:
        if _lines(a) != _lines(b):
            differ.append("metrics lines")
        for key in ("traffic", "calls"):
            if sa[key] != sb[key]:
                differ.append(key)
        if _untimed(sa["metrics"]) != _untimed({k: v for k, v in sb["metrics"].items()
                                               if k != "resumed_from_step"}):
            differ.append("metrics")
    return differ


def main(root: Path, repeats: int) -> None:
    plans = set()
    for i in range(repeats):
        a, b = root / f"a{i}", root / f"b{i}"
        sa = _train(a)
        if COMM.rank == 0:
            (b / "checkpoints").mkdir(parents=True)
            for f in (a / "checkpoints").glob("ckpt-r*-s00000003.npz"):
                shutil.copy(f, b / "checkpoints" / f.name)
        COMM.barrier()
        sb = _train(b, "--resume")
        differ = _differences(a, b, sa, sb)
        collective_check(COMM, not differ, f"repeat {i}: rank {COMM.rank}: resumed run differs "
                                           f"in {differ}")
        if COMM.rank == 0:
            sel = sa["metrics"]["selection"]
            plans.add(json.dumps([sa["metrics"]["buffer_tensors"], sel["dense"], sel["k"],
                                  sel["split"]], sort_keys=True))
            print(f"OK plan repeat {i}", flush=True)
        if COMM.rank == 0:
            shutil.rmtree(a)
            shutil.rmtree(b)
        COMM.barrier()
    if COMM.rank == 0:
        print(f"PLANS {len(plans)} distinct of {repeats}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
