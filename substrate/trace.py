"""Chrome Trace Event export of a run's timeline (what Perfetto and ``chrome://tracing`` open).

Horovod's timeline and ``torch.profiler`` write the Trace Event format; so does spardist:
``--trace FILE`` (with ``--trace-steps``) writes the selected steps of every rank, and
``python -m commvol trace RUN_DIR`` the steps a finished run's ``summary.json`` keeps.  Each rank
is a process (``pid``); its lanes are threads (``tid``): the compute stream, the offload thread,
the intra- and inter-node links, waits for other ranks' phases, and a ``wall`` lane with the
step's measured wall time.  Every event is a complete event (``"ph": "X"``) on the **simulated**
clock (microseconds from the start of the run's simulated time), with its phase, bytes and link
class in ``args``; the ``wall`` lane is placed at the same simulated start so the two compare
step by step.  Format: the Trace Event Format document (JSON object with ``traceEvents``).
"""

from __future__ import annotations

__all__ = ["LANES", "parse_steps", "trace_document", "trace_events"]

#: lane (thread) ids, in display order
LANES = {"compute": 1, "offload": 2, "intra": 3, "inter": 4, "none": 5, "wall": 6}
_LANE_NAMES = {"compute": "compute stream", "offload": "offload thread",
               "intra": "intra-node link", "inter": "inter-node link",
               "none": "waits for other ranks", "wall": "measured wall time"}


def _parse(spec: str):
    out, last = set(), False
    for item in str(spec).replace(" ", "").split(","):
        if not item:
            continue
        if item == "last":
            last = True
            continue
        a, sep, b = item.partition("-")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise ValueError(f"--trace-steps {spec!r}: write step indices and ranges (0,3-5), "
                             "'last' or 'all'") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"--trace-steps {spec!r}: a range must be lo-hi with 0 <= lo <= hi")
        out.update(range(lo, hi + 1))
    return out, last


def parse_steps(spec: str):
    """``--trace-steps``: ``all`` (``None``), or ``(indices, last)`` from step indices and
    ranges such as ``0,3-5`` and the word ``last``."""
    if str(spec).strip() == "all":
        return None
    return _parse(spec)


def trace_events(rank: int, steps: list[dict]) -> list[dict]:
    """The Trace Event records of one rank: ``steps`` are ``{"step", "sim_start_s",
    "wall_s", "events": [EventRecord-like dicts]}``."""
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    used = set()
    for st in steps:
        t0 = float(st["sim_start_s"])
        for e in st["events"]:
            if e["kind"] == "join":
                continue
            lane = e["resource"] if e["resource"] in LANES else "none"
            used.add(lane)
            args = {"step": st["step"], "kind": e["kind"]}
            if e.get("phase"):
                args["phase"] = e["phase"]
            if e["kind"] in ("transfer", "wait"):
                args["bytes"] = int(e.get("nbytes") or 0)
                args["link"] = e["resource"] if e["kind"] == "transfer" else "another rank's"
            out.append({"ph": "X", "name": e["label"], "cat": e.get("phase") or e["kind"],
                        "pid": rank, "tid": LANES[lane],
                        "ts": (t0 + float(e["start"])) * 1e6,
                        "dur": max(0.0, float(e["finish"]) - float(e["start"])) * 1e6,
                        "args": args})
        if st.get("wall_s") is not None:
            used.add("wall")
            out.append({"ph": "X", "name": f"step {st['step']} (wall)", "cat": "wall",
                        "pid": rank, "tid": LANES["wall"], "ts": t0 * 1e6,
                        "dur": float(st["wall_s"]) * 1e6,
                        "args": {"step": st["step"], "kind": "wall",
                                 "wall_s": float(st["wall_s"]),
                                 "sim_s": float(st.get("sim_s") or 0.0)}})
    for lane in sorted(used, key=LANES.get):
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": LANES[lane],
                    "args": {"name": _LANE_NAMES[lane]}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": LANES[lane],
                    "args": {"sort_index": LANES[lane]}})
    return out


def trace_document(per_rank: dict[int, list[dict]], meta: dict) -> dict:
    """The whole file: every rank's events, the unit, and what the run was."""
    events = []
    for rank in sorted(per_rank):
        events += trace_events(rank, per_rank[rank])
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "simulated seconds (compute measured or costed, "
                                   "communication modeled); lane 'wall' measured", **meta}}
