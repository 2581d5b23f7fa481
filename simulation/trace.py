"""Chrome Trace Event export of a run's simulated steps (what Perfetto and ``chrome://tracing``
open).

Horovod's timeline and ``torch.profiler`` write the Trace Event format; so does spardist:
``--trace FILE`` (with ``--trace-steps``) writes the selected steps of every rank as the job
simulation ran them (:class:`simulation.jobsim.JobSim`, ``record_events``).  Each rank is a
process (``pid``); its lanes are threads (``tid``): the compute stream, the offload worker, the
calls on the communication stream, the blocking calls, and a ``wall`` lane with the step's
measured wall time.  Every event is a complete event (``"ph": "X"``) on the **simulated** clock
(microseconds from the start of the run's simulated time), a call's phase, bytes and algorithm
in ``args``; the ``wall`` lane is placed at the same simulated start so the two compare step by
step.  Format: the Trace Event Format document (JSON object with ``traceEvents``).
"""

from __future__ import annotations

__all__ = ["LANES", "parse_steps", "trace_document", "trace_events"]

#: lane (thread) ids, in display order
LANES = {"compute": 1, "offload": 2, "stream": 3, "calls": 4, "wall": 5}
_LANE_NAMES = {"compute": "compute stream", "offload": "offload worker",
               "stream": "communication stream", "calls": "blocking calls",
               "wall": "measured wall time"}


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
    """The Trace Event records of one rank: ``steps`` are ``{"step", "sim_start_s", "sim_s",
    "wall_s", "events"}``, the events :class:`simulation.jobsim.JobSim` recorded (``label``,
    ``kind``, ``lane``, ``start``, ``finish`` from the step's start; a call's ``phase``,
    ``nbytes``, ``algorithm``)."""
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    used = set()
    for st in steps:
        t0 = float(st["sim_start_s"])
        for e in st["events"]:
            lane = e["lane"]
            used.add(lane)
            args = {"step": st["step"], "kind": e["kind"]}
            if e.get("phase"):
                args.update(phase=e["phase"], bytes=int(e.get("nbytes") or 0),
                            algorithm=e.get("algorithm"))
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
            "otherData": {"clock": "simulated seconds of the job simulation (compute measured "
                                   "or costed, messages on the network); lane 'wall' "
                                   "measured", **meta}}
