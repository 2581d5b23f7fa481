"""Event timeline of one rank: compute and communication events with dependencies, shared links,
and the step time as the critical path.

The additive clock (``sim = compute + Σ α–β``) cannot show overlap (DDP buckets all-reduced while
the backward runs, SSFusion's interleaved fusion buffers, H-SGD's non-blocking messages, PruneX's
pipelined intra/inter phases) nor contention (two collectives on one link at once).  A
:class:`Timeline` takes the events of one step of one rank, each with the events it waits for,
and schedules them on its resources:

* **streams** ``"compute"`` and ``"offload"`` (a CPU thread that sparsifies or packs while the
  compute stream goes on): each runs its events one at a time, **in declaration order** (an
  in-order stream, like a CUDA stream or the one Python thread that executes them);
* **links** ``"intra"`` and ``"inter"`` (:data:`substrate.costmodel.LINKS`): a transfer first
  waits its latency part ``L`` (the α terms of its algorithm) and then moves its bandwidth part
  ``W`` (the β terms: seconds at the full link rate).  The ``k`` transfers in their bandwidth
  part on one link at the same time each progress at rate ``1/k`` (processor sharing, which is
  the max–min fair share when every transfer uses one link), so two equal transfers that start
  together both finish after ``2W`` (+ ``L``).  Alone, a transfer takes exactly the cost model's
  time ``L + W``;
* **joins** (no resource, no duration): markers such as "bucket 3's gradients are ready".

``L`` and ``W`` of a collective come from :class:`substrate.costmodel.CostModel`'s own formulas
(``ring_allreduce_time``, ``ring_allgather_time``, ``bcast_time``, ``barrier_time``,
``p2p_time``) evaluated once with the bandwidths set to infinity (``L``) and once with the
latencies set to zero (``W``); no formula is repeated here.

Dependencies can only name events declared earlier in the same step, so every step is a DAG by
construction.  :meth:`Timeline.step` schedules the step (event-driven simulation, every event
starts as soon as its dependencies are done and its resource lets it) and returns a
:class:`StepTiming`: the step time (the critical path: the finish of the last event), compute,
link busy time, exposed communication and the no-overlap sum ``Σ compute + Σ (L + W)`` that the
additive clock reported.  Hierarchical schemes chain their phases through dependencies
(``inter = tl.transfer(..., deps=[intra])``); nothing in the engine knows a strategy.

Compute events are timed by a compute source (:mod:`substrate.compute`, compute profiles in
:mod:`substrate.profile`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .costmodel import INTER, INTRA, LINKS, CostModel

__all__ = [
    "ALGORITHMS",
    "STREAMS",
    "Event",
    "EventRecord",
    "StepTiming",
    "Timeline",
    "transfer_parts",
]


#: Serial resources: the compute stream and an offload thread.
STREAMS = ("compute", "offload")
#: Algorithms whose time a transfer can take from the cost model (``nbytes`` meaning in brackets):
#: ring all-reduce [buffer], ring all-gather(v) [total gathered], binomial bcast [buffer],
#: dissemination barrier [ignored], ``messages`` direct messages [their total].
ALGORITHMS = ("allreduce", "allgather", "bcast", "barrier", "p2p")

_TOL = 1e-12


@lru_cache(maxsize=64)
def _split_models(cost: CostModel) -> tuple[CostModel, CostModel]:
    """``cost`` with infinite bandwidths (its α terms only) and with zero latencies (β only)."""
    return (replace(cost, intra_bw=math.inf, inter_bw=math.inf),
            replace(cost, intra_lat=0.0, inter_lat=0.0))


def transfer_parts(cost: CostModel, algorithm: str, nbytes: float, link: str, *, p: int = 2,
                   messages: int = 1) -> tuple[float, float]:
    """``(L, W)``: the latency and bandwidth parts of one call under ``cost``.

    ``L + W`` is exactly the cost model's time of the call (e.g.
    ``ring_allreduce_time(n, p, link) = 2(p-1) α + 2(p-1)/p n β``): ``L`` is that formula with
    infinite bandwidth, ``W`` with zero latency.

    Parameters
    ----------
    algorithm : {"allreduce", "allgather", "bcast", "barrier", "p2p"}
        See :data:`ALGORITHMS`.
    nbytes : float
        Buffer bytes (all-reduce, bcast), total gathered bytes (all-gather), total bytes of the
        ``messages`` messages (p2p); ignored for a barrier.
    link : {"intra", "inter"}
        The link class (for a ring: its slowest link, as :class:`~substrate.comm.Comm` books it).
    p : int
        Ranks of the collective.
    messages : int
        Number of direct messages (p2p) sharing ``nbytes`` equally.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown transfer algorithm {algorithm!r}; use one of {ALGORITHMS}")
    if link not in LINKS:
        raise ValueError(f"unknown link class {link!r}; use one of {LINKS}")
    if not (isinstance(nbytes, (int, float)) and math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p (ranks of the collective) must be an integer >= 1, got {p!r}")
    if isinstance(messages, bool) or not isinstance(messages, int) or messages < 0:
        raise ValueError(f"messages must be an integer >= 0, got {messages!r}")
    lat_only, bw_only = _split_models(cost)

    def t(c: CostModel) -> float:
        if algorithm == "allreduce":
            return c.ring_allreduce_time(nbytes, p, link)
        if algorithm == "allgather":
            return c.ring_allgather_time(nbytes, p, link)
        if algorithm == "bcast":
            return c.bcast_time(nbytes, p, link)
        if algorithm == "barrier":
            return c.barrier_time(p, link)
        if messages == 0:
            if nbytes:
                raise ValueError(f"p2p transfer of {nbytes} bytes in 0 messages; pass "
                                 "messages >= 1")
            return 0.0
        return messages * c.p2p_time(nbytes / messages, link)

    return float(t(lat_only)), float(t(bw_only))


# -- events ----------------------------------------------------------------------------------------

@dataclass(eq=False)
class Event:
    """Handle of one declared event (pass it in ``deps`` of later events of the same step).

    ``start`` and ``finish`` (seconds from the start of the step) are set when the step is
    scheduled (:meth:`Timeline.schedule` / :meth:`Timeline.step`).
    """

    index: int
    label: str
    kind: str                 # "compute" | "transfer" | "wait" | "join"
    resource: str             # stream name, link class, or "none"
    deps: tuple
    seconds: float = 0.0      # compute duration
    latency_s: float = 0.0    # transfer: L
    work_s: float = 0.0       # transfer: W (seconds at the full link rate)
    phase: str | None = None
    nbytes: float = 0.0
    start: float = math.nan
    finish: float = math.nan
    order: tuple = ()         # place in its stream's order: (index,), or (after.index, k)
    _owner: object = field(default=None, repr=False)

    @property
    def standalone_s(self) -> float:
        """Duration with the resource to itself (``seconds`` or ``L + W``)."""
        return self.seconds if self.kind == "compute" else self.latency_s + self.work_s


@dataclass(frozen=True)
class EventRecord:
    """One scheduled event (for Gantt charts): label, kind, resource, start, finish."""

    label: str
    kind: str
    resource: str
    start: float
    finish: float
    phase: str | None = None
    nbytes: float = 0.0


@dataclass(frozen=True)
class StepTiming:
    """Schedule of one step of one rank (seconds).

    Attributes
    ----------
    step_s : float
        Critical path: the finish of the last event.
    compute_s, offload_s : float
        Σ durations on the compute stream / the offload thread.
    comm_s : float
        Σ standalone transfer times ``L + W`` (what the additive clock charged).
    comm_busy_s : dict
        Per link class, the time during which the link carried at least one transfer.
    exposed_comm_s : float
        Time during which some transfer was in flight and the compute stream was idle.
    no_overlap_s : float
        ``compute_s + offload_s + comm_s``: the additive clock's step time.
    events : tuple of EventRecord
    """

    step_s: float
    compute_s: float
    offload_s: float
    comm_s: float
    comm_busy_s: dict
    exposed_comm_s: float
    no_overlap_s: float
    events: tuple = ()

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "offload_s": self.offload_s,
                "comm_s": self.comm_s, "comm_busy_s": dict(self.comm_busy_s),
                "exposed_comm_s": self.exposed_comm_s, "no_overlap_s": self.no_overlap_s}


def _union_length(intervals) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection_length(xs, ys) -> float:
    """Length of (∪ xs) ∩ (∪ ys)."""
    return _union_length(xs) + _union_length(ys) - _union_length(list(xs) + list(ys))


def _check_seconds(what: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {v!r}")
    return float(v)


class Timeline:
    """Events of one rank, scheduled step by step (see the module docstring).

    Parameters
    ----------
    cost : CostModel, optional
        Needed by :meth:`transfer` (not by :meth:`transfer_seconds`).
    keep_events : bool
        Keep the :class:`EventRecord` list in every :class:`StepTiming` (for plots).
    keep_steps : int
        How many of the last steps' :class:`StepTiming` to keep in :attr:`history`.
    """

    def __init__(self, cost: CostModel | None = None, *, keep_events: bool = True,
                 keep_steps: int = 4) -> None:
        self.cost = cost
        self.keep_events = bool(keep_events)
        self._events: list[Event] = []
        self._token = object()        # identifies the open step
        self._placed: dict[int, int] = {}   # events placed after= each event of the open step
        self._sinks: dict[int, Event] = {}   # events of the open step nothing waits for yet
        self._blocking: list[Event] = []     # blocking calls the next compute event waits for
        self.steps = 0
        self.history: deque[StepTiming] = deque(maxlen=max(0, int(keep_steps)))
        self.totals = {"step_s": 0.0, "compute_s": 0.0, "offload_s": 0.0, "comm_s": 0.0,
                       "exposed_comm_s": 0.0, "no_overlap_s": 0.0}
        self._cache: tuple[int, StepTiming] | None = None

    # -- declaring events ------------------------------------------------------------------------
    def _deps(self, deps, label: str) -> tuple:
        if deps is None:
            deps = ()
        elif isinstance(deps, Event) or hasattr(deps, "event"):
            deps = (deps,)
        out = []
        for d in deps:
            d = getattr(d, "event", d)      # a communication Handle stands for its event
            if d is None:
                continue
            if not isinstance(d, Event):
                raise ValueError(f"event {label!r}: deps must be Event handles returned by this "
                                 f"timeline, got {type(d).__name__}")
            if d._owner is not self._token:
                raise ValueError(f"event {label!r} depends on {d.label!r}, which belongs to "
                                 "another timeline or to a step already closed with step(); "
                                 "an event can only wait for events of its own step")
            out.append(d)
        return tuple(out)

    def _add(self, **kw) -> Event:
        label = kw["label"]
        if not isinstance(label, str) or not label:
            raise ValueError(f"every event needs a non-empty string label, got {label!r}")
        order = kw.pop("order", None) or (len(self._events),)
        ev = Event(index=len(self._events), _owner=self._token, order=order, **kw)
        self._events.append(ev)
        for d in ev.deps:
            self._sinks.pop(d.index, None)
        self._sinks[ev.index] = ev
        self._cache = None
        return ev

    def frontier(self) -> list[Event]:
        """The open step's events no later event waits for: a call that waits for these waits
        for everything declared so far (a blocking call in program order)."""
        return list(self._sinks.values())

    def block(self, event: Event | None) -> None:
        """``event`` is a blocking call: the next compute event of the compute stream waits for
        it (the thread that issued it computes nothing until it returns)."""
        if event is not None:
            self._blocking.append(event)

    def compute(self, label: str, seconds: float, deps=(), stream: str = "compute",
                after: Event | None = None) -> Event:
        """A compute event of ``seconds`` on ``stream`` (``"compute"`` or ``"offload"``), after
        every event in ``deps`` and after the earlier events of the same stream.

        ``after``: place the event in its stream's order right after that (earlier declared)
        event of the same stream instead of at the end, e.g. a fusion buffer's sparsification
        launched on the compute stream as soon as the backward event that completes the buffer
        has run, before the rest of the backward (SSFusion's pipeline), when the events are
        declared after the backward (a plan laid on a paper-scale timeline,
        :func:`substrate.calls.declare`; a run's ready hook declares it there in program
        order).  Several events placed after one event keep their
        declaration order.  Its ``deps`` may only name events declared up to ``after`` (so the
        in-order stream cannot wait for an event behind it), and ``after`` must itself be in
        declaration order (not placed with ``after``).
        """
        if stream not in STREAMS:
            raise ValueError(f"event {label!r}: unknown stream {stream!r}; use one of {STREAMS}")
        seconds = _check_seconds(f"compute event {label!r}: seconds", seconds)
        deps = self._deps(deps, label)
        if stream == "compute" and after is None and self._blocking:
            # the thread that runs the compute stream waited for these calls (blocking calls
            # in program order): nothing it computes next starts before they end
            deps = tuple(dict.fromkeys((*deps, *self._blocking)))
            self._blocking = []
        order = None
        if after is not None:
            (after,) = self._deps(after, label)
            if after.kind != "compute" or after.resource != stream:
                raise ValueError(f"event {label!r}: after= must be a compute event of stream "
                                 f"{stream!r}, got {after.kind} event {after.label!r} on "
                                 f"{after.resource!r}")
            if after.order != (after.index,):
                raise ValueError(f"event {label!r}: after={after.label!r} was itself placed "
                                 "with after=; place both after the same declared event")
            late = [d.label for d in deps if d.index > after.index]
            if late:
                raise ValueError(f"event {label!r}: placed after {after.label!r} but depends on "
                                 f"{late}, declared later (the stream would wait for an event "
                                 "behind it); declare it at the end instead")
            self._placed[after.index] = self._placed.get(after.index, 0) + 1
            order = (after.index, self._placed[after.index])
        return self._add(label=label, kind="compute", resource=stream, deps=deps,
                         seconds=seconds, order=order)

    def set_seconds(self, event: Event, seconds: float) -> None:
        """Time a compute event declared before its block ran (see
        :meth:`substrate.compute.LayerEvents.layer`)."""
        if event.kind != "compute" or event._owner is not self._token:
            raise ValueError(f"set_seconds: {event.label!r} is not a compute event of the open "
                             "step")
        event.seconds = _check_seconds(f"compute event {event.label!r}: seconds", seconds)
        self._cache = None

    def transfer(self, phase: str, link: str, nbytes: float, *, algorithm: str = "p2p",
                 p: int = 2, messages: int = 1, deps=(), label: str | None = None,
                 share: int = 1) -> Event:
        """A communication event on ``link`` whose time is the cost model's time of
        ``algorithm`` (:func:`transfer_parts`); starts when ``deps`` are done.

        ``share``: how many ranks of this rank's node drive the node's ``link`` at the same time
        in this phase, each with a transfer like this one (an exchange in which every rank of a
        node sends across nodes, e.g. H-SGD's SpFF/SpBP messages or an all-to-all).  A node has
        one link of each class (one NIC), so this rank's bandwidth part is ``share × W``: the
        node's ``share`` flows split the link, as the wire lab measures.  Rings and trees cross
        a node boundary with one flow per direction and keep ``share = 1``.
        """
        if self.cost is None:
            raise ValueError("Timeline.transfer needs a cost model: Timeline(cost=run.cost), or "
                             "use transfer_seconds(phase, link, latency_s, bandwidth_s)")
        if isinstance(share, bool) or not isinstance(share, int) or share < 1:
            raise ValueError(f"transfer {phase!r}: share must be an integer >= 1 (ranks of the "
                             f"node on the link at once), got {share!r}")
        lat, work = transfer_parts(self.cost, algorithm, nbytes, link, p=p, messages=messages)
        return self.transfer_seconds(phase, link, lat, work * share, deps=deps, label=label,
                                     nbytes=nbytes)

    def transfer_seconds(self, phase: str, link: str, latency_s: float, bandwidth_s: float, *,
                         deps=(), label: str | None = None, nbytes: float = 0.0) -> Event:
        """A communication event with explicit latency part ``L`` and bandwidth part ``W``
        (seconds at the full rate of ``link``)."""
        if not isinstance(phase, str) or not phase:
            raise ValueError(f"every transfer needs a non-empty phase label, got {phase!r}")
        if link not in LINKS:
            raise ValueError(f"transfer {phase!r}: unknown link class {link!r}; use one of "
                             f"{LINKS}")
        lat = _check_seconds(f"transfer {phase!r}: latency_s", latency_s)
        work = _check_seconds(f"transfer {phase!r}: bandwidth_s", bandwidth_s)
        label = label or phase
        return self._add(label=label, kind="transfer", resource=link,
                         deps=self._deps(deps, label), latency_s=lat, work_s=work, phase=phase,
                         nbytes=float(nbytes))

    def wait(self, phase: str, seconds: float, *, deps=(), label: str | None = None,
             nbytes: float = 0.0) -> Event:
        """A wait of ``seconds`` for communication on other ranks' links (e.g. the other nodes'
        intra-node phase before the leaders' all-reduce): it delays what depends on it, takes
        no resource of this rank and is not this rank's communication time."""
        seconds = _check_seconds(f"wait {phase!r}: seconds", seconds)
        label = label or phase
        return self._add(label=label, kind="wait", resource="none", deps=self._deps(deps, label),
                         latency_s=seconds, phase=phase, nbytes=float(nbytes))

    def join(self, label: str, deps=()) -> Event:
        """A zero-duration marker done when every event in ``deps`` is."""
        return self._add(label=label, kind="join", resource="none", deps=self._deps(deps, label))

    @property
    def open_events(self) -> list[Event]:
        """Events declared since the last :meth:`step`."""
        return list(self._events)

    def declared_comm_s(self) -> dict:
        """Σ standalone transfer time per phase in the open step."""
        out: dict[str, float] = {}
        for e in self._events:
            if e.kind == "transfer":
                out[e.phase] = out.get(e.phase, 0.0) + e.standalone_s
        return out

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> StepTiming:
        """Schedule the open step (sets every event's ``start``/``finish``) without closing it."""
        if self._cache is not None and self._cache[0] == len(self._events):
            return self._cache[1]
        timing = _simulate(self._events, self.keep_events)
        self._cache = (len(self._events), timing)
        return timing

    def step(self) -> StepTiming:
        """Schedule and close the open step; later events start a new step at time 0."""
        timing = self.schedule()
        self.steps += 1
        for k in self.totals:
            self.totals[k] += getattr(timing, k)
        self.history.append(timing)
        self._events = []
        self._placed = {}
        self._sinks = {}
        self._blocking = []
        self._token = object()
        self._cache = None
        return timing

    @property
    def sim_s(self) -> float:
        """Σ step times of the closed steps plus the open step's critical path."""
        return self.totals["step_s"] + (self.schedule().step_s if self._events else 0.0)


def _simulate(events: list[Event], keep: bool) -> StepTiming:
    """Event-driven schedule of one step (see the module docstring for the rules)."""
    n = len(events)
    waiting = [len(e.deps) for e in events]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for e in events:
        for d in e.deps:
            dependents[d.index].append(e.index)
    queues = {s: deque(e.index for e in sorted(events, key=lambda e: e.order)
                       if e.kind == "compute" and e.resource == s) for s in STREAMS}
    running: dict[str, tuple[int, float]] = {}          # stream -> (event, end)
    latency: dict[int, float] = {}                      # transfer in latency part -> its end
    sharing: dict[str, dict[int, float]] = {link: {} for link in LINKS}  # remaining W
    ready: list[int] = []
    done = 0
    t = 0.0

    def finish(i: int) -> None:
        nonlocal done
        events[i].finish = t
        done += 1
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)

    for e in events:
        e.start = e.finish = math.nan
        if not e.deps:
            ready.append(e.index)

    while True:
        # start everything that can start at t (zero-length events finish at once)
        progress = True
        while progress:
            progress = False
            while ready:
                i = ready.pop()
                e = events[i]
                if e.kind == "compute":
                    continue                     # started from its stream queue below
                e.start = t
                if e.kind == "join":
                    finish(i)
                elif e.latency_s > 0:
                    latency[i] = t + e.latency_s
                elif e.work_s > 0:
                    sharing[e.resource][i] = e.work_s
                else:
                    finish(i)
                progress = True
            for s, q in queues.items():
                while s not in running and q and waiting[q[0]] == 0:
                    i = q.popleft()
                    events[i].start = t
                    if events[i].seconds > 0:
                        running[s] = (i, t + events[i].seconds)
                    else:
                        finish(i)
                    progress = True
        if done == n:
            break
        # the next moment something ends
        t_next = math.inf
        for _, end in running.values():
            t_next = min(t_next, end)
        for end in latency.values():
            t_next = min(t_next, end)
        for active in sharing.values():
            if active:
                t_next = min(t_next, t + min(active.values()) * len(active))
        if t_next == math.inf:           # cannot happen: deps only point backwards
            raise RuntimeError("timeline deadlock: events waiting with nothing running")
        dt = t_next - t
        for active in sharing.values():
            k = len(active)
            for i in active:
                active[i] -= dt / k
        t = t_next
        tol = _TOL * max(1.0, t)
        for s, (i, end) in list(running.items()):
            if end <= t + tol:
                del running[s]
                finish(i)
        for i, end in list(latency.items()):
            if end <= t + tol:
                del latency[i]
                if events[i].work_s > 0:
                    sharing[events[i].resource][i] = events[i].work_s
                else:
                    finish(i)
        for active in sharing.values():
            for i, rem in list(active.items()):
                if rem <= tol:
                    del active[i]
                    finish(i)

    step_s = max((e.finish for e in events), default=0.0)
    compute = [(e.start, e.finish) for e in events if e.kind == "compute"
               and e.resource == "compute"]
    comm = {link: [(e.start, e.finish) for e in events if e.kind == "transfer"
                   and e.resource == link and e.finish > e.start] for link in LINKS}
    all_comm = comm[INTRA] + comm[INTER]
    exposed = _union_length(all_comm) - _intersection_length(all_comm, compute)
    compute_s = sum((e.seconds for e in events if e.kind == "compute"
                     and e.resource == "compute"), 0.0)
    offload_s = sum((e.seconds for e in events if e.kind == "compute"
                     and e.resource == "offload"), 0.0)
    comm_s = sum((e.standalone_s for e in events if e.kind == "transfer"), 0.0)
    records = tuple(EventRecord(e.label, e.kind, e.resource, e.start, e.finish, e.phase,
                                e.nbytes) for e in events) if keep else ()
    return StepTiming(step_s=step_s, compute_s=compute_s, offload_s=offload_s, comm_s=comm_s,
                      comm_busy_s={link: _union_length(v) for link, v in comm.items()},
                      exposed_comm_s=max(0.0, exposed),
                      no_overlap_s=compute_s + offload_s + comm_s, events=records)
