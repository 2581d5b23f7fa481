"""Chrome Trace Event export (issue 26): ``--trace FILE`` on a 2 x 2 H-SADMM and SSFusion run and
``commvol trace RUN_DIR`` write JSON that follows the Trace Event format (checked here against
the format's rules, written from its specification), with every rank and every phase the ledger
booked; bad ``--trace-steps`` and an existing file are refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_helpers import assert_fails_on_every_rank, read_summary, run_mpi

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"B", "E", "X", "i", "I", "C", "M", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D"}
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
            "thread_sort_index"}


def check_trace_event_format(doc) -> list[dict]:
    """The Trace Event format's rules for the JSON Object Format: an object whose
    ``traceEvents`` is a list of events; every event has a phase ``ph`` of the format, integer
    ``pid``/``tid`` where it needs them; a complete event (``X``) has a name, a timestamp ``ts``
    and a duration ``dur`` (microseconds, finite, >= 0); a metadata event (``M``) is one of the
    format's names with its ``args``; ``displayTimeUnit`` is ``ms`` or ``ns``.  Returns the
    complete events."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    complete = []
    for e in doc["traceEvents"]:
        assert isinstance(e, dict) and e.get("ph") in PHASES, e
        assert isinstance(e.get("pid"), int), e
        if e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e.get("args"), dict), e
            if e["name"].startswith("thread"):
                assert isinstance(e.get("tid"), int), e
            continue
        assert isinstance(e.get("tid"), int) and isinstance(e.get("name"), str), e
        assert isinstance(e.get("ts"), (int, float)) and math.isfinite(e["ts"]) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and math.isfinite(e["dur"])
            assert e["dur"] >= 0, e
            complete.append(e)
        if "args" in e:
            assert isinstance(e["args"], dict)
    json.dumps(doc)                      # plain JSON throughout
    return complete


@pytest.mark.mpi
@pytest.mark.parametrize("module,args", [
    ("hsadmm", ["train", "--iters", 2, "--local-steps", 2]),
    ("dataparallel", ["train", "--method", "ssfusion", "--steps", 3, "--profile-steps", 1]),
], ids=["hsadmm", "ssfusion"])
def test_trace_of_a_2x2_run_is_valid_with_every_rank_and_phase(tmp_path, module, args):
    trace = tmp_path / "trace.json"
    run_mpi(None, 4, *args, "--ranks-per-node", 2, "--out", tmp_path / "run", "--trace", trace,
            "--trace-steps", "all", "--progress-every", 0, module=module, timeout=240)
    doc = json.loads(trace.read_text())
    events = check_trace_event_format(doc)
    summary = read_summary(tmp_path / "run")
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    steps = summary["timing"]["steps"]
    assert {e["args"]["step"] for e in events} == set(range(int(steps)))
    booked = {ph for ph, e in summary["traffic"]["measured"]["by_phase"].items()
              if e["bytes"] > 0}
    traced = {e["args"].get("phase") for e in events if e["args"]["kind"] == "transfer"}
    assert booked <= traced, booked - traced
    # a transfer's bytes and link class are in its args; the wall lane holds every step
    assert all("bytes" in e["args"] and e["args"]["link"] in ("intra", "inter")
               for e in events if e["args"]["kind"] == "transfer")
    walls = [e for e in events if e["cat"] == "wall"]
    assert len(walls) == 4 * int(steps) and all(e["dur"] > 0 for e in walls)
    # each rank's steps follow one another on the simulated clock
    for r in range(4):
        starts = sorted(e["ts"] for e in walls if e["pid"] == r)
        assert starts == sorted(set(starts))
    assert summary["trace"]["events"] == len(doc["traceEvents"])


@pytest.mark.mpi
def test_commvol_trace_of_a_run_dir(tmp_path):
    run_mpi(None, 2, "train", "--method", "ddp", "--steps", 2, "--ranks-per-node", 1,
            "--out", tmp_path / "run", module="dataparallel", timeout=180)
    proc = subprocess.run([sys.executable, "-m", "commvol", "trace", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "run" / "trace.json").read_text())
    events = check_trace_event_format(doc)
    assert any(e["args"].get("phase") == "grad_allreduce" for e in events)


@pytest.mark.mpi
@pytest.mark.parametrize("steps,message", [("x", "--trace-steps 'x'"), ("3-1", "lo-hi"),
                                           ("-2", "--trace-steps '-2'")])
def test_bad_trace_steps_are_refused(tmp_path, steps, message):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "ddp", "--steps", 1,
                                                "--trace", tmp_path / "t.json",
                                                "--trace-steps", steps],
                               message, tmp_path / "x")


@pytest.mark.mpi
def test_an_existing_trace_is_kept_without_overwrite(tmp_path):
    t = tmp_path / "t.json"
    t.write_text("keep me")
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "ddp", "--steps", 1,
                                                "--trace", t],
                               "already exists: pass --overwrite", tmp_path / "x")
    assert t.read_text() == "keep me"
