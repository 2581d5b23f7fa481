"""Plots of a run's simulated time: ``python -m commvol {gantt,plot-scaling,plot-tta}``.

``gantt RUN_DIR [--step N] [--out PNG]``
    A Gantt chart of the last simulated step of the run loop, one panel per rank the run's
    ``summary.json`` keeps (rank 0 and the rank that ended the step last): the events the job
    simulation (:class:`simulation.jobsim.JobSim`) ran, from ``clock.last_step``.  One row per
    event lane the step used (``compute``: the compute stream; ``offload``: the offload worker;
    ``stream``: calls issued without waiting, on the communication stream beside compute;
    ``calls``: blocking calls on the rank's thread; unused lanes are left out); a block nested in
    another (a model's units inside ``forward+backward``) is drawn in a sub-row below it.  Bars
    are coloured by pass (per-layer forward/backward), compute block or call phase (the legend
    names each) and carry their name where it fits; the calls of each phase are named once above
    their lane with their bytes (the call's buffer; an all-gather's: every member's blocks) and
    an arrow to each bar.  The figure states how compute was timed (the run's compute source)
    and on which network the calls were simulated.
``plot-scaling SCALE_JSON [--out PNG]``
    Speedup and parallel efficiency from ``python -m commvol scale --out``: modeled lines (the
    job simulation solid, the alpha-beta bound dashed) and, when the JSON carries them, the
    paper's measured speedups as stars, each labelled modeled or measured with the paper's
    figure.
``plot-tta RUN_DIR... [--out PNG] [--target ACC]``
    Time to accuracy: test accuracy against simulated time (``sim_s``, in s / ms / µs by
    magnitude) of every logged line of ``metrics.jsonl``, one curve per run.

A run recorded by an older spardist (no ``clock`` block in ``summary.json``: its simulated time
came from the retired one-rank event timeline) is refused, naming the file.  Each plotting
function returns a :class:`commvol.report.Plot` (PNG path, figure, data drawn).

matplotlib is imported only inside the plotting functions (Agg backend, headless).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from simulation.trace import LANES as _TRACE_LANES

from .predict import fmt_bytes
from .report import Plot, _pyplot, _save, fmt_time, load_run, run_labels, time_unit
from .report import plot_scaling as _report_plot_scaling

__all__ = [
    "LANES",
    "Plot",
    "add_parser",
    "plot_gantt",
    "plot_scaling",
    "plot_tta",
    "run_clock",
    "step_events",
    "tta_points",
]

#: Lanes of the Gantt chart, in display order: the job simulation's event lanes
#: (:data:`simulation.trace.LANES` without the measured ``wall`` lane)
LANES = tuple(ln for ln in _TRACE_LANES if ln != "wall")


def _run_dir(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: pass a run directory (the --out of "
                         "hsadmm/dataparallel/sparse_sgd train)")
    return path


def run_clock(r) -> dict:
    """The ``clock`` block of a loaded run's ``summary.json`` (:meth:`SimClock.describe
    <simulation.clock.SimClock.describe>`: model, compute source, network, job simulation
    options, steps, ``last_step``).

    Raises
    ------
    ValueError
        When the run was recorded by an older spardist (no ``clock`` block), naming the file.
    """
    clock = r.summary.get("clock")
    if isinstance(clock, dict):
        return clock
    old = (" (its 'timeline' block is the one-rank event timeline spardist no longer has)"
           if "timeline" in r.summary else "")
    raise ValueError(f"{r.path / 'summary.json'} has no clock block{old}: the run was recorded "
                     "by an older spardist; run it again with the current trainer (its "
                     "simulated time is the job simulation of every rank's steps)")


def step_events(run_dir, step: int | None = None) -> dict:
    """The events of the last simulated step of the run loop that ``summary.json`` keeps
    (``clock.last_step``): ``{"step", "step_s" (the job's step), "slowest_rank", "ranks": {name:
    events}, "rank_of": {name: rank}, "compute_source", "clock"}``, rank 0 first, then the rank
    that ended the step last (``"rank R (slowest)"``).  An event is the job simulation's
    (``label``, ``kind``, ``lane``, ``start``, ``finish`` in seconds from the moment the rank
    ended the step before; a call's ``phase``, ``nbytes``, ``algorithm``).

    Raises
    ------
    ValueError
        Naming the path and the fix, when the directory or ``summary.json`` is missing, the run
        was recorded by an older spardist, no step of the run loop was simulated, rank 0 has no
        events, or ``step`` is not the step kept.
    """
    r = load_run(_run_dir(run_dir))
    clock = run_clock(r)
    s = r.path / "summary.json"
    last = clock.get("last_step")
    if not isinstance(last, dict) or not isinstance(last.get("ranks"), dict):
        raise ValueError(f"{s}'s clock block keeps no last_step: the run simulated no step of "
                         f"its run loop ({clock.get('steps', 0)} steps in all); run at least "
                         "one (--steps/--iters N)")
    k = int(last["step"])
    if step is not None and step != k:
        raise ValueError(f"{s} keeps the events of step {k} only (the last of the run loop), not "
                         f"step {step}: pass --step {k} or omit --step; for other steps run the "
                         f"job with --trace FILE --trace-steps {step} (every rank, any step)")
    if not last["ranks"].get("0"):
        raise ValueError(f"{s}'s clock.last_step has no events of rank 0: the file is "
                         "incomplete; run the job again with the current trainer")
    slowest = int(last.get("slowest_rank", 0))
    ranks, rank_of = {}, {}
    for rank in sorted(int(x) for x, evs in last["ranks"].items() if evs):
        name = f"rank {rank}" + (" (slowest)" if rank == slowest else "")
        ranks[name], rank_of[name] = last["ranks"][str(rank)], rank
    return {"step": k, "step_s": last.get("step_s"), "slowest_rank": slowest, "ranks": ranks,
            "rank_of": rank_of, "compute_source": clock.get("compute_source", "?"),
            "clock": clock}


def _drawn(e) -> bool:
    """Whether an event is a bar of the chart: every event on a lane (one that took no time,
    e.g. a broadcast's root, is drawn as a line)."""
    return e.get("lane") in LANES and e.get("finish", 0) >= e.get("start", 0)


def _subrows(events) -> list[int]:
    """Sub-row of each interval (sorted by start, the longer first) so that overlapping ones do
    not share a row: a block nested in another lands in a row below it."""
    ends: list[float] = []
    rows = []
    for e in events:
        for k, end in enumerate(ends):
            if e["start"] >= end - 1e-15:
                ends[k] = e["finish"]
                rows.append(k)
                break
        else:
            ends.append(e["finish"])
            rows.append(len(ends) - 1)
    return rows


#: colours: per-layer compute by pass, other compute blocks and calls by their phase (calls in
#: strong colours, compute in pale ones)
_PASS_COLORS = {"forward": ("tab:blue", "forward (per layer)"),
                "backward": ("tab:orange", "backward (per layer)")}
_COMPUTE_PALETTE = ("silver", "khaki", "lightsteelblue", "thistle", "tan", "darkseagreen",
                    "lightcoral", "gold", "lightcyan", "wheat")
_CALL_PALETTE = ("tab:green", "tab:red", "tab:purple", "tab:cyan", "tab:brown", "tab:pink",
                 "tab:olive", "navy", "darkgreen", "crimson")

#: a lane's geometry (row li spans li - 0.5 .. li + 0.5): label band centre, top of the bars
_LABEL_Y, _BAR_TOP = -0.3, -0.12


def _phase_of(label: str) -> str:
    """Phase of a label: ``ssf_sparsify[3]`` -> ``ssf_sparsify``."""
    return str(label).split("[")[0]


def _color_key(e) -> tuple[str, str]:
    """``("pass", forward|backward)`` for a per-layer compute event (``forward:conv1``),
    ``("call", phase)`` for a call, else ``("compute", phase of the label)``."""
    label = str(e.get("label", ""))
    if e.get("kind") == "call":
        return "call", str(e.get("phase") or _phase_of(label))
    kind, sep, _ = label.partition(":")
    if sep and kind in _PASS_COLORS:
        return "pass", kind
    return "compute", _phase_of(label)


def _colors(ranks: dict) -> dict:
    """``{colour key: (colour, legend label)}`` of the drawn events, in legend order: passes,
    compute blocks, call phases (each by first appearance); a call phase's label names its
    algorithm."""
    drawn = [e for evs in ranks.values() for e in evs if _drawn(e)]
    keys = list(dict.fromkeys(_color_key(e) for e in drawn))
    algorithms = {}
    for e in drawn:
        if e.get("kind") == "call":
            algorithms.setdefault(_color_key(e), {})[e.get("algorithm")] = None
    out = {("pass", p): v for p, v in _PASS_COLORS.items() if ("pass", p) in keys}
    compute = [k for k in keys if k[0] == "compute"]
    calls = [k for k in keys if k[0] == "call"]
    out.update({k: (_COMPUTE_PALETTE[i % len(_COMPUTE_PALETTE)], k[1])
                for i, k in enumerate(compute)})
    for i, k in enumerate(calls):
        algs = ", ".join(str(a) for a in algorithms[k] if a)
        out[k] = (_CALL_PALETTE[i % len(_CALL_PALETTE)], f"{k[1]} ({algs})" if algs else k[1])
    return out


def _call_bytes(e) -> str | None:
    """Bytes of a call's bar: the call's own ``nbytes`` (its buffer; an all-gather's: every
    member's blocks together)."""
    nb = e.get("nbytes")
    return fmt_bytes(nb) if isinstance(nb, (int, float)) else None


def _compute_statement(source: str) -> str:
    """What the compute bars are: measured (CPU/GPU time), replayed from a profile, or modeled
    from FLOP counts, from the run's ``clock.compute_source``."""
    s = str(source)
    if s.startswith("flops"):
        return f"compute modeled from FLOP counts ({s})"
    if s.startswith("profile"):
        return f"compute replayed from a measured profile ({s})"
    how = {"cpu_thread": "thread CPU time", "cpu_process": "process CPU time",
           "cuda": "CUDA events", "wall": "wall clock", "calibrated": "least of repeated "
           "measurements"}
    for k, v in how.items():
        if s.startswith(k):
            return f"compute measured ({v}: {s})"
    return f"compute: {s}"


def _comm_statement(clock: dict) -> str:
    """On what the calls were simulated: the run's network (``clock.network``, a
    :class:`simulation.cluster.Cluster`) and how messages share its links."""
    net = clock.get("network") or {}
    node, lib = net.get("node") or {}, net.get("library") or {}
    links = []
    if "fabric_gbps" in node:
        links.append(f"intra-node {node.get('fabric', '')} {node['fabric_gbps']:g} Gbit/s + "
                     f"{node.get('fabric_latency_us', 0):g} µs")
    if "nic_gbps" in node:
        links.append(f"inter-node {node.get('nics', 1)} x {node['nic_gbps']:g} Gbit/s + "
                     f"{node.get('nic_latency_us', 0):g} µs")
    if lib.get("name"):
        links.append(f"{lib['name']}")
    sharing = (clock.get("job_simulation") or {}).get("link_sharing")
    if sharing:
        links.append(f"link sharing {sharing}")
    where = net.get("name", "the run's network")
    return (f"communication simulated with every rank's messages on {where}"
            + (f" ({', '.join(links)})" if links else ""))


#: what the lanes and the calls' bytes are (the figure's footer)
_LANE_NOTE = ("lanes: compute stream, offload worker, stream = calls issued without waiting "
              "(beside compute), calls = blocking calls on the rank's thread; a call's bytes: its "
              "buffer (an all-gather's: every member's blocks)")


def _fits(ax, renderer, text, x0, x1) -> bool:
    """Whether ``text`` (drawn) fits between data x0 and x1 of ``ax``."""
    px = ax.transData.transform([(x0, 0), (x1, 0)])
    return text.get_window_extent(renderer).width + 3 <= abs(px[1][0] - px[0][0])


def _pack(items, lo, hi, pad=4.0):
    """Left edges (display px) for texts ``[(anchor_center, width)]`` sorted by anchor, so that
    none overlap and all lie in ``[lo, hi]`` where possible."""
    lefts, right = [], lo
    for c, w in items:
        x = max(c - w / 2, right + pad if lefts else lo)
        lefts.append(x)
        right = x + w
    nxt = hi
    for k in range(len(items) - 1, -1, -1):
        w = items[k][1]
        lefts[k] = max(lo, min(lefts[k], nxt - w))
        nxt = lefts[k] - pad
    return lefts


def _draw_lanes(ax, events, lanes, k, bars, rank, colors):
    """Bars of ``events`` on ``ax`` (one row per lane, sub-rows for overlapping events);
    appends each drawn bar to ``bars``; returns ``[(event, patch, lane index)]``."""
    drawn = []
    for li, lane in enumerate(lanes):
        evs = sorted((e for e in events if e.get("lane") == lane and _drawn(e)),
                     key=lambda e: (e["start"], -e["finish"]))
        rows = _subrows(evs)
        n = max(rows, default=0) + 1
        # the lane's upper part is its label band (y is inverted: up = smaller y)
        top, height = li + _BAR_TOP, 0.45 - _BAR_TOP
        h = height / n
        for e, row in zip(evs, rows):
            color = colors[_color_key(e)][0]
            call = e.get("kind") == "call"
            # a call's edge in its own colour: a bar thinner than a pixel (or a call that took
            # no time) is a line of that colour
            (patch,) = ax.barh(top + row * h + h / 2, k * (e["finish"] - e["start"]),
                               left=k * e["start"], height=h * 0.92, color=color,
                               edgecolor=color if call else "black",
                               linewidth=0.8 if call else 0.3)
            patch.set_gid(str(e.get("label", "")))
            drawn.append((e, patch, li))
            bars.append({"rank": rank, "lane": lane, "label": e.get("label", ""),
                         "kind": e.get("kind"), "phase": e.get("phase"),
                         "start": e["start"], "finish": e["finish"],
                         "bytes": e.get("nbytes") if call else None,
                         "algorithm": e.get("algorithm") if call else None})
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    return drawn


def _label_bars(fig, ax, drawn) -> list[str]:
    """Names on the bars: a compute bar gets its layer's name (``forward:conv1`` -> ``conv1``) or
    its label inside when it fits (every bar is also named by its colour in the legend); the
    calls of one phase and size on one lane get one name above the lane with their bytes
    (``phase ×n`` when the phase runs n times), packed so that no two names overlap, with an
    arrow in the phase's colour to each of its bars.  Returns the texts written."""
    renderer = fig.canvas.get_renderer()
    x0, x1 = ax.get_xlim()
    written, above = [], {}
    for e, patch, li in drawn:
        a, b = max(patch.get_x(), x0), min(patch.get_x() + patch.get_width(), x1)
        label = str(e.get("label", ""))
        if e.get("kind") == "call":
            if b >= a:
                key = (li, _color_key(e)[1], _call_bytes(e))
                above.setdefault(key, []).append((label, patch))
            continue
        if b <= a:
            continue
        short = label.split(":", 1)[1] if _color_key(e)[0] == "pass" else label
        t = ax.text((a + b) / 2, patch.get_y() + patch.get_height() / 2, short, ha="center",
                    va="center", fontsize=6.5, clip_on=True)
        if _fits(ax, renderer, t, a, b):
            written.append(short)
        else:
            t.remove()
    lo, hi = ax.transAxes.transform([(0, 0), (1, 0)])[:, 0]
    inv = ax.transData.inverted()
    by_lane = {}
    for (li, phase, nb), items in above.items():
        name = items[0][0] if len(items) == 1 else f"{phase} ×{len(items)}"
        text = name + (f": {nb}" if nb else "")
        centre = sum(ax.transData.transform((p.get_x() + p.get_width() / 2, 0))[0]
                     for _, p in items) / len(items)
        by_lane.setdefault(li, []).append((centre, text, [p for _, p in items]))
    for li, groups in by_lane.items():
        groups.sort(key=lambda g: g[0])
        texts = []
        for centre, text, patches in groups:
            t = ax.text(0, _LABEL_Y + li, text, fontsize=6.5, va="center", ha="left")
            texts.append((t, centre, t.get_window_extent(renderer).width, text, patches))
        lefts = _pack([(c, w) for _, c, w, _, _ in texts], lo, hi)
        for (t, _, tw, text, patches), left in zip(texts, lefts):
            t.set_x(inv.transform((left, 0))[0])
            for patch in patches:
                # the arrow leaves the text at the point nearest the bar
                cx = ax.transData.transform((patch.get_x() + patch.get_width() / 2, 0))[0]
                start = inv.transform((min(max(cx, left + 2), left + tw - 2), 0))[0]
                ax.annotate("", xy=(patch.get_x() + patch.get_width() / 2, patch.get_y()),
                            xytext=(start, _LABEL_Y + li + 0.08),
                            arrowprops={"arrowstyle": "-|>", "lw": 0.6, "mutation_scale": 7,
                                        "color": patch.get_facecolor(), "shrinkA": 0,
                                        "shrinkB": 0})
            written.append(text)
    return written


def plot_gantt(run_dir, path, step: int | None = None) -> Plot:
    """Gantt chart of the last simulated step of the run loop (see the module docstring): one
    panel per rank kept (rank 0 and the rank that ended the step last), one row per event lane
    it used, every bar coloured by its pass (per-layer forward/backward), compute block or call
    phase and named in the legend, named inside where the name fits, and the calls of each
    phase labelled once above their lane with their bytes and an arrow to each bar (bars too
    thin to see included).  The figure says how compute was timed (the run's compute source)
    and where the calls were simulated.  Times in s / ms / µs by magnitude, each rank's from the
    moment it ended the step before.

    ``data``: ``{"step", "step_s", "slowest_rank", "unit", "factor" (seconds x factor = axis
    units), "lanes": {rank name: [lane, ...]}, "bars": [{"rank", "lane", "label", "kind",
    "phase", "start", "finish", "bytes", "algorithm"}], "labels": {rank name: [texts
    written]}}``.
    """
    data = step_events(run_dir, step)
    plt = _pyplot()
    ranks, k_step = data["ranks"], data["step"]
    lanes = {name: [ln for ln in LANES if any(e.get("lane") == ln and _drawn(e) for e in evs)]
             for name, evs in ranks.items()}
    end = max((e["finish"] for evs in ranks.values() for e in evs if _drawn(e)),
              default=0.0) or 1.0
    unit, k = time_unit(end)
    heights = [max(1, len(v)) for v in lanes.values()]
    fig, axes = plt.subplots(len(ranks), 1, figsize=(12, 1.6 + sum(0.62 * h + 0.55
                                                                    for h in heights)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    bars, drawn_by, colors = [], [], _colors(ranks)
    for ax, (name, events) in zip(axes[:, 0], ranks.items()):
        ax.set_gid(f"gantt:{name}")
        drawn_by.append((ax, name, _draw_lanes(ax, events, lanes[name], k, bars, name, colors)))
        ax.set_xlim(0, k * end * 1.01)
        span = max((e["finish"] for e in events if _drawn(e)), default=None)
        ax.set_title(f"{name}: step {k_step}" +
                     (f", its last event ends {fmt_time(span)} after it ended the step before"
                      if span else ""), fontsize=9)
        ax.set_xlabel(f"simulated time from the rank's end of the step before ({unit})",
                      fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=lb) for c, lb in colors.values()]
    ncol = max(1, min(len(handles), 6))
    fig.legend(handles=handles, fontsize=7, loc="upper center", ncol=ncol,
               bbox_to_anchor=(0.5, 1.0), frameon=False)
    top = 1 - (0.25 + 0.17 * math.ceil(len(handles) / ncol)) / fig.get_figheight()
    job = (f"job step {k_step}: {fmt_time(data['step_s'])} (from the moment the last rank "
           f"ended the step before to the moment rank {data['slowest_rank']} ended this one)")
    fig.text(0.5, 0.005, "\n".join([job, _compute_statement(data["compute_source"]),
                                    _comm_statement(data["clock"]), _LANE_NOTE]),
             ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, top))
    labels = {name: _label_bars(fig, ax, drawn) for ax, name, drawn in drawn_by}
    return _save(fig, path, {"step": k_step, "step_s": data["step_s"],
                             "slowest_rank": data["slowest_rank"], "unit": unit, "factor": k,
                             "lanes": lanes, "bars": bars, "labels": labels}, tight=False)


def _load_scale(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: write it with `python -m commvol scale ... "
                         "--out FILE`")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): write it again with `python -m "
                         "commvol scale ... --out FILE`") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("systems"), dict) or \
            not doc["systems"]:
        raise ValueError(f"{path} has no 'systems' rows: it is not the output of `python -m "
                         "commvol scale --out`")
    return doc


def plot_scaling(scale, path) -> Plot:
    """Speedup and efficiency from a scale JSON (a path or the dict ``commvol scale`` returns):
    :func:`commvol.report.plot_scaling` (modeled lines, the paper's measured points)."""
    doc = scale if isinstance(scale, dict) else _load_scale(scale)
    return _report_plot_scaling(doc, path)


def tta_points(run_dir) -> tuple[str, list[float], list[float]]:
    """``(method, simulated seconds, test accuracy)`` of the logged lines of a run.

    Raises
    ------
    ValueError
        When the directory, ``summary.json`` or every line with both ``sim_s`` and
        ``test_accuracy`` is missing, or the run was recorded by an older spardist (its
        ``sim_s`` is another clock's), naming the path and the fix.
    """
    r = load_run(_run_dir(run_dir))
    run_clock(r)
    xs, ys = [], []
    for ln in r.lines:
        t, acc = ln.get("sim_s"), ln.get("test_accuracy")
        if isinstance(t, (int, float)) and isinstance(acc, (int, float)) and \
                math.isfinite(t) and math.isfinite(acc):
            xs.append(float(t))
            ys.append(float(acc))
    if not xs:
        raise ValueError(f"{r.path / 'metrics.jsonl'} has no line with both sim_s and "
                         "test_accuracy: run the trainer with evaluations (e.g. --eval-every N) "
                         "to log them")
    return r.method, xs, ys


def plot_tta(run_dirs, path, target: float | None = None) -> Plot:
    """Test accuracy against simulated time (s / ms / µs by magnitude), one curve per run
    labelled by its method (and its directory where two runs share a method); the footer says
    how each run's compute was timed and on which network its calls were simulated.

    ``data``: ``{"unit", "factor", "curves": {label: (sim seconds, accuracy)}}``.
    """
    if not run_dirs:
        raise ValueError("plot-tta needs at least one RUN_DIR")
    curves = [tta_points(d) for d in run_dirs]
    runs = [load_run(d) for d in run_dirs]
    clocks = [run_clock(r) for r in runs]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    unit, k = time_unit(max(max(xs) for _, xs, _ in curves))
    data = {"unit": unit, "factor": k, "curves": {}}
    for lb, (_, xs, ys) in zip(run_labels(runs), curves):
        data["curves"][lb] = (xs, ys)
        ax.plot([k * x for x in xs], ys, "o-", markersize=3, label=lb)
    if target is not None:
        ax.axhline(target, color="k", linestyle=":", linewidth=0.8, label=f"target {target:g}")
    ax.set(title="time to accuracy (simulated clock)",
           xlabel=f"simulated time, sim_s ({unit})", ylabel="test accuracy")
    ax.legend(fontsize=7)
    sources = sorted({_compute_statement(c.get("compute_source", "?")) for c in clocks})
    networks = sorted({str((c.get("network") or {}).get("name", "the run's network"))
                       for c in clocks})
    fig.text(0.5, 0.005, "; ".join(sources) + "\ncommunication simulated with every rank's "
             f"messages (job simulation) on {'; '.join(networks)}", ha="center", va="bottom",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, path, data, tight=False)


# -- CLI ---------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    g = sub.add_parser("gantt", help="Gantt chart of the last step (rank 0 and the slowest rank)",
                       description=__doc__, formatter_class=raw)
    g.add_argument("run", type=Path, metavar="RUN_DIR")
    g.add_argument("--step", type=int, default=None,
                   help="the step summary.json keeps (default: it, the last of the run loop)")
    g.add_argument("--out", type=Path, default=None, help="PNG (default RUN_DIR/gantt.png)")
    g.set_defaults(func=run_gantt)
    s = sub.add_parser("plot-scaling", help="speedup/efficiency plot of `commvol scale --out`",
                       description=__doc__, formatter_class=raw)
    s.add_argument("scale", type=Path, metavar="SCALE_JSON")
    s.add_argument("--out", type=Path, default=Path("results") / "commvol_plots" /
                   "scaling.png", help="PNG (default %(default)s)")
    s.set_defaults(func=run_scaling)
    t = sub.add_parser("plot-tta", help="time to accuracy of runs (accuracy vs simulated s)",
                       description=__doc__, formatter_class=raw)
    t.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR")
    t.add_argument("--target", type=float, default=None, help="draw this accuracy as a line")
    t.add_argument("--out", type=Path, default=Path("results") / "commvol_plots" / "tta.png",
                   help="PNG (default %(default)s)")
    t.set_defaults(func=run_tta)


def run_gantt(args) -> Plot:
    out = args.out or Path(args.run) / "gantt.png"
    p = plot_gantt(args.run, out, args.step)
    print(f"wrote {p.path}")
    return p


def run_scaling(args) -> Plot:
    p = plot_scaling(args.scale, args.out)
    print(f"wrote {p.path}")
    return p


def run_tta(args) -> Plot:
    p = plot_tta(args.runs, args.out, args.target)
    print(f"wrote {p.path}")
    return p
