"""The clock's compute sources under load: load-independent compute.

Prints (not a test)::

    python bench/bench_clock.py [--part load,simload]

``load``
    A fixed NumPy workload (1 BLAS thread) timed alone and beside two busy-loop processes on the
    same cores, by wall time, per-thread CPU time (the ``cpu`` compute source) and process CPU
    time; ``loaded / alone`` per source (best of 5 repeats each).
``simload`` (``ddpload``: its ddp part only)
    ``dataparallel train --method ddp``, ``--method ssfusion`` and ``hsadmm train`` as 4 ranks
    (2 simulated nodes x 2) alone, beside two busy-loop processes, and beside a second
    concurrent 4-rank run of the same job (8 ranks on the cores), with the compute sources
    ``cpu``, ``calibrated`` and ``profile`` (replaying the profile the ``cpu`` alone run recorded
    with ``--compute-profile-out``): simulated seconds per step and ``loaded / alone``.
The wire-lab comparison (predicted vs measured time per step on shaped links, root only) is
``bench/bench_wirelab.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from substrate.testing import busy_loops

_WORK = r"""
import sys, time
from threadpoolctl import threadpool_limits
import numpy as np
threadpool_limits(1)
a = np.random.default_rng(0).standard_normal((160, 160))
res = {"wall": [], "thread": [], "process": []}
for rep in range(5):
    t = {k: 0.0 for k in res}
    for _ in range(40):
        w, th, pr = time.perf_counter(), time.thread_time(), time.process_time()
        b = a
        for _ in range(6):
            b = np.tanh(b @ a * 1e-2)
        t["wall"] += time.perf_counter() - w
        t["thread"] += time.thread_time() - th
        t["process"] += time.process_time() - pr
    for k in res:
        res[k].append(t[k])
print(" ".join(f"{k}={min(v)}" for k, v in res.items()))
"""


def _work(env) -> dict:
    out = subprocess.run([sys.executable, "-c", _WORK], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    return {kv.split("=")[0]: float(kv.split("=")[1]) for kv in out}


def part_load() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print(f"## load-independent compute ({len(os.sched_getaffinity(0))} cores; the box is "
          "shared with other jobs: numbers taken under load)")
    print(f"{'source':>10s} {'alone s':>10s} {'beside 2 busy s':>16s} {'loaded/alone':>13s}")
    alone = _work(env)
    with busy_loops(2):
        loaded = _work(env)
    for k in ("wall", "thread", "process"):
        print(f"{k:>10s} {alone[k]:10.4f} {loaded[k]:16.4f} {loaded[k] / alone[k]:13.3f}")


#: the 2 x 2 jobs of ``--part simload``: (module, arguments, flag of the step count)
SIM_JOBS = {
    "ddp": ("dataparallel", ["train", "--method", "ddp", "--eval-every", "1000000"], "--steps"),
    "ssfusion": ("dataparallel", ["train", "--method", "ssfusion", "--eval-every", "1000000"],
                 "--steps"),
    "hsadmm": ("hsadmm", ["train", "--method", "hsadmm", "--local-steps", "10"], "--iters"),
}
#: compute sources of ``--part simload`` (``profile`` replays the ``cpu`` alone run's profile)
SIM_SOURCES = ("cpu", "calibrated", "profile")


def _sim_cmd(system: str, steps: int, out: Path, extra: list[str]) -> list[str]:
    from runner.launch import launch_command

    module, args, flag = SIM_JOBS[system]
    return launch_command(4, module, [*args, flag, str(steps), "--ranks-per-node", "2",
                                      "--progress-every", "0", "--out", str(out), "--overwrite",
                                      *extra])


def _sim_jobs(cmds: list[list[str]], outs: list[Path]) -> list[tuple[float, str]]:
    """Run the jobs at the same time; per job (simulated seconds per step, compute source)."""
    from runner.launch import mpi_env

    procs = [subprocess.Popen(c, cwd=ROOT, env=mpi_env(4), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    res = []
    for p, c, out in zip(procs, cmds, outs):
        log, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"{' '.join(c)} exited {p.returncode}:\n{log[-3000:]}")
        s = json.loads((out / "summary.json").read_text())
        t = s["timing"]
        res.append((t["sim_s"] / t["steps"], s["timeline"]["compute_source"]))
    return res


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def part_sim_load(steps: dict[str, int], systems=("ddp", "ssfusion", "hsadmm")) -> None:
    """The target: the simulated step of the same 2 x 2 job (4 ranks,
    ``--ranks-per-node 2``) alone, beside two busy loops, and beside a second concurrent 4-rank
    run of the same job (8 ranks on the cores), for the compute sources ``cpu``, ``calibrated``
    and ``profile`` (the profile recorded once by the ``cpu`` alone run with
    ``--compute-profile-out``, which does not change that run's clock)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-timeline-"))
    cores = len(os.sched_getaffinity(0))
    print(f"\n## simulated step under load: 2 x 2 jobs (4 ranks, 1 BLAS thread each) on {cores} "
          "cores; seconds per step = summary timing sim_s / steps")
    for system in systems:
        n = steps[system]
        prof = tmp / f"{system}_profile.json"
        flags = {"cpu": ["--compute-source", "cpu"],
                 "calibrated": ["--compute-source", "calibrated"],
                 "profile": ["--compute-source", "profile", "--compute-profile", str(prof)]}
        rows: dict[str, dict] = {src: {} for src in SIM_SOURCES}
        print(f"\n### {system} ({n} {SIM_JOBS[system][2][2:]})")
        print("commands (OUT, and FILE the profile):")
        for src in SIM_SOURCES:
            extra = flags[src] + (["--compute-profile-out", "FILE"] if src == "cpu" else [])
            print("  " + " ".join(_sim_cmd(system, n, Path("OUT"), extra)).replace(str(prof),
                                                                                   "FILE"))
        for cond in ("alone", "busy", "8 ranks"):
            before = _load()
            with busy_loops(2 if cond == "busy" else 0):
                for src in SIM_SOURCES:
                    extra = list(flags[src])
                    if src == "cpu" and cond == "alone":
                        extra += ["--compute-profile-out", str(prof)]
                    jobs = 2 if cond == "8 ranks" else 1
                    outs = [tmp / f"{system}_{src}_{cond.replace(' ', '')}_{j}"
                            for j in range(jobs)]
                    got = _sim_jobs([_sim_cmd(system, n, o, extra) for o in outs], outs)
                    rows[src][cond] = [g[0] for g in got]
                    rows[src]["desc"] = got[0][1]
            print(f"  {cond}: load average before {before}, after {_load()}")
        print(f"{'source':>10s} {'alone s':>10s} {'beside 2 busy s':>16s} "
              f"{'8 ranks s (job 1, job 2)':>26s} {'busy/alone':>11s} {'8 ranks/alone':>14s}")
        for src, r in rows.items():
            a, b, c = r["alone"][0], r["busy"][0], r["8 ranks"]
            print(f"{src:>10s} {a:10.6f} {b:16.6f} {c[0]:12.6f}, {c[1]:12.6f} {b / a:11.3f} "
                  f"{max(c[0] / a, c[1] / a, key=lambda x: abs(x - 1)):14.3f}")
        print("  (8 ranks/alone: the job further from alone)")
        for src, r in rows.items():
            print(f"  {src}: {r['desc']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="load,simload",
                    help="comma list of load, simload (ddpload: its ddp part); the "
                         "wire-lab comparison is bench/bench_wirelab.py")
    ap.add_argument("--sim-steps", default="ddp=20,ssfusion=20,hsadmm=4",
                    help="steps (iterations for hsadmm) per simload job")
    ap.add_argument("--sim-systems", default="ddp,ssfusion,hsadmm")
    a = ap.parse_args()
    parts = a.part.split(",")
    if "load" in parts:
        part_load()
    if "simload" in parts or "ddpload" in parts:
        steps = {k: int(v) for k, v in (kv.split("=") for kv in a.sim_steps.split(","))}
        systems = ("ddp",) if "simload" not in parts else tuple(a.sim_systems.split(","))
        part_sim_load(steps, systems)


if __name__ == "__main__":
    main()
