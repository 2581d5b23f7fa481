"""Simulated clock of one rank: additive (compute + α–β) or an event timeline.

Two modes, one interface (``with clock.compute(): ...``, ``clock.sim_s``, ``compute_s``,
``comm_modeled_s``, ``as_dict()``):

**additive** (``SimClock(ledger)``, the default)
    ``sim_s = compute_s + comm_modeled_s``: measured compute plus the α–β time of every call in
    the ledger, nothing overlapped (an upper bound for systems that overlap).

**timeline** (``SimClock(ledger, timeline=Timeline(cost))``)
    Every ``compute()`` block and every per-layer event of a model whose ``recorder`` is
    :attr:`SimClock.layers` is a compute event of a :class:`~substrate.timeline.Timeline`; every
    communication call declares its own transfer event on the same timeline from its record
    (:class:`substrate.recorder.Recorder`), after the events its ``after=`` names (by default
    after everything declared before it); :meth:`SimClock.step` closes a step and ``sim_s`` is
    the sum of the steps' critical paths.

Compute is timed by a :class:`~substrate.compute.ComputeSource` (``source=``): ``"wall"``
(default, the old behaviour, grows with the host's load), ``"cpu"`` (per-thread CPU time; does
not grow when ranks share cores), ``"cuda"`` (CUDA events), ``"flops"`` (roofline from the
model's per-layer FLOP counts, ``device_tflops``), ``"profile"`` (each event's least cost in a
compute profile recorded by a quiet run: load-independent by construction).
:meth:`SimClock.describe` says which, for ``summary.json``.  Every block has a label (an unnamed
block is named by its call site: module, function and line within the function, which stays
the same when code elsewhere in the file moves), and :meth:`SimClock.step` tells the source that
a step ended, so sources that cost events ``(label, k)`` (the ``k``-th block with that label in
the step) can count them.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from .compute import (
    CalibratedSource,
    ComputeSource,
    CpuTimeSource,
    CudaEventSource,
    FlopSource,
    LayerEvents,
    WallSource,
    resolve_pending,
)
from .ledger import Ledger
from .profile import ProfileSource
from .timeline import StepTiming, Timeline

__all__ = ["SOURCES", "PendingSeconds", "SimClock", "make_source"]

#: Names :func:`make_source` accepts (the ``--compute-source`` choices).
SOURCES = ("auto", "wall", "cpu", "cpu_thread", "cpu_process", "calibrated", "cuda", "flops",
           "profile")


def make_source(name: str, *, sync=None, gpu: bool = False, device_tflops: float | None = None,
                device_gbs: float | None = None, profile=None, rank: int = 0,
                ranks: int = 1) -> ComputeSource:
    """Build a source by name: ``auto`` (``cuda`` when ``gpu``, else ``cpu``), ``wall``,
    ``cpu`` (thread or process CPU time, see :class:`CpuTimeSource`), ``cpu_thread``,
    ``cpu_process``, ``calibrated`` (:class:`CalibratedSource` over ``cpu``, or ``cuda`` on a
    GPU), ``cuda``, ``flops`` (needs ``device_tflops``), ``profile`` (needs ``profile``, a
    file written by ``--compute-profile-out``; ``rank`` of ``ranks`` picks its table)."""
    if profile is not None and name != "profile":
        raise ValueError(f"--compute-profile {profile} is only read by --compute-source "
                         f"profile (got --compute-source {name}): add --compute-source profile "
                         "or drop --compute-profile")
    if name == "profile":
        if profile is None:
            raise ValueError("--compute-source profile needs --compute-profile FILE (a profile "
                             "written by --compute-profile-out FILE on a quiet run of the same "
                             "job)")
        return ProfileSource(profile, rank=rank, ranks=ranks,
                             fallback=CudaEventSource() if gpu else CpuTimeSource())
    if name == "auto":
        name = "cuda" if gpu else "cpu"
    if name == "wall":
        return WallSource(sync)
    if name in ("cpu", "cpu_thread", "cpu_process"):
        return CpuTimeSource({"cpu": "auto", "cpu_thread": "thread",
                              "cpu_process": "process"}[name])
    if name == "calibrated":
        return CalibratedSource(CudaEventSource() if gpu else CpuTimeSource())
    if name == "cuda":
        return CudaEventSource()
    if name == "flops":
        if device_tflops is None:
            raise ValueError("--compute-source flops needs --device-tflops (peak TFLOP/s of the "
                             "modeled device, e.g. 15.7 for a V100)")
        return FlopSource(device_tflops, device_gbs)
    raise ValueError(f"unknown compute source {name!r}; use one of {SOURCES}")


def _call_site(frame) -> str:
    """Label of an unnamed compute block: ``compute@module:function+line`` (the line counted
    from the function's first line, so edits elsewhere in the module keep the label)."""
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    module = frame.f_globals.get("__name__", code.co_filename)
    return f"compute@{module}:{name}+{frame.f_lineno - code.co_firstlineno}"


class PendingSeconds:
    """The seconds of work done elsewhere (a worker thread), known once the work is collected:
    what :meth:`SimClock.offload`'s ``submit`` returns.  :meth:`set` is called by whoever
    collects the work, on the clock's thread; :meth:`then` callbacks run then (now, if
    known)."""

    __slots__ = ("_callbacks", "seconds")

    def __init__(self) -> None:
        self.seconds = None
        self._callbacks: list = []

    def then(self, callback) -> None:
        if self.seconds is not None:
            callback(self.seconds)
        else:
            self._callbacks.append(callback)

    def set(self, seconds: float) -> None:
        self.seconds = max(0.0, float(seconds))
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self.seconds)


class SimClock:
    """Per-rank simulated time (see the module docstring).

    Parameters
    ----------
    ledger : Ledger
    sync : callable, optional
        Device synchronization (``Backend.synchronize``) for the ``wall`` source.
    source : str or ComputeSource
        ``wall`` (default), ``auto`` (``cuda`` on a GPU, else ``cpu``), ``cpu``,
        ``cpu_thread``, ``cpu_process``, ``calibrated``, ``cuda``, ``flops``, ``profile``
        (with ``profile``).
    timeline : Timeline, optional
        Switches to timeline mode.
    device_tflops, device_gbs : float, optional
        Peak of the modeled device for ``source="flops"``.
    gpu : bool, optional
        Whether compute runs on a GPU (for ``auto``); default: ``sync`` was given.
    profile : str or dict, optional
        The compute profile of ``source="profile"`` (a file written by
        ``--compute-profile-out``, or :func:`~substrate.profile.load_profile`'s dict).
    """

    def __init__(self, ledger: Ledger, sync=None, *, source="wall",
                 timeline: Timeline | None = None, device_tflops: float | None = None,
                 device_gbs: float | None = None, gpu: bool | None = None,
                 profile=None) -> None:
        self.ledger = ledger
        self._sync = sync
        gpu = (sync is not None) if gpu is None else gpu
        self.source: ComputeSource = source if isinstance(source, ComputeSource) else \
            make_source(source, sync=sync, gpu=gpu, device_tflops=device_tflops,
                        device_gbs=device_gbs, profile=profile)
        self.timeline = timeline
        self.layers = LayerEvents(timeline, self.source) if timeline is not None else None
        #: the rank's recorded program (:mod:`substrate.program`), when a profile is recorded
        self.program = None
        #: steps kept for ``--trace`` (:func:`substrate.trace.parse_steps`; ``None``: all)
        self.trace_steps = False
        #: the kept steps: ``{"step", "sim_start_s", "sim_s", "wall_s", "events"}``
        self.traced: list[dict] = []
        self._compute_s = 0.0          # additive mode, and compute outside the timeline's sums
        self._offset = {"sim_s": 0.0, "no_overlap_s": 0.0, "compute_s": 0.0}
        self._depth = 0
        self._outer_last = None        # the last layer event when the outermost block began
        self._nested_s = 0.0           # Σ seconds of blocks that were events inside another
        self._nested_ms: list = []     # their measurements, with a deferred source
        self.last_event = None
        self.last_step: StepTiming | None = None
        #: every closed step's simulated length and its no-overlap length (seconds, this rank):
        #: the run reduces them over the ranks (the job's step is its slowest rank's)
        self.step_history: list[tuple[float, float]] = []
        self._t0 = self._step_t0 = time.perf_counter()
        self.step_wall_s = 0.0
        self._prev = {"compute_s": 0.0, "comm_s": ledger.modeled_s}

    @property
    def mode(self) -> str:
        return "additive" if self.timeline is None else "timeline"

    # -- compute ---------------------------------------------------------------------------------
    @contextmanager
    def compute(self, label: str = "compute", *, flops: float | None = None, deps=(),
                stream: str = "compute", after=None, key: str | None = None):
        """Time the enclosed block as compute (a block nested in another is part of the outer
        one, except between two units of a model's pass: :meth:`_between_units`, where it is an
        event of its own, declared after the unit that just ended, and the outer block's rest
        leaves it out as it leaves out the per-layer events).  In timeline mode the block becomes an event ``label`` on ``stream`` after
        ``deps`` (its handle is :attr:`last_event` afterwards); per-layer events the model
        recorded inside the block are events of their own and only the rest of the block (loss,
        Python) is added as ``label``.  ``flops`` gives the block's FLOP count to the ``flops``
        source; ``after`` places the event in its stream right after that event
        (:meth:`Timeline.compute`); ``key`` overrides the block's profile key (a replay
        repeats the recorded one)."""
        nested = self._depth > 0
        if nested and not self._between_units():
            yield None
            return
        if key is None:
            key = label
            if label == "compute":      # unnamed block: its call site names it (calibration)
                key = _call_site(sys._getframe(2))
        if self.program is not None:
            self.program.begin("clock", label, key, deps, stream, after)
        if not nested:
            self._outer_last = self.layers.last if self.layers is not None else None
        self._depth += 1
        # a deferred source (CUDA events, read once when the step closes) leaves the block's
        # seconds, and its layers' and nested blocks', to then: no host wait here
        deferred = getattr(self.source, "deferred", False)
        if deferred:
            start = (self.layers.count if self.layers is not None else 0, len(self._nested_ms))
        else:
            inner0 = self.layers.recorded_s if self.layers is not None else 0.0
            nested0 = self._nested_s
        try:
            with self.source.measure(flops, None, key) as m:
                yield m
        finally:
            self._depth -= 1
        if deferred:
            self._deferred_end(m, start, nested, label, deps, stream, after)
        elif self.timeline is None:
            self._compute_s += m.seconds
        else:
            inner = self.layers.recorded_s - inner0 + self._nested_s - nested0
            if inner > 0 and isinstance(self.source, FlopSource):
                self.last_event = self.layers.last        # the layers' FLOPs are the block
            else:
                rest = max(0.0, m.seconds - inner)
                if rest > 0 or not inner:
                    self.last_event = self.timeline.compute(label, rest, deps=deps,
                                                            stream=stream, after=after)
                else:
                    self.last_event = self.layers.last
            if nested:                  # the outer block's rest leaves it out
                self._nested_s += m.seconds
        if self.program is not None:
            self.program.end(self.last_event if self.timeline is not None else None)

    def offload(self, label: str, submit=None, *, flops: float | None = None, deps=(),
                after=None, key: str | None = None):
        """A block on the ``offload`` stream: work a worker thread does beside the compute
        stream (SSFusion-O's CPU worker).  ``submit()`` hands it to the worker and returns its
        :class:`PendingSeconds` (the worker's own reading of a compute source for the event
        ``key``, delivered when the work is collected); this thread goes on at once.  Without
        ``submit`` (a replay) the block costs what the run's source charges ``key``.  In
        timeline mode the block is an event on the offload stream after ``deps`` with those
        seconds (its handle is :attr:`last_event`); in additive mode nothing is added (the
        additive clock sums the compute stream).  Returns the event."""
        if key is None:
            key = label
        if self.program is not None:
            self.program.begin("clock", label, key, deps, "offload", after)
        tl = self.timeline
        ev = None if tl is None else tl.compute(label, 0.0, deps=deps, stream="offload",
                                                after=after)
        if submit is not None:
            pending = submit()
        else:
            with self.source.measure(flops, None, key) as pending:
                pass
        if ev is not None and pending is not None:
            if hasattr(pending, "then"):          # a worker's, or a deferred source's
                pending.then(lambda seconds: tl.set_seconds(ev, seconds))
            else:
                tl.set_seconds(ev, pending.seconds)
            self.last_event = ev
        if self.program is not None:
            self.program.end(ev)
        return ev

    def _deferred_end(self, m, start: tuple[int, int], nested: bool, label: str, deps,
                      stream: str, after) -> None:
        """The end of a block timed by a deferred source (:class:`DeferredMeasurement`): in
        timeline mode its event is declared now with 0 seconds (its handle is
        :attr:`last_event`) and gets the block's rest (its seconds less those of the layer
        events and nested blocks it holds) when the step's events are read; in additive mode
        the seconds are added then.  :meth:`step` reads them (one host wait) before it
        schedules, and so does any reading of the open step."""
        if self.timeline is None:
            m.then(self._add_compute)
        else:
            ev = self.timeline.compute(label, 0.0, deps=deps, stream=stream, after=after)
            self.last_event = ev
            layers = self.layers.span(start[0]) if self.layers is not None else (lambda: 0.0)
            inner_ms = self._nested_ms[start[1]:]
            timeline = self.timeline

            def rest(seconds: float) -> None:
                inner = layers() + sum(x.seconds for x in inner_ms)
                timeline.set_seconds(ev, max(0.0, seconds - inner))

            m.then(rest)
        if nested:                      # the outer block's rest leaves it out
            self._nested_ms.append(m)
        elif self._depth == 0:
            self._nested_ms = []

    def _add_compute(self, seconds: float) -> None:
        self._compute_s += seconds

    def _resolve(self) -> None:
        """Read the pending deferred measurements (before a reading of the open step)."""
        if getattr(self.source, "deferred", False):
            resolve_pending(self.source)

    def _between_units(self) -> bool:
        """Whether a block opened inside another one is an event of its own: on a timeline,
        while the outer block runs a model's units (it recorded per-layer events) and between
        two of them (no unit open): work a strategy does from the backward's ready hook, which
        runs after each unit's backward (:func:`models.network._wrap_unit`)."""
        lay = self.layers
        return (self.timeline is not None and lay is not None and lay.open is None
                and lay.last is not None and lay.last is not self._outer_last)

    # -- dependencies for strategies ------------------------------------------------------------
    def ready(self, lo: int, hi: int):
        """Dependency for a transfer of gradients ``flat[lo:hi]``: the backward event after
        which they are all written (:meth:`LayerEvents.ready_event`, when the model's
        ``recorder`` is :attr:`layers`); without per-layer events this step, the last compute
        block (the whole backward: conservative, never early); ``None`` in additive mode."""
        if self.timeline is None:
            return None
        if self.layers.last is not None:
            return self.layers.ready_event(lo, hi)
        return self.last_event

    def now(self):
        """Dependency for a call issued from the backward (e.g. a bucket its gradients
        complete): the unit being computed (:attr:`LayerEvents.open`), else the last unit
        (the ready hook runs right after a unit's backward), else the last compute event;
        ``None`` in additive mode."""
        if self.timeline is None:
            return None
        return self.layers.open or self.layers.last or self.last_event

    def comm_events(self) -> list:
        """The transfers declared so far in the open step (e.g. ``deps`` of the optimizer
        step); ``[]`` in additive mode."""
        if self.timeline is None:
            return []
        return [e for e in self.timeline.open_events if e.kind == "transfer"]

    # -- steps -----------------------------------------------------------------------------------
    def mark(self) -> None:
        """Restart the wall-time interval of the next :meth:`step` (call it after work that is
        not part of a step, e.g. an evaluation or a checkpoint)."""
        self._step_t0 = time.perf_counter()

    def step(self) -> StepTiming:
        """Close the step and return its :class:`StepTiming`; :attr:`step_wall_s` is the wall
        time since the previous ``step()`` (or :meth:`mark`): everything the rank did in the
        step, diagnostics included.

        Timeline mode: schedule and start a new step.  Additive mode: the step's compute and
        ledger α–β, added (so trainers call ``step()`` the same way in both modes)."""
        if self.program is not None:
            self.program.step()
        now = time.perf_counter()
        self.step_wall_s = now - self._step_t0
        self._step_t0 = now
        self.source.new_step()
        if self.timeline is None:
            compute = self._compute_s - self._prev["compute_s"]
            comm = self.ledger.modeled_s - self._prev["comm_s"]
            self._prev = {"compute_s": self._compute_s, "comm_s": self.ledger.modeled_s}
            self.last_step = StepTiming(step_s=compute + comm, compute_s=compute, offload_s=0.0,
                                        comm_s=comm, comm_busy_s={}, exposed_comm_s=comm,
                                        no_overlap_s=compute + comm)
            self.step_history.append((self.last_step.step_s, self.last_step.no_overlap_s))
            return self.last_step
        sim_start = self.sim_s - (self.timeline.schedule().step_s
                                  if self.timeline.open_events else 0.0)
        self.last_step = self.timeline.step()
        self.step_history.append((self.last_step.step_s, self.last_step.no_overlap_s))
        if self.trace_steps is not False:
            self._trace(self.timeline.steps - 1, sim_start)
        return self.last_step

    def _trace(self, k: int, sim_start: float) -> None:
        """Keep step ``k`` for ``--trace`` when it is selected (``last``: the newest only)."""
        sel = self.trace_steps
        keep_last = sel is not None and sel[1]
        if sel is not None and k not in sel[0] and not keep_last:
            return
        if keep_last and self.traced and self.traced[-1].get("last_only") and \
                self.traced[-1]["step"] not in sel[0]:
            self.traced.pop()
        self.traced.append({
            "step": k, "sim_start_s": sim_start, "sim_s": self.last_step.step_s,
            "wall_s": self.step_wall_s,
            "last_only": sel is not None and k not in sel[0],
            "events": [{"label": e.label, "kind": e.kind, "resource": e.resource,
                        "start": e.start, "finish": e.finish, "phase": e.phase,
                        "nbytes": e.nbytes} for e in self.last_step.events]})

    # -- readings --------------------------------------------------------------------------------
    def _open(self) -> tuple[float, float, float]:
        """(critical path, no-overlap sum, compute) of the open step."""
        self._resolve()
        if self.timeline is None or not self.timeline.open_events:
            return 0.0, 0.0, 0.0
        t = self.timeline.schedule()
        return t.step_s, t.no_overlap_s, t.compute_s + t.offload_s

    @property
    def compute_s(self) -> float:
        if self.timeline is None:
            self._resolve()
            return self._compute_s
        tot = self.timeline.totals
        return self._offset["compute_s"] + tot["compute_s"] + tot["offload_s"] + self._open()[2]

    @compute_s.setter
    def compute_s(self, value: float) -> None:
        """Restore compute time (resume); in timeline mode it becomes an offset."""
        if self.timeline is None:
            self._compute_s = float(value)
            self._resnap()
        else:
            self._resnap()
            self._offset["compute_s"] = float(value) - (self.compute_s
                                                        - self._offset["compute_s"])

    @property
    def comm_modeled_s(self) -> float:
        return self.ledger.modeled_s

    @property
    def sim_s(self) -> float:
        if self.timeline is None:
            return self.compute_s + self.comm_modeled_s
        return self._offset["sim_s"] + self.timeline.totals["step_s"] + self._open()[0]

    @property
    def no_overlap_s(self) -> float:
        """The additive clock's reading (``Σ compute + Σ α–β``)."""
        if self.timeline is None:
            return self.sim_s
        return self._offset["no_overlap_s"] + self.timeline.totals["no_overlap_s"] + \
            self._open()[1]

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self._t0

    def as_dict(self) -> dict:
        """Floats only (``Run.finish`` reduces each with MAX over ranks)."""
        d = {"wall_s": self.wall_s, "compute_s": self.compute_s,
             "comm_modeled_s": self.comm_modeled_s, "sim_s": self.sim_s}
        if self.timeline is not None:
            d["no_overlap_s"] = self.no_overlap_s
            d["exposed_comm_s"] = self.timeline.totals["exposed_comm_s"]
            d["steps"] = float(self.timeline.steps)
        return d

    def describe(self, events: bool = False) -> dict:
        """For ``summary.json``'s ``timeline`` block: mode, compute source, totals, and with
        ``events`` the last closed step's schedule (label, kind, resource, start, finish: a
        Gantt chart of this rank)."""
        d = {"mode": self.mode, "compute_source": self.source.describe()}
        profile = self.source.profile_info()
        if profile is not None:
            d["compute_profile"] = profile
        if self.timeline is not None:
            d["steps"] = self.timeline.steps
            d["links"] = ("one resource per link class; a transfer waits its alpha terms, then "
                          "shares the link's bandwidth equally with the transfers in flight")
            d["totals"] = dict(self.timeline.totals)
        if self.last_step is not None:
            d["last_step"] = self.last_step.as_dict()
            if events:
                d["last_step"]["events"] = [
                    {"label": e.label, "kind": e.kind, "resource": e.resource,
                     "start": e.start, "finish": e.finish, "phase": e.phase,
                     "nbytes": e.nbytes} for e in self.last_step.events]
        return d

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self) -> dict:
        """Readings to restore with :meth:`load_state` on resume (timeline mode: call at a step
        boundary)."""
        return {"compute_s": self.compute_s, "sim_s": self.sim_s,
                "no_overlap_s": self.no_overlap_s}

    def _resnap(self) -> None:
        """Start the step accounting from the ledger as it is now (after a resume restored it)."""
        self._prev = {"compute_s": self._compute_s, "comm_s": self.ledger.modeled_s}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state` on resume; call it after the ledger has been restored."""
        if self.timeline is None:
            self._compute_s = float(state["compute_s"])
            self._resnap()
            return
        self._resnap()
        for k in ("sim_s", "no_overlap_s", "compute_s"):
            self._offset[k] = 0.0
        cur = {"sim_s": self.sim_s, "no_overlap_s": self.no_overlap_s,
               "compute_s": self.compute_s}
        for k, now in cur.items():
            self._offset[k] = float(state[k]) - now
