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
from commvol.predict import predict, resolve_model
from commvol.report import comparison_table, load_run, time_to_target, write_plots
from commvol.scale import measure_compute_s_per_sample, strong_scaling
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


def test_strong_scaling_formula():
    spec = resolve_model("cnn")
    t_s, D, b = 1e-3, 10_000, 32
    rows = strong_scaling("ddp", spec, [4, 8, 16], 2, compute_s_per_sample=t_s,
                          dataset_size=D, batch_size=b)
    for r in rows:
        step = predict("ddp", spec=spec, nodes=r["gpus"] // 2, gpus_per_node=2).steady.time_s
        p = r["gpus"]
        assert r["time_s"] == pytest.approx(D / p * t_s + math.ceil(D / (p * b)) * step)
        assert r["speedup"] == pytest.approx(rows[0]["time_s"] / r["time_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] * 4 / p)
    hs = strong_scaling("hsadmm", spec, [4], 2, compute_s_per_sample=t_s, dataset_size=D,
                        local_epochs=2.0)
    steady = predict("hsadmm", spec=spec, nodes=2, gpus_per_node=2).steady.time_s
    assert hs[0]["comm_s"] == pytest.approx(steady / 2)
    with pytest.raises(ValueError, match="multiples of --gpus-per-node 4"):
        strong_scaling("ddp", spec, [6], 4, compute_s_per_sample=t_s)
    with pytest.raises(ValueError, match="model-parallel sparse SGD"):
        strong_scaling("hsgd", spec, [4], 2, compute_s_per_sample=t_s)
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
           for ln in text.splitlines() if ln.startswith("| hs") or ln.startswith("| ddp")}
    # method, topo, acc, units, total, per unit, payload, comm, sim, wall, tta, vs ddp, match
    assert row["hsadmm"][2:] == ["0.9500", "3 iterations", "300 B", "100 B / iteration",
                                 "0.6000", "500 ms", "3.00 s", "9.00 s", "2.00 s", "0.250", "yes"]
    assert row["ddp"][3:7] == ["6 steps", "1.17 KiB", "200 B / step", "1.0000"]
    assert row["ddp"][10:] == ["2.50 s", "1.000", "NO"]
    with pytest.raises(ValueError, match="has no summary.json"):
        comparison_table([hs.parent / "missing"])


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_report_plots(fake_runs, tmp_path, capsys):
    hs, ddp = fake_runs
    scale = tmp_path / "scale.json"
    main(["scale", "--system", "ddp", "hsadmm", "--model", "cnn", "--gpus", "4", "8",
          "--gpus-per-node", "2", "--compute-s-per-sample", "0.001", "--out", str(scale)])
    assert "| ddp | 8 | 4 |" in capsys.readouterr().out
    paths = write_plots([hs, ddp], tmp_path / "plots", scaling=scale)
    names = sorted(p.name for p in paths)
    assert names == ["accuracy_vs_bytes.png", "comm_breakdown.png", "payload.png",
                     "residuals.png", "scaling.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
