"""The simulated clock of a run: measured compute, recorded programs, one job simulation.

Every rank records what it runs as its program (:class:`substrate.program.Program`: the compute
blocks of :meth:`SimClock.compute` and of the model's units, :class:`LayerEvents`, and the calls
its communicators record) and times each compute block with a
:class:`~simulation.compute.ComputeSource`, one table of seconds per step, ``(key, k)`` the
``k``-th block with profile key ``key`` in the step.  :meth:`SimClock.simulate` (collective, at
every metrics line and when the run finishes) gathers the steps closed since the last call on
rank 0 (each distinct step program once, the tables every time) and runs them together on the
run's network (:class:`simulation.jobsim.JobSim`: every collective's messages on the NICs and
links of the cluster, calls issued without waiting on the communication stream while the rank
computes, an offload worker beside the thread): the step of the job is the time between the
moments its last rank ends one step and the next.  That is the one time model of spardist: a
run's ``sim_s`` and ``step_sim_s``, the replay, ``commvol simulate`` and ``commvol scale`` all
read it (the last two on programs generated from the plans).  The α–β sum of the ledger
(:attr:`SimClock.comm_modeled_s`) stays as a bound: every call alone on its links, nothing
overlapped.

Compute is timed by a source (``source=``): ``"wall"`` (grows with the host's load), ``"cpu"``
(per-thread CPU time; does not grow when ranks share cores), ``"cuda"`` (CUDA events),
``"flops"`` (roofline from the model's per-layer FLOP counts, ``device_tflops``), ``"profile"``
(each block's least cost in a compute profile recorded by a quiet run: load-independent by
construction).  :meth:`SimClock.describe` says which, for ``summary.json``.  Every block has a
key (an unnamed block is named by its call site: module, function and line within the
function, which stays the same when code elsewhere in the file moves).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import sys
import time
from contextlib import contextmanager

import numpy as np

from substrate.calls import Call
from substrate.costmodel import CostModel
from substrate.ledger import Ledger
from substrate.program import Program, normalize, rebase

from .compute import (
    CalibratedSource,
    ComputeSource,
    CpuTimeSource,
    CudaEventSource,
    FlopSource,
    WallSource,
    resolve_pending,
)
from .jobsim import JobSim, JobSimOptions
from .profile import ProfileSource

__all__ = ["SOURCES", "LayerEvents", "PendingSeconds", "SimClock", "make_source"]

#: Names :func:`make_source` accepts (the ``--compute-source`` choices).
SOURCES = ("auto", "wall", "cpu", "cpu_thread", "cpu_process", "calibrated", "cuda", "flops",
           "profile")

#: what a run's simulated time is (``summary.json``, ``describe()``)
MODEL = ("job simulation (simulation.jobsim): every rank's recorded program of each step, its "
         "blocks costed by the compute source, run together on the network")


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
    """Key of an unnamed compute block: ``compute@module:function+line`` (the line counted
    from the function's first line, so edits elsewhere in the module keep the key)."""
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


def _when_known(m, callback) -> None:
    """``callback(seconds)`` of a measurement: now, or when a deferred one (CUDA events, a
    worker's :class:`PendingSeconds`) is read."""
    if getattr(m, "deferred", False):
        if m.resolved:
            callback(float(m.seconds))
        else:
            m.then(callback)
    elif isinstance(m, PendingSeconds):
        m.then(callback)
    else:
        callback(float(m.seconds))


class _Block:
    """A recorded block of the open step: its entry, stream, seconds (``None`` until known),
    the seconds of the blocks nested in it, and the entry index after which it ended."""

    __slots__ = ("end", "index", "inner", "layers", "parent", "seconds", "stream")

    def __init__(self, index: int, parent, stream: str) -> None:
        self.index, self.parent, self.stream = index, parent, stream
        self.seconds = None
        self.inner = 0.0
        self.layers = 0
        self.end = None


class _Measured:
    """The charge of one rank's steps in the job simulation: every block its measured
    seconds, in the order the step's program begins them (``JobSim`` charges each ``B`` entry
    once, in program order, and calls :meth:`new_step` at each step's end)."""

    def __init__(self, steps: list) -> None:
        self.steps, self.s, self.i = steps, 0, 0

    def __call__(self, key, k: int) -> float:
        seconds = self.steps[self.s]
        if self.i >= len(seconds):
            raise ValueError(f"step {self.s} charges more blocks than it measured "
                             f"({len(seconds)}; at {key!r})")
        self.i += 1
        return float(seconds[self.i - 1])

    def new_step(self) -> None:
        self.s, self.i = self.s + 1, 0


class LayerEvents:
    """Recorder for :attr:`models.network.Model.recorder`: the model's per-layer forward and
    backward (and its loss) become blocks of the clock's program, timed by its source, and it
    remembers after which backward block each flat-parameter range is ready.

    The model calls ``layer(phase, name, flops, nbytes)`` (a context manager around the unit's
    computation) and ``grads_ready(name, lo, hi)`` (after the backward of a unit whose
    parameters are ``flat[lo:hi]``).
    """

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self._ranges: list[tuple[int, int, int]] = []
        self._last: int | None = None
        self._open: int | None = None

    def new_step(self) -> None:
        self._ranges, self._last, self._open = [], None, None

    @contextmanager
    def layer(self, phase: str, name: str, flops: float | None = None,
              nbytes: float | None = None):
        """The unit's computation: its entry is recorded when the block starts (:attr:`open`,
        so a call issued from inside the block, e.g. a gradient bucket handed to the
        communication stream as soon as the layer wrote it, can name it) and timed when it
        ends."""
        label = f"{phase}:{name}"
        clock = self.clock
        b = clock._begin("layer", label, label, (), "compute", None)
        self._open = b.index
        try:
            with clock.source.measure(flops, nbytes, label) as m:
                yield m
        finally:
            self._open = None
        clock._end(b, m, layer=True)
        self._last = b.index

    @property
    def open(self) -> int | None:
        """The entry of the unit being computed now (``None`` between units)."""
        return self._open

    @property
    def last(self) -> int | None:
        """The entry of the last unit of the open step (e.g. the end of the backward)."""
        return self._last

    def grads_ready(self, name: str, lo: int, hi: int) -> None:
        if self._last is None:
            raise ValueError(f"grads_ready({name!r}) before any backward block of this step")
        if hi > lo:
            self._ranges.append((int(lo), int(hi), self._last))

    def ready_event(self, lo: int, hi: int) -> int:
        """The backward block after which every gradient in ``flat[lo:hi]`` is written."""
        if not 0 <= lo < hi:
            raise ValueError(f"ready_event: need 0 <= lo < hi, got [{lo}, {hi})")
        covering = [(a, b, e) for a, b, e in self._ranges if a < hi and b > lo]
        covered = sum(min(b, hi) - max(a, lo) for a, b, _ in covering)
        if covered < hi - lo:
            raise ValueError(f"ready_event: flat[{lo}:{hi}] is not covered by the gradients "
                             f"reported this step ({covered} of {hi - lo} elements); run the "
                             "backward with model.recorder set first")
        return max(e for _, _, e in covering)


class SimClock:
    """Per-rank measured compute and the job's simulated time (see the module docstring).

    Parameters
    ----------
    ledger : Ledger
    sync : callable, optional
        Device synchronization (``Backend.synchronize``) for the ``wall`` source.
    source : str or ComputeSource
        ``wall`` (default), ``auto`` (``cuda`` on a GPU, else ``cpu``), ``cpu``,
        ``cpu_thread``, ``cpu_process``, ``calibrated``, ``cuda``, ``flops``, ``profile``
        (with ``profile``).
    device_tflops, device_gbs : float, optional
        Peak of the modeled device for ``source="flops"``.
    gpu : bool, optional
        Whether compute runs on a GPU (for ``auto``); default: ``sync`` was given.
    profile : str or dict, optional
        The compute profile of ``source="profile"``.
    network : simulation.cluster.Cluster, optional
        What the steps are simulated on (default: the two-tier cluster of the default cost
        model).
    jobsim : simulation.jobsim.JobSimOptions, optional
    node_of : sequence of int
        Node of every world rank (default: one rank).
    rank : int
        This rank.
    mpi : mpi4py communicator, optional
        The world's, over which :meth:`simulate` gathers the steps (``None``: one rank).
    keep_program : bool
        Keep every entry of the run's program (a compute profile stores it for the replay);
        otherwise the entries of simulated steps are dropped.
    """

    def __init__(self, ledger: Ledger, sync=None, *, source="wall",
                 device_tflops: float | None = None, device_gbs: float | None = None,
                 gpu: bool | None = None, profile=None, network=None, jobsim=None,
                 node_of=(0,), rank: int = 0, mpi=None, keep_program: bool = False) -> None:
        self.ledger = ledger
        gpu = (sync is not None) if gpu is None else gpu
        self.source: ComputeSource = source if isinstance(source, ComputeSource) else \
            make_source(source, sync=sync, gpu=gpu, device_tflops=device_tflops,
                        device_gbs=device_gbs, profile=profile)
        self.jobsim = jobsim or JobSimOptions()
        self.network = network if network is not None else self.jobsim.network(CostModel())
        self.node_of = [int(n) for n in node_of]
        self.rank, self.mpi = int(rank), mpi
        self.keep_program = keep_program
        #: the rank's program as it runs (:mod:`substrate.program`)
        self.program = Program()
        self.layers = LayerEvents(self)
        #: the entry of the last compute block that ended (a dependency for what follows)
        self.last_event: int | None = None
        #: steps kept for ``--trace`` (:func:`simulation.trace.parse_steps`; ``False``: none)
        self.trace_steps = False
        #: the kept steps' simulated events, ``{rank: [step, ...]}`` (rank 0 holds them)
        self.traced: dict[int, list[dict]] = {}
        self._open: list[_Block] = []          # the recorded blocks open now
        self._depth = 0                        # compute() blocks open, recorded or not
        self._outer_last = None                # the last layer when the outermost block began
        self._blocks: list[_Block] = []        # the open step's blocks, in program order
        self._step_start = 0
        self._closed: list = []                # (start, stop, blocks, kind) not simulated yet
        self._sent: dict = {}                  # digest -> id of a step program sent to rank 0
        self._known: dict = {}                 # rank 0: (rank, id) -> step program
        #: ``(kind, seconds)`` of every simulated step of this process (``unit``: a step of
        #: the run loop; ``eval``: an evaluation's calls; ``end``: what followed the last)
        self.simulated: list[tuple[str, float]] = []
        self._drift: list[float] | None = None     # each rank's start in the next piece
        self._piece_start: list[float] = []
        # inter-node bytes of the simulation's own messages (rank 0 gathers every step's
        # program once and its blocks' seconds, and broadcasts the steps): the run's control
        # plane, not the system's traffic, so not booked; the wire lab subtracts it
        self.control_bytes = 0
        #: rank 0: the last simulated unit step's events of rank 0 and of its slowest rank
        #: (``{"step", "step_s", "slowest_rank", "ranks": {rank: [event, ...]}}``: a Gantt chart)
        self.last_step: dict | None = None
        #: rank 0: bytes the simulated messages moved inside nodes and between them (the
        #: ledger's wire bytes of the simulated steps, a check)
        self.moved: dict[str, float] = {}
        #: rank 0: bytes the transport's acknowledgements moved (not in :attr:`moved`)
        self.ack_bytes = 0.0
        self._compute_s = 0.0
        self._offset = {"sim_s": 0.0, "compute_s": 0.0}
        self._t0 = self._step_t0 = time.perf_counter()
        self.step_wall_s = 0.0

    # -- recording -------------------------------------------------------------------------------
    def _begin(self, kind: str, label: str, key: str, deps, stream: str, after) -> _Block:
        i = self.program.begin(kind, label, key, deps, stream, after)
        b = _Block(i, self._open[-1] if self._open else None, stream)
        self._open.append(b)
        self._blocks.append(b)
        return b

    def _end(self, b: _Block, m, *, layer: bool = False) -> None:
        """Close block ``b`` timed by ``m``: its seconds are the block's in the step (when a
        deferred measurement is read, for CUDA events), added to the compute total when it is
        outermost."""
        self._open.pop()
        self.program.end()
        b.end = len(self.program)
        flops_block = isinstance(self.source, FlopSource) and not layer
        parent = b.parent

        def known(seconds: float) -> None:
            if flops_block and b.layers:     # the layers' FLOPs are the block
                seconds = b.inner
            b.seconds = seconds
            if parent is not None:
                parent.inner += seconds
                parent.layers += 1 if layer else b.layers
            else:
                self._compute_s += seconds

        _when_known(m, known)

    @contextmanager
    def compute(self, label: str = "compute", *, flops: float | None = None, deps=(),
                stream: str = "compute", after=None, key: str | None = None):
        """Time the enclosed block as compute and record it in the program (``B`` ... ``E``)
        after ``deps`` on ``stream`` (its entry is :attr:`last_event` afterwards).  A block
        opened inside another is part of the outer one (nothing recorded), except between two
        units of a model's pass (:meth:`_between_units`): work a strategy does from the
        backward's ready hook is a block of its own, and the job simulation leaves it out of
        the outer block's own time as it leaves out the units.  ``flops`` gives the block's
        FLOP count to the ``flops`` source; ``after`` places the block in its stream right
        after that entry; ``key`` overrides the block's profile key (a replay repeats the
        recorded one)."""
        nested = self._depth > 0
        if nested and not self._between_units():
            yield None
            return
        if key is None:
            key = label
            if label == "compute":      # unnamed block: its call site names it (calibration)
                key = _call_site(sys._getframe(2))
        b = self._begin("clock", label, key, deps, stream, after)
        if not nested:
            self._outer_last = self.layers.last
        self._depth += 1
        try:
            with self.source.measure(flops, None, key) as m:
                yield m
        finally:
            self._depth -= 1
        self._end(b, m)
        self.last_event = b.index

    def offload(self, label: str, submit=None, *, flops: float | None = None, deps=(),
                after=None, key: str | None = None) -> int:
        """A block on the ``offload`` stream: work a worker thread does beside the compute
        stream (SSFusion-O's CPU worker).  ``submit()`` hands it to the worker and returns its
        :class:`PendingSeconds` (the worker's own reading of a compute source for the block
        ``key``, delivered when the work is collected); this thread goes on at once.  Without
        ``submit`` (a replay) the block costs what the run's source charges ``key``.  Returns
        its entry."""
        if key is None:
            key = label
        b = self._begin("clock", label, key, deps, "offload", after)
        if submit is not None:
            pending = submit()
        else:
            with self.source.measure(flops, None, key) as pending:
                pass
        self._end(b, pending)
        self.last_event = b.index
        return b.index

    def _between_units(self) -> bool:
        """Whether a block opened inside another one is a block of its own: while the outer
        block runs a model's units and between two of them (no unit open): work a strategy
        does from the backward's ready hook, which runs after each unit's backward
        (:func:`models.network._wrap_unit`)."""
        lay = self.layers
        return lay.open is None and lay.last is not None and lay.last != self._outer_last

    def compute_before(self, entry: int) -> float:
        """Seconds of the open step's compute stream up to the end of block ``entry``: every
        block that ended by then, each its own time (less the blocks nested in it) — when in
        this step's compute a unit's backward wrote its gradients (SSFusion's warm-up)."""
        resolve_pending(self.source)
        ends = {b.index: b.end for b in self._blocks}
        stop = ends.get(entry)
        if stop is None:
            raise ValueError(f"compute_before: entry {entry} is no block of the open step")
        return sum((b.seconds or 0.0) - b.inner for b in self._blocks
                   if b.stream == "compute" and b.end is not None and b.end <= stop)

    # -- steps -----------------------------------------------------------------------------------
    def mark(self) -> None:
        """Restart the wall-time interval of the next :meth:`step` (call it after work that is
        not part of a step, e.g. an evaluation or a checkpoint)."""
        self._step_t0 = time.perf_counter()

    def step(self, kind: str = "unit") -> None:
        """Close the step (``kind``: ``unit``, a step of the run loop; ``eval``, an
        evaluation's work; ``end``, what followed the last step).  :attr:`step_wall_s` is the
        wall time since the previous ``step()`` (or :meth:`mark`).  Its simulated time is
        known after the next :meth:`simulate`."""
        if self._open:
            raise ValueError(f"a step ends with {len(self._open)} compute blocks open")
        stop = self.program.step()
        now = time.perf_counter()
        self.step_wall_s = now - self._step_t0
        self._step_t0 = now
        self._closed.append((self._step_start, stop, self._blocks, kind, self.step_wall_s))
        self._step_start = stop
        self._blocks = []
        self.layers.new_step()
        self.source.new_step()

    @property
    def open_step(self) -> bool:
        """Whether entries were recorded since the last step closed."""
        return len(self.program) > self._step_start

    def simulate(self) -> list[tuple[str, float]]:
        """Simulate the steps closed since the last call, every rank's together (collective
        over the world: every rank calls it at the same point); returns ``(kind, seconds)``
        of each, the job's (the time between the moments its last rank ended the step before
        and this one), on every rank."""
        mine = pickle.dumps(self._payload(), protocol=pickle.HIGHEST_PROTOCOL)
        gathered = self.mpi.gather(mine, root=0) if self.mpi is not None else [mine]
        result = None
        if self.rank == 0:
            off = [r for r in range(len(gathered)) if self.node_of[r] != self.node_of[0]]
            self.control_bytes += sum(len(gathered[r]) for r in off)
            try:
                result = ("ok", self._run([pickle.loads(g) for g in gathered]))
            except (ValueError, RuntimeError) as exc:
                result = ("error", f"the job simulation of the run's steps failed: {exc}")
            nodes = len(set(self.node_of))
            self.control_bytes += (nodes - 1) * len(pickle.dumps(
                result, protocol=pickle.HIGHEST_PROTOCOL))
        if self.mpi is not None:
            result = self.mpi.bcast(result, root=0)
        if result[0] == "error":
            raise ValueError(result[1])
        steps = result[1]
        self.simulated.extend(steps)
        return steps

    def _payload(self) -> list:
        """What this rank sends rank 0 for :meth:`simulate`: per closed step its program's id
        (the program itself the first time), its blocks' seconds in program order, its kind
        and its wall time."""
        resolve_pending(self.source)
        closed, self._closed = self._closed, []
        mine = []
        for start, stop, blocks, kind, wall in closed:
            entries = rebase(self.program.since(start, stop), start)
            digest = _digest(entries)
            pid = self._sent.get(digest)
            new = pid is None
            if new:
                pid = self._sent[digest] = len(self._sent)
            mine.append((pid, normalize(entries) if new else None,
                         np.array([b.seconds or 0.0 for b in blocks], dtype=np.float64),
                         kind, wall))
        if not self.keep_program:
            self.program.drop(self._step_start)
        return mine

    def _run(self, gathered) -> tuple[list, list]:
        """Rank 0: the job simulation of the gathered steps."""
        counts = {len(g) for g in gathered}
        if len(counts) != 1:
            raise ValueError(f"the ranks closed different numbers of steps ({sorted(counts)})")
        n = counts.pop()
        if not n:
            return []
        kinds = [step[3] for step in gathered[0]]
        programs, charges = [], []
        for r, steps in enumerate(gathered):
            prog: list = []
            for pid, entries, *_ in steps:
                if entries is not None:
                    self._known[(r, pid)] = entries
                prog += rebase(self._known[(r, pid)], -len(prog))
            programs.append(prog)
            charges.append(_Measured([step[2] for step in steps]))
        first = len(self.simulated)
        keep = self._traced_steps(first, n)
        start = self._piece_start = self._drift or [0.0] * len(programs)
        sim = JobSim(programs, self.node_of, self.network, charges, **self.jobsim.kwargs(),
                     record_events=True, start=start)
        ends = sim.run()
        for link, moved in sim.moved.items():
            self.moved[link] = self.moved.get(link, 0.0) + moved
        self.ack_bytes += sim.ack_bytes
        done = [max(e[s] for e in ends) for s in range(n)]
        lengths = [b - a for a, b in zip([max(start), *done[:-1]], done)]
        # the next piece starts each rank where it ended this one (the ranks' drift carries
        # over; messages in flight and busy links at the boundary do not)
        last = [e[-1] for e in ends]
        self._drift = [t - min(last) for t in last]
        if keep:
            self._trace(sim, ends, gathered, keep, first, lengths)
        units = [s for s in range(n) if kinds[s] == "unit"]
        if units:
            self._keep_last(sim, ends, units[-1], first, lengths)
        return list(zip(kinds, lengths))

    def _keep_last(self, sim, ends, s: int, first: int, lengths) -> None:
        """Rank 0: the events of step ``s`` (the interval's last unit) of rank 0 and of the
        rank that ended it last, each from the moment it ended the step before."""
        slowest = max(range(len(ends)), key=lambda r: ends[r][s])

        def events(r):
            t0 = ends[r][s - 1] if s else self._piece_start[r]
            return [{**e, "start": e["start"] - t0, "finish": e["finish"] - t0}
                    for e in sim.events[r] if e["step"] == s]

        self.last_step = {"step": first + s, "step_s": lengths[s], "slowest_rank": slowest,
                          "ranks": {str(r): events(r) for r in sorted({0, slowest})}}

    def _traced_steps(self, first: int, n: int) -> list[int]:
        """Which of the steps ``first`` ... ``first + n - 1`` of the run ``--trace`` keeps
        (interval positions)."""
        sel = self.trace_steps
        if sel is False:
            return []
        if sel is None:
            return list(range(n))
        indices, last = sel
        keep = [s for s in range(n) if first + s in indices]
        if last and n - 1 not in keep:
            keep.append(n - 1)
        return keep

    def _trace(self, sim, ends, gathered, keep: list[int], first: int, lengths) -> None:
        """Rank 0: the kept steps' events of every rank (:mod:`simulation.trace`), each rank's
        step from the moment it ended the one before, on the run's simulated time."""
        sel = self.trace_steps
        only = set(sel[0]) if sel is not None else None
        base = self.sim_s
        for r, steps in enumerate(gathered):
            kept = self.traced.setdefault(r, [])
            if sel is not None and sel[1]:     # "last": the newest step replaces the last one
                kept[:] = [st for st in kept if st["step"] in only]
            for s in keep:
                t0 = ends[r][s - 1] if s else self._piece_start[r]
                kept.append({"step": first + s, "sim_start_s": base + t0,
                             "sim_s": lengths[s], "wall_s": steps[s][4],
                             "events": [{**e, "start": e["start"] - t0,
                                         "finish": e["finish"] - t0}
                                        for e in sim.events[r] if e["step"] == s]})

    # -- readings --------------------------------------------------------------------------------
    @property
    def compute_s(self) -> float:
        """Measured compute of the outermost blocks so far (every stream)."""
        resolve_pending(self.source)
        return self._offset["compute_s"] + self._compute_s

    @property
    def comm_modeled_s(self) -> float:
        """The α–β sum of every call booked (a bound: nothing overlapped, no link shared)."""
        return self.ledger.modeled_s

    @property
    def sim_s(self) -> float:
        """The job's simulated time of every step simulated so far."""
        return self._offset["sim_s"] + math.fsum(s for _, s in self.simulated)

    def unit_steps(self) -> list[float]:
        """The simulated length of every ``unit`` step, in order."""
        return [s for kind, s in self.simulated if kind == "unit"]

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self._t0

    def as_dict(self) -> dict:
        """Floats only (``Run.finish`` reduces each with MAX over ranks)."""
        return {"wall_s": self.wall_s, "compute_s": self.compute_s,
                "comm_modeled_s": self.comm_modeled_s, "sim_s": self.sim_s,
                "steps": float(len(self.simulated))}

    def describe(self) -> dict:
        """For ``summary.json``'s ``clock`` block: the model, the compute source, the network,
        the simulation's options and the steps simulated."""
        d = {"model": MODEL, "compute_source": self.source.describe(),
             "network": self.network.describe(),
             "job_simulation": {"link_sharing": self.jobsim.link_sharing,
                                "eager_limit": None if math.isinf(self.jobsim.eager_limit)
                                else self.jobsim.eager_limit,
                                "ack_overhead": self.network.library.ack_overhead
                                if self.jobsim.ack_overhead is None
                                else self.jobsim.ack_overhead,
                                "ack_bytes": self.ack_bytes if self.rank == 0 else None},
             "steps": len(self.simulated),
             "bytes_moved": dict(self.moved) if self.rank == 0 else None,
             "control_inter_node_bytes": self.control_bytes if self.rank == 0 else None,
             "last_step": self.last_step,
             "bound": "comm_modeled_s: every call's alpha-beta time, alone on its links, "
                      "nothing overlapped"}
        profile = self.source.profile_info()
        if profile is not None:
            d["compute_profile"] = profile
        return d

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self) -> dict:
        """Readings to restore with :meth:`load_state` on resume (after a :meth:`simulate`)."""
        return {"compute_s": self.compute_s, "sim_s": self.sim_s, "drift": self._drift}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state` on resume."""
        for k in ("sim_s", "compute_s"):
            self._offset[k] = 0.0
        self._offset["compute_s"] = float(state["compute_s"]) - self.compute_s
        self._offset["sim_s"] = float(state["sim_s"]) - self.sim_s
        drift = state.get("drift")
        self._drift = None if drift is None else [float(t) for t in drift]


def _digest(entries) -> str:
    """A step program's identity (its calls by their keys): equal digests, equal programs."""
    h = hashlib.blake2b(digest_size=16)
    for e in entries:
        if e[0] == "C":
            c = e[1]
            h.update(repr(["C", c.key_repr if isinstance(c, Call) else repr(c), *e[2:]])
                     .encode())
        else:
            h.update(repr(e).encode())
    return h.hexdigest()
