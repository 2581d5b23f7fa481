"""Results are never lost (issue 16): publish order and recovery, file modes, clean-up of failed
and killed runs, refusal to overwrite, damaged checkpoints, progress and failure reports."""

from __future__ import annotations

import argparse
import json
import os
import stat
import struct
import zipfile

import numpy as np
import pytest
from mpi_helpers import error_lines, run_mpi

from runner.checkpoints import RunCheckpoints
from runner.errors import main_guard
from runner.options import CommonConfig, add_common_args, add_training_args
from runner.progress import Progress
from runner.run import start_run
from substrate import results
from substrate.results import Checkpointer, CheckpointError, RunWriter, recover_publish


@pytest.fixture(autouse=True)
def _serial_world(monkeypatch):
    """In-process runs are 1-rank worlds: no launcher size to compare with."""
    for var in ("SPARDIST_NP", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _start(out, **kw):
    return start_run(CommonConfig(out=str(out), **kw), system="t", method="m")


def _finished_run(out, lines=({"it": 0},)):
    run = _start(out)
    for k, rec in enumerate(lines):
        run.log(k, **rec)
    run.finish(metrics={"final_loss": 1.0})
    return run


# -- publishing ---------------------------------------------------------------------------------
def test_summary_names_its_metrics_and_both_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        w = RunWriter(tmp_path)
        w.log({"it": 0})
        w.log({"it": 1})
        w.finish({"run": "new"})
    finally:
        os.umask(old)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics_file"]["lines"] == 2
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text == '{"it": 0}\n{"it": 1}\n'
    assert summary["metrics_file"]["sha256"] == results._sha256(tmp_path / "metrics.jsonl")
    assert _mode(tmp_path / "summary.json") == _mode(tmp_path / "metrics.jsonl") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_crash_between_summary_and_metrics_is_completed_later(tmp_path, monkeypatch):
    old = RunWriter(tmp_path)
    old.log({"it": "old"})
    old.finish({"run": "old"})
    w = RunWriter(tmp_path)
    w.log({"it": "new"})
    real_replace = os.replace

    def crash_on_metrics(src, dst):
        if str(src).endswith(".metrics.jsonl.part"):
            raise OSError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_metrics)
    with pytest.raises(OSError, match="power cut"):
        w.finish({"run": "new"})
    monkeypatch.undo()
    # the summary is the new one; its metrics are complete in the .part file, not missing
    assert json.loads((tmp_path / "summary.json").read_text())["run"] == "new"
    assert (tmp_path / ".metrics.jsonl.part").read_text() == '{"it": "new"}\n'
    assert recover_publish(tmp_path) is True
    assert (tmp_path / "metrics.jsonl").read_text() == '{"it": "new"}\n'
    assert not (tmp_path / ".metrics.jsonl.part").exists()
    assert recover_publish(tmp_path) is False  # nothing left to do


def test_failed_run_removes_its_part_file_and_the_folders_it_created(tmp_path):
    out = tmp_path / "a" / "b"
    w = RunWriter(out)
    w.log({"it": 0})
    RunWriter.abandon_open()
    assert not (tmp_path / "a").exists()


def test_leftovers_of_a_killed_run_are_removed_when_the_next_starts(tmp_path):
    (tmp_path / ".metrics.jsonl.part").write_text('{"it": "killed"}\n')
    (tmp_path / ".summary.json.x1y2.tmp").write_text("half")
    w = RunWriter(tmp_path)
    assert not (tmp_path / ".summary.json.x1y2.tmp").exists()
    assert (tmp_path / ".metrics.jsonl.part").read_text() == ""
    w.abandon()


# -- the results directory ------------------------------------------------------------------------
def test_finished_run_is_refused_without_overwrite_or_resume(tmp_path):
    _finished_run(tmp_path)
    with pytest.raises(ValueError) as exc:
        _start(tmp_path)
    msg = str(exc.value)
    assert str(tmp_path) in msg and "--overwrite" in msg and "--resume" in msg
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"]["final_loss"] == 1.0


def test_overwrite_replaces_the_run_and_its_checkpoints_when_it_finishes(tmp_path):
    _finished_run(tmp_path)
    ck = tmp_path / "checkpoints"
    Checkpointer(ck).save({"x": np.zeros(2)}, 3)
    earlier = _snapshot(ck)
    run = _start(tmp_path, overwrite=True)
    # nothing is deleted at the start: the earlier checkpoints wait aside, apart from the new
    # run's (whose pruning would otherwise keep the earlier, higher steps over its own)
    assert _snapshot(tmp_path / results.REPLACED).items() >= earlier.items()
    assert not ck.exists()
    Checkpointer(ck).save({"x": np.ones(2)}, 1)
    run.log(0, it="second")
    run.finish(metrics={"final_loss": 2.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["it"] == "second"
    assert not (tmp_path / results.REPLACED).exists()
    assert [p.name for p in Checkpointer.files(ck)] == ["ckpt-r0-s00000001.npz"]


def _snapshot(folder) -> dict:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_failed_overwrite_run_leaves_the_earlier_run_whole(tmp_path, capsys):
    _finished_run(tmp_path)
    Checkpointer(tmp_path / "checkpoints").save({"x": np.zeros(2)}, 3)
    before = _snapshot(tmp_path)

    @main_guard
    def main(argv):
        _start(tmp_path, overwrite=True)
        Checkpointer(tmp_path / "checkpoints").save({"x": np.ones(2)}, 1)
        raise ValueError("boom")

    with pytest.raises(SystemExit):
        main([])
    capsys.readouterr()
    assert _snapshot(tmp_path) == before


def test_checkpoints_set_aside_by_a_killed_overwrite_run(tmp_path, capsys):
    """A killed ``--overwrite`` run cannot put the earlier checkpoints back: the next start does
    when the killed run left none of its own, refuses to pick one set over the other when it
    did, and removes them when the killed run had published after all."""
    _finished_run(tmp_path)
    ck = tmp_path / "checkpoints"
    Checkpointer(ck).save({"x": np.zeros(2)}, 3)
    earlier = _snapshot(ck)
    results.set_aside_checkpoints(tmp_path)              # ... and killed before a checkpoint
    with pytest.raises(ValueError, match="already holds a finished run"):
        _start(tmp_path)
    assert _snapshot(ck) == earlier and "put back the checkpoints" in capsys.readouterr().err
    results.set_aside_checkpoints(tmp_path)              # ... killed after one of its own
    Checkpointer(ck).save({"x": np.ones(2)}, 1)
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(ValueError) as exc:
            _start(tmp_path, **kw)
        msg = str(exc.value)
        assert "an --overwrite run that did not finish" in msg and "pass --resume" in msg
        assert str(tmp_path / results.REPLACED) in msg
    assert _snapshot(tmp_path / results.REPLACED).items() >= earlier.items()
    run = start_run(_args(tmp_path, resume=True), system="t", method="m")
    run.finish()                                          # the resumed run replaces it
    assert not (tmp_path / results.REPLACED).exists()
    assert [p.name for p in Checkpointer.files(ck)] == ["ckpt-r0-s00000001.npz"]
    results.set_aside_checkpoints(tmp_path)              # ... killed after publishing
    _finished_run(tmp_path / "other")
    (tmp_path / "summary.json").write_bytes((tmp_path / "other" / "summary.json").read_bytes())
    with pytest.raises(ValueError, match="already holds a finished run"):
        _start(tmp_path)
    assert not (tmp_path / results.REPLACED).exists() and not ck.exists()


def test_interrupted_run_is_refused_without_resume(tmp_path):
    Checkpointer(tmp_path / "checkpoints").save({"x": np.zeros(2)}, 2)
    with pytest.raises(ValueError, match="holds checkpoints of an interrupted run.*pass "
                                         "--resume to continue it"):
        _start(tmp_path)
    with pytest.raises(ValueError, match="pass one of them"):
        start_run(_args(tmp_path, resume=True, overwrite=True), system="t", method="m")


def _args(out, **kw):
    parser = argparse.ArgumentParser()
    add_training_args(add_common_args(parser), "step", 10)
    flags = [f"--{k}" for k, v in kw.items() if v]
    return parser.parse_args(["--out", str(out), *flags])


def test_out_that_is_a_file_or_read_only_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match="is an existing file, not a directory"):
        _start(f)
    if os.geteuid() == 0:
        return  # root writes into read-only directories
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ValueError, match="is not writable"):
            _start(ro / "run")
    finally:
        ro.chmod(0o755)


def test_main_guard_drops_the_run_of_a_failure_and_prints_once(tmp_path, capsys):
    out = tmp_path / "new" / "run"

    @main_guard
    def main(argv):
        _start(out)
        raise ValueError("boom")

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 1
    assert error_lines(capsys.readouterr().err) == ["spardist: error on rank 0: ValueError: boom"]
    assert not (tmp_path / "new").exists()


# -- checkpoints --------------------------------------------------------------------------------
def _checkpoints(tmp_path, resume=False):
    run = start_run(_args(tmp_path, resume=resume), system="t", method="m")
    return run, RunCheckpoints(run, every=2, fingerprint={"lr": 0.1}, unit="step",
                               flag="--steps")


def test_damaged_newest_checkpoint_falls_back_and_says_so(tmp_path, capsys):
    run, ck = _checkpoints(tmp_path)
    for done in (2, 4):
        run.log(step=done)
        ck.save(done, {"w": np.full(3, done)})
    newest = ck.ckpt.path(4)
    newest.write_bytes(newest.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=str(newest)):
        ck.ckpt.load(4)
    run.writer.abandon()
    run, ck = _checkpoints(tmp_path, resume=True)
    start, state = ck.resume(6)
    assert start == 2 and np.array_equal(state["w"], np.full(3, 2))
    err = capsys.readouterr().err
    assert "damaged checkpoint(s): " in err and str(newest) in err
    assert "resuming from step 2, the newest checkpoint intact on every rank" in err
    assert [json.loads(r)["step"] for r in run.writer.records] == [2]  # lines up to the checkpoint
    assert newest.with_name(newest.name + ".corrupt").is_file()


def test_no_intact_checkpoint_names_every_damaged_file(tmp_path):
    run, ck = _checkpoints(tmp_path)
    ck.save(2, {"w": np.zeros(3)})
    bad = ck.ckpt.path(2)
    raw = bytearray(bad.read_bytes())
    # one flipped bit pattern in the middle of the largest member's data (a byte of a local
    # header field the reader never checks, e.g. "version needed", would be harmless)
    with zipfile.ZipFile(bad) as z:
        big = max(z.infolist(), key=lambda i: i.compress_size)
    name_len, extra_len = struct.unpack("<HH", raw[big.header_offset + 26:big.header_offset + 30])
    at = big.header_offset + 30 + name_len + extra_len
    raw[at + big.compress_size // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    run.writer.abandon()
    run, ck = _checkpoints(tmp_path, resume=True)
    with pytest.raises(ValueError) as exc:
        ck.resume(6)
    assert "no checkpoint in" in str(exc.value) and str(bad) in str(exc.value)
    assert "--overwrite" in str(exc.value)


def test_resume_refuses_a_different_configuration_and_fewer_steps(tmp_path):
    run, ck = _checkpoints(tmp_path)
    ck.save(4, {"w": np.zeros(3)})
    run.writer.abandon()
    run, ck = _checkpoints(tmp_path, resume=True)
    other = RunCheckpoints(run, every=2, fingerprint={"lr": 0.2}, unit="step", flag="--steps")
    with pytest.raises(ValueError, match=r"lr=0.1 \(now 0.2\)"):
        other.resume(6)
    with pytest.raises(ValueError, match="--steps 3 is smaller than the 4 steps already done"):
        ck.resume(3)


def test_resume_messages_name_the_option_that_set_the_total(tmp_path):
    """A total the user gave as ``--epochs`` is named as such, with the steps it makes, and the
    fix names ``--steps``, which overrides it; the options a resume may change are listed."""
    run, ck = _checkpoints(tmp_path)
    ck.save(4, {"w": np.zeros(3)})
    run.finish()
    run, _ = _checkpoints(tmp_path, resume=True)

    def by_epochs(lr=0.1):
        return RunCheckpoints(run, every=2, fingerprint={"lr": lr}, unit="step", flag="--steps",
                              given="--epochs 0.5", may_change=("--epochs",))

    with pytest.raises(ValueError, match=r"only --steps, --epochs, --checkpoint-every"):
        by_epochs(lr=0.2).resume(3)
    with pytest.raises(ValueError) as exc:
        by_epochs().resume(3)
    assert ("--resume: --epochs 0.5 (3 steps) is smaller than the 4 steps already done"
            in str(exc.value))
    assert "pass --steps 4 or more (instead of --epochs) to continue" in str(exc.value)
    with pytest.raises(ValueError, match=r"already finished its 4 steps \(summary.json\): pass "
                                         r"a larger --epochs \(or --steps\) to train further"):
        by_epochs().resume(4)


# -- progress -------------------------------------------------------------------------------------
def test_progress_lines_every_n_and_at_the_end(tmp_path, capsys):
    run = _start(tmp_path)
    p = Progress(run, total=5, unit="step", every=2)
    for done in range(1, 6):
        p.update(done, loss=0.5, test_accuracy=float("nan"), inter_bytes=3 << 20)
    p.close()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("spardist: step")]
    assert lines == [f"spardist: step {d}/5  loss 0.5000  inter-node 3.00 MiB" for d in (2, 4, 5)]
    quiet = Progress(run, total=5, unit="step", every=0)
    quiet.update(5, loss=0.1)
    assert capsys.readouterr().err == ""
    run.writer.abandon()


# -- failures of a multi-rank job ---------------------------------------------------------------
@pytest.mark.mpi
def test_lone_failing_rank_reports_and_ends_the_job():
    res = run_mpi("guard_checks.py", 2, "lone", timeout=120, expect_fail=True)
    assert error_lines(res.stderr) == [
        "spardist: error on rank 1: ValueError: lone failure on rank 1"]


@pytest.mark.mpi
def test_distinct_messages_printed_once_each_with_their_ranks(tmp_path):
    out = tmp_path / "run"
    res = run_mpi("guard_checks.py", 3, "distinct", out, timeout=120, expect_fail=True)
    assert error_lines(res.stderr) == ["spardist: error on rank 0: ValueError: first kind",
                                       "spardist: error on ranks 1-2: RuntimeError: second kind"]
    assert res.stderr.count("Traceback") == 1
    assert not out.exists()
