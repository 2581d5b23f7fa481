"""Chrome Trace Event export: ``--trace FILE`` on a 2 x 2 H-SADMM and SSFusion run and ``commvol
trace RUN_DIR`` write JSON that follows the Trace Event format (checked here against the format's
rules, written from its specification), with every rank and every call the ledger booked (its
bytes), each event the job simulation's; a run of an older spardist, bad ``--trace-steps`` and an
existing file are refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from mpi_helpers import assert_fails_on_every_rank, read_summary, run_mpi
from run_dir_helpers import step_of_events, write_run

from commvol.__main__ import main
from commvol.trace import trace_of_run
from simulation.trace import LANES

ROOT = Path(__file__).resolve().parents[2]
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
def test_trace_of_a_2x2_run_is_valid_with_every_rank_and_call(tmp_path, module, args):
    trace = tmp_path / "trace.json"
    run_mpi(None, 4, *args, "--ranks-per-node", 2, "--out", tmp_path / "run", "--trace", trace,
            "--trace-steps", "all", "--progress-every", 0, module=module, timeout=240)
    doc = json.loads(trace.read_text())
    events = check_trace_event_format(doc)
    summary = read_summary(tmp_path / "run")
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    steps = int(summary["timing"]["steps"])
    assert {e["args"]["step"] for e in events} == set(range(steps))
    assert {e["tid"] for e in events} <= set(LANES.values())
    # every call the ledger booked is an event, on the stream or the blocking lane, with its
    # bytes and algorithm: per phase, the rank that booked the most calls has that many events
    # (the ledger keeps the most over ranks), and a buffer's bytes summed over the events are
    # the ledger's payload (an all-gather's event holds every member's blocks: left out)
    calls = [e for e in events if e["args"]["kind"] == "call"]
    assert {e["tid"] for e in calls} <= {LANES["stream"], LANES["calls"]}
    assert all({"phase", "bytes", "algorithm"} <= set(e["args"]) for e in calls)
    booked = {ph: e for ph, e in summary["traffic"]["measured"]["by_phase"].items()
              if e["bytes"] > 0}
    assert set(booked) <= {e["args"]["phase"] for e in calls}, \
        set(booked) - {e["args"]["phase"] for e in calls}
    for ph, led in booked.items():
        mine = [e for e in calls if e["args"]["phase"] == ph]
        per_rank = Counter(e["pid"] for e in mine)
        assert max(per_rank.values()) == led["calls"], (ph, per_rank, led["calls"])
        if {e["args"]["algorithm"] for e in mine} <= {"allreduce", "bcast"}:
            assert sum(e["args"]["bytes"] for e in mine) == led["payload_bytes"], ph
    # the wall lane holds every step of every rank; each rank's steps follow one another
    walls = [e for e in events if e["cat"] == "wall"]
    assert len(walls) == 4 * steps and all(e["dur"] > 0 for e in walls)
    for r in range(4):
        starts = sorted(e["ts"] for e in walls if e["pid"] == r)
        assert starts == sorted(set(starts))
    assert summary["trace"]["events"] == len(doc["traceEvents"])


def test_commvol_trace_of_a_summary_is_its_last_step(tmp_path):
    """``commvol trace`` of a hand-made run: every event of ``clock.last_step`` is one complete
    event of its rank, on its lane, at its start and for its duration (µs), a call's phase,
    bytes and algorithm in its args."""
    d = write_run(tmp_path / "ddp")
    doc = trace_of_run(d)
    events = check_trace_event_format(doc)
    assert doc["otherData"]["step"] == 6
    kept = {0: step_of_events(), 3: step_of_events(0.2)}
    assert {e["pid"] for e in events} == set(kept)
    for rank, want in kept.items():
        got = sorted((e for e in events if e["pid"] == rank), key=lambda e: (e["ts"], e["name"]))
        want = sorted(want, key=lambda e: (e["start"], e["label"]))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g["name"], g["tid"], g["args"]["step"]) == (w["label"], LANES[w["lane"]], 6)
            assert g["ts"] == pytest.approx(w["start"] * 1e6)
            assert g["dur"] == pytest.approx((w["finish"] - w["start"]) * 1e6)
            if w["kind"] == "call":
                assert (g["args"]["phase"], g["args"]["bytes"], g["args"]["algorithm"]) == \
                    (w["phase"], w["nbytes"], w["algorithm"])
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"compute stream", "offload worker", "communication stream",
                     "blocking calls"}
    assert main(["trace", str(d), "--out", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(doc))
    with pytest.raises(ValueError, match="pass --step 6 or omit --step"):
        main(["trace", str(d), "--step", "2"])
    old = write_run(tmp_path / "old", clock=False, timeline=True)
    with pytest.raises(ValueError, match="has no clock block .*recorded by an older spardist"):
        main(["trace", str(old)])
    assert not (old / "trace.json").exists()


@pytest.mark.mpi
def test_commvol_trace_of_a_run_dir(tmp_path):
    run_mpi(None, 2, "train", "--method", "ddp", "--steps", 2, "--ranks-per-node", 1,
            "--out", tmp_path / "run", module="dataparallel", timeout=180)
    proc = subprocess.run([sys.executable, "-m", "commvol", "trace", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "run" / "trace.json").read_text())
    events = check_trace_event_format(doc)
    last = read_summary(tmp_path / "run")["clock"]["last_step"]
    assert {e["pid"] for e in events} == {int(r) for r in last["ranks"]} == \
        {0, last["slowest_rank"]}
    assert len(events) == sum(len(evs) for evs in last["ranks"].values())
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
