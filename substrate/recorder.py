"""The run's books: every executed call is booked in the ledger, recorded in the rank's program
and logged, from its one record (:class:`substrate.calls.Call`).

A :class:`Recorder` is shared by every :class:`~substrate.comm.Comm` of a run.  For each call a
communicator runs (or, on a rank outside the group, waits for) it

* books what this rank handed to MPI in the :class:`~substrate.ledger.Ledger`, with the α–β
  seconds :func:`substrate.calls.rank_seconds` gives the record (this rank's entry:
  :func:`substrate.calls.seconds_of`);
* records the call in the rank's program (:class:`substrate.program.Program`, which the job
  simulation runs, :mod:`simulation.jobsim`) after its dependencies: by default blocking, after
  everything the rank did before; or after exactly the entries passed as ``after=`` (a call
  issued to a communication stream: it overlaps what the rank computes next);
* appends the record to the call log, a :class:`~substrate.calls.CallLog` whose digest is
  chained block by block (:class:`ChainedLog`: count and digest, a run and its replay agree
  call for call); :meth:`Recorder.account` holds the calls of an interval against
  the plan's records of the interval and prices them for the run's ``predicted`` block, so a
  run that does not execute exactly its plan stops with the first difference.

It returns a :class:`Handle` carrying the record, its program entry and the call's result.
"""

from __future__ import annotations

import hashlib

from .calls import Call, CallLog, Placement, bytes_by_phase, seconds_of
from .costmodel import CostModel
from .ledger import Ledger

__all__ = ["Booking", "ChainedLog", "Handle", "Recorder"]

#: records whose modeled seconds a recorder keeps (:meth:`Recorder.seconds`)
MAX_SECONDS = 4096


class ChainedLog(CallLog):
    """The rank's :class:`~substrate.calls.CallLog` (count, digest, the records since the last
    check) with its SHA-256 chained over blocks of :attr:`BLOCK` records instead of record by
    record: one running hash takes each record's line (``repr((call.key(), member))`` and a
    newline, worked out once per collective record), and every :attr:`BLOCK` records its
    digest starts the next block.  The digest after ``n`` records is the running hash's:
    SHA-256 of the last closed block's digest (SHA-256 of nothing before the first) and the
    lines of the open block.  It depends on the records, in order, alone (a changed, missing
    or extra record changes it): a run and its replay, and a resumed run and the
    uninterrupted one, agree call for call.  :meth:`state` carries the count, the digest, the
    last closed block's digest and the open block's lines (fewer than :attr:`BLOCK`) through a
    checkpoint; :meth:`load_state` continues from it."""

    #: records per chained block
    BLOCK = 16
    #: collective records whose lines are kept (a communicator reuses its records)
    MAX_LINES = 4096

    def __init__(self) -> None:
        super().__init__()
        self._start(hashlib.sha256().digest(), [])
        self._lines: dict = {}

    def _start(self, block: bytes, tail: list) -> None:
        """Open a block after the one whose digest is ``block``, holding the lines ``tail``."""
        self._block = block
        self._hash = hashlib.sha256(block)
        for line in tail:
            self._hash.update(line)
        self._tail = list(tail)

    def _line(self, call: Call, member: bool) -> bytes:
        """The record's line (kept for a collective record, which comes back)."""
        if call.algorithm in ("p2p", "alltoallv"):     # a new record every call
            return f"({call.key_repr}, {member!r})\n".encode()
        if len(self._lines) >= self.MAX_LINES:
            self._lines.clear()
        text = call.key_repr
        hit = self._lines[id(call)] = (call, f"({text}, False)\n".encode(),
                                       f"({text}, True)\n".encode())   # holds the record
        return hit[2] if member else hit[1]

    def add(self, call: Call, member: bool = True) -> None:
        self.count += 1
        hit = self._lines.get(id(call))
        if hit is not None and hit[0] is call:
            line = hit[2] if member else hit[1]
        else:
            line = self._line(call, member)
        self._hash.update(line)
        tail = self._tail
        tail.append(line)
        if len(tail) >= self.BLOCK:
            self._start(self._hash.digest(), [])
        pending = self.pending
        if len(pending) < self.MAX_PENDING:
            pending.append((call, member))
        else:
            self.overflow = True

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()

    def state(self) -> dict:
        """The count and digest, and what continues the chain (JSON-able), for a
        checkpoint."""
        return {"count": self.count, "sha256": self.digest, "block": self._block.hex(),
                "tail": [line.decode() for line in self._tail]}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state` (the calls since, still to be checked, are kept).  A
        state without the block (an older checkpoint: count and digest only) continues the
        chain from its digest."""
        self.count = int(state["count"])
        if "block" in state:
            self._start(bytes.fromhex(state["block"]),
                        [line.encode() for line in state.get("tail", ())])
        else:
            self._start(bytes.fromhex(state["sha256"]), [])


class Handle:
    """What a communication call returns: its record, its entry in the rank's program
    (:attr:`event`; ``None`` without a program) and its result (the reduced buffer, the
    gathered array, ...).

    Pass a handle (or its :attr:`event`) in a later call's ``after=`` or a compute block's
    ``deps=``.  :meth:`wait` completes a non-blocking call and returns the result.
    """

    __slots__ = ("_wait", "call", "event", "program", "result")

    def __init__(self, call: Call | None, event=None, result=None, wait=None,
                 program=None) -> None:
        self.call = call
        self.event = event
        self.result = result
        self._wait = wait
        self.program = program

    def wait(self):
        """Complete the call (a no-op for blocking calls) and return its result."""
        if self._wait is not None:
            w, self._wait = self._wait, None
            if self.program is not None and self.event is not None:
                self.program.wait(self.event)
            w()
        return self.result

    @property
    def done(self) -> bool:
        return self._wait is None

    def __repr__(self) -> str:
        what = self.call.phase if self.call is not None else "none"
        return f"Handle({what}, entry={self.event!r})"


class Booking:
    """What one rank books for one call record, worked out once and booked as often as the
    record runs (:meth:`Recorder.booking`, :meth:`Recorder.book_fixed`): the payload, the bytes
    per link class, the messages and the links of what the rank hands to MPI, and the record's
    modeled seconds on this rank (worked out again if the recorder's cost model or placement
    is replaced).

    Parameters
    ----------
    call : Call
        The record.
    payload, intra, inter, messages : int
        As :meth:`Recorder.book` takes them.
    links : iterable of str
        Link classes the messages used.
    seconds : float
        The record's modeled seconds on the rank (:func:`substrate.calls.seconds_of`)...
    cost : CostModel
    placement : Placement
        ... under this cost model and placement.
    """

    __slots__ = ("_cost", "_placement", "call", "inter", "intra", "links", "messages",
                 "payload", "phase", "seconds")

    def __init__(self, call: Call, payload: int, intra: int, inter: int, messages: int,
                 links, seconds: float, cost, placement) -> None:
        self.call, self.phase = call, call.phase
        self.payload, self.intra, self.inter = int(payload), int(intra), int(inter)
        self.messages = int(messages)
        self.links = frozenset(links)
        self.seconds = float(seconds)
        self._cost, self._placement = cost, placement


class Recorder:
    """Ledger, program and call log of one rank (see the module docstring).

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
        self.log = ChainedLog()
        #: ``--overlap``: calls issued without waiting overlap what follows (False: every call
        #: is recorded as blocking)
        self.overlap = True
        #: the rank's program as it runs (:mod:`substrate.program`; ``None``: not recorded)
        self.program = None
        self._seconds: dict = {}

    def seconds(self, call: Call) -> float:
        """This rank's modeled seconds of ``call`` (:func:`substrate.calls.seconds_of`),
        worked out once per collective record (a communicator reuses its records, so the same
        object comes back step after step) while the cost model and placement stay."""
        if call.algorithm in ("p2p", "alltoallv"):     # a new record every call
            return seconds_of(call, self.cost, self.placement, self.rank)
        hit = self._seconds.get(id(call))
        if hit is not None and hit[0] is call and hit[1] is self.cost \
                and hit[2] is self.placement:
            return hit[3]
        t = seconds_of(call, self.cost, self.placement, self.rank)
        if len(self._seconds) >= MAX_SECONDS:
            self._seconds.clear()
        self._seconds[id(call)] = (call, self.cost, self.placement, t)   # holds the record
        return t

    def book(self, call: Call, *, payload: int, intra: int = 0, inter: int = 0,
             messages: int = 0, links=()) -> None:
        """Book this rank's part of ``call`` in the ledger (bytes it handed to MPI)."""
        self.ledger.add(call.phase, int(payload), int(intra), int(inter), int(messages),
                        float(self.seconds(call)), links)

    def booking(self, call: Call, *, payload: int, intra: int = 0, inter: int = 0,
                messages: int = 0, links=()) -> Booking:
        """:meth:`book`'s entry for ``call``, worked out once, to book with
        :meth:`book_fixed` every time the call runs and sends the same messages."""
        return Booking(call, payload, intra, inter, messages, links,
                       seconds_of(call, self.cost, self.placement, self.rank), self.cost,
                       self.placement)

    def book_fixed(self, b: Booking) -> None:
        """Book ``b`` (:meth:`booking`): the ledger entry :meth:`book` makes of the same
        values."""
        if b._cost is not self.cost or b._placement is not self.placement:
            b.seconds = float(seconds_of(b.call, self.cost, self.placement, self.rank))
            b._cost, b._placement = self.cost, self.placement
        self.ledger.add(b.phase, b.payload, b.intra, b.inter, b.messages, b.seconds, b.links)

    def complete(self, b: Booking, after, result) -> Handle:
        """Book ``b`` (:meth:`book_fixed`), record its call after ``after`` (:meth:`declare`)
        and return its handle (:meth:`handle`): what a blocking call does once it has run, in
        one step."""
        self.book_fixed(b)
        return self.handle(b.call, self.declare(b.call, after), result)

    def declare(self, call: Call, after=None, member: bool = True, wait: bool = True,
                tag: int | None = None) -> int | None:
        """Log ``call`` and record it in the rank's program (``None`` without one): after
        ``after`` (entries or handles), or, when ``after`` is ``None`` or the run does not
        overlap, blocking, after everything before.  ``member=False``: this rank does not take
        part, it waits for the call; ``wait``: whether it was issued blocking.  Returns the
        call's entry (what later entries name as their dependency)."""
        self.log.add(call, member)
        if self.program is None:
            return None
        return self.program.call(call, after if self.overlap else None, member, wait, tag)

    def handle(self, call: Call, entry, result, wait=None) -> Handle:
        """The handle of the call just recorded as ``entry``."""
        return Handle(call, entry, result, wait, self.program)

    def account(self, planned) -> dict:
        """The plan's records of the calls executed since the previous ``account``: check them
        against what ran (:meth:`substrate.calls.CallLog.check`) and return their
        ``{phase: {"intra": bytes, "inter": bytes}}`` (the run's predicted traffic)."""
        planned = list(planned)
        self.log.check(planned, self.rank)
        return bytes_by_phase(planned, self.placement)
