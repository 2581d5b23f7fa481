"""The job simulation at scale: one step of every rank's program, generated from the plan
(:class:`commvol.job.Job`), simulated together (:class:`simulation.jobsim.JobSim`).

    PYTHONPATH=. python -m bench.bench_jobsim [--ranks 64 256 1024 4096] [--gpt-ranks 64]

Targets (one core): ResNet-152 DDP (25 MiB buckets) on PruneX's cluster at 1,024 ranks in
<= 30 s and <= 2 GiB, 4,096 ranks in <= 5 minutes; GPT-2-L SSFusion at 64 ranks in <= 30 s.

Every case runs in a process of its own, so that its memory is its own: the program build
(``Job``), the simulation's wall and CPU seconds, the process's peak resident memory and what
the simulation added to it (``ru_maxrss`` before and after), the messages (acknowledgements
included) and timers the compiled network counted.  The growth exponent is the slope of
log(CPU seconds) against log(ranks) between neighbouring sizes and over all of them (a ring
all-reduce moves ``2 (p - 1)`` messages a rank: 2 is the messages' own growth).  At 64 ranks the
Python loop (the reference) runs too, and the two results must be equal bit for bit.

The compiled network is Numba's: its first call in a fresh cache compiles it, later processes
load it from the cache; the first lines measure both (a 4-rank step in a cache directory of its
own).  The header and footer give the load average (the box is shared: CPU seconds are the
measure, wall seconds include waiting for a core).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

CASES = {"ddp": ("resnet152", "ddp", {"bucket_mib": 25.0}, "prunex-puhti", 32),
         "ssfusion": ("gpt2-large", "ssfusion", {}, "ssfusion-cloud-a100", 4)}


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(case: str, ranks: int, python: bool) -> dict:
    """One case in this process: ``{build_s, sim_s, cpu_s, rss_mib, sim_rss_mib, counts, ...}``."""
    from commvol.job import Job
    from commvol.specs import resolve_model
    from commvol.systems import get_system
    from commvol.workload import DeviceModel, units_for_spec
    from simulation.cluster import Cluster
    from simulation.jobsim import JobSim, JobSimOptions

    model, system, opts, cluster_name, batch = CASES[case]
    spec = resolve_model(model)
    units, _ = units_for_spec(spec, model)
    cluster = Cluster.load(cluster_name)
    P = cluster.node.devices
    options, _ = get_system(system).split(opts)
    t0 = time.perf_counter()
    job = Job(system, spec, ranks // P, P, options, units, DeviceModel(cluster.device), batch,
              steps=1)
    build = time.perf_counter() - t0

    def simulate(compiled):
        sim = JobSim(job.programs, job.placement.node_of, cluster, [job.charge] * ranks,
                     **JobSimOptions().kwargs())
        sim.compiled = compiled
        rss0, w0, c0 = _rss_mib(), time.perf_counter(), time.process_time()
        steps = sim.run()
        return sim, steps, {"sim_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
                            "sim_rss_mib": _rss_mib() - rss0}

    sim, steps, out = simulate(True)
    out.update(ranks=ranks, build_s=build, rss_mib=_rss_mib(), counts=sim.counts,
               step_s=max(s[-1] for s in steps))
    if python:
        ref, ref_steps, ref_out = simulate(False)
        out["python_cpu_s"] = ref_out["cpu_s"]
        out["equal"] = (ref_steps, ref.now, ref.moved, ref.ack_bytes) == \
            (steps, sim.now, sim.moved, sim.ack_bytes)
    return out


def _run_child(case: str, ranks: int, python: bool = False, env=None, timeout=None) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_jobsim", "--child", case, str(ranks)]
    if python:
        cmd.append("--python")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              check=True)
    except subprocess.TimeoutExpired:
        return {"ranks": ranks, "timeout": timeout}
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"bench_jobsim: {case} at {ranks} ranks failed:\n{err.stderr}") from err
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_times() -> None:
    """The 4-rank DDP step in a fresh Numba cache (compiles), then in a new process that
    loads the cache, then warm (the same process again)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        cold = _run_child("ddp", 4, env=env)
        cached = _run_child("ddp", 4, env=env)
    print(f"compiled network, 4-rank ResNet-152 DDP step: first call in a fresh cache "
          f"{cold['cpu_s']:.1f} s CPU ({cold['sim_s']:.1f} s wall; compiling), in a new process "
          f"loading the cache {cached['cpu_s']:.2f} s CPU", flush=True)


def _slope(a: dict, b: dict) -> float:
    return math.log(b["cpu_s"] / a["cpu_s"]) / math.log(b["ranks"] / a["ranks"])


def table(case: str, sizes: list[int], timeout: float) -> list[dict]:
    model, system = CASES[case][:2]
    print(f"\n{model} {system}, one step, {CASES[case][3]}", flush=True)
    print(f"{'ranks':>6} {'build s':>8} {'sim s':>8} {'CPU s':>8} {'peak MiB':>9} "
          f"{'sim MiB':>8} {'messages':>11} {'timers':>11} {'us/msg':>7}  step (sim.) s",
          flush=True)
    rows = []
    for p in sizes:
        r = _run_child(case, p, python=p <= 64, timeout=timeout)
        if "timeout" in r:
            print(f"{p:>6}  did not end within {timeout:.0f} s (wall)", flush=True)
            break
        c = r["counts"]
        print(f"{p:>6} {r['build_s']:>8.2f} {r['sim_s']:>8.2f} {r['cpu_s']:>8.2f} "
              f"{r['rss_mib']:>9.0f} {r['sim_rss_mib']:>8.0f} {c['messages']:>11,} "
              f"{c['timers']:>11,} {r['cpu_s'] / c['messages'] * 1e6:>7.2f}  {r['step_s']:.4f}",
              flush=True)
        if "python_cpu_s" in r:
            print(f"{'':>6} Python loop (reference): {r['python_cpu_s']:.2f} s CPU, results "
                  f"{'equal bit for bit' if r['equal'] else 'DIFFERENT'}", flush=True)
        rows.append(r)
    if len(rows) > 1:
        pairs = ", ".join(f"{a['ranks']}->{b['ranks']}: {_slope(a, b):.2f}"
                          for a, b in itertools.pairwise(rows))
        print(f"growth exponent of CPU seconds: {pairs}; {rows[0]['ranks']}->"
              f"{rows[-1]['ranks']}: {_slope(rows[0], rows[-1]):.2f}", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--gpt-ranks", type=int, nargs="*", default=[64])
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="wall seconds a case may take (default 1800)")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "RANKS"), help=argparse.SUPPRESS)
    ap.add_argument("--python", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.python)))
        return
    print(f"bench_jobsim: {time.strftime('%Y-%m-%d %H:%M')}, {_load()}, {os.cpu_count()} CPUs",
          flush=True)
    compile_times()
    table("ddp", args.ranks, args.timeout)
    if args.gpt_ranks:
        table("ssfusion", args.gpt_ranks, args.timeout)
    print(f"\n{_load()}", flush=True)


if __name__ == "__main__":
    main()
