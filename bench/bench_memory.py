"""Peak resident memory per rank of the real trainers at 8 ... 128 ranks (virtual nodes of 4).

Prints (not a test)::

    python bench/bench_memory.py [--ranks 8 32 64 128] [--systems hsadmm ddp]
                                 [--ranks-per-node 4] [--timeout 600] [--keep DIR]

Every run is ``python -m runner.launch -n NP --ranks-per-node R bench.rss_probe MODULE train
...`` (what ``./run_mpi.sh`` runs), so each rank executes the unmodified trainer and reports, at
exit, its peak resident set (``VmHWM`` of ``/proc/self/status``) through
:mod:`bench.rss_probe`.  Budgets are small (the digits CNN, ``--iters 1`` of H-SADMM with
``--local-steps 2``, ``--steps 2`` of DDP, per-rank batch 4), since memory, not accuracy, is
measured.  Each run is capped by ``--timeout`` seconds; a run that does not finish is reported as
such with what it reached.  "traffic" compares the measured (ledger) and predicted bytes in the
run's ``summary.json``.  The table lists per-rank VmHWM (min / median / max, MiB), the resident
set when the probe started (interpreter + mpi4py, median), the heavy modules found loaded at exit,
and the wall time of the whole launch.  Other processes on the machine do not change the memory
numbers, only the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SYSTEMS = {
    "hsadmm": ["hsadmm", "train", "--model", "cnn", "--iters", "1", "--local-steps", "2",
               "--batch-size", "4"],
    "ddp": ["dataparallel", "train", "--method", "ddp", "--model", "cnn", "--steps", "2",
            "--batch-size", "4"],
}


def run_one(system: str, np_: int, rpn: int, timeout: float, workdir: Path) -> dict:
    """Launch one run; per-rank records, traffic check and timing."""
    rss_dir = workdir / f"{system}_{np_}_rss"
    out_dir = workdir / f"{system}_{np_}_out"
    shutil.rmtree(rss_dir, ignore_errors=True)
    rss_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "runner.launch", "-n", str(np_), "--ranks-per-node",
           str(rpn), "bench.rss_probe", *SYSTEMS[system], "--out", str(out_dir), "--overwrite",
           "--progress-every", "0"]
    env = dict(os.environ, SPARDIST_RSS_DIR=str(rss_dir))
    t0 = time.perf_counter()
    # its own process group (setsid), so a run past the timeout is ended with every rank it started
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        tail = (stderr or stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        status, tail = f"timeout {timeout:.0f}s", []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
    wall = time.perf_counter() - t0
    recs = []
    for f in sorted(rss_dir.glob("rss.*.json")):
        for line in f.read_text().splitlines():
            recs.append(json.loads(line))
    traffic = "n/a"
    summary = out_dir / "summary.json"
    if summary.exists():
        t = json.loads(summary.read_text()).get("traffic", {})
        meas, pred = t.get("measured", {}), t.get("predicted", {})
        keys = [k for k in ("intra_node_bytes", "inter_node_bytes") if k in meas and k in pred]
        if keys:
            traffic = "yes" if all(meas[k] == pred[k] for k in keys) else "NO"
    return {"system": system, "np": np_, "status": status, "wall": wall, "recs": recs,
            "traffic": traffic, "tail": tail}


def _mib(kib: float) -> float:
    return kib / 1024.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 32, 64, 128])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per launch before it is ended (default 600)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep run directories here (default: a temporary directory)")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="spardist_mem_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"bench_memory: peak RSS per rank (VmHWM), digits CNN, virtual nodes of "
          f"{args.ranks_per_node}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'system':<7} {'ranks':>5} {'status':<13} {'reported':>8} {'min MiB':>8} "
          f"{'median':>7} {'max MiB':>8} {'start':>6} {'traffic m=p':>11} {'wall s':>7}  "
          "heavy modules loaded")
    for np_ in args.ranks:
        for system in args.systems:
            r = run_one(system, np_, args.ranks_per_node, args.timeout, workdir)
            hwm = [rec["vmhwm_kib"] for rec in r["recs"]]
            start = [rec["start_rss_kib"] for rec in r["recs"]]
            mods = sorted({m for rec in r["recs"] for m in rec.get("modules", [])})
            if hwm:
                stats = (f"{_mib(min(hwm)):8.1f} {_mib(statistics.median(hwm)):7.1f} "
                         f"{_mib(max(hwm)):8.1f} {_mib(statistics.median(start)):6.1f}")
            else:
                stats = f"{'-':>8} {'-':>7} {'-':>8} {'-':>6}"
            print(f"{system:<7} {np_:>5} {r['status']:<13} {len(hwm):>4}/{np_:<3} {stats} "
                  f"{r['traffic']:>11} {r['wall']:7.1f}  {','.join(mods) or '-'}", flush=True)
            if r["status"] != "ok" and r["tail"]:
                print("        " + "\n        ".join(r["tail"]))
    print(f"load average at end {os.getloadavg()[0]:.1f}; run directories in {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
