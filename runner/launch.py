"""The launcher behind ``run_mpi.sh`` (after it has bootstrapped ``.venv``) and the MPI tests.

``python -m runner.launch [-n NP] [--ranks-per-node R] [--hostfile F] [--dry-run] MODULE
[ARGS...]`` runs ``python -m mpi4py -m MODULE ARGS`` under ``mpiexec -n NP`` (or ``srun`` inside
a Slurm allocation; ``SPARDIST_LAUNCHER`` overrides, e.g. ``mpirun`` or ``srun --mpi=pmix``).
With no arguments it runs the project's main job on the embedded default; with ``--test`` it runs
the test suite.

Which ``mpiexec``: ``SPARDIST_MPIEXEC`` if set, else the one installed in this Python's
environment (the ``mpich`` wheel from PyPI), else the first on ``PATH``.  Oversubscription is
enabled automatically when NP exceeds the cores (Open MPI needs a flag; MPICH's Hydra allows it by
default), and then MPICH's waiting ranks sleep instead of spinning (:data:`YIELD_ENV`); Open MPI
run as root also gets ``--allow-run-as-root``.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import functools
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from substrate.pinning import pinning_env

__all__ = [
    "DEFAULT_JOB",
    "YIELD_ENV",
    "descendants",
    "find_mpiexec",
    "git_commit",
    "kill_tree",
    "launch_command",
    "main",
    "mpi_env",
    "mpi_flavor",
    "oversubscribed",
    "run_tree",
    "warm_jobsim",
    "warm_kernels",
]

#: ``./run_mpi.sh`` with no arguments (the main job on the embedded default).  It replaces its own
#: previous output in ``results/headline`` (``--overwrite``, said in the README): the demo is
#: meant to be run again; every other command refuses to overwrite a finished run.
DEFAULT_JOB = ["-n", "4", "--ranks-per-node", "2", "commvol.compare", "--overwrite"]
DEFAULT_NP = 4


def find_mpiexec() -> str:
    """Path of the ``mpiexec`` matching this environment's MPI library."""
    env = os.environ.get("SPARDIST_MPIEXEC")
    if env:
        return env
    local = Path(sys.prefix) / "bin" / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found: run ./run_mpi.sh once (it installs the mpich wheel into .venv), "
            "load your site's MPI module, or set SPARDIST_MPIEXEC=/path/to/mpiexec")
    return found


@functools.cache
def mpi_flavor(mpiexec: str) -> str:
    """``"openmpi"``, ``"mpich"``, ``"intel"`` or ``"unknown"`` from ``mpiexec --version``."""
    try:
        out = subprocess.run([*shlex.split(mpiexec), "--version"], capture_output=True,
                             text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    low = out.lower()
    if "open mpi" in low or "openrte" in low or "open-mpi" in low:
        return "openmpi5" if "(open mpi) 5" in low or "prte" in low else "openmpi"
    if "intel" in low:
        return "intel"
    if "hydra" in low or "mpich" in low:
        return "mpich"
    return "unknown"


@functools.cache
def srun_mpi_plugins(srun: str = "srun") -> tuple[str, ...]:
    """The PMI plugins this Slurm offers (``srun --mpi=list``), e.g. ``("pmix", "pmi2")``."""
    try:
        out = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    names = []
    for line in (out.stdout + out.stderr).splitlines():
        # "MPI plugin types are..." then one indented name per line, then "specific ..."
        if line[:1].isspace() and line.strip() and ":" not in line:
            names.append(line.strip())
    return tuple(names)


def slurm_launcher(flavor: str | None = None, plugins: tuple[str, ...] | None = None) -> str | None:
    """How to start one MPI world inside a Slurm allocation, for the MPI library of this
    environment (``flavor`` of :func:`find_mpiexec`).

    ``srun`` alone starts N singletons unless its PMI plugin is one the library speaks: the
    MPICH wheel speaks PMI-2 (``srun --mpi=pmi2``; it has no PMIx).  Open MPI speaks PMIx, but
    ``srun --mpi=pmix`` depends on the site's Slurm being built against a compatible PMIx (with
    Debian's Slurm 22.05 and the Open MPI 5.0 wheel its task launch timed out), so Open MPI gets
    ``None``: its own ``mpiexec`` (PRRTE), which reads the allocation and starts one world; sites
    whose ``srun --mpi=pmix`` works can say so with ``SPARDIST_LAUNCHER``.  ``None`` also when
    Slurm offers no matching plugin (Hydra starts its proxies inside the allocation).
    """
    if flavor is None:
        try:
            flavor = mpi_flavor(find_mpiexec())
        except FileNotFoundError:
            flavor = "unknown"
    plugins = srun_mpi_plugins() if plugins is None else plugins
    if flavor == "mpich":
        return "srun --mpi=pmi2" if "pmi2" in plugins else None
    if flavor.startswith("openmpi"):
        return None
    return "srun"


def launch_command(np_: int, module: str | None, args: list[str] = (), *,
                   script: str | None = None, hostfile: str | None = None,
                   python: str | None = None, launcher: str | None = None) -> list[str]:
    """The exact command line that runs ``python -m mpi4py -m module args`` (or
    ``python -m mpi4py script args``) on ``np_`` ranks.  ``python -m mpi4py`` makes an uncaught
    exception on any rank abort the whole job instead of leaving the others waiting."""
    if np_ < 1:
        raise ValueError(f"-n must be >= 1, got {np_}")
    if (module is None) == (script is None):
        raise ValueError("give exactly one of module or script")
    python = python or sys.executable
    target = ["-m", module] if module is not None else [script]
    payload = [python, "-m", "mpi4py", *target, *args]
    launcher = launcher if launcher is not None else os.environ.get("SPARDIST_LAUNCHER")
    if launcher is None and os.environ.get("SLURM_JOB_ID") and shutil.which("srun"):
        launcher = slurm_launcher()
    if launcher is not None and Path(shlex.split(launcher)[0]).name == "srun":
        cmd = [*shlex.split(launcher), "-n", str(np_)]
        if hostfile:
            print("spardist: --hostfile is ignored under srun (Slurm places the ranks)",
                  file=sys.stderr)
        return cmd + payload
    mpiexec = launcher or find_mpiexec()
    cmd = [*shlex.split(mpiexec), "-n", str(np_)]
    flavor = mpi_flavor(mpiexec)
    if flavor.startswith("openmpi"):
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if np_ > (os.cpu_count() or 1):
            cmd += ["--map-by", ":OVERSUBSCRIBE"] if flavor == "openmpi5" else ["--oversubscribe"]
        if hostfile:
            cmd += ["--hostfile", hostfile]
    elif hostfile:
        cmd += ["-f", hostfile] if flavor == "mpich" else ["-hostfile", hostfile]
    return cmd + payload


#: MPICH (ch4) environment that makes a waiting rank sleep 1 us after this many progress polls
#: without progress instead of spinning: with more ranks than cores (2 x 2 on 2 vCPUs), a rank
#: busy-polling for its neighbour's data otherwise holds the core the neighbour needs to send it.
#: ``ENABLE_HEAVY_YIELD``: a rank initialised with ``MPI_THREAD_MULTIPLE`` (every spardist rank:
#: the communication thread of ``--overlap``) yields in its progress loop with ``sched_yield``,
#: which returns at once on a busy box; measured here, a thread waiting 2 s for a message burnt
#: 0.44-0.50 s of CPU with or without the throttle (every replay rank of a 4 x 2 lab held a
#: quarter of a vCPU while it waited), 0.17-0.22 s with a nanosleep yield, and 0.015 s with the
#: nanosleep yield under a time-dilated lab's 1.6 ms timer slack.  :func:`mpi_env` sets it for
#: an oversubscribed launch (4-rank jobs on 2 cores: H-SGD train 4.7-6.2 -> 3.7-3.8 s wall, 9.3-
#: 12.2 -> 6.7-7.0 CPU s; H-SADMM 1.3-1.8 -> 1.3 s); the wire lab's hosts take it with ``--yield``.
YIELD_ENV = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
             "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "64",
             "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def oversubscribed(np_: int, hostfile: str | None = None, cmd: list[str] | None = None) -> bool:
    """Whether ``np_`` ranks of a launch share this host's cores: more ranks than cores, no
    hostfile, and not started by ``srun`` (which places the ranks on the allocation's nodes)."""
    if hostfile or (cmd and Path(cmd[0]).name == "srun"):
        return False
    return np_ > (os.cpu_count() or 1)


def mpi_env(np_: int, base: dict | None = None, flavor: str | None = None,
            shared_cores: bool | None = None) -> dict:
    """Environment for ``np_`` ranks on this host.

    * BLAS/OpenMP/Numba threads are capped at ``cores // np_`` (at least 1) unless already set,
      so oversubscribed ranks do not thrash.
    * Ranks that share the cores (``shared_cores``, default :func:`oversubscribed`) wait in MPI
      by sleeping, not spinning (:data:`YIELD_ENV`, unless the user set those variables): a
      spinning rank holds the core its neighbour needs to send what it waits for.
    * The MPI library's collectives are pinned to the algorithms the ledger books
      (:func:`substrate.collectives.pinning_env`) unless the user set those variables: this must
      happen before ``MPI_Init``, so only a launcher can do it.  It matters for
      ``--collectives native``; in the default exact mode only spardist's unbooked bookkeeping
      (ledger gathering) uses the library's collectives.  ``flavor`` defaults to the family of
      :func:`find_mpiexec`; MPICH's variables are set for any launcher (other libraries ignore
      them), Open MPI's only when the launcher is Open MPI's.
    """
    env = dict(os.environ if base is None else base)
    threads = str(max(1, (os.cpu_count() or 1) // max(np_, 1)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        env.setdefault(var, threads)
    # OpenBLAS's workers sleep right after a GEMM instead of spinning ~0.1 s (its default), which
    # kept the layer kernels' own threads off the cores (ResNet-18, 2 threads: 0.92 -> 0.79 s a
    # step); read when NumPy loads OpenBLAS, so only a launcher can set it
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if oversubscribed(np_) if shared_cores is None else shared_cores:
        for var, value in YIELD_ENV.items():
            env.setdefault(var, value)
    if flavor is None:
        try:
            flavor = mpi_flavor(find_mpiexec())
        except FileNotFoundError:
            flavor = "unknown"
    pins = pinning_env("mpich")
    if flavor.startswith("openmpi"):
        pins.update(pinning_env(flavor))
    for var, value in pins.items():
        env.setdefault(var, value)
    env["SPARDIST_NP"] = str(np_)  # every rank checks MPI's world against it (no singletons)
    return env


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_mpi.sh",
        description="Run a spardist module under MPI, or the tests. With no arguments: the main "
                    "job on the embedded default (" + " ".join(DEFAULT_JOB) + ").")
    p.add_argument("-n", "--np", type=int, default=DEFAULT_NP, dest="np",
                   help="number of ranks (default %(default)s)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="simulate nodes of R ranks (passed to the module on every rank)")
    p.add_argument("--hostfile", default=None, help="MPI hostfile (mpiexec only)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("module", help="module to run, e.g. runner.probe or hsadmm")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the module")
    ns = p.parse_args(argv)
    # a placeholder or typo would otherwise start every rank only to fail in runpy, once a rank
    top = ns.module.split(".")[0]
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", ns.module) or \
            importlib.util.find_spec(top) is None:
        p.error(f"MODULE {ns.module!r} is not a module this Python can run; give one such as "
                "hsadmm, dataparallel, sparse_sgd, partition, models, commvol or runner.probe, "
                "then its arguments")
    return ns


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from ``/proc``: the ranks of an
    MPI job are the launcher's descendants even when each sits in a process group of its own
    (Open MPI's ``prterun`` daemons put them there, so killing a group misses them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int, grace: float = 3.0) -> None:
    """End ``pid`` and all its descendants: SIGTERM to every one (the MPI launcher forwards it
    and tears its job down), then, after ``grace`` seconds, SIGKILL to whatever is left."""
    procs = [pid, *descendants(pid)]
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.05)
    for p in [*procs, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().decode(errors="replace")
        return state[state.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def run_tree(cmd: list[str], env: dict | None = None) -> int:
    """Run ``cmd`` in a setsid group of its own and wait; on SIGINT or SIGTERM end it with every
    process it started (:func:`kill_tree`: ranks, launcher daemons, a test run's MPI jobs), so
    an interrupted ``run_mpi.sh`` leaves nothing behind; returns its exit code (128 + signal
    when interrupted)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    got: list[int] = []

    def stop(signum, _frame):
        got.append(signum)
        kill_tree(proc.pid)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 + got[0] if got else rc


def _lint() -> int:
    """ruff over the checkout (the project's configuration in pyproject.toml) before the tests:
    the suite fails fast on a finding.  ``SPARDIST_NO_LINT=1`` skips it; an installed package
    (no pyproject.toml beside it) has nothing to lint."""
    root = Path(__file__).resolve().parents[1]
    if os.environ.get("SPARDIST_NO_LINT") == "1" or not (root / "pyproject.toml").is_file():
        return 0
    rc = subprocess.run([sys.executable, "-m", "ruff", "check", str(root)], check=False).returncode
    if rc:
        print(f"spardist: ruff found problems in {root} (above); fix them (many with "
              f"`{sys.executable} -m ruff check --fix {root}`), then run the tests again; "
              "SPARDIST_NO_LINT=1 skips the lint", file=sys.stderr)
    return rc


def byte_compile_checkout() -> None:
    """Byte-compile the checkout's packages, tests and benches once, before a launch.

    With ``PYTHONDONTWRITEBYTECODE`` set (common on shared machines and CI images) Python never
    writes its ``.pyc`` caches, so every rank of every job compiled the package's sources again:
    0.3 s of a 0.7 s start-up per process on a 2-core box.  Python still reads caches that
    exist, so writing them here once makes every later process start from bytecode.  Up-to-date
    caches are only checked (0.06 s on a 2-core box); an installed package (no ``pyproject.toml`` beside
    it) was compiled when it was installed."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        return
    dirs = [d for d in sorted(root.iterdir())
            if (d / "__init__.py").is_file() or d.name in ("tests", "bench", "scripts")]
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        for d in dirs:
            with contextlib.suppress(OSError):   # a read-only checkout just starts slower
                compileall.compile_dir(str(d), quiet=2, workers=1)


#: one small training step of each model family whose Numba kernels many-process runs load
#: (``python -m models train``; ResNet: the layer and Winograd kernels, ViT and GPT: the
#: transformer kernels), longest first
WARM_RUNS = [["--model", "resnet", "--dataset", "digits"],
             ["--model", "vit", "--dataset", "digits"],
             ["--model", "gpt", "--dataset", "text"]]
#: the kernels' sources: the checkout is warm when Numba's cache holds kernels of each
WARM_SOURCES = ["models/kernels.py", "models/kernels_winograd.py",
                "models/kernels_transformer.py"]


def _kernels_cached(source: Path) -> bool:
    """Whether Numba's cache holds kernels of ``source`` compiled since it last changed."""
    with contextlib.suppress(OSError):
        mtime = source.stat().st_mtime
        return any(f.stat().st_mtime >= mtime
                   for f in (source.parent / "__pycache__").glob(f"{source.stem}.*.nbi"))
    return False


def _quiet(args: list[str], root: Path) -> subprocess.Popen:
    """``python -m ARGS`` in ``root``, no input, output discarded (a warm-up step)."""
    return subprocess.Popen([sys.executable, "-m", *args], cwd=root, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def warm_kernels(root: Path | None = None, workers: int | None = None) -> bool:
    """Compile the model kernels once, before many processes would each compile them.

    Numba caches compiled kernels beside their sources (``cache=True``).  On a cold checkout (a
    fresh clone, CI) every process that needs a kernel compiles it, and the ranks of an
    oversubscribed job compile the same kernels at once: 4 ranks of a ViT job on 2 cores took
    16.1 s cold against 5.5 s warm.  Unless every source of :data:`WARM_SOURCES` has cached
    kernels, this runs the steps of :data:`WARM_RUNS` in parallel processes (at most
    ``workers``, default the cores), output discarded; a step that fails only leaves its
    kernels to be compiled where they are used.  Returns whether it ran them."""
    root = root or Path(__file__).resolve().parents[1]
    if all(_kernels_cached(root / src) for src in WARM_SOURCES):
        return False
    workers = max(1, workers or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="spardist-warm-") as tmp:
        pending = list(enumerate(WARM_RUNS))
        running: list[subprocess.Popen] = []
        while pending or running:
            while pending and len(running) < workers:
                i, args = pending.pop(0)
                running.append(_quiet(["models", "train", *args, "--steps", "1",
                                       "--out", str(Path(tmp) / str(i))], root))
            time.sleep(0.1)
            running = [p for p in running if p.poll() is None]
    return True


#: one strong-scaling prediction at 32 GPUs: it compiles the job simulation's engine
#: (:mod:`simulation.jobsim_kernel`, used from 32 ranks on)
JOBSIM_WARM_RUN = ["commvol", "scale", "--system", "ddp", "--model", "resnet18", "--gpus", "32",
                   "--gpus-per-node", "4", "--cluster", "prunex-puhti"]
JOBSIM_SOURCE = "simulation/jobsim_kernel.py"


def warm_jobsim(root: Path | None = None) -> subprocess.Popen | None:
    """Start compiling the job simulation's engine in the background when its cache is cold,
    and return the process (the caller ends it), else ``None``.

    Its kernels take 62-77 s to compile on a 2-core box at 1.7x its quiet time; in the suite
    every pytest worker whose tests simulate 32 ranks or more compiled them inside a test (one
    such test ran past pytest's 300 s limit under load).  The suite's first tests launch MPI
    jobs and need no simulation, so the compilation runs beside them."""
    root = root or Path(__file__).resolve().parents[1]
    if _kernels_cached(root / JOBSIM_SOURCE):
        return None
    return _quiet(JOBSIM_WARM_RUN, root)


#: at most this many pytest workers for the whole suite (``SPARDIST_TEST_WORKERS`` overrides)
MAX_TEST_WORKERS = 8


def suite_command(args: list[str], cores: int | None = None,
                  xdist: bool | None = None) -> list[str]:
    """The pytest command of ``run_mpi.sh --test ARGS``.

    With ``ARGS`` given: pytest with them, as typed.  The whole suite (no ``ARGS``) runs on one
    pytest worker per core (pytest-xdist, at most :data:`MAX_TEST_WORKERS`;
    ``SPARDIST_TEST_WORKERS`` to choose), a test file's tests on one worker (``--dist
    loadfile``: a module's MPI jobs run in one launch per world size, which tests spread over
    workers would launch once each).  No test asserts a time that another worker's load could
    break: the wire lab's timed runs assert bytes, and of their times only bounds that a slower
    machine still meets.  On two cores two workers take 0.6 of the serial time
    (``docs/RESULTS.md``, the test suite)."""
    pytest = [sys.executable, "-m", "pytest"]
    if args:
        return pytest + args
    cores = cores if cores is not None else (os.cpu_count() or 1)
    want = os.environ.get("SPARDIST_TEST_WORKERS", "").strip()
    workers = int(want) if want.isdigit() else min(cores, MAX_TEST_WORKERS)
    if xdist is None:
        xdist = importlib.util.find_spec("xdist") is not None
    if workers < 2 or not xdist:
        return pytest
    return pytest + ["-n", str(workers), "--dist", "loadfile"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--test":   # the suite's conftest byte-compiles the checkout itself
        rc = _lint()
        if rc:
            return rc
        background = None
        if len(argv) == 1:             # the whole suite: its 4-rank jobs load the kernels
            t = time.perf_counter()
            if warm_kernels():
                print(f"run_mpi.sh: compiled the model kernels once "
                      f"({time.perf_counter() - t:.0f} s), before the suite's processes",
                      flush=True)
            background = warm_jobsim()
        try:
            return run_tree(suite_command(argv[1:]))
        finally:
            if background is not None and background.poll() is None:
                background.kill()
                background.wait()
    byte_compile_checkout()
    if not argv:
        argv = list(DEFAULT_JOB)
    ns = _parse(argv)
    args = list(ns.args)
    if ns.ranks_per_node is not None:
        args += ["--ranks-per-node", str(ns.ranks_per_node)]
    cmd = launch_command(ns.np, ns.module, args, hostfile=ns.hostfile)
    if ns.dry_run:
        print(shlex.join(cmd))
        return 0
    env = mpi_env(ns.np, shared_cores=oversubscribed(ns.np, ns.hostfile, cmd))
    if sys.stderr.isatty():     # rank 0's stderr is a pipe under mpiexec: tell it ours is not
        env.setdefault("SPARDIST_TTY", "1")
    return run_tree(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())


def git_commit(where: Path | None = None) -> str:
    """The commit of the checkout spardist runs from (``+dirty`` with local changes), or
    ``"not a checkout"``."""
    where = where or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
        if head.returncode:
            return "not a checkout"
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=False).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "not a checkout"
