"""``python -m commvol simulate --compute-profile FILE --node-map MAP [cost flags]``: how long
a recorded job's steps would take on another network or placement, without running it.

A run that recorded ``--compute-profile-out FILE`` holds every rank's program (what it computed
and communicated, in order).  ``simulate`` runs those programs together in simulated time
(:mod:`substrate.jobsim`: the exact collectives' messages, eager protocol, node links as
first-in-first-out queues or shared max-min fairly, compute charged from the profile), on the
placement and links given here, and prints every step's length and the mean after the warm-up
steps.  It starts no MPI: a laptop answers "and on 8 nodes at 100 Gbit/s?" for a job recorded
anywhere.  The wire lab checks the
same simulation against replays on shaped links (docs/BENCHMARKS.md, sessions 12-13).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from substrate.calls import Placement
from substrate.costmodel import (
    DEFAULT_INTER_GBPS,
    DEFAULT_INTER_LAT_US,
    DEFAULT_INTRA_GBPS,
    DEFAULT_INTRA_LAT_US,
    CostModel,
)
from substrate.jobsim import LINK_SHARING, simulate_profile
from substrate.profile import load_profile
from substrate.results import atomic_write_bytes

__all__ = ["add_parser", "run", "simulate"]


def simulate(profile, node_map: str, cost: CostModel, *, eager_limit: float = math.inf,
             skip: int = 1, link_sharing: str = "fifo", ack_overhead: float = 0.0) -> dict:
    """The job simulation of ``profile`` (a path or a loaded profile) on ``node_map``
    (``--node-map`` syntax: ``block:R``, ``round-robin:R`` or a node per rank)."""
    doc = profile if isinstance(profile, dict) else load_profile(profile)
    programs = doc.get("programs")
    if programs is None:
        raise ValueError(f"--compute-profile {doc.get('path')}: holds no programs (recorded by "
                         "an older spardist or with --clock additive); record it again with "
                         "--compute-profile-out")
    placement = Placement.parse(node_map, len(programs))
    if skip < 0:
        raise ValueError(f"--skip {skip}: must be >= 0 warm-up steps")
    if not 0 <= ack_overhead < 1:
        raise ValueError(f"--ack-overhead {ack_overhead:g}: must be in [0, 1) bytes per byte "
                         "(TCP with delayed ACKs: 0.0218; RDMA: 0)")
    res = simulate_profile(doc, placement.node_of, cost, eager_limit=eager_limit,
                           link_sharing=link_sharing, ack_overhead=ack_overhead)
    steps = res["step_s"]
    if len(steps) <= skip:
        raise ValueError(f"--skip {skip}: the profile's programs hold {len(steps)} steps; pass "
                         f"--skip {max(0, len(steps) - 1)} or fewer")
    res.update(profile=str(doc.get("path")), node_map=node_map, cost_model=cost.describe(),
               skip=skip, mean_step_s=statistics.fmean(steps[skip:]))
    return res


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a recorded job's steps on any network and "
                       "placement (no MPI)", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--compute-profile", required=True, type=Path, metavar="FILE",
                   help="a profile written by --compute-profile-out (it holds the programs)")
    p.add_argument("--node-map", required=True, metavar="MAP",
                   help="the nodes of the ranks: block:R, round-robin:R or 0,0,1,1")
    p.add_argument("--intra-bw", type=float, default=DEFAULT_INTRA_GBPS, metavar="GBPS",
                   help="intra-node bandwidth in Gbit/s (default %(default)s)")
    p.add_argument("--inter-bw", type=float, default=DEFAULT_INTER_GBPS, metavar="GBPS",
                   help="inter-node bandwidth in Gbit/s, each node's uplink and downlink "
                        "(default %(default)s)")
    p.add_argument("--intra-lat", type=float, default=DEFAULT_INTRA_LAT_US, metavar="US",
                   help="intra-node latency in microseconds (default %(default)s)")
    p.add_argument("--inter-lat", type=float, default=DEFAULT_INTER_LAT_US, metavar="US",
                   help="inter-node latency in microseconds (default %(default)s)")
    p.add_argument("--eager-limit", type=float, default=math.inf, metavar="BYTES",
                   help="messages above BYTES go by rendezvous (default: all eager)")
    p.add_argument("--link-sharing", choices=LINK_SHARING, default="fifo",
                   help="fifo: every node link a first-in-first-out queue, a node sending one "
                        "message at a time (TCP through one NIC queue, the wire lab); fair: "
                        "max-min fair shares per message (per-flow fair queueing, fq_codel, "
                        "RDMA NICs arbitrating queue pairs) (default %(default)s)")
    p.add_argument("--ack-overhead", type=float, default=0.0, metavar="FRACTION",
                   help="bytes a receiving node sends back per inter-node byte, the "
                        "transport's acknowledgements (TCP with delayed ACKs: 0.0218; default "
                        "0, RDMA)")
    p.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the mean "
                   "(default 1)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the result here "
                   "(refused if it exists)")
    p.set_defaults(func=run)


def run(args) -> None:
    if args.json is not None and args.json.exists():
        raise ValueError(f"--json {args.json}: already exists; choose a new file (results are "
                         "never overwritten)")
    if not args.eager_limit >= 0:
        raise ValueError(f"--eager-limit {args.eager_limit:g}: must be >= 0 bytes")
    cost = CostModel.from_cli(args.intra_bw, args.inter_bw, args.intra_lat, args.inter_lat)
    res = simulate(args.compute_profile, args.node_map, cost, eager_limit=args.eager_limit,
                   skip=args.skip, link_sharing=args.link_sharing,
                   ack_overhead=args.ack_overhead)
    steps = ", ".join(f"{s * 1e3:.3f}" for s in res["step_s"])
    print(f"job simulation of {res['profile']} on {args.node_map} (inter {args.inter_bw:g} "
          f"Gbit/s, {args.inter_lat:g} us, {args.link_sharing} links; intra {args.intra_bw:g} "
          f"Gbit/s, {args.intra_lat:g} us)")
    print(f"  steps (ms): {steps}")
    print(f"  mean step after {args.skip} warm-up: {res['mean_step_s'] * 1e3:.3f} ms; bytes "
          f"moved: inter-node {res['bytes']['inter']:.0f}, intra-node "
          f"{res['bytes']['intra']:.0f}")
    if args.json is not None:
        atomic_write_bytes(args.json, json.dumps(res, indent=2).encode())
