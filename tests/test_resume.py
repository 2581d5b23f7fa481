"""Checkpoint/resume of every trainer under MPI (4 ranks as 2 virtual nodes x 2): a resumed
run equals an uninterrupted one bit for bit (see ``tests/mpi/resume_checks.py``)."""

import pytest
from mpi_helpers import run_mpi

pytestmark = pytest.mark.mpi


def test_dataparallel_resume_equals_uninterrupted_run(tmp_path):
    res = run_mpi("resume_checks.py", 4, "dataparallel", tmp_path, timeout=400)
    for name in ("ddp", "topk", "pactrain", "sdp", "ssfusion", "fallback",
                 "refuses fewer steps"):
        assert f"OK resume {name}" in res.stdout, res.stdout + res.stderr
    # the fallback says which file is damaged and where it resumes from
    assert "spardist: warning: damaged checkpoint(s): " in res.stderr
    assert "ckpt-r1-s00000006.npz" in res.stderr and "resuming from step 4" in res.stderr


def test_sparse_sgd_resume_equals_uninterrupted_run(tmp_path):
    res = run_mpi("resume_checks.py", 4, "sparse", tmp_path, timeout=300)
    assert "OK resume sparse_sgd" in res.stdout, res.stdout + res.stderr
