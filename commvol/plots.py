"""Plots from the event timeline: ``python -m commvol {gantt,plot-scaling,plot-tta}``.

``gantt RUN_DIR [--step N] [--out PNG]``
    A Gantt chart of one step of rank 0 and of the busiest rank, one lane per resource of the
    timeline that has events in the step (``compute``, ``offload``, ``intra``, ``inter``; empty
    lanes are left out), from the ``timeline`` block of the run's ``summary.json``
    (``rank0.events`` / ``busiest.events``: label, kind, resource, start, finish of the last
    closed step; a ``step_events`` map ``{step: {"rank0": [...], "busiest": [...]}}``, when a
    trainer writes one, gives other steps).  Bars are coloured by pass, phase or link class (the
    legend names each) and carry their name where it fits; the transfers of each phase are named
    once with their bytes (the ledger's per call of the phase, or the events' own ``nbytes``)
    and an arrow to each bar.  Transfers in flight at the same time on one link are drawn in
    sub-rows of its lane (they share its bandwidth).  The figure states that compute is measured
    (or replayed, or FLOP-modeled: the run's compute source) and communication modeled.
``plot-scaling SCALE_JSON [--out PNG]``
    Speedup and parallel efficiency from ``python -m commvol scale --out``: modeled lines (the
    timeline solid, its no-overlap sum dashed) and, when the JSON carries them, the paper's
    measured speedups as stars, each labelled modeled or measured with the paper's figure.
``plot-tta RUN_DIR... [--out PNG] [--target ACC]``
    Time to accuracy: test accuracy against simulated time (``sim_s``, in s / ms / µs by
    magnitude) of every logged line of ``metrics.jsonl``, one curve per run.

Each plotting function returns a :class:`commvol.report.Plot` (PNG path, figure, data drawn).

matplotlib is imported only inside the plotting functions (Agg backend, headless).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

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
    "step_events",
    "tta_points",
]

#: Lanes of the Gantt chart: the timeline's streams and link classes
LANES = ("compute", "offload", "intra", "inter")
_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "compute": "tab:gray",
           "offload": "tab:purple", "intra": "tab:green", "inter": "tab:red"}


def _run_dir(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: pass a run directory (the --out of "
                         "hsadmm/dataparallel train)")
    return path


def step_events(run_dir, step: int | None = None) -> dict:
    """``{"step": N, "ranks": {"rank 0": events, "rank R (busiest)": events}}`` of one step of a
    run, from ``summary.json``'s ``timeline`` block.

    Raises
    ------
    ValueError
        Naming the path and the fix, when the directory or ``summary.json`` is missing, the run
        used the additive clock, the block has no events, or ``step`` is not recorded.
    """
    r = load_run(_run_dir(run_dir))
    tl = r.summary.get("timeline")
    s = r.path / "summary.json"
    if not isinstance(tl, dict) or tl.get("mode") != "timeline":
        raise ValueError(f"{s} has no timeline events (clock "
                         f"{tl.get('mode') if isinstance(tl, dict) else 'missing'}): run the "
                         "trainer with --clock timeline (the default) to record them")
    last = int(tl.get("steps", 0))
    by_step = tl.get("step_events") or {}
    if step is None or (step == last and str(step) not in by_step):
        blocks, step = {"rank0": tl.get("rank0"), "busiest": tl.get("busiest")}, last
    elif str(step) in by_step:
        blocks = by_step[str(step)]
    else:
        have = sorted({last, *(int(k) for k in by_step)})
        raise ValueError(f"{s} records the events of step(s) {have} only, not step {step}: pass "
                         f"--step {have[-1]} or omit --step (the last step)")
    ranks = {}
    rank0 = (blocks or {}).get("rank0")
    if not isinstance(rank0, dict) or not rank0.get("events"):
        raise ValueError(f"{s}'s timeline block has no rank0.events: the run predates per-event "
                         "records; run it again with the current trainer (--clock timeline)")
    ranks["rank 0"] = rank0["events"]
    step_s = {"rank 0": rank0.get("step_s")}
    busiest = (blocks or {}).get("busiest")
    b = tl.get("busiest_rank")
    if isinstance(busiest, dict) and busiest.get("events") and b not in (None, 0):
        ranks[f"rank {b} (busiest)"] = busiest["events"]
        step_s[f"rank {b} (busiest)"] = busiest.get("step_s")
    return {"step": step, "ranks": ranks, "step_s": step_s,
            "compute_source": tl.get("compute_source", "?")}


def _subrows(events) -> list[int]:
    """Greedy sub-row of each interval so that overlapping ones do not share a row."""
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


#: colours: per-layer compute by pass, transfers by link class, other events by their phase
_PASS_COLORS = {"forward": ("tab:blue", "forward (per layer)"),
                "backward": ("tab:orange", "backward (per layer)")}
_LINK_COLORS = {"intra": ("tab:green", "intra-node transfer"),
                "inter": ("tab:red", "inter-node transfer")}
_PHASE_PALETTE = ("silver", "tab:olive", "tab:cyan", "tab:pink", "tab:brown", "khaki",
                  "lightsteelblue", "thistle", "tan", "darkseagreen", "lightcoral", "gold")

#: a lane's geometry (row li spans li - 0.5 .. li + 0.5): label band centre, top of the bars
_LABEL_Y, _BAR_TOP = -0.3, -0.12


def _color_key(e) -> str:
    """``forward``/``backward`` for a per-layer compute event (``forward:conv1``), the link class
    for a transfer, else the event's phase (``ssf_sparsify[3]`` -> ``ssf_sparsify``)."""
    lane, label = e.get("resource"), str(e.get("label", ""))
    if lane in _LINK_COLORS:
        return lane
    kind = label.split(":")[0]
    if kind in _PASS_COLORS and ":" in label:
        return kind
    return _phase_of(label)


def _colors(ranks: dict) -> dict:
    """``{colour key: (colour, legend label)}`` of the drawn events, in legend order: passes,
    phases (by first appearance), link classes."""
    keys = [_color_key(e) for evs in ranks.values() for e in evs
            if e.get("resource") in LANES and e.get("finish", 0) > e.get("start", 0)]
    phases = [k for k in dict.fromkeys(keys) if k not in _PASS_COLORS and k not in _LINK_COLORS]
    out = {k: v for k, v in _PASS_COLORS.items() if k in keys}
    out.update({ph: (_PHASE_PALETTE[i % len(_PHASE_PALETTE)], ph) for i, ph in enumerate(phases)})
    out.update({k: v for k, v in _LINK_COLORS.items() if k in keys})
    return out


def _phase_of(label: str) -> str:
    """Ledger phase of a transfer's label: ``inter_allreduce[1]`` / ``p2p->3`` -> the phase."""
    return str(label).split("->")[0].split("[")[0]


def _transfer_bytes(e, by_phase: dict) -> str | None:
    """Bytes of a transfer bar: the event's own ``nbytes`` when the timeline recorded it, else
    the ledger's bytes of its phase per call, summed over ranks (``traffic.measured.by_phase``)."""
    if isinstance(e.get("nbytes"), (int, float)):
        return fmt_bytes(e["nbytes"])
    ph = by_phase.get(_phase_of(e.get("label", "")))
    if not isinstance(ph, dict) or not ph.get("calls"):
        return None
    n = ph["calls"]
    inter, intra = ph.get("inter_bytes", 0) / n, ph.get("intra_bytes", 0) / n
    if inter and intra:
        return f"{fmt_bytes(inter)} inter + {fmt_bytes(intra)} intra per call"
    return f"{fmt_bytes(inter or intra)} per call"


def _compute_statement(source: str) -> str:
    """What the compute bars are: measured (CPU/GPU time), replayed from a profile, or modeled
    from FLOP counts, from the run's ``timeline.compute_source``."""
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


def _comm_statement(summary: dict) -> str:
    cm = summary.get("cost_model") or {}
    if {"inter_gbps", "intra_gbps"} <= set(cm):
        links = (f"inter {cm['inter_gbps']:g} Gbit/s + {cm.get('inter_lat_us', 0):g} µs, intra "
                 f"{cm['intra_gbps']:g} Gbit/s + {cm.get('intra_lat_us', 0):g} µs")
    else:
        links = "alpha-beta per link class"
    return (f"communication modeled ({links}; transfers in flight share a link's bandwidth); "
            "bytes: each transfer's own (its call record), else the ledger's per call of the "
            "phase")


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


def _draw_lanes(ax, events, lanes, k, bars, rank, by_phase, colors):
    """Bars of ``events`` on ``ax`` (one row per lane, sub-rows for concurrent transfers);
    appends each drawn bar to ``bars``; returns ``[(event, patch, lane index)]``."""
    drawn = []
    for li, lane in enumerate(lanes):
        evs = sorted((e for e in events if e.get("resource") == lane
                      and e.get("finish", 0) > e.get("start", 0)), key=lambda e: e["start"])
        rows = _subrows(evs)
        n = max(rows, default=0) + 1
        transfer = lane in ("intra", "inter")
        # the lane's upper part is its label band (y is inverted: up = smaller y)
        top, height = li + _BAR_TOP, 0.45 - _BAR_TOP
        h = height / n
        for e, row in zip(evs, rows):
            color = colors[_color_key(e)][0]
            # a transfer's edge in its own colour: a bar thinner than a pixel stays that colour
            (patch,) = ax.barh(top + row * h + h / 2, k * (e["finish"] - e["start"]),
                               left=k * e["start"], height=h * 0.92, color=color,
                               edgecolor=color if transfer else "black", linewidth=0.3)
            patch.set_gid(str(e.get("label", "")))
            drawn.append((e, patch, li))
            bars.append({"rank": rank, "lane": lane, "label": e.get("label", ""),
                         "start": e["start"], "finish": e["finish"],
                         "bytes": _transfer_bytes(e, by_phase) if transfer else None})
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    return drawn


def _label_bars(fig, ax, drawn, by_phase) -> list[str]:
    """Names on the bars: a compute bar gets its layer's name (``forward:conv1`` -> ``conv1``) or
    its label inside when it fits (every bar is also named by its colour in the legend); the
    transfers of one phase on one lane get one name above the lane with their bytes (``phase
    x n`` when the phase runs n times), packed so that no two names overlap, with an arrow in
    the link's colour to each of its bars.  Returns the texts written."""
    renderer = fig.canvas.get_renderer()
    x0, x1 = ax.get_xlim()
    written, above = [], {}
    for e, patch, li in drawn:
        a, b = max(patch.get_x(), x0), min(patch.get_x() + patch.get_width(), x1)
        if b <= a:
            continue
        label = str(e.get("label", ""))
        if e.get("resource") in _LINK_COLORS:
            key = (li, _phase_of(label), _transfer_bytes(e, by_phase))
            above.setdefault(key, []).append((label, patch))
            continue
        short = label.split(":", 1)[1] if _color_key(e) in _PASS_COLORS else label
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
    """Gantt chart of one step (see the module docstring): one panel per rank (rank 0 and the
    busiest), one row per lane that has events (empty lanes are left out), every bar coloured
    by its pass (per-layer forward/backward), phase or link class and named in the legend, named
    inside where the name fits, and the transfers of each phase labelled once above their lane
    with their bytes and an arrow to each bar (bars too thin to see included).  The figure says
    what is measured (compute, per the run's compute source) and what is modeled
    (communication).  Times in s / ms / µs by magnitude.

    ``data``: ``{"step", "unit", "factor" (seconds x factor = axis units), "lanes": {rank name:
    [lane, ...]}, "bars": [{"rank", "lane", "label", "start", "finish", "bytes"}], "labels":
    {rank name: [texts written]}}``.
    """
    data = step_events(run_dir, step)
    summary = load_run(_run_dir(run_dir)).summary
    by_phase = ((summary.get("traffic") or {}).get("measured") or {}).get("by_phase") or {}
    plt = _pyplot()
    ranks = data["ranks"]
    lanes = {name: [ln for ln in LANES if any(e.get("resource") == ln and
                                              e.get("finish", 0) > e.get("start", 0)
                                              for e in evs)] for name, evs in ranks.items()}
    end = max((e["finish"] for evs in ranks.values() for e in evs), default=0.0) or 1.0
    unit, k = time_unit(end)
    heights = [max(1, len(v)) for v in lanes.values()]
    fig, axes = plt.subplots(len(ranks), 1, figsize=(12, 1.4 + sum(0.62 * h + 0.55
                                                                    for h in heights)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    bars, drawn_by, colors = [], [], _colors(ranks)
    for ax, (name, events) in zip(axes[:, 0], ranks.items()):
        ax.set_gid(f"gantt:{name}")
        drawn_by.append((ax, name, _draw_lanes(ax, events, lanes[name], k, bars, name,
                                               by_phase, colors)))
        ax.set_xlim(0, k * end * 1.01)
        step_s = data.get("step_s", {}).get(name)
        ax.set_title(f"{name}: step {data['step']}" +
                     (f", {fmt_time(step_s)} on the critical path" if step_s else ""),
                     fontsize=9)
        ax.set_xlabel(f"simulated time in the step ({unit})", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=lb) for c, lb in colors.values()]
    ncol = min(len(handles), 7)
    fig.legend(handles=handles, fontsize=7, loc="upper center", ncol=ncol,
               bbox_to_anchor=(0.5, 1.0), frameon=False)
    top = 1 - (0.25 + 0.17 * math.ceil(len(handles) / ncol)) / fig.get_figheight()
    fig.text(0.5, 0.005, f"{_compute_statement(data['compute_source'])}\n"
             f"{_comm_statement(summary)}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, top))
    labels = {name: _label_bars(fig, ax, drawn, by_phase) for ax, name, drawn in drawn_by}
    return _save(fig, path, {"step": data["step"], "unit": unit, "factor": k, "lanes": lanes,
                             "bars": bars, "labels": labels}, tight=False)


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
        ``test_accuracy`` is missing (naming the path and the fix).
    """
    r = load_run(_run_dir(run_dir))
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
    labelled by its method (and its directory where two runs share a method).

    ``data``: ``{"unit", "factor", "curves": {label: (sim seconds, accuracy)}}``.
    """
    if not run_dirs:
        raise ValueError("plot-tta needs at least one RUN_DIR")
    curves = [tta_points(d) for d in run_dirs]
    runs = [load_run(d) for d in run_dirs]
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
    sources = sorted({_compute_statement((r.summary.get("timeline") or {}).get(
        "compute_source", "?")) for r in runs})
    fig.text(0.5, 0.005, "; ".join(sources) + "\ncommunication modeled (alpha-beta per link "
             "class) on the event timeline", ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, path, data, tight=False)


# -- CLI ---------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    g = sub.add_parser("gantt", help="Gantt chart of one step (rank 0 and the busiest rank)",
                       description=__doc__, formatter_class=raw)
    g.add_argument("run", type=Path, metavar="RUN_DIR")
    g.add_argument("--step", type=int, default=None,
                   help="step to draw (default: the last, the one summary.json records)")
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
