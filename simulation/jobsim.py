"""Job simulation: every rank's program run together, step after step, on a simulated network.

The one time model of spardist: a run's simulated time (:meth:`simulation.clock.SimClock.
simulate`, on the programs its ranks recorded and the seconds its compute source measured), the
replay, ``commvol simulate`` (a recorded compute profile) and ``commvol scale`` (programs
generated from the plans, :mod:`commvol.job`) all read it.  A real job drifts, and so does this
one: in a ring all-gather across two nodes the ranks whose left neighbour shares their node
receive their last block one hop earlier than the others; with an eager protocol their last
sends are still on the wire when they return, so they start the next step's compute while the
link still carries the current step's blocks, and the ranks settle into a pipelined steady
state in which a link stays busy through part of the compute (on the wire lab, Top-K 2 x 2 at
100 Mbit/s ran 0.80x of a model that starts every rank's step together).

This module is SimGrid SMPI's offline mode for spardist's programs (:mod:`substrate.program`):
every rank walks its program as :mod:`runner.replay` executes it, in simulated time:

* **compute**: each block waits what the profile charges the replay (a layer block its
  ``(label, k)`` cost when it begins; a clock block the rest of its cost after its layers and
  nested blocks, when it ends), one block after the other on the rank's thread;
* **calls**: every collective is its algorithm's schedule (:mod:`substrate.schedule`, the
  rounds the exact collectives execute: ring all-reduce and all-gather, binomial broadcast,
  dissemination barrier), each round sends and receives the rank waits for; calls issued without
  waiting run on the rank's communication stream, in issue order, while the rank computes; a
  blocking call, a send or a barrier first waits for the stream to drain (``Comm``'s rule);
* **messages**: an eager message (every message up to ``eager_limit`` bytes) leaves when it is
  posted and its send completes at once; a larger one (rendezvous) leaves when the receive is
  posted as well, one more latency later, and its send completes when it has arrived.  A
  message waits its link's latency α, then moves its bytes;
* **network**: every node has an uplink and a downlink of the inter-node bandwidth.  By
  default (``link_sharing="fifo"``) each is a first-in-first-out queue: a node's uplink sends
  one message at a time, whole, in the order its ranks' messages reached it, into the
  destination's downlink, which forwards what reaches it in arrival order (a byte that
  arrives while W bytes wait leaves W / β later).  Nothing pushes back: the queues are deep
  and a sender is never slowed by the receiver's downlink.  This is TCP on the wire lab (and
  on a Linux host whose NIC queue is one FIFO): no loss ever shrinks a window, and TCP small
  queues let up to ``tcp_limit_output_bytes`` of each socket into the queue at once (64 KiB
  on the lab, half of an H-SGD message; 4 MiB by default), so a message enters the host's
  queue in one or a few pieces.  On the wire lab (with the ACKs below) H-SGD's
  exchanges, 12-15 flows per host, read 0.904 / 0.944 / 0.956 of the measured step at 4 x 2 /
  8 x 2 / 16 x 1, 1 Gbit/s, where max-min fair links read 0.878 / 0.922 / 0.858: FIFO links
  reproduce the slowest incoming message of each exchange landing on a different rank each
  time (docs/BENCHMARKS.md, "Wire lab").  With
  ``link_sharing="fair"`` the messages moving at one time share the links max-min fairly
  (progressive filling), each at the rate of its most loaded link, and messages between one
  pair of ranks move one after the other (one connection): per-flow fair queueing, as
  ``fq_codel`` or a NIC arbitrating between queue pairs gives.  Messages inside a node move at
  the intra-node bandwidth each, unshared (the lab's loopback; a shared-memory copy).
* **acknowledgements** (``ack_overhead``, default 0): when an inter-node message has arrived,
  its receiver's node sends ``ack_overhead`` x its bytes back over the reverse links, queued
  like a message: TCP's ACK frames, 2.2 % of the payload with delayed ACKs, which slow every
  link whose reverse direction carries data too.  With it the wire lab's ddp cells (rings: both
  directions of every link busy) read 0.989-1.000 of the measured step, against 0.958-0.980
  without.

The result is every rank's simulated time at each step boundary (``"S"`` entries):
:func:`job_steps` gives the steps of the job, whose length the lab compares with the measured
one (:func:`simulate_profile`; the replay writes them to ``summary.json``).  Nothing is
fitted: the inputs are the programs, the profile, the placement and the cost model's α and β.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from substrate import schedule
from substrate.calls import Call
from substrate.costmodel import CostModel
from substrate.options import check_choices, option

from .cluster import Cluster
from .profile import ProfileSource

__all__ = ["LINK_SHARING", "JobSim", "JobSimOptions", "job_steps", "simulate_profile"]

#: how the messages crossing one node link share it (:class:`JobSim`'s ``link_sharing``)
LINK_SHARING = ("fifo", "fair")
JOBSIM = "job simulation (the network the steps are simulated on)"


@dataclass(frozen=True)
class JobSimOptions:
    """The job simulation's flags, declared once for every command that simulates."""

    cluster: str | None = option(
        None, "a cluster file (TOML, see simulation/cluster.py) or the name of a shipped one: "
        "devices, the node's fabric, NICs, switch tiers, the library's per-call overhead and "
        "transport (default: the two-tier cluster of --intra-bw, --inter-bw, --intra-lat, "
        "--inter-lat)", metavar="FILE|NAME", group=JOBSIM)
    link_sharing: str = option(
        "fifo", "fifo: every NIC link a first-in-first-out queue, a NIC sending one message at "
        "a time (TCP through one NIC queue: the wire lab); fair: max-min fair shares per "
        "message (per-flow fair queueing, RDMA NICs arbitrating queue pairs; needed for "
        "oversubscribed switch tiers)", choices=LINK_SHARING, group=JOBSIM)
    eager_limit: float = option(
        math.inf, "messages above BYTES go by rendezvous: the data leaves once the receive is "
        "posted (default: every message eager, which the wire lab's MPICH over UCX's TCP "
        "measured like)", metavar="BYTES", group=JOBSIM)
    ack_overhead: float | None = option(
        None, "bytes a receiving node sends back per inter-node byte, the transport's "
        "acknowledgements (default: the cluster's transport: tcp 0.0218, rdma 0)",
        metavar="FRACTION", group=JOBSIM)

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.eager_limit >= 0:
            raise ValueError(f"--eager-limit {self.eager_limit:g}: must be >= 0 bytes (default: "
                             "every message eager). Fix: e.g. --eager-limit 262144")
        if self.ack_overhead is not None and not 0 <= self.ack_overhead < 1:
            raise ValueError(f"--ack-overhead {self.ack_overhead:g}: must be in [0, 1) bytes per "
                             "byte. Fix: 0.0218 for TCP with delayed ACKs, 0 for RDMA")

    def network(self, cost: CostModel) -> Cluster:
        """The cluster to simulate on: ``--cluster``'s, else the cost model's two tiers."""
        return Cluster.load(self.cluster) if self.cluster else Cluster.two_tier(cost)

    def kwargs(self) -> dict:
        """:class:`JobSim`'s keyword arguments."""
        return {"eager_limit": self.eager_limit, "link_sharing": self.link_sharing,
                "ack_overhead": self.ack_overhead}

#: a flow whose remaining bytes fall below this is done (floating-point slack)
_EPS_BYTES = 1e-6

#: ranks from which :meth:`JobSim.run` runs the compiled network by default: below, the Python
#: loop ends sooner than Numba's cache loads (about 0.2 s; compiling it the first time after a
#: change: about 20 s)
COMPILED_FROM_RANKS = 32

#: the operations of a rank's thread (:meth:`JobSim._program_ops`)
(_OP_SLEEP, _OP_NEW, _OP_DONE, _OP_WAIT, _OP_OFFLOAD, _OP_STREAM, _OP_DRAIN, _OP_SEND, _OP_RECV,
 _OP_CALL, _OP_STEP, _OP_ERROR) = range(12)


@dataclass(eq=False)
class _Req:
    """A request (a send, a receive, a call on the stream): done at ``t``."""

    done: bool = False
    t: float = math.nan
    waiters: list = field(default_factory=list)


@dataclass(eq=False)
class _Msg:
    src: int
    dst: int
    nbytes: float
    send: _Req
    recv: _Req | None = None
    arrived: bool = False
    eager: bool = True
    rem: float = 0.0
    rate: float = 0.0
    links: tuple = ()
    ack: bool = False               # the transport's acknowledgements of a message, no data


@dataclass(eq=False)
class _Proc:
    """A generator of one rank's thread (main or a stream call) and what it waits for."""

    gen: object
    rank: int
    waiting: int = 0


class JobSim:
    """Simulate ``programs`` (one per world rank) together.

    Parameters
    ----------
    programs : list of list
        Every rank's program (:mod:`substrate.program`), as a compute profile stores them.
    node_of : sequence of int
        Node of every world rank (any placement).
    cost : CostModel
        α and β of the intra- and inter-node links.
    charge : list of callables
        ``charge[r](label, k)``: the seconds rank r's profile charges event ``(label, k)``
        (``None`` when it lacks it: the replay measures that block, ~0 s; charged 0 here).
        A charge with a ``new_step()`` method is told when its rank's step ends (a run's own
        measurements, one table a step).
    eager_limit : float
        Messages of at most this many bytes use the eager protocol (default: all of them).
        UCX 1.20's protocol table for TCP (``UCX_PROTO_INFO=y``, two ranks on one host) lists
        rendezvous from 259,132 bytes, yet the wire lab's SSFusion runs, whose all-gather
        blocks are 838,864 bytes, measured what the all-eager simulation predicts (0.976-0.983
        of it at 2 x 2 to 16 x 1) and not the rendezvous one (1.155 at 2 x 2): the default
        follows the measurement.
    link_sharing : {"fifo", "fair"}
        How messages share a node's uplink and downlink: first in, first out (default; TCP
        through one deep FIFO queue per port, the wire lab) or max-min fair (per-flow fair
        queueing).  See the module's docstring.
    record_events : bool
        Keep every rank's compute blocks and calls with their simulated start and end
        (:attr:`events`: what ``--trace`` writes).
    ack_overhead : float
        Bytes (at the inter-node rate) the receiving node sends back over the reverse links per
        byte of an inter-node message: the transport's acknowledgements.  When a message has
        arrived, ``ack_overhead`` x its bytes leave the receiver's node for the sender's, in
        the links' queues like any message (nobody waits for them).  Default 0 (RDMA: an
        acknowledgement per message, negligible).  TCP with delayed ACKs sends one 66-byte frame
        (Ethernet, IP, TCP with timestamps) per two 1514-byte data frames: 66 / 3028 = 0.0218
        (:func:`lab.analysis.tcp_ack_overhead`); the wire lab's counters show it (a 2 x 2 ddp
        replay: one host's 55,749 frames for 37,383 full segments, about 18,366 ACKs, 0.0214).  Where both
        directions of a link carry data (rings, all-to-alls) it slows every transfer by that
        fraction.
    """

    def __init__(self, programs, node_of, cost: CostModel | Cluster, charge, *,
                 eager_limit: float = math.inf, link_sharing: str = "fifo",
                 ack_overhead: float | None = None, record_events: bool = False,
                 start=None) -> None:
        if len(programs) != len(node_of) or len(charge) != len(programs):
            raise ValueError(f"JobSim: {len(programs)} programs, {len(node_of)} node entries "
                             f"and {len(charge)} profiles: give one of each per rank")
        if link_sharing not in LINK_SHARING:
            raise ValueError(f"JobSim: link_sharing {link_sharing!r} is not one of "
                             f"{', '.join(LINK_SHARING)}")
        cluster = cost if isinstance(cost, Cluster) else Cluster.two_tier(cost)
        if ack_overhead is None:
            ack_overhead = cluster.library.ack_overhead
        if not 0 <= ack_overhead < 1:
            raise ValueError(f"JobSim: ack_overhead {ack_overhead!r} must be in [0, 1) bytes "
                             "per byte (TCP with delayed ACKs: 0.0218; RDMA: 0)")
        if link_sharing == "fifo" and any(t.oversubscription > 1 for t in cluster.tiers):
            raise ValueError(f"JobSim: {cluster.path or cluster.name} has oversubscribed switch "
                             "tiers, which the FIFO links do not model: simulate it with "
                             "link_sharing='fair' (--link-sharing fair)")
        self.cluster = cluster
        self._call_s = cluster.library.call_us * 1e-6
        self._shared_fabric = cluster.node.fabric == "pcie"
        self.link_sharing = link_sharing
        self.ack_overhead = float(ack_overhead)
        #: bytes the acknowledgements moved (not in :attr:`moved`: the ledger books payload)
        self.ack_bytes = 0.0
        self.programs = programs
        self.node_of = [int(n) for n in node_of]
        self.cost = cluster.cost_model()
        # each rank's NIC: (node, nic), its node's ranks spread evenly over the node's NICs
        local, size = {}, {}
        for n in self.node_of:
            size[n] = size.get(n, 0) + 1
        self.port_of = []
        for n in self.node_of:
            k = local.get(n, 0)
            local[n] = k + 1
            self.port_of.append((n, cluster.nic_of(k, size[n])))
        self._latency: dict = {}            # (node, node) -> seconds
        self.charge = charge
        self.eager_limit = float(eager_limit)
        self.now = 0.0
        self.steps: list[list[float]] = [[] for _ in programs]
        # when each rank begins its program (a job simulated in pieces: where it ended the
        # last piece, from the earliest rank; default every rank at 0)
        self.start = [0.0] * len(programs) if start is None else [float(t) for t in start]
        if len(self.start) != len(programs) or min(self.start, default=0.0) < 0:
            raise ValueError(f"JobSim: start needs one time >= 0 per rank ({len(programs)}), "
                             f"got {start!r}")
        self._ready: deque = deque()
        self._timers: list = []
        self._seq = 0
        self._flows: list[_Msg] = []
        self._rates_stale = False
        self._pair_busy: dict = {}          # (src, dst) -> a message moving on that connection
        self._pair_queue: dict = {}         # (src, dst) -> messages waiting for it
        self._uplink: dict = {}             # node -> messages in its uplink's FIFO (head moves)
        self._downlink: dict = {}           # node -> [W bytes waiting, input rate, at time]
        self._sends: dict = {}              # match key -> unmatched messages
        self._recvs: dict = {}              # match key -> unmatched receives
        self._alive = 0
        self._schedules: dict = {}          # id(call) -> its schedule, group number, members
        self._groups: dict = {}             # group -> (its number, {rank: member index})
        self._a2a: dict = {}                # (group, n) -> members' rows of an all-to-all
        self._a2a_count: dict = {}          # (group, rank) -> all-to-alls it has entered
        self._calls: dict = {}              # id(call dict) -> its Call
        #: bytes moved inside nodes and between them (the ledger's wire bytes, a check)
        self.moved = {"intra": 0.0, "inter": 0.0}
        #: with ``record_events``: every rank's compute blocks and calls, ``{"label", "kind",
        #: "lane", "start", "finish", "step", ...}`` (a call: its phase, bytes, algorithm)
        self.events = [[] for _ in programs] if record_events else None
        #: run FIFO links compiled (:mod:`simulation.jobsim_kernel`, the same results bit for
        #: bit) where Numba is installed: None (default) from :data:`COMPILED_FROM_RANKS` ranks
        #: on, True at any size, False never (the Python loop below, the reference)
        self.compiled: bool | None = None
        #: what the compiled run counted: ``{"messages", "timers", "thread turns"}`` (messages
        #: with the acknowledgements'); None after the Python loop
        self.counts = None

    # -- requests and processes ------------------------------------------------------------------
    def _complete(self, req: _Req) -> None:
        req.done, req.t = True, self.now
        for proc in req.waiters:
            proc.waiting -= 1
            if proc.waiting == 0:
                self._ready.append(proc)
        req.waiters = []

    def _spawn(self, gen, rank: int) -> None:
        self._alive += 1
        self._ready.append(_Proc(gen, rank))

    def _at(self, t: float, fn) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (t, self._seq, fn))

    def _step(self, proc: _Proc) -> None:
        """Run ``proc`` until it waits."""
        while True:
            try:
                what, arg = next(proc.gen)
            except StopIteration:
                self._alive -= 1
                return
            if what == "sleep":
                if arg > 0:
                    self._at(self.now + arg, lambda p=proc: self._ready.append(p))
                    return
                continue
            pending = [q for q in arg if not q.done]
            if not pending:
                continue
            proc.waiting = len(pending)
            for q in pending:
                q.waiters.append(proc)
            return

    # -- messages --------------------------------------------------------------------------------
    def _send(self, src: int, dst: int, key, nbytes: float) -> _Req:
        req = _Req()
        if src == dst:                  # a local copy
            self._complete(req)
            m = _Msg(src, dst, nbytes, req, arrived=True)
            self._match_send(key, m)
            return req
        m = _Msg(src, dst, float(nbytes), req, eager=nbytes <= self.eager_limit)
        if m.eager:
            self._complete(req)
            self._launch(m, self.now)
        self._match_send(key, m)
        return req

    def _match_send(self, key, m: _Msg) -> None:
        waiting = self._recvs.get(key)
        if waiting:
            self._matched(m, waiting.popleft())
        else:
            self._sends.setdefault(key, deque()).append(m)

    def _recv(self, src: int, dst: int, key) -> _Req:
        req = _Req()
        waiting = self._sends.get(key)
        if waiting:
            self._matched(waiting.popleft(), req)
        else:
            self._recvs.setdefault(key, deque()).append(req)
        return req

    def _matched(self, m: _Msg, recv: _Req) -> None:
        m.recv = recv
        if m.arrived:
            self._complete(recv)
        elif not m.eager:               # rendezvous: the data leaves once both are posted,
            self._launch(m, self.now + self._alpha(m))   # after the handshake

    def _alpha(self, m: _Msg) -> float:
        a, b = self.node_of[m.src], self.node_of[m.dst]
        if a == b:
            return self.cost.intra_lat
        t = self._latency.get((a, b))
        if t is None:
            t = self._latency[(a, b)] = self.cluster.inter_latency(a, b)
        return t

    def _launch(self, m: _Msg, t: float) -> None:
        """The message leaves at ``t``: one latency later it moves, after the pair's earlier
        messages (one connection)."""
        self._at(t + self._alpha(m), lambda: self._queue(m))

    def _queue(self, m: _Msg) -> None:
        pair = (m.src, m.dst)
        if self.link_sharing == "fifo" and self.node_of[m.src] != self.node_of[m.dst]:
            self._move(m)               # the uplink's FIFO keeps a connection's order
            return
        if pair in self._pair_busy:
            self._pair_queue.setdefault(pair, deque()).append(m)
            return
        self._move(m)

    def _move(self, m: _Msg) -> None:
        a, b = self.node_of[m.src], self.node_of[m.dst]
        fifo = self.link_sharing == "fifo" and (a != b or self._shared_fabric)
        if not (fifo or m.ack):
            self._pair_busy[(m.src, m.dst)] = m
        if a == b:
            m.links = (("pcie", a),) if self._shared_fabric else (("intra", m.src, m.dst),)
        else:
            up, down = self.port_of[m.src], self.port_of[m.dst]
            m.links = (("up", up), *self._tier_links(a, b), ("down", down))
        if not m.ack:
            self.moved["intra" if a == b else "inter"] += m.nbytes
        m.rem = m.nbytes
        if m.rem <= _EPS_BYTES:
            self._arrive(m)
            return
        if fifo:
            port = m.links[0]
            queue = self._uplink.setdefault(port, deque())
            queue.append(m)
            if len(queue) == 1:
                self._uplink_send(port)
            return
        if m.links[0][0] == "intra":    # a link of its own, one message at a time: full rate
            self._at(self.now + m.nbytes / self.cost.intra_bw, lambda: self._arrive(m))
            return
        self._flows.append(m)
        self._rates_stale = True

    def _tier_links(self, a: int, b: int) -> tuple:
        """The switch tiers' links a message from node ``a`` to node ``b`` crosses: up from
        ``a``'s switch and down into ``b``'s at every tier it climbs."""
        tiers = self.cluster.tiers
        out_up, out_down = [], []
        for k in self.cluster.switches_between(a, b):
            n = tiers[k].nodes
            out_up.append(("tier", k, a // n, "up"))
            out_down.append(("tier", k, b // n, "down"))
        return (*out_up, *reversed(out_down))

    # -- FIFO links ------------------------------------------------------------------------------
    def _downlink_input(self, port, rate: float) -> None:
        """NIC ``port``'s downlink queue brought up to now, then its input changed by
        ``rate``: W bytes wait, growing at input - β while it exceeds β or W > 0."""
        d = self._downlink.setdefault(port, [0.0, 0.0, self.now])
        d[0] = max(0.0, d[0] + (d[1] - self.cost.inter_bw) * (self.now - d[2]))
        d[1] += rate
        d[2] = self.now

    def _uplink_send(self, link) -> None:
        """The head of an uplink moves: a NIC's at β into its destination NIC's downlink; a
        node's shared fabric (PCIe) at its rate, straight to the destination."""
        m = self._uplink[link][0]
        if link[0] == "pcie":
            self._at(self.now + m.nbytes / self.cost.intra_bw,
                     lambda: self._fabric_sent(link, m))
            return
        dst = m.links[-1][1]
        self._downlink_input(dst, self.cost.inter_bw)
        self._at(self.now + m.nbytes / self.cost.inter_bw,
                 lambda: self._uplink_sent(link, m, dst))

    def _fabric_sent(self, link, m: _Msg) -> None:
        self._arrive(m)
        self._next_on(link)

    def _next_on(self, link) -> None:
        queue = self._uplink[link]
        queue.popleft()
        if queue:
            self._uplink_send(link)

    def _uplink_sent(self, link, m: _Msg, dst) -> None:
        """``m``'s last byte reaches ``dst``'s downlink behind the W bytes waiting there: it
        arrives W / β later."""
        self._downlink_input(dst, -self.cost.inter_bw)
        wait = self._downlink[dst][0] / self.cost.inter_bw
        if wait > 0:
            self._at(self.now + wait, lambda: self._arrive(m))
        else:
            self._arrive(m)
        self._next_on(link)

    def _arrive(self, m: _Msg) -> None:
        m.arrived = True
        if m.ack:
            return
        if self.ack_overhead and self.node_of[m.src] != self.node_of[m.dst] and m.nbytes > 0:
            ack = _Msg(m.dst, m.src, self.ack_overhead * m.nbytes, _Req(), ack=True)
            self.ack_bytes += ack.nbytes
            self._move(ack)             # leaves the receiver's node now, behind its queue
        pair = (m.src, m.dst)
        if self._pair_busy.get(pair) is m:
            del self._pair_busy[pair]
        if not m.eager:
            self._complete(m.send)
        if m.recv is not None:
            self._complete(m.recv)
        queue = self._pair_queue.get(pair)
        if queue and pair not in self._pair_busy:
            self._move(queue.popleft())

    def _capacity(self, link) -> float:
        if link[0] in ("intra", "pcie"):
            return self.cost.intra_bw
        if link[0] == "tier":           # a switch's uplink (or downlink) of its tier
            t = self.cluster.tiers[link[1]]          # what its nodes' NICs can send, narrowed
            return t.nodes * self.cluster.node.nics * self.cost.inter_bw / t.oversubscription
        return self.cost.inter_bw

    def _set_rates(self) -> None:
        """Max-min fair rates (progressive filling: the link with the least share per message
        fixes its messages' rates, which leave the other links they cross)."""
        cap: dict = {}
        users: dict = {}
        for m in self._flows:
            for link in m.links:
                if link not in cap:
                    cap[link] = self._capacity(link)
                    users[link] = []
                users[link].append(m)
        left = {link: len(flows) for link, flows in users.items()}
        fixed: set = set()
        while left:
            best = min(left, key=lambda link: cap[link] / left[link])
            # (rounding may leave a link's last share a hair below zero)
            share = max(cap[best] / left[best], 1e-12 * self._capacity(best))
            for f in users[best]:
                if id(f) in fixed:
                    continue
                fixed.add(id(f))
                f.rate = share
                for link in f.links:
                    if link in left:
                        cap[link] -= share
                        left[link] -= 1
                        if not left[link]:
                            del left[link]
            left.pop(best, None)
        self._rates_stale = False

    # -- the simulation --------------------------------------------------------------------------
    def run(self) -> list[list[float]]:
        """Simulate every program to its end; returns each rank's times at its step
        boundaries."""
        ops = [self._program_ops(r) for r in range(len(self.programs))]
        for r, t in enumerate(self.start):
            if t > 0:
                ops[r].insert(0, (_OP_SLEEP, t))
        compiled = len(self.programs) >= COMPILED_FROM_RANKS if self.compiled is None \
            else self.compiled
        if compiled and self.link_sharing == "fifo" and self.events is None \
                and type(self) is JobSim:
            try:
                from . import jobsim_kernel  # noqa: PLC0415 (Numba, loaded when used)
            except ImportError:
                jobsim_kernel = None
            if jobsim_kernel is not None:
                try:
                    stuck = jobsim_kernel.simulate(self, ops)
                except NotImplementedError:
                    pass
                else:
                    if stuck is not None:
                        self._stuck(stuck)
                    return self.steps
        for r in range(len(self.programs)):
            self._spawn(self._rank(r, ops[r]), r)
        while True:
            while self._ready:
                self._step(self._ready.popleft())
            if self._rates_stale:
                self._set_rates()
            first = min(self._flows, key=lambda m: m.rem / m.rate, default=None)
            dt_flow = first.rem / first.rate if first is not None else math.inf
            t_timer = self._timers[0][0] if self._timers else math.inf
            if dt_flow == math.inf and t_timer == math.inf:
                break
            # the next event: the first flow to finish (ended exactly, whatever the rounding
            # of now + dt) or the next timer
            dt = dt_flow if self.now + dt_flow <= t_timer else max(0.0, t_timer - self.now)
            for m in self._flows:
                m.rem -= m.rate * dt
            if dt == dt_flow:
                first.rem = 0.0
            self.now = max(self.now + dt, self.now) if dt == dt_flow else max(t_timer, self.now)
            done = [m for m in self._flows if m.rem <= _EPS_BYTES + 1e-9 * m.nbytes]
            if done:
                gone = {id(m) for m in done}
                self._flows = [m for m in self._flows if id(m) not in gone]
                self._rates_stale = True
                for m in done:
                    self._arrive(m)
            while self._timers and self._timers[0][0] <= self.now:
                heapq.heappop(self._timers)[2]()
        if self._alive:
            self._stuck(sorted({p.rank for p in self._waiting_procs()}))
        return self.steps

    @staticmethod
    def _stuck(ranks: list) -> None:
        raise RuntimeError(f"JobSim: ranks {ranks} wait for messages nobody sends (the "
                           "programs do not match: record them again from one run)")

    def _waiting_procs(self):
        seen = []
        for queue in self._recvs.values():
            for req in queue:
                seen.extend(req.waiters)
        return seen

    # -- what a rank does ------------------------------------------------------------------------
    def _call(self, c) -> Call:
        """The record of a program's call entry (a recorded program holds its dict; cached by
        its identity, which the programs keep for the whole simulation)."""
        if isinstance(c, Call):
            return c
        hit = self._calls.get(id(c))
        if hit is None:
            hit = self._calls[id(c)] = Call.from_dict(c)
        return hit

    def _program_ops(self, r: int) -> list:
        """Rank ``r``'s program as the operations its thread performs, one tuple each (the
        ``_OP_*`` kinds), as the executor (:class:`substrate.executor.Executor`) runs it:
        compute-stream blocks one after the other, each after its dependencies; an
        offload-stream block on the rank's CPU worker, in order, after its dependencies, while
        the thread goes on; calls issued without waiting on the communication stream, in order.

        Everything that does not depend on the simulated time is decided here, once: each
        block's charge (``charge[r](key, k)`` per occurrence in program order, ``new_step()`` at
        each ``S``), what a clock block sleeps after its layers and nested blocks, which entries
        a dependency, ``W`` or ``A`` names hold a request at that point of the step (a handle
        is an entry's index; the others are ignored), which calls go on the stream.  Both
        engines (:meth:`_rank` and :mod:`simulation.jobsim_kernel`) run these operations."""
        charge = self.charge[r]
        new_step = getattr(charge, "new_step", None)
        occurrences: dict = {}
        blocks: list = []                   # open blocks: [kind, cost, inner, entry, label]
        held: set = set()                   # entries holding a request in this step
        ops: list = []
        prog = self.programs[r]
        skip_to = -1
        for i, e in enumerate(prog):
            if i <= skip_to:
                continue
            kind = e[0]
            if kind == "B":
                key = e[3]
                k = occurrences.get(key, 0)
                occurrences[key] = k + 1
                c = float(charge(key, k) or 0.0)
                deps = tuple(d for d in e[4] if d in held)
                held.add(i)
                if e[5] == "offload":       # the CPU worker: the block, whole, beside the thread
                    ops.append((_OP_OFFLOAD, i, deps, c, e[2]))
                    try:
                        skip_to = self._end(r, i)
                    except ValueError as err:
                        ops.append((_OP_ERROR, err))
                        break
                    continue
                if deps:
                    ops.append((_OP_WAIT, deps))
                ops.append((_OP_NEW, i))
                blocks.append([e[1], c, 0.0, i, e[2]])
                if e[1] == "layer":
                    for b in blocks[:-1]:   # the clock blocks around leave it out
                        b[2] += c
                    ops.append((_OP_SLEEP, c))
            elif kind == "E":
                what, c, inner, j, label = blocks.pop()
                if what == "clock":
                    for b in blocks:        # a nested block's whole cost
                        b[2] += c
                    ops.append((_OP_SLEEP, max(0.0, c - inner)))
                ops.append((_OP_DONE, j, label))
            elif kind == "C":
                call, _after, member, wait, tag = e[1:]
                if not member:              # the leaders' call seen from a follower
                    continue
                call = self._call(call)
                a = call.algorithm
                if not wait and a in ("allreduce", "bcast", "allgather") \
                        and len(set(call.blocks or [0])) == 1:
                    held.add(i)
                    ops.append((_OP_STREAM, i, call))
                    continue
                ops.append((_OP_DRAIN,))    # a blocking call drains the stream first
                if a == "p2p":
                    (src, dst, nbytes), = call.pairs.tolist()
                    if self._call_s:            # the library's software overhead of a call
                        ops.append((_OP_SLEEP, self._call_s))
                    held.add(i)
                    ops.append((_OP_SEND, i, src, dst, ("p2p", call.group, tag, src, dst),
                                nbytes))
                    continue
                ops.append((_OP_CALL, call))
            elif kind == "W":
                if e[1] in held:
                    ops.append((_OP_WAIT, (e[1],)))
            elif kind == "R":
                source, _nbytes, tag, group = e[1:]
                held.add(i)
                ops.append((_OP_RECV, i, source, ("p2p", tuple(group), tag, source, r)))
            elif kind == "A":
                deps = tuple(j for j in e[1] if j in held)
                if deps:
                    ops.append((_OP_WAIT, deps))
            elif kind == "S":
                ops.append((_OP_STEP,))
                occurrences = {}
                held = set()
                if new_step is not None:
                    new_step()
        return ops

    def _rank(self, r: int, ops: list):
        """Rank ``r``'s thread: its operations (:meth:`_program_ops`) in simulated time."""
        handles: dict = {}                  # entry -> request (calls, blocks, receives)
        stream = None                       # the last call on the communication stream
        offload = None                      # the last block on the offload stream
        events = self.events is not None
        starts: dict = {}                   # entry -> its block's start (``record_events``)
        for op in ops:
            kind = op[0]
            if kind == _OP_SLEEP:
                yield "sleep", op[1]
            elif kind == _OP_NEW:
                handles[op[1]] = _Req()
                if events:
                    starts[op[1]] = self.now
            elif kind == _OP_DONE:
                self._complete(handles[op[1]])
                if events:
                    self._event(r, op[2], "compute", "compute", starts.pop(op[1]))
            elif kind == _OP_WAIT:
                yield "wait", [handles[d] for d in op[1]]
            elif kind == _OP_OFFLOAD:
                h = _Req()
                self._spawn(self._offloaded(op[3], [offload, *(handles[d] for d in op[2])], h,
                                            r, op[4]), r)
                offload = handles[op[1]] = h
            elif kind == _OP_STREAM:
                h = _Req()
                self._spawn(self._on_stream(r, op[2], stream, h), r)
                stream = handles[op[1]] = h
            elif kind == _OP_DRAIN:
                if stream is not None and not stream.done:
                    yield "wait", [stream]
            elif kind == _OP_SEND:
                handles[op[1]] = self._send(*op[2:])
            elif kind == _OP_RECV:
                handles[op[1]] = self._recv(op[2], r, op[3])
            elif kind == _OP_CALL:
                t0 = self.now
                yield from self._collective(r, op[1])
                if events:
                    call = op[1]
                    self._event(r, call.label or call.phase, "call", "calls", t0, call)
            elif kind == _OP_STEP:
                self.steps[r].append(self.now)
            else:
                raise op[1]

    def _end(self, r: int, i: int) -> int:
        """Index of the ``E`` that closes block ``i`` of rank ``r``'s program."""
        depth, prog = 0, self.programs[r]
        for j in range(i, len(prog)):
            if prog[j][0] == "B":
                depth += 1
            elif prog[j][0] == "E":
                depth -= 1
                if not depth:
                    return j
        raise ValueError(f"JobSim: rank {r}'s block {i} never ends")

    def _offloaded(self, cost: float, before: list, h: _Req, r: int, label: str):
        """An offload-stream block: after the worker's previous block and its dependencies,
        ``cost`` seconds on the worker."""
        pending = [q for q in before if q is not None and not q.done]
        if pending:
            yield "wait", pending
        t0 = self.now
        yield "sleep", cost
        self._complete(h)
        if self.events is not None:
            self._event(r, label, "compute", "offload", t0)

    def _on_stream(self, r: int, call: Call, before: _Req | None, h: _Req):
        if before is not None and not before.done:
            yield "wait", [before]
        t0 = self.now
        yield from self._collective(r, call)
        self._complete(h)
        if self.events is not None:
            self._event(r, call.label or call.phase, "call", "stream", t0, call)

    def _event(self, r: int, label: str, kind: str, lane: str, t0: float,
               call: Call | None = None) -> None:
        """Keep what rank ``r`` did from ``t0`` to now (``record_events``), in its step."""
        ev = {"label": label, "kind": kind, "lane": lane, "start": t0, "finish": self.now,
              "step": len(self.steps[r])}
        if call is not None:
            ev.update(phase=call.phase, nbytes=call.nbytes, algorithm=call.algorithm)
        self.events[r].append(ev)

    def _collective(self, r: int, call: Call):
        """Rank ``r``'s rounds of the call's schedule (:func:`substrate.schedule.of_call`, the
        rounds :mod:`substrate.collectives` executes): per round its sends leave (eager) and
        its receives are posted, and it waits for all of them."""
        if call.algorithm == "alltoallv":
            yield from self._alltoallv(r, call)
            return
        sched, key, member = self._schedule(call)
        group = call.group
        i = self._member(call, member, r)
        if self._call_s and call.size > 1:     # the library's software overhead of a call
            yield "sleep", self._call_s
        for rnd in sched.rounds(i):
            reqs = [self._send(r, group[q], (key, r, group[q]), hi - lo)
                    for q, lo, hi in rnd.sends]
            reqs += [self._recv(group[q], r, (key, group[q], r)) for q, _, _ in rnd.recvs]
            yield "wait", reqs

    def _alltoallv(self, r: int, call: Call):
        """Rank ``r``'s part of a personalized all-to-all (:func:`substrate.schedule.alltoallv`:
        its sends to ``i+1, i+2, ...``, its receives from ``i-1, i-2, ...``).  A member's record
        holds its own row of the byte matrix only (what it knows before the call); the column it
        receives is the other members' rows, so its receives are posted once every member has
        entered the same call (the n-th all-to-all of the group on each)."""
        group, p = call.group, call.size
        key, member = self._group(call)
        i = self._member(call, member, r)
        n = self._a2a_count[(group, r)] = self._a2a_count.get((group, r), 0) + 1
        slot = self._a2a.setdefault((group, n), ({}, _Req()))
        rows, everyone = slot
        rows[i] = np.asarray(call.blocks, dtype=np.int64).reshape(p, p)[i]
        if len(rows) == p:
            self._complete(everyone)
            del self._a2a[(group, n)]
        if self._call_s and p > 1:
            yield "sleep", self._call_s
        row = rows[i]
        reqs = [self._send(r, group[j], (key, r, group[j]), int(row[j]))
                for j in ((i + k) % p for k in range(1, p)) if row[j]]
        if not everyone.done:
            yield "wait", [everyone]
        reqs += [self._recv(group[j], r, (key, group[j], r))
                 for j in ((i - k) % p for k in range(1, p)) if rows[j][i]]
        yield "wait", reqs

    def _schedule(self, call: Call):
        """The schedule of a call, its group's number and every member's index
        (:meth:`_group`), cached by the record's identity."""
        hit = self._schedules.get(id(call))
        if hit is None:
            hit = self._schedules[id(call)] = (schedule.of_call(call), *self._group(call))
        return hit

    def _group(self, call: Call) -> tuple:
        """The number of the call's group (its messages' match key: one number a group, not
        the group's members, which a message would hash each time) and every member's index."""
        group = self._groups.get(call.group)
        if group is None:
            group = self._groups[call.group] = (
                len(self._groups), {r: i for i, r in enumerate(call.group)})
        return group

    @staticmethod
    def _member(call: Call, member: dict, r: int) -> int:
        i = member.get(r)
        if i is None:
            raise ValueError(f"JobSim: rank {r} runs call {call.label or call.phase} of group "
                             f"{call.group}, which it is not in (the programs do not match)")
        return i


def job_steps(boundaries: list[list[float]], rank: int = 0) -> list[float]:
    """Lengths of the steps of ``rank`` (the lab measures rank 0's) from :meth:`JobSim.run`'s
    step boundaries."""
    t = boundaries[rank]
    return [b - a for a, b in zip([0.0, *t[:-1]], t)]


def simulate_profile(doc: dict, node_of, cost: CostModel | Cluster, *,
                     eager_limit: float = math.inf, link_sharing: str = "fifo",
                     ack_overhead: float | None = None) -> dict:
    """Every rank's program of the compute profile ``doc`` (:func:`simulation.profile.
    load_profile`) simulated together on the placement ``node_of`` with ``cost``'s links, each
    rank's blocks charged as its replay charges them (:class:`~simulation.profile.
    ProfileSource`).  Returns ``{"step_s": [...], "bytes": {"intra", "inter"}, ...}``: the
    lengths of rank 0's steps of the run loop (what a run's metrics lines measure; an
    evaluation's or the run's closing work in ``other_steps_s`` by kind) and the bytes moved."""
    programs = doc.get("programs")
    if programs is None:
        raise ValueError(f"compute profile {doc.get('path', '')}: holds no programs (recorded "
                         "by an older spardist); record it again with "
                         "--compute-profile-out")
    n = len(programs)
    if len(node_of) != n:
        raise ValueError(f"compute profile {doc.get('path', '')}: recorded on {n} ranks, the "
                         f"placement has {len(node_of)}; give a placement of {n} ranks")
    t0 = time.perf_counter()
    sim = JobSim(programs, node_of, cost, [ProfileSource(doc, r, n).cost for r in range(n)],
                 eager_limit=eager_limit, link_sharing=link_sharing,
                 ack_overhead=ack_overhead)
    steps = job_steps(sim.run())
    kinds = doc.get("step_kinds") or ["unit"] * len(steps)
    if len(kinds) != len(steps):
        raise ValueError(f"compute profile {doc.get('path', '')}: names the kinds of "
                         f"{len(kinds)} steps, its programs hold {len(steps)}; record it again")
    return {"step_s": [t for t, k in zip(steps, kinds) if k == "unit"],
            "other_steps_s": {k: [t for t, kk in zip(steps, kinds) if kk == k]
                              for k in sorted(set(kinds) - {"unit"})},
            "model": "simulation.jobsim: exact collectives' messages, eager "
            f"protocol up to eager_limit, {link_sharing} node links, acknowledgements "
            f"{sim.ack_overhead:g} of the bytes",
            "eager_limit": None if math.isinf(eager_limit) else eager_limit,
            "link_sharing": link_sharing, "ack_overhead": sim.ack_overhead,
            "cluster": sim.cluster.describe(),
            "ack_bytes": sim.ack_bytes,
            "bytes": dict(sim.moved), "seconds": time.perf_counter() - t0}
