"""Defaults that learn: every model trains on its own defaults (the transformers with
AdamW, warm-up and cosine decay; the CNNs with SGD), and a brief run on them beats chance by a
margin (the byte GPT: its held-out bits per byte below the corpus's unigram entropy)."""

from __future__ import annotations

import json

import pytest

from models.train import MODEL_DEFAULTS, main, model_defaults


def _train(tmp_path, *args):
    out = tmp_path / "run"
    main(["train", *map(str, args), "--out", str(out), "--quiet"])
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("model,dataset,steps,chance,margin", [
    ("vit", "digits", 200, 0.1, 0.15), ("cnn", "digits", 60, 0.1, 0.5),
    ("mlp", "digits", 60, 0.1, 0.5)])
def test_a_brief_run_on_the_defaults_beats_chance(tmp_path, model, dataset, steps, chance,
                                                   margin):
    s = _train(tmp_path, "--model", model, "--dataset", dataset, "--steps", steps)
    assert s["metrics"]["final_test_accuracy"] > chance + margin
    want = MODEL_DEFAULTS.get(model, {}).get("optimizer", "sgd")
    assert s["config"]["optimizer"] == want


def test_the_byte_gpt_beats_the_unigram_entropy_on_its_defaults(tmp_path):
    s = _train(tmp_path, "--model", "gpt", "--dataset", "text", "--steps", 200)
    m = s["metrics"]
    assert m["final_test_bits_per_byte"] < m["unigram_entropy"]
    assert s["config"]["optimizer"] == "adamw" and s["config"]["lr_schedule"] == "cosine"


def test_flags_override_the_model_defaults():
    got = model_defaults("vit", {"lr": 0.1, "optimizer": None})
    assert got["lr"] == 0.1 and got["optimizer"] == "adamw" and got["warmup"] == 0.05
    assert model_defaults("cnn", {})["optimizer"] == "sgd"
