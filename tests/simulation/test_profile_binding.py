"""A compute profile is bound to the job it describes: another system, method,
model, option or world size is refused on every rank, naming ``--compute-profile``, what differs
and the fix, unless ``--compute-profile-partial`` (then the summary says what fraction of the
compute was measured instead); run length, seed and output do not change the job."""

from __future__ import annotations

import json

import pytest
from mpi_helpers import assert_fails_on_every_rank, read_summary, run_mpi

pytestmark = pytest.mark.mpi

BASE = ["train", "--method", "ddp", "--steps", 2, "--ranks-per-node", 1, "--progress-every", 0]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    run_mpi(None, 2, *BASE, "--out", d / "run", "--compute-profile-out", d / "p.json",
            module="dataparallel", timeout=180)
    return d / "p.json"


def _use(profile, *extra):
    return [*BASE, "--compute-source", "profile", "--compute-profile", profile, *extra]


@pytest.mark.parametrize("change,n,what", [
    (["--method", "topk"], 2, "method: profile 'ddp', this run 'topk'"),
    (["--model", "mlp"], 2, "model: profile 'cnn', this run 'mlp'"),
    (["--batch-size", "16"], 2, "batch_size: profile 32, this run 16"),
    (["--bucket-mib", "1"], 2, "options: profile"),
    ([], 4, "world: profile 2, this run 4"),
])
def test_a_profile_of_another_job_is_refused(profile, tmp_path, change, n, what):
    args = _use(profile, *change)
    if n == 4:
        args[args.index("--ranks-per-node") + 1] = 2
    assert_fails_on_every_rank("dataparallel", args, what, tmp_path / "x", n=n)


def test_a_profile_without_a_job_is_refused(profile, tmp_path):
    doc = json.loads(profile.read_text())
    del doc["provenance"]["job"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    assert_fails_on_every_rank("dataparallel", _use(old), "records no job", tmp_path / "x")


def test_partial_uses_it_and_says_how_much_was_measured(profile, tmp_path):
    run_mpi(None, 2, *_use(profile, "--method", "topk", "--compute-profile-partial"), "--out",
            tmp_path / "partial", module="dataparallel", timeout=180)
    cp = read_summary(tmp_path / "partial")["clock"]["compute_profile"]
    assert any("method" in d for d in cp["job_differences"])
    assert cp["fallback_blocks_all_ranks"] > 0
    assert 0 < cp["fraction_measured_instead"] < 1


def test_run_length_seed_and_output_are_the_same_job(profile, tmp_path):
    run_mpi(None, 2, *_use(profile, "--seed", 3), "--out", tmp_path / "same",
            module="dataparallel", timeout=180)
    cp = read_summary(tmp_path / "same")["clock"]["compute_profile"]
    assert cp["job_differences"] == [] and cp["fallback_blocks_all_ranks"] == 0
