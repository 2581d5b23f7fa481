"""Measured against booked and predicted: what the lab's readings mean.

* Bytes (:func:`wire_report`, :func:`format_table`): the real TCP payload that crossed between
  hosts, from the interface counters, against the ledger's booked and the closed form's
  predicted inter-node bytes of the same run (``wire.json``).  Segments that crossed a link
  twice (D-SACKed spurious retransmissions; every retransmission with offload on), if any, are
  subtracted at one MSS each and reported.
* Time per step: the cost model of a lab run (:func:`cost_flags`: beta from the
  ``--link`` rate as TCP payload, :func:`link_payload_gbps`; alpha from the lab's ping-pong),
  and the run's measured ``step_wall_s`` against its predicted ``step_sim_s`` per
  ``metrics.jsonl`` line (:func:`compare_steps`, ``steps.json``); :func:`per_step_from_pair`
  gets the time per step from two runs that differ only in their step count;
  :func:`format_comparison` tabulates :func:`lab.experiments.compare_systems`.
"""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

from simulation.cluster import TCP_ACK_OVERHEAD

from .netns import LabError
from .network import ETH_HDR, IP_HDR, MTU, TCP_HDR, TCPEXT_FIELDS

__all__ = ["STEPS_JSON", "WIRE_JSON", "compare_steps", "cost_flags", "format_comparison",
           "format_steps", "format_table", "link_payload_gbps", "per_step_from_pair",
           "tcp_ack_overhead", "wire_report"]

WIRE_JSON = "wire.json"
STEPS_JSON = "steps.json"


# -- bytes -----------------------------------------------------------------------------------------

def _host_figures(lab, d: dict) -> dict:
    hdr = lab.calibration["header_bytes"]
    mss = lab.calibration["mss"]
    frame_extra = 0 if lab.calibration["counters_include_ethernet_header"] else ETH_HDR
    dup = _duplicate_segs(lab, d)
    return {"counter_bytes": d["bytes"], "packets": d["packets"],
            "frame_bytes": d["bytes"] + frame_extra * d["packets"],
            "retrans_segs": d["retrans_segs"], "duplicate_segs": dup,
            "dropped": d.get("dropped", 0),
            "payload_bytes": d["bytes"] - hdr * d["packets"] - mss * dup}

def _duplicate_segs(lab, d: dict) -> int:
    """Segments that crossed the link twice.  In veth's NAPI mode (GRO on) the counters only
    see frames the peer took, so a retransmission after a drop is the first delivery and only
    spurious retransmissions (reported back by D-SACK) are duplicates; with the kernel's
    default offload the counters count at transmit, so every retransmission is."""
    return d.get("TCPDSACKRecvSegs", 0) if not lab.offload else d["retrans_segs"]

def wire_report(lab, summary: dict, job: dict, base: dict, launch: str, module_args,
                out) -> dict:
    """The ``wire.json`` of one run of :class:`lab.jobs.Lab`: booked (the ledger's
    ``traffic.measured.inter_node_bytes``), predicted and real inter-host bytes, per host and in
    total, after the start-up baseline ``base`` and less the job simulation's own messages
    (the run's control plane, ``clock.control_inter_node_bytes``); the ratios and warnings.

    ``job`` and ``base`` are :meth:`lab.jobs.Lab._job` results (counter deltas per host);
    ``summary`` is the run's ``summary.json``.  The TCP payload is ``bytes - packets x header``
    (the header calibrated at set-up), less one MSS per segment that crossed a link twice."""
    traffic = summary.get("traffic", {})
    booked = traffic.get("measured", {}).get("inter_node_bytes")
    predicted = traffic.get("predicted", {}).get("inter_node_bytes")
    per_host = {}
    for h in lab.hostnames:
        run = _host_figures(lab, job["delta"][h])
        b = _host_figures(lab, base["delta"][h])
        per_host[h] = {"run": run, "baseline": b,
                       "tcp_events": {k: job["delta"][h].get(k, 0) for k in TCPEXT_FIELDS},
                       "payload_bytes": run["payload_bytes"] - b["payload_bytes"],
                       "frame_bytes": run["frame_bytes"] - b["frame_bytes"]}
    # the job simulation's own messages (summary.json clock.control_inter_node_bytes): the
    # run's control plane, not the system's traffic; taken off the payload compared with booked
    control = (summary.get("clock") or {}).get("control_inter_node_bytes") or 0
    real_payload = sum(v["payload_bytes"] for v in per_host.values()) - control
    real_frames = sum(v["frame_bytes"] for v in per_host.values())
    base_payload = sum(v["baseline"]["payload_bytes"] for v in per_host.values())
    base_frames = sum(v["baseline"]["frame_bytes"] for v in per_host.values())
    retrans = sum(v["run"]["retrans_segs"] for v in per_host.values())
    dups = sum(v["run"]["duplicate_segs"] for v in per_host.values())
    dropped = sum(v["run"]["dropped"] for v in per_host.values())
    def ratio(x, y):
        return (x / y) if y else None
    topo = summary.get("topology", {})
    warnings = []
    if topo and (topo.get("nodes") != lab.hosts or topo.get("virtual_nodes")):
        warnings.append(f"the run saw {topo.get('nodes')} nodes (virtual: "
                        f"{topo.get('virtual_nodes')}), the lab has {lab.hosts} hosts")
    if dups:
        warnings.append(f"{dups} TCP segments crossed a link twice (spurious "
                        "retransmissions; subtracted at one MSS each)")
    if dropped:
        warnings.append(f"{dropped} frames were dropped at a veth (retransmitted by TCP)")
    qdrops = sum(v["drops"] for v in (job["qdisc"] or {}).values())
    if qdrops:
        warnings.append(f"the link shaping dropped {qdrops} packets (retransmitted by TCP)")
    if booked and real_payload < 0.01 * booked:
        warnings.append("almost nothing crossed the links: inter-host traffic is not on the "
                        "veth links (shared memory?)")
    result = {
        "wirelab": 1,
        "lab_id": lab.id,
        "shape": {"hosts": lab.hosts, "ranks_per_host": lab.rph,
                  "world": lab.hosts * lab.rph, "hostnames": lab.hostnames},
        "launch": launch,
        "command": shlex.join(job["command"]),
        "resolved_command": job["resolved"],
        "module_args": list(module_args),
        "out": str(out),
        "network": {"netmod": lab.netmod,
                    "env": {k: v for k, v in lab.mpi_env().items()
                            if k.startswith(("UCX_", "FI_", "MPIR_CVAR_", "SPARDIST_"))},
                    "mtu": MTU, "offload": lab.features.get("mode"),
                    "addresses": dict(zip(lab.hostnames, lab.addrs))},
        "link": lab.shaping,
        "nice": lab.nice,
        "calibration": lab.calibration,
        "system": summary.get("system"), "method": summary.get("method"),
        "topology": topo,
        "collectives": summary.get("collectives"),
        "booked_inter_node_bytes": booked,
        "predicted_inter_node_bytes": predicted,
        "control_plane_bytes": control,
        "real": {"payload_bytes": real_payload, "frame_bytes": real_frames,
                 "excess_payload_bytes": None if booked is None else real_payload - booked,
                 "retrans_segs": retrans, "duplicate_segs": dups, "dropped": dropped},
        "baseline": {"payload_bytes": base_payload, "frame_bytes": base_frames,
                     "wall_s": base["wall_s"]},
        "ratios": {"payload_vs_booked": ratio(real_payload, booked),
                   "frames_vs_booked": ratio(real_frames, booked),
                   "payload_vs_predicted": ratio(real_payload, predicted),
                   "booked_vs_predicted": ratio(booked, predicted)},
        "per_host": per_host,
        "qdisc": job["qdisc"],
        "wall_s": job["wall_s"],
        "pingpong": lab.pingpong,
        "warnings": warnings,
    }
    return result


def format_table(r: dict) -> str:
    """The small table printed on stdout."""
    def fmt(x):
        return "-" if x is None else f"{x:,}"

    def rat(x):
        return "-" if x is None else f"{x:.4f}"

    s = r["shape"]
    link = r["link"]
    link_txt = "unshaped" if link is None else (
        f"{link['mbit']:g} Mbit/s, {link['latency_us_applied']:g} us ({link['qdisc']})")
    lines = [(f"wire lab: {s['hosts']} hosts x {s['ranks_per_host']} ranks, launch "
              f"{r['launch']}, MPICH {r['network']['netmod']} over TCP on veth, link "
              f"{link_txt}"),
             f"  {r['system']} / {r['method']}: {' '.join(r['module_args'])}",
             f"  {'':24s}{'bytes':>16s}  {'/ booked':>9s}"]
    booked = r["booked_inter_node_bytes"]
    rows = [("booked (ledger)", booked),
            ("predicted", r["predicted_inter_node_bytes"]),
            ("real payload (TCP)", r["real"]["payload_bytes"]),
            ("  clock's messages, off", r.get("control_plane_bytes")),
            ("real frames", r["real"]["frame_bytes"]),
            ("start-up baseline", r["baseline"]["payload_bytes"])]
    for name, v in rows:
        lines.append(f"  {name:24s}{fmt(v):>16s}  "
                     f"{rat(v / booked) if (booked and v is not None) else '-':>9s}")
    lines.append("  per host (payload / frames / packets / retransmitted / duplicate segments):")
    for h, v in r["per_host"].items():
        lines.append(f"    {h}: {v['payload_bytes']:,} / {v['frame_bytes']:,} / "
                     f"{v['run']['packets'] - v['baseline']['packets']:,} / "
                     f"{v['run']['retrans_segs']} / {v['run']['duplicate_segs']}")
    if r.get("collectives") is not None:
        lines.append(f"  collectives: {json.dumps(r['collectives'])}")
    for w in r["warnings"]:
        lines.append(f"  warning: {w}")
    lines.append(f"  wrote {Path(r['out']) / WIRE_JSON}")
    return "\n".join(lines)


# -- the cost model of a lab run ------------------------------------------------------------------

def link_payload_gbps(mbit: float) -> float:
    """TCP payload rate (Gbit/s) of a link shaped to ``mbit`` Mbit/s: the shaper counts whole
    frames, so each full segment of MSS 1448 bytes costs 1448 + 32 (TCP with timestamps) + 20 (IP)
    + 14 (Ethernet) = 1514 bytes of rate.  Derived from the setting, not fitted."""
    mss = MTU - IP_HDR - TCP_HDR
    return mbit * 1e-3 * mss / (MTU + ETH_HDR)


def tcp_ack_overhead() -> float:
    """Link time TCP's acknowledgements take on the reverse direction, per unit of payload time
    (:class:`simulation.jobsim.JobSim`'s ``ack_overhead``): one 66-byte frame per two full
    segments, :data:`simulation.cluster.TCP_ACK_OVERHEAD` (0.0218; the lab's counters show
    0.0214)."""
    return TCP_ACK_OVERHEAD


def cost_flags(link, pingpong: dict | None, dilation: float = 1.0) -> list[str]:
    """Cost-model flags for a run on the lab: ``--inter-bw`` from the ``--link`` rate
    (:func:`link_payload_gbps`), ``--inter-lat`` / ``--intra-lat`` (and ``--intra-bw``) from
    the ping-pong (``pingpong.json`` content), when given.

    ``dilation`` K (time dilation, :mod:`runner.replay`): ``link`` is the *emulated* rate (the
    lab shapes its links to 1/K of it) and the ping-pong was measured in dilated time, so its
    alphas are divided and its bandwidths multiplied by K: the emulated cluster's values."""
    flags = []
    if link is not None:
        flags += ["--inter-bw", f"{link_payload_gbps(float(link[0])):.9g}"]
    links = (pingpong or {}).get("links", {})
    if "inter" in links:
        flags += ["--inter-lat", f"{links['inter']['alpha_s'] * 1e6 / dilation:.6g}"]
        if link is None and links["inter"].get("bandwidth_gbps"):
            flags += ["--inter-bw", f"{links['inter']['bandwidth_gbps'] * dilation:.6g}"]
    if "intra" in links:
        flags += ["--intra-lat", f"{links['intra']['alpha_s'] * 1e6 / dilation:.6g}"]
        if links["intra"].get("bandwidth_gbps"):
            flags += ["--intra-bw", f"{links['intra']['bandwidth_gbps'] * dilation:.6g}"]
    return flags



# -- predicted vs measured step time ---------------------------------------------------------------

_STEP_KEYS = ("step", "iteration", "k", "epoch")


def _read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        raise LabError(f"{path} not found: --compare-steps needs a finished run's metrics.jsonl")
    lines = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise LabError(f"{path}:{i + 1} is not JSON ({exc})") from None
    return lines


def _job_steps(lines: list, steps_max: dict | None) -> tuple[list, str] | None:
    """The run's simulated job steps (``summary.json`` ``steps_max``: one per step of the run
    loop, or per replayed step) and the line key that counts steps from 1 (``index``, else
    ``step``), when the counter's last value is the number of entries."""
    if not steps_max or not lines:
        return None
    series = steps_max.get("step_s", [])
    n = len(series)
    for key in ("index", "step"):
        vals = [line.get(key) for line in lines]
        if all(isinstance(v, int) and 0 < v <= n for v in vals) and vals[-1] == n and \
                vals == sorted(set(vals)):
            return series, key
    return None


def compare_steps(out, *, skip: int = 1) -> dict:
    """Predicted vs measured time per step from a run's ``metrics.jsonl``.

    Each line must carry ``step_wall_s`` (measured wall seconds per step over the steps since
    the previous line).  The prediction is the job simulation's (:mod:`simulation.jobsim`):
    the job's step from ``summary.json``'s ``steps_max`` (every step, a line over several
    steps takes their mean) when the lines' counter lines up with it (a replay's lines carry
    no prediction of their own), else the line's ``step_sim_s``, else the difference of the
    cumulative ``sim_s`` to the previous line over the steps between them (a step counter
    ``step`` / ``iteration`` / ``k``).  The first ``skip`` lines (warm-up) are left out of the
    medians.  A line's ``time_dilation`` K (a dilated replay, :mod:`runner.replay`) divides
    its measured time: the measured step of the emulated cluster.

    Returns ``{"rows": [...], "median_ratio": predicted / measured, ...}``.
    """
    lines = _read_metrics(out)
    summary = Path(out) / "summary.json"
    sm = json.loads(summary.read_text()) if summary.exists() else {}
    job = _job_steps(lines, sm.get("steps_max"))
    rows = []
    prev = None
    for line in lines:
        key = next((k for k in _STEP_KEYS if k in line), None)
        if "step_wall_s" not in line:
            raise LabError(f"{Path(out) / 'metrics.jsonl'}: a line has no step_wall_s (keys: "
                           f"{sorted(line)}); the command must log the measured wall time per "
                           "step")
        k = line.get(key) if key else None
        dk = (k - prev.get(key, 0)) if (prev is not None and key) else k
        dilation = float(line.get("time_dilation", 1.0))
        row = {"k": k, "measured_s": float(line["step_wall_s"]) / dilation}
        if dilation != 1.0:
            row["time_dilation"] = dilation
        if job is not None:
            series, at = job
            first, last = (prev[at] if prev is not None else 0), line[at]
            row["predicted_s"] = float(statistics.fmean(series[first:last]))
        elif line.get("step_sim_s") is not None:
            row["predicted_s"] = float(line["step_sim_s"])
        elif "sim_s" in line and dk:
            row["predicted_s"] = (line["sim_s"] - (prev or {}).get("sim_s", 0.0)) / dk
        if "predicted_s" not in row:
            raise LabError(f"{Path(out) / 'metrics.jsonl'}: line {k} has neither step_sim_s nor "
                           "a cumulative sim_s with a step counter, and summary.json no steps_max")
        row["ratio"] = row["predicted_s"] / row["measured_s"] if row["measured_s"] else None
        rows.append(row)
        prev = line

    used = [r for r in rows[skip:] if r["ratio"] is not None]
    if not used:
        raise LabError(f"{out}: no step left after skipping {skip} warm-up line(s); run more "
                       "steps or pass a smaller --skip")

    def med(xs):
        return float(statistics.median(xs))

    res = {"out": str(out), "skip": skip, "rows": rows, "steps_compared": len(used),
           "predicted_from": ("the job simulation, step by step (summary.json steps_max)"
                              if job is not None else "the job simulation, per metrics line"),
           "median_measured_s": med([r["measured_s"] for r in used]),
           "median_predicted_s": med([r["predicted_s"] for r in used]),
           "median_ratio": med([r["ratio"] for r in used])}
    if sm:
        res["cost_model"] = sm.get("cost_model")
        res["clock"] = sm.get("clock")
    wire = Path(out) / WIRE_JSON
    if wire.exists():
        res["link"] = json.loads(wire.read_text()).get("link")
    return res


def format_steps(r: dict) -> str:
    lines = [(f"per-step time, {r['out']} ({r['steps_compared']} lines compared, first "
              f"{r['skip']} skipped)"),
             f"  {'k':>6s} {'measured s':>12s} {'predicted s':>12s} {'pred/meas':>10s}"]
    for row in r["rows"]:
        lines.append(f"  {row['k']!s:>6s} {row['measured_s']:12.5f} {row['predicted_s']:12.5f} "
                     f"{row['ratio']:10.3f}")
    lines.append(f"  median: measured {r['median_measured_s']:.5f} s, predicted "
                 f"{r['median_predicted_s']:.5f} s, ratio {r['median_ratio']:.3f} "
                 f"({r['predicted_from']})")
    return "\n".join(lines)


def per_step_from_pair(short: dict, long: dict) -> dict:
    """Per-step time from two lab runs that differ only in their step count: measured
    ``(wall_long - wall_short) / Δsteps`` (set-up, evaluation at the end and teardown cancel)
    against predicted ``(sim_long - sim_short) / Δsteps``.  ``short``/``long`` are
    ``{"steps": N, "wire": wire.json dict, "summary": summary.json dict}``."""
    ds = long["steps"] - short["steps"]
    if ds <= 0:
        raise LabError("per_step_from_pair: the long run needs more steps than the short one")
    meas = (long["wire"]["wall_s"] - short["wire"]["wall_s"]) / ds
    t_s, t_l = short["summary"]["timing"], long["summary"]["timing"]
    out = {"steps": [short["steps"], long["steps"]], "measured_s": meas,
           "predicted_s": (t_l["sim_s"] - t_s["sim_s"]) / ds,
           "compute_s": (t_l["compute_s"] - t_s["compute_s"]) / ds,
           "comm_modeled_s": (t_l["comm_modeled_s"] - t_s["comm_modeled_s"]) / ds}
    out["ratio"] = out["predicted_s"] / meas if meas > 0 else None
    return out


# -- several systems ------------------------------------------------------------------------------

def median_of(xs):
    """The median of the values that are not None (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def format_run(r: dict) -> str:
    """One line per run of :func:`lab.experiments.compare_systems` (its progress output)."""
    head = (f"{r['system']} {r['hosts']}x{r['ranks_per_host']} {r['mbit']:g} Mbit/s "
            f"#{r['repeat']}: ")
    if "error" in r:
        return head + f"error: {r['error']}"
    return head + (f"predicted {r['predicted_s']:.4f} s/step, measured {r['measured_s']:.4f}, "
                   f"ratio {r['ratio']:.3f}"
                   + f" ({r['steps_compared']} steps; load "
                   f"{r['load_before']:.1f} -> {r['load_after']:.1f})")


def format_comparison(res: dict) -> str:
    """The table of :func:`compare_systems`: one line per system x hosts x ranks x link."""
    def f(x, p=4):
        return "-" if x is None else f"{x:.{p}f}"
    lines = [("| system | hosts x ranks | link | dilation | alpha inter / intra (us) | "
              "predicted s/step | measured s/step | predicted / measured | runs | load |"),
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        a = r["alpha_s"] or {}
        alpha = " / ".join(f"{a[k] * 1e6:.1f}" if k in a else "-" for k in ("inter", "intra"))
        load = f"{f(r['load_before'], 1)} -> {f(r['load_after'], 1)}"
        lines.append(f"| {r['system']} | {r['hosts']} x {r['ranks_per_host']} | "
                     f"{r['mbit']:g} Mbit/s | {r.get('time_dilation') or 1:g} | {alpha} | "
                     f"{f(r['predicted_s'])} | "
                     f"{f(r['measured_s'])} | {f(r['ratio'], 3)} | {r['runs']} | {load} |")
        for e in r["errors"]:
            lines.append(f"|   error: {e} |")
    return "\n".join(lines)

