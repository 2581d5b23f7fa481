"""A rank's event program, recorded for replay: what it computed and communicated, in order.

SimGrid's SMPI and SimAI replay an application's communication while its compute is replaced
by the time a profile says it takes; this is spardist's version.  While a run records a compute
profile (``--compute-profile-out``), every rank also records its **program**: a flat list of
entries in program order,

``["B", kind, label, key, deps, stream, after]``
    a compute block begins: ``kind`` ``"clock"`` (:meth:`substrate.clock.SimClock.compute`, the
    profile key ``key``) or ``"layer"`` (a model unit, :meth:`substrate.compute.LayerEvents.
    layer`); ``deps`` and ``after`` are entry indices;
``["E"]``
    the innermost open block ends;
``["C", call, after, member, wait, tag]``
    a communication call (:meth:`substrate.calls.Call.to_dict`); ``after`` is a list of entry
    indices or ``None`` (blocking, after everything before); ``member`` false for a wait on a
    group this rank is not in; ``wait`` false for a call issued to the communication stream;
    ``tag`` of a point-to-point send;
``["W", i]``
    the handle of call entry ``i`` is waited for;
``["R", source, nbytes, tag, group]``
    a receive posted (nothing is booked for receives);
``["A", [i, ...]]``
    a wait for the requests of those send / receive entries;
``["S"]``
    the clock closes a step.

:mod:`runner.replay` runs the programs of every rank again on any MPI world of the same size:
blocks cost their profile time (and sleep it), calls run for real on buffers of the recorded
sizes, so the replay's traffic is the run's, call for call, and its simulated step is the one
``--compute-source profile`` gives the same job.
"""

from __future__ import annotations

__all__ = ["Program"]


class Program:
    """The entries of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.entries: list = []
        self._index: dict[int, int] = {}     # id(timeline event) -> entry index
        self._open: list[int] = []           # entry indices of the open blocks
        #: labels of dependencies on events no entry made (the replay cannot wait for them)
        self.unknown: list[str] = []

    def _idx(self, deps) -> list[int]:
        if deps is None:
            return []
        if not isinstance(deps, (list, tuple)):
            deps = (deps,)
        out = []
        for d in deps:
            ev = getattr(d, "event", d)
            if ev is None:
                continue
            i = self._index.get(id(ev))
            if i is None:          # an event the program did not record (a join made by hand)
                self.unknown.append(getattr(ev, "label", str(ev)))
                continue
            out.append(i)
        return out

    def _add(self, entry) -> int:
        self.entries.append(entry)
        return len(self.entries) - 1

    def bind(self, event, index: int) -> None:
        """``event`` is the timeline event of entry ``index``."""
        if event is not None:
            self._index[id(event)] = index

    # -- recording -------------------------------------------------------------------------------
    def begin(self, kind: str, label: str, key: str | None = None, deps=(),
              stream: str = "compute", after=None, event=None) -> int:
        placed = self._idx(after) if after is not None else []
        i = self._add(["B", kind, label, key, self._idx(deps), stream,
                       placed[0] if placed else None])
        self._open.append(i)
        self.bind(event, i)
        return i

    def end(self, event=None) -> None:
        i = self._open.pop()
        self._add(["E"])
        self.bind(event, i)

    def call(self, call, after, member: bool, wait: bool, event, tag=None) -> int:
        i = self._add(["C", call.to_dict(), None if after is None else self._idx(after),
                       bool(member), bool(wait), tag])
        self.bind(event, i)
        return i

    def waited(self, index: int) -> None:
        self._add(["W", int(index)])

    def receive(self, source: int, nbytes: int, tag: int, group) -> int:
        return self._add(["R", int(source), int(nbytes), int(tag), list(group)])

    def waitall(self, indices) -> None:
        self._add(["A", [int(i) for i in indices]])

    def step(self) -> None:
        self._add(["S"])
