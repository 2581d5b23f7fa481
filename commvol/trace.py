"""``python -m commvol trace RUN_DIR [--out FILE] [--step N]``: a finished run's timeline as Chrome
Trace Event JSON (Perfetto, ``chrome://tracing``).

A run's ``summary.json`` keeps the last step of rank 0 and of the busiest rank (and any step the
trainer recorded); this writes those as a trace (:mod:`substrate.trace`: one process per rank,
lanes for the compute stream, the offload thread, the links and waits; phase, bytes and link
class in each event's ``args``).  For every rank and any steps, run with ``--trace FILE``.
"""

from __future__ import annotations

import json
from pathlib import Path

from substrate.results import atomic_write_bytes
from substrate.trace import trace_document

from .plots import step_events

__all__ = ["add_parser", "run", "trace_of_run"]


def trace_of_run(run_dir, step: int | None = None) -> dict:
    """The Trace Event document of the step(s) ``summary.json`` keeps (see the module
    docstring)."""
    data = step_events(run_dir, step)
    per_rank = {}
    for name, events in data["ranks"].items():
        rank = int(name.split()[1])
        per_rank[rank] = [{"step": data["step"], "sim_start_s": 0.0,
                           "sim_s": data["step_s"].get(name), "wall_s": None,
                           "events": events}]
    return trace_document(per_rank, {"run": str(run_dir), "step": data["step"],
                                     "compute_source": data["compute_source"],
                                     "ranks": "rank 0 and the busiest rank of the run"})


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="a run's timeline as Chrome Trace Event JSON (Perfetto)")
    p.add_argument("run_dir", help="folder of a finished run (timeline clock)")
    p.add_argument("--step", type=int, default=None, help="a recorded step (default: the last)")
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
