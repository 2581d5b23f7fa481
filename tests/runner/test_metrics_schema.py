"""One metrics schema for every trainer: ``runner/metrics.schema.json`` documents each
field, :func:`runner.metrics.check_line` enforces it, every trainer's ``metrics.jsonl`` conforms
(hsadmm, flat ADMM, every data-parallel strategy, sparse_sgd train, models train), the lines
agree with the run (bytes add up to its traffic, evaluations where ``--eval-every`` puts
them, units counted), and ``commvol report --csv`` exports them."""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mpi_helpers import run_mpi

from commvol.report import add_parser
from runner import metrics
from runner.loop import RunLoop
from runner.options import CommonConfig
from substrate.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"line", "cumulative", "interval", "interval-mean", "evaluation"}

GOOD = {"unit": "step", "index": 6, "step": 6, "interval_units": 3, "intra_node_bytes": 10,
        "inter_node_bytes": 0, "step_wall_s": 0.5, "step_sim_s": 0.25, "sim_s": 1.5, "eval_wall_s": None, "test_accuracy": None,
        "compute_s": 1.2, "comm_modeled_s": 0.1, "phase_modeled_s": {"ddp_allreduce": 0.1},
        "loss": 2.3, "anything_else": [1, 2]}


# -- the schema and its validator (no MPI) ------------------------------------------------------
def test_schema_documents_every_field():
    sch = metrics.schema()
    props = sch["properties"]
    assert set(sch["required"]) <= set(props)
    assert sch["additionalProperties"] is True       # the systems' own fields
    for name, p in props.items():
        assert p.get("x-kind") in KINDS, name
        assert len(p.get("description", "")) > 20, name
    # the brief's common fields, in the order the CSV and the lines use
    assert metrics.common_fields()[:11] == (
        "unit", "index", "interval_units", "intra_node_bytes", "inter_node_bytes",
        "step_wall_s", "step_sim_s", "sim_s", "eval_wall_s", "test_accuracy",
        "compute_s")
    kinds = {k: props[k]["x-kind"] for k in metrics.common_fields()}
    assert kinds["sim_s"] == kinds["index"] == "cumulative"
    assert kinds["inter_node_bytes"] == "interval"
    assert kinds["step_wall_s"] == kinds["step_sim_s"] == "interval-mean"
    assert kinds["test_accuracy"] == kinds["eval_wall_s"] == "evaluation"
    # the file the README names is the one the package reads
    assert metrics.SCHEMA_PATH == ROOT / "runner" / "metrics.schema.json"


def _mutated(change):
    line = copy.deepcopy(GOOD)
    change(line)
    return line


@pytest.mark.parametrize("change,message", [
    (lambda x: x.pop("eval_wall_s"), "required field 'eval_wall_s' is missing"),
    (lambda x: x.pop("interval_units"), "required field 'interval_units' is missing"),
    (lambda x: x.update(unit="batch"), "is not one of"),
    (lambda x: x.update(index=0), "below the minimum 1"),
    (lambda x: x.update(index=2.0), "is not of type integer"),
    (lambda x: x.update(inter_node_bytes=-8), "below the minimum 0"),
    (lambda x: x.update(test_accuracy=float("nan")), "not a finite number"),
    (lambda x: x.update(test_accuracy=1.5), "above the maximum 1"),
    (lambda x: x.update(test_accuracy="0.9"), "is not of type number or null"),
    (lambda x: x.update(step_sim_s="0.1"), "is not of type number or null"),
    (lambda x: x.update(phase_modeled_s={"a": "x"}), "line.phase_modeled_s.a"),
    (lambda x: x.update(loss=True), "line.loss"),
])
def test_validator_rejects_what_the_schema_forbids(change, message):
    assert metrics.check_line(GOOD) == []
    errors = metrics.check_line(_mutated(change))
    assert errors and any(message in e for e in errors), errors


def _loop(total, **kw) -> RunLoop:
    run = SimpleNamespace(common=CommonConfig(), size=1, rank=0, out="/nonexistent", unit="step",
                          ledger=Ledger())
    return RunLoop(run, total=total, flag="--steps", **kw)


def test_schedule_of_lines_and_evaluations():
    """Evaluations after every N-th unit and the last (0: the last only); lines at the log
    schedule, at every evaluation and at the last unit."""
    def plan(loop):
        dues = [loop.due(k) for k in range(loop.total)]
        return ([d.index + 1 for d in dues if d.eval], [d.index + 1 for d in dues if d.log])

    assert plan(_loop(7, eval_every=3)) == ([3, 6, 7], [3, 6, 7])
    assert plan(_loop(7, eval_every=0)) == ([7], [7])
    assert plan(_loop(4, eval_every=1, log_every=1)) == ([1, 2, 3, 4], [1, 2, 3, 4])
    # sparse_sgd's lines after steps 1, 1 + N, ... (log_phase 1) and its evaluation at the end
    assert plan(_loop(12, log_every=4, log_phase=1)) == ([12], [1, 5, 9, 12])
    assert plan(_loop(5, eval_every=3, log_every=2, log_phase=1)) == ([3, 5], [1, 3, 5])
    with pytest.raises(ValueError, match="--eval-every must be >= 0"):
        _loop(3, eval_every=-1)


def test_sparse_sgd_summary_names_the_final_accuracy_like_every_trainer(tmp_path):
    """``final_test_accuracy`` is the summary key of hsadmm, dataparallel and models (and the one
    ``commvol report`` reads); sparse_sgd writes it too, keeping its older ``test_accuracy``."""
    from sparse_sgd.cli import main as sparse_main

    out = tmp_path / "sparse"
    sparse_main(["train", "--neurons", "1024", "--layers", "2", "--steps", "2", "--batch-size",
                 "8", "--progress-every", "0", "--out", str(out)])
    summary, lines = _read(out)
    m = summary["metrics"]
    assert 0 <= m["final_test_accuracy"] <= 1
    assert m["final_test_accuracy"] == m["test_accuracy"] == lines[-1]["test_accuracy"]


# -- every trainer's lines (MPI) -----------------------------------------------------------------
#: run -> (unit, --eval-every, log schedule (every, phase); 0: lines only where evaluated)
DP = ("step", 2, (0, 0))
EXPECT = {
    "hsadmm": ("iteration", 2, (1, 0)),
    "flat-admm": ("iteration", 0, (1, 0)),
    **{m: DP for m in ("ddp", "topk", "fp16", "pactrain", "sdp", "ssfusion")},
    "sparse_sgd": ("step", 3, (2, 1)),
    "models": ("epoch", 2, (1, 0)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("schema")
    run_mpi("schema_checks.py", 4, out, timeout=900)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "models", "train", "--model", "mlp", "--dataset", "synthetic",
         "--epochs", "3", "--eval-every", "2", "--batch-size", "64", "--quiet",
         "--out", str(out / "models")], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return out


def _read(out: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, lines


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(EXPECT))
def test_every_trainer_writes_the_schema(runs, name):
    summary, lines = _read(runs / name)
    unit, eval_every, (log_every, log_phase) = EXPECT[name]
    for i, line in enumerate(lines):
        assert metrics.check_line(line) == [], (name, i, line)
        assert line["unit"] == unit
    m = summary["metrics"]
    total = m.get("iterations", m.get("steps")) if unit != "epoch" else 3
    # units counted from 1; each line's interval is the units since the previous line
    idx = [x["index"] for x in lines]
    assert idx == sorted(set(idx)) and idx[-1] == total
    assert [x["interval_units"] for x in lines] == [b - a for a, b in zip([0, *idx], idx)]
    # evaluated exactly where --eval-every says (and after the last unit); lines there and on
    # the log schedule
    evals = [k for k in range(1, total + 1)
             if k == total or (eval_every and k % eval_every == 0)]
    logs = sorted(set(evals) | {k for k in range(1, total + 1)
                                if log_every and k % log_every == log_phase % log_every})
    assert idx == logs
    assert [x["index"] for x in lines if x["eval_wall_s"] is not None] == evals
    assert [x["index"] for x in lines if x["test_accuracy"] is not None] == evals
    assert all(x["eval_wall_s"] > 0 for x in lines if x["eval_wall_s"] is not None)
    assert lines[-1]["test_accuracy"] == m["final_test_accuracy"]   # one key for every trainer
    # the lines' bytes are the run's traffic (set-up in the first, evaluations where they ran)
    for link in ("inter_node_bytes", "intra_node_bytes"):
        assert sum(x[link] for x in lines) == summary["traffic"]["predicted"].get(link, 0) == \
            summary["traffic"]["measured"][link]
    # cumulative fields never go back
    for key in ("sim_s", "compute_s", "comm_modeled_s"):
        assert [x[key] for x in lines] == sorted(x[key] for x in lines), key
    assert all(x["step_wall_s"] > 0 for x in lines)
    # the job simulation's steps: one per unit, the lines' step_sim_s their interval's mean,
    # sim_s every simulated step so far (evaluations' own steps included)
    job = summary["steps_max"]["step_s"]
    assert len(job) == idx[-1] and min(job) > 0
    for x, (a, b) in zip(lines, zip([0, *idx], idx)):
        assert x["step_sim_s"] == pytest.approx(sum(job[a:b]) / (b - a), rel=1e-9)
        assert x["sim_s"] >= sum(job[:b]) * (1 - 1e-12)
    assert summary["timing"]["sim_s"] == pytest.approx(lines[-1]["sim_s"], rel=1e-12) or \
        summary["timing"]["sim_s"] > lines[-1]["sim_s"]
    if unit == "iteration":
        assert [x["iteration"] for x in lines] == [k - 1 for k in idx]   # the paper's k
    else:
        assert [x[unit] for x in lines] == idx


@pytest.mark.mpi
def test_ssfusion_counts_missing_tensors_only_on_logged_steps(runs):
    """Steps 2 and 4 write a line (--eval-every 2); step 1 is the profiling step, so the three
    sparse steps carry the diagnostic twice."""
    m = _read(runs / "ssfusion")[0]["metrics"]
    assert m["sparse_steps"] == 3 and m["missing_rate_steps"] == 2
    assert 0 <= m["tensor_missing_rate"] <= 1


@pytest.mark.mpi
def test_report_writes_the_lines_as_csv(runs, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    names = ["hsadmm", "ddp", "sparse_sgd", "models"]
    out = runs / "csv" / "metrics.csv"
    args = parser.parse_args(["report", *(str(runs / n) for n in names), "--no-plots",
                              "--csv", str(out)])
    args.func(args)
    assert f"wrote {out}" in capsys.readouterr().out
    with open(out, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["run", "system", "method", *metrics.common_fields()]
    want = [(n, line) for n in names for line in _read(runs / n)[1]]
    assert len(rows) - 1 == len(want)
    col = {c: i for i, c in enumerate(rows[0])}
    for row, (n, line) in zip(rows[1:], want):
        assert row[col["run"]] == str(runs / n)
        assert int(row[col["index"]]) == line["index"]
        assert int(row[col["inter_node_bytes"]]) == line["inter_node_bytes"]
        acc = row[col["test_accuracy"]]
        assert (acc == "") == (line["test_accuracy"] is None)
        if acc:
            assert math.isclose(float(acc), line["test_accuracy"], rel_tol=1e-15)
        assert json.loads(row[col["phase_modeled_s"]]) == line["phase_modeled_s"]
