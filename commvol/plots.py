"""Plots from the event timeline: ``python -m commvol {gantt,plot-scaling,plot-tta}``.

``gantt RUN_DIR [--step N] [--out PNG]``
    A Gantt chart of one step of rank 0 and of the busiest rank, one lane per resource of the
    timeline (``compute``, ``offload``, ``intra``, ``inter``), from the ``timeline`` block of the
    run's ``summary.json`` (``rank0.events`` / ``busiest.events``: label, kind, resource, start,
    finish of the last closed step; a ``step_events`` map ``{step: {"rank0": [...], "busiest":
    [...]}}``, when a trainer writes one, gives other steps).  Transfers in flight at the same time
    on one link are drawn in sub-rows of its lane (they share its bandwidth).
``plot-scaling SCALE_JSON [--out PNG]``
    Speedup and parallel efficiency from ``python -m commvol scale --out``: the timeline (solid),
    its no-overlap sum (dashed) and the paper's measured speedups when the JSON carries them.
``plot-tta RUN_DIR... [--out PNG] [--target ACC]``
    Time to accuracy: test accuracy against simulated seconds (``sim_s``) of every logged line of
    ``metrics.jsonl``, one curve per run.

matplotlib is imported only inside the plotting functions (Agg backend, headless).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .report import _pyplot, _save, load_run

__all__ = ["LANES", "step_events", "plot_gantt", "plot_scaling", "tta_points", "plot_tta",
           "add_parser"]

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
    busiest = (blocks or {}).get("busiest")
    b = tl.get("busiest_rank")
    if isinstance(busiest, dict) and busiest.get("events") and b not in (None, 0):
        ranks[f"rank {b} (busiest)"] = busiest["events"]
    return {"step": step, "ranks": ranks, "compute_source": tl.get("compute_source", "?")}


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


def plot_gantt(run_dir, path, step: int | None = None) -> Path:
    """Gantt chart of one step (see the module docstring); returns the PNG path."""
    data = step_events(run_dir, step)
    plt = _pyplot()
    ranks = data["ranks"]
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 1.0 + 1.6 * len(ranks)), squeeze=False,
                             sharex=True)
    unit, scale = "ms", 1e3
    for ax, (name, events) in zip(axes[:, 0], ranks.items()):
        for lane_i, lane in enumerate(LANES):
            evs = sorted((e for e in events if e.get("resource") == lane
                          and e.get("finish", 0) > e.get("start", 0)), key=lambda e: e["start"])
            rows = _subrows(evs)
            n = max(rows, default=0) + 1
            h = 0.8 / n
            for e, k in zip(evs, rows):
                kind = str(e.get("label", "")).split(":")[0]
                color = _COLORS.get(kind if lane == "compute" else lane, "tab:gray")
                ax.broken_barh([(scale * e["start"], scale * (e["finish"] - e["start"]))],
                               (lane_i - 0.4 + k * h, h * 0.95), facecolors=color,
                               edgecolors="black", linewidth=0.2)
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{name}: step {data['step']}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"simulated time in the step ({unit}); compute source: "
                           f"{data['compute_source']}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    axes[0, 0].legend(handles, list(_COLORS), fontsize=7, loc="upper left",
                      bbox_to_anchor=(1.005, 1.0))
    return _save(fig, path, {})


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


def plot_scaling(scale, path) -> Path:
    """Speedup and efficiency (timeline solid, no-overlap dashed, paper points) from a scale
    JSON (a path or the dict ``commvol scale`` returns)."""
    doc = scale if isinstance(scale, dict) else _load_scale(scale)
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    gpus: set[int] = set()
    for i, (name, rows) in enumerate(doc["systems"].items()):
        c = f"C{i}"
        g = [r["gpus"] for r in rows]
        gpus |= set(g)
        a.plot(g, [r["speedup"] for r in rows], "o-", color=c, label=f"{name} (timeline)")
        b.plot(g, [100 * r["efficiency"] for r in rows], "o-", color=c, label=name)
        if all("no_overlap_speedup" in r for r in rows):
            a.plot(g, [r["no_overlap_speedup"] for r in rows], "--", color=c, alpha=0.6,
                   label=f"{name} (no overlap)")
            b.plot(g, [100 * r["no_overlap_efficiency"] for r in rows], "--", color=c,
                   alpha=0.6)
        paper = (doc.get("paper") or {}).get("speedup", {})
        if name in paper:
            p0, p1 = (doc.get("paper") or {}).get("gpus", [min(g), max(g)])
            a.plot([p1], [paper[name]], "*", color=c, markersize=13,
                   label=f"{name} (paper)")
            b.plot([p1], [100 * paper[name] * p0 / p1], "*", color=c, markersize=13)
    if gpus:
        xs = sorted(gpus)
        a.plot(xs, [x / xs[0] for x in xs], "k:", label="ideal")
    a.set(title=f"(a) speedup ({doc.get('model', '')})", xlabel="GPUs", ylabel="speedup")
    b.set(title="(b) parallel efficiency", xlabel="GPUs", ylabel="%", ylim=(0, 105))
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    return _save(fig, path, {})


def tta_points(run_dir) -> tuple[str, list[float], list[float]]:
    """``(label, simulated seconds, test accuracy)`` of the logged lines of a run.

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
    return f"{r.method} ({r.path.name})", xs, ys


def plot_tta(run_dirs, path, target: float | None = None) -> Path:
    """Test accuracy against simulated seconds, one curve per run."""
    if not run_dirs:
        raise ValueError("plot-tta needs at least one RUN_DIR")
    curves = [tta_points(d) for d in run_dirs]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, xs, ys in curves:
        ax.plot(xs, ys, "o-", markersize=3, label=label)
    if target is not None:
        ax.axhline(target, color="k", linestyle=":", linewidth=0.8, label=f"target {target:g}")
    ax.set(title="time to accuracy (simulated clock)", xlabel="simulated seconds (sim_s)",
           ylabel="test accuracy")
    ax.legend(fontsize=7)
    return _save(fig, path, {})


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


def run_gantt(args) -> Path:
    out = args.out or Path(args.run) / "gantt.png"
    p = plot_gantt(args.run, out, args.step)
    print(f"wrote {p.path}")
    return p


def run_scaling(args) -> Path:
    p = plot_scaling(args.scale, args.out)
    print(f"wrote {p.path}")
    return p


def run_tta(args) -> Path:
    p = plot_tta(args.runs, args.out, args.target)
    print(f"wrote {p.path}")
    return p
