"""Predicted vs measured step time on shaped links: one command, four systems.

Prints (not a test; root only)::

    python bench/bench_wirelab.py [--links 100,1000] [--shapes 2x1,2x2]
        [--systems ddp,ssfusion,hsadmm,sparse_sgd] [--repeat 3] [--nice -20] [--out DIR]

For every shape (emulated hosts x MPI ranks per host) and link rate, one wire lab
(:mod:`lab`, the package beside ``bench/``) is set up with every host link shaped by ``tbf`` to
the rate (this kernel has no ``sch_netem``: the latency is the unshaped link's own); alpha is
measured once by an MPI ping-pong on the lab, beta is the link rate as TCP payload
(:func:`lab.analysis.link_payload_gbps`); nothing is fitted per run.  Every system then runs
``--repeat`` times with that cost model and the ``cpu`` compute source (per-thread CPU time,
the default on a CPU), logging one ``metrics.jsonl`` line per step;
:func:`lab.analysis.compare_steps` takes the median over the steps (after the warm-up lines
below) of the predicted step (the job simulation of every rank's recorded steps on the cost
model's network, :mod:`simulation.jobsim`) over the measured ``step_wall_s``.  The table prints
the medians over the repeats.

The workloads are chosen so that communication, not CPU scheduling, dominates a step on the
shaped link (an earlier attempt with the 38k-parameter digits CNN measured 0.17 s per
step whatever the link: 4 ranks on 2 shared vCPUs):

``ddp``
    MLP 64-1024-1024-10 (1.13 M parameters, 4.5 MB of gradients), batch 32 per rank, 1 MiB
    buckets (5 buckets: the backward of the later layers overlaps the first buckets'
    all-reduce); one evaluation per step (not in the measured step: the trainer restarts the
    step's wall clock after it).
``topk``
    The same MLP, Top-K at density 0.01 (one all-gather of K values + indices per step).
``ssfusion``
    The same MLP, density 0.1 (DGC selection), 2 dense profiling steps (skipped with the
    first sparse step).
``hsadmm``
    H-SADMM on the digits CNN (38 k parameters; the trainer has no ``--arch``), 1 local SGD step
    per outer iteration: the 145 kB compact consensus all-reduce is 2/3 of an iteration at
    100 Mbit/s.
``sparse_sgd``
    H-SGD on a 1024-neuron, 4-layer Graph Challenge network, batch 128, ``--partition random``
    (random rows: most SpFF/SpBP messages cross hosts; 7.4 MB between the hosts per step).
``ddp_overlap`` (only with ``--systems``)
    ddp on an MLP 64-1024x4-10, batch 128: compute comparable to the transfer, so the
    overlap shows against the runs without it.
``ddp_off``, ``ddp_overlap_off`` (only with ``--systems``)
    The same runs with ``--overlap off``: every call blocks where it is issued (the measured
    no-overlap reference; the programs then record every call as blocking).

``--dilation K`` (with ``--replay``; time dilation as in DieCast, Gupta et al., NSDI 2006 and
2008): the lab's links run at rate / K and every replayed compute block sleeps K times its
profile time, so the whole run is the emulated one slowed K-fold while the box's CPU work per
message (MPI, Python, the bridge's forwarding) is not: 16-32 ranks on two vCPUs then behave as
hosts with cores of their own (``--dilate-timer-slack`` also sets the jobs' timer slack to
K x 50 us).  The measured step is divided by K
and the cost flags describe the emulated cluster (:func:`lab.analysis.cost_flags`).
``--dilation Cxranks`` takes K = C x the shape's ranks (one rule for a whole table).

With ``--replay`` the prediction is the job simulation of the replayed programs, which the
replay runs once when it finishes (``summary.json`` ``steps_max``): nothing but the recorded
calls runs between the replayed steps.

Ranks that wait in MPI sleep instead of spinning (:data:`lab.jobs.YIELD_ENV`), and the
MPI job runs at ``--nice`` (default -20; root): the measured step is then the link's and the
ranks' own, not the other jobs' on this box.  ``--tiny`` runs a seconds-long version (the test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root

import lab as wl

ROOT = Path(__file__).resolve().parents[1]

QUIET = ["--progress-every", "0"]


def workloads(steps: int, tiny: bool = False) -> dict:
    """``{system: {"args": [...], "skip": warm-up metrics lines}}`` (see the module docstring)."""
    if tiny:
        mlp = ["--model", "mlp", "--arch", "hidden=256", "--batch-size", "16"]
        return {
            "ddp": {"args": ["dataparallel", "train", "--method", "ddp", *mlp, "--steps",
                             str(steps), "--eval-every", "1", "--bucket-mib", "0.25", *QUIET],
                    "skip": 1},
            "sparse_sgd": {"args": ["sparse_sgd", "train", "--neurons", "1024", "--layers", "2",
                                    "--batch-size", "16", "--steps", str(steps),
                                    "--log-every", "1", *QUIET],
                           "skip": 1},
        }
    mlp = ["--model", "mlp", "--arch", "hidden=1024,1024", "--batch-size", "32"]
    return {
        "ddp": {"args": ["dataparallel", "train", "--method", "ddp", *mlp, "--steps", str(steps),
                         "--eval-every", "1", "--bucket-mib", "1", *QUIET],
                "skip": 2},
        "topk": {"args": ["dataparallel", "train", "--method", "topk", *mlp, "--density",
                          "0.01", "--steps", str(steps), "--eval-every", "1", *QUIET],
                 "skip": 2},
        "ssfusion": {"args": ["dataparallel", "train", "--method", "ssfusion", *mlp,
                              "--density", "0.1", "--profile-steps", "2",
                              "--steps", str(steps + 2), "--eval-every", "1", *QUIET],
                     "skip": 3},
        # not in the default set: compute comparable to communication, so the overlap shows
        # (the buckets are reduced on the communication thread while the backward goes on)
        "ddp_overlap": {"args": ["dataparallel", "train", "--method", "ddp", "--model", "mlp",
                                 "--arch", "hidden=1024,1024,1024,1024", "--batch-size", "128",
                                 "--steps", str(steps), "--eval-every", "1", "--bucket-mib", "1",
                                 *QUIET],
                        "skip": 2},
        # the same runs with every call blocking where it is issued: the measured no-overlap
        # reference of the two above
        "ddp_off": {"args": ["dataparallel", "train", "--method", "ddp", *mlp, "--steps",
                             str(steps), "--eval-every", "1", "--bucket-mib", "1",
                             "--overlap", "off", *QUIET],
                    "skip": 2},
        "ddp_overlap_off": {"args": ["dataparallel", "train", "--method", "ddp", "--model",
                                     "mlp", "--arch", "hidden=1024,1024,1024,1024",
                                     "--batch-size", "128", "--steps", str(steps),
                                     "--eval-every", "1", "--bucket-mib", "1", "--overlap",
                                     "off", *QUIET],
                            "skip": 2},
        "hsadmm": {"args": ["hsadmm", "train", "--model", "cnn", "--iters", str(steps),
                            "--local-steps", "1", *QUIET],
                   "skip": 2},
        "sparse_sgd": {"args": ["sparse_sgd", "train", "--neurons", "1024", "--layers", "4",
                                "--batch-size", "128", "--partition", "random",
                                "--steps", str(steps), "--log-every", "1", *QUIET],
                       "skip": 2},
    }


def replayed(loads: dict, tmp: Path, timeout: float) -> dict:
    """The workloads replayed (:mod:`runner.replay`): for every shape, one real run outside
    the lab records the compute profile and the ranks' programs (``--compute-profile-out``, on
    virtual nodes of the lab's block placement); the lab then runs the replay, whose ranks
    sleep their compute and communicate for real, so 16-32 ranks share two cores without
    their compute competing ("replayed compute")."""
    out = {}
    for name, w in loads.items():
        def args(hosts, rph, name=name, w=w):
            prof = tmp / f"{name}_{hosts}x{rph}.profile.json"
            if not prof.exists():
                n = hosts * rph
                cmd = [str(ROOT / "run_mpi.sh"), "-n", str(n), *w["args"], "--node-map",
                       f"block:{rph}", "--out", str(tmp / f"{name}_{hosts}x{rph}_recorded"),
                       "--overwrite", "--compute-profile-out", str(prof)]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                      timeout=timeout, check=False)
                if proc.returncode:
                    raise wl.LabError(f"recording {name} on {n} ranks failed: "
                                      f"{(proc.stderr or proc.stdout).strip()[-300:]}")
            return ["runner.replay", "--compute-profile", str(prof)]
        out[name] = {"args": args, "skip": w["skip"], "replay": True}
    return out


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            h, r = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise wl.LabError(f"--shapes {text!r}: write HOSTSxRANKS. Fix: e.g. --shapes "
                              "2x1,2x2") from None
        out.append((h, r))
    return out


def _links(text: str) -> list[tuple[float, float]]:
    """``--links`` (Mbit/s, comma list) -> unshaped-latency links, each checked like the lab's
    ``--link`` (:func:`lab.check_link`)."""
    example = "--links 100,1000"
    out = []
    for part in text.split(","):
        try:
            mbit = float(part)
        except ValueError:
            raise wl.LabError(f"--links {text!r}: write Mbit/s rates separated by commas. Fix: "
                              f"e.g. {example}") from None
        out.append(wl.check_link(mbit, 0.0, flag="--links", given=text, example=example))
    return out


def _dilation(text: str, replay: bool):
    """``--dilation``: a number K >= 1, or ``Cxranks`` (K = C x the shape's ranks, so every
    emulated rank gets the same share of the box per emulated second); only with ``--replay``.
    Returns K or ``K(hosts, ranks_per_host, mbit)``."""
    per_rank = text.endswith("xranks")
    try:
        k = float(text[:-len("xranks")] if per_rank else text)
    except ValueError:
        raise wl.LabError(f"--dilation {text!r}: give a number >= 1 or Cxranks. Fix: e.g. "
                          "--dilation 16 or --dilation 4xranks") from None
    if not (k > 0 if per_rank else k >= 1):
        raise wl.LabError(f"--dilation {text}: must be >= 1 (Cxranks: C > 0). Fix: e.g. "
                          "--dilation 16")
    if (per_rank or k != 1) and not replay:
        raise wl.LabError("--dilation slows only replayed compute: add --replay")
    if per_rank:
        return lambda hosts, rph, mbit: max(1.0, k * hosts * rph)
    return k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", default="100,1000",
                    help="link rates in Mbit/s, comma list (default %(default)s)")
    ap.add_argument("--shapes", default="2x1,2x2",
                    help="HOSTSxRANKS per host, comma list (default %(default)s)")
    ap.add_argument("--systems", default=None,
                    help="comma list of ddp, ssfusion, hsadmm, sparse_sgd, ddp_overlap, "
                         "ddp_off, ddp_overlap_off "
                         "(default: the first four; with --tiny: ddp, sparse_sgd)")
    ap.add_argument("--steps", type=int, default=12,
                    help="steps (iterations) per run (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per system (default 3)")
    ap.add_argument("--nice", type=int, default=-20,
                    help="niceness of the MPI jobs (default -20; 0 or more without root)")
    ap.add_argument("--no-yield", action="store_true",
                    help="let waiting MPI ranks spin (MPICH's default)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per MPI run")
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long check: ddp and sparse_sgd on small models (tests)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "wirelab_compare",
                    help="runs and compare.json go here (default %(default)s)")
    ap.add_argument("--replay", action="store_true",
                    help="run every workload as a replay of a recorded run: compute slept from "
                         "its profile, communication real (many ranks on few cores)")
    ap.add_argument("--dilation", default="1", metavar="K|Cxranks",
                    help="time dilation (with --replay): shape the links to 1/K of the rate, "
                         "sleep K x the compute, divide the measured step "
                         "by K (runner.replay; default 1); Cxranks: K = C x the shape's ranks")
    ap.add_argument("--dilate-timer-slack", action="store_true",
                    help="with --dilation K: also set the jobs' timer slack to K x 50 us (less "
                         "CPU burnt by waiting ranks, coarser MPI progress; see "
                         "lab.experiments.compare_systems)")
    ap.add_argument("--real-time-rto", action="store_true",
                    help="with --dilation K: keep TCP's minimum retransmission timeout at the "
                         "kernel's 200 ms (default: K x 200 ms, the timer in emulated time; see "
                         "lab.experiments.compare_systems)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the lab's MPI jobs (repeatable), e.g. "
                         "UCX_RNDV_THRESH=8192")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    extra_env = {}
    for item in a.env:
        key, eq, value = item.partition("=")
        if not eq or not key or not key.replace("_", "").isalnum():
            print(f"bench_wirelab: error: --env {item!r}: write KEY=VALUE. Fix: e.g. --env "
                  "UCX_RNDV_THRESH=8192", file=sys.stderr)
            return 2
        extra_env[key] = value
    try:
        dilation = _dilation(a.dilation, a.replay)
    except wl.LabError as exc:
        print(f"bench_wirelab: error: {exc}", file=sys.stderr)
        return 2
    loads = workloads(a.steps, a.tiny)
    names = a.systems.split(",") if a.systems else (
        list(loads) if a.tiny else ["ddp", "ssfusion", "hsadmm", "sparse_sgd"])
    unknown = sorted(set(names) - set(loads))
    if unknown:
        print(f"bench_wirelab: error: --systems: unknown {unknown}; choose from "
              f"{sorted(loads)}", file=sys.stderr)
        return 2
    loads = {n: loads[n] for n in names}
    if a.replay:
        (a.out / "profiles").mkdir(parents=True, exist_ok=True)
        loads = replayed(loads, a.out / "profiles", a.timeout)
    t0 = time.monotonic()
    try:
        links, shapes = _links(a.links), _shapes(a.shapes)
        print(f"# wire lab: predicted vs measured s/step; load average {os.getloadavg()}",
              flush=True)
        res = wl.compare_systems(loads, shapes=shapes, links=links, repeat=a.repeat,
                                 out_root=a.out, nice=a.nice,
                                 env={**({} if a.no_yield else wl.YIELD_ENV), **extra_env},
                                 timeout=a.timeout,
                                 verbose=a.verbose, progress=lambda s: print(s, flush=True),
                                 dilation=dilation,
                                 dilate_timer_slack=a.dilate_timer_slack,
                                 dilate_rto=not a.real_time_rto)
    except wl.LabError as exc:
        print(f"bench_wirelab: error: {exc}", file=sys.stderr)
        return 2
    except wl.LabInterrupted as exc:
        print(f"{exc}; everything torn down", file=sys.stderr)
        return 128 + exc.signum
    res["settings"] = {"links_mbit": [m for m, _ in links], "shapes": shapes,
                       "steps": a.steps, "repeat": a.repeat, "nice": a.nice,
                       "yield_env": None if a.no_yield else wl.YIELD_ENV,
                       "extra_env": extra_env,
                       "replay": a.replay, "dilation": a.dilation,
                       "dilate_timer_slack": a.dilate_timer_slack,
                       "dilate_rto": not a.real_time_rto,
                       "workloads": {n: {"args": w["args"] if not callable(w["args"]) else
                                         "replay of a recorded run", "skip": w["skip"]}
                                     for n, w in loads.items()},
                       "wall_s": time.monotonic() - t0}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "compare.json").write_text(json.dumps(res, indent=2) + "\n")
    for lab in res["labs"]:
        lk = lab["link"]
        k = lab["time_dilation"]
        dil = "" if k == 1 else (f" emulating {lab['emulated_mbit']:g} Mbit/s at time "
                                 f"dilation {k:g}")
        print(f"# lab {lab['hosts']} x {lab['ranks_per_host']}, {lk['mbit']:g} Mbit/s{dil} "
              f"({lk['qdisc']}, latency applied {lk['latency_us_applied']:g} us): alpha "
              + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in lab["alpha_s"].items())
              + f"; cost flags {' '.join(lab['cost_flags'])}")
    print(wl.format_comparison(res))
    print(f"# wrote {a.out / 'compare.json'} ({res['settings']['wall_s']:.0f} s; load average "
          f"{os.getloadavg()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
