"""A launch that yields singletons stops with a clear error instead of racing on one folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.guards import check_world_size, expected_world_size
from runner.launch import slurm_launcher

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("env,want", [
    ({}, None),
    ({"SPARDIST_NP": "4"}, (4, "SPARDIST_NP")),
    ({"PMI_SIZE": "6", "SLURM_STEP_NUM_TASKS": "2"}, (6, "PMI_SIZE")),  # hydra under Slurm
    ({"OMPI_COMM_WORLD_SIZE": "3"}, (3, "OMPI_COMM_WORLD_SIZE")),
    ({"SLURM_STEP_NUM_TASKS": "4"}, (4, "SLURM_STEP_NUM_TASKS")),
    ({"SLURM_STEP_NUM_TASKS": "2", "PMIX_RANK": "0"}, None),  # pmix: the library knows better
    ({"SPARDIST_NP": "x"}, None),
])
def test_expected_world_size(env, want):
    assert expected_world_size(env) == want


def test_mismatch_names_both_sizes_and_the_fix():
    check_world_size(4, {"SPARDIST_NP": "4"})
    check_world_size(1, {})
    with pytest.raises(ValueError, match=r"started 4 ranks \(SLURM_STEP_NUM_TASKS=4\) but MPI "
                                         r"sees a world of 1.*srun --mpi=pmi2"):
        check_world_size(1, {"SLURM_STEP_NUM_TASKS": "4"})


def test_singleton_run_stops_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    env["SPARDIST_NP"] = "2"
    res = subprocess.run([sys.executable, "-m", "runner.probe", "--out", str(tmp_path / "r")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0
    assert "MPI sees a world of 1" in res.stderr and "singletons" in res.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flavor,plugins,want", [
    ("mpich", ("pmix", "none", "pmi2"), "srun --mpi=pmi2"),
    ("mpich", ("pmix", "none"), None),          # no PMI-2: hydra inside the allocation
    ("openmpi5", ("pmix", "pmi2"), None),       # PRRTE's mpiexec reads the allocation
    ("unknown", ("pmi2",), "srun"),
])
def test_slurm_launcher_per_library(flavor, plugins, want):
    assert slurm_launcher(flavor, plugins) == want


def test_only_the_first_singleton_speaks(tmp_path):
    """srun without a PMI the library speaks starts N singletons that all fail alike: the
    launcher's process 0 prints the error, the others exit non-zero quietly (not N copies of
    'error on rank 0')."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    for procid, speaks in (("0", True), ("3", False)):
        env = {**base, "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": procid}
        res = subprocess.run([sys.executable, "-m", "runner.probe", "--out",
                              str(tmp_path / procid)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert res.returncode != 0
        assert ("MPI sees a world of 1" in res.stderr) == speaks, res.stderr
