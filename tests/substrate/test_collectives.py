"""Collectives modes without mpiexec: mode selection, pinning environment, the summary verdict."""

import pytest
from mpi4py import MPI

from runner.launch import mpi_env
from substrate import collectives as coll
from substrate.pinning import MPICH_PINNING, OPENMPI_PINNING, pinning_env


def test_default_mode_is_exact_and_env_overrides(monkeypatch):
    monkeypatch.delenv("SPARDIST_COLLECTIVES", raising=False)
    assert coll.default_mode() == "exact"
    monkeypatch.setenv("SPARDIST_COLLECTIVES", "native")
    assert coll.default_mode() == "native"
    monkeypatch.setenv("SPARDIST_COLLECTIVES", "fast")
    with pytest.raises(ValueError, match="SPARDIST_COLLECTIVES"):
        coll.default_mode()


def test_pinning_env_per_family():
    assert pinning_env("mpich")["MPIR_CVAR_DEVICE_COLLECTIVES"] == "none"
    assert pinning_env("mpich")["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] == "ring"
    assert pinning_env("openmpi5")["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1"
    assert pinning_env("intel") == {}


def test_launcher_pins_but_user_values_win():
    env = mpi_env(4, base={"MPIR_CVAR_BCAST_INTRA_ALGORITHM": "scatter_ring_allgather"},
                  flavor="mpich")
    assert env["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] == "ring"
    assert env["MPIR_CVAR_BCAST_INTRA_ALGORITHM"] == "scatter_ring_allgather"
    assert not any(k.startswith("OMPI_MCA_") for k in env)
    ompi = mpi_env(4, base={}, flavor="openmpi")
    assert all(ompi[k] == v for k, v in OPENMPI_PINNING.items())


def test_describe_verdicts(monkeypatch):
    for k in MPICH_PINNING:
        monkeypatch.delenv(k, raising=False)
    exact = coll.describe("exact", MPI.COMM_SELF)
    assert exact["verified"] is True and exact["status"].startswith("exact")
    bare = coll.describe("native", MPI.COMM_SELF)
    assert bare["verified"] is False and bare["status"].startswith("booked, not verified")
    monkeypatch.setattr(coll, "library", lambda: ("unknown", "SomeMPI 1.0"))
    assert coll.describe("native", MPI.COMM_SELF)["status"].startswith("booked, not verified")
    monkeypatch.setattr(coll, "library", lambda: ("mpich", "MPICH Version: 4.1.2"))
    for k, v in MPICH_PINNING.items():
        monkeypatch.setenv(k, v)
    old = coll.describe("native", MPI.COMM_SELF)  # pinned, but this version never on the wire
    assert old["pinned"] is True and old["verified"] is False
    monkeypatch.setattr(coll, "library", lambda: ("mpich", "MPICH Version: 5.0.2"))
    assert coll.describe("native", MPI.COMM_SELF)["verified"] is True


def test_unknown_mode_names_the_fix():
    with pytest.raises(ValueError, match="--collectives exact"):
        coll.check_mode("ring")
