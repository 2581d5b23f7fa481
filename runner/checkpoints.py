"""Checkpoints of a run and resume, bit for bit (``--checkpoint-every``, ``--resume``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from substrate import costmodel as cm
from substrate.ledger import Ledger
from substrate.results import CHECKPOINTS, SUMMARY, Checkpointer, to_jsonable

from .run import Run

# -- checkpoints -------------------------------------------------------------------------------
_LINKS = {"none": (), cm.INTRA: (cm.INTRA,), cm.INTER: (cm.INTER,),
          "mixed": (cm.INTRA, cm.INTER)}


def _restore_ledger(ledger: Ledger, entries: dict) -> None:
    """Make ``ledger`` hold exactly ``entries`` (``Ledger.local()`` of a checkpoint)."""
    ledger.reset()
    for phase, e in entries.items():
        ledger.record(phase, payload=e["payload_bytes"], intra=e["intra_bytes"],
                      inter=e["inter_bytes"], messages=e["messages"], modeled_s=e["modeled_s"],
                      links=_LINKS[e["link"]], calls=e["calls"])


class RunCheckpoints:
    """Checkpoint and resume a training loop (every trainer uses this one class).

    A checkpoint holds the trainer's state (a dict of arrays; JSON text for nested values)
    plus the run's own: the ledger of this rank (so the resumed run's traffic is the whole
    run's), the call log's count and digest (so are its calls), its measured compute time,
    rank 0's metrics lines up to the checkpoint (a resumed run neither loses nor repeats a
    line), a fingerprint of everything that must not change, and the schedule that follows from
    the total.
    Files: ``OUT/checkpoints/ckpt-r{rank}-s{done:08d}.npz`` (newest two kept; in
    ``OUT/checkpoints.pending`` while an ``--overwrite`` run is not published), written after
    every ``every``-th unit and at the end.

    Parameters
    ----------
    run : Run
    every : int
        ``--checkpoint-every`` (0: never save).
    fingerprint : dict
        JSON-able values a resumed run must share (configuration without the resumable fields);
        the common options but ``--out``/``--overwrite`` and the world size are added.
    unit, flag : str
        What is counted ("iteration") and the flag that sets the total in those units
        ("--iters"), for messages.
    given : str, optional
        How the user set the total where it was not ``flag`` with the total itself, for
        messages: another option (``"--epochs 1"``, of which the total follows) or ``flag``
        with another value (a strategy that runs more steps than ``--steps`` asks).  It is kept
        in the checkpoint, so a resume refused for its total names the option the run was
        started with (``pass --epochs 2 or more``), whichever option the resume passes.
    may_change : tuple of str
        The options besides ``flag``, ``--checkpoint-every`` and ``--progress-every`` that a
        resume may change (``("--epochs",)``), for messages.
    schedule : dict, optional
        JSON-able values that fix what the trainer does at each unit and follow from the total
        (a cosine learning rate's length and warm-up): a resume that would change them is
        refused (``schedule_why`` says why they depend on the total), so a resumed run always
        equals the uninterrupted one.  A run's total may change on resume only where its
        schedule does not depend on it.
    schedule_why : str
        How ``schedule`` depends on the total, for the message.
    """

    def __init__(self, run: Run, *, every: int, fingerprint: dict, unit: str, flag: str,
                 given: str | None = None, may_change: tuple[str, ...] = (),
                 schedule: dict | None = None, schedule_why: str = "") -> None:
        if every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got {every}")
        self.run = run
        self.every = every
        self.unit, self.flag = unit, flag
        self.given, self.may_change = given, tuple(may_change)
        common = {k: v for k, v in dataclasses.asdict(run.common).items()
                  if k not in ("out", "overwrite")}
        fp = {**fingerprint, **common, "world": run.size}
        self.fingerprint = json.loads(json.dumps(to_jsonable(fp)))  # as it comes back
        self.schedule = (json.loads(json.dumps(to_jsonable(schedule)))
                         if schedule is not None else None)
        self.schedule_why = schedule_why
        #: the total of the run (set by :meth:`save` / :meth:`resume`; kept in the checkpoint)
        self.total: int | None = None
        # with --overwrite apart from the replaced run's until this run is published
        where = getattr(run, "checkpoints", None) or Path(run.out) / CHECKPOINTS
        self.ckpt = Checkpointer(where, rank=run.rank)

    def due(self, done: int, last: bool) -> bool:
        """Whether to save after ``done`` units (``last``: the loop is over)."""
        return bool(self.every) and (done % self.every == 0 or last)

    # -- messages -------------------------------------------------------------------------------
    def asked(self, total: int) -> str:
        """The total as the user asked for it: ``--steps 8``, or ``--epochs 1 (45 steps)``."""
        plain = f"{self.flag} {total}"
        if self.given is None or self.given == plain:
            return plain
        return f"{self.given} ({total} {self.unit}s)"

    def _instead(self) -> str:
        """`` (instead of --epochs)`` where the user set the total with another option."""
        given = self.given.split()[0] if self.given else self.flag
        return "" if given == self.flag else f" (instead of {given})"

    def _larger(self, started: str | None = None) -> str:
        """The options that ask for more units: ``--epochs (or --steps)``, or ``--steps``
        (``started``: how the checkpointed run set its total, see :meth:`_started_with`)."""
        options = [g.split()[0] for g in (started, self.given) if g]
        other = next((o for o in options if o != self.flag), None)
        return self.flag if other is None else f"{other} (or {self.flag})"

    def _started_with(self, saved: dict | None) -> str | None:
        """How the checkpointed run set its total where that was not ``flag`` with the total
        itself (``--epochs 2``, or ``--steps 4`` of a strategy that runs 6): what a resume
        passes to get that total again.  ``None`` otherwise, and for a checkpoint that does
        not say (written before the checkpoint kept it)."""
        if not saved or saved.get("given") is None or saved.get("total") is None:
            return None
        given = str(saved["given"])
        return None if given == f"{self.flag} {saved['total']}" else given

    def save(self, done: int, state: dict) -> None:
        """Write this rank's checkpoint after ``done`` units (every rank calls it)."""
        run = self.run
        full = {**state,
                "run/fingerprint": json.dumps(self.fingerprint),
                "run/schedule": json.dumps({"total": self.total, "values": self.schedule,
                                            "given": self.given}),
                "run/ledger": json.dumps(run.ledger.local()),
                "run/clock": json.dumps(run.clock.state()),
                "run/calls": json.dumps(run.recorder.log.state()),
                "run/metrics": json.dumps(run.writer.records)}
        self.ckpt.save(full, done)

    def resume(self, total: int) -> tuple[int, dict]:
        """Load the newest checkpoint intact on every rank (collective).

        Restores the ledger, the compute time and the metrics lines, checks the fingerprint and
        ``total``; returns ``(units done, the trainer's state)``.

        Raises
        ------
        ValueError
            No checkpoint; none intact on every rank (naming the damaged files); a different
            configuration; ``total`` below the units done; a finished run with nothing left.
        """
        run, ck = self.run, self.ckpt
        intact, corrupt = ck.scan()
        views = run.world.mpi.allgather((intact, corrupt))
        common = set(views[0][0]).intersection(*(set(v[0]) for v in views[1:]))
        damaged = [f"{Checkpointer(ck.dir, r).path(s)} ({why})"
                   for r, (_, bad) in enumerate(views) for s, why in sorted(bad.items())]
        if not common:
            if not damaged:
                have = ", ".join(f"rank {r}: {v[0]}" for r, v in enumerate(views) if v[0])
                raise ValueError(
                    f"--resume: no checkpoint of every rank in {ck.dir} "
                    f"({'steps per rank: ' + have if have else 'no checkpoint at all'}); run "
                    "without --resume to start afresh, or pass the --out of a run that used "
                    "--checkpoint-every N")
            good = {r: v[0][-1] for r, v in enumerate(views) if v[0]}
            last = ("; the last good checkpoint per rank: " + ", ".join(
                str(Checkpointer(ck.dir, r).path(s)) for r, s in good.items())) if good else ""
            raise ValueError(f"--resume: no checkpoint in {ck.dir} is intact on every rank: "
                             f"damaged: {'; '.join(damaged)}{last}; restore the files or start "
                             "afresh with --overwrite")
        step = max(common)
        newer_damaged = [(r, s) for r, (_, bad) in enumerate(views) for s in bad if s > step]
        if newer_damaged:
            for r, s in newer_damaged:
                if r == run.rank:
                    ck.set_aside(s)
            if run.rank == 0:
                print(f"spardist: warning: damaged checkpoint(s): {'; '.join(damaged)}; resuming "
                      f"from {self.unit} {step}, the newest checkpoint intact on every rank "
                      f"({ck.path(step)}): safe, the {self.unit}s after it are recomputed with "
                      "the same result (damaged files renamed to *.corrupt)",
                      file=sys.stderr, flush=True)
        state = ck.load(step)
        if "run/fingerprint" not in state:
            raise ValueError(f"--resume: {ck.path(step)} is not a checkpoint of a spardist run "
                             f"(it holds {', '.join(sorted(state)[:6]) or 'nothing'}"
                             f"{' ...' if len(state) > 6 else ''}): restore the checkpoint "
                             "files the run wrote, or start afresh with --overwrite")
        saved = json.loads(str(state.pop("run/fingerprint")))
        diff = sorted(k for k in set(saved) | set(self.fingerprint)
                      if saved.get(k) != self.fingerprint.get(k))
        if diff:
            raise ValueError(
                f"--resume: the checkpoint in {ck.dir} was written with different "
                + ", ".join(f"{k}={saved.get(k)!r} (now {self.fingerprint.get(k)!r})"
                            for k in diff)
                + f"; resume with the same options (only "
                  f"{', '.join((self.flag, *self.may_change))}, --checkpoint-every and "
                  "--progress-every may change) or start afresh with --overwrite")
        saved_schedule = json.loads(str(state.pop("run/schedule", "null")))
        started = self._started_with(saved_schedule)
        if step > total:
            again = (f"{started} or more (the {saved_schedule['total']} {self.unit}s it was "
                     "started with)" if started is not None
                     else f"{self.flag} {step} or more{self._instead()}")
            raise ValueError(f"--resume: {self.asked(total)} is smaller than the {step} "
                             f"{self.unit}s already done (checkpoints in {ck.dir}): pass "
                             f"{again} to continue, or start afresh with --overwrite")
        if step == total and run.previous == "finished":
            raise ValueError(f"--resume: the run in {run.out} already finished its {total} "
                             f"{self.unit}s ({SUMMARY}): pass a larger {self._larger(started)} "
                             "to train further, or start afresh with --overwrite")
        self._check_schedule(saved_schedule, total, step)
        self.total = total
        _restore_ledger(run.ledger, json.loads(str(state.pop("run/ledger"))))
        run.clock.load_state(json.loads(str(state.pop("run/clock"))))
        calls = state.pop("run/calls", None)    # absent in checkpoints of older spardists
        if calls is not None:
            run.recorder.log.load_state(json.loads(str(calls)))
        for line in json.loads(str(state.pop("run/metrics"))):
            run.writer.log(json.loads(line))
        return step, state

    def _check_schedule(self, saved: dict | None, total: int, step: int) -> None:
        """Refuse a resume whose total changes the schedule the checkpoint was written under
        (a checkpoint without one, written before schedules were recorded, is not checked)."""
        if saved is None or saved.get("values") is None or self.schedule is None:
            return
        was, now = saved["values"], self.schedule
        diff = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
        if not diff:
            return
        changes = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in diff)
        keep, started = saved.get("total"), self._started_with(saved)
        if keep is not None and keep > step and started is not None:
            again = (f"resume with {started} (the total it was written with: {keep} "
                     f"{self.unit}s)")
        elif keep is not None and keep > step:
            again = (f"resume with {self.flag} {keep}{self._instead()} (the total it was "
                     "written with)")
        else:
            again = (f"the run ends with its {step} {self.unit}s under that schedule: train "
                     "further in a new run (another --out)")
        raise ValueError(f"--resume: {self.asked(total)} would change the schedule of the run "
                         f"in {self.run.out} ({changes}): {self.schedule_why}; a resumed run "
                         f"keeps the schedule it started with, so it equals the uninterrupted "
                         f"run: {again}, or start afresh with --overwrite")
