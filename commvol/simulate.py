"""``python -m commvol simulate --compute-profile FILE --node-map MAP [cost flags]``: how long
a recorded job's steps would take on another network or placement, without running it.

A run that recorded ``--compute-profile-out FILE`` holds every rank's program (what it computed
and communicated, in order).  ``simulate`` runs those programs together in simulated time
(:mod:`simulation.jobsim`: the exact collectives' messages, eager protocol, NIC links as
first-in-first-out queues or shared max-min fairly, compute charged from the profile), on the
placement and the cluster given here (``--cluster FILE|NAME``, or the two tiers of the cost
flags), and prints every step's length and the mean after the warm-up steps.  It starts no
MPI: a laptop answers "and on 8 nodes at 100 Gbit/s?" for a job recorded anywhere.  The wire
lab checks the same simulation against replays on shaped links.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from runner.options import add_cost_args, cost_from_args
from simulation.cluster import Cluster
from simulation.jobsim import JobSimOptions, simulate_profile
from simulation.profile import load_profile
from substrate.calls import Placement
from substrate.costmodel import CostModel
from substrate.options import add_dataclass_args, from_args
from substrate.results import atomic_write_bytes

__all__ = ["add_parser", "run", "simulate"]


def simulate(profile, node_map: str, network: CostModel | Cluster,
             options: JobSimOptions | None = None, *, skip: int = 1) -> dict:
    """The job simulation of ``profile`` (a path or a loaded profile) on ``node_map``
    (``--node-map`` syntax: ``block:R``, ``round-robin:R`` or a node per rank) and
    ``network`` (a cluster, or a cost model's two tiers)."""
    options = options or JobSimOptions()
    doc = profile if isinstance(profile, dict) else load_profile(profile)
    programs = doc.get("programs")
    if programs is None:
        raise ValueError(f"--compute-profile {doc.get('path')}: holds no programs (recorded by "
                         "an older spardist); record it again with "
                         "--compute-profile-out")
    placement = Placement.parse(node_map, len(programs))
    if skip < 0:
        raise ValueError(f"--skip {skip}: must be >= 0 warm-up steps")
    res = simulate_profile(doc, placement.node_of, network, **options.kwargs())
    steps = res["step_s"]
    if len(steps) <= skip:
        raise ValueError(f"--skip {skip}: the profile's programs hold {len(steps)} steps; pass "
                         f"--skip {max(0, len(steps) - 1)} or fewer")
    res.update(profile=str(doc.get("path")), node_map=node_map, skip=skip,
               mean_step_s=statistics.fmean(steps[skip:]))
    return res


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a recorded job's steps on any network and "
                       "placement (no MPI)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compute-profile", required=True, type=Path, metavar="FILE",
                   help="a profile written by --compute-profile-out (it holds the programs)")
    p.add_argument("--node-map", required=True, metavar="MAP",
                   help="the nodes of the ranks: block:R, round-robin:R or 0,0,1,1")
    add_cost_args(p)
    add_dataclass_args(p, JobSimOptions)
    p.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the mean "
                   "(default 1)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the result here "
                   "(refused if it exists)")
    p.set_defaults(func=run)


def run(args) -> None:
    if args.json is not None and args.json.exists():
        raise ValueError(f"--json {args.json}: already exists; choose a new file (results are "
                         "never overwritten)")
    options = from_args(JobSimOptions, args)
    network = options.network(cost_from_args(args))
    res = simulate(args.compute_profile, args.node_map, network, options, skip=args.skip)
    steps = ", ".join(f"{s * 1e3:.3f}" for s in res["step_s"])
    n = network.node
    print(f"job simulation of {res['profile']} on {args.node_map}, {network.name} (NICs "
          f"{n.nic_gbps:g} Gbit/s, {n.nic_latency_us:g} us, {options.link_sharing} links; "
          f"{n.fabric} {n.fabric_gbps:g} Gbit/s, {n.fabric_latency_us:g} us)")
    print(f"  steps (ms): {steps}")
    print(f"  mean step after {args.skip} warm-up: {res['mean_step_s'] * 1e3:.3f} ms; bytes "
          f"moved: inter-node {res['bytes']['inter']:.0f}, intra-node "
          f"{res['bytes']['intra']:.0f}")
    if args.json is not None:
        atomic_write_bytes(args.json, json.dumps(res, indent=2).encode())
