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

Plots (matplotlib, Agg backend; PNG under ``--out``): ``payload.png`` (PruneX Fig. 6a: compact vs
dense payload per H-SADMM iteration, and inter-node bytes per iteration/step of every run),
``accuracy_vs_bytes.png`` (Fig. 5b), ``comm_breakdown.png`` (Fig. 8: modeled communication time
by phase), ``residuals.png`` (Figs. 10/11: per-layer ``r_intra``/``r_inter`` of H-SADMM runs) and
``scaling.png`` (Fig. 9, from ``python -m commvol scale --out``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from runner.metrics import write_csv

from .predict import fmt_bytes
from .specs import resolve_model

__all__ = ["RunData", "load_run", "time_to_target", "comparison_table", "write_plots",
           "plot_payload", "plot_accuracy_vs_bytes", "plot_comm_breakdown", "plot_residuals",
           "plot_scaling", "add_parser", "run"]


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

    def per_unit_bytes(self) -> tuple[list[float], list[float]]:
        """``(x, inter-node bytes per unit)`` from the metrics lines (intervals divided by their
        length for data-parallel runs)."""
        xs, ys, prev = [], [], 0
        for ln in self.lines:
            if "inter_node_bytes" not in ln:
                continue
            if "step" in ln:
                n = max(1, int(ln["step"]) - prev)
                prev = int(ln["step"])
                xs.append(prev)
                ys.append(ln["inter_node_bytes"] / n)
            else:
                xs.append(int(ln.get("iteration", len(xs))) + 1)
                ys.append(float(ln["inter_node_bytes"]))
        return xs, ys


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
            f"| payload ratio | comm modeled s | sim s | wall s | sim s to {target:g} | "
            "inter vs ddp | measured = predicted |")
    out = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
                 "---: | --- |"]
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
            f"{timing.get('comm_modeled_s', float('nan')):.4f}",
            f"{timing.get('sim_s', float('nan')):.3f}", f"{timing.get('wall_s', float('nan')):.2f}",
            "not reached" if ttt is None else f"{ttt:.3f}",
            f"{inter / ddp_inter:.3f}" if ddp_inter else "-", _matches(r)]) + " |")
    out.append("")
    out.append("inter-node bytes: bytes sent over node-crossing links (ledger); payload ratio: "
               "inter-node payload / dense payload (H-SADMM compact elements; Top-K 2K/T); sim "
               "s = the simulated clock (timeline: critical path of per-layer compute and "
               "transfers; additive: compute + modeled communication; see summary.json "
               "timeline.mode); time to accuracy from the logged evaluations")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("commvol report plots need matplotlib: pip install matplotlib (the "
                          "comparison table works without it)") from exc
    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_payload(runs, path) -> Path:
    """Fig. 6a: compact vs dense payload per H-SADMM iteration; inter-node bytes per unit."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    hs = [r for r in runs if any("compact_elems" in ln for ln in r.lines)]
    for r in hs:
        it = [ln["iteration"] + 1 for ln in r.lines if "compact_elems" in ln]
        item = 4  # float32 parameters
        a.plot(it, [ln["compact_elems"] * item / 2**20 for ln in r.lines if "compact_elems" in ln],
               marker="o", label=f"{r.method}: compact")
        a.plot(it, [ln["dense_elems"] * item / 2**20 for ln in r.lines if "compact_elems" in ln],
               ls="--", label=f"{r.method}: dense")
    if not hs:
        a.text(0.5, 0.5, "no H-SADMM run", ha="center", va="center", transform=a.transAxes)
    a.set(title="(a) inter-node payload per leader", xlabel="iteration", ylabel="MiB")
    a.set_ylim(bottom=0)
    if hs:
        a.legend(fontsize=8)
    for r in runs:
        xs, ys = r.per_unit_bytes()
        if xs:
            b.plot(xs, [y / 2**20 for y in ys], marker=".", label=f"{r.method} (per {r.unit})")
    b.set(title="(b) inter-node wire bytes per iteration / step", xlabel="iteration or step",
          ylabel="MiB")
    b.legend(fontsize=8)
    return _save(fig, path)


def plot_accuracy_vs_bytes(runs, path) -> Path:
    """Fig. 5b: test accuracy against cumulative inter-node bytes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        cum, xs, ys = 0.0, [], []
        for ln in r.lines:
            cum += float(ln.get("inter_node_bytes", 0))
            a = _acc(ln.get("test_accuracy"))
            if not math.isnan(a):
                xs.append(cum / 2**20)
                ys.append(a)
        if xs:
            ax.plot(xs, ys, marker="o", label=r.method)
    ax.set(title="accuracy vs inter-node communication", xlabel="cumulative inter-node MiB",
           ylabel="test accuracy")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_comm_breakdown(runs, path) -> Path:
    """Fig. 8: modeled communication time per phase (share of each run's total)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.6 * len(runs)))
    cmap = plt.get_cmap("tab20")
    phases = sorted({p for r in runs for p in r.summary["traffic"]["measured"]["by_phase"]})
    for i, r in enumerate(runs):
        bp = r.summary["traffic"]["measured"]["by_phase"]
        total = sum(e.get("modeled_s", 0.0) for e in bp.values()) or 1.0
        left = 0.0
        for j, p in enumerate(phases):
            share = bp.get(p, {}).get("modeled_s", 0.0) / total
            if share <= 0:
                continue
            ax.barh(i, share, left=left, color=cmap(j % 20),
                    label=p if p not in ax.get_legend_handles_labels()[1] else None)
            if share > 0.08:
                ax.text(left + share / 2, i, f"{100 * share:.1f}%", ha="center", va="center",
                        fontsize=7)
            left += share
    totals = [sum(e.get("modeled_s", 0.0)
                  for e in r.summary["traffic"]["measured"]["by_phase"].values()) for r in runs]
    ax.set_yticks(range(len(runs)), [f"{r.method} ({t:.3g} s)" for r, t in zip(runs, totals)])
    ax.set(xlim=(0, 1), xlabel="share of modeled communication time",
           title="communication time by phase")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4)
    return _save(fig, path)


def _layer_names(r: RunData, n: int) -> list[str]:
    cfg = r.summary.get("config", {})
    try:
        names = list(resolve_model(cfg["model"], cfg.get("dataset", "digits")).layout.names)
        if len(names) == n:
            return names
    except (KeyError, ValueError, TypeError):
        pass
    return [f"layer {i}" for i in range(n)]


def plot_residuals(runs, path, top: int = 5) -> Path:
    """Figs. 10/11: per-layer primal residuals ``r_intra``, ``r_inter`` of H-SADMM runs (the
    ``top`` layers with the largest first residual)."""
    plt = _pyplot()
    hs = [r for r in runs if any("r_intra" in ln for ln in r.lines)]
    fig, axes = plt.subplots(max(1, len(hs)), 2, figsize=(11, 3.5 * max(1, len(hs))),
                             squeeze=False)
    if not hs:
        axes[0, 0].text(0.5, 0.5, "no H-SADMM run", ha="center", transform=axes[0, 0].transAxes)
    for row, r in zip(axes, hs):
        lines = [ln for ln in r.lines if "r_intra" in ln]
        it = [ln["iteration"] + 1 for ln in lines]
        for ax, key, title in ((row[0], "r_intra", "intra-node"), (row[1], "r_inter",
                                                                    "inter-node")):
            data = [ln[key] for ln in lines]
            n = len(data[0])
            names = _layer_names(r, n)
            order = sorted(range(n), key=lambda i: -float(data[0][i]))[:top]
            for i in order:
                ax.plot(it, [max(float(d[i]), 1e-30) for d in data], marker=".", label=names[i])
            ax.set_yscale("log")
            ax.set(title=f"{r.method}: {title} primal residual ||r||_F (top {len(order)})",
                   xlabel="iteration")
            ax.legend(fontsize=7)
    return _save(fig, path)


def plot_scaling(doc: dict, path) -> Path:
    """Fig. 9: speedup and parallel efficiency from ``python -m commvol scale --out``."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    gpus = []
    for name, rows in doc["systems"].items():
        g = [r["gpus"] for r in rows]
        gpus += g
        a.plot(g, [r["speedup"] for r in rows], marker="o", label=name)
        b.plot(g, [100 * r["efficiency"] for r in rows], marker="o", label=name)
    if gpus:
        g0 = min(gpus)
        a.plot(sorted(set(gpus)), [g / g0 for g in sorted(set(gpus))], "k:", label="ideal")
    a.set(title=f"(a) speedup ({doc.get('model', '')})", xlabel="GPUs", ylabel="speedup")
    b.set(title="(b) parallel efficiency", xlabel="GPUs", ylabel="%", ylim=(0, 105))
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    return _save(fig, path)


def write_plots(run_dirs, out_dir, scaling=None) -> list[Path]:
    """Write every applicable plot under ``out_dir``; returns the PNG paths.

    ``scaling`` is the JSON written by ``python -m commvol scale --out`` (a path or dict).
    """
    runs = [r if isinstance(r, RunData) else load_run(r) for r in run_dirs]
    out = Path(out_dir)
    paths = []
    if runs:
        paths += [plot_payload(runs, out / "payload.png"),
                  plot_accuracy_vs_bytes(runs, out / "accuracy_vs_bytes.png"),
                  plot_comm_breakdown(runs, out / "comm_breakdown.png")]
        if any(any("r_intra" in ln for ln in r.lines) for r in runs):
            paths.append(plot_residuals(runs, out / "residuals.png"))
    if scaling is not None:
        doc = scaling if isinstance(scaling, dict) else json.loads(Path(scaling).read_text())
        paths.append(plot_scaling(doc, out / "scaling.png"))
    return paths


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
