"""The emulated hosts and their links: namespaces, veth pairs, a bridge, shaping, counters.

How the hosts are emulated (nothing is added to the root network namespace):

* one *switch* namespace ``spwl-<id>-sw`` holds a bridge ``br0`` and one veth port ``p<i>`` per
  host; the other end of each veth pair is ``eth0`` inside the *host* namespace
  ``spwl-<id>-h<i>`` with address ``10.251.0.<i+1>/24`` (private, only inside these namespaces),
  ``lo`` up, IPv6 off, static neighbour entries (no ARP on the links), TCP congestion control
  :data:`TCP_CONGESTION` (CUBIC, Linux's default, whatever the machine's default) on the lab
  subnet's route and
  ``/etc/netns/spwl-<id>-h<i>/hosts`` naming ``h0 .. h<H-1>`` (``ip netns exec`` bind-mounts it
  over ``/etc/hosts``);
* every process of host ``i`` also runs in its own UTS namespace with hostname ``h<i>``: the
  shim (:meth:`Network.shim`, called like ``ssh HOST COMMAND``) enters ``h<i>``'s network
  namespace (``ip netns exec``) and a fresh UTS namespace (``unshare --uts`` + ``hostname``).

What is counted (:meth:`Network.counters`): for each host, ``tx_bytes``/``tx_packets`` of its
``eth0`` (everything it put on its link: with a bridge and static neighbours that is traffic to
the other hosts), plus TCP ``RetransSegs`` and the TcpExt counters of its namespace.
Segmentation offload (TSO/GSO) is switched off on every veth end with the ``SIOCETHTOOL`` ioctl
(no ``ethtool`` binary needed), so the counters see MTU-sized frames; GRO is switched *on*,
which puts veth into its NAPI mode and keeps each flow in order (without it, a sender migrating
between CPUs reorders frames and TCP sends spurious fast retransmits).  The per-packet header
the counters add is calibrated at set-up with a plain TCP transfer of known size between h0 and
h1 (:meth:`Network.calibrate`: 52 bytes = 20 IPv4 + 32 TCP with timestamps when veth counts from
the IP header, as in NAPI mode; 66 with the 14-byte Ethernet header).  Every veth end gets a
``pfifo`` (or the ``--link`` shaper) so a full peer ring means backpressure, not drops, and
tail-loss probes are off in the host namespaces (``tcp_early_retrans=0``: on links that cannot
drop they only duplicate data).

``--link MBIT,LATENCY_US`` (:func:`parse_link`: finite, rate 1 .. 10000 Mbit/s, latency
0 .. 1000000 us) shapes every link, both directions (host ``eth0`` egress and switch port
egress), with ``netem rate .. delay ..`` where the kernel has ``sch_netem``, else with ``tbf``
(rate only; the delay is then recorded as not applied).  The shaping is in :attr:`shaping`.

Everything a network creates (namespaces, veths, bridge, ``/etc/netns`` entries, the temp dir,
the processes in the namespaces) is removed on exit, failure, ``SIGINT`` and ``SIGTERM``
(:mod:`lab.netns`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .netns import (
    CMD_TIMEOUT,
    NETNS_ETC,
    PREFIX,
    STATE_DIR,
    TMP_PREFIX,
    LabError,
    LabInterrupted,
    Signals,
    check_prerequisites,
    cleanup_stale,
    destroy,
    kill_pids,
    netns_pids,
    proc_start,
    run,
    venv_python,
)

__all__ = [
    "ETH_HDR",
    "HOST_IF",
    "IP_HDR",
    "LATENCY_US",
    "MTU",
    "RATE_MBIT",
    "RTO_MIN_MS",
    "SUBNET",
    "TCPEXT_FIELDS",
    "TCP_CONGESTION",
    "TCP_HDR",
    "Network",
    "check_link",
    "link_text",
    "parse_link",
]

SUBNET = "10.251.0"                   # host i: 10.251.0.<i+1>/24, only inside the lab namespaces
HOST_IF = "eth0"
MTU = 1500
ETH_HDR, IP_HDR, TCP_HDR = 14, 20, 32  # TCP with the timestamp option
CALIBRATION_BYTES = 4 << 20
#: Per host namespace.  Tail-loss probes off: the links never drop (every veth end has a queue),
#: so a probe is always a spurious duplicate of the last segment (seen on a loaded box as
#: TCPLossProbes + D-SACKs without it).  No congestion-window restart after idle (RFC 2861,
#: Linux default on): a ring step sends one chunk after waiting for its neighbour, so every
#: chunk restarted from 10 segments and waited for ACKs queued behind the reverse direction's
#: data; a 2 x 2 ddp step on a 10 Mbit/s link took 1.19 s against 0.26 s without the restart
#: (the alpha-beta model of the interconnects spardist models, RDMA, has no such window).
#: TCP small queues at 64 KiB per socket (the kernel's default, 4 MiB, lets one bulk flow fill
#: the shaped egress queue with a third of a second of data at 100 Mbit/s): the lab's qdiscs are
#: FIFOs (this kernel has no fq), so a ring's rendezvous replies and ACKs waited behind the
#: reverse direction's chunks; a replayed 2 x 2 ddp step at 100 Mbit/s measured 0.654 s against
#: 0.573 s predicted with 4 MiB, 0.602 s with 64 KiB (load 7-9).
HOST_SYSCTLS = ("net.ipv4.tcp_early_retrans=0", "net.ipv4.tcp_slow_start_after_idle=0",
                "net.ipv4.tcp_limit_output_bytes=65536")
#: TCP congestion control of every host, set on the lab subnet's route (``congctl``: a namespace
#: other than the first may not choose an algorithm outside ``tcp_allowed_congestion_control`` as
#: its default).  Pinned to Linux's default, CUBIC, rather than inherited from the machine: this
#: box defaults to BBR, whose timers run in real time (a ProbeRTT every 10 s cuts the window to 4
#: segments for 200 ms; the bandwidth and minimum-RTT filters are windowed in seconds), so on a
#: time-dilated lab (:func:`lab.experiments.compare_systems`) it stalled flows once per step of a
#: replayed H-SGD 2 x 2 at K = 16 (the links idled in bursts while data was pending).
TCP_CONGESTION = "cubic"
#: Range of ``rto_min_ms``: up to the kernel's TCP_RTO_MAX (120 s), i.e. K x 200 ms for a lab
#: dilated up to 600-fold
RTO_MIN_MS = (1.0, 120_000.0)
#: tbf bucket, in seconds of the rate: a link idle for longer sends this much at once.  Short:
#: with 4 ms (the old ``rate / 250``) an H-SADMM iteration's 145 kB all-reduce after 6 ms of
#: compute took 9 ms on a 100 Mbit/s link instead of the 12.1 ms its size takes at the rate
#: (50 kB went at once), and at 1 Gbit/s every idle gap was worth 0.5 MB.
TBF_BURST_S = 1e-3
QUEUE_PACKETS = 10000                 # pfifo limit on every veth end (backpressure, no drops)
#: TcpExt counters recorded beside RetransSegs (why segments were sent twice)
TCPEXT_FIELDS = ("TCPLossProbes", "TCPFastRetrans", "TCPSlowStartRetrans", "TCPTimeouts",
                 "TCPSpuriousRTOs", "TCPDSACKRecv", "TCPDSACKRecvSegs", "TCPSACKReorder",
                 "TCPTSReorder", "TCPRenoReorder", "TCPBacklogDrop", "TCPRcvQDrop",
                 "TCPOFOQueue", "TCPOFODrop")
#: Link rates a lab can shape, Mbit/s.  Below 1 Mbit/s the set-up's 4 MiB header calibration
#: alone takes over half a minute (it must finish in 60 s); above 10 Gbit/s the shaper never
#: acts, because veth links with segmentation offload off carry less than that on one machine
#: (this 2-vCPU box: 0.7-1.0 Gbit/s each way, 2 x 1 Sendrecv of 50-400 MB; leave --link out
#: for unshaped links).
RATE_MBIT = (1.0, 10_000.0)
#: One-way link latency, us (netem only).  Above 1 s hydra's start-up and every collective
#: would run into the lab's timeouts long before anything is measured.
LATENCY_US = (0.0, 1_000_000.0)
LINK_EXAMPLE = "--link 1000,50 (1 Gbit/s, 50 us)"


# -- link parameters -------------------------------------------------------------------------------

def link_text(link) -> str:
    """``(mbit, latency_us)`` as the ``--link`` value that gives it."""
    return ",".join(f"{float(v):g}" for v in link)


def check_link(mbit: float, lat: float, *, flag: str = "--link", given: str | None = None,
               example: str = LINK_EXAMPLE) -> tuple[float, float]:
    """Refuse a link rate or latency that is not finite or out of range (:data:`RATE_MBIT`,
    :data:`LATENCY_US`): :class:`LabError` naming ``flag``, the value ``given`` and the fix.
    Returns ``(mbit, lat)`` as floats."""
    given = link_text((mbit, lat)) if given is None else given
    head = f"{flag} {given!r}"
    (rlo, rhi), (llo, lhi) = RATE_MBIT, LATENCY_US
    rate_rule = f"the rate must be a finite number of Mbit/s from {rlo:g} to {rhi:g}"
    if flag == "--link":
        rate_rule += " (leave --link out for unshaped links)"
    lat_rule = f"the latency must be a finite number of us from {llo:g} to {lhi:.0f}"
    mbit, lat = float(mbit), float(lat)
    if not math.isfinite(mbit):
        raise LabError(f"{head}: {rate_rule}; got {mbit:g}. Fix: e.g. {example}")
    if not rlo <= mbit <= rhi:
        raise LabError(f"{head}: {rate_rule}; got {mbit:g} Mbit/s. Fix: e.g. {example}")
    if not math.isfinite(lat):
        raise LabError(f"{head}: {lat_rule}; got {lat:g}. Fix: e.g. {example}")
    if not llo <= lat <= lhi:
        raise LabError(f"{head}: {lat_rule}; got {lat:g} us. Fix: e.g. {example}")
    return mbit, lat


def parse_link(link, *, flag: str = "--link") -> tuple[float, float] | None:
    """``"MBIT,LATENCY_US"`` (or a ``(mbit, latency_us)`` pair) -> ``(mbit, latency_us)``,
    checked by :func:`check_link`; ``None`` passes through."""
    if link is None:
        return None
    given = link if isinstance(link, str) else repr(link)
    parts = link.split(",") if isinstance(link, str) else list(link)
    try:
        if len(parts) != 2:
            raise ValueError
        mbit, lat = float(parts[0]), float(parts[1])
    except (TypeError, ValueError):
        raise LabError(f"{flag} {given!r} is malformed: write MBIT,LATENCY_US (two numbers: "
                       f"the rate in Mbit/s and the one-way latency in us). Fix: e.g. "
                       f"{LINK_EXAMPLE}") from None
    return check_link(mbit, lat, flag=flag, given=given)


# -- ethtool without ethtool -----------------------------------------------------------------------

_ETHTOOL = {"tso": (0x1E, 0x1F), "gso": (0x23, 0x24), "gro": (0x2B, 0x2C)}

#: Run inside a namespace: ``python -c _ETHTOOL_SCRIPT dev feature=0|1 ...``; prints the features
#: read back as JSON.  SIOCETHTOOL with the legacy ETHTOOL_[GS]{TSO,GSO,GRO} commands.
_ETHTOOL_SCRIPT = r"""
import ctypes, fcntl, json, socket, struct, sys
CMD = __CMD__
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
""".replace("__CMD__", repr(_ETHTOOL))


# -- the network -----------------------------------------------------------------------------------

class Network:
    """``hosts`` emulated hosts on this machine, one link each to a switch (see the module
    docstring).  Use as a context manager: everything is created on entry and removed on exit.

    Parameters
    ----------
    hosts : int
        2 .. 250 (one /24 subnet).
    link : (mbit, latency_us) or str, optional
        Shape every link (:func:`parse_link`).
    offload : bool
        Keep the kernel's default segmentation offload (TSO/GSO on, GRO off) instead of turning
        TSO/GSO off and GRO on.
    python : str, optional
        The Python run inside the namespaces (default: the project's ``.venv``).
    rto_min_ms : float, optional
        TCP's minimum retransmission timeout on the lab subnet's route (``ip route ... rto_min``;
        default: the kernel's 200 ms).  A time-dilated lab sets K x 200 ms (see
        :func:`lab.experiments.compare_systems`).
    """

    def __init__(self, hosts: int, *, link=None, offload: bool = False,
                 python: str | None = None, verbose: bool = False,
                 rto_min_ms: float | None = None) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 2:
            raise LabError(f"--hosts must be an integer >= 2, got {hosts!r}")
        if rto_min_ms is not None and (isinstance(rto_min_ms, bool)
                                       or not isinstance(rto_min_ms, (int, float))
                                       or not RTO_MIN_MS[0] <= rto_min_ms <= RTO_MIN_MS[1]):
            raise LabError(f"rto_min_ms must be a number of ms in {RTO_MIN_MS[0]:g} .. "
                           f"{RTO_MIN_MS[1]:g}, got {rto_min_ms!r}. Fix: leave it out for the "
                           "kernel's 200 ms")
        self.rto_min_ms = rto_min_ms
        if hosts > 250:
            raise LabError(f"--hosts must be <= 250 (one /24 subnet), got {hosts}")
        self.hosts = hosts
        self.link = parse_link(link)
        self.offload = offload
        self.python = python or venv_python()
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
        self.signals = Signals()
        self.up = False
        self.features: dict = {}
        self.shaping: dict | None = None
        self.calibration: dict | None = None
        self.teardown_problems: list[str] = []

    # -- life cycle ------------------------------------------------------------------------------
    def __enter__(self):
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
            print(f"lab: {msg}", file=sys.stderr, flush=True)

    def preflight(self) -> None:
        """Checks before anything is created (root, tools, namespaces work)."""
        check_prerequisites()

    def setup(self) -> None:
        """Create the namespaces, links and shim (see the module docstring)."""
        self.preflight()
        cleanup_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
        self.state = STATE_DIR / f"{self.id}.json"
        self.state.write_text(json.dumps({
            "pid": os.getpid(), "start": proc_start(os.getpid()), "tmpdir": str(self.tmp),
            "namespaces": [self.switch, *self.names]}))
        ip = ["ip"]
        # namespaces (switch first), recorded before anything is put in them
        for ns in (self.switch, *self.names):
            self.created.append(ns)
            run([*ip, "netns", "add", ns])
        for ns in (self.switch, *self.names):
            for key in ("all", "default"):
                run([*ip, "netns", "exec", ns, "sysctl", "-q", "-w",
                     f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
        for ns in self.names:
            for kv in HOST_SYSCTLS:
                run([*ip, "netns", "exec", ns, "sysctl", "-q", "-w", kv])
        sw = [*ip, "-n", self.switch]
        run([*sw, "link", "add", "br0", "type", "bridge"])
        run([*sw, "link", "set", "br0", "up"])
        # hosts file bind-mounted over /etc/hosts by `ip netns exec`
        hosts_txt = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames))
        for ns in self.names:
            d = NETNS_ETC / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts_txt)
        for i, ns in enumerate(self.names):
            port = f"p{i}"
            run([*sw, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name",
                 HOST_IF, "netns", ns, "mtu", str(MTU)])
            run([*sw, "link", "set", port, "master", "br0"])
            run([*sw, "link", "set", port, "up"])
            hn = [*ip, "-n", ns]
            run([*hn, "addr", "add", f"{self.addrs[i]}/24", "dev", HOST_IF])
            run([*hn, "link", "set", "lo", "up"])
            run([*hn, "link", "set", HOST_IF, "up"])
            rto = [] if self.rto_min_ms is None else ["rto_min", f"{self.rto_min_ms:.0f}ms"]
            run([*hn, "route", "replace", f"{SUBNET}.0/24", "dev", HOST_IF, "proto", "kernel",
                 "scope", "link", "src", self.addrs[i], "congctl", TCP_CONGESTION, *rto])
        macs = [self._mac(ns) for ns in self.names]
        for i, ns in enumerate(self.names):
            for j, addr in enumerate(self.addrs):
                if j != i:
                    run([*ip, "-n", ns, "neigh", "replace", addr, "lladdr", macs[j], "dev",
                         HOST_IF, "nud", "permanent"])
        self._set_offload()
        if self.link is not None:
            self._shape()
        else:
            self._queue()
        self._write_shim()
        self.up = True
        self._wait_links()
        self.calibration = self.calibrate()
        self._log(f"{self.hosts} hosts up ({self.id}); header {self.calibration['header_bytes']} "
                  "B/packet")

    def teardown(self) -> None:
        """Remove everything this lab created; safe to call twice."""
        self.signals.hold()
        try:
            for p in list(self.procs):
                self._kill(p)
            self.procs = []
            names = [n for n in self.created]
            self.teardown_problems = destroy(names) if names else []
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
                print(f"lab: teardown: {msg}", file=sys.stderr)
        finally:
            pending = self.signals.pending
            self.signals.restore()
            if pending is not None:
                raise LabInterrupted(pending)

    # -- set-up pieces ---------------------------------------------------------------------------
    def _mac(self, ns: str) -> str:
        out = run(["ip", "-n", ns, "-j", "link", "show", "dev", HOST_IF]).stdout
        return json.loads(out)[0]["address"]

    def _set_offload(self) -> None:
        flags = [] if self.offload else ["tso=0", "gso=0", "gro=1"]
        ports = ",".join(f"p{i}" for i in range(self.hosts))
        feats = {}
        for ns, devs in ((self.switch, ports), *((n, HOST_IF) for n in self.names)):
            res = run(["ip", "netns", "exec", ns, self.python, "-c", _ETHTOOL_SCRIPT, devs,
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
                         "per_device": feats, "tcp_congestion": TCP_CONGESTION,
                         "tcp_rto_min_ms": 200 if self.rto_min_ms is None else self.rto_min_ms}

    def _devices(self) -> list[tuple[str, str]]:
        """(namespace, device) of every veth end: host eth0s, then switch ports."""
        return [(ns, HOST_IF) for ns in self.names] + [(self.switch, f"p{i}")
                                                      for i in range(self.hosts)]

    def _queue(self) -> None:
        """A pfifo on every veth end.  veth has no queue by default: a full peer ring then drops
        frames (and TCP retransmits them); with a qdisc, veth applies backpressure instead."""
        for ns, dev in self._devices():
            run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
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
                res = run([*base, "netem", "rate", rate, "delay", f"{delay_us:g}us",
                           "limit", str(max(1000, limit // MTU))], check=False)
                if res.returncode == 0:
                    continue
                if k:
                    raise LabError(f"tc netem failed on {ns}/{dev}: {res.stderr.strip()}")
                qdisc = "tbf"
                self._log(f"sch_netem unavailable ({res.stderr.strip()}): tbf, rate only")
            run([*base, "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)])
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
            print(f"lab: warning: {self.shaping['note']}", file=sys.stderr)

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
{cases}  *) echo "lab shim: unknown host '$host'" >&2; exit 255 ;;
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
        return json.loads(run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]).stdout)

    def _tcp_stats(self, ns: str) -> dict:
        """TCP ``RetransSegs`` and the TcpExt counters that say why (of namespace ``ns``)."""
        txt = run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp",
                   "/proc/net/netstat"]).stdout
        out = {}
        lines = txt.splitlines()
        for head, vals in itertools.pairwise(lines):
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
            js = json.loads(run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show",
                                 "dev", dev]).stdout)
            root = next((q for q in js if q.get("root")), js[0] if js else {})
            out[label] = {"kind": root.get("kind"), "drops": root.get("drops", 0),
                          "overlimits": root.get("overlimits", 0), "bytes": root.get("bytes", 0),
                          "packets": root.get("packets", 0)}
        return out

    @staticmethod
    def _delta(a: dict, b: dict) -> dict:
        return {h: {k: b[h][k] - a[h][k] for k in a[h]} for h in a}

    def calibrate(self) -> dict:
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
            run(["ip", "netns", "exec", self.names[0], self.python, "-c", client], timeout=60)
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

    # -- processes -------------------------------------------------------------------------------
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
        """Kill whatever is still inside the host namespaces."""
        for ns in self.names:
            for _ in range(20):
                pids = netns_pids(ns)
                if not pids:
                    break
                kill_pids(pids)
                time.sleep(0.1)
