"""Namespaces on this machine: the preflight, the bookkeeping of what a lab created, and the
removal of labs whose owner died.

Every network namespace a lab creates is named ``spwl-<id>-...`` (:data:`PREFIX`); its owner
records ``{pid, start, tmpdir, namespaces}`` in ``/run/spardist-wirelab/<id>.json``
(:data:`STATE_DIR`) before creating anything, so :func:`cleanup_stale` can remove the
namespaces, ``/etc/netns`` entries and temp dir of a lab whose process was killed (the next lab
calls it).  Signals arriving while a lab is up become :class:`LabInterrupted`
(:class:`Signals`) so that the lab always tears down.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = [
    "CMD_TIMEOUT",
    "NETNS_ETC",
    "PREFIX",
    "ROOT",
    "STATE_DIR",
    "LabError",
    "LabInterrupted",
    "Signals",
    "check_prerequisites",
    "check_root",
    "cleanup_stale",
    "destroy",
    "find_hydra",
    "lab_namespaces",
    "netns_pids",
    "run",
    "stale_labs",
    "venv_python",
]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "spwl-"                      # every namespace a lab creates starts with it
#: state files of running labs; the name predates the ``lab`` package and is kept so that labs
#: left behind by older versions are still found and removed
STATE_DIR = Path("/run/spardist-wirelab")
TMP_PREFIX = "spardist-wirelab-"      # a lab's temp dir (the shim, logs of internal runs)
NETNS_ETC = Path("/etc/netns")
CMD_TIMEOUT = 30.0                    # every set-up / teardown command


class LabError(RuntimeError):
    """The lab cannot run (the message names why and the fix)."""


class LabInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM/SIGHUP arrived; everything is torn down before it propagates."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"lab: interrupted by {signal.Signals(signum).name}")


# -- preflight -------------------------------------------------------------------------------------

def check_root(euid: int | None = None) -> None:
    """Raise :class:`LabError` unless running as root (``euid`` for tests)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise LabError(
            "the wire lab must run as root: it creates network and UTS namespaces, veth "
            "pairs and a bridge, and writes /etc/netns (needs CAP_NET_ADMIN and CAP_SYS_ADMIN); "
            f"this process has euid {euid}. Fix: run it as root, e.g. "
            f"sudo {shlex.quote(sys.executable)} -m lab ... (or inside a container "
            "started with --privileged / --cap-add NET_ADMIN,SYS_ADMIN)")


def venv_python() -> str:
    """The project's ``.venv`` Python (what the lab's MPI jobs run), else this one."""
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def find_hydra(python: str | None = None) -> str:
    """The hydra ``mpiexec`` next to ``python`` (the mpich wheel's), checked with ``--version``."""
    python = python or venv_python()
    cand = Path(python).parent / "mpiexec"
    if not cand.exists():
        raise LabError(f"no mpiexec next to {python}: the wire lab needs MPICH's hydra mpiexec "
                       "(./run_mpi.sh installs the mpich wheel into .venv)")
    try:
        out = subprocess.run([str(cand), "--version"], check=False, capture_output=True,
                             text=True, timeout=CMD_TIMEOUT).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{cand} --version failed: {exc}") from exc
    if "hydra" not in out.lower():
        raise LabError(f"{cand} is not MPICH's hydra mpiexec (the wire lab drives hydra's "
                       "-launcher-exec); install the mpich wheel: ./run_mpi.sh")
    return str(cand)


def check_prerequisites(euid: int | None = None) -> dict:
    """Root, ``ip``/``tc``/``unshare``/``hostname`` present, and a network namespace can be
    created.  Returns the tool paths; raises :class:`LabError` naming the fix otherwise."""
    check_root(euid)
    tools = {}
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"),
                      ("hostname", "hostname")):
        path = shutil.which(tool)
        if path is None:
            raise LabError(f"the wire lab needs '{tool}' on PATH (Debian/Ubuntu: apt-get install "
                           f"{pkg})")
        tools[tool] = path
    probe = f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(2)}"
    res = run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        raise LabError(
            f"cannot create a network namespace ('ip netns add' failed: "
            f"{(res.stderr or res.stdout).strip()}); the wire lab needs a kernel with network "
            "namespaces and CAP_SYS_ADMIN (a container needs --privileged or "
            "--cap-add SYS_ADMIN,NET_ADMIN)")
    run(["ip", "netns", "del", probe], check=False)
    return tools


# -- commands and processes ------------------------------------------------------------------------

def run(cmd, *, check: bool = True, timeout: float = CMD_TIMEOUT, input: str | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (captured, text) under ``timeout``; :class:`LabError` on a timeout, a missing
    program or (with ``check``) a non-zero exit, naming the command and its output."""
    try:
        res = subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True,
                             timeout=timeout, input=input, env=env)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{shlex.join(map(str, cmd))} timed out after {timeout:g} s") from exc
    except FileNotFoundError as exc:
        raise LabError(f"{cmd[0]}: not found") from exc
    if check and res.returncode != 0:
        raise LabError(f"{shlex.join(map(str, cmd))} failed ({res.returncode}): "
                       f"{(res.stderr or res.stdout).strip()}")
    return res


def proc_start(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def autogroup_nice(pid: int, nice: int) -> bool:
    """Set the niceness of the scheduler autogroup of ``pid`` (its setsid group).  With
    ``kernel.sched_autogroup_enabled`` (this box), CFS shares the cores between autogroups
    first, so a process's own nice value only orders it within its autogroup: the job runs in
    a new setsid group (``start_new_session``), whose autogroup gets ``nice``.  Returns whether it applied."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(int(nice)))
    except OSError:
        return False
    return True


def kill_pids(pids, sig=signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``pids`` (never to this process)."""
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# -- namespaces ------------------------------------------------------------------------------------

def netns_list() -> list[str]:
    """Every named network namespace (``ip netns list``)."""
    res = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    """The processes in network namespace ``ns``."""
    res = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def lab_namespaces() -> list[str]:
    """Every network namespace a wire lab created that still exists (any run)."""
    return [n for n in netns_list() if n.startswith(PREFIX)]


def destroy(names: list[str]) -> list[str]:
    """Kill the processes in the namespaces ``names``, delete the namespaces and their
    ``/etc/netns`` entries.  Returns what could not be removed."""
    problems = []
    for ns in names:
        if ns in netns_list():
            for attempt in range(20):
                pids = netns_pids(ns)
                if not pids:
                    break
                kill_pids(pids, signal.SIGTERM if attempt == 0 else signal.SIGKILL)
                time.sleep(0.1 if attempt == 0 else 0.25)
            else:
                problems.append(f"processes {netns_pids(ns)} still in {ns}")
            res = run(["ip", "netns", "del", ns], check=False)
            if res.returncode != 0 and ns in netns_list():
                problems.append(f"ip netns del {ns}: {res.stderr.strip()}")
        etc = NETNS_ETC / ns
        if etc.exists():
            shutil.rmtree(etc, ignore_errors=True)
            if etc.exists():
                problems.append(f"could not remove {etc}")
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()            # only if empty (another lab or user may have entries)
    return problems


def stale_labs() -> list[str]:
    """Ids of labs whose owning process is gone (their state file or namespaces remain)."""
    ids = set()
    if STATE_DIR.is_dir():
        for f in STATE_DIR.glob("*.json"):
            try:
                st = json.loads(f.read_text())
            except (OSError, ValueError):
                ids.add(f.stem)
                continue
            if proc_start(int(st.get("pid", -1))) != st.get("start"):
                ids.add(f.stem)
    live = {f.stem for f in STATE_DIR.glob("*.json")} - ids if STATE_DIR.is_dir() else set()
    for ns in lab_namespaces():
        lab_id = ns[len(PREFIX):].rsplit("-", 1)[0]
        if lab_id.startswith("probe-"):       # check_prerequisites' probe of a killed process
            pid = lab_id.split("-")[1]
            if pid.isdigit() and proc_start(int(pid)) is None:
                ids.add(lab_id)
        elif lab_id not in live:
            ids.add(lab_id)
    return sorted(ids)


def cleanup_stale() -> list[str]:
    """Remove the labs of dead processes (namespaces, /etc/netns entries, temp dirs, state).
    Returns their ids."""
    removed = []
    for lab_id in stale_labs():
        state = STATE_DIR / f"{lab_id}.json"
        tmp = None
        with contextlib.suppress(OSError, ValueError):
            tmp = json.loads(state.read_text()).get("tmpdir")
        destroy([n for n in lab_namespaces() if n.startswith(f"{PREFIX}{lab_id}-")])
        for d in NETNS_ETC.glob(f"{PREFIX}{lab_id}-*") if NETNS_ETC.is_dir() else []:
            shutil.rmtree(d, ignore_errors=True)
        if tmp and Path(tmp).name.startswith(TMP_PREFIX):
            shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            state.unlink()
        removed.append(lab_id)
    with contextlib.suppress(OSError):
        STATE_DIR.rmdir()
    return removed


# -- signals ---------------------------------------------------------------------------------------

class Signals:
    """Turn SIGINT/SIGTERM/SIGHUP into :class:`LabInterrupted` while the lab is up (main thread
    only), and hold them off during teardown."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.old = {}
        self.active = threading.current_thread() is threading.main_thread()
        self.pending = None

    def _raise(self, signum, frame):
        raise LabInterrupted(signum)

    def _defer(self, signum, frame):
        self.pending = signum

    def install(self) -> None:
        if self.active:
            for s in self.SIGNALS:
                self.old[s] = signal.signal(s, self._raise)

    def hold(self) -> None:
        if self.active:
            for s in self.SIGNALS:
                self.old.setdefault(s, signal.getsignal(s))
                signal.signal(s, self._defer)

    def restore(self) -> None:
        if self.active:
            for s, h in self.old.items():
                signal.signal(s, h)
            self.old = {}
