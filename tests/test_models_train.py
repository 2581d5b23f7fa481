"""Serial training: the digits CNN learns; the CLI writes metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.data import load_digits
from models.optim import SGD, SGDConfig, make_schedule
from models.train import TrainConfig, evaluate, fit
from models.zoo import cnn

ROOT = Path(__file__).resolve().parents[1]


def test_digits_cnn_reaches_95_percent():
    # One BLAS thread: these GEMMs are small, and threaded OpenBLAS slows down by 10x or more
    # when the two CI cores are shared with other processes (no effect on the result).
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"):
        _train_digits_and_check()


def _train_digits_and_check():
    train, test = load_digits()
    model = cnn(train.input_shape, 10, seed=0)
    epochs, bs = 6, 32
    steps = epochs * -(-len(train) // bs)
    opt = SGD(model.params, model.grads, SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-4),
              schedule=make_schedule("cosine", 0.05, steps))
    records = []
    result = fit(model, opt, train, test, epochs=epochs, batch_size=bs, seed=0,
                 on_epoch=records.append)
    assert result["final_test_accuracy"] >= 0.95
    assert len(records) == epochs and records[-1]["step"] == steps == result["steps"]
    assert records[-1]["loss"] < records[0]["loss"]
    # the reported accuracy is the fraction of correct predictions (independent recount)
    pred = model.predict(test.x)
    assert result["final_test_accuracy"] == pytest.approx(float(np.mean(pred == test.y)))
    loss, acc = evaluate(model, test, batch_size=50)
    assert acc == pytest.approx(result["final_test_accuracy"])


def test_train_config_is_frozen_and_validated():
    cfg = TrainConfig()
    with pytest.raises(Exception):
        cfg.epochs = 3
    with pytest.raises(ValueError, match="valid names"):
        TrainConfig(model="vgg")
    with pytest.raises(ValueError, match="nesterov"):
        TrainConfig(momentum=0.0, nesterov=True)


def _run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "models", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_writes_metrics_and_summary(tmp_path):
    out = tmp_path / "run"
    proc = _run_cli("train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "2",
                    "--batch-size", "64", "--lr", "0.05", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["system"] == "models" and summary["config"]["model"] == "mlp"
    assert summary["metrics"]["final_test_accuracy"] == lines[-1]["test_accuracy"]
    assert summary["metrics"]["final_loss"] == lines[-1]["loss"]
    assert summary["topology"]["world"] == 1


def test_cli_unknown_model_fails_cleanly(tmp_path):
    proc = _run_cli("train", "--model", "vgg", "--out", str(tmp_path / "x"))
    assert proc.returncode != 0
    assert "vgg" in proc.stderr and "cnn" in proc.stderr
