"""A lab always tears down (``lab.netns``, ``lab.network``): after a failing job, a timeout,
SIGINT, and, for the lab of a killed process, at the next lab's start.  Root only (skipped with
the reason otherwise)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from lab_helpers import ROOT, leftovers, needs_lab

import lab

pytestmark = [pytest.mark.wire, needs_lab]


def test_teardown_after_a_failing_payload(tmp_path):
    the_lab = lab.Lab(2, 2, timeout=120)
    with pytest.raises(lab.LabError, match="the MPI job exited"), the_lab:
        assert len(leftovers(the_lab.id)) >= 4       # 3 namespaces + 2 /etc/netns + state
        the_lab.measure(["dataparallel", "train", "--method", "nope"], out=tmp_path)
    assert leftovers(the_lab.id) == []
    assert the_lab.tmp is None and not the_lab.procs


def test_timeout_kills_the_job_and_tears_down(tmp_path):
    the_lab = lab.Lab(2, 1, timeout=4)
    t0 = time.monotonic()
    with pytest.raises(lab.LabError, match="timed out after 4 s"), the_lab:
        the_lab.measure(["lab", "--idle", "--sleep", "120"], out=tmp_path)
    assert time.monotonic() - t0 < 60
    assert leftovers(the_lab.id) == []


def test_sigint_tears_everything_down(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "lab", "-v", "--hosts", "2", "--ranks-per-host", "1", "--out",
         str(tmp_path), "--", "lab", "--idle", "--sleep", "120"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # wait until the payload runs (the baseline has finished), then interrupt
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            log = tmp_path / "wirelab.log"
            if log.exists() and log.read_text().count("$ ") >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the lab did not reach the payload run")
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "interrupted by SIGINT; everything torn down" in err
    lab_id = err.split("hosts up (")[1].split(")")[0]
    assert leftovers(lab_id) == []
    assert not (tmp_path / lab.WIRE_JSON).exists()


def test_stale_lab_of_a_killed_process_is_removed():
    proc = subprocess.Popen(
        [sys.executable, "-c", ("import time\n"
                                "import lab\n"
                                "x = lab.Lab(2, 1); x.__enter__(); print(x.id, flush=True); "
                                "time.sleep(300)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        lab_id = proc.stdout.readline().strip()
        assert lab_id and len(leftovers(lab_id)) >= 3
        proc.kill()                                    # no teardown: SIGKILL
        proc.wait(timeout=30)
        assert lab_id in lab.stale_labs()
        assert lab_id in lab.cleanup_stale()
        assert leftovers(lab_id) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
