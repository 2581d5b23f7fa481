"""``commvol gantt``, ``plot-scaling`` and ``plot-tta`` from hand-made run directories and from a
real 2 x 2 ddp run's timeline block: the plotted data (bars, lines, lanes, legends, axis units
read back from the saved figure) against the run directories' numbers, and clear errors for
directories they cannot use."""

import importlib.util
import json

import pytest
from mpi_helpers import run_mpi

from commvol.__main__ import main
from commvol.plots import LANES, plot_gantt, plot_scaling, plot_tta, step_events, tta_points
from commvol.predict import fmt_bytes
from commvol.report import fmt_time, time_unit

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
PNG = b"\x89PNG\r\n\x1a\n"


def _ev(label, kind, resource, start, finish):
    return {"label": label, "kind": kind, "resource": resource, "start": start,
            "finish": finish}


def _events(shift=0.0):
    return [_ev("forward:fc", "compute", "compute", 0.0, 1.0 + shift),
            _ev("backward:fc", "compute", "compute", 1.0 + shift, 3.0),
            _ev("pack", "compute", "offload", 2.0, 2.5),
            _ev("intra_allreduce[0]", "transfer", "intra", 2.0, 2.6),
            _ev("inter_allreduce[0]", "transfer", "inter", 2.6, 3.4),
            _ev("inter_allreduce[1]", "transfer", "inter", 3.0, 3.8),   # shares the link
            _ev("ready", "join", "none", 3.0, 3.0),
            _ev("optimizer", "compute", "compute", 3.8, 4.0)]


#: the ledger's phases of the hand-made run (bytes summed over ranks, per run)
BY_PHASE = {"inter_allreduce": {"link": "inter", "inter_bytes": 6 * 3000, "intra_bytes": 0,
                                "calls": 6 * 2, "modeled_s": 0.4},
            "intra_allreduce": {"link": "intra", "inter_bytes": 0, "intra_bytes": 6 * 1024,
                                "calls": 6, "modeled_s": 0.1}}


def _run(d, *, timeline=True, lines=None, mode="timeline", step_events=None, events=None,
         busiest=None, source="flops (15.7 TFLOP/s)", method=None):
    d.mkdir(parents=True)
    summary = {"system": "dataparallel", "method": method or d.name,
               "traffic": {"measured": {"by_phase": BY_PHASE}},
               "cost_model": {"intra_gbps": 2400.0, "inter_gbps": 100.0, "intra_lat_us": 2.0,
                              "inter_lat_us": 5.0}}
    if timeline:
        tl = {"mode": mode, "compute_source": source, "steps": 6,
              "rank0": {"step_s": 4.0, "events": events or _events()}, "busiest_rank": 3,
              "busiest": {"step_s": 4.2, "events": busiest or _events(0.2)}}
        if step_events is not None:
            tl["step_events"] = step_events
        summary["timeline"] = tl
    (d / "summary.json").write_text(json.dumps(summary))
    lines = lines if lines is not None else [
        {"step": 2, "sim_s": 0.5, "test_accuracy": 0.4},
        {"step": 4, "sim_s": 1.0, "test_accuracy": 0.7},
        {"step": 6, "sim_s": 1.5, "test_accuracy": 0.8}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def _bars(ax):
    """``[(label, lane, x, width)]`` of the bars drawn on a Gantt axis (lane from the row the
    bar sits in, named by the y tick labels)."""
    lanes = [t.get_text() for t in ax.get_yticklabels()]
    out = []
    for p in ax.patches:
        row = round(p.get_y() + p.get_height() / 2)
        out.append((p.get_gid(), lanes[row], p.get_x(), p.get_width()))
    return out


def _gantt_axes(fig):
    return {ax.get_gid().split(":", 1)[1]: ax for ax in fig.axes
            if str(ax.get_gid()).startswith("gantt:")}


def _assert_gantt_is_the_events(plot, run_dir):
    """Every drawn bar is one event of step_events (start, duration, lane), every event with a
    duration is drawn, lanes are exactly the non-empty ones, the axis unit fits the step."""
    data = step_events(run_dir)
    end = max(e["finish"] for evs in data["ranks"].values() for e in evs)
    unit, k = time_unit(end)
    axes = _gantt_axes(plot.fig)
    assert list(axes) == list(data["ranks"])
    for name, events in data["ranks"].items():
        ax = axes[name]
        want = sorted((e["label"], e["resource"], pytest.approx(k * e["start"]),
                       pytest.approx(k * (e["finish"] - e["start"])))
                      for e in events if e["resource"] in LANES and e["finish"] > e["start"])
        assert sorted(_bars(ax)) == want
        lanes = [t.get_text() for t in ax.get_yticklabels()]
        assert lanes == [ln for ln in LANES if any(e["resource"] == ln and
                                                    e["finish"] > e["start"] for e in events)]
        assert f"({unit})" in ax.get_xlabel()


def test_step_events_reads_rank0_and_the_busiest_rank(tmp_path):
    d = _run(tmp_path / "ddp")
    data = step_events(d)
    assert data["step"] == 6
    assert list(data["ranks"]) == ["rank 0", "rank 3 (busiest)"]
    assert data["ranks"]["rank 0"] == _events()
    assert {e["resource"] for e in data["ranks"]["rank 0"]} - {"none"} == set(LANES)
    # another step only where the trainer recorded it
    other = _run(tmp_path / "more", step_events={"2": {"rank0": {"events": _events(0.1)}}})
    assert step_events(other, 2)["ranks"] == {"rank 0": _events(0.1)}
    with pytest.raises(ValueError, match=r"step\(s\) \[2, 6\] only, not step 3"):
        step_events(other, 3)


def test_time_units_by_magnitude():
    assert [fmt_time(x) for x in (0.000517, 0.004644, 0.401, 9.0, 0.0009997, 2.5e-6, None)] == \
        ["517 µs", "4.64 ms", "401 ms", "9.00 s", "1.00 ms", "2.50 µs", "-"]
    assert time_unit(0.0021) == ("ms", 1e3) and time_unit(4.2) == ("s", 1.0)
    assert time_unit(4.8e-5) == ("µs", 1e6)


@needs_mpl
def test_gantt_bars_are_the_timeline_events(tmp_path, capsys):
    d = _run(tmp_path / "ddp")
    plot = plot_gantt(d, tmp_path / "g.png")
    assert plot.path.read_bytes()[:8] == PNG
    _assert_gantt_is_the_events(plot, d)
    assert plot.data["unit"] == "s"
    # every transfer is labelled with its phase and the ledger's bytes per call (one label
    # for the two calls of inter_allreduce, with an arrow to each bar)
    texts = {t.get_text() for ax in plot.fig.axes for t in ax.texts}
    assert "inter_allreduce ×2: 1.46 KiB per call" in texts          # 18000 B / 12 calls
    assert "intra_allreduce[0]: 1.00 KiB per call" in texts
    assert {"fc", "optimizer", "pack"} <= texts                      # names that fit their bars
    arrows = [t for t in plot.fig.axes[0].texts if t.get_text() == "" and t.arrow_patch]
    assert len(arrows) == 3                                          # rank 0: three transfers
    # what is measured and what is modeled, in the figure
    said = " ".join(t.get_text() for t in plot.fig.texts)
    assert "compute modeled from FLOP counts" in said and "communication modeled" in said
    # the legend names every colour once: passes, phases, link classes
    legend = [t.get_text() for lg in plot.fig.legends for t in lg.get_texts()]
    assert legend == ["forward (per layer)", "backward (per layer)", "pack",
                      "optimizer", "intra-node transfer", "inter-node transfer"]
    assert main(["gantt", str(d), "--step", "6"]) == 0
    assert (d / "gantt.png").read_bytes()[:8] == PNG
    assert "gantt.png" in capsys.readouterr().out
    # no offload work, a CPU-timed millisecond step: no offload lane, ms axis, "measured"
    ms = [dict(e, start=e["start"] / 1e3, finish=e["finish"] / 1e3) for e in _events()
          if e["resource"] != "offload"]
    d2 = _run(tmp_path / "topk", events=ms, busiest=ms, source="cpu_thread (blas_threads=1)")
    plot = plot_gantt(d2, tmp_path / "g2.png")
    _assert_gantt_is_the_events(plot, d2)
    assert plot.data["unit"] == "ms" and plot.data["lanes"]["rank 0"] == ["compute", "intra",
                                                                          "inter"]
    said = " ".join(t.get_text() for t in plot.fig.texts)
    assert "compute measured (thread CPU time" in said
    assert "pack" not in [t.get_text() for lg in plot.fig.legends for t in lg.get_texts()]


@pytest.mark.parametrize("make,match", [
    (lambda t: t / "missing", "is not a directory"),
    (lambda t: (t / "empty").mkdir() or t / "empty", "has no summary.json"),
    (lambda t: _run(t / "add", mode="additive"), "run the trainer with --clock timeline"),
    (lambda t: _run(t / "old", timeline=False), "no timeline events"),
])
def test_gantt_refuses_bad_run_dirs(tmp_path, make, match):
    d = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        plot_gantt(d, tmp_path / "g.png")
    with pytest.raises(ValueError, match=match):
        main(["gantt", str(d)])


def test_gantt_refuses_a_step_it_does_not_have(tmp_path):
    d = _run(tmp_path / "ddp")
    with pytest.raises(ValueError, match="pass --step 6 or omit --step"):
        main(["gantt", str(d), "--step", "2"])
    no_events = _run(tmp_path / "bare")
    s = json.loads((no_events / "summary.json").read_text())
    s["timeline"]["rank0"] = {"step_s": 1.0}
    (no_events / "summary.json").write_text(json.dumps(s))
    with pytest.raises(ValueError, match="no rank0.events"):
        step_events(no_events)


def test_tta_points_and_bad_dirs(tmp_path):
    d = _run(tmp_path / "ddp")
    label, xs, ys = tta_points(d)
    assert label == "ddp" and xs == [0.5, 1.0, 1.5] and ys == [0.4, 0.7, 0.8]
    none = _run(tmp_path / "noacc", lines=[{"step": 1, "sim_s": 0.1, "loss": 2.0}])
    with pytest.raises(ValueError, match="no line with both sim_s and test_accuracy"):
        tta_points(none)
    with pytest.raises(ValueError, match="is not a directory"):
        main(["plot-tta", str(d), str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="at least one RUN_DIR"):
        plot_tta([], tmp_path / "t.png")


@needs_mpl
def test_tta_plots_each_runs_points(tmp_path):
    a, b = _run(tmp_path / "ddp"), _run(tmp_path / "topk")
    # two runs of one method are told apart by their directories, never "ddp (ddp)"
    c = _run(tmp_path / "again", method="ddp", lines=[
        {"step": 2, "sim_s": 0.002, "test_accuracy": 0.5},
        {"step": 4, "sim_s": 0.004, "test_accuracy": 0.6}])
    plot = plot_tta([a, b], tmp_path / "tta.png", target=0.7)
    assert plot.path.read_bytes()[:8] == PNG
    ax = plot.fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ddp", "topk", "target 0.7"]
    assert list(lines["ddp"].get_xdata()) == [0.5, 1.0, 1.5]                  # seconds: "s"
    assert list(lines["ddp"].get_ydata()) == [0.4, 0.7, 0.8]
    assert ax.get_xlabel().endswith("(s)")
    plot = plot_tta([a, c], tmp_path / "tta2.png")
    ax = plot.fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["ddp (ddp)", "ddp (again)"] and len(set(labels)) == len(labels)
    assert ax.get_xlabel().endswith("(s)")
    plot = plot_tta([c], tmp_path / "tta3.png")
    ax = plot.fig.axes[0]
    assert ax.get_xlabel().endswith("(ms)")
    assert list(ax.get_lines()[0].get_xdata()) == pytest.approx([2.0, 4.0])


def test_plot_scaling_refuses_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist: write it with `python -m commvol"):
        main(["plot-scaling", str(tmp_path / "none.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        plot_scaling(bad, tmp_path / "s.png")
    bad.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="has no 'systems' rows"):
        plot_scaling(bad, tmp_path / "s.png")


@needs_mpl
def test_plot_scaling_modeled_vs_measured(tmp_path, capsys):
    out = tmp_path / "scale.json"
    # small buckets: DDP's all-reduces overlap the backward, so the job simulation's and the
    # bound's lines differ and swapping them is seen
    assert main(["scale", "--system", "ddp", "topk", "--model", "cnn", "--gpus", "8", "16",
                 "64", "--gpus-per-node", "4", "--compute-s-per-sample", "0.0005",
                 "--bucket-mib", "0.01", "--out", str(out)]) == 0
    png = tmp_path / "scaling.png"
    assert main(["plot-scaling", str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG
    doc = json.loads(out.read_text())
    # the paper's measured points beside the model (as `scale` writes them for resnet152)
    doc["paper"] = {"source": "PruneX Fig. 9 (8 -> 64 GPUs)", "gpus": [8, 64],
                    "speedup": {"ddp": 5.81, "topk": 3.71}}
    plot = plot_scaling(doc, tmp_path / "s2.png")
    a, b = plot.fig.axes
    lines = {ln.get_label(): ln for ln in a.get_lines()}
    for name, rows in doc["systems"].items():
        solid = lines[f"{name}: modeled, job simulation"]
        assert list(solid.get_xdata()) == [r["gpus"] for r in rows]
        assert list(solid.get_ydata()) == [r["speedup"] for r in rows]
        dashed = lines[f"{name}: modeled, alpha-beta bound"]
        assert list(dashed.get_ydata()) == pytest.approx(
            [rows[0]["bound_time_s"] / r["bound_time_s"] for r in rows])
        star = lines[f"{name}: measured, PruneX Fig. 9 (8 -> 64 GPUs)"]
        assert (list(star.get_xdata()), list(star.get_ydata())) == \
            ([64], [doc["paper"]["speedup"][name]])
    ddp = doc["systems"]["ddp"]
    assert [r["speedup"] for r in ddp] != pytest.approx(
        [ddp[0]["bound_time_s"] / r["bound_time_s"] for r in ddp])
    eff = {ln.get_label(): ln for ln in b.get_lines()}
    for name, rows in doc["systems"].items():
        assert list(eff[f"{name}: modeled, job simulation"].get_ydata()) == \
            pytest.approx([100 * r["efficiency"] for r in rows])
    assert list(eff["ddp: measured, PruneX Fig. 9 (8 -> 64 GPUs)"].get_ydata()) == \
        pytest.approx([100 * 5.81 * 8 / 64])
    # every line says whether it is modeled or measured; the legends say which style is which
    assert all(("modeled" in lb or "measured" in lb or lb.startswith(("ideal", "_")))
               for lb in lines)
    for ax in (a, b):
        shown = [t.get_text() for lg in ax.findobj(lambda o: type(o).__name__ == "Legend")
                 for t in lg.get_texts()]
        assert len(shown) == len(set(shown))
        assert {"modeled: job simulation", "measured: PruneX Fig. 9 (8 -> 64 GPUs)"} <= \
            set(shown)
    title = " ".join(t.get_text() for t in plot.fig.texts)   # the suptitle
    assert "modeled" in title and "measured, PruneX Fig. 9" in title
    # a model without the paper's points says only "modeled"
    doc["paper"] = None
    plot = plot_scaling(doc, tmp_path / "s3.png")
    labels = [ln.get_label() for ax in plot.fig.axes for ln in ax.get_lines()]
    assert not any("measured" in lb for lb in labels)
    assert "measured" not in " ".join(t.get_text() for t in plot.fig.texts)


@needs_mpl
def test_gantt_of_a_real_timeline_run(tmp_path):
    """A 2 x 2 ddp run writes the events the chart needs (rank 0 and the busiest rank)."""
    out = tmp_path / "ddp"
    run_mpi(None, 4, "train", "--method", "ddp", "--steps", "4", "--eval-every", "2",
            "--ranks-per-node", 2, "--out", out, module="dataparallel", timeout=180)
    data = step_events(out)
    rank0 = data["ranks"]["rank 0"]
    assert data["step"] == 4
    assert any(e["kind"] == "transfer" and e["resource"] == "inter" for e in rank0)
    assert any(e["label"].startswith("backward:") for e in rank0)
    plot = plot_gantt(out, tmp_path / "gantt.png")
    assert plot.path.read_bytes()[:8] == PNG
    _assert_gantt_is_the_events(plot, out)
    assert "offload" not in plot.data["lanes"]["rank 0"]     # ddp has no offload thread
    # each transfer carries its call record's bytes: DDP's one bucket is the whole gradient
    summary = json.loads((out / "summary.json").read_text())
    ph = summary["traffic"]["measured"]["by_phase"]["grad_allreduce"]
    T4 = ph["payload_bytes"] / 4 / ph["calls"]        # every rank's buffer, per call
    want = f"grad_allreduce: {fmt_bytes(T4)}"
    assert want in plot.data["labels"]["rank 0"], plot.data["labels"]["rank 0"]
    _, xs, _ = tta_points(out)
    assert len(xs) == 2 and xs[0] < xs[1]
