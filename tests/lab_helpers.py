"""Shared by the wire-lab tests (``tests/lab/``): why a lab cannot be built here, and
what a lab left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import lab

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def skip_reason() -> str | None:
    """None when a lab can be built here, else the precise reason (root, hydra, namespaces)."""
    if os.geteuid() != 0:
        return (f"wire lab needs root (network namespaces, veth, /etc/netns); euid is "
                f"{os.geteuid()}: run the tests as root")
    hydra = VENV_PYTHON.parent / "mpiexec"
    if not hydra.exists():
        return f"MPICH hydra mpiexec not found at {hydra} (./run_mpi.sh installs the mpich wheel)"
    try:
        lab.find_hydra(str(VENV_PYTHON))
        lab.check_prerequisites()
    except lab.LabError as exc:
        return str(exc)
    return None


SKIP = skip_reason()
needs_lab = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def leftovers(lab_id: str | None = None) -> list[str]:
    """Namespaces, /etc/netns entries and state files of ``lab_id`` (or of any lab)."""
    tag = f"{lab.PREFIX}{lab_id}-" if lab_id else lab.PREFIX
    found = [n for n in lab.lab_namespaces() if n.startswith(tag)]
    if lab.NETNS_ETC.is_dir():
        found += [str(p) for p in lab.NETNS_ETC.iterdir() if p.name.startswith(tag)]
    if lab_id and (lab.STATE_DIR / f"{lab_id}.json").exists():
        found.append(str(lab.STATE_DIR / f"{lab_id}.json"))
    return found
