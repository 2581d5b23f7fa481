"""One run loop for every trainer: units, traffic, evaluation, metrics lines, progress,
checkpoints and resume, written once.

A trainer describes one unit of its work (an ADMM iteration, an optimizer step, an epoch) as a
:class:`LoopBody` and hands it to :meth:`RunLoop.run`::

    loop = RunLoop(run, total=iters, flag="--iters", fingerprint=fp,
                   checkpoint_every=..., progress_every=..., eval_every=1, resume=...)
    state = loop.resume()          # the body's own state of a checkpoint, or None
    ...                            # build the model / restore it from ``state``
    loop.account(setup_records)    # calls made before the first unit, if any
    loop.run(body)
    run.finish(metrics={..., "final_test_accuracy": loop.final_accuracy},
               predicted=loop.predicted.block())

Per unit the loop

1. asks the body to run it (:meth:`LoopBody.unit`, told by a :class:`Due` whether the unit will
   write a metrics line or be evaluated, so e.g. a per-step diagnostic runs only on logged
   units); the body returns the plan's call records of what the unit executed;
2. closes the clock's step (``run.clock.step()``: the wall time of everything the rank did
   since the previous unit's bookkeeping; the step's simulated time comes with the line);
3. accounts the records (``run.recorder.account``, which stops the run when the calls that ran
   are not the plan's) into :attr:`RunLoop.predicted` (:class:`substrate.ledger.Predicted`, the
   run's one traffic accumulator) and into the interval of the next metrics line;
4. evaluates when due (``--eval-every N``: after every N-th unit, and always after the last;
   ``0``: only after the last), timed apart from the step (``eval_wall_s``); an evaluation
   that communicates returns its records too, accounted into the same line;
5. writes the metrics line when due (the log schedule, an evaluation, or the last unit), in
   the schema of ``runner/metrics.schema.json`` (:mod:`runner.metrics`), after the job
   simulation of the interval's steps (``run.clock.simulate()``, collective: every rank's
   recorded steps run together on the network; ``step_sim_s`` is their mean);
6. updates the progress (:class:`runner.progress.Progress`) and saves a checkpoint when due
   (:class:`runner.checkpoints.RunCheckpoints`): the body's state plus the loop's own
   (interval, predicted traffic, last accuracy, timing sums), so a resumed run writes the
   same lines and the same traffic as an uninterrupted one;
7. restarts the wall clock (``run.clock.mark()``), so the next unit's ``step_wall_s`` holds
   neither the evaluation nor the bookkeeping.

The run ends after ``total`` units or as soon as :meth:`LoopBody.stopped` says so (e.g. an ADMM
solver that converged); the unit that ends it is evaluated and logged like the last.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from substrate.ledger import Predicted

from .checkpoints import RunCheckpoints
from .progress import Progress
from .run import Run

__all__ = ["Due", "Evaluation", "Interval", "LoopBody", "RunLoop"]

#: checkpoint entries of the loop itself (``loop/timing`` holds measured times only)
STATE_KEY, TIMING_KEY = "loop/state", "loop/timing"


@dataclass(frozen=True)
class Due:
    """What the loop will do after the unit about to run (decided before it runs).

    Attributes
    ----------
    index : int
        The unit's index, from 0 (units done before it).
    log : bool
        The unit writes a metrics line (the log schedule, an evaluation or the last unit).
    eval : bool
        The unit is evaluated (``--eval-every``, or the last unit).
    last : bool
        The last unit of the budget.  A unit after which :meth:`LoopBody.stopped` ends the run
        early is evaluated and logged although its ``Due`` did not say so.
    """

    index: int
    log: bool
    eval: bool
    last: bool


@dataclass
class Evaluation:
    """What :meth:`LoopBody.evaluate` returns.

    Attributes
    ----------
    test_accuracy : float or None
        The held-out accuracy; ``None`` on a rank that does not evaluate (rank 0 writes the
        lines) or when there is nothing to score.
    records : sequence of substrate.calls.Call
        The plan's records of the calls the evaluation made (every rank), accounted like a
        unit's and added to the line's interval; such an evaluation's blocks and calls are
        closed as a step of their own (``eval``) unless it is the last, so the next unit's
        simulated time is its own.
    values : dict
        More fields for the line (e.g. ``test_loss``).
    """

    test_accuracy: float | None = None
    records: Sequence = ()
    values: dict = field(default_factory=dict)


@dataclass
class Interval:
    """The units since the previous metrics line (what :meth:`LoopBody.line` may need)."""

    units: int = 0
    intra: int = 0
    inter: int = 0
    #: ``{phase: {"intra": bytes, "inter": bytes}}`` of the interval's accounted records
    phase_bytes: dict = field(default_factory=dict)

    def add(self, phases: dict) -> dict:
        """Add one account's ``{phase: {"intra", "inter"}}``; returns its totals."""
        total = {"intra": 0, "inter": 0}
        for phase, b in phases.items():
            e = self.phase_bytes.setdefault(phase, {"intra": 0, "inter": 0})
            for link in ("intra", "inter"):
                e[link] += int(b[link])
                total[link] += int(b[link])
        self.intra += total["intra"]
        self.inter += total["inter"]
        return total

    def state(self) -> dict:
        return {"units": self.units, "intra": self.intra, "inter": self.inter,
                "phase_bytes": self.phase_bytes}


class LoopBody:
    """A trainer's unit of work, as :class:`RunLoop` drives it (override what applies)."""

    def unit(self, due: Due) -> Sequence:
        """Run unit ``due.index``; return the plan's call records of the calls it made."""
        raise NotImplementedError

    def evaluate(self) -> Evaluation | None:
        """Evaluate the model (collective where the evaluation communicates); ``None``: this
        trainer has no evaluation."""
        return None

    def line(self, interval: Interval) -> dict:
        """The system's own fields of a metrics line (called once per line, after the
        evaluation), e.g. ``{"loss": mean loss of the interval}``."""
        return {}

    def progress(self) -> dict:
        """Values shown by the progress line after each unit (e.g. ``{"loss": ...}``)."""
        return {}

    def stopped(self) -> bool:
        """Whether the run is over before its budget (checked before and after each unit)."""
        return False

    def state_dict(self) -> dict:
        """The body's state for a checkpoint (arrays; JSON text for nested values), taken after
        the unit, its evaluation and its line."""
        return {}


def _finite(v) -> float | None:
    """``v`` as a float, or ``None`` for ``None`` and NaN (JSON has no NaN)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


class RunLoop:
    """The run loop of every trainer (see the module docstring).

    Parameters
    ----------
    run : Run
        The run; ``run.unit`` names the unit.
    total : int
        Units of the run (``--iters``, ``--steps``, ...).
    flag : str
        The flag that sets ``total`` in units, for messages (``"--iters"``).
    given, may_change : str, tuple of str
        How the user set the total where not with ``flag`` itself (``"--epochs 1"``), and the
        options besides ``flag`` that a resume may change, for messages
        (:class:`RunCheckpoints`).
    fingerprint : dict
        Configuration a resumed run must share (:class:`RunCheckpoints`).
    checkpoint_every, progress_every : int
        ``--checkpoint-every`` (0: never), ``--progress-every`` (0: quiet).
    eval_every : int
        Evaluate after every ``eval_every``-th unit and after the last; 0: after the last only.
    log_every, log_phase : int
        Write a metrics line after unit ``done`` when ``done % log_every == log_phase %
        log_every`` (0: only where an evaluation is or at the last unit); lines are also
        written at every evaluation and at the last unit.
    resume : bool
        ``--resume``: :meth:`resume` continues from the newest checkpoint.
    schedule, schedule_why : dict, str
        What of the trainer's schedule follows from ``total`` (e.g. a cosine learning rate's
        length and warm-up) and why: a resume whose ``total`` changes it is refused
        (:class:`RunCheckpoints`).
    """

    def __init__(self, run: Run, *, total: int, flag: str, given: str | None = None,
                 may_change: tuple[str, ...] = (), fingerprint: dict | None = None,
                 checkpoint_every: int = 0, progress_every: int = 0, eval_every: int = 0,
                 log_every: int = 0, log_phase: int = 0, resume: bool = False,
                 schedule: dict | None = None, schedule_why: str = "") -> None:
        for name, v in (("--eval-every", eval_every), ("--log-every", log_every),
                        ("--progress-every", progress_every)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if total < 0:
            raise ValueError(f"{flag} must be >= 0, got {total}")
        self._run = run
        self.total, self.flag = int(total), flag
        self.eval_every, self.log_every, self.log_phase = eval_every, log_every, log_phase
        self.progress_every = progress_every
        self.resuming = bool(resume)
        self.ckpt = RunCheckpoints(run, every=checkpoint_every, fingerprint=fingerprint or {},
                                   unit=run.unit, flag=flag, given=given,
                                   may_change=may_change, schedule=schedule,
                                   schedule_why=schedule_why)
        self.ckpt.total = self.total
        #: units done (the next unit's index)
        self.done = 0
        #: units done when this process started (after :meth:`resume`)
        self.start = 0
        #: the run's predicted traffic: every accounted record, set-up and evaluations included
        self.predicted = Predicted()
        #: the last evaluation's accuracy (``None``: none yet, or this rank does not evaluate)
        self.accuracy: float | None = None
        #: wall seconds of every unit of the run so far (rank-local; resumed runs included)
        self.units_wall_s = 0.0
        self._interval = Interval()
        self._sums = {"wall_s": 0.0, "sim_s": 0.0, "sim_units": 0.0}
        self._snap = run.ledger.local()

    # -- schedule -------------------------------------------------------------------------------
    def due(self, index: int) -> Due:
        """The :class:`Due` of unit ``index`` (from 0)."""
        done = index + 1
        last = done == self.total
        ev = last or (self.eval_every > 0 and done % self.eval_every == 0)
        log = ev or (self.log_every > 0 and
                     done % self.log_every == self.log_phase % self.log_every)
        return Due(index=index, log=log, eval=ev, last=last)

    @property
    def final_accuracy(self) -> float:
        """The last evaluation's accuracy (NaN where there is none: other ranks than the
        evaluating one)."""
        return float("nan") if self.accuracy is None else self.accuracy

    # -- traffic --------------------------------------------------------------------------------
    def account(self, records) -> dict:
        """Hold ``records`` against the calls run since the previous account (raises on a
        difference), add their bytes to :attr:`predicted` and to the next line's interval;
        returns their ``{phase: {"intra", "inter"}}``.  For calls outside a unit (set-up)."""
        phases = self._run.recorder.account(records)
        self.predicted.add(phases)
        self._interval.add(phases)
        return phases

    # -- checkpoints ----------------------------------------------------------------------------
    def resume(self) -> dict | None:
        """With ``--resume``: load the newest checkpoint intact on every rank (collective;
        :meth:`RunCheckpoints.resume`), restore the loop's state and return the body's (the
        checkpoint's other entries); otherwise ``None``."""
        if not self.resuming:
            return None
        done, state = self.ckpt.resume(self.total)
        if STATE_KEY not in state or TIMING_KEY not in state:
            raise ValueError(f"--resume: the checkpoint in {self.ckpt.ckpt.dir} holds no run "
                             "loop state (written by an older spardist); start afresh with "
                             "--overwrite")
        s = json.loads(str(state.pop(STATE_KEY)))
        t = json.loads(str(state.pop(TIMING_KEY)))
        self.predicted = Predicted.from_state(s["predicted"])
        self._interval = Interval(**s["interval"])
        self._snap = s["snap"]
        self.accuracy = s["accuracy"]
        self._sums = {k: float(t.get(k, 0.0)) for k in self._sums}
        self.units_wall_s = float(t["units_wall_s"])
        self.done = self.start = int(done)
        return state

    def _state(self) -> dict:
        return {STATE_KEY: json.dumps({"interval": self._interval.state(), "snap": self._snap,
                                       "accuracy": self.accuracy,
                                       "predicted": self.predicted.state()}),
                TIMING_KEY: json.dumps({**self._sums, "units_wall_s": self.units_wall_s})}

    # -- the loop -------------------------------------------------------------------------------
    def run(self, body: LoopBody) -> None:
        """Run units until ``total`` or until ``body.stopped()`` (see the module docstring)."""
        run = self._run
        progress = Progress(run, total=self.total, unit=run.unit, every=self.progress_every,
                            start=self.done)
        run.clock.mark()   # set-up is not part of the first unit
        try:
            while self.done < self.total and not body.stopped():
                self._unit(body, progress)
        finally:
            progress.close()

    def _unit(self, body: LoopBody, progress: Progress) -> None:
        run = self._run
        due = self.due(self.done)
        records = body.unit(due)
        run.clock.step()
        self._sums["wall_s"] += run.clock.step_wall_s
        self.units_wall_s += run.clock.step_wall_s
        self._interval.units += 1
        self.account(records)
        self.done += 1
        last = self.done == self.total or body.stopped()
        ev, eval_wall_s = None, None
        if due.eval or last:
            self._simulate()        # the simulated time so far (a time to a target accuracy)
            t0 = time.perf_counter()
            ev = body.evaluate()
            eval_wall_s = time.perf_counter() - t0
            if ev is not None:
                self.accuracy = _finite(ev.test_accuracy)
                if ev.records:
                    self.account(ev.records)
                    if not last:    # its blocks and calls: a step of their own
                        run.clock.step("eval")
        if due.log or ev is not None or last:
            self._line(body, ev, eval_wall_s)
        p = self.predicted
        progress.update(self.done, **body.progress(), test_accuracy=self.accuracy,
                        inter_bytes=p.total("inter"),
                        total_bytes=p.total("inter") + p.total("intra"))
        if self.ckpt.due(self.done, last=last):
            self._simulate()            # the checkpoint holds the simulated time so far
            self.ckpt.save(self.done, {**body.state_dict(), **self._state()})
        run.clock.mark()

    def _simulate(self) -> None:
        """The job simulation of the steps closed since the last one (collective), the units'
        added to the interval's sums."""
        for kind, seconds in self._run.clock.simulate():
            if kind == "unit":
                self._sums["sim_s"] += seconds
                self._sums["sim_units"] += 1

    def _line(self, body: LoopBody, ev: Evaluation | None, eval_wall_s: float | None) -> None:
        """Write the metrics line of the interval (rank 0) and start the next interval."""
        run, iv = self._run, self._interval
        n = max(1, iv.units)
        self._simulate()
        sims = self._sums["sim_units"]
        delta = run.ledger.since(self._snap)
        self._snap = run.ledger.local()
        line = {"interval_units": iv.units,
                "intra_node_bytes": iv.intra, "inter_node_bytes": iv.inter,
                "step_wall_s": self._sums["wall_s"] / n,
                "step_sim_s": self._sums["sim_s"] / sims if sims else None,
                "sim_s": run.clock.sim_s,
                "eval_wall_s": eval_wall_s if ev is not None else None,
                "test_accuracy": self.accuracy if ev is not None else None,
                "compute_s": run.clock.compute_s, "comm_modeled_s": run.clock.comm_modeled_s,
                "phase_modeled_s": {p: e["modeled_s"] for p, e in delta.items()}}
        if ev is not None:
            line.update(ev.values)
        line.update(body.line(iv))
        run.log(self.done, **line)
        self._interval = Interval()
        self._sums = dict.fromkeys(self._sums, 0.0)
