"""Same answer however launched: a plain ``mpiexec`` (no launcher environment)
gives every rank the thread caps ``run_mpi.sh`` gives it, so the ``cpu`` compute source reads
the same clock (thread CPU time, one BLAS thread per rank); the summary records the caps and
who set them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_helpers import read_summary, run_mpi

from runner.launch import find_mpiexec, launch_command
from substrate.threads import THREAD_VARS, cap_threads

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi
JOB = ["train", "--method", "ddp", "--steps", 2, "--ranks-per-node", 2, "--progress-every", 0]


def test_plain_mpiexec_caps_threads_like_the_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS and k != "SPARDIST_NP"}
    cmd = [find_mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py", "-m", "dataparallel",
           *map(str, JOB), "--out", str(tmp_path / "plain")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    run_mpi(None, 4, *JOB, "--out", tmp_path / "launcher", module="dataparallel", timeout=240)
    plain, launched = (read_summary(tmp_path / d) for d in ("plain", "launcher"))
    cores = len(os.sched_getaffinity(0))
    want = max(1, cores // 4)
    assert plain["threads"]["threads"] == launched["threads"]["threads"] == want
    assert plain["threads"]["set_by"].startswith("spardist:")
    assert launched["threads"]["set_by"].startswith("environment")
    assert plain["threads"]["blas_threads"] == launched["threads"]["blas_threads"] == want
    src = plain["clock"]["compute_source"]
    assert src == launched["clock"]["compute_source"]
    assert src.startswith("cpu_thread" if want == 1 else "cpu_process")
    assert "OMP_NUM_THREADS" not in " ".join(launch_command(4, "x", []))


def test_cap_threads_keeps_what_the_environment_says(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    got = cap_threads(4, cores=16, apply=False)
    assert got["threads"] == 3 and "OMP_NUM_THREADS=3" in got["set_by"]


def test_cap_threads_divides_the_cores_among_the_node_s_ranks(monkeypatch):
    for v in THREAD_VARS:
        monkeypatch.delenv(v, raising=False)
    got = cap_threads(3, cores=8, apply=False)
    assert got["threads"] == 2 and not any(v in os.environ for v in THREAD_VARS)
    assert cap_threads(16, cores=8, apply=False)["threads"] == 1
    # applying may set NUMBA_NUM_THREADS (Numba not loaded yet): the later calls would keep it
    assert cap_threads(3, cores=8)["threads"] == 2
    assert not any(os.environ.get(v) for v in THREAD_VARS if v != "NUMBA_NUM_THREADS")
    assert got["set_by"] == "spardist: 8 usable cores // 3 ranks on this node"


def test_default_out_never_collides_and_latest_follows(tmp_path):
    """Without --out every run gets a folder of its own, results/<system>_<method>/run-N, and
    ``latest`` points at the newest; --resume without --out continues the newest."""
    job = ["train", "--method", "ddp", "--steps", 2, "--ranks-per-node", 1,
           "--progress-every", 0, "--checkpoint-every", 1]
    here = {"SPARDIST_RESULTS": ""}   # the default root: results/ in the working directory
    for _ in range(2):
        run_mpi(None, 2, *job, module="dataparallel", timeout=180, cwd=tmp_path, env=here)
    base = tmp_path / "results" / "dataparallel_ddp"
    assert sorted(p.name for p in base.iterdir()) == ["latest", "run-1", "run-2"]
    assert (base / "latest").resolve() == (base / "run-2").resolve()
    assert (base / "run-1" / "summary.json").is_file()
    assert (base / "run-2" / "summary.json").is_file()
    # continuing the newest run (finished at 2 steps) to 3 steps, in its own folder
    longer = [*job[:4], 3, *job[5:]]
    run_mpi(None, 2, *longer, "--resume", module="dataparallel", timeout=180, cwd=tmp_path,
            env=here)
    assert sorted(p.name for p in base.iterdir()) == ["latest", "run-1", "run-2"]
    assert read_summary(base / "run-2")["metrics"]["steps"] == 3
    # SPARDIST_RESULTS names another root (the test suite's own, so no test writes into the
    # checkout's results/)
    other = tmp_path / "elsewhere"
    run_mpi(None, 2, *job, module="dataparallel", timeout=180, cwd=tmp_path,
            env={"SPARDIST_RESULTS": str(other)})
    assert (other / "dataparallel_ddp" / "run-1" / "summary.json").is_file()
    assert sorted(p.name for p in base.iterdir()) == ["latest", "run-1", "run-2"]


def test_resume_without_out_and_without_runs_is_refused(tmp_path):
    res = run_mpi(None, 2, "train", "--method", "ddp", "--steps", 2, "--ranks-per-node", 1,
                  "--resume", module="dataparallel", timeout=180, cwd=tmp_path,
                  expect_fail=True)
    assert "--resume without --out continues the newest run" in res.stderr


def test_summary_records_the_run_and_rerun_repeats_it(tmp_path):
    """``summary.json``'s record says how the run was launched and where; ``commvol rerun``
    repeats it into a new folder with the same bytes and accuracy."""
    out = tmp_path / "first"
    run_mpi(None, 2, "train", "--method", "topk", "--steps", 2, "--ranks-per-node", 1,
            "--out", out, module="dataparallel", timeout=180)
    rec = read_summary(out)["record"]
    assert rec["schema"] >= 2 and rec["module"] == "dataparallel"
    assert rec["args"][:3] == ["train", "--method", "topk"]
    assert rec["git_commit"] and rec["hosts"] and len(rec["hosts_per_rank"]) == 2
    assert rec["started"] <= rec["finished"]
    assert "\x00" not in rec["versions"]["mpi"] and rec["versions"]["numpy"]
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-m", "commvol", "rerun", str(out), "--out",
                           str(again)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    a, b = read_summary(out), read_summary(again)
    assert a["traffic"] == b["traffic"]
    assert a["metrics"]["final_test_accuracy"] == b["metrics"]["final_test_accuracy"]
    assert b["record"]["args"][-2:] == ["--out", str(again)]


def test_rerun_refuses_a_folder_without_a_record(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text('{"system": "x"}')
    proc = subprocess.run([sys.executable, "-m", "commvol", "rerun", str(tmp_path / "old")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "has no run record" in proc.stderr


def test_the_console_command_and_version():
    """``spardist`` (the installed console command) runs every command and prints the version;
    every command has ``--version``; the license file the metadata declares exists."""
    exe = Path(sys.executable).with_name("spardist")
    assert exe.exists(), "pip install -e . registers the spardist console command"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.startswith("spardist ")
    for cmd in (["commvol", "predict", "--help"], ["hsadmm", "train", "--help"],
                ["run", "--dry-run", "-n", "2", "runner.probe"]):
        proc = subprocess.run([str(exe), *cmd], capture_output=True, text=True, timeout=120,
                              check=False, cwd=ROOT)
        assert proc.returncode == 0, (cmd, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "dataparallel", "train", "--version"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("spardist ")
    assert subprocess.run([str(exe), "nope"], capture_output=True, text=True,
                          timeout=60, check=False).returncode == 2
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")


@pytest.mark.parametrize("module", ["[-n", "nosuchmodule", "hsadmm/train.py"])
def test_a_module_that_cannot_run_is_refused_before_any_rank_starts(module):
    """A README placeholder or a typo copied as MODULE is refused by the launcher itself (exit
    2, one line naming MODULE and examples), not by every rank's runpy traceback."""
    proc = subprocess.run([str(ROOT / "run_mpi.sh"), "-n", "2", module, "train"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert f"MODULE {module!r} is not a module this Python can run" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_launcher_leaves_bytecode_for_every_rank(tmp_path):
    """With PYTHONDONTWRITEBYTECODE set no rank writes ``.pyc`` caches; the launcher writes
    them first, so a job's ranks import the packages from bytecode."""
    import importlib.util
    import shutil

    root = Path(__file__).resolve().parents[2]
    checkout = tmp_path / "checkout"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "pkg" / "__init__.py").write_text("X = 1\n")
    (checkout / "runner").mkdir()
    (checkout / "runner" / "__init__.py").write_text("")
    shutil.copy(root / "runner" / "launch.py", checkout / "runner" / "launch.py")
    (checkout / "pyproject.toml").write_text("")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import runner.launch as L; assert L.__file__.startswith(sys.argv[1]); "
            "L.byte_compile_checkout()")
    subprocess.run([sys.executable, "-c", code, str(checkout)], check=True, cwd=root,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    for src in ("pkg/__init__.py", "runner/launch.py"):
        assert Path(importlib.util.cache_from_source(str(checkout / src))).is_file(), src


def test_the_suite_runs_on_every_core(monkeypatch):
    """``run_mpi.sh --test`` without arguments: one pytest worker per core, a file's tests on one
    worker (so a module's MPI jobs launch once); with arguments, pytest exactly as typed; one
    core, one worker asked for, or no pytest-xdist: one plain run."""
    from runner.launch import MAX_TEST_WORKERS, suite_command

    monkeypatch.delenv("SPARDIST_TEST_WORKERS", raising=False)
    pytest_cmd = [sys.executable, "-m", "pytest"]
    assert suite_command([], cores=2, xdist=True) == pytest_cmd + ["-n", "2", "--dist",
                                                                  "loadfile"]
    assert suite_command([], cores=64, xdist=True)[4] == str(MAX_TEST_WORKERS)
    assert suite_command(["-x", "tests/models"], cores=2, xdist=True) == pytest_cmd + [
        "-x", "tests/models"]
    assert suite_command([], cores=1, xdist=True) == pytest_cmd
    assert suite_command([], cores=2, xdist=False) == pytest_cmd
    monkeypatch.setenv("SPARDIST_TEST_WORKERS", "1")
    assert suite_command([], cores=2, xdist=True) == pytest_cmd


def test_warm_kernels_compiles_each_family_once_and_only_on_a_cold_checkout(tmp_path,
                                                                             monkeypatch):
    """A cold checkout (a kernel source without cached kernels newer than it) runs one training
    step per model family, at most ``workers`` at once; a warm one runs nothing."""
    from runner import launch

    for src in launch.WARM_SOURCES:
        (tmp_path / src).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / src).write_text("# kernels\n")
    started, live, most = [], [], []

    class FakeRun:
        def __init__(self, cmd, **kw):
            started.append(cmd)
            live.append(self)
            most.append(len(live))
            self.polls = 0

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            live.remove(self)
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", FakeRun)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    assert launch.warm_kernels(tmp_path, workers=2)
    assert [c[2:4] for c in started] == [["models", "train"]] * len(launch.WARM_RUNS)
    assert all(c[-4:-1] == ["--steps", "1", "--out"] for c in started)
    assert max(most) == 2
    # every source has kernels cached after it last changed: nothing runs
    started.clear()
    for src in launch.WARM_SOURCES:
        cache = (tmp_path / src).parent / "__pycache__"
        cache.mkdir(exist_ok=True)
        (cache / f"{Path(src).stem}.kernel-10.py311.nbi").write_bytes(b"")
    assert not launch.warm_kernels(tmp_path, workers=2) and not started
    # one source edited after its cache: cold again
    later = (tmp_path / launch.WARM_SOURCES[0]).stat().st_mtime + 10
    os.utime(tmp_path / launch.WARM_SOURCES[0], (later, later))
    assert launch.warm_kernels(tmp_path, workers=1) and len(started) == len(launch.WARM_RUNS)


def test_warm_jobsim_starts_only_on_a_cold_cache(tmp_path, monkeypatch):
    """The job simulation's engine is compiled in the background (an offline ``commvol scale``
    at 32 GPUs) only while its cache is cold."""
    from runner import launch

    src = tmp_path / launch.JOBSIM_SOURCE
    src.parent.mkdir(parents=True)
    src.write_text("# kernels\n")
    started = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or cmd)
    assert launch.warm_jobsim(tmp_path)[2:4] == ["commvol", "scale"]
    assert "32" in started[0]
    cache = src.parent / "__pycache__"
    cache.mkdir()
    (cache / f"{src.stem}.simulate-700.py311.nbi").write_bytes(b"")
    assert launch.warm_jobsim(tmp_path) is None and len(started) == 1
