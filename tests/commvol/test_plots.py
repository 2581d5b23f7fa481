"""``commvol gantt``, ``plot-scaling`` and ``plot-tta`` from hand-made run directories and from a
real 2 x 2 ddp run's ``clock.last_step`` (the job simulation's events): the plotted data (bars,
lines, lanes, legends, colours, axis units read back from the saved figure) against the run
directories' numbers, and clear errors for directories they cannot use (an older spardist's
runs included)."""

import importlib.util
import json

import pytest
from mpi_helpers import run_mpi
from run_dir_helpers import NETWORK, step_of_events, write_run

from commvol.__main__ import main
from commvol.plots import LANES, plot_gantt, plot_scaling, plot_tta, step_events, tta_points
from commvol.predict import fmt_bytes
from commvol.report import fmt_time, time_unit

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
PNG = b"\x89PNG\r\n\x1a\n"


def _bars(ax):
    """``[(label, lane, x, width, patch)]`` of the bars drawn on a Gantt axis (lane from the row
    the bar sits in, named by the y tick labels)."""
    lanes = [t.get_text() for t in ax.get_yticklabels()]
    return [(p.get_gid(), lanes[round(p.get_y() + p.get_height() / 2)], p.get_x(),
             p.get_width(), p) for p in ax.patches]


def _gantt_axes(fig):
    return {ax.get_gid().split(":", 1)[1]: ax for ax in fig.axes
            if str(ax.get_gid()).startswith("gantt:")}


def _legend_colors(fig) -> dict:
    return {t.get_text(): h.get_facecolor() for lg in fig.legends
            for t, h in zip(lg.get_texts(), lg.legend_handles)}


def _legend_name(e) -> str:
    """What the legend calls an event's colour: its pass, its call phase with the algorithm, or
    its compute block's name."""
    pass_, sep, _ = e["label"].partition(":")
    if e["kind"] == "call":
        return f"{e['phase']} ({e['algorithm']})"
    if sep and pass_ in ("forward", "backward"):
        return f"{pass_} (per layer)"
    return e["label"].split("[")[0]


def _assert_gantt_is_the_events(plot, run_dir):
    """Every drawn bar is one event of the step (start, duration, lane) in the colour the legend
    gives its pass or phase, every event is drawn, the lanes are exactly the used ones, a block
    nested in another is drawn below it, the axis unit fits the step."""
    data = step_events(run_dir)
    end = max(e["finish"] for evs in data["ranks"].values() for e in evs)
    unit, k = time_unit(end)
    axes = _gantt_axes(plot.fig)
    legend = _legend_colors(plot.fig)
    assert list(axes) == list(data["ranks"])
    for name, events in data["ranks"].items():
        ax = axes[name]
        got = sorted(_bars(ax), key=lambda b: (b[0], b[1], b[2]))
        want = sorted(events, key=lambda e: (e["label"], e["lane"], e["start"]))
        assert len(got) == len(want) == len(events)
        for (label, lane, x, w, patch), e in zip(got, want):
            assert (label, lane) == (e["label"], e["lane"])
            assert (x, w) == (pytest.approx(k * e["start"]),
                              pytest.approx(k * (e["finish"] - e["start"])))
            assert patch.get_facecolor() == legend[_legend_name(e)], (label, _legend_name(e))
        lanes = [t.get_text() for t in ax.get_yticklabels()]
        assert lanes == [ln for ln in LANES if any(e["lane"] == ln for e in events)]
        assert f"({unit})" in ax.get_xlabel()
        for outer, e in ((o, e) for o in got for e in got if o[1] == e[1]):
            if outer[2] <= e[2] and e[2] + e[3] <= outer[2] + outer[3] and e[3] < outer[3]:
                assert outer[4].get_y() < e[4].get_y(), (outer[0], e[0])   # nested: below


def test_step_events_reads_rank0_and_the_slowest_rank(tmp_path):
    d = write_run(tmp_path / "ddp")
    data = step_events(d)
    assert (data["step"], data["step_s"], data["slowest_rank"]) == (6, 4.2, 3)
    assert list(data["ranks"]) == ["rank 0", "rank 3 (slowest)"]
    assert data["rank_of"] == {"rank 0": 0, "rank 3 (slowest)": 3}
    assert data["ranks"]["rank 0"] == step_of_events()
    assert data["ranks"]["rank 3 (slowest)"] == step_of_events(0.2)
    assert {e["lane"] for e in data["ranks"]["rank 0"]} == set(LANES)
    assert step_events(d, 6)["ranks"] == data["ranks"]
    # rank 0 ended the step last: one panel
    alone = write_run(tmp_path / "alone", last_step={"step": 2, "step_s": 1.0, "slowest_rank": 0,
                                                     "ranks": {"0": step_of_events()}})
    assert list(step_events(alone)["ranks"]) == ["rank 0 (slowest)"]
    # only the step the summary keeps; other steps come from --trace
    with pytest.raises(ValueError, match=r"step 6 only .* not step 3: pass --step 6 or omit "
                                         r"--step; .*--trace-steps 3"):
        step_events(d, 3)


def test_time_units_by_magnitude():
    assert [fmt_time(x) for x in (0.000517, 0.004644, 0.401, 9.0, 0.0009997, 2.5e-6, None)] == \
        ["517 µs", "4.64 ms", "401 ms", "9.00 s", "1.00 ms", "2.50 µs", "-"]
    assert time_unit(0.0021) == ("ms", 1e3) and time_unit(4.2) == ("s", 1.0)
    assert time_unit(4.8e-5) == ("µs", 1e6)


@needs_mpl
def test_gantt_bars_are_the_job_simulation_events(tmp_path, capsys):
    d = write_run(tmp_path / "ddp")
    plot = plot_gantt(d, tmp_path / "g.png")
    assert plot.path.read_bytes()[:8] == PNG
    _assert_gantt_is_the_events(plot, d)
    assert plot.data["unit"] == "s" and plot.data["step"] == 6
    assert plot.data["lanes"]["rank 0"] == ["compute", "offload", "stream", "calls"]
    # the calls of a phase and size are named once with their bytes and an arrow to each bar
    # (a call that took no time included)
    texts = {t.get_text() for ax in plot.fig.axes for t in ax.texts}
    assert f"grad_allreduce ×2: {fmt_bytes(3000)}" in texts
    assert f"sparse_allgather: {fmt_bytes(1024)}" in texts
    assert f"model_bcast: {fmt_bytes(512)}" in texts
    assert {"fc", "optimizer", "pack", "forward+backward"} <= texts   # names that fit their bars
    axes = _gantt_axes(plot.fig)
    arrows = [t for t in axes["rank 0"].texts if t.get_text() == "" and t.arrow_patch]
    assert len(arrows) == 4                                          # rank 0: four calls
    bars = [b for b in plot.data["bars"] if b["rank"] == "rank 0" and b["kind"] == "call"]
    assert [(b["label"], b["bytes"], b["algorithm"]) for b in bars] == \
        [(e["label"], e["nbytes"], e["algorithm"]) for e in step_of_events()
         if e["kind"] == "call"]
    # the panels and the footer: the step, the job's step, what is measured and what simulated
    assert axes["rank 3 (slowest)"].get_title().startswith("rank 3 (slowest): step 6")
    said = " ".join(t.get_text() for t in plot.fig.texts)
    assert f"job step 6: {fmt_time(4.2)}" in said and "rank 3 ended this one" in said
    assert "compute modeled from FLOP counts" in said
    assert f"communication simulated with every rank's messages on {NETWORK['name']}" in said
    assert "inter-node 1 x 100 Gbit/s + 5 µs" in said and "link sharing fifo" in said
    # the legend names every colour once: passes, compute blocks, call phases
    legend = [t.get_text() for lg in plot.fig.legends for t in lg.get_texts()]
    assert legend == ["forward (per layer)", "backward (per layer)", "forward+backward", "pack",
                      "optimizer", "grad_allreduce (allreduce)", "sparse_allgather (allgather)",
                      "model_bcast (bcast)"]
    assert main(["gantt", str(d), "--step", "6"]) == 0
    assert (d / "gantt.png").read_bytes()[:8] == PNG
    assert "gantt.png" in capsys.readouterr().out
    # no offload work, no blocking call, a CPU-timed millisecond step: no such lanes, ms axis
    ms = [dict(e, start=e["start"] / 1e3, finish=e["finish"] / 1e3) for e in step_of_events()
          if e["lane"] not in ("offload", "calls")]
    d2 = write_run(tmp_path / "topk", ranks={"0": ms, "3": ms},
                   source="cpu_thread (blas_threads=1)")
    plot = plot_gantt(d2, tmp_path / "g2.png")
    _assert_gantt_is_the_events(plot, d2)
    assert plot.data["unit"] == "ms"
    assert plot.data["lanes"]["rank 0"] == ["compute", "stream"]
    said = " ".join(t.get_text() for t in plot.fig.texts)
    assert "compute measured (thread CPU time" in said
    legend = [t.get_text() for lg in plot.fig.legends for t in lg.get_texts()]
    assert "pack" not in legend and "model_bcast (bcast)" not in legend


@pytest.mark.parametrize("make,match", [
    (lambda t: t / "missing", "is not a directory"),
    (lambda t: (t / "empty").mkdir() or t / "empty", "has no summary.json"),
    (lambda t: write_run(t / "old", clock=False, timeline=True),
     (r"has no clock block \(its 'timeline' block is the one-rank event timeline.*recorded "
      "by an older spardist; run it again")),
    (lambda t: write_run(t / "older", clock=False),
     "has no clock block: the run was recorded by an older spardist"),
    (lambda t: write_run(t / "nostep", last_step=None),
     r"keeps no last_step: the run simulated no step .*\(7 steps"),
    (lambda t: write_run(t / "norank0", ranks={"3": step_of_events()}),
     "has no events of rank 0"),
])
def test_gantt_refuses_bad_run_dirs(tmp_path, make, match):
    d = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        plot_gantt(d, tmp_path / "g.png")
    with pytest.raises(ValueError, match=match):
        main(["gantt", str(d)])


def test_gantt_refuses_a_step_it_does_not_have(tmp_path):
    d = write_run(tmp_path / "ddp")
    with pytest.raises(ValueError, match="pass --step 6 or omit --step"):
        main(["gantt", str(d), "--step", "2"])


def test_tta_points_and_bad_dirs(tmp_path):
    d = write_run(tmp_path / "ddp")
    label, xs, ys = tta_points(d)
    assert label == "ddp" and xs == [0.5, 1.0, 1.5] and ys == [0.4, 0.7, 0.8]
    none = write_run(tmp_path / "noacc", lines=[{"step": 1, "sim_s": 0.1, "loss": 2.0}])
    with pytest.raises(ValueError, match="no line with both sim_s and test_accuracy"):
        tta_points(none)
    with pytest.raises(ValueError, match="is not a directory"):
        main(["plot-tta", str(d), str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="at least one RUN_DIR"):
        plot_tta([], tmp_path / "t.png")
    # an older spardist's sim_s is another clock's: refused, not plotted beside this one's
    old = write_run(tmp_path / "old", clock=False, timeline=True)
    with pytest.raises(ValueError, match=r"old/summary.json has no clock block .*older spardist"):
        tta_points(old)
    with pytest.raises(ValueError, match="older spardist"):
        main(["plot-tta", str(d), str(old)])


@needs_mpl
def test_tta_plots_each_runs_points(tmp_path):
    a, b = write_run(tmp_path / "ddp"), write_run(tmp_path / "topk")
    # two runs of one method are told apart by their directories, never "ddp (ddp)"
    c = write_run(tmp_path / "again", method="ddp", lines=[
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
    # how compute was timed and where the calls were simulated, from the runs' clock blocks
    said = " ".join(t.get_text() for t in plot.fig.texts)
    assert "compute modeled from FLOP counts (flops (15.7 TFLOP/s))" in said
    assert f"job simulation) on {NETWORK['name']}" in said
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
                 "32", "--gpus-per-node", "4", "--compute-s-per-sample", "0.0005",
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


@pytest.mark.mpi
@needs_mpl
def test_gantt_of_a_real_2x2_ddp_run(tmp_path):
    """A 2 x 2 ddp run keeps the job simulation's events of its last step (rank 0 and the rank
    that ended it last); the chart draws them, and they follow DDP: the gradients' all-reduce
    is issued without waiting once the backward has written them, the optimizer waits for it,
    and it carries the ledger's bytes."""
    out = tmp_path / "ddp"
    run_mpi(None, 4, "train", "--method", "ddp", "--steps", "4", "--eval-every", "2",
            "--ranks-per-node", 2, "--out", out, module="dataparallel", timeout=180)
    summary = json.loads((out / "summary.json").read_text())
    data = step_events(out)
    # the step kept is the last of the run loop: its job step is the last of steps_max
    assert data["step_s"] == summary["steps_max"]["step_s"][-1]
    assert data["slowest_rank"] in range(4) and next(iter(data["ranks"])).startswith("rank 0")
    ph = summary["traffic"]["measured"]["by_phase"]["grad_allreduce"]
    T4 = ph["payload_bytes"] / 4 / ph["calls"]        # every rank's buffer, per call
    for events in data["ranks"].values():
        backward = [e for e in events if e["label"].startswith("backward:")]
        calls = [e for e in events if e["kind"] == "call"]
        optimizer = [e for e in events if e["label"] == "optimizer"]
        assert backward and calls and len(optimizer) == 1
        assert {(e["phase"], e["lane"], e["algorithm"]) for e in calls} == \
            {("grad_allreduce", "stream", "allreduce")}
        assert all(e["nbytes"] == T4 for e in calls)
        assert min(e["start"] for e in calls) >= max(e["finish"] for e in backward) - 1e-12
        assert optimizer[0]["start"] >= max(e["finish"] for e in calls) - 1e-12
    plot = plot_gantt(out, tmp_path / "gantt.png")
    assert plot.path.read_bytes()[:8] == PNG
    _assert_gantt_is_the_events(plot, out)
    rank0 = next(k for k in plot.data["lanes"] if k.startswith("rank 0"))  # may end it last
    assert plot.data["lanes"][rank0] == ["compute", "stream"]   # no offload, no blocking
    # DDP's one bucket is the whole gradient: one call, named with its bytes
    assert f"grad_allreduce: {fmt_bytes(T4)}" in plot.data["labels"][rank0], \
        plot.data["labels"][rank0]
    _, xs, _ = tta_points(out)
    assert len(xs) == 2 and xs[0] < xs[1]
