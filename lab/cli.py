"""``python -m lab``: run a spardist command across emulated hosts and compare the bytes that
really crossed between them with the ledger's (and, with ``--compare-steps``, the time per
step with the job simulation's).

    python -m lab --hosts H --ranks-per-host R [--link MBIT,LATENCY_US] [--out DIR]
        [--launch mpiexec|run_mpi] -- MODULE ARGS...
    python -m lab --compare-steps OUT [--skip N]          # offline, no root
    python -m mpi4py -m lab --idle | --sendrecv N | --pingpong ...   # the in-lab programs

Every refusal is one line on stderr, ``lab: error: ...`` naming the option, the value and the
fix, with exit status 2; nothing is created before the options are checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .analysis import compare_steps, format_steps, format_table
from .experiments import run_lab
from .jobs import DEFAULT_TIMEOUT, YIELD_ENV
from .netns import LabError, LabInterrupted
from .programs import run_program

__all__ = ["main"]

PROG = "python -m lab"


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (the option, the value, where the options are listed)."""

    def error(self, message: str):
        self.exit(2, f"lab: error: {message} (see {self.prog} --help)\n")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(
        prog=PROG,
        description="Run a spardist command across emulated hosts (network + UTS namespaces on "
                    "this machine, MPICH over TCP on veth links) and compare the bytes that "
                    "really crossed between hosts with the ledger's. Root only.",
        epilog=f"example: {PROG} --hosts 2 --ranks-per-host 2 -- "
               "dataparallel train --method ddp --steps 6")
    p.add_argument("--hosts", type=int, required=True, help="emulated hosts (2 .. 250)")
    p.add_argument("--ranks-per-host", type=int, required=True, help="MPI ranks on each host")
    p.add_argument("--link", default=None, metavar="MBIT,LATENCY_US",
                   help="shape every link with tc: rate in Mbit/s (1 .. 10000), one-way latency "
                        "in us (0 .. 1000000; needs sch_netem), e.g. --link 1000,50")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory of the run (its summary.json and wire.json); default "
                        "results/wirelab/<module>_<method>_<H>x<R>")
    p.add_argument("--launch", choices=("mpiexec", "run_mpi"), default="mpiexec",
                   help="plain hydra mpiexec, or the project's launcher (python -m "
                        "runner.launch, what run_mpi.sh runs) with SPARDIST_LAUNCHER set to "
                        "the same hydra command")
    p.add_argument("--netmod", choices=("ucx", "ofi"), default="ucx",
                   help="MPICH network module, both over TCP (default ucx)")
    p.add_argument("--offload", choices=("off", "on"), default="off",
                   help="segmentation offload on the veth links (default off: TSO/GSO off, GRO "
                        "on)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds allowed for each MPI run (default %(default)s)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the MPI job (repeatable)")
    p.add_argument("--yield", dest="yield_", action="store_true",
                   help="waiting MPI ranks sleep instead of spinning (MPICH's "
                        "MPIR_CVAR_CH4_PROGRESS_THROTTLE): for more ranks than cores")
    p.add_argument("--nice", type=int, default=None,
                   help="run the MPI job at this niceness (-20 .. 19): a timing run gets the "
                        "cores before the box's other jobs")
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUT/wire.json (and pass --overwrite to the command "
                        "when OUT already holds its summary.json)")
    p.add_argument("--calibrate-cost", action="store_true",
                   help="ping-pong on the lab first and pass the cost model to the command: "
                        "--inter-bw from --link (TCP payload rate), --inter-lat/--intra-lat "
                        "(and --intra-bw) from the ping-pong")
    p.add_argument("--compare-steps", action="store_true",
                   help="after the run, compare predicted and measured time per step from its "
                        "metrics.jsonl (step_wall_s) and write OUT/steps.json")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("module_args", nargs=argparse.REMAINDER,
                   help="-- MODULE ARGS... (the spardist command)")
    ns = p.parse_args(argv)
    if ns.module_args and ns.module_args[0] == "--":
        ns.module_args = ns.module_args[1:]
    if not ns.module_args:
        p.error("give the command after --, e.g. -- dataparallel train --method ddp")
    return ns


def _compare_offline(argv: list[str]) -> int:
    """``--compare-steps OUT [--skip N]``: read a finished run's metrics.jsonl (no root)."""
    p = _Parser(prog=f"{PROG} --compare-steps", description="predicted vs measured time per "
                "step of a finished run (its metrics.jsonl)")
    p.add_argument("out", type=Path, help="the run's results directory")
    p.add_argument("--skip", type=int, default=1,
                   help="warm-up lines left out of the medians (default %(default)s)")
    a = p.parse_args(argv[1:])
    if a.skip < 0:
        p.error(f"argument --skip: must be >= 0, got {a.skip}")
    r = compare_steps(a.out, skip=a.skip)
    print(format_steps(r))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = run_program(argv)
    if rc is not None:
        return rc
    try:
        if argv[:1] == ["--compare-steps"] and len(argv) >= 2 and not argv[1].startswith("-"):
            return _compare_offline(argv)
        ns = _parse(argv)
        env = dict(YIELD_ENV) if ns.yield_ else {}
        for kv in ns.env:
            if "=" not in kv:
                raise LabError(f"--env {kv!r}: write KEY=VALUE, e.g. --env "
                               "SPARDIST_COLLECTIVES=native")
            k, v = kv.split("=", 1)
            env[k] = v
        result = run_lab(ns.hosts, ns.ranks_per_host, ns.module_args, link=ns.link,
                         launch=ns.launch, out=ns.out, timeout=ns.timeout, force=ns.force,
                         netmod=ns.netmod, offload=ns.offload == "on", env=env,
                         verbose=ns.verbose, calibrate_cost=ns.calibrate_cost,
                         compare=ns.compare_steps, nice=ns.nice)
    except LabError as exc:
        print(f"lab: error: {exc}", file=sys.stderr)
        return 2
    except LabInterrupted as exc:
        print(f"{exc}; everything torn down", file=sys.stderr)
        return 128 + exc.signum
    print(format_table(result))
    if result.get("pingpong"):
        for link, v in result["pingpong"]["links"].items():
            bw = v.get("bandwidth_gbps")
            print(f"  ping-pong {link}: alpha {v['alpha_s'] * 1e6:.1f} us"
                  + (f", {bw:.3f} Gbit/s" if bw else ""))
    if result.get("steps"):
        print(format_steps(result["steps"]))
    return 0
