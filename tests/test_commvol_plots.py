"""``commvol gantt``, ``plot-scaling`` and ``plot-tta``: PNGs from hand-made run directories and
from a real 2 x 2 ddp run's timeline block, and clear errors for directories they cannot use."""

import importlib.util
import json

import pytest

from commvol.__main__ import main
from commvol.plots import LANES, plot_gantt, plot_scaling, plot_tta, step_events, tta_points
from mpi_helpers import run_mpi

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


def _run(d, *, timeline=True, lines=None, mode="timeline", step_events=None):
    d.mkdir(parents=True)
    summary = {"system": "dataparallel", "method": d.name}
    if timeline:
        tl = {"mode": mode, "compute_source": "flops (15.7 TFLOP/s)", "steps": 6,
              "rank0": {"step_s": 4.0, "events": _events()}, "busiest_rank": 3,
              "busiest": {"step_s": 4.2, "events": _events(0.2)}}
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


@needs_mpl
def test_gantt_png(tmp_path, capsys):
    d = _run(tmp_path / "ddp")
    p = plot_gantt(d, tmp_path / "g.png")
    assert p.path.read_bytes()[:8] == PNG and p.path.stat().st_size > 5000
    assert main(["gantt", str(d), "--step", "6"]) == 0
    assert (d / "gantt.png").read_bytes()[:8] == PNG
    assert "gantt.png" in capsys.readouterr().out


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
    assert label == "ddp (ddp)" and xs == [0.5, 1.0, 1.5] and ys == [0.4, 0.7, 0.8]
    none = _run(tmp_path / "noacc", lines=[{"step": 1, "sim_s": 0.1, "loss": 2.0}])
    with pytest.raises(ValueError, match="no line with both sim_s and test_accuracy"):
        tta_points(none)
    with pytest.raises(ValueError, match="is not a directory"):
        main(["plot-tta", str(d), str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="at least one RUN_DIR"):
        plot_tta([], tmp_path / "t.png")


@needs_mpl
def test_tta_png(tmp_path):
    a, b = _run(tmp_path / "ddp"), _run(tmp_path / "topk")
    p = plot_tta([a, b], tmp_path / "tta.png", target=0.7)
    assert p.path.read_bytes()[:8] == PNG and p.path.stat().st_size > 5000


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
def test_plot_scaling_png(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["scale", "--system", "ddp", "topk", "--model", "cnn", "--gpus", "8", "16",
                 "64", "--gpus-per-node", "4", "--device-tflops", "0.05", "--out",
                 str(out)]) == 0
    png = tmp_path / "scaling.png"
    assert main(["plot-scaling", str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000


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
    p = plot_gantt(out, tmp_path / "gantt.png")
    assert p.path.read_bytes()[:8] == PNG
    _, xs, _ = tta_points(out)
    assert len(xs) == 2 and xs[0] < xs[1]
