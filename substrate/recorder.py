"""The run's books: every executed call is booked in the ledger, declared on the timeline and
logged, from its one record (:class:`substrate.calls.Call`).

A :class:`Recorder` is shared by every :class:`~substrate.comm.Comm` of a run.  For each call a
communicator runs (or, on a rank outside the group, waits for) it

* books what this rank handed to MPI in the :class:`~substrate.ledger.Ledger`, with the α–β
  seconds :func:`substrate.calls.rank_seconds` gives the record (this rank's entry:
  :func:`substrate.calls.seconds_of`);
* declares the record's event on the run's :class:`~substrate.timeline.Timeline` (when the clock
  keeps one) after its dependencies (:func:`substrate.calls.declare_one`): by default after
  everything the rank declared before, and the rank's next compute waits for it (a blocking
  call in program order); or after exactly the events passed as ``after=`` (a call issued
  to a communication stream: it overlaps what the rank computes next);
* appends the record to the :class:`~substrate.calls.CallLog` (count and digest: a run and its
  replay agree call for call); :meth:`Recorder.account` holds the calls of an interval against
  the plan's records of the interval and prices them for the run's ``predicted`` block, so a
  run that does not execute exactly its plan stops with the first difference.

It returns a :class:`Handle` carrying the record, its event and the call's result.
"""

from __future__ import annotations

from .calls import Call, CallLog, Placement, bytes_by_phase, declare_one, seconds_of
from .costmodel import CostModel
from .ledger import Ledger

__all__ = ["Handle", "Recorder"]


class Handle:
    """What a communication call returns: its record, its timeline event (``None`` without a
    timeline) and its result (the reduced buffer, the gathered array, ...).

    Pass a handle (or its :attr:`event`) in a later call's ``after=`` or a compute block's
    ``deps=``.  :meth:`wait` completes a non-blocking call and returns the result.
    """

    __slots__ = ("_wait", "call", "entry", "event", "program", "result")

    def __init__(self, call: Call | None, event=None, result=None, wait=None, entry=None,
                 program=None) -> None:
        self.call = call
        self.event = event
        self.result = result
        self._wait = wait
        self.entry = entry            # its entry in the rank's recorded program (replay)
        self.program = program

    def wait(self):
        """Complete the call (a no-op for blocking calls) and return its result."""
        if self._wait is not None:
            w, self._wait = self._wait, None
            if self.program is not None and self.entry is not None:
                self.program.wait(self.entry)
            w()
        return self.result

    @property
    def done(self) -> bool:
        return self._wait is None

    def __repr__(self) -> str:
        what = self.call.phase if self.call is not None else "none"
        return f"Handle({what}, event={getattr(self.event, 'label', None)!r})"


def _events(after) -> list:
    """Timeline events of ``after`` (events, handles or ``None``s, one or a sequence)."""
    if after is None:
        return []
    if not isinstance(after, (list, tuple)):
        after = (after,)
    out = []
    for a in after:
        if a is None:
            continue
        ev = a.event if isinstance(a, Handle) else a
        if ev is not None:
            out.append(ev)
    return out


class Recorder:
    """Ledger, timeline and call log of one rank (see the module docstring).

    Parameters
    ----------
    placement : Placement
        Node of every world rank.
    rank : int
        This process's world rank.
    cost : CostModel, optional
    ledger : Ledger, optional
    """

    def __init__(self, placement: Placement, rank: int, cost: CostModel | None = None,
                 ledger: Ledger | None = None) -> None:
        self.placement = placement
        self.rank = int(rank)
        self.cost = cost if cost is not None else CostModel()
        self.ledger = ledger if ledger is not None else Ledger()
        self.timeline = None
        self.log = CallLog()
        #: ``--overlap``: calls issued without waiting overlap what follows (False: every call
        #: blocks, and the timeline declares every call as blocking)
        self.overlap = True
        #: the rank's event program, recorded for replay (:mod:`substrate.program`; ``None``:
        #: not recorded)
        self.program = None
        self.last_entry: int | None = None

    def book(self, call: Call, *, payload: int, intra: int = 0, inter: int = 0,
             messages: int = 0, links=()) -> None:
        """Book this rank's part of ``call`` in the ledger (bytes it handed to MPI)."""
        seconds = seconds_of(call, self.cost, self.placement, self.rank)
        self.ledger.record(call.phase, payload=payload, intra=intra, inter=inter,
                           messages=messages, modeled_s=seconds, links=links)

    def declare(self, call: Call, after=None, member: bool = True, wait: bool = True,
                tag: int | None = None):
        """Log ``call`` and declare it on the timeline (``None`` without one): after ``after``
        (events or handles), or, when ``after`` is ``None``, after everything declared before.
        ``member=False``: this rank does not take part, it waits for the call; ``wait``:
        whether it was issued blocking (for the recorded program)."""
        self.log.add(call, member)
        tl = self.timeline
        ev = None
        if tl is not None:
            if after is not None and self.overlap:
                ev = declare_one(tl, call, self.placement, self.rank, _events(after))
            else:
                ev = declare_one(tl, call, self.placement, self.rank, tl.frontier())
                tl.block(ev)
        if self.program is not None:
            self.last_entry = self.program.call(call, after if self.overlap else None, member,
                                                wait, ev, tag)
        return ev

    def handle(self, call: Call, event, result, wait=None) -> Handle:
        """The handle of the call just declared (its program entry attached)."""
        return Handle(call, event, result, wait, self.last_entry if self.program else None,
                      self.program)

    def account(self, planned) -> dict:
        """The plan's records of the calls executed since the previous ``account``: check them
        against what ran (:meth:`substrate.calls.CallLog.check`) and return their
        ``{phase: {"intra": bytes, "inter": bytes}}`` (the run's predicted traffic)."""
        planned = list(planned)
        self.log.check(planned, self.rank)
        return bytes_by_phase(planned, self.placement)
