"""Data-parallel strategies on the transformers, under MPI on 2 virtual nodes x 2.

Each run's ledger must equal its closed form per phase and link class, as for the CNNs; SDP drops
whole Attention + MLP blocks (B-SDP / B_b-SDP, the paper's unit on Swin and LLaMA); the language
model reports its held-out loss and perplexity.
"""

import pytest
from mpi_helpers import (
    JobBatch,
    assert_fails_on_every_rank,
    assert_measured_equals_predicted,
    read_summary,
)

pytestmark = pytest.mark.mpi

COMMON = ["--steps", "2", "--eval-every", "2", "--ranks-per-node", "2", "--progress-every", "0",
          "--optimizer", "adamw", "--lr", "1e-3"]


RUNS = [
    ("ddp", "vit", []),
    ("topk", "gpt", ["--density", "0.05"]),
    ("sdp", "vit", ["--sdp-mode", "block", "--active-blocks", "2/4"]),
    ("sdp", "gpt", ["--sdp-mode", "block-backward", "--active-blocks", "1/2"]),
    ("ssfusion", "gpt", ["--no-momentum-correction", "--fusion", "multi-tensor",
                         "--fusion-policy", "count", "--profile-steps", "0"]),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The runs below in one MPI launch."""
    b = JobBatch(tmp_path_factory.mktemp("transformer_runs"))
    for i, (method, model, extra) in enumerate(RUNS):
        data = ["--dataset", "text", "--arch", "context=16"] if model == "gpt" else []
        b.add(f"run-{i}", 4, "dataparallel", "train", "--method", method, "--model", model,
              *data, *COMMON, *extra, "--out", b.root / f"run-{i}")
    return b


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"{m}-{n}" for m, n, _ in RUNS])
def test_transformer_runs_traffic_equals_prediction(jobs, i):
    model = RUNS[i][1]
    out = jobs.run(f"run-{i}")
    s = read_summary(out)
    assert_measured_equals_predicted(s)
    assert s["traffic"]["measured"]["inter_node_bytes"] > 0
    if model == "gpt":
        m = s["metrics"]
        assert m["heldout_perplexity"] > 1 and m["heldout_loss"] > 0


def test_neuron_sdp_on_a_transformer_is_refused(tmp_path):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "sdp", "--model", "vit",
                                                "--sdp-mode", "neuron", "--coverage", "1/2",
                                                "--steps", "1"],
                               "is not implemented for the transformer", tmp_path / "x")


def test_momentum_correction_with_adamw_is_refused(tmp_path):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "ssfusion", "--model", "vit",
                                                "--optimizer", "adamw", "--steps", "1"],
                               "add --no-momentum-correction", tmp_path / "x")
