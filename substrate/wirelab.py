"""The wire lab: run a spardist job across emulated hosts and count the bytes on the links.

``python -m substrate.wirelab --hosts H --ranks-per-host R [--link MBIT,LATENCY_US] [--out DIR]
[--launch mpiexec|run_mpi] -- MODULE ARGS...``

runs ``python -m mpi4py -m MODULE ARGS --out DIR`` on ``H x R`` ranks spread over ``H`` emulated
hosts on this machine, reads how many bytes each host really sent to the other hosts from the
interface counters, subtracts a start-up baseline (an empty MPI run of the same shape), and writes
``DIR/wire.json`` next to the run's ``summary.json``: booked (the ledger's
``traffic.measured.inter_node_bytes``), predicted, real bytes and the ratios.  Root only.

How the hosts are emulated (nothing is added to the root network namespace):

* one *switch* namespace ``spwl-<id>-sw`` holds a bridge ``br0`` and one veth port ``p<i>`` per
  host; the other end of each veth pair is ``eth0`` inside the *host* namespace
  ``spwl-<id>-h<i>`` with address ``10.251.0.<i+1>/24`` (private, only inside these namespaces),
  ``lo`` up, IPv6 off, static neighbour entries (no ARP on the links) and
  ``/etc/netns/spwl-<id>-h<i>/hosts`` naming ``h0 .. h<H-1>`` (``ip netns exec`` bind-mounts it
  over ``/etc/hosts``);
* every process of host ``i`` also runs in its own UTS namespace with hostname ``h<i>``, so
  MPICH's hydra sees ``H`` distinct hosts and ``MPI_Comm_split_type(SHARED)`` groups the ranks by
  host: the nodes of the run are real (no ``--ranks-per-node``);
* ``mpiexec`` (hydra, from the environment of this Python) runs inside host 0 with
  ``-launcher ssh -launcher-exec SHIM -hosts h0,..,h<H-1> -ppn R``.  SHIM is a generated shell
  script: hydra calls it like ``ssh`` (``SHIM -x h1 "proxy command"``); it enters ``h1``'s network
  namespace (``ip netns exec``) and a fresh UTS namespace (``unshare --uts`` + ``hostname h1``)
  and runs the proxy there.  Host 0's proxy is forked by mpiexec itself (hydra sees ``h0`` is
  local);
* ``MPIR_CVAR_CH4_NETMOD=ucx`` with ``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES=eth0`` (or
  ``--netmod ofi``: ``FI_PROVIDER=tcp``, ``FI_TCP_IFACE=eth0``): the namespaces share one kernel,
  so UCX would otherwise move inter-host messages through shared memory / CMA.  Ranks of the same
  host still use MPICH's shared memory, as on a real node.

What is counted: for each host, ``tx_bytes``/``tx_packets`` of its ``eth0`` (everything it put on
its link: with a bridge and static neighbours that is traffic to the other hosts) before and after
the run, plus TCP ``RetransSegs`` of its namespace.  Segmentation offload (TSO/GSO) is switched
off on every veth end with the ``SIOCETHTOOL`` ioctl (no ``ethtool`` binary needed), so the
counters see MTU-sized frames; GRO is switched *on*, which puts veth into its NAPI mode and keeps
each flow in order (without it, a sender migrating between CPUs reorders frames and TCP sends
spurious fast retransmits).  The TCP payload estimate is ``bytes - packets x header``, which does
not depend on segmentation; ``header`` is calibrated at set-up with a plain TCP transfer of known
size between h0 and h1 (52 bytes = 20 IPv4 + 32 TCP with timestamps when veth counts from the IP
header, as in NAPI mode; 66 with the 14-byte Ethernet header).  Segments that crossed a link
twice (D-SACKed spurious retransmissions; every retransmission with ``--offload on``), if any,
are subtracted at one MSS each and reported.  Every veth end gets a ``pfifo`` (or the ``--link``
shaper) so a full peer ring means backpressure, not drops, and tail-loss probes are off in the
host namespaces (``tcp_early_retrans=0``: on links that cannot drop they only duplicate data).

``--link MBIT,LATENCY_US`` shapes every link, both directions (host ``eth0`` egress and switch
port egress), with ``netem rate .. delay ..`` where the kernel has ``sch_netem``, else with
``tbf`` (rate only; the delay is then recorded as not applied).  The shaping is in ``wire.json``.

Everything the lab creates (namespaces, veths, bridge, ``/etc/netns`` entries, the temp dir with
the shim, the processes in the namespaces) is removed on exit, failure, timeout, ``SIGINT`` and
``SIGTERM``; labs left behind by a killed process are removed by the next lab (state files in
``/run/spardist-wirelab``).  Every subprocess runs under a timeout (``--timeout``).

Step time (issue 12): ``--calibrate-cost`` measures alpha once with an MPI ping-pong on the lab
(:meth:`Lab.ping_pong`, ``pingpong.json``) and passes the cost model to the command (beta from
the ``--link`` rate as TCP payload, :func:`link_payload_gbps`); ``--compare-steps`` reads the
run's per-step wall time (``step_wall_s`` in ``metrics.jsonl``) against its predicted step time
(:func:`compare_steps`, ``steps.json``); ``python -m substrate.wirelab --compare-steps OUT`` does
the same offline.  :func:`per_step_from_pair` gets the time per step from two runs that differ
only in their step count.  :func:`compare_systems` does it for several commands, link rates and
shapes at once (``bench/bench_wirelab.py``, table by :func:`format_comparison`).

Timing on a shared box: ``--nice N`` runs the MPI job at niceness ``N`` *and* gives every
process in the host namespaces the autogroup niceness ``N`` (with
``kernel.sched_autogroup_enabled`` CFS shares the cores between sessions first, and hydra starts
every proxy and rank in a session of its own, so a plain ``nice`` would not order them against
the box's other jobs); ``--yield`` (:data:`YIELD_ENV`) makes ranks waiting in MPI sleep instead
of spinning, for more ranks than cores.

Python API: :func:`run_lab` (one measurement), :class:`Lab` (set up once, measure many runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .results import atomic_write_json

__all__ = ["LabError", "Lab", "run_lab", "check_root", "check_prerequisites", "main",
           "parse_link", "stale_labs", "cleanup_stale", "lab_namespaces", "PREFIX",
           "compare_steps", "format_steps", "per_step_from_pair", "link_payload_gbps",
           "cost_flags", "PINGPONG_JSON", "YIELD_ENV", "compare_systems", "format_comparison"]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "spwl-"                      # every namespace this module creates starts with it
STATE_DIR = Path("/run/spardist-wirelab")
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.251.0"                   # host i: 10.251.0.<i+1>/24, only inside the lab namespaces
HOST_IF = "eth0"
MTU = 1500
ETH_HDR, IP_HDR, TCP_HDR = 14, 20, 32  # TCP with the timestamp option
DEFAULT_TIMEOUT = 300.0
CMD_TIMEOUT = 30.0                    # every set-up / teardown command
CALIBRATION_BYTES = 4 << 20
#: Per host namespace.  Tail-loss probes off: the links never drop (every veth end has a queue),
#: so a probe is always a spurious duplicate of the last segment (seen on a loaded box as
#: TCPLossProbes + D-SACKs without it).  No congestion-window restart after idle (RFC 2861,
#: Linux default on): a ring step sends one chunk after waiting for its neighbour, so every
#: chunk restarted from 10 segments and waited for ACKs queued behind the reverse direction's
#: data; a 2 x 2 ddp step on a 10 Mbit/s link took 1.19 s against 0.26 s without the restart
#: (the alpha-beta model of the interconnects spardist models, RDMA, has no such window).
HOST_SYSCTLS = ("net.ipv4.tcp_early_retrans=0", "net.ipv4.tcp_slow_start_after_idle=0")
#: MPICH (ch4) environment that makes a waiting rank sleep 1 us after this many progress polls
#: without progress instead of spinning: with more ranks than cores (2 x 2 on 2 vCPUs), a rank
#: busy-polling for its neighbour's data otherwise holds the core the neighbour needs to send it.
YIELD_ENV = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
             "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "64"}
#: tbf bucket, in seconds of the rate: a link idle for longer sends this much at once.  Short:
#: with 4 ms (the old ``rate / 250``) an H-SADMM iteration's 145 kB all-reduce after 6 ms of
#: compute took 9 ms on a 100 Mbit/s link instead of the 12.1 ms its size takes at the rate
#: (50 kB went at once), and at 1 Gbit/s every idle gap was worth 0.5 MB.
TBF_BURST_S = 1e-3
QUEUE_PACKETS = 10000                 # pfifo limit on every veth end (backpressure, no drops)
WIRE_JSON = "wire.json"
PINGPONG_JSON = "pingpong.json"
STEPS_JSON = "steps.json"
#: TcpExt counters recorded beside RetransSegs (why segments were sent twice)
TCPEXT_FIELDS = ("TCPLossProbes", "TCPFastRetrans", "TCPSlowStartRetrans", "TCPTimeouts",
                 "TCPSpuriousRTOs", "TCPDSACKRecv", "TCPDSACKRecvSegs", "TCPSACKReorder",
                 "TCPTSReorder", "TCPRenoReorder", "TCPBacklogDrop", "TCPRcvQDrop",
                 "TCPOFOQueue", "TCPOFODrop")


class LabError(RuntimeError):
    """The lab cannot run (the message names why and the fix)."""


class LabInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM/SIGHUP arrived; everything is torn down before it propagates."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"wirelab: interrupted by {signal.Signals(signum).name}")


# -- preflight -------------------------------------------------------------------------------------

def check_root(euid: int | None = None) -> None:
    """Raise :class:`LabError` unless running as root (``euid`` for tests)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise LabError(
            "substrate.wirelab must run as root: it creates network and UTS namespaces, veth "
            "pairs and a bridge, and writes /etc/netns (needs CAP_NET_ADMIN and CAP_SYS_ADMIN); "
            f"this process has euid {euid}. Fix: run it as root, e.g. "
            f"sudo {shlex.quote(sys.executable)} -m substrate.wirelab ... (or inside a container "
            "started with --privileged / --cap-add NET_ADMIN,SYS_ADMIN)")


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def find_hydra(python: str | None = None) -> str:
    """The hydra ``mpiexec`` next to ``python`` (the mpich wheel's), checked with ``--version``."""
    python = python or _python()
    cand = Path(python).parent / "mpiexec"
    if not cand.exists():
        raise LabError(f"no mpiexec next to {python}: the wire lab needs MPICH's hydra mpiexec "
                       "(./run_mpi.sh installs the mpich wheel into .venv)")
    try:
        out = subprocess.run([str(cand), "--version"], capture_output=True, text=True,
                             timeout=CMD_TIMEOUT).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{cand} --version failed: {exc}") from exc
    if "hydra" not in out.lower():
        raise LabError(f"{cand} is not MPICH's hydra mpiexec (the wire lab drives hydra's "
                       "-launcher-exec); install the mpich wheel: ./run_mpi.sh")
    return str(cand)


def check_prerequisites(euid: int | None = None) -> dict:
    """Root, ``ip``/``unshare``/``hostname`` present, and a network namespace can be created.

    Returns the tool paths; raises :class:`LabError` naming the fix otherwise.
    """
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
    res = _run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        raise LabError(
            f"cannot create a network namespace ('ip netns add' failed: "
            f"{(res.stderr or res.stdout).strip()}); the wire lab needs a kernel with network "
            "namespaces and CAP_SYS_ADMIN (a container needs --privileged or "
            "--cap-add SYS_ADMIN,NET_ADMIN)")
    _run(["ip", "netns", "del", probe], check=False)
    return tools


def parse_link(text: str | None) -> tuple[float, float] | None:
    """``"MBIT,LATENCY_US"`` -> ``(mbit, latency_us)``; ``None`` passes through."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        mbit, lat = float(parts[0]), float(parts[1])
    except ValueError:
        raise LabError(f"--link {text!r} is malformed: write MBIT,LATENCY_US, e.g. "
                       "--link 1000,50") from None
    if not mbit > 0 or lat < 0:
        raise LabError(f"--link {text!r}: the rate must be > 0 Mbit/s and the latency >= 0 us")
    return mbit, lat


# -- small helpers ---------------------------------------------------------------------------------

def _run(cmd, *, check: bool = True, timeout: float = CMD_TIMEOUT, input: str | None = None,
         env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                             timeout=timeout, input=input, env=env)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{shlex.join(map(str, cmd))} timed out after {timeout:g} s") from exc
    except FileNotFoundError as exc:
        raise LabError(f"{cmd[0]}: not found") from exc
    if check and res.returncode != 0:
        raise LabError(f"{shlex.join(map(str, cmd))} failed ({res.returncode}): "
                       f"{(res.stderr or res.stdout).strip()}")
    return res


def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _autogroup_nice(pid: int, nice: int) -> bool:
    """Set the niceness of the scheduler autogroup of ``pid`` (its session).  With
    ``kernel.sched_autogroup_enabled`` (this box), CFS shares the cores between sessions first,
    so a process's own nice value only orders it within its session: the job runs in a new
    session (``start_new_session``), whose group gets ``nice``.  Returns whether it applied."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(int(nice)))
    except OSError:
        return False
    return True


def _netns_list() -> list[str]:
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    res = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def lab_namespaces() -> list[str]:
    """Every network namespace a wire lab created that still exists (any run)."""
    return [n for n in _netns_list() if n.startswith(PREFIX)]


def _kill_pids(pids, sig=signal.SIGKILL) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _destroy(lab_id: str, names: list[str]) -> list[str]:
    """Kill the processes in the namespaces ``names`` (all created by lab ``lab_id``), delete the
    namespaces and their ``/etc/netns`` entries.  Returns what could not be removed."""
    problems = []
    for ns in names:
        if ns in _netns_list():
            for attempt in range(20):
                pids = _netns_pids(ns)
                if not pids:
                    break
                _kill_pids(pids, signal.SIGTERM if attempt == 0 else signal.SIGKILL)
                time.sleep(0.1 if attempt == 0 else 0.25)
            else:
                problems.append(f"processes {_netns_pids(ns)} still in {ns}")
            res = _run(["ip", "netns", "del", ns], check=False)
            if res.returncode != 0 and ns in _netns_list():
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
            if _proc_start(int(st.get("pid", -1))) != st.get("start"):
                ids.add(f.stem)
    live = {f.stem for f in STATE_DIR.glob("*.json")} - ids if STATE_DIR.is_dir() else set()
    for ns in lab_namespaces():
        lab_id = ns[len(PREFIX):].rsplit("-", 1)[0]
        if lab_id.startswith("probe-"):       # check_prerequisites' probe of a killed process
            pid = lab_id.split("-")[1]
            if pid.isdigit() and _proc_start(int(pid)) is None:
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
        names = [n for n in lab_namespaces() if n.startswith(f"{PREFIX}{lab_id}-")]
        _destroy(lab_id, names)
        for d in NETNS_ETC.glob(f"{PREFIX}{lab_id}-*") if NETNS_ETC.is_dir() else []:
            shutil.rmtree(d, ignore_errors=True)
        if tmp and Path(tmp).name.startswith("spardist-wirelab-"):
            shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            state.unlink()
        removed.append(lab_id)
    with contextlib.suppress(OSError):
        STATE_DIR.rmdir()
    return removed


# -- ethtool without ethtool -----------------------------------------------------------------------

_ETHTOOL = {"tso": (0x1E, 0x1F), "gso": (0x23, 0x24), "gro": (0x2B, 0x2C)}

#: Run inside a namespace: ``python -c _ETHTOOL_SCRIPT dev feature=0|1 ...``; prints the features
#: read back as JSON.  SIOCETHTOOL with the legacy ETHTOOL_[GS]{TSO,GSO,GRO} commands.
_ETHTOOL_SCRIPT = r"""
import ctypes, fcntl, json, socket, struct, sys
CMD = %r
def ethtool(dev, cmd, data=0):
    buf = ctypes.create_string_buffer(struct.pack("II", cmd, data), 8)
    ifr = struct.pack("16sP", dev.encode(), ctypes.addressof(buf)) + bytes(16)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), 0x8946, ifr)
    return struct.unpack("II", buf.raw[:8])[1]
out = {}
for dev in sys.argv[1].split(","):
    for kv in sys.argv[2:]:
        k, v = kv.split("=")
        ethtool(dev, CMD[k][1], int(v))
    out[dev] = {k: ethtool(dev, g) for k, (g, s) in CMD.items()}
print(json.dumps(out))
""" % (_ETHTOOL,)


# -- the MPI side: idle module and a Send/Recv calibration ----------------------------------------

def _idle_main(argv: list[str]) -> int:
    """MPI init + the same topology set-up as every spardist command, then exit (the start-up
    baseline).  With ``--out DIR`` rank 0 also writes a summary.json booking nothing (a null
    measurement: the lab's noise floor)."""
    from mpi4py import MPI  # noqa: PLC0415

    from substrate.topology import Topology  # noqa: PLC0415

    topo = Topology.from_comm(MPI.COMM_WORLD)
    if "--sleep" in argv and topo.rank == 0:
        time.sleep(float(argv[argv.index("--sleep") + 1]))
    if "--out" in argv and topo.rank == 0:
        _write_summary(Path(argv[argv.index("--out") + 1]), "idle", topo, 0)
    return 0


def _write_summary(out: Path, method: str, topo, inter: int) -> None:

    traffic = {"inter_node_bytes": inter, "intra_node_bytes": 0, "by_phase": {}}
    atomic_write_json(out / "summary.json", {
        "system": "wirelab", "method": method, "topology": topo.describe(),
        "traffic": {"measured": traffic, "predicted": dict(traffic)}})


def _sendrecv_main(argv: list[str]) -> int:
    """``--sendrecv NBYTES --out DIR``: every rank sends NBYTES to the rank with the same local
    index on the next host (``Sendrecv``), and rank 0 writes a summary.json booking them."""
    from mpi4py import MPI  # noqa: PLC0415

    from substrate.topology import Topology  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="substrate.wirelab --sendrecv")
    p.add_argument("--sendrecv", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--overwrite", action="store_true", help="accepted like spardist commands")
    a = p.parse_args(argv)
    topo = Topology.from_comm(MPI.COMM_WORLD)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    node_of = topo.node_of
    m = topo.num_nodes
    members = [np.flatnonzero(node_of == k) for k in range(m)]
    dest = int(members[(topo.node + 1) % m][topo.local_rank])
    src = int(members[(topo.node - 1) % m][topo.local_rank])
    buf = np.full(a.sendrecv, rank % 251, dtype=np.uint8)
    got = np.empty_like(buf)
    world.Barrier()
    for _ in range(a.repeat):
        world.Sendrecv(buf, dest, 11, got, src, 11)
    inter = a.sendrecv * a.repeat if node_of[dest] != node_of[rank] else 0
    total = world.allreduce(inter)
    if rank == 0:
        _write_summary(a.out, "sendrecv", topo, total)
    return 0


def _pingpong_main(argv: list[str]) -> int:
    """``--pingpong --out DIR [--reps N] [--sizes 8,1048576]``: world rank 0 ping-pongs messages
    of each size with the first rank of the next node (inter-node) and, when its node has
    another rank, with that rank (intra-node); every round trip is timed and rank 0 writes
    ``DIR/pingpong.json`` with the median one-way time ``RTT / 2`` per size and link class.

    ``alpha`` is the one-way time of the smallest size; ``beta`` (seconds per byte) is the
    slope between the smallest and the largest size.  Each size is timed for at most
    ``--budget-s`` seconds (at least 5 round trips), so large messages on slow links end in
    time.  The other ranks wait without spinning."""
    from mpi4py import MPI  # noqa: PLC0415

    from substrate.topology import Topology  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="substrate.wirelab --pingpong")
    p.add_argument("--pingpong", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sizes", default="8,1048576")
    p.add_argument("--budget-s", type=float, default=3.0,
                   help="stop timing a size after this many seconds (at least 5 round trips)")
    p.add_argument("--overwrite", action="store_true", help="accepted like spardist commands")
    a = p.parse_args(argv)
    sizes = sorted({int(x) for x in a.sizes.split(",")})
    if len(sizes) < 1 or sizes[0] < 1 or a.reps < 1:
        raise SystemExit("--sizes needs positive byte counts and --reps >= 1")
    topo = Topology.from_comm(MPI.COMM_WORLD)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    node_of = np.asarray(topo.node_of)
    peers = {}
    others = np.flatnonzero(node_of != node_of[0])
    if others.size:
        peers["inter"] = int(others[0])
    same = np.flatnonzero((node_of == node_of[0]) & (np.arange(node_of.size) != 0))
    if same.size:
        peers["intra"] = int(same[0])
    def quiet_barrier() -> None:
        # ranks outside the pair wait without spinning: on oversubscribed cores a rank busy-polling
        # in MPI_Barrier steals the CPU the timed pair needs
        req = world.Ibarrier()
        while not req.Test():
            time.sleep(0.002)

    result = {}
    for link, peer in peers.items():
        quiet_barrier()
        if rank not in (0, peer):
            continue
        other = peer if rank == 0 else 0
        per_size = {}
        for n in sizes:
            buf = np.zeros(n, dtype=np.uint8)
            times = []
            start = MPI.Wtime()
            for i in range(a.warmup + a.reps):
                # both ends stop together: rank 0 decides and tells its partner in the ping
                stop = rank == 0 and len(times) >= 5 and MPI.Wtime() - start > a.budget_s
                if rank == 0:
                    buf[:1] = 1 if stop else 0
                t0 = MPI.Wtime()
                if rank == 0:
                    world.Send(buf, other, 21)
                    world.Recv(buf, other, 21)
                else:
                    world.Recv(buf, other, 21)
                    world.Send(buf, other, 21)
                if buf[0]:
                    break                           # the stop round trip is not timed
                if i >= a.warmup or n > 65536:      # big messages: no separate warm-up
                    times.append(MPI.Wtime() - t0)
            one_way = np.asarray(times) / 2
            per_size[str(n)] = {"round_trips": len(times), "median_s": float(np.median(one_way)),
                                "p10_s": float(np.percentile(one_way, 10)),
                                "p90_s": float(np.percentile(one_way, 90))}
        lo, hi = str(sizes[0]), str(sizes[-1])
        alpha = per_size[lo]["median_s"]
        beta = ((per_size[hi]["median_s"] - alpha) / (sizes[-1] - sizes[0])
                if len(sizes) > 1 else None)
        result[link] = {"peer": peer, "sizes": per_size, "alpha_s": alpha, "beta_s_per_byte": beta,
                        "bandwidth_gbps": (8e-9 / beta) if beta and beta > 0 else None}
    quiet_barrier()
    if rank == 0:
        atomic_write_json(a.out / PINGPONG_JSON, {
            "method": "MPI Send/Recv ping-pong, one-way = RTT/2, median over reps",
            "reps": a.reps, "warmup": a.warmup, "sizes": sizes,
            "topology": topo.describe(), "links": result})
    return 0


def link_payload_gbps(mbit: float) -> float:
    """TCP payload rate (Gbit/s) of a link shaped to ``mbit`` Mbit/s: the shaper counts whole
    frames, so each full segment of MSS 1448 bytes costs 1448 + 32 (TCP with timestamps) + 20 (IP)
    + 14 (Ethernet) = 1514 bytes of rate.  Derived from the setting, not fitted."""
    mss = MTU - IP_HDR - TCP_HDR
    return mbit * 1e-3 * mss / (MTU + ETH_HDR)


def cost_flags(link, pingpong: dict | None) -> list[str]:
    """Cost-model flags for a run on the lab: ``--inter-bw`` from the ``--link`` rate
    (:func:`link_payload_gbps`), ``--inter-lat`` / ``--intra-lat`` (and ``--intra-bw``) from
    the ping-pong (``pingpong.json`` content), when given."""
    flags = []
    if link is not None:
        flags += ["--inter-bw", f"{link_payload_gbps(float(link[0])):.9g}"]
    links = (pingpong or {}).get("links", {})
    if "inter" in links:
        flags += ["--inter-lat", f"{links['inter']['alpha_s'] * 1e6:.6g}"]
        if link is None and links["inter"].get("bandwidth_gbps"):
            flags += ["--inter-bw", f"{links['inter']['bandwidth_gbps']:.6g}"]
    if "intra" in links:
        flags += ["--intra-lat", f"{links['intra']['alpha_s'] * 1e6:.6g}"]
        if links["intra"].get("bandwidth_gbps"):
            flags += ["--intra-bw", f"{links['intra']['bandwidth_gbps']:.6g}"]
    return flags


# -- predicted vs measured step time ---------------------------------------------------------------

_STEP_KEYS = ("step", "iteration", "k", "epoch")


def _read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        raise LabError(f"{path} not found: --compare-steps needs a finished run's metrics.jsonl")
    lines = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise LabError(f"{path}:{i + 1} is not JSON ({exc})") from None
    return lines


def compare_steps(out, *, skip: int = 1) -> dict:
    """Predicted vs measured time per step from a run's ``metrics.jsonl``.

    Each line must carry ``step_wall_s`` (measured wall seconds per step over the steps since
    the previous line) and either ``step_sim_s`` (predicted seconds per step) or the cumulative
    ``sim_s`` with a step counter (``step`` / ``iteration`` / ``k``), from which the predicted
    time per step is the difference to the previous line over the steps between them; likewise
    ``step_no_overlap_s`` or cumulative ``no_overlap_s`` for the additive clock, when present.
    The first ``skip`` lines (warm-up) are left out of the medians.

    Returns ``{"rows": [...], "median_ratio": predicted / measured, ...}``.
    """
    lines = _read_metrics(out)
    rows = []
    prev = None
    for line in lines:
        key = next((k for k in _STEP_KEYS if k in line), None)
        if "step_wall_s" not in line:
            raise LabError(f"{Path(out) / 'metrics.jsonl'}: a line has no step_wall_s (keys: "
                           f"{sorted(line)}); the command must log the measured wall time per "
                           "step")
        k = line.get(key) if key else None
        dk = (k - prev.get(key, 0)) if (prev is not None and key) else k
        row = {"k": k, "measured_s": float(line["step_wall_s"])}
        for name, per_step, cum in (("predicted_s", "step_sim_s", "sim_s"),
                                    ("no_overlap_s", "step_no_overlap_s", "no_overlap_s")):
            if per_step in line:
                row[name] = float(line[per_step])
            elif cum in line and dk:
                row[name] = (line[cum] - (prev or {}).get(cum, 0.0)) / dk
        if "predicted_s" not in row:
            raise LabError(f"{Path(out) / 'metrics.jsonl'}: line {k} has neither step_sim_s nor "
                           "a cumulative sim_s with a step counter")
        row["ratio"] = row["predicted_s"] / row["measured_s"] if row["measured_s"] else None
        rows.append(row)
        prev = line

    used = [r for r in rows[skip:] if r["ratio"] is not None]
    if not used:
        raise LabError(f"{out}: no step left after skipping {skip} warm-up line(s); run more "
                       "steps or pass a smaller --skip")
    med = lambda xs: float(statistics.median(xs))  # noqa: E731
    res = {"out": str(out), "skip": skip, "rows": rows, "steps_compared": len(used),
           "median_measured_s": med([r["measured_s"] for r in used]),
           "median_predicted_s": med([r["predicted_s"] for r in used]),
           "median_ratio": med([r["ratio"] for r in used])}
    if all("no_overlap_s" in r for r in used):
        res["median_no_overlap_s"] = med([r["no_overlap_s"] for r in used])
        res["median_no_overlap_ratio"] = med([r["no_overlap_s"] / r["measured_s"] for r in used])
    summary = Path(out) / "summary.json"
    if summary.exists():
        sm = json.loads(summary.read_text())
        res["cost_model"] = sm.get("cost_model")
        res["timeline"] = sm.get("timeline")
    wire = Path(out) / WIRE_JSON
    if wire.exists():
        res["link"] = json.loads(wire.read_text()).get("link")
    return res


def format_steps(r: dict) -> str:
    lines = [f"per-step time, {r['out']} ({r['steps_compared']} lines compared, first "
             f"{r['skip']} skipped)",
             f"  {'k':>6s} {'measured s':>12s} {'predicted s':>12s} {'pred/meas':>10s} "
             f"{'no-overlap s':>13s}"]
    for row in r["rows"]:
        no = row.get("no_overlap_s")
        lines.append(f"  {row['k']!s:>6s} {row['measured_s']:12.5f} {row['predicted_s']:12.5f} "
                     f"{row['ratio']:10.3f} {'-' if no is None else f'{no:.5f}':>13s}")
    lines.append(f"  median: measured {r['median_measured_s']:.5f} s, predicted "
                 f"{r['median_predicted_s']:.5f} s, ratio {r['median_ratio']:.3f}")
    if "median_no_overlap_ratio" in r:
        lines.append(f"  additive (no overlap) median {r['median_no_overlap_s']:.5f} s, ratio "
                     f"{r['median_no_overlap_ratio']:.3f}")
    return "\n".join(lines)


def per_step_from_pair(short: dict, long: dict) -> dict:
    """Per-step time from two lab runs that differ only in their step count: measured
    ``(wall_long - wall_short) / Δsteps`` (set-up, evaluation at the end and teardown cancel)
    against predicted ``(sim_long - sim_short) / Δsteps``.  ``short``/``long`` are
    ``{"steps": N, "wire": wire.json dict, "summary": summary.json dict}``."""
    ds = long["steps"] - short["steps"]
    if ds <= 0:
        raise LabError("per_step_from_pair: the long run needs more steps than the short one")
    meas = (long["wire"]["wall_s"] - short["wire"]["wall_s"]) / ds
    t_s, t_l = short["summary"]["timing"], long["summary"]["timing"]
    out = {"steps": [short["steps"], long["steps"]], "measured_s": meas,
           "predicted_s": (t_l["sim_s"] - t_s["sim_s"]) / ds,
           "compute_s": (t_l["compute_s"] - t_s["compute_s"]) / ds,
           "comm_modeled_s": (t_l["comm_modeled_s"] - t_s["comm_modeled_s"]) / ds}
    if "no_overlap_s" in t_l and "no_overlap_s" in t_s:
        out["no_overlap_s"] = (t_l["no_overlap_s"] - t_s["no_overlap_s"]) / ds
    out["ratio"] = out["predicted_s"] / meas if meas > 0 else None
    return out


# -- predicted vs measured step time of several systems on shaped links ----------------------------

def _median(xs):
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def compare_systems(workloads: dict, *, shapes=((2, 1),), links=((100.0, 0.0),), repeat: int = 1,
                    out_root, nice: int | None = None, env: dict | None = None,
                    timeout: float = DEFAULT_TIMEOUT, launch: str = "mpiexec",
                    netmod: str = "ucx", verbose: bool = False, progress=None) -> dict:
    """Predicted vs measured time per step of several spardist commands on shaped links.

    For every ``(hosts, ranks_per_host)`` of ``shapes`` and every ``(mbit, latency_us)`` of
    ``links`` one :class:`Lab` is set up; its alpha is measured once (:meth:`Lab.ping_pong`) and
    every workload runs ``repeat`` times with the cost model of :func:`cost_flags` (beta from the
    link setting, alpha from the ping-pong: nothing fitted per run); :func:`compare_steps` reads
    each run's per-step ``step_wall_s`` against ``step_sim_s`` (and ``step_no_overlap_s``),
    skipping the workload's warm-up lines.

    ``workloads``: ``{name: {"args": [MODULE, ARGS...], "skip": warm-up lines}}``; a callable
    ``args(hosts, ranks_per_host)`` may stand for the list.  ``progress(text)`` is called after
    every run (e.g. ``print``).

    Returns ``{"labs": [...], "runs": [...], "rows": [...]}``: one ``runs`` entry per run (its
    medians over steps, the 1-minute load average before and after, or its error), one ``rows``
    entry per system x shape x link (medians over the repeats).
    """
    if not isinstance(repeat, int) or repeat < 1:
        raise LabError(f"repeat must be an integer >= 1, got {repeat!r}")
    if not workloads:
        raise LabError("compare_systems: give at least one workload")
    out_root = Path(out_root)
    labs, runs = [], []
    for hosts, rph in shapes:
        for link in links:
            mbit, lat = (float(link[0]), float(link[1]))
            with Lab(hosts, rph, link=(mbit, lat), netmod=netmod, timeout=timeout,
                     env={**(env or {})}, verbose=verbose, nice=nice) as lab:
                tag = f"{hosts}x{rph}_{mbit:g}mbit"
                pp = lab.ping_pong(launch=launch, out=out_root / f"pingpong_{tag}")
                flags = cost_flags(lab.link, pp)
                alpha = {k: v["alpha_s"] for k, v in pp["links"].items()}
                labs.append({"lab_id": lab.id, "hosts": hosts, "ranks_per_host": rph,
                             "link": lab.shaping,
                             "alpha_s": alpha, "cost_flags": flags,
                             "env": {k: v for k, v in lab.mpi_env().items()
                                     if k.startswith(("MPIR_CVAR_", "UCX_", "FI_"))},
                             "nice": nice, "loadavg": os.getloadavg()[0]})
                for rep in range(repeat):
                    for name, w in workloads.items():
                        args = w["args"](hosts, rph) if callable(w["args"]) else w["args"]
                        out = out_root / f"{name}_{tag}_r{rep}"
                        run = {"system": name, "hosts": hosts, "ranks_per_host": rph,
                               "mbit": mbit, "repeat": rep, "out": str(out),
                               "skip": int(w.get("skip", 1)), "alpha_s": alpha,
                               "load_before": os.getloadavg()[0]}
                        try:
                            wire = lab.measure([*args, *flags], out=out, launch=launch,
                                               force=True)
                            st = compare_steps(out, skip=run["skip"])
                            _write_no_clobber(out / STEPS_JSON, st, True)
                        except LabError as exc:
                            run["error"] = str(exc).splitlines()[0][:300]
                        else:
                            run.update(
                                wall_s=wire["wall_s"], steps_compared=st["steps_compared"],
                                predicted_s=st["median_predicted_s"],
                                measured_s=st["median_measured_s"], ratio=st["median_ratio"],
                                no_overlap_s=st.get("median_no_overlap_s"),
                                no_overlap_ratio=st.get("median_no_overlap_ratio"),
                                payload_vs_booked=wire["ratios"]["payload_vs_booked"],
                                cost_model=st.get("cost_model"))
                        run["load_after"] = os.getloadavg()[0]
                        runs.append(run)
                        if progress is not None:
                            progress(_format_run(run))
    rows = []
    for hosts, rph in shapes:
        for link in links:
            for name in workloads:
                rs = [r for r in runs if (r["system"], r["hosts"], r["ranks_per_host"],
                                          r["mbit"]) == (name, hosts, rph, float(link[0]))]
                ok = [r for r in rs if "error" not in r]
                rows.append({
                    "system": name, "hosts": hosts, "ranks_per_host": rph,
                    "mbit": float(link[0]), "alpha_s": rs[0]["alpha_s"] if rs else None,
                    "runs": len(ok), "errors": [r["error"] for r in rs if "error" in r],
                    **{k: _median([r.get(k) for r in ok]) for k in (
                        "predicted_s", "measured_s", "ratio", "no_overlap_s", "no_overlap_ratio",
                        "load_before",
                        "load_after")}})
    return {"labs": labs, "runs": runs, "rows": rows}


def _format_run(r: dict) -> str:
    head = (f"{r['system']} {r['hosts']}x{r['ranks_per_host']} {r['mbit']:g} Mbit/s "
            f"#{r['repeat']}: ")
    if "error" in r:
        return head + f"error: {r['error']}"
    return head + (f"predicted {r['predicted_s']:.4f} s/step, measured {r['measured_s']:.4f}, "
                   f"ratio {r['ratio']:.3f} ({r['steps_compared']} steps; load "
                   f"{r['load_before']:.1f} -> {r['load_after']:.1f})")


def format_comparison(res: dict) -> str:
    """The table of :func:`compare_systems`: one line per system x hosts x ranks x link."""
    f = lambda x, p=4: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [("| system | hosts x ranks | link | alpha inter / intra (us) | predicted s/step | "
              "measured s/step | predicted / measured | no-overlap s/step | "
              "no-overlap / measured | runs | load |"),
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        a = r["alpha_s"] or {}
        alpha = " / ".join(f"{a[k] * 1e6:.1f}" if k in a else "-" for k in ("inter", "intra"))
        load = f"{f(r['load_before'], 1)} -> {f(r['load_after'], 1)}"
        lines.append(f"| {r['system']} | {r['hosts']} x {r['ranks_per_host']} | "
                     f"{r['mbit']:g} Mbit/s | {alpha} | {f(r['predicted_s'])} | "
                     f"{f(r['measured_s'])} | {f(r['ratio'], 3)} | {f(r['no_overlap_s'])} | "
                     f"{f(r['no_overlap_ratio'], 3)} | {r['runs']} | {load} |")
        for e in r["errors"]:
            lines.append(f"|   error: {e} |")
    return "\n".join(lines)


# -- the lab ---------------------------------------------------------------------------------------

class _Signals:
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


class Lab:
    """``hosts`` emulated hosts on this machine (see the module docstring).

    Use as a context manager; :meth:`measure` runs one spardist command across the hosts and
    returns the ``wire.json`` dict.  The start-up baseline is measured once per launch style and
    reused.

    Parameters
    ----------
    hosts, ranks_per_host : int
    link : (mbit, latency_us) or str, optional
        Shape every link (see the module docstring).
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
    """

    def __init__(self, hosts: int, ranks_per_host: int, *, link=None, netmod: str = "ucx",
                 offload: bool = False, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None,
                 python: str | None = None, verbose: bool = False,
                 nice: int | None = None) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 2:
            raise LabError(f"--hosts must be an integer >= 2, got {hosts!r}")
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) \
                or ranks_per_host < 1:
            raise LabError(f"--ranks-per-host must be an integer >= 1, got {ranks_per_host!r}")
        if hosts > 250:
            raise LabError("--hosts must be <= 250 (one /24 subnet)")
        if netmod not in ("ucx", "ofi"):
            raise LabError(f"--netmod must be ucx or ofi, got {netmod!r}")
        if not timeout > 0:
            raise LabError(f"--timeout must be > 0, got {timeout!r}")
        if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int)
                                 or not -20 <= nice <= 19):
            raise LabError(f"--nice must be an integer in -20 .. 19, got {nice!r}")
        self.nice = nice
        self.hosts, self.rph = hosts, ranks_per_host
        self.link = parse_link(link) if isinstance(link, str) else (
            tuple(map(float, link)) if link is not None else None)
        if self.link is not None:
            parse_link(f"{self.link[0]},{self.link[1]}")
        self.netmod, self.offload, self.timeout = netmod, offload, float(timeout)
        self.extra_env = dict(env or {})
        self.python = python or _python()
        self.verbose = verbose
        self.id = f"{os.getpid():x}{secrets.token_hex(2)}"
        self.names = [f"{PREFIX}{self.id}-h{i}" for i in range(hosts)]
        self.switch = f"{PREFIX}{self.id}-sw"
        self.hostnames = [f"h{i}" for i in range(hosts)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.tmp: Path | None = None
        self.state: Path | None = None
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.signals = _Signals()
        self.up = False
        self.features: dict = {}
        self.shaping: dict | None = None
        self.calibration: dict | None = None
        self.baselines: dict = {}
        self.pingpong: dict | None = None
        self.teardown_problems: list[str] = []

    # -- life cycle ------------------------------------------------------------------------------
    def __enter__(self) -> "Lab":
        self.signals.install()
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"wirelab: {msg}", file=sys.stderr, flush=True)

    def setup(self) -> None:
        """Create the namespaces, links and shim (see the module docstring)."""
        check_prerequisites()
        self.mpiexec = find_hydra(self.python)
        cleanup_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="spardist-wirelab-"))
        self.state = STATE_DIR / f"{self.id}.json"
        self.state.write_text(json.dumps({
            "pid": os.getpid(), "start": _proc_start(os.getpid()), "tmpdir": str(self.tmp),
            "namespaces": [self.switch, *self.names]}))
        ip = ["ip"]
        # namespaces (switch first), recorded before anything is put in them
        for ns in (self.switch, *self.names):
            self.created.append(ns)
            _run([*ip, "netns", "add", ns])
        for ns in (self.switch, *self.names):
            for key in ("all", "default"):
                _run([*ip, "netns", "exec", ns, "sysctl", "-q", "-w",
                      f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
        for ns in self.names:
            for kv in HOST_SYSCTLS:
                _run([*ip, "netns", "exec", ns, "sysctl", "-q", "-w", kv])
        sw = [*ip, "-n", self.switch]
        _run([*sw, "link", "add", "br0", "type", "bridge"])
        _run([*sw, "link", "set", "br0", "up"])
        # hosts file bind-mounted over /etc/hosts by `ip netns exec`
        hosts_txt = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames))
        for ns in self.names:
            d = NETNS_ETC / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts_txt)
        for i, ns in enumerate(self.names):
            port = f"p{i}"
            _run([*sw, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name",
                  HOST_IF, "netns", ns, "mtu", str(MTU)])
            _run([*sw, "link", "set", port, "master", "br0"])
            _run([*sw, "link", "set", port, "up"])
            hn = [*ip, "-n", ns]
            _run([*hn, "addr", "add", f"{self.addrs[i]}/24", "dev", HOST_IF])
            _run([*hn, "link", "set", "lo", "up"])
            _run([*hn, "link", "set", HOST_IF, "up"])
        macs = [self._mac(ns) for ns in self.names]
        for i, ns in enumerate(self.names):
            for j, addr in enumerate(self.addrs):
                if j != i:
                    _run([*ip, "-n", ns, "neigh", "replace", addr, "lladdr", macs[j], "dev",
                          HOST_IF, "nud", "permanent"])
        self._set_offload()
        if self.link is not None:
            self._shape()
        else:
            self._queue()
        self._write_shim()
        self.up = True
        self._wait_links()
        self.calibration = self._calibrate()
        self._log(f"{self.hosts} hosts up ({self.id}); header {self.calibration['header_bytes']} "
                  "B/packet")

    def teardown(self) -> None:
        """Remove everything this lab created; safe to call twice."""
        self.signals.hold()
        try:
            for p in self.procs:
                self._kill(p)
            self.procs = []
            names = [n for n in self.created]
            self.teardown_problems = _destroy(self.id, names) if names else []
            self.created = []
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None
            if self.state is not None:
                with contextlib.suppress(OSError):
                    self.state.unlink()
                with contextlib.suppress(OSError):
                    STATE_DIR.rmdir()        # only if no other lab is running
                self.state = None
            self.up = False
            for msg in self.teardown_problems:
                print(f"wirelab: teardown: {msg}", file=sys.stderr)
        finally:
            pending = self.signals.pending
            self.signals.restore()
            if pending is not None:
                raise LabInterrupted(pending)

    # -- set-up pieces ---------------------------------------------------------------------------
    def _mac(self, ns: str) -> str:
        out = _run(["ip", "-n", ns, "-j", "link", "show", "dev", HOST_IF]).stdout
        return json.loads(out)[0]["address"]

    def _set_offload(self) -> None:
        flags = [] if self.offload else ["tso=0", "gso=0", "gro=1"]
        ports = ",".join(f"p{i}" for i in range(self.hosts))
        feats = {}
        for ns, devs in ((self.switch, ports), *((n, HOST_IF) for n in self.names)):
            res = _run(["ip", "netns", "exec", ns, self.python, "-c", _ETHTOOL_SCRIPT, devs,
                        *flags], check=False)
            if res.returncode != 0:
                raise LabError(f"could not set segmentation offload in {ns} (SIOCETHTOOL): "
                               f"{res.stderr.strip()[-500:]}; try --offload on")
            feats[ns] = json.loads(res.stdout)
        if not self.offload:
            bad = [f"{ns}/{d}" for ns, ds in feats.items() for d, f in ds.items()
                   if f["tso"] or f["gso"]]
            if bad:
                raise LabError(f"TSO/GSO stayed on for {bad}")
        self.features = {"mode": "kernel defaults" if self.offload else
                         "tso off, gso off, gro on (veth NAPI: in-order delivery)",
                         "per_device": feats}

    def _devices(self) -> list[tuple[str, str]]:
        """(namespace, device) of every veth end: host eth0s, then switch ports."""
        return [(ns, HOST_IF) for ns in self.names] + [(self.switch, f"p{i}")
                                                      for i in range(self.hosts)]

    def _queue(self) -> None:
        """A pfifo on every veth end.  veth has no queue by default: a full peer ring then drops
        frames (and TCP retransmits them); with a qdisc, veth applies backpressure instead."""
        for ns, dev in self._devices():
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                  "pfifo", "limit", str(QUEUE_PACKETS)])

    def _shape(self) -> None:
        mbit, lat = self.link
        rate = f"{mbit:g}mbit"
        rate_bps = mbit * 1e6 / 8
        burst = int(max(2 * (MTU + ETH_HDR), rate_bps * TBF_BURST_S))
        limit = int(max(8 << 20, rate_bps))          # >= 1 s of queue: shaping must not drop
        # each direction of a link gets half the latency: host egress + switch port egress
        delay_us = lat / 2
        devs = self._devices()
        qdisc = "netem"
        for k, (ns, dev) in enumerate(devs):
            base = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"]
            if qdisc == "netem":
                res = _run([*base, "netem", "rate", rate, "delay", f"{delay_us:g}us",
                            "limit", str(max(1000, limit // MTU))], check=False)
                if res.returncode == 0:
                    continue
                if k:
                    raise LabError(f"tc netem failed on {ns}/{dev}: {res.stderr.strip()}")
                qdisc = "tbf"
                self._log(f"sch_netem unavailable ({res.stderr.strip()}): tbf, rate only")
            _run([*base, "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)])
        applied = lat if qdisc == "netem" else 0.0
        self.shaping = {
            "mbit": mbit, "latency_us_requested": lat, "latency_us_applied": applied,
            "qdisc": qdisc, "where": "egress of every host eth0 and every switch port "
                                     "(both directions of each host-switch link)",
            "tbf": {"burst_bytes": burst, "limit_bytes": limit} if qdisc == "tbf" else None,
            "note": None if qdisc == "netem" or lat == 0 else (
                "sch_netem is not available in this kernel: the rate is shaped with tbf, the "
                "latency is NOT applied"),
        }
        if self.shaping["note"]:
            print(f"wirelab: warning: {self.shaping['note']}", file=sys.stderr)

    def _write_shim(self) -> None:
        cases = "".join(f"  {h}) ns={shlex.quote(n)} ;;\n"
                        for h, n in zip(self.hostnames, self.names))
        shim = f"""#!/bin/sh
# wire lab {self.id}: hydra's launcher-exec. Called like ssh: SHIM [-x] [-o OPT] HOST COMMAND...
# Enters HOST's network namespace and a new UTS namespace named HOST, then runs COMMAND there.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}  *) echo "wirelab shim: unknown host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$*"' \\
  "$host" "$@"
"""
        path = self.tmp / "shim.sh"
        path.write_text(shim)
        path.chmod(0o755)
        self.shim = str(path)

    def _wait_links(self) -> None:
        deadline = time.monotonic() + CMD_TIMEOUT
        while time.monotonic() < deadline:
            states = [self._link_json(ns)[0].get("operstate") for ns in self.names]
            if all(s == "UP" for s in states):
                return
            time.sleep(0.1)
        raise LabError(f"links did not come up: {states}")

    # -- counters --------------------------------------------------------------------------------
    def _link_json(self, ns: str, dev: str = HOST_IF) -> list:
        return json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]).stdout)

    def _tcp_stats(self, ns: str) -> dict:
        """TCP ``RetransSegs`` and the TcpExt counters that say why (of namespace ``ns``)."""
        txt = _run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp",
                    "/proc/net/netstat"]).stdout
        out = {}
        lines = txt.splitlines()
        for head, vals in zip(lines, lines[1:]):
            hk, vk = head.split(), vals.split()
            if not hk or hk[0] != vk[0] or hk[0] not in ("Tcp:", "TcpExt:") or \
                    not vk[1:2] or not vk[1].lstrip("-").isdigit():
                continue
            row = dict(zip(hk[1:], vk[1:]))
            if hk[0] == "Tcp:":
                out["retrans_segs"] = int(row["RetransSegs"])
                out["tcp_active_opens"] = int(row["ActiveOpens"])
                out["tcp_out_segs"] = int(row["OutSegs"])
            else:
                for k in TCPEXT_FIELDS:
                    out[k] = int(row.get(k, 0))
        return out

    def counters(self) -> dict:
        """Per host: ``tx_bytes``, ``tx_packets`` of its eth0 and TCP ``RetransSegs``."""
        out = {}
        for h, ns in zip(self.hostnames, self.names):
            st = self._link_json(ns)[0]["stats64"]["tx"]
            out[h] = {"bytes": int(st["bytes"]), "packets": int(st["packets"]),
                      "dropped": int(st.get("dropped", 0)), **self._tcp_stats(ns)}
        return out

    def qdisc_stats(self) -> dict | None:
        if self.link is None:
            return None
        out = {}
        devs = [(h, ns, HOST_IF) for h, ns in zip(self.hostnames, self.names)] + [
            (f"switch:p{i}", self.switch, f"p{i}") for i in range(self.hosts)]
        for label, ns, dev in devs:
            js = json.loads(_run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show",
                                  "dev", dev]).stdout)
            root = next((q for q in js if q.get("root")), js[0] if js else {})
            out[label] = {"kind": root.get("kind"), "drops": root.get("drops", 0),
                          "overlimits": root.get("overlimits", 0), "bytes": root.get("bytes", 0),
                          "packets": root.get("packets", 0)}
        return out

    @staticmethod
    def _delta(a: dict, b: dict) -> dict:
        return {h: {k: b[h][k] - a[h][k] for k in a[h]} for h in a}

    def _calibrate(self) -> dict:
        """Send CALIBRATION_BYTES over one TCP connection h0 -> h1 and solve for the bytes the
        counters add per packet (the header correction)."""
        port = 40000 + secrets.randbelow(20000)
        n = CALIBRATION_BYTES
        server = (
            "import socket,sys\n"
            "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(({self.addrs[1]!r},{port})); s.listen(1); print('ready',flush=True)\n"
            "s.settimeout(30); c,_=s.accept(); c.settimeout(30); got=0\n"
            "while True:\n  b=c.recv(1<<20)\n  if not b: break\n  got+=len(b)\n"
            "c.sendall(b'k'); c.close(); print(got)\n")
        client = (
            "import socket,time\n"
            f"for _ in range(100):\n  try:\n    c=socket.create_connection(({self.addrs[1]!r},"
            f"{port}),timeout=30); break\n  except OSError: time.sleep(0.05)\n"
            f"c.sendall(bytes({n})); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()\n")
        before = self.counters()
        srv = self._popen(["ip", "netns", "exec", self.names[1], self.python, "-c", server],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            srv.stdout.readline()
            _run(["ip", "netns", "exec", self.names[0], self.python, "-c", client], timeout=60)
            out, _ = srv.communicate(timeout=60)
        finally:
            self._kill(srv)
        if srv.returncode != 0 or int(out.split()[-1]) != n:
            raise LabError(f"calibration transfer h0 -> h1 failed: {out!r}")
        after = self.counters()
        d = self._delta(before, after)
        tot_b = sum(v["bytes"] for v in d.values())
        tot_p = sum(v["packets"] for v in d.values())
        retr = sum(v["retrans_segs"] for v in d.values())
        raw = (tot_b - n - 1) / tot_p
        header = min((IP_HDR + TCP_HDR, ETH_HDR + IP_HDR + TCP_HDR), key=lambda h: abs(h - raw))
        if abs(raw - header) > 1.0 and not retr:
            raise LabError(f"per-packet overhead {raw:.2f} B matches neither 52 (IP+TCP) nor 66 "
                           "(Ethernet+IP+TCP): the interface counters are not what the lab "
                           "expects")
        return {"payload_bytes": n, "counter_bytes": tot_b, "packets": tot_p,
                "retrans_segs": retr, "overhead_per_packet_measured": raw,
                "header_bytes": header, "counters_include_ethernet_header": header == 66,
                "mss": MTU - IP_HDR - TCP_HDR}

    # -- running ---------------------------------------------------------------------------------
    def _popen(self, cmd, **kw) -> subprocess.Popen:
        p = subprocess.Popen([str(c) for c in cmd], start_new_session=True, text=True, **kw)
        self.procs.append(p)
        return p

    def _kill(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        if p in self.procs:
            self.procs.remove(p)

    def _sweep(self) -> None:
        """Kill whatever this lab started that is still inside its host namespaces."""
        for ns in self.names:
            for _ in range(20):
                pids = _netns_pids(ns)
                if not pids:
                    break
                _kill_pids(pids)
                time.sleep(0.1)

    def _renice(self, stop: threading.Event) -> None:
        """While a job runs: give every new process in the host namespaces (hydra puts each
        proxy and each rank in a session of its own, so in an autogroup of its own) the
        autogroup niceness :attr:`nice` (:func:`_autogroup_nice`), again when it moved to a new
        session since.  Polls every 50 ms, slowing to 1 s: the ranks appear at start-up."""
        want = f" nice {int(self.nice)}"
        wait = 0.05
        while not stop.wait(wait):
            for ns in self.names:
                for pid in _netns_pids(ns):
                    with contextlib.suppress(OSError):
                        if not Path(f"/proc/{pid}/autogroup").read_text().rstrip() \
                                .endswith(want):
                            _autogroup_nice(pid, self.nice)
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
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")   # as substrate.launch: no spinning
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
            cmd = [self.python, "-m", "substrate.launch", "-n", str(np_), *module_args]
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
            res = _run(self.in_host0([*cmd[:3], "--dry-run", *cmd[3:]]), env=env, timeout=60)
            resolved = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
            if not resolved.startswith(shlex.join(self.hydra_prefix())):
                raise LabError("substrate.launch did not resolve to the lab's hydra command: "
                               f"{resolved!r}")
        before, qd_before = self.counters(), self.qdisc_stats()
        t0 = time.monotonic()
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            niced = cmd if self.nice is None else ["nice", "-n", str(self.nice), *cmd]
            p = self._popen(self.in_host0(niced), cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT)
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
            job = self._job(["substrate.wirelab", "--idle"], launch, log)
            self.baselines[launch] = job
        return self.baselines[launch]

    def ping_pong(self, *, reps: int = 200, sizes=(8, 1 << 20), launch: str = "mpiexec",
                  out: Path | None = None) -> dict:
        """One-off MPI ping-pong on the lab (:func:`_pingpong_main`): one-way time per size for
        an inter-host pair and, with ``ranks_per_host > 1``, an intra-host pair.  Cached: the
        alpha of the lab is measured once."""
        if self.pingpong is not None:
            return self.pingpong
        if not self.up:
            raise LabError("the lab is not set up (use it as a context manager)")
        d = Path(out) if out is not None else self.tmp / "pingpong"
        d.mkdir(parents=True, exist_ok=True)
        self._job(["substrate.wirelab", "--pingpong", "--out", str(d), "--reps", str(reps),
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
                         ("--ranks-per-node", "nodes are real in the lab (hosts); use "
                                              "--ranks-per-host")):
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
        log = out / "wirelab.log"
        if log.exists() and force:
            log.unlink()
        base = self.baseline(launch, log)
        job = self._job([*module_args, "--out", str(out), *extra], launch, log)
        if _stat_key(summary_path) in (None, old):
            raise LabError(f"the job did not write a new {summary_path}: is {module_args[0]} a "
                           "spardist command that takes --out?")
        summary = json.loads(summary_path.read_text())
        result = self.report(summary, job, base, launch, module_args, out)
        _write_no_clobber(wire, result, force)
        return result

    # -- the report ------------------------------------------------------------------------------
    def _host_figures(self, d: dict) -> dict:
        hdr = self.calibration["header_bytes"]
        mss = self.calibration["mss"]
        frame_extra = 0 if self.calibration["counters_include_ethernet_header"] else ETH_HDR
        dup = self._duplicate_segs(d)
        return {"counter_bytes": d["bytes"], "packets": d["packets"],
                "frame_bytes": d["bytes"] + frame_extra * d["packets"],
                "retrans_segs": d["retrans_segs"], "duplicate_segs": dup,
                "dropped": d.get("dropped", 0),
                "payload_bytes": d["bytes"] - hdr * d["packets"] - mss * dup}

    def _duplicate_segs(self, d: dict) -> int:
        """Segments that crossed the link twice.  In veth's NAPI mode (GRO on) the counters only
        see frames the peer took, so a retransmission after a drop is the first delivery and only
        spurious retransmissions (reported back by D-SACK) are duplicates; with the kernel's
        default offload the counters count at transmit, so every retransmission is."""
        return d.get("TCPDSACKRecvSegs", 0) if not self.offload else d["retrans_segs"]

    def report(self, summary: dict, job: dict, base: dict, launch: str, module_args, out) -> dict:
        traffic = summary.get("traffic", {})
        booked = traffic.get("measured", {}).get("inter_node_bytes")
        predicted = traffic.get("predicted", {}).get("inter_node_bytes")
        per_host = {}
        for h in self.hostnames:
            run = self._host_figures(job["delta"][h])
            b = self._host_figures(base["delta"][h])
            per_host[h] = {"run": run, "baseline": b,
                           "tcp_events": {k: job["delta"][h].get(k, 0) for k in TCPEXT_FIELDS},
                           "payload_bytes": run["payload_bytes"] - b["payload_bytes"],
                           "frame_bytes": run["frame_bytes"] - b["frame_bytes"]}
        real_payload = sum(v["payload_bytes"] for v in per_host.values())
        real_frames = sum(v["frame_bytes"] for v in per_host.values())
        base_payload = sum(v["baseline"]["payload_bytes"] for v in per_host.values())
        base_frames = sum(v["baseline"]["frame_bytes"] for v in per_host.values())
        retrans = sum(v["run"]["retrans_segs"] for v in per_host.values())
        dups = sum(v["run"]["duplicate_segs"] for v in per_host.values())
        dropped = sum(v["run"]["dropped"] for v in per_host.values())
        ratio = lambda x, y: (x / y) if y else None  # noqa: E731
        topo = summary.get("topology", {})
        warnings = []
        if topo and (topo.get("nodes") != self.hosts or topo.get("virtual_nodes")):
            warnings.append(f"the run saw {topo.get('nodes')} nodes (virtual: "
                            f"{topo.get('virtual_nodes')}), the lab has {self.hosts} hosts")
        if dups:
            warnings.append(f"{dups} TCP segments crossed a link twice (spurious "
                            "retransmissions; subtracted at one MSS each)")
        if dropped:
            warnings.append(f"{dropped} frames were dropped at a veth (retransmitted by TCP)")
        qdrops = sum(v["drops"] for v in (job["qdisc"] or {}).values())
        if qdrops:
            warnings.append(f"the link shaping dropped {qdrops} packets (retransmitted by TCP)")
        if booked and real_payload < 0.01 * booked:
            warnings.append("almost nothing crossed the links: inter-host traffic is not on the "
                            "veth links (shared memory?)")
        result = {
            "wirelab": 1,
            "lab_id": self.id,
            "shape": {"hosts": self.hosts, "ranks_per_host": self.rph,
                      "world": self.hosts * self.rph, "hostnames": self.hostnames},
            "launch": launch,
            "command": shlex.join(job["command"]),
            "resolved_command": job["resolved"],
            "module_args": list(module_args),
            "out": str(out),
            "network": {"netmod": self.netmod,
                        "env": {k: v for k, v in self.mpi_env().items()
                                if k.startswith(("UCX_", "FI_", "MPIR_CVAR_", "SPARDIST_"))},
                        "mtu": MTU, "offload": self.features.get("mode"),
                        "addresses": dict(zip(self.hostnames, self.addrs))},
            "link": self.shaping,
            "nice": self.nice,
            "calibration": self.calibration,
            "system": summary.get("system"), "method": summary.get("method"),
            "topology": topo,
            "collectives": summary.get("collectives"),
            "booked_inter_node_bytes": booked,
            "predicted_inter_node_bytes": predicted,
            "real": {"payload_bytes": real_payload, "frame_bytes": real_frames,
                     "excess_payload_bytes": None if booked is None else real_payload - booked,
                     "retrans_segs": retrans, "duplicate_segs": dups, "dropped": dropped},
            "baseline": {"payload_bytes": base_payload, "frame_bytes": base_frames,
                         "wall_s": base["wall_s"]},
            "ratios": {"payload_vs_booked": ratio(real_payload, booked),
                       "frames_vs_booked": ratio(real_frames, booked),
                       "payload_vs_predicted": ratio(real_payload, predicted),
                       "booked_vs_predicted": ratio(booked, predicted)},
            "per_host": per_host,
            "qdisc": job["qdisc"],
            "wall_s": job["wall_s"],
            "pingpong": self.pingpong,
            "warnings": warnings,
        }
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


def _write_no_clobber(path: Path, obj: dict, force: bool) -> None:
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


def format_table(r: dict) -> str:
    """The small table printed on stdout."""
    def fmt(x):
        return "-" if x is None else f"{x:,}"

    def rat(x):
        return "-" if x is None else f"{x:.4f}"

    s = r["shape"]
    link = r["link"]
    link_txt = "unshaped" if link is None else (
        f"{link['mbit']:g} Mbit/s, {link['latency_us_applied']:g} us ({link['qdisc']})")
    lines = [f"wire lab: {s['hosts']} hosts x {s['ranks_per_host']} ranks, launch "
             f"{r['launch']}, MPICH {r['network']['netmod']} over TCP on veth, link {link_txt}",
             f"  {r['system']} / {r['method']}: {' '.join(r['module_args'])}",
             f"  {'':24s}{'bytes':>16s}  {'/ booked':>9s}"]
    booked = r["booked_inter_node_bytes"]
    rows = [("booked (ledger)", booked),
            ("predicted", r["predicted_inter_node_bytes"]),
            ("real payload (TCP)", r["real"]["payload_bytes"]),
            ("real frames", r["real"]["frame_bytes"]),
            ("start-up baseline", r["baseline"]["payload_bytes"])]
    for name, v in rows:
        lines.append(f"  {name:24s}{fmt(v):>16s}  "
                     f"{rat(v / booked) if (booked and v is not None) else '-':>9s}")
    lines.append("  per host (payload / frames / packets / retransmitted / duplicate segments):")
    for h, v in r["per_host"].items():
        lines.append(f"    {h}: {v['payload_bytes']:,} / {v['frame_bytes']:,} / "
                     f"{v['run']['packets'] - v['baseline']['packets']:,} / "
                     f"{v['run']['retrans_segs']} / {v['run']['duplicate_segs']}")
    if r.get("collectives") is not None:
        lines.append(f"  collectives: {json.dumps(r['collectives'])}")
    for w in r["warnings"]:
        lines.append(f"  warning: {w}")
    lines.append(f"  wrote {Path(r['out']) / WIRE_JSON}")
    return "\n".join(lines)


def run_lab(hosts: int, ranks_per_host: int, module_args, *, link=None, launch: str = "mpiexec",
            out=None, timeout: float = DEFAULT_TIMEOUT, force: bool = False,
            netmod: str = "ucx", offload: bool = False, env: dict | None = None,
            verbose: bool = False, calibrate_cost: bool = False, compare: bool = False,
            nice: int | None = None) -> dict:
    """Set up a lab, measure one run (after its start-up baseline), tear down.

    ``calibrate_cost``: ping-pong first (:meth:`Lab.ping_pong`) and append the cost-model flags
    of :func:`cost_flags` to the command (beta from ``--link``, alpha from the ping-pong).
    ``compare``: read the run's per-step wall time back (:func:`compare_steps`), write
    ``OUT/steps.json`` and put it under ``"steps"`` of the result.

    Returns the ``wire.json`` dict (also written to ``OUT/wire.json``).
    """
    with Lab(hosts, ranks_per_host, link=link, netmod=netmod, offload=offload, timeout=timeout,
             env=env, verbose=verbose, nice=nice) as lab:
        module_args = list(module_args)
        if calibrate_cost:
            flags = cost_flags(lab.link, lab.ping_pong(launch=launch))
            given = [f for f in flags[::2] if f in module_args]
            if given:
                raise LabError(f"--calibrate-cost sets {given} itself: drop them from the "
                               "command")
            module_args += flags
        result = lab.measure(module_args, out=out, launch=launch, force=force)
        if compare:
            steps = compare_steps(result["out"])
            _write_no_clobber(Path(result["out"]) / STEPS_JSON, steps, True)
            result["steps"] = steps
        return result


# -- CLI -------------------------------------------------------------------------------------------

def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m substrate.wirelab",
        description="Run a spardist command across emulated hosts (network + UTS namespaces on "
                    "this machine, MPICH over TCP on veth links) and compare the bytes that "
                    "really crossed between hosts with the ledger's. Root only.",
        epilog="example: python -m substrate.wirelab --hosts 2 --ranks-per-host 2 -- "
               "dataparallel train --method ddp --steps 6")
    p.add_argument("--hosts", type=int, required=True, help="emulated hosts (>= 2)")
    p.add_argument("--ranks-per-host", type=int, required=True, help="MPI ranks on each host")
    p.add_argument("--link", default=None, metavar="MBIT,LATENCY_US",
                   help="shape every link with tc (rate in Mbit/s, latency in us)")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory of the run (its summary.json and wire.json); default "
                        "results/wirelab/<module>_<method>_<H>x<R>")
    p.add_argument("--launch", choices=("mpiexec", "run_mpi"), default="mpiexec",
                   help="plain hydra mpiexec, or the project's launcher (python -m "
                        "substrate.launch, what run_mpi.sh runs) with SPARDIST_LAUNCHER set to "
                        "the same hydra command")
    p.add_argument("--netmod", choices=("ucx", "ofi"), default="ucx",
                   help="MPICH network module, both over TCP (default ucx)")
    p.add_argument("--offload", choices=("off", "on"), default="off",
                   help="segmentation offload on the veth links (default off: TSO/GSO off, GRO "
                        "on)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds allowed for each MPI run (default %(default)s)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the MPI job (repeatable)")
    p.add_argument("--yield", dest="yield_", action="store_true",
                   help="waiting MPI ranks sleep instead of spinning (MPICH's "
                        "MPIR_CVAR_CH4_PROGRESS_THROTTLE): for more ranks than cores")
    p.add_argument("--nice", type=int, default=None,
                   help="run the MPI job at this niceness (-20 .. 19): a timing run gets the "
                        "cores before the box's other jobs")
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUT/wire.json (and pass --overwrite to the command "
                        "when OUT already holds its summary.json)")
    p.add_argument("--calibrate-cost", action="store_true",
                   help="ping-pong on the lab first and pass the cost model to the command: "
                        "--inter-bw from --link (TCP payload rate), --inter-lat/--intra-lat "
                        "(and --intra-bw) from the ping-pong")
    p.add_argument("--compare-steps", action="store_true",
                   help="after the run, compare predicted and measured time per step from its "
                        "metrics.jsonl (step_wall_s) and write OUT/steps.json")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("module_args", nargs=argparse.REMAINDER,
                   help="-- MODULE ARGS... (the spardist command)")
    ns = p.parse_args(argv)
    if ns.module_args and ns.module_args[0] == "--":
        ns.module_args = ns.module_args[1:]
    if not ns.module_args:
        p.error("give the command after --, e.g. -- dataparallel train --method ddp")
    return ns


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--idle"]:
        return _idle_main(argv)
    if argv[:1] == ["--sendrecv"]:
        return _sendrecv_main(argv)
    if argv[:1] == ["--pingpong"]:
        return _pingpong_main(argv)
    if argv[:1] == ["--compare-steps"] and len(argv) >= 2 and not argv[1].startswith("-"):
        # offline: python -m substrate.wirelab --compare-steps OUT [--skip N] (no root needed)
        skip = int(argv[argv.index("--skip") + 1]) if "--skip" in argv else 1
        try:
            r = compare_steps(Path(argv[1]), skip=skip)
        except LabError as exc:
            print(f"wirelab: error: {exc}", file=sys.stderr)
            return 2
        print(format_steps(r))
        return 0
    ns = _parse(argv)
    env = dict(YIELD_ENV) if ns.yield_ else {}
    for kv in ns.env:
        if "=" not in kv:
            print(f"wirelab: error: --env {kv!r}: write KEY=VALUE", file=sys.stderr)
            return 2
        k, v = kv.split("=", 1)
        env[k] = v
    try:
        result = run_lab(ns.hosts, ns.ranks_per_host, ns.module_args, link=ns.link,
                         launch=ns.launch, out=ns.out, timeout=ns.timeout, force=ns.force,
                         netmod=ns.netmod, offload=ns.offload == "on", env=env,
                         verbose=ns.verbose, calibrate_cost=ns.calibrate_cost,
                         compare=ns.compare_steps, nice=ns.nice)
    except LabError as exc:
        print(f"wirelab: error: {exc}", file=sys.stderr)
        return 2
    except LabInterrupted as exc:
        print(f"{exc}; everything torn down", file=sys.stderr)
        return 128 + exc.signum
    print(format_table(result))
    if result.get("pingpong"):
        for link, v in result["pingpong"]["links"].items():
            bw = v.get("bandwidth_gbps")
            print(f"  ping-pong {link}: alpha {v['alpha_s'] * 1e6:.1f} us"
                  + (f", {bw:.3f} Gbit/s" if bw else ""))
    if result.get("steps"):
        print(format_steps(result["steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
