"""commvol partition-table (H-SGD Table 1), sparse-SGD volumes against a brute-force count,
strong scaling, and the report's table/plots on hand-made run directories."""

import csv
import importlib.util
import json
import math

import numpy as np
import pytest

from commvol.__main__ import main
from commvol.hsgd import radixnet_config, radixnet_weights
from commvol.partition_table import TABLE_KEYS, partition_table
from commvol.predict import fmt_bytes, predict, resolve_model
from commvol.report import comparison_table, draw_report, load_run, time_to_target, write_plots
from commvol.scale import measure_compute_s_per_sample
from hsadmm.penalty import penalty_groups
from partition import partition_metrics, random_partition
from sparse_sgd.plan import PartitionOptions, plan_partition

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
DET = PartitionOptions(engine="mtkahypar", preset="deterministic", threads=1)


def test_partition_table_rows_are_the_partition_metrics(tmp_path):
    rows = partition_table([64], [2, 4], layers=2, options=DET)
    network = radixnet_config(64, 2)
    weights = radixnet_weights(64, 2)
    for P in (2, 4):
        got = {r["method"]: r for r in rows if r["parts"] == P}
        assert list(got) == ["H/R", "H", "R", "E[R]", "LB"]
        for label, method in (("H", "hypergraph"), ("R", "random")):
            want = partition_metrics(weights, plan_partition(weights, P, method, DET,
                                                             network=network)).table1()
            assert {k: got[label][k] for k in TABLE_KEYS} == {k: want[k] for k in TABLE_KEYS}
        for k in TABLE_KEYS:
            assert got["H/R"][k] == pytest.approx(got["H"][k] / got["R"][k])
        assert got["H"]["avg_volume"] < got["R"]["avg_volume"]  # the point of H-SGD
        assert got["LB"]["avg_volume"] <= got["H"]["avg_volume"]
        # E[R] written from the paper: (N/P)(P-1)(1-(1-1/P)^32), column degree 32
        assert got["E[R]"]["avg_volume"] == pytest.approx(64 / P * (P - 1) * (1 - (1 - 1 / P)
                                                                              ** 32))
    out = tmp_path / "t"
    main(["partition-table", "--neurons", "64", "--parts", "2", "--layers", "2", "--engine",
          "mtkahypar", "--preset", "deterministic", "--threads", "1", "--out", str(out)])
    back = list(csv.DictReader((out / "table1.csv").open()))
    assert [r["method"] for r in back] == ["H/R", "H", "R", "E[R]", "LB"]
    assert float(back[2]["avg_volume"]) == [r for r in rows if r["parts"] == 2][2]["avg_volume"]
    with pytest.raises(ValueError, match="--overwrite"):
        main(["partition-table", "--neurons", "64", "--parts", "2", "--layers", "2",
              "--out", str(out)])
    with pytest.raises(ValueError, match="--neurons must be 16 \\* 2\\^m"):
        partition_table([100], [2], layers=1)
    with pytest.raises(ValueError, match="--parts \\[128\\] outside 1..64"):
        partition_table([64], [128], layers=1)


def test_sparse_sgd_bytes_against_a_brute_force_count():
    """SpFF sends, per layer, x^{k-1} entries of n used by rows of m (n -> m); SpBP sends the
    same counts back for k >= 2; each word is batch x word_bytes bytes."""
    weights = radixnet_weights(64, 3)
    part = random_partition(weights, 4, seed=0)  # what predict("sgd", seed=0) partitions with
    node = np.arange(4) // 2
    batch, wb = 3, 4
    want = {"spff": [0, 0], "spbp": [0, 0]}
    msgs = {"spff": 0, "spbp": 0}
    for k, W in enumerate(weights):
        A = W.toarray() != 0
        rows, cols = part.owners[k + 1], part.owners[k]
        for m in range(4):
            used = A[rows == m].any(axis=0)
            for n in range(4):
                if n == m:
                    continue
                d = int((used & (cols == n)).sum())
                for ph in ("spff", "spbp") if k else ("spff",):
                    want[ph][int(node[m] != node[n])] += d * batch * wb
                    msgs[ph] += d > 0
    it = predict("sgd", nodes=2, gpus_per_node=2, neurons=64, layers=3, batch_size=batch,
                 dtype="float32").steady
    for ph in ("spff", "spbp"):
        assert (it.phases[ph]["intra"], it.phases[ph]["inter"]) == tuple(want[ph])
        assert it.messages[ph] == msgs[ph]


def test_compute_time_per_sample_is_measured():
    assert measure_compute_s_per_sample("cnn", batch=2, reps=1) > 0


def _write_run(d, summary, lines):
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def _summary(system, method, inter, by_phase, metrics, predicted_inter=None):
    pred = inter if predicted_inter is None else predicted_inter
    return {"system": system, "method": method,
            "config": {"model": "cnn", "dataset": "digits"},
            "topology": {"nodes": 2, "ranks_per_node": 2},
            "traffic": {"measured": {"inter_node_bytes": inter, "intra_node_bytes": 5,
                                     "by_phase": by_phase},
                        "predicted": {"inter_node_bytes": pred, "intra_node_bytes": 5}},
            "metrics": metrics, "timing": {"comm_modeled_s": 0.5, "sim_s": 3.0, "wall_s": 9.0}}


@pytest.fixture
def fake_runs(tmp_path):
    L = len(resolve_model("cnn").layout)
    hs = _write_run(tmp_path / "hs", _summary(
        "hsadmm", "hsadmm", 300,
        {"inter_allreduce": {"modeled_s": 0.3}, "bcast_z": {"modeled_s": 0.2}},
        {"final_test_accuracy": 0.95, "iterations": 3}),
        [{"iteration": k, "test_accuracy": a, "sim_s": 1.0 + k, "inter_node_bytes": 100,
          "compact_elems": 60, "dense_elems": 100, "r_intra": [0.5 / (k + 1)] * L,
          "r_inter": [0.1 / (k + 1)] * L} for k, a in enumerate((0.5, 0.92, 0.95))])
    ddp = _write_run(tmp_path / "ddp", _summary(
        "dataparallel", "ddp", 1200, {"grad_allreduce": {"modeled_s": 0.5}},
        {"final_test_accuracy": 0.91, "steps": 6, "payload_ratio": 1.0}, predicted_inter=1),
        [{"step": 3, "test_accuracy": 0.6, "sim_s": 1.5, "inter_node_bytes": 600},
         {"step": 6, "test_accuracy": 0.91, "sim_s": 2.5, "inter_node_bytes": 600}])
    return hs, ddp


def test_report_table(fake_runs):
    hs, ddp = fake_runs
    assert time_to_target(load_run(hs).lines, 0.9) == 2.0
    assert time_to_target(load_run(ddp).lines, 0.95) is None
    text = comparison_table([hs, ddp], target=0.9)
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
           for ln in text.splitlines() if ln.startswith(("| hs", "| ddp"))}
    # method, topo, acc, units, total, per unit, payload, comm, sim, wall, tta, vs ddp, match
    assert row["hsadmm"][2:] == ["0.9500", "3 iterations", "300 B", "100 B / iteration",
                                 "0.6000", "500 ms", "3.00 s", "9.00 s", "2.00 s", "0.250", "yes"]
    assert row["ddp"][3:7] == ["6 steps", "1.17 KiB", "200 B / step", "1.0000"]
    assert row["ddp"][10:] == ["2.50 s", "1.000", "NO"]
    with pytest.raises(ValueError, match="has no summary.json"):
        comparison_table([hs.parent / "missing"])


def _cum_at_evals(lines, key="inter_node_bytes"):
    """Cumulative ``key`` bytes of a run at each line that logs a test accuracy."""
    cum, out = 0, []
    for ln in lines:
        cum += ln.get(key, 0)
        if "test_accuracy" in ln:
            out.append(cum)
    return out


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_report_plots(fake_runs, tmp_path, capsys):
    """Every report plot, read back from its figure, against the run directories' numbers."""
    hs, ddp = fake_runs
    layers, _ = penalty_groups(resolve_model("cnn").layout, "layer")     # conv1, conv2, ...
    G = len(layers)
    # an H-SADMM run that logs per-layer residuals (rho_scope layer), a flat ADMM run (r_inter
    # identically 0: one consensus level) and a Top-K run whose epochs are logged
    hs2 = _write_run(tmp_path / "hs2", {**_summary(
        "hsadmm", "hsadmm", 900, {"inter_allreduce": {"modeled_s": 3e-4}},
        {"final_test_accuracy": 0.9, "iterations": 3}),
        "config": {"model": "cnn", "dataset": "digits", "rho_scope": "layer",
                   "local_epochs": 1.0, "local_steps": None}},
        [{"iteration": k, "test_accuracy": 0.5 + 0.1 * k, "inter_node_bytes": 300 - 10 * k,
          "intra_node_bytes": 7000, "compact_elems": 60 - k, "dense_elems": 100,
          "r_intra": [(g + 1) / (k + 1) for g in range(G)],
          "r_inter": [0.0 if g == 0 else 0.1 * (g + 1) / (k + 1) for g in range(G)]}
         for k in range(3)])
    flat = _write_run(tmp_path / "flat", {**_summary(
        "hsadmm", "flat-admm", 600, {"world_allreduce": {"modeled_s": 6.27e-4}},
        {"final_test_accuracy": 0.9, "iterations": 3}),
        "config": {"model": "cnn", "dataset": "digits", "rho_scope": "layer"}},
        [{"iteration": k, "test_accuracy": 0.5, "inter_node_bytes": 200, "compact_elems": 100,
          "dense_elems": 100, "r_intra": [1.0] * G, "r_inter": [0.0] * G} for k in range(3)])
    topk = _write_run(tmp_path / "topk", _summary(
        "dataparallel", "topk", 48, {"topk_allgather": {"modeled_s": 1.5e-3}},
        {"final_test_accuracy": 0.8, "steps": 8}),
        [{"step": 4 * k, "epoch": k / 2, "test_accuracy": 0.7 + 0.05 * k, "inter_node_bytes": 24,
          "intra_node_bytes": 24000} for k in (1, 2)])
    runs = [hs, ddp, hs2, flat, topk]
    scale = tmp_path / "scale.json"
    main(["scale", "--system", "ddp", "hsadmm", "--model", "cnn", "--gpus", "4", "8",
          "--gpus-per-node", "2", "--compute-s-per-sample", "0.001", "--out", str(scale)])
    assert "| ddp | 8 | 4 |" in capsys.readouterr().out
    plots = draw_report(runs, tmp_path / "plots", scaling=scale)
    assert sorted(p.name for p in write_plots(runs, tmp_path / "again", scaling=scale)) == \
        sorted(plots) == ["accuracy_vs_bytes.png", "comm_breakdown.png", "payload.png",
                          "residuals.png", "scaling.png"]
    for p in plots.values():
        assert p.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines_of = {r.name: load_run(r).lines for r in runs}
    label = {"hs": "hsadmm (hs)", "ddp": "ddp", "hs2": "hsadmm (hs2)", "flat": "flat-admm",
             "topk": "topk"}

    # accuracy vs bytes: log axis; x = the ledger's cumulative inter-node bytes at each
    # evaluation, its total in the legend; one legend entry per run
    ax = plots["accuracy_vs_bytes.png"].fig.axes[0]
    assert ax.get_xscale() == "log"
    got = {ln.get_label(): ln for ln in ax.get_lines()}
    for d, lb in label.items():
        total = sum(x["inter_node_bytes"] for x in lines_of[d])
        line = got[f"{lb} ({fmt_bytes(total)})"]
        assert list(line.get_xdata()) == _cum_at_evals(lines_of[d])
        assert list(line.get_ydata()) == [x["test_accuracy"] for x in lines_of[d]]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == len(set(legend)) == len(runs)
    assert "handed to MPI" in " ".join(t.get_text() for t in ax.figure.texts)

    # payload: (a) compact/dense float32 payload of the H-SADMM runs that compact (not flat
    # ADMM, whose compact = dense is said instead); (b) inter-node bytes per epoch, log axis
    fig = plots["payload.png"].fig
    a, b = fig.axes
    unit = plots["payload.png"].data["payload_unit"]
    div = {"B": 1, "KiB": 1024}[unit]
    got = {ln.get_label(): ln for ln in a.get_lines()}
    assert sorted(got) == ["hsadmm (hs): compact", "hsadmm (hs): dense", "hsadmm (hs2): compact",
                           "hsadmm (hs2): dense"]
    assert list(got["hsadmm (hs2): compact"].get_ydata()) == \
        [4 * x["compact_elems"] / div for x in lines_of["hs2"]]
    assert f"({unit})" in a.get_ylabel()
    assert any("flat-admm: compact = dense" in t.get_text() for t in a.texts)
    assert b.get_yscale() == "log"
    got = {ln.get_label(): ln for ln in b.get_lines()}
    assert sorted(got) == ["hsadmm (hs2)", "topk"]          # the others log no epochs
    assert list(got["topk"].get_xdata()) == [0.5, 1.0]
    assert list(got["topk"].get_ydata()) == [48.0, 48.0]   # 24 B per half epoch
    assert list(got["hsadmm (hs2)"].get_ydata()) == [300, 290, 280]
    assert "epochs not recorded" in " ".join(plots["payload.png"].data["notes"])

    # communication breakdown: each bar is its phase's share of the run's modeled time, the
    # total printed in a unit chosen by magnitude
    ax = plots["comm_breakdown.png"].fig.axes[0]
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks == ["hsadmm (hs) (500 ms)", "ddp (500 ms)", "hsadmm (hs2) (300 µs)",
                     "flat-admm (627 µs)", "topk (1.50 ms)"]
    bars = {p.get_gid(): p for p in ax.patches}
    want = {}
    for i, (d, lb) in enumerate(label.items()):
        bp = load_run(tmp_path / d).summary["traffic"]["measured"]["by_phase"]
        total, left = sum(e["modeled_s"] for e in bp.values()), 0.0
        for ph in sorted(bp):
            want[f"{lb}|{ph}"] = (i, pytest.approx(left), pytest.approx(bp[ph]["modeled_s"]
                                                                        / total))
            left += bp[ph]["modeled_s"] / total
    assert {g: (round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_width())
            for g, p in bars.items()} == want
    assert bars["hsadmm (hs)|inter_allreduce"].get_width() == pytest.approx(0.6)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == len(set(legend))

    # residuals: per-layer lines named by the model's layers, the data as logged (zeros left
    # out of the log axis, never clamped to 1e-30); flat ADMM's r_inter is not drawn
    fig = plots["residuals.png"].fig
    axes = fig.axes
    titles = [ax.get_title() for ax in axes]
    r_intra = axes[titles.index(next(t for t in titles if t.startswith("hsadmm (hs2): intra")))]
    got = {ln.get_label(): ln for ln in r_intra.get_lines()}
    assert sorted(got) == sorted(layers)
    for g, name in enumerate(layers):
        assert list(got[name].get_ydata()) == [x["r_intra"][g] for x in lines_of["hs2"]]
    r_inter = axes[titles.index(next(t for t in titles if t.startswith("hsadmm (hs2): inter")))]
    zero_layer = {ln.get_label(): ln for ln in r_inter.get_lines()}[layers[0]]
    assert all(math.isnan(y) for y in zero_layer.get_ydata())
    assert min(y for ln in r_inter.get_lines() for y in ln.get_ydata() if not math.isnan(y)) > 1e-3
    flat_inter = axes[titles.index("flat-admm: r_inter")]
    assert not flat_inter.get_lines()
    assert any("r_inter = 0 in every layer and iteration" in t.get_text()
               for t in flat_inter.texts)
    assert all(ax.get_yscale() == "log" for ax in axes if ax.get_lines())

    # scaling: the model's lines are the scale JSON's rows, labelled modeled
    doc = json.loads(scale.read_text())
    a, _ = plots["scaling.png"].fig.axes
    got = {ln.get_label(): ln for ln in a.get_lines()}
    for name, rows in doc["systems"].items():
        assert list(got[f"{name}: modeled, job simulation"].get_ydata()) == [r["speedup"]
                                                                        for r in rows]
