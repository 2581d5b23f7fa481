"""A resumed run equals an uninterrupted one (run with ``mpiexec -n 4``: 2 virtual nodes x 2).

``python -m mpi4py resume_checks.py dataparallel OUT`` trains every data-parallel method in this
process: A, 8 steps in one go; B, 8 steps that crash (an exception on every rank, as a killed
job: the in-progress metrics stay behind) in the 6th step after the checkpoint of step 5, then
``--resume`` (mid-epoch and mid-evaluation-interval); for ddp also C, crashed in the 7th step
after checkpoints 4 and 6, rank 1's newest checkpoint truncated, then ``--resume`` (falls back to
step 4, intact on every rank).  Every rank's final checkpoint (parameters, optimizer and strategy
state, ledger), the metrics lines and the summary's traffic of B and C equal A's, bit for bit,
but measured times.  ``--resume --steps 4`` after 8 steps is refused on every rank.

``python -m mpi4py resume_checks.py sparse OUT`` does A and B for ``sparse_sgd train``
(crash in the 5th iteration after the checkpoint of iteration 4; the hypergraph partition of
the checkpoint is kept); ``sparse-gpu`` the same with ``--device gpu`` (on the strict CuPy
stand-in: checkpoints written from host copies, restored onto the device).

Prints ``OK <name>`` per check on rank 0.
"""

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dataparallel.strategy import STRATEGIES
from dataparallel.train import build_parser as dp_parser
from dataparallel.train import train as dp_train
from sparse_sgd.cli import _train as sparse_train
from sparse_sgd.cli import build_parser as sparse_parser
from sparse_sgd.distributed import DistributedSparseNet
from substrate import collective_check

COMM = MPI.COMM_WORLD
#: checkpoint entries and metrics fields that hold measured times (differ run to run)
TIMED_KEYS = ("run/clock", "run/metrics", "loop/timing", "train/time_to_target",
              "strategy/stats", "partition/seconds")
TIMED_FIELDS = ("sim_s", "compute_s", "step_wall_s", "step_sim_s", "step_no_overlap_s",
                "eval_wall_s")
#: method -> its options in these runs
DP_METHODS = {
    "ddp": [],
    "topk": ["--density", "0.05"],
    "pactrain": ["--warmup-steps", "2", "--stable-window", "1", "--ternary"],
    "sdp": [],
    "ssfusion": ["--fusion", "per-tensor", "--profile-steps", "2", "--fusion-policy", "count"],
}


class Crash(Exception):
    """Stands for a job killed in the middle of a step."""


@contextlib.contextmanager
def crash_in(cls, name: str, calls: int):
    """Make ``cls.name`` raise :class:`Crash` on its ``calls``-th call (every rank alike)."""
    original = getattr(cls, name)
    count = [0]

    def patched(self, *args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise Crash(f"{cls.__name__}.{name} call {calls}")
        return original(self, *args, **kwargs)

    setattr(cls, name, patched)
    try:
        with contextlib.suppress(Crash):
            yield
    finally:
        setattr(cls, name, original)


def _lines(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in rec.items() if k not in TIMED_FIELDS} for rec in lines]


def _equal(x: np.ndarray, y: np.ndarray) -> bool:
    """Bit-for-bit equal arrays (NaN equals NaN: rank 0 alone evaluates the accuracy)."""
    return np.array_equal(x, y, equal_nan=x.dtype.kind == "f" and y.dtype.kind == "f")


def _same_run(a: Path, b: Path, step: int, name: str) -> None:
    """``b`` ended exactly as ``a``: every rank's checkpoint after ``step``, the metrics lines
    and the summary's traffic (collective)."""
    rank = COMM.rank
    ckpt = f"checkpoints/ckpt-r{rank}-s{step:08d}.npz"
    with np.load(a / ckpt) as x, np.load(b / ckpt) as y:
        differ = sorted(set(x.files) ^ set(y.files)) + [
            k for k in x.files if k in y.files and k not in TIMED_KEYS
            and not k.startswith(("strategy/sums/", "strategy/profile"))
            and not _equal(x[k], y[k])]
    collective_check(COMM, not differ, f"{name}: rank {rank} checkpoint differs in {differ}")
    ok, msg = True, ""
    if rank == 0:
        sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
        if _lines(a) != _lines(b):
            ok, msg = False, f"{name}: metrics lines differ"
        elif sa["traffic"] != sb["traffic"]:
            ok, msg = False, f"{name}: traffic differs: {sa['traffic']} vs {sb['traffic']}"
        elif sa["metrics"].get("final_test_accuracy") != sb["metrics"].get(
                "final_test_accuracy"):
            ok, msg = False, f"{name}: final accuracy differs"
    collective_check(COMM, ok, msg)


def _dp(method: str, out: Path, steps: int, *extra) -> None:
    dp_train(dp_parser().parse_args([
        "--method", method, *DP_METHODS[method], "--steps", str(steps), "--eval-every", "2",
        "--ranks-per-node", "2", "--progress-every", "0", "--out", str(out), *extra]))


def check_dataparallel(root: Path) -> None:
    for method, cls in ((m, STRATEGIES[m]) for m in DP_METHODS):
        a, b = root / f"{method}-a", root / f"{method}-b"
        _dp(method, a, 8, "--checkpoint-every", "3")
        with crash_in(cls, "after_step", 6):
            _dp(method, b, 8, "--checkpoint-every", "5")
        _dp(method, b, 8, "--checkpoint-every", "3", "--resume")
        _same_run(a, b, 8, method)
        if COMM.rank == 0:
            print(f"OK resume {method}", flush=True)
    # damaged newest checkpoint on one rank: fall back to the previous one intact everywhere
    a, c = root / "ddp-a", root / "ddp-c"
    with crash_in(STRATEGIES["ddp"], "after_step", 7):
        _dp("ddp", c, 8, "--checkpoint-every", "2")
    COMM.barrier()
    if COMM.rank == 1:
        newest = c / "checkpoints" / "ckpt-r1-s00000006.npz"
        newest.write_bytes(newest.read_bytes()[:1000])
    COMM.barrier()
    _dp("ddp", c, 8, "--checkpoint-every", "2", "--resume")
    _same_run(a, c, 8, "ddp fallback")
    aside = (c / "checkpoints" / "ckpt-r1-s00000006.npz.corrupt").is_file()
    collective_check(COMM, COMM.rank != 1 or aside, "the damaged checkpoint was not set aside")
    if COMM.rank == 0:
        print("OK resume fallback", flush=True)
    # fewer steps than already done: refused on every rank, nothing rewritten
    before = (a / "summary.json").read_bytes() if COMM.rank == 0 else b""
    try:
        _dp("ddp", a, 4, "--checkpoint-every", "3", "--resume")
        err = ""
    except ValueError as exc:
        err = str(exc)
    same = COMM.rank != 0 or (a / "summary.json").read_bytes() == before
    collective_check(COMM, "--steps 4 is smaller than the 8 steps already done" in err and same,
                     f"--resume --steps 4 after 8 steps: {err!r}")
    if COMM.rank == 0:
        print("OK resume refuses fewer steps", flush=True)


def _sparse(out: Path, every: int, *extra) -> None:
    sparse_train(sparse_parser().parse_args([
        "train", "--neurons", "1024", "--layers", "3", "--batch-size", "8",
        "--steps", "7", "--log-every", "2", "--ranks-per-node", "2",
        "--progress-every", "0", "--checkpoint-every", str(every), "--out", str(out), *extra]))


def check_sparse(root: Path, *device) -> None:
    a, b = root / "sparse-a", root / "sparse-b"
    _sparse(a, 3, *device)
    with crash_in(DistributedSparseNet, "target", 5):   # in the 5th step
        _sparse(b, 4, *device)
    _sparse(b, 3, "--resume", *device)
    _same_run(a, b, 7, "sparse_sgd")
    if COMM.rank == 0:
        sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
        ok = sa["metrics"]["loss_trajectory"] == sb["metrics"]["loss_trajectory"]
    else:
        ok = True
    collective_check(COMM, ok, "sparse_sgd: loss trajectories differ")
    if COMM.rank == 0:
        print(f"OK resume sparse_sgd{' on the GPU' if device else ''}", flush=True)


if __name__ == "__main__":
    {"dataparallel": check_dataparallel, "sparse": check_sparse,
     "sparse-gpu": lambda root: check_sparse(root, "--device", "gpu"),
     }[sys.argv[1]](Path(sys.argv[2]))
