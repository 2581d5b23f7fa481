"""Results are never lost: publish order and recovery, file modes, clean-up of failed
and killed runs, refusal to overwrite, damaged checkpoints, progress and failure reports."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import struct
import zipfile
from pathlib import Path

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
    earlier = _snapshot(tmp_path)
    run = _start(tmp_path, overwrite=True)
    # nothing of the earlier run is touched at the start: the new run's checkpoints go apart
    # (where pruning cannot keep the earlier, higher steps over its own)
    assert run.checkpoints == tmp_path / results.PENDING
    Checkpointer(run.checkpoints).save({"x": np.ones(2)}, 1)
    assert _snapshot(tmp_path).items() >= earlier.items()
    run.log(0, it="second")
    run.finish(metrics={"final_loss": 2.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["it"] == "second"
    assert not (tmp_path / results.PENDING).exists()
    assert not (tmp_path / results.REPLACED).exists()
    assert [p.name for p in ck.iterdir()] == ["ckpt-r0-s00000001.npz"]
    # a run that writes no checkpoint replaces the earlier ones all the same
    run = _start(tmp_path, overwrite=True)
    run.finish()
    assert not ck.exists() and not (tmp_path / results.PENDING).exists()
    # into a folder with no run to keep, an --overwrite run writes its checkpoints in place
    assert _start(tmp_path / "fresh", overwrite=True).checkpoints == \
        tmp_path / "fresh" / "checkpoints"
    RunWriter.abandon_open()


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
        run = _start(tmp_path, overwrite=True)
        Checkpointer(run.checkpoints).save({"x": np.ones(2)}, 1)
        raise ValueError("boom")

    with pytest.raises(SystemExit):
        main([])
    capsys.readouterr()
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl",
                                                          "summary.json"]


def _killed(run) -> None:
    """End ``run`` as a killed process does: nothing cleaned up."""
    RunWriter._open.discard(run.writer)
    if run.writer._fh is not None:
        run.writer._fh.close()


def test_killed_overwrite_run_leaves_the_earlier_run_to_resume(tmp_path, capsys):
    """A killed ``--overwrite`` run cannot clean up: the earlier run's files are byte for byte
    as they were all the same, the next start removes what the killed run left, and
    ``--resume`` continues the earlier run."""
    run, ck = _checkpoints(tmp_path)
    run.log(1, it=1)
    ck.save(2, {"w": np.full(3, 2.0)})
    run.finish()
    before = _snapshot(tmp_path)
    run = start_run(_args(tmp_path, overwrite=True), system="t", method="m")
    RunCheckpoints(run, every=1, fingerprint={"lr": 0.1}, unit="step", flag="--steps").save(
        1, {"w": np.full(3, -1.0)})
    _killed(run)
    assert _snapshot(tmp_path).items() >= before.items()
    capsys.readouterr()
    run, ck = _checkpoints(tmp_path, resume=True)
    assert (f"spardist: note: removed {tmp_path / results.PENDING}: the checkpoints of an "
            "--overwrite run that did not finish") in capsys.readouterr().err
    now = _snapshot(tmp_path)
    assert now.pop(results.METRICS_PART) == b"" and now == before     # the resumed run's lines
    step, state = ck.resume(4)
    assert step == 2 and np.array_equal(state["w"], np.full(3, 2.0))
    assert [json.loads(r)["it"] for r in run.writer.records] == [1]
    run.writer.abandon()


@pytest.mark.parametrize("cut", ["before the swap", "between the renames", "before removing"])
def test_overwrite_run_killed_in_its_finish_is_completed_by_the_next_start(tmp_path, capsys,
                                                                           monkeypatch, cut):
    """Killed after publishing its summary, an ``--overwrite`` run is the run of the folder:
    the next start makes its checkpoints the folder's, wherever the swap was cut."""
    _finished_run(tmp_path)
    Checkpointer(tmp_path / "checkpoints").save({"x": np.zeros(2)}, 3)
    run = _start(tmp_path, overwrite=True)
    Checkpointer(run.checkpoints).save({"x": np.ones(2)}, 1)
    new = _snapshot(run.checkpoints)
    real_replace, real_rmtree = os.replace, results.shutil.rmtree

    def replace(src, dst):
        if (cut == "before the swap" and Path(dst).name == results.REPLACED or
                cut == "between the renames" and Path(src).name == results.PENDING):
            raise OSError("killed")
        real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if cut == "before removing" and Path(path).name == results.REPLACED:
            raise OSError("killed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(results.shutil, "rmtree", rmtree)
    with pytest.raises(OSError, match="killed"):
        run.finish(metrics={"final_loss": 2.0})
    monkeypatch.undo()
    _killed(run)
    capsys.readouterr()
    with pytest.raises(ValueError, match="already holds a finished run"):
        _start(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"]["final_loss"] == 2.0
    assert _snapshot(tmp_path / "checkpoints") == {k: v for k, v in new.items()
                                                   if k.startswith("ckpt-")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl",
                                                          "summary.json"]


def test_checkpoints_set_aside_by_an_older_spardist_are_put_back(tmp_path, capsys):
    """An older spardist moved the earlier run's checkpoints aside to
    ``OUT/checkpoints.replaced`` at the start of an ``--overwrite`` run: killed, that run is
    dropped and the earlier checkpoints are put back; published, they are removed."""
    _finished_run(tmp_path)
    ck, aside = tmp_path / "checkpoints", tmp_path / results.REPLACED
    Checkpointer(ck).save({"x": np.zeros(2)}, 3)
    earlier = _snapshot(ck)

    def set_aside():
        os.replace(ck, aside)
        (aside / results._REPLACED_MARK).write_text(results._sha256(tmp_path / "summary.json"))

    set_aside()
    Checkpointer(ck).save({"x": np.ones(2)}, 1)           # ... killed after one of its own
    with pytest.raises(ValueError, match="already holds a finished run"):
        _start(tmp_path)
    assert _snapshot(ck) == earlier and "put back the checkpoints" in capsys.readouterr().err
    assert not aside.exists()
    os.replace(ck, aside)                                # ... its put-back cut short
    with pytest.raises(ValueError, match="already holds a finished run"):
        _start(tmp_path)
    assert _snapshot(ck) == earlier and "put back the checkpoints" in capsys.readouterr().err
    set_aside()                                          # ... killed after publishing
    _finished_run(tmp_path / "other")
    (tmp_path / "summary.json").write_bytes((tmp_path / "other" / "summary.json").read_bytes())
    with pytest.raises(ValueError, match="already holds a finished run"):
        _start(tmp_path)
    assert not aside.exists() and not ck.exists()


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["fails", "killed"])
def test_failed_overwrite_job_leaves_the_earlier_checkpoints_byte_for_byte(tmp_path, how):
    """2 ranks: an ``--overwrite`` run that fails after its first checkpoint on rank 1 alone
    (rank 0, waiting in a collective, is aborted without its clean-up) or is killed on every
    rank leaves every file of the earlier run with the hash it had; ``--resume`` then continues
    the earlier run from its last checkpoint."""
    out = tmp_path / "run"
    toy = ["--out", out, "--checkpoint-every", "1", "--progress-every", "0"]
    run_mpi("overwrite_checks.py", 2, *toy, "--steps", "2")
    earlier = _hashes(out)
    assert sum(k.startswith("checkpoints/") for k in earlier) == 4
    res = run_mpi("overwrite_checks.py", 2, *toy, "--steps", "4", "--overwrite",
                  "--fail-after", "1", "--how", how, expect_fail=True)
    if how == "fails":
        want = "spardist: error on rank 1: ValueError: made to fail after the checkpoint of step 1"
        assert error_lines(res.stderr) == [want], res.stderr
    after = _hashes(out)
    assert {k: after.get(k) for k in earlier} == earlier
    assert any(k.startswith(f"{results.PENDING}/ckpt-") for k in after)   # it got that far
    res = run_mpi("overwrite_checks.py", 2, *toy, "--steps", "4", "--resume")
    assert "RESUMED FROM 2" in res.stdout, res.stdout + res.stderr
    assert f"removed {out / results.PENDING}" in res.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == [1, 2, 3, 4]
    assert [x["loss"] for x in lines] == [3.0, 9.0, 18.0, 30.0]   # 3 * (1, 1+2, ..., 1+..+4)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl",
                                                     "summary.json"]


def _hashes(folder) -> dict:
    """The SHA-256 of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


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


def test_resume_messages_name_the_option_the_run_was_started_with(tmp_path):
    """A run started with ``--epochs`` is continued by that option: a resume refused for its
    total names ``--epochs`` and the total the run was started with (kept in the checkpoint),
    whichever option the resume passes."""
    def started(run, given, total, schedule):
        ck = RunCheckpoints(run, every=2, fingerprint={"lr": 0.1}, unit="step", flag="--steps",
                            given=given, may_change=("--epochs",), schedule=schedule,
                            schedule_why="the schedule decays over the steps")
        ck.total = total
        return ck

    run, _ = _checkpoints(tmp_path)
    started(run, "--epochs 2", 8, {"total_steps": 8}).save(6, {"w": np.zeros(3)})
    run.writer.abandon()
    run, _ = _checkpoints(tmp_path, resume=True)
    for given, total in (("--epochs 1", 4), ("--steps 5", 5)):
        with pytest.raises(ValueError) as exc:
            started(run, given, total, {"total_steps": total}).resume(total)
        assert (f"--resume: {given}{' (4 steps)' if total == 4 else ''} is smaller than the 6 "
                "steps already done") in str(exc.value)
        assert ("pass --epochs 2 or more (the 8 steps it was started with) to continue, or "
                "start afresh with --overwrite") in str(exc.value)
        assert "--steps 6" not in str(exc.value)
    with pytest.raises(ValueError) as exc:
        started(run, "--epochs 3", 12, {"total_steps": 12}).resume(12)
    assert ("--resume: --epochs 3 (12 steps) would change the schedule" in str(exc.value))
    assert "resume with --epochs 2 (the total it was written with: 8 steps)" in str(exc.value)
    step, _ = started(run, "--epochs 2", 8, {"total_steps": 8}).resume(8)
    assert step == 6
    run.writer.abandon()
    # finished: train further with a larger --epochs, even where the resume passes --steps
    run, _ = _checkpoints(tmp_path / "finished")
    started(run, "--epochs 2", 8, None).save(8, {"w": np.zeros(3)})
    run.finish()
    run, _ = _checkpoints(tmp_path / "finished", resume=True)
    with pytest.raises(ValueError, match=r"already finished its 8 steps \(summary.json\): pass "
                                         r"a larger --epochs \(or --steps\) to train further"):
        started(run, "--steps 8", 8, None).resume(8)


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
