"""Interrupting a test run or a launched job leaves no rank or launcher behind:
``run_mpi.sh`` runs its child in a setsid group of its own and, on SIGINT or SIGTERM, ends it with
every descendant (:func:`runner.launch.kill_tree`), ranks in process groups of their own
included (Open MPI's ``prterun``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.launch import descendants, kill_tree

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi


def _wait_for(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def _ranks_of(pid):
    """Descendants running python -m mpi4py (the ranks)."""
    out = []
    for p in descendants(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"mpi4py" in cmd:
            out.append(p)
    return out


def _alive(pids):
    return [p for p in pids if Path(f"/proc/{p}").exists() and
            Path(f"/proc/{p}/stat").read_text().split(") ")[-1][0] != "Z"]


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("what", ["job", "tests"])
def test_interrupt_leaves_nothing_behind(tmp_path, how, what):
    if what == "job":    # a long training job on 4 ranks
        args = ["-n", "4", "--ranks-per-node", "2", "dataparallel", "train", "--method", "ddp",
                "--steps", "100000", "--progress-every", "0", "--out", str(tmp_path / "run")]
    else:                # a test run that is inside an MPI test
        args = ["--test", "-q", "-p", "no:cacheprovider", "tests/dataparallel/test_ddp_topk_mpi.py"]
    proc = subprocess.Popen([str(ROOT / "run_mpi.sh"), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert _wait_for(lambda: len(_ranks_of(proc.pid)) >= 2, 120), "no ranks started"
        tree = descendants(proc.pid)
        os.kill(proc.pid, how)
        rc = proc.wait(timeout=60)
        assert _wait_for(lambda: not _alive(tree), 30), (
            f"left behind: {[Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in _alive(tree)]}")
        assert rc != 0
    finally:
        kill_tree(proc.pid, grace=0.5)


def test_kill_tree_reaches_a_grandchild_in_its_own_process_group():
    """A rank that left its parent's process group (as Open MPI's daemons make them) is still
    found by the tree walk and ended."""
    code = ("import os, subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
            "start_new_session=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _wait_for(lambda: len(descendants(proc.pid)) == 1, 30)
        grandchild = descendants(proc.pid)[0]
        assert os.getpgid(grandchild) != os.getpgid(proc.pid)
        kill_tree(proc.pid, grace=0.5)
        proc.wait(timeout=10)
        assert _wait_for(lambda: not _alive([grandchild]), 10)
    finally:
        kill_tree(proc.pid, grace=0.1)
