"""MPI jobs across the emulated hosts: :class:`Lab` runs a spardist command on ``H x R`` ranks
and measures what crossed the links.

``Lab.measure(["dataparallel", "train", ...], out=DIR)`` runs ``python -m mpi4py -m MODULE ARGS
--out DIR`` across the hosts, reads the counters of every host link before and after, subtracts
the start-up baseline (an empty MPI run of the same shape, :meth:`Lab.baseline`, measured once
per launch style) and writes ``DIR/wire.json`` (:func:`lab.analysis.wire_report`).

* ``mpiexec`` (hydra, from the environment of the lab's Python) runs inside host 0 with
  ``-launcher ssh -launcher-exec SHIM -hosts h0,..,h<H-1> -ppn R``: hydra calls the shim like
  ``ssh`` and it enters the host's namespaces, so hydra sees ``H`` distinct hosts and
  ``MPI_Comm_split_type(SHARED)`` groups the ranks by host: the nodes of the run are real (no
  ``--ranks-per-node``).  Host 0's proxy is forked by mpiexec itself.  ``launch="run_mpi"``
  runs the project's launcher (``python -m runner.launch``) with ``SPARDIST_LAUNCHER`` set to
  the same hydra command, and checks that it resolves to it.
* ``MPIR_CVAR_CH4_NETMOD=ucx`` with ``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES=eth0`` (or
  ``netmod="ofi"``: ``FI_PROVIDER=tcp``, ``FI_TCP_IFACE=eth0``): the namespaces share one
  kernel, so UCX would otherwise move inter-host messages through shared memory / CMA.  Ranks
  of the same host still use MPICH's shared memory, as on a real node.
* Timing on a shared box: ``nice=N`` runs the MPI job at niceness ``N`` *and* gives every
  process in the host namespaces the autogroup niceness ``N`` (with
  ``kernel.sched_autogroup_enabled`` CFS shares the cores between autogroups first, and hydra
  starts every proxy and rank in a setsid group of its own, so a plain ``nice`` would not order them
  against the box's other jobs); :data:`YIELD_ENV` makes ranks waiting in MPI sleep instead of
  spinning, for more ranks than cores.
* Every job runs under ``timeout`` seconds; a job past it is killed with everything in the host
  namespaces, and the lab is torn down by its context manager.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from runner.launch import YIELD_ENV

from .analysis import WIRE_JSON, wire_report
from .netns import ROOT, LabError, autogroup_nice, find_hydra, netns_pids, run
from .network import HOST_IF, Network
from .programs import PINGPONG_JSON

__all__ = ["DEFAULT_TIMEOUT", "YIELD_ENV", "Lab", "default_out", "write_json"]

DEFAULT_TIMEOUT = 300.0
LOG_NAME = "wirelab.log"              # the jobs' output, in the run's directory


#: Linux ``prctl`` option that sets the calling thread's timer slack (``linux/prctl.h``)
PR_SET_TIMERSLACK = 29


def _timer_slack_setter(us: float):
    """A ``preexec_fn`` that sets the job's timer slack to ``us`` microseconds.

    The slack is how late the kernel may fire a sleeping thread's timer; every process and
    thread the job forks inherits it through ``exec``.  A rank waiting in MPI with
    :data:`YIELD_ENV` sleeps ``usleep(1)`` between polls, i.e. one slack (50 us by default):
    in a time-dilated lab (:mod:`runner.replay` ``--dilation K``) a slack of K x 50 us keeps
    that wake-up period 50 us of *emulated* time and divides the CPU the waiting ranks burn by
    K (opt-in, ``bench_wirelab.py --dilate-timer-slack``: with MPICH's nanosleep yield every
    progress poll then waits a slack, see :func:`lab.experiments.compare_systems`)."""
    ns = int(us * 1000)

    def setter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK)")
    return setter


class Lab(Network):
    """``hosts`` emulated hosts with ``ranks_per_host`` MPI ranks each (see the module docstring
    and :class:`lab.network.Network`).

    Use as a context manager; :meth:`measure` runs one spardist command across the hosts and
    returns the ``wire.json`` dict.  The start-up baseline is measured once per launch style and
    reused.

    Parameters
    ----------
    hosts, ranks_per_host : int
    link : (mbit, latency_us) or str, optional
        Shape every link (:func:`lab.network.parse_link`).
    netmod : {"ucx", "ofi"}
        MPICH's network module (both over TCP on ``eth0``).
    offload : bool
        Keep the kernel's default segmentation offload (TSO/GSO on, GRO off) instead of turning
        TSO/GSO off and GRO on.
    timeout : float
        Seconds allowed for each MPI run (the job is killed and the lab torn down past it).
    env : dict, optional
        Extra environment for the MPI job (e.g. ``{"SPARDIST_COLLECTIVES": "native"}``;
        :data:`YIELD_ENV` makes waiting ranks yield their core).
    nice : int, optional
        Scheduling niceness of the MPI job (``nice -n``; -20 .. 19, below 0 needs root): a
        timing run on a box that other jobs load gets its cores first (``--nice -20``).
    rto_min_ms : float, optional
        TCP's minimum retransmission timeout (:class:`lab.network.Network`).
    """

    def __init__(self, hosts: int, ranks_per_host: int, *, link=None, netmod: str = "ucx",
                 offload: bool = False, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None,
                 python: str | None = None, verbose: bool = False,
                 nice: int | None = None, timer_slack_us: float | None = None,
                 rto_min_ms: float | None = None) -> None:
        super().__init__(hosts, link=link, offload=offload, python=python, verbose=verbose,
                         rto_min_ms=rto_min_ms)
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) \
                or ranks_per_host < 1:
            raise LabError(f"--ranks-per-host must be an integer >= 1, got {ranks_per_host!r}")
        if netmod not in ("ucx", "ofi"):
            raise LabError(f"--netmod must be ucx or ofi, got {netmod!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not (math.isfinite(timeout) and timeout > 0):
            raise LabError(f"--timeout must be a finite number of seconds > 0, got {timeout!r}. "
                           "Fix: e.g. --timeout 600")
        if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int)
                                 or not -20 <= nice <= 19):
            raise LabError(f"--nice must be an integer in -20 .. 19, got {nice!r}")
        if timer_slack_us is not None and not (isinstance(timer_slack_us, (int, float))
                                               and 1 <= timer_slack_us <= 1e6):
            raise LabError(f"timer_slack_us must be in 1 .. 1e6 us, got {timer_slack_us!r}")
        self.rph = ranks_per_host
        self.timer_slack_us = timer_slack_us
        self.netmod, self.timeout = netmod, float(timeout)
        self.extra_env = dict(env or {})
        self.nice = nice
        self.baselines: dict = {}
        self.pingpong: dict | None = None

    def preflight(self) -> None:
        """The network's checks, and MPICH's hydra ``mpiexec`` next to the lab's Python."""
        super().preflight()
        self.mpiexec = find_hydra(self.python)

    def _renice(self, stop: threading.Event) -> None:
        """While a job runs: give every new process in the host namespaces (hydra puts each
        proxy and each rank in a setsid group of its own, so in an autogroup of its own) the
        autogroup niceness :attr:`nice` (:func:`autogroup_nice`), again when it moved to a new
        setsid group since.  Polls every 50 ms, slowing to 1 s: the ranks appear at start-up."""
        want = f" nice {int(self.nice)}"
        wait = 0.05
        while not stop.wait(wait):
            for ns in self.names:
                for pid in netns_pids(ns):
                    with contextlib.suppress(OSError):
                        if not Path(f"/proc/{pid}/autogroup").read_text().rstrip() \
                                .endswith(want):
                            autogroup_nice(pid, self.nice)
            wait = min(1.0, wait * 1.3)

    def mpi_env(self) -> dict:
        """The job's environment: this one minus batch-system/PMI variables, plus the network
        selection that keeps inter-host traffic on the veth links."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "PMI_", "PMIX_", "HYDRA_", "OMPI_", "PBS_",
                                    "UCX_", "FI_"))
               and k not in ("SPARDIST_LAUNCHER", "SPARDIST_MPIEXEC")}
        threads = str(max(1, (os.cpu_count() or 1) // (self.hosts * self.rph)))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "NUMBA_NUM_THREADS"):
            env.setdefault(var, threads)
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")   # as runner.launch: no spinning
        if self.netmod == "ucx":
            env.update(MPIR_CVAR_CH4_NETMOD="ucx", UCX_TLS="tcp,self", UCX_NET_DEVICES=HOST_IF,
                       UCX_WARN_UNUSED_ENV_VARS="n")
        else:
            env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp", FI_TCP_IFACE=HOST_IF)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(self.extra_env)
        return env

    def hydra_prefix(self) -> list[str]:
        return [self.mpiexec, "-genvall", "-rmk", "user", "-launcher", "ssh", "-launcher-exec",
                self.shim, "-hosts", ",".join(self.hostnames), "-ppn", str(self.rph)]

    def command(self, module_args: list[str], launch: str) -> tuple[list[str], dict]:
        """The command (run inside host 0) and its environment for one launch style."""
        np_ = self.hosts * self.rph
        env = self.mpi_env()
        if launch == "mpiexec":
            cmd = [*self.hydra_prefix(), "-n", str(np_), self.python, "-m", "mpi4py", "-m",
                   *module_args]
        elif launch == "run_mpi":
            hydra = shlex.join(self.hydra_prefix())
            env["SPARDIST_LAUNCHER"] = hydra      # wins over Slurm detection and find_mpiexec
            env["SPARDIST_MPIEXEC"] = hydra
            cmd = [self.python, "-m", "runner.launch", "-n", str(np_), *module_args]
        else:
            raise LabError(f"--launch must be mpiexec or run_mpi, got {launch!r}")
        return cmd, env

    def in_host0(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[0], "unshare", "--uts", "/bin/sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[0], *cmd]

    def _job(self, module_args: list[str], launch: str, log: Path) -> dict:
        """Run one MPI job; return the counter deltas, wall time and resolved command."""
        cmd, env = self.command(module_args, launch)
        resolved = None
        if launch == "run_mpi":
            res = run(self.in_host0([*cmd[:3], "--dry-run", *cmd[3:]]), env=env, timeout=60)
            resolved = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
            if not resolved.startswith(shlex.join(self.hydra_prefix())):
                raise LabError("runner.launch did not resolve to the lab's hydra command: "
                               f"{resolved!r}")
        before, qd_before = self.counters(), self.qdisc_stats()
        t0 = time.monotonic()
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            niced = cmd if self.nice is None else ["nice", "-n", str(self.nice), *cmd]
            slack = ({} if self.timer_slack_us is None else
                     {"preexec_fn": _timer_slack_setter(self.timer_slack_us)})
            p = self._popen(self.in_host0(niced), cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT, **slack)
            stop = threading.Event()
            if self.nice is not None:
                threading.Thread(target=self._renice, args=(stop,), daemon=True).start()
            try:
                rc = p.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._kill(p)
                self._sweep()
                raise LabError(f"the MPI job timed out after {self.timeout:g} s and was killed "
                               f"(raise --timeout); log: {log}\n{_tail(log)}") from None
            finally:
                stop.set()
                self._kill(p)
        wall = time.monotonic() - t0
        self._sweep()
        if rc != 0:
            raise LabError(f"the MPI job exited {rc}: {shlex.join(cmd)}\n{_tail(log)}")
        after, qd_after = self.counters(), self.qdisc_stats()
        qdisc = None
        if qd_before is not None:
            qdisc = {dev: {"kind": v["kind"], **{k: (v[k] or 0) - (qd_before[dev][k] or 0)
                                                 for k in ("bytes", "packets", "drops",
                                                           "overlimits")}}
                     for dev, v in qd_after.items()}
        return {"delta": self._delta(before, after), "wall_s": wall, "command": cmd,
                "resolved": resolved, "qdisc": qdisc}

    def baseline(self, launch: str = "mpiexec", log: Path | None = None) -> dict:
        """Start-up traffic of an empty run of this shape (cached per launch style)."""
        if launch not in self.baselines:
            log = log or self.tmp / "baseline.log"
            job = self._job(["lab", "--idle"], launch, log)
            self.baselines[launch] = job
        return self.baselines[launch]

    def ping_pong(self, *, reps: int = 200, sizes=(8, 1 << 20), launch: str = "mpiexec",
                  out: Path | None = None) -> dict:
        """One-off MPI ping-pong on the lab (:func:`lab.programs.pingpong_main`): one-way time per size for
        an inter-host pair and, with ``ranks_per_host > 1``, an intra-host pair.  Cached: the
        alpha of the lab is measured once."""
        if self.pingpong is not None:
            return self.pingpong
        if not self.up:
            raise LabError("the lab is not set up (use it as a context manager)")
        d = Path(out) if out is not None else self.tmp / "pingpong"
        d.mkdir(parents=True, exist_ok=True)
        self._job(["lab", "--pingpong", "--out", str(d), "--reps", str(reps),
                   "--sizes", ",".join(str(int(x)) for x in sizes)], launch, d / "pingpong.log")
        self.pingpong = json.loads((d / PINGPONG_JSON).read_text())
        self.pingpong["link_setting"] = self.shaping
        return self.pingpong

    def measure(self, module_args, *, out=None, launch: str = "mpiexec",
                force: bool = False) -> dict:
        """Run ``python -m mpi4py -m MODULE ARGS --out OUT`` across the hosts and write
        ``OUT/wire.json``; return its content."""
        if not self.up:
            raise LabError("the lab is not set up (use it as a context manager)")
        module_args = [str(a) for a in module_args]
        if not module_args:
            raise LabError("give the module to run after --, e.g. -- dataparallel train "
                           "--method ddp")
        for bad, why in (("--out", "the lab passes --out itself: use the lab's --out"),
                         ("--ranks-per-node", ("nodes are real in the lab (hosts); use "
                                               "--ranks-per-host"))):
            if any(a == bad or a.startswith(bad + "=") for a in module_args[1:]):
                raise LabError(f"do not pass {bad} to the module: {why}")
        out = Path(out) if out is not None else default_out(module_args, self.hosts, self.rph)
        out = out.resolve()
        wire = out / WIRE_JSON
        if wire.exists() and not force:
            raise LabError(f"{wire} exists: pass --force to replace it, or another --out")
        out.mkdir(parents=True, exist_ok=True)
        summary_path = out / "summary.json"
        old = _stat_key(summary_path)
        extra = []
        if old is not None:
            if not force:
                raise LabError(f"{out} already holds a run ({summary_path.name}): pass --force "
                               "(the lab then passes --overwrite to the command) or another --out")
            if "--overwrite" not in module_args:
                extra = ["--overwrite"]
        log = out / LOG_NAME
        if log.exists() and force:
            log.unlink()
        base = self.baseline(launch, log)
        job = self._job([*module_args, "--out", str(out), *extra], launch, log)
        if _stat_key(summary_path) in (None, old):
            raise LabError(f"the job did not write a new {summary_path}: is {module_args[0]} a "
                           "spardist command that takes --out?")
        summary = json.loads(summary_path.read_text())
        result = wire_report(self, summary, job, base, launch, module_args, out)
        write_json(wire, result, force)
        return result



def _tail(path: Path, n: int = 40) -> str:
    with contextlib.suppress(OSError):
        lines = Path(path).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])
    return ""


def _stat_key(path: Path):
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def write_json(path: Path, obj: dict, force: bool) -> None:
    """Write JSON atomically (temp file + fsync + rename); without ``force`` never replace an
    existing file (``link`` fails if the target appeared meanwhile)."""
    data = json.dumps(obj, indent=2).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise LabError(f"{path} appeared during the run; not replaced (--force)") \
                    from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def default_out(module_args, hosts: int, rph: int) -> Path:
    """``results/wirelab/<module>[_<method>]_<H>x<R>``."""
    label = module_args[0].replace(".", "_")
    args = list(module_args[1:])
    if "--method" in args and args.index("--method") + 1 < len(args):
        label += "_" + args[args.index("--method") + 1]
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
    return ROOT / "results" / "wirelab" / f"{label}_{hosts}x{rph}"

