"""``python -m commvol report RUN_DIR...``: one comparison table of finished runs, and plots.

Reads every run's ``summary.json`` and ``metrics.jsonl`` (``hsadmm train`` logs one line per
outer ``iteration``, ``dataparallel train`` one per evaluation interval of ``step``\\ s, both with
``test_accuracy``, the interval's ``inter_node_bytes`` and the cumulative simulated clock
``sim_s``) and prints, per run: final test accuracy, total and per-iteration (per step for
data-parallel runs) inter-node bytes, the inter-node payload ratio (H-SADMM: compact / dense
elements of the last iteration; data-parallel: the strategy's ``payload_ratio``), modeled
communication time, simulated and wall time, simulated time to ``--target`` accuracy (first
logged line at or above it), total inter-node bytes relative to a ``ddp`` run, and whether the
ledger's bytes equal the closed-form prediction.

Times print in s, ms or µs by magnitude (:func:`fmt_time`); "inter-node bytes" are the bytes
each rank handed to MPI across node-crossing links, summed over ranks, as the ledger booked them
(:data:`LEDGER_BYTES`).

Plots (matplotlib, Agg backend; PNG under ``--out``; each function returns a :class:`Plot`: the
PNG, the figure and the numbers drawn): ``payload.png`` (PruneX Fig. 6a: compact vs dense payload
per H-SADMM iteration, and inter-node bytes per epoch of every run), ``accuracy_vs_bytes.png``
(Fig. 5b, log bytes axis), ``comm_breakdown.png`` (Fig. 8: modeled communication time by phase),
``residuals.png`` (Figs. 10/11: per-layer ``r_intra``/``r_inter`` of ADMM runs, named by the
model's layers; a residual that is zero throughout is said, not drawn) and ``scaling.png`` (Fig.
9, from ``python -m commvol scale --out``: modeled lines, the paper's measured points).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from hsadmm.penalty import penalty_groups
from runner.metrics import write_csv

from .predict import fmt_bytes
from .specs import resolve_model

__all__ = [
    "LEDGER_BYTES",
    "Plot",
    "RunData",
    "add_parser",
    "comparison_table",
    "draw_report",
    "fmt_time",
    "load_run",
    "plot_accuracy_vs_bytes",
    "plot_comm_breakdown",
    "plot_payload",
    "plot_residuals",
    "plot_scaling",
    "run",
    "run_labels",
    "time_to_target",
    "time_unit",
    "write_plots",
]


@dataclass
class RunData:
    """A finished run: its directory, ``summary.json`` and ``metrics.jsonl`` lines."""

    path: Path
    summary: dict
    lines: list

    @property
    def method(self) -> str:
        return str(self.summary.get("method", self.path.name))

    @property
    def system(self) -> str:
        return str(self.summary.get("system", "?"))

    @property
    def unit(self) -> str:
        """What one logged unit of progress is: ``step`` (data parallel) or ``iteration``."""
        return "step" if self.system == "dataparallel" else "iteration"

    @property
    def units(self) -> int:
        m = self.summary.get("metrics", {})
        n = m.get("steps") if self.unit == "step" else m.get("iterations")
        if n is None and self.lines:
            last = self.lines[-1]
            n = last.get("step", last.get("iteration", len(self.lines) - 1) + 1)
        return int(n or 0)


def load_run(path) -> RunData:
    """Read a run directory.

    Raises
    ------
    ValueError
        If ``path`` has no ``summary.json`` (not a finished run), or ``summary.json`` or a line
        of ``metrics.jsonl`` is not valid JSON (naming the file).
    """
    path = Path(path)
    s = path / "summary.json"
    if not s.is_file():
        raise ValueError(f"{path} has no summary.json: pass finished run directories (the --out "
                         "of hsadmm/dataparallel/sparse_sgd train)")
    try:
        summary = json.loads(s.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{s} is not valid JSON ({exc}): the file is damaged; run the command "
                         "that wrote it again (with --overwrite)") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{s} holds a JSON {type(summary).__name__}, not a run summary "
                         "object: run the command that wrote it again (with --overwrite)")
    m = path / "metrics.jsonl"
    lines = []
    if m.is_file():
        for lineno, text in enumerate(m.read_text().splitlines(), start=1):
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{m}:{lineno} is not valid JSON ({exc}): the file is "
                                 "damaged; run the command that wrote it again (with "
                                 "--overwrite)") from None
    return RunData(path, summary, lines)


def _acc(v) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return v


def time_to_target(lines: list, target: float) -> float | None:
    """Simulated seconds (``sim_s``) of the first metrics line with ``test_accuracy >= target``;
    ``None`` if never reached."""
    for ln in lines:
        a = _acc(ln.get("test_accuracy"))
        if not math.isnan(a) and a >= target and "sim_s" in ln:
            return float(ln["sim_s"])
    return None


def _payload_ratio(r: RunData):
    for ln in reversed(r.lines):
        if ln.get("dense_elems"):
            return ln["compact_elems"] / ln["dense_elems"]
    return r.summary.get("metrics", {}).get("payload_ratio")


def _matches(r: RunData) -> str:
    t = r.summary.get("traffic", {})
    m, p = t.get("measured", {}), t.get("predicted", {})
    if not p or "inter_node_bytes" not in p:
        return "-"
    same = all(m.get(k) == p.get(k) for k in ("inter_node_bytes", "intra_node_bytes"))
    verdict = "yes" if same else "NO"
    coll = r.summary.get("collectives")
    if coll is not None and not coll.get("verified", False):
        # the ledger booked the bytes, nothing showed the wire carried them (native, unpinned)
        verdict += " (booked, not verified)"
    return verdict


def _gb(n) -> str:
    return fmt_bytes(n)


#: what the ledger's inter-/intra-node numbers are (plots and tables say this, not "wire bytes")
LEDGER_BYTES = ("bytes handed to MPI on node-crossing links, summed over ranks, as booked by the "
                "traffic ledger (what the wire carries where the collectives are exact or "
                "verified)")

#: time units, largest first: a time prints in the largest unit it holds at least once
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def time_unit(seconds: float) -> tuple[str, float]:
    """``(unit, factor)`` for a time of ``seconds`` (e.g. the largest value of an axis): the
    largest of s, ms, µs, ns that it holds at least once; ``seconds * factor`` is in ``unit``."""
    a = abs(float(seconds))
    for name, size in _TIME_UNITS:
        if a >= size:
            return name, 1.0 / size
    return "ns", 1e9


def fmt_time(seconds, digits: int = 3) -> str:
    """``517 µs``, ``4.64 ms``, ``1.19 s``: ``digits`` significant digits in the unit chosen by
    magnitude (:func:`time_unit`); ``-`` for a missing or non-finite value."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(s):
        return "-"
    if s == 0:
        return "0 s"
    if abs(s) >= 1000:
        return f"{s:.0f} s"
    unit, k = time_unit(s)
    v = float(f"{s * k:.{digits}g}")
    if abs(v) >= 1000 and unit != "s":   # 999.7 µs rounds to 1000 µs: print 1.00 ms
        unit, k = time_unit(v / k * 1.0001)
        v = float(f"{s * k:.{digits}g}")
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:.{decimals}f} {unit}"


def comparison_table(run_dirs, target: float = 0.9) -> str:
    """Markdown table comparing finished runs (see the module docstring).

    Parameters
    ----------
    run_dirs : sequence of path or RunData
    target : float
        Accuracy of the simulated time-to-accuracy column.
    """
    if not 0 <= target <= 1:
        raise ValueError(f"--target must be in [0, 1], got {target}")
    runs = [r if isinstance(r, RunData) else load_run(r) for r in run_dirs]
    if not runs:
        raise ValueError("report needs at least one run directory")
    ddp = next((r for r in runs if r.method == "ddp"), None)
    ddp_inter = ddp.summary["traffic"]["measured"]["inter_node_bytes"] if ddp else 0
    head = ("| method | nodes x ranks | final acc | iters/steps | inter-node total | inter / unit "
            f"| payload ratio | comm modeled | sim | wall | sim to {target:g} | "
            "inter vs ddp | measured = predicted |")
    out = [head, ("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
                 "---: | --- |")]
    for r in runs:
        s = r.summary
        topo, timing = s.get("topology", {}), s.get("timing", {})
        inter = s.get("traffic", {}).get("measured", {}).get("inter_node_bytes", 0)
        acc = _acc(s.get("metrics", {}).get("final_test_accuracy"))
        ttt = time_to_target(r.lines, target)
        pr = _payload_ratio(r)
        n = r.units
        out.append(" | ".join([
            f"| {r.method}", f"{topo.get('nodes', '?')} x {topo.get('ranks_per_node', '?')}",
            "-" if math.isnan(acc) else f"{acc:.4f}", f"{n} {r.unit}s",
            _gb(inter), f"{_gb(inter / n)} / {r.unit}" if n else "-",
            "-" if pr is None else f"{pr:.4f}",
            fmt_time(timing.get("comm_modeled_s")), fmt_time(timing.get("sim_s")),
            fmt_time(timing.get("wall_s")), "not reached" if ttt is None else fmt_time(ttt),
            f"{inter / ddp_inter:.3f}" if ddp_inter else "-", _matches(r)]) + " |")
    out.append("")
    out.append(f"inter-node bytes: {LEDGER_BYTES}; payload ratio: inter-node payload / dense "
               "payload (H-SADMM compact elements; Top-K 2K/T); comm modeled: alpha-beta time of "
               "the ledger's calls (a bound: each call alone on its links); sim = the job "
               "simulation of every rank's steps (summary.json clock); wall: measured; time to "
               "accuracy from the logged "
               "evaluations; times in s, ms or µs by magnitude")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
@dataclass
class Plot:
    """A written figure: the PNG, the matplotlib ``Figure`` it was saved from (closed to pyplot,
    still readable: ``fig.axes``, their lines, patches, texts and legends) and the numbers it was
    drawn from (``data``; each plotting function documents its keys).  ``os.fspath(plot)`` is
    the PNG's path."""

    path: Path
    fig: object
    data: dict

    def __fspath__(self) -> str:
        return str(self.path)


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("commvol report plots need matplotlib: pip install matplotlib (the "
                          "comparison table works without it)") from exc
    return plt


def _save(fig, path, data: dict, *, tight: bool = True) -> Plot:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return Plot(path, fig, data)


def run_labels(runs) -> list[str]:
    """One legend label per run: its method, with the run directory's name only where two runs
    share a method (never ``ddp (ddp)``)."""
    methods = [r.method for r in runs]
    labels = [m if methods.count(m) == 1 else f"{m} ({r.path.name})"
              for m, r in zip(methods, runs)]
    return [lb if labels.count(lb) == 1 else f"{r.method} ({r.path})"
            for lb, r in zip(labels, runs)]


def _bytes_tick(n: float, _pos=None) -> str:
    """Short binary-prefixed tick label: ``256 KiB``, ``1.5 MiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover


def bytes_unit(n: float) -> tuple[str, float]:
    """``(unit, divisor)`` for a linear axis of bytes up to ``n``: B, KiB, MiB, GiB, TiB."""
    n, d = abs(float(n)), 1.0
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 * d or unit == "TiB":
            return unit, d
        d *= 1024
    return "TiB", d  # pragma: no cover


def _log_bytes_axis(axis) -> None:
    """A log axis of bytes with ticks at powers of two, labelled ``256 KiB``, ``1 MiB``."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

    axis.set_major_locator(LogLocator(base=2, numticks=12))
    axis.set_major_formatter(FuncFormatter(_bytes_tick))
    axis.set_minor_formatter(NullFormatter())


def _epochs_of(r: RunData) -> list[float] | None:
    """Passes over each rank's shard at the end of every metrics line with bytes (data-parallel
    lines log ``epoch``; an ADMM iteration is ``local_epochs`` passes); ``None`` when the run
    does not say (e.g. H-SADMM with ``--local-steps``)."""
    lines = [ln for ln in r.lines if "inter_node_bytes" in ln]
    if lines and all(isinstance(ln.get("epoch"), (int, float)) for ln in lines):
        return [float(ln["epoch"]) for ln in lines]
    cfg = r.summary.get("config", {})
    le = cfg.get("local_epochs")
    if lines and cfg.get("local_steps") is None and isinstance(le, (int, float)) and le > 0 and \
            all("iteration" in ln for ln in lines):
        return [(int(ln["iteration"]) + 1) * float(le) for ln in lines]
    return None


def plot_payload(runs, path) -> Plot:
    """PruneX Fig. 6a: (a) compact vs dense inter-node payload per H-SADMM iteration (float32
    elements of the compacted all-reduce, per leader); (b) inter-node bytes per pass over the
    data (epoch) of every run, from the metrics lines (log scale).

    ``data``: ``{"payload": {label: {"iteration", "compact_bytes", "dense_bytes"}},
    "per_epoch": {label: {"epoch", "bytes_per_epoch"}}, "notes": [...]}``.
    """
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11.5, 4.3))
    labels = dict(zip((id(r) for r in runs), run_labels(runs)))
    data = {"payload": {}, "per_epoch": {}, "notes": []}
    item = 4  # float32 parameters
    for r in runs:
        lines = [ln for ln in r.lines if "compact_elems" in ln and "dense_elems" in ln]
        if not lines:
            continue
        lb = labels[id(r)]
        if all(ln["compact_elems"] == ln["dense_elems"] for ln in lines):
            data["notes"].append(f"{lb}: compact = dense in every iteration (no compaction)")
            continue
        it = [int(ln["iteration"]) + 1 for ln in lines]
        comp = [ln["compact_elems"] * item for ln in lines]
        dense = [ln["dense_elems"] * item for ln in lines]
        data["payload"][lb] = {"iteration": it, "compact_bytes": comp, "dense_bytes": dense}
    top = max((max(d["dense_bytes"] + d["compact_bytes"]) for d in data["payload"].values()),
              default=1)
    unit, div = bytes_unit(top)
    data["payload_unit"] = unit
    for lb, d in data["payload"].items():
        (line,) = a.plot(d["iteration"], [v / div for v in d["compact_bytes"]], marker="o",
                         label=f"{lb}: compact")
        a.plot(d["iteration"], [v / div for v in d["dense_bytes"]], ls="--",
               color=line.get_color(), label=f"{lb}: dense")
    if data["payload"]:
        a.set_ylim(0, 1.12 * top / div)
        a.legend(fontsize=8, loc="lower right")
    a.set(title="(a) inter-node payload per leader and iteration", xlabel="ADMM iteration",
          ylabel=f"float32 payload of the inter-node all-reduce ({unit})")
    note = "\n".join(data["notes"]) or ("" if data["payload"] else "no H-SADMM run")
    if note:
        a.text(0.5, 0.5 if not data["payload"] else 0.3, note, ha="center", va="center",
               fontsize=8, transform=a.transAxes, wrap=True)
    for r in runs:
        ep = _epochs_of(r)
        lb = labels[id(r)]
        lines = [ln for ln in r.lines if "inter_node_bytes" in ln]
        if ep is None:
            if lines:
                data["notes"].append(f"{lb}: epochs not recorded, not in (b)")
            continue
        prev, xs, ys = 0.0, [], []
        for e, ln in zip(ep, lines):
            if e > prev and ln["inter_node_bytes"] > 0:
                xs.append(e)
                ys.append(ln["inter_node_bytes"] / (e - prev))
            prev = e
        if xs:
            data["per_epoch"][lb] = {"epoch": xs, "bytes_per_epoch": ys}
            b.plot(xs, ys, marker=".", label=lb)
    b.set_yscale("log")
    _log_bytes_axis(b.yaxis)
    b.set(title="(b) inter-node bytes per epoch (ledger)", xlabel="epochs (passes over each "
          "rank's shard)", ylabel="inter-node bytes per epoch")
    if data["per_epoch"]:
        b.legend(fontsize=7, ncol=2, loc="best")
    fig.text(0.5, 0.005, f"inter-node bytes: {LEDGER_BYTES}", ha="center", va="bottom",
             fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(fig, path, data, tight=False)


def plot_accuracy_vs_bytes(runs, path) -> Plot:
    """PruneX Fig. 5b: test accuracy against the cumulative inter-node bytes of the ledger (log
    axis: the methods span 40x), one curve per run, its total in the legend.

    ``data``: ``{label: {"bytes": cumulative inter-node bytes at each evaluation, "accuracy":
    [...], "total": Σ inter_node_bytes of every metrics line}}``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    data = {}
    for r, lb in zip(runs, run_labels(runs)):
        cum, xs, ys = 0, [], []
        for ln in r.lines:
            cum += int(ln.get("inter_node_bytes", 0))
            a = _acc(ln.get("test_accuracy"))
            if not math.isnan(a) and cum > 0:
                xs.append(cum)
                ys.append(a)
        if xs:
            data[lb] = {"bytes": xs, "accuracy": ys, "total": cum}
            ax.plot(xs, ys, marker="o", markersize=4, label=f"{lb} ({fmt_bytes(cum)})")
    ax.set_xscale("log")
    _log_bytes_axis(ax.xaxis)
    ax.grid(which="major", alpha=0.3)
    ax.set(title="test accuracy vs cumulative inter-node bytes",
           xlabel="cumulative inter-node bytes (log scale)", ylabel="test accuracy")
    if data:
        ax.legend(fontsize=8, title="method (inter-node total)", title_fontsize=8)
    else:
        ax.text(0.5, 0.5, "no run logs test_accuracy with inter_node_bytes", ha="center",
                transform=ax.transAxes)
    fig.text(0.5, 0.005, f"inter-node bytes: {LEDGER_BYTES}", ha="center", va="bottom",
             fontsize=6.5, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, path, data, tight=False)


def plot_comm_breakdown(runs, path) -> Plot:
    """PruneX Fig. 8: modeled (alpha-beta) communication time per phase, as shares of each run's
    total (the total in the run's label, in s / ms / µs).

    ``data``: ``{label: {"total_s": s, "shares": {phase: share}}}``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 1.4 + 0.55 * len(runs)))
    cmap = plt.get_cmap("tab20")
    phases = sorted({p for r in runs for p in r.summary["traffic"]["measured"]["by_phase"]})
    data, ticks = {}, []
    for i, (r, lb) in enumerate(zip(runs, run_labels(runs))):
        bp = r.summary["traffic"]["measured"]["by_phase"]
        total = sum(e.get("modeled_s", 0.0) for e in bp.values())
        shares = {p: bp[p].get("modeled_s", 0.0) / total for p in phases
                  if p in bp and total > 0 and bp[p].get("modeled_s", 0.0) > 0}
        data[lb] = {"total_s": total, "shares": shares}
        ticks.append(f"{lb} ({fmt_time(total)})")
        left = 0.0
        for j, p in enumerate(phases):
            share = shares.get(p, 0.0)
            if share <= 0:
                continue
            seen = ax.get_legend_handles_labels()[1]
            (bar,) = ax.barh(i, share, left=left, color=cmap(j % 20),
                             label=p if p not in seen else None)
            bar.set_gid(f"{lb}|{p}")
            if share > 0.08:
                ax.text(left + share / 2, i, f"{100 * share:.1f}%", ha="center", va="center",
                        fontsize=7)
            left += share
    ax.set_yticks(range(len(runs)), ticks)
    ax.set(xlim=(0, 1), xlabel="share of the run's modeled communication time",
           title="modeled communication time by phase (alpha-beta per link class; the "
                 "run's total in brackets)")
    if phases:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    return _save(fig, path, data)


def _layer_names(r: RunData, n: int) -> tuple[list[str], str | None]:
    """Names of the ``n`` per-layer residual entries (the adaptive-penalty groups of the run's
    ``rho_scope``: layers ``conv1``, ``fc1`` ... or tensors ``conv1.weight`` ...), and a note when
    they cannot be known."""
    cfg = r.summary.get("config", {})
    try:
        layout = resolve_model(cfg["model"], cfg.get("dataset", "digits")).layout
    except (KeyError, ValueError, TypeError):
        return [f"group {i}" for i in range(n)], "model not in summary.json: groups numbered"
    scopes = [cfg["rho_scope"]] if cfg.get("rho_scope") in ("layer", "tensor") else []
    for scope in [*scopes, "layer", "tensor"]:
        names, _ = penalty_groups(layout, scope)
        if len(names) == n:
            return list(names), None
    return [f"group {i}" for i in range(n)], (f"{n} residual entries match no grouping of "
                                               f"{cfg['model']}: groups numbered")


#: what each residual is, per method (PruneX §3.4: r = theta_ij - z_i intra, z_i - z inter;
#: flat ADMM has one consensus level, every rank against z, logged as r_intra)
_RESIDUALS = {"flat-admm": (("r_intra", "primal residual ||θ_j − z||_F (one level, all ranks)"),
                            ("r_inter", "no node level")),
              None: (("r_intra", "intra-node primal residual ||θ_ij − z_i||_F"),
                     ("r_inter", "inter-node primal residual ||z_i − z||_F"))}


def plot_residuals(runs, path, top: int = 5) -> Plot:
    """PruneX Figs. 10/11: per-layer primal residuals of ADMM runs (the ``top`` layers with the
    largest first residual), named by the model's layers.  A residual that is zero in every
    layer and iteration (flat ADMM's ``r_inter``: it has no node level) is not drawn on the log
    axis: the panel says so.  Zero entries of other residuals are left out of the log axis.

    ``data``: ``{label: {key: {"iteration": [...], "layers": {name: [...]}} or
    {"identically_zero": True}}}``.
    """
    plt = _pyplot()
    hs = [(r, lb) for r, lb in zip(runs, run_labels(runs)) if any("r_intra" in ln for ln in
                                                                   r.lines)]
    fig, axes = plt.subplots(max(1, len(hs)), 2, figsize=(11.5, 3.6 * max(1, len(hs))),
                             squeeze=False)
    data = {}
    if not hs:
        axes[0, 0].text(0.5, 0.5, "no ADMM run", ha="center", transform=axes[0, 0].transAxes)
    for row, (r, lb) in zip(axes, hs):
        lines = [ln for ln in r.lines if "r_intra" in ln]
        it = [int(ln["iteration"]) + 1 for ln in lines]
        data[lb] = {}
        for ax, (key, what) in zip(row, _RESIDUALS.get(r.method, _RESIDUALS[None])):
            values = [[float(v) for v in ln.get(key, [])] for ln in lines]
            if not values or not values[0] or all(v == 0 for vs in values for v in vs):
                data[lb][key] = {"identically_zero": True}
                why = (" (flat ADMM has no node level)" if r.method == "flat-admm" else "")
                ax.text(0.5, 0.5, f"{key} = 0 in every layer and iteration{why}:\n"
                        "nothing to draw on a log axis", ha="center", va="center", fontsize=9,
                        transform=ax.transAxes)
                ax.set(title=f"{lb}: {key}", xticks=[], yticks=[])
                ax.title.set_fontsize(9)
                continue
            n = len(values[0])
            names, note = _layer_names(r, n)
            # the top layers by first residual, drawn in the model's order, one colour per
            # layer in every panel
            order = sorted(sorted(range(n), key=lambda i: -values[0][i])[:top])
            data[lb][key] = {"iteration": it, "layers": {}}
            zeros = 0
            for i in order:
                ys = [v[i] if v[i] > 0 else float("nan") for v in values]
                zeros += sum(1 for v in values if v[i] <= 0)
                data[lb][key]["layers"][names[i]] = [v[i] for v in values]
                ax.plot(it, ys, marker=".", color=f"C{i % 10}", label=names[i])
            ax.set_yscale("log")
            shown = f" (top {len(order)} of {n} layers)" if len(order) < n else ""
            ax.set(title=f"{lb}: {what}{shown}", xlabel="ADMM iteration",
                   ylabel=f"{key} (log scale)")
            ax.title.set_fontsize(9)
            extra = [t for t in (note, f"{zeros} zero values not drawn (log axis)"
                                 if zeros else None) if t]
            if extra:
                ax.text(0.01, 0.01, "; ".join(extra), fontsize=7, transform=ax.transAxes)
            ax.legend(fontsize=7, title="layer", title_fontsize=7)
    return _save(fig, path, data)


def plot_scaling(doc: dict, path) -> Plot:
    """PruneX Fig. 9: speedup and parallel efficiency from ``python -m commvol scale --out``.

    Lines are modeled (solid: the job simulation; dashed: the α–β bound, nothing overlapped);
    stars are the paper's measured points (``doc["paper"]``, e.g. PruneX Fig. 9), drawn only
    where the model's baseline GPU count is the paper's.  One legend for the systems (colours),
    one for what is modeled and what is measured (styles).

    ``data``: ``{"systems": {name: {"gpus", "speedup", "efficiency", "bound_speedup"?}},
    "paper": {name: (gpus, speedup)}, "base_gpus": g0}``.
    """
    from matplotlib.lines import Line2D  # noqa: PLC0415

    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11.5, 4.6))
    paper = doc.get("paper") or {}
    source = paper.get("source", "the paper")
    p0, p1 = (paper.get("gpus") or [None, None])[:2]
    gpus = sorted({r["gpus"] for rows in doc["systems"].values() for r in rows})
    g0 = gpus[0] if gpus else None
    data = {"systems": {}, "paper": {}, "base_gpus": g0}
    sys_handles, dashed = [], False
    for i, (name, rows) in enumerate(doc["systems"].items()):
        c = f"C{i}"
        g = [r["gpus"] for r in rows]
        d = data["systems"][name] = {"gpus": g, "speedup": [r["speedup"] for r in rows],
                                     "efficiency": [100 * r["efficiency"] for r in rows]}
        a.plot(g, d["speedup"], "o-", color=c, label=f"{name}: modeled, job simulation")
        b.plot(g, d["efficiency"], "o-", color=c, label=f"{name}: modeled, job simulation")
        if all("bound_time_s" in r for r in rows):
            dashed = True
            base = rows[0]["bound_time_s"]
            d["bound_speedup"] = [base / r["bound_time_s"] for r in rows]
            a.plot(g, d["bound_speedup"], "--", color=c, alpha=0.6,
                   label=f"{name}: modeled, alpha-beta bound")
            b.plot(g, [100 * s_ * g[0] / x for s_, x in zip(d["bound_speedup"], g)], "--",
                   color=c, alpha=0.6, label=f"{name}: modeled, alpha-beta bound")
        if name in paper.get("speedup", {}) and p0 == g0 and p1 is not None:
            s = paper["speedup"][name]
            data["paper"][name] = (p1, s)
            a.plot([p1], [s], "*", color=c, markersize=14, markeredgecolor="black",
                   label=f"{name}: measured, {source}")
            b.plot([p1], [100 * s * p0 / p1], "*", color=c, markersize=14,
                   markeredgecolor="black", label=f"{name}: measured, {source}")
        sys_handles.append(Line2D([], [], color=c, lw=6, label=name))
    if gpus:
        a.plot(gpus, [x / g0 for x in gpus], "k:", label="ideal (linear)")
    style = [Line2D([], [], color="gray", marker="o", label="modeled: job simulation")]
    if dashed:
        style.append(Line2D([], [], color="gray", ls="--",
                            label="modeled: alpha-beta bound (nothing overlapped)"))
    if data["paper"]:
        style.append(Line2D([], [], color="gray", marker="*", ls="", markersize=12,
                            markeredgecolor="black", label=f"measured: {source}"))
    style.append(Line2D([], [], color="black", ls=":", label="ideal (linear)"))
    if gpus:
        b.axhline(100, color="black", ls=":")
    where = (doc.get("cluster") or {}).get("name")
    model = "lines: modeled here (job simulation" + (f" on {where})" if where else ")")
    what = (f"{model}; ★: measured, {source}" if data["paper"] else model)
    a.set(title=f"(a) speedup over {g0} GPUs, {doc.get('model', '')}", xlabel="GPUs",
          ylabel=f"speedup over {g0} GPUs")
    b.set(title="(b) parallel efficiency", xlabel="GPUs", ylabel="parallel efficiency (%)",
          ylim=(0, 105))
    for ax, where, sys_where in ((a, "lower right", "upper left"),
                                 (b, "lower left", "center left")):
        ax.add_artist(ax.legend(handles=sys_handles, fontsize=8, loc=sys_where,
                                title="system", title_fontsize=8))
        ax.legend(handles=style, fontsize=7, loc=where)
    fig.suptitle(f"strong scaling of {doc.get('model', '?')}: {what}", fontsize=10)
    return _save(fig, path, data)


def draw_report(run_dirs, out_dir, scaling=None) -> dict:
    """Draw every applicable plot under ``out_dir``: ``{png name: Plot}`` (see :class:`Plot`).

    ``scaling`` is the JSON written by ``python -m commvol scale --out`` (a path or dict).
    """
    runs = [r if isinstance(r, RunData) else load_run(r) for r in run_dirs]
    out = Path(out_dir)
    plots = {}
    if runs:
        plots["payload.png"] = plot_payload(runs, out / "payload.png")
        plots["accuracy_vs_bytes.png"] = plot_accuracy_vs_bytes(runs,
                                                                out / "accuracy_vs_bytes.png")
        plots["comm_breakdown.png"] = plot_comm_breakdown(runs, out / "comm_breakdown.png")
        if any(any("r_intra" in ln for ln in r.lines) for r in runs):
            plots["residuals.png"] = plot_residuals(runs, out / "residuals.png")
    if scaling is not None:
        doc = scaling if isinstance(scaling, dict) else json.loads(Path(scaling).read_text())
        plots["scaling.png"] = plot_scaling(doc, out / "scaling.png")
    return plots


def write_plots(run_dirs, out_dir, scaling=None) -> list[Path]:
    """Write every applicable plot under ``out_dir`` (:func:`draw_report`); returns the PNG
    paths."""
    return [p.path for p in draw_report(run_dirs, out_dir, scaling).values()]


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="comparison table and plots of finished runs",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, metavar="RUN_DIR",
                   help="run directories (summary.json + metrics.jsonl)")
    p.add_argument("--target", type=float, default=0.9,
                   help="accuracy of the time-to-accuracy column (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("results") / "commvol_report",
                   help="directory of the PNG plots (default %(default)s)")
    p.add_argument("--scaling", type=Path, default=None,
                   help="JSON of `python -m commvol scale --out` for scaling.png")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="only the table")
    p.add_argument("--csv", type=Path, default=None, metavar="FILE",
                   help="also write the runs' metrics.jsonl lines to FILE as CSV: one row per "
                        "line; columns run, system, method and the common fields of "
                        "runner/metrics.schema.json, in its order")
    p.set_defaults(func=run)


def run(args) -> list[Path]:
    if not args.runs and args.scaling is None:
        raise ValueError("report needs RUN_DIR arguments and/or --scaling FILE")
    if args.runs:
        print(comparison_table(args.runs, target=args.target))
    if getattr(args, "csv", None) is not None:
        if not args.runs:
            raise ValueError("report --csv needs RUN_DIR arguments")
        runs = [load_run(d) for d in args.runs]
        print(f"wrote {write_csv([(r.path, r.summary, r.lines) for r in runs], args.csv)}")
    if not args.plots:
        return []
    paths = write_plots(args.runs, args.out, scaling=args.scaling)
    for p in paths:
        print(f"wrote {p}")
    return paths
