"""Launch MPI test scripts with a timeout and fail with the ranks' own messages."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from runner.launch import kill_tree, launch_command, mpi_env

ROOT = Path(__file__).resolve().parents[1]
MPI_DIR = Path(__file__).resolve().parent / "mpi"
#: the MPI jobs running now (their launchers' pids)
_RUNNING: set[int] = set()
#: what ``tests/mpi/batch_jobs.py`` prints before each job's output (handed to it in the spec)
BATCH_MARK = "=== batch job: "


def run_mpi(script, n: int, *args, timeout: float = 120, expect_fail: bool = False,
            module: str | None = None, env: dict | None = None,
            cwd=None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m mpi4py SCRIPT ARGS`` (or ``-m MODULE``) from the repo root.

    ``script`` is a path, or a file name under ``tests/mpi/``.  Fails the test with every rank's
    stdout/stderr on a non-zero exit (or, with ``expect_fail``, on a zero exit) and kills the
    whole process group on timeout, so a hung rank never hangs the suite.  ``env`` adds
    variables to the launcher's environment; ``cwd`` (default: the repository) is where the
    job runs.
    """
    args = [str(a) for a in args]
    if module is not None:
        cmd = launch_command(n, module, args)
    else:
        path = Path(script)
        if not path.is_absolute():
            path = MPI_DIR / path
        cmd = launch_command(n, None, args, script=str(path))
    run_env = {**mpi_env(n), **(env or {})}
    if cwd is not None:   # the modules must still import from the checkout
        run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                             run_env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=run_env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _RUNNING.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, grace=1.0)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s (a rank hung)\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    except BaseException:
        # interrupted (Ctrl-C, or SIGTERM turned into KeyboardInterrupt by conftest): the job
        # and every process it started go with the test run
        kill_tree(proc.pid, grace=1.0)
        raise
    finally:
        _RUNNING.discard(proc.pid)
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if expect_fail and proc.returncode == 0:
        pytest.fail(f"{' '.join(cmd)} was expected to fail but exited 0\n{out}\n{err}")
    if not expect_fail and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{out}\n"
                    f"--- stderr ---\n{err}")
    return res


class JobBatch:
    """The MPI jobs of one test module, run in one launch per world size and environment
    (``tests/mpi/batch_jobs.py``), on the first test that asks for one of them.

    ``add(name, n, module, *argv)`` declares a job (its output folder is ``root / name``,
    which the caller passes in ``argv`` as it needs); ``run(name)`` returns that folder once
    the launch holding the job has finished, in the order the jobs were added.  A launch that
    fails fails every test that asks for one of its jobs, with the ranks' output.
    """

    def __init__(self, root, *, seconds_per_job: float = 30.0):
        self.root = Path(root)
        self.seconds_per_job = seconds_per_job
        self._jobs: dict[str, tuple] = {}
        self._launched: dict[tuple, str | None] = {}   # launch key -> failure message or None
        self._stdout: dict[str, str] = {}

    def add(self, name: str, n: int, module: str, *argv, env: dict | None = None) -> Path:
        if name in self._jobs:
            raise ValueError(f"job {name!r} declared twice")
        key = (n, tuple(sorted((env or {}).items())))
        self._jobs[name] = (key, module, [str(a) for a in argv])
        return self.root / name

    def run(self, name: str) -> Path:
        key = self._jobs[name][0]
        if key not in self._launched:
            group = [[job, module, argv] for job, (k, module, argv) in self._jobs.items()
                     if k == key]
            spec = self.root / f"jobs-{len(self._launched)}.json"
            spec.write_text(json.dumps({"mark": BATCH_MARK, "jobs": group}))
            self._launched[key] = "the launch did not finish"
            n, env = key
            try:
                res = run_mpi("batch_jobs.py", n, spec, env=dict(env),
                              timeout=60 + self.seconds_per_job * len(group))
            except pytest.fail.Exception as exc:
                self._launched[key] = str(exc)
                raise
            self._launched[key] = None
            for part in res.stdout.split(BATCH_MARK)[1:]:
                job, _, text = part.partition("\n")
                self._stdout[job] = text
        if self._launched[key] is not None:
            pytest.fail(f"the launch holding job {name!r} failed:\n{self._launched[key]}")
        return self.root / name

    def stdout(self, name: str) -> str:
        """What the job printed on rank 0 (after :meth:`run`)."""
        self.run(name)
        return self._stdout.get(name, "")


def read_summary(out_dir) -> dict:
    """``summary.json`` of a finished run directory."""
    return json.loads((Path(out_dir) / "summary.json").read_text())


def assert_measured_equals_predicted(summary: dict) -> None:
    """Ledger totals equal the closed-form prediction in total and per phase and link class."""
    measured, predicted = summary["traffic"]["measured"], summary["traffic"]["predicted"]
    assert measured["inter_node_bytes"] == predicted["inter_node_bytes"]
    assert measured["intra_node_bytes"] == predicted["intra_node_bytes"]
    assert set(measured["by_phase"]) == set(predicted["by_phase"])
    for phase, want in predicted["by_phase"].items():
        got = measured["by_phase"][phase]
        assert (got["intra_bytes"], got["inter_bytes"]) == (want["intra_bytes"],
                                                            want["inter_bytes"]), phase


def error_lines(stderr: str) -> list[str]:
    """The ``spardist: error on ...`` lines of a job's stderr."""
    return [x for x in stderr.splitlines() if x.startswith("spardist: error on ")]


def assert_one_error_from_every_rank(stderr: str, message: str, n: int) -> None:
    """Every one of the ``n`` ranks failed with ``message``, printed once (not interleaved)."""
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    want = "spardist: error on " + (f"ranks 0-{n - 1}: " if n > 1 else "rank 0: ")
    assert lines[0].startswith(want) and message in lines[0], stderr


def assert_fails_on_every_rank(module: str, args, message: str, out_dir, n: int = 2) -> None:
    """``module`` run with ``args`` on ``n`` ranks fails with ``message`` reported by every rank
    in one line, and writes nothing into ``out_dir`` (an earlier summary stays as it was, no
    in-progress metrics are left)."""
    summary = Path(out_dir) / "summary.json"
    before = summary.read_bytes() if summary.is_file() else None
    res = run_mpi(None, n, *args, "--out", out_dir, module=module, timeout=120,
                  expect_fail=True)
    assert_one_error_from_every_rank(res.stderr, message, n)
    assert (summary.read_bytes() if summary.is_file() else None) == before
    assert not (Path(out_dir) / ".metrics.jsonl.part").exists()
