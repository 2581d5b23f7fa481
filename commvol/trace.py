"""``python -m commvol trace RUN_DIR [--out FILE] [--step N]``: the last simulated step a finished
run keeps as Chrome Trace Event JSON (Perfetto, ``chrome://tracing``).

A run's ``summary.json`` keeps the job simulation's events of the last step of its run loop for
rank 0 and for the rank that ended it last (``clock.last_step``); this writes those as a trace
(:mod:`simulation.trace`: one process per rank, lanes for the compute stream, the offload worker,
the calls issued without waiting and the blocking calls; a call's phase, bytes and algorithm in
its ``args``), each rank's events from the moment it ended the step before.  For every rank and
any steps, run the job with ``--trace FILE``.  A run recorded by an older spardist (no ``clock``
block) is refused, naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from simulation.trace import trace_document
from substrate.results import atomic_write_bytes

from .plots import step_events

__all__ = ["add_parser", "run", "trace_of_run"]


def trace_of_run(run_dir, step: int | None = None) -> dict:
    """The Trace Event document of the step ``summary.json`` keeps (see the module
    docstring)."""
    data = step_events(run_dir, step)
    per_rank = {data["rank_of"][name]: [{"step": data["step"], "sim_start_s": 0.0,
                                         "sim_s": data["step_s"], "wall_s": None,
                                         "events": events}]
                for name, events in data["ranks"].items()}
    return trace_document(per_rank, {
        "run": str(run_dir), "step": data["step"], "compute_source": data["compute_source"],
        "ranks": f"rank 0 and rank {data['slowest_rank']}, the rank that ended the step last",
        "time_origin": "each rank's moment of ending the step before"})


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="a run's last simulated step as Chrome Trace Event JSON "
                                     "(Perfetto)")
    p.add_argument("run_dir", help="folder of a finished run")
    p.add_argument("--step", type=int, default=None,
                   help="the step summary.json keeps (default: it, the last of the run loop)")
    p.add_argument("--out", type=Path, default=None,
                   help="trace file (default: RUN_DIR/trace.json)")
    p.set_defaults(func=run)


def run(args) -> Path:
    out = args.out or Path(args.run_dir) / "trace.json"
    doc = trace_of_run(args.run_dir, args.step)
    atomic_write_bytes(out, json.dumps(doc).encode() + b"\n")
    print(f"wrote {out} ({len(doc['traceEvents'])} events): open it in https://ui.perfetto.dev "
          "or chrome://tracing")
    return out
