"""A rank's program: what it computes and communicates in one step, in order.

The one description of a step that every consumer shares (SimAI's workload, SimGrid SMPI's
program): each system's plan **generates** every rank's program for any world and placement
without MPI (:class:`Builder`); the training run **executes** it (:class:`substrate.executor.
Executor`: the system binds only its buffers, its compute and its codecs); a run that records a
compute profile also **records** what really ran, in the same form (:class:`Program`, held
equal to the generated one in the tests); the replay executes a recorded or generated program on
zeros with compute slept; the job simulation (:mod:`simulation.jobsim`) simulates it.  Entries,
in program order:

``["B", kind, label, key, deps, stream, after]``
    a compute block begins: ``kind`` ``"clock"`` (:meth:`simulation.clock.SimClock.compute`, the
    profile key ``key``) or ``"layer"`` (a model unit, :meth:`simulation.compute.LayerEvents.
    layer`); ``deps`` (entry indices) what it waits for, ``stream`` ``"compute"`` or
    ``"offload"``, ``after`` the entry it is placed right after in its stream (or ``None``);
``["E"]``
    the innermost open block ends;
``["C", call, after, member, wait, tag]``
    a communication call (a :class:`substrate.calls.Call`; its ``to_dict()`` in a recorded
    file); ``after`` a list of entry indices or ``None`` (blocking, after everything before);
    ``member`` false for a wait on a group this rank is not in (the leaders' call seen by a
    follower); ``wait`` false for a call issued to the communication stream; ``tag`` of a
    point-to-point send;
``["W", i]``
    the handle of call entry ``i`` is waited for;
``["R", source, nbytes, tag, group]``
    a receive posted (nothing is booked for receives);
``["A", [i, ...]]``
    a wait for the requests of those send / receive entries;
``["S"]``
    the step ends.
"""

from __future__ import annotations

import numpy as np

from .calls import Call

__all__ = ["Builder", "Placer", "Program", "normalize", "rebase", "steps"]


class _Entries:
    """What a recorded and a generated program write alike."""

    def __init__(self) -> None:
        self.entries: list = []

    def _add(self, entry) -> int:
        self.entries.append(entry)
        return len(self.entries) - 1

    def wait(self, index: int) -> None:
        """The handle of call entry ``index`` is waited for."""
        self._add(["W", int(index)])

    def receive(self, source: int, nbytes: int, tag: int, group) -> int:
        return self._add(["R", int(source), int(nbytes), int(tag), list(group)])

    def waitall(self, indices) -> None:
        self._add(["A", [int(i) for i in indices]])


class Program(_Entries):
    """The entries of one rank as it runs, recorded from the clock's and the communicators'
    hooks (see the module docstring).

    An entry's index is its event: a compute block, a call or a layer is named, in a later
    entry's dependencies, by the index :meth:`begin` / :meth:`call` returned.  Indices count
    over the whole run; :meth:`drop` forgets the entries before a step already simulated
    (:attr:`base` is the index of the first one kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = 0
        self._open: list[int] = []           # entry indices of the open blocks

    def __len__(self) -> int:
        """Entries recorded so far (the index the next one gets)."""
        return self.base + len(self.entries)

    def _add(self, entry) -> int:
        self.entries.append(entry)
        return self.base + len(self.entries) - 1

    def since(self, start: int, stop: int | None = None) -> list:
        """The entries ``start`` (an index over the run) up to ``stop``."""
        stop = len(self) if stop is None else stop
        return self.entries[start - self.base:stop - self.base]

    def drop(self, upto: int) -> None:
        """Forget the entries before index ``upto`` (no open block may start before it)."""
        if self._open and self._open[0] < upto:
            raise ValueError(f"program: block {self._open[0]} is still open")
        del self.entries[:upto - self.base]
        self.base = upto

    @staticmethod
    def _idx(deps) -> list[int]:
        """Entry indices of ``deps`` (indices, handles holding one as their ``event``, or
        ``None``s; one or a sequence)."""
        if deps is None:
            return []
        if not isinstance(deps, (list, tuple)):
            deps = (deps,)
        out = []
        for d in deps:
            ev = getattr(d, "event", d)
            if ev is not None:
                out.append(int(ev))
        return out

    # -- recording -------------------------------------------------------------------------------
    def begin(self, kind: str, label: str, key: str | None = None, deps=(),
              stream: str = "compute", after=None) -> int:
        placed = self._idx(after) if after is not None else []
        i = self._add(["B", kind, label, key, self._idx(deps), stream,
                       placed[0] if placed else None])
        self._open.append(i)
        return i

    def end(self) -> int:
        """The innermost open block ends; returns its index."""
        i = self._open.pop()
        self._add(["E"])
        return i

    def call(self, call, after, member: bool, wait: bool, tag=None) -> int:
        """A call (its record, written as :meth:`~substrate.calls.Call.to_dict` by
        :func:`normalize`)."""
        return self._add(["C", call, None if after is None else self._idx(after),
                          bool(member), bool(wait), tag])

    def step(self) -> int:
        """The step ends; returns the index after it."""
        self._add(["S"])
        return len(self)


def normalize(entries) -> list:
    """A program in its file form (calls as :meth:`~substrate.calls.Call.to_dict`, lists for
    tuples): what a recorded and a generated program are compared in."""
    out = []
    for e in entries:
        if e[0] == "C":
            c = e[1]
            out.append(["C", c if isinstance(c, dict) else c.to_dict(),
                        None if e[2] is None else list(e[2]), bool(e[3]), bool(e[4]), e[5]])
        elif e[0] == "B":
            out.append(["B", e[1], e[2], e[3], list(e[4]), e[5], e[6]])
        elif e[0] == "A":
            out.append(["A", list(e[1])])
        elif e[0] == "R":
            out.append(["R", int(e[1]), int(e[2]), int(e[3]), list(e[4])])
        else:
            out.append(list(e))
    return out


class Builder(_Entries):
    """Writes one rank's program (the generated side of :class:`Program`): the same entries a
    run records, built from a plan."""

    def __init__(self) -> None:
        super().__init__()
        self._open: list[int] = []

    def begin(self, label: str, *, kind: str = "clock", key: str | None = None, deps=(),
              stream: str = "compute", after: int | None = None) -> int:
        """A block begins (its key defaults to its label); returns its entry index."""
        i = self._add(["B", kind, label, label if key is None else key,
                       [int(d) for d in deps], stream, after])
        self._open.append(i)
        return i

    def end(self) -> None:
        self._open.pop()
        self._add(["E"])

    def block(self, label: str, **kw) -> int:
        """A block without anything inside (a compute callback, a codec step)."""
        i = self.begin(label, **kw)
        self.end()
        return i

    def layer(self, phase: str, name: str) -> int:
        """A model unit's forward or backward (:meth:`simulation.compute.LayerEvents.layer`)."""
        label = f"{phase}:{name}"
        return self.block(label, kind="layer")

    def call(self, call, after=None, *, member: bool = True, wait: bool = True,
             tag: int | None = None) -> int:
        return self._add(["C", call, None if after is None else [int(a) for a in after],
                          bool(member), bool(wait), tag])

    def step(self) -> None:
        if self._open:
            raise ValueError(f"a step ends with {len(self._open)} blocks open")
        self._add(["S"])


class Placer:
    """Lays a plan's records (:class:`~substrate.calls.Call` and :class:`~substrate.calls.Work`
    items, with their ``after`` tokens) into one rank's program, in the plan's order.

    A rank's program holds the calls it takes part in, and the node leaders' calls as waits
    (``member`` false: a follower sees the leaders' communicator and waits for what it runs;
    ``leader_waits`` false: a group that happens to be the leaders' is not a phase of a
    hierarchical scheme, e.g. one of SDP's holder sets, and a rank outside it does not wait);
    other nodes' calls are not in it, and a dependency on them is dropped.  A call goes out on
    the communication stream, after what it names, when the record says so (:attr:`Call.wait`
    false) and the run overlaps (``overlap``); else it blocks, after everything before it (its
    entry names nothing).  A compute item is a block (its ``stream``) after its dependencies,
    and a call on the stream it depends on is waited for first.  A token other
    than a record index is the caller's: ``resolve(token)`` gives the entry it stands for, or
    ``None`` while it is not there yet (:meth:`emit_ready` stops at such a record).
    """

    def __init__(self, builder: Builder, records, placement, rank: int, *, overlap: bool,
                 resolve=None, leader_waits: bool = True) -> None:
        self.b = builder
        self.records = list(records)
        self.rank = int(rank)
        self.overlap = bool(overlap)
        self.resolve = resolve
        self.entry: dict[int, int] = {}          # record index -> entry index
        self._sends: dict[int, list] = {}        # exchange record -> its send entries
        self.pending: list[int] = []             # entries of calls on the stream, not waited
        self.next = 0
        self.placement = placement
        leaders = placement.leaders if leader_waits else None
        self._mine = []
        for r in self.records:
            if not isinstance(r, Call):
                self._mine.append("work")
            elif r.algorithm == "p2p":
                pr = r.pairs
                self._mine.append("exchange" if np.any((pr[:, 0] == self.rank)
                                                       | (pr[:, 1] == self.rank)) else None)
            elif r.involves(self.rank):
                self._mine.append("member")
            elif r.group == leaders and r.algorithm not in ("p2p", "alltoallv"):
                self._mine.append("wait")
            else:
                self._mine.append(None)

    @property
    def done(self) -> bool:
        return self.next >= len(self.records)

    def _deps(self, r) -> list[int] | None:
        """Entry indices of ``r``'s dependencies, or ``None`` when one is not there yet."""
        out = []
        for t in r.after:
            if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
                if int(t) in self._sends:      # an exchange: waited for in program order
                    out += [e for e in self._sends[int(t)] if e not in out]
                    continue
                e = self.entry.get(int(t))     # None: another node's call, not waited for here
            else:
                if self.resolve is None:
                    raise ValueError(f"record {getattr(r, 'phase', r)!r} waits for {t!r}: the "
                                     "program needs resolve=")
                e = self.resolve(t)
                if e is None:
                    return None
            if e is not None and e not in out:
                out.append(e)
        return out

    def _stream_deps(self, r) -> list[int]:
        """The call entries on the stream that ``r`` depends on, not waited for yet."""
        deps = [self.entry[int(t)] for t in r.after if isinstance(t, (int, np.integer))
                and not isinstance(t, bool) and int(t) in self.entry]
        return [e for e in deps if e in self.pending]

    @staticmethod
    def _names_token(r) -> bool:
        """Whether ``r`` waits for a token of the caller's (e.g. a part of the gradient), not
        only for records."""
        return any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in r.after)

    def emit_ready(self, during_pass: bool = True) -> None:
        """Emit records in order while their dependencies are there.  A compute item that waits
        for a call on the stream needs a wait: it is left for after the pass, unless it also
        waits for a token of the caller's (a part of the gradient), where the host waits for
        the call once that token is there (a codec that needs a call's result when the next
        bucket is ready)."""
        while not self.done:
            k = self.next
            r, kind = self.records[k], self._mine[k]
            if kind is None:
                self.next += 1
                continue
            deps = self._deps(r)
            if deps is None or (during_pass and kind == "work" and self._stream_deps(r)
                                and not self._names_token(r)):
                return
            self._emit(k, r, kind, deps)

    def emit_rest(self) -> None:
        """Emit every remaining record (after the pass: every token resolves)."""
        while not self.done:
            before = self.next
            self.emit_ready(during_pass=False)
            if self.next == before and not self.done:
                r = self.records[self.next]
                raise ValueError(f"record {self.next} ({getattr(r, 'phase', None) or r.label}) "
                                 f"waits for {r.after!r}, which this rank's program never has")

    def _emit(self, k: int, r, kind: str, deps: list[int]) -> None:
        b = self.b
        if kind == "work":
            for e in self._stream_deps(r):
                b.wait(e)
                self.pending.remove(e)
            self.entry[k] = b.block(r.label, deps=deps, stream=getattr(r, "stream", "compute"))
        elif kind == "wait":
            self.entry[k] = b.call(r, deps if self.overlap else None, member=False)
        elif kind == "exchange":
            self.entry[k] = self._exchange(k, r, deps)
        elif self.overlap and not r.wait:          # on the stream, after what it names
            self.entry[k] = b.call(r, deps, wait=False)
            self.pending.append(self.entry[k])
        else:                                      # blocking: after everything before
            self.entry[k] = b.call(r, None)
        self.next = k + 1

    def _exchange(self, k: int, r, deps: list[int]) -> int:
        """This rank's part of a direct-message exchange (a ``p2p`` record of every sender's
        messages): a receive posted for every message it gets, a send for every message it
        sends (one record each), then a wait for all of them.  Returns the
        wait's entry (what later records depend on)."""
        me, b = self.rank, self.b
        rows = r.pairs.tolist()
        posted = [b.receive(src, nb, 0, r.group) for src, dst, nb in rows if dst == me != src]
        posted += [b.call(Call(r.phase, "p2p", r.group, pairs=((me, dst, nb),),
                               label=r.label), deps if self.overlap else None, wait=False,
                          tag=0)
                   for src, dst, nb in rows if src == me != dst]
        b.waitall(posted)
        self._sends[k] = [e for e in posted if b.entries[e][0] == "C"]
        return len(b.entries) - 1

    def wait_all(self) -> None:
        """Wait for every call still on the stream, in issue order."""
        for e in self.pending:
            self.b.wait(e)
        self.pending = []

    def calls(self) -> list[int]:
        """Entry indices of every call emitted (member or wait; an exchange's sends), in
        order."""
        out = []
        for k, e in sorted(self.entry.items()):
            if self._mine[k] in ("member", "wait"):
                out.append(e)
            out += self._sends.get(k, [])
        return out


def steps(entries) -> list[list]:
    """A program cut at its ``S`` entries, each step's entry indices counted from the step's
    first entry (a recorded program numbers its entries over the whole run)."""
    out, start = [], 0
    for i, e in enumerate(entries):
        if e[0] == "S":
            out.append(rebase(entries[start:i + 1], start))
            start = i + 1
    if start < len(entries):
        out.append(rebase(entries[start:], start))
    return out


def rebase(entries, base: int) -> list:
    """``entries`` whose indices count from ``base``, with indices counted from 0."""
    def shift(i):
        return None if i is None else int(i) - base

    out = []
    for e in entries:
        t = e[0]
        if t == "B":
            out.append([*e[:4], [shift(d) for d in e[4]], e[5], shift(e[6])])
        elif t == "C":
            out.append([e[0], e[1], None if e[2] is None else [shift(a) for a in e[2]],
                        *e[3:]])
        elif t == "W":
            out.append(["W", shift(e[1])])
        elif t == "A":
            out.append(["A", [shift(a) for a in e[1]]])
        else:
            out.append(list(e))
    return out
