"""The one executor: runs a rank's program (:mod:`substrate.program`) for real.

Training, the replay and the tests run every system through it.  A system supplies only what it
alone knows, as :class:`Bindings`: the array each call works on (:meth:`Bindings.buffer`), the
compute of each block (:meth:`Bindings.compute`: a callable, or a :class:`Pass` that runs a
model's forward and backward), and what it does with a call's result.  The executor does the
rest, entry by entry, exactly as the program says:

* ``B`` (a block of the clock): the block's compute inside :meth:`simulation.clock.SimClock.
  compute`, after its ``deps``, on its ``stream``; a :class:`Pass` runs the model, and from the
  model's ready notifications (the backward of a unit wrote its gradients) the executor walks
  the program past that unit's layer entries and issues what the program lists there (a bucket
  to the communication stream, a fusion buffer's sparsification) before the backward goes on;
* ``C``: the call through its group's :class:`~substrate.comm.Comm` on the bound buffer, after
  the entries ``after`` names, blocking or on the communication stream; a follower's wait for
  the leaders' call (``member`` false) is declared, nothing runs;
* ``W``: the call's handle is waited for and its result handed to :meth:`Bindings.received`;
* ``R`` / ``A``: a receive posted into the bound buffer, a wait for send and receive requests;
* ``S``: the step ends (closed by the caller's run loop, or here with ``close_steps``).

No system restates a phase, a group, an op or a dependency: they are the program's.
"""

from __future__ import annotations

import numpy as np

from .calls import Call
from .program import Builder, Placer, normalize, rebase

__all__ = ["Bindings", "Executor", "Pass", "ZeroBindings"]


class Pass:
    """The compute of a block that runs a model's forward and backward: ``run(ready)`` gets
    the hook the model calls with each gradient's name (:meth:`models.Model.loss_and_grad`'s
    ``ready``); ``units`` are ``(name, tensor names)`` of the model's units in forward order
    (:meth:`models.Model.compute_units`): a unit's backward is done when all its tensors are."""

    def __init__(self, run, units) -> None:
        self.run = run
        self.units = [(str(n), tuple(t)) for n, t in units]


class Bindings:
    """What a system binds to a program (override what its programs use)."""

    def buffer(self, call: Call):
        """The array ``call`` works on, on this rank (reduced or broadcast in place; the block
        an all-gather sends; the message a send carries)."""
        raise ValueError(f"nothing is bound to call {call.phase!r} ({call.label or ''})")

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        """The array a receive from world rank ``source`` lands in."""
        raise ValueError(f"nothing is bound to a receive from rank {source} (tag {tag})")

    def compute(self, label: str):
        """The compute of block ``label``: a callable, a :class:`Pass`, or ``None`` (nothing
        beyond what the block's nested entries do)."""
        raise ValueError(f"nothing is bound to compute block {label!r}")

    def received(self, call: Call, result) -> None:
        """``call`` completed with ``result`` (a gathered array, a reduced buffer)."""

    def flops(self, label: str) -> float | None:
        """FLOPs of block ``label`` (for the ``flops`` compute source; ``None``: unknown)."""
        return None

    def on_ready(self, name: str) -> None:
        """The backward wrote tensor ``name``'s gradient (before the program goes on)."""

    def block_begin(self, label: str, key: str, kind: str) -> None:
        """Block ``label`` (profile key ``key``, ``kind`` ``"clock"`` or ``"layer"``) begins,
        inside its timing (a replay sleeps a layer's profile time here)."""

    def block_end(self, label: str, key: str, kind: str) -> None:
        """Block ``label`` ends, still inside its timing (a replay sleeps a clock block's own
        rest here)."""


def _dtype(itemsize: int, op: str | None):
    """A buffer type of ``itemsize`` bytes for which the op is defined."""
    if op == "bor" or itemsize == 1:
        return np.dtype(f"u{itemsize}")
    return np.dtype(f"f{itemsize}")


class ZeroBindings(Bindings):
    """Zeros of every call's sizes and no compute (the replay; a system that is only a plan):
    the calls, their bytes and their order are the program's, the data is not."""

    def __init__(self, compute=None) -> None:
        self._compute = compute

    def buffer(self, call: Call):
        dt = _dtype(call.itemsize, call.op)
        if call.algorithm == "allgather":
            return None                    # the executor cuts the member's block
        if call.algorithm == "p2p":
            return np.zeros(int(call.pairs[0, 2]), dtype=np.uint8)
        return np.zeros(call.nbytes // dt.itemsize, dtype=dt)

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        return np.zeros(nbytes, dtype=np.uint8)

    def compute(self, label: str):
        return self._compute


def _ends(entries) -> dict:
    """``{B index: matching E index}``."""
    out, stack = {}, []
    for i, e in enumerate(entries):
        if e[0] == "B":
            stack.append(i)
        elif e[0] == "E":
            out[stack.pop()] = i
    if stack:
        raise ValueError(f"program: block {stack[-1]} never ends")
    return out


class Executor:
    """Runs programs on this rank's communicators and clock (see the module docstring).

    Parameters
    ----------
    run : runner.run.Run
        Clock, recorder and topology of the run.
    comms : dict, optional
        ``{group: Comm}`` for groups beyond the topology's world, node and leaders
        communicators (:func:`runner.replay.communicators`).
    close_steps : bool
        Close the clock's step at an ``S`` entry (the replay); a trainer's run loop closes it
        itself (default).
    """

    def __init__(self, run, comms: dict | None = None, close_steps: bool = False) -> None:
        self.clock, self.rec, topo = run.clock, run.recorder, run.topo
        self.rank = run.rank
        # the world's communicator wins a group it shares (one rank per node: the leaders')
        self.comms = {c.group: c for c in (topo.inter, topo.intra, topo.world) if c is not None}
        self.comms.update(comms or {})
        self.close_steps = close_steps
        self._ends_cache: dict = {}
        #: steps run while the run records its program: (first recorded entry, the step's
        #: generated entries), held equal by :meth:`verify`
        self._ran: list = []
        self.steps_verified = 0
        #: hold every step run equal to its recording (a run that keeps its whole program:
        #: ``--compute-profile-out``)
        self.verifying = bool(getattr(run, "verify_programs", False))

    def verify(self) -> None:
        """Hold what the run recorded of every step run so far (:class:`substrate.program.
        Program`, from the clock's and the communicators' own hooks) equal to the generated
        program the step executed: the same blocks, calls, dependencies, issue modes and
        streams, entry for entry.  Only while the run records its program
        (``--compute-profile-out``); raises ``ValueError`` naming the first difference."""
        prog = self.rec.program
        if prog is None or not self.verifying:
            return
        done = []
        for start, gen in self._ran:
            end = start + len(gen)
            if len(prog) < end:
                break                       # the step is not closed yet
            have = rebase(normalize(prog.since(start, end)), start)
            want = gen
            if have != want:
                k = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b),
                         min(len(have), len(want)))
                raise ValueError(
                    f"rank {self.rank}: the recorded program of step {self.steps_verified} "
                    f"differs from the generated one at entry {k}: recorded "
                    f"{have[k] if k < len(have) else 'nothing'}, generated "
                    f"{want[k] if k < len(want) else 'nothing'}")
            self.steps_verified += 1
            done.append((start, gen))
        self._ran = self._ran[len(done):]

    # -- a step ----------------------------------------------------------------------------------
    def run_records(self, records, bind: Bindings, placement, *, overlap: bool = False) -> list:
        """Run a plan's records outside a step (a set-up, an evaluation): their program on this
        rank (:class:`substrate.program.Placer`, calls blocking unless ``overlap``), executed
        at once.  Returns the program's entries."""
        b = Builder()
        place = Placer(b, records, placement, self.rank, overlap=overlap)
        place.emit_rest()
        place.wait_all()
        self.run_step(b.entries, bind)
        return b.entries

    def run_step(self, entries, bind: Bindings, start: int = 0) -> int:
        """Execute ``entries`` from ``start`` through the next ``S`` (or the end); returns the
        index after it."""
        key = id(entries)
        ends = self._ends_cache.get(key)
        if ends is None or ends[0] is not entries:
            ends = self._ends_cache[key] = (entries, _ends(entries))
        self.entries, self.ends, self.bind = entries, ends[1], bind
        prog = self.rec.program
        if prog is not None and self.verifying:
            self.verify()
            stop = next((i + 1 for i in range(start, len(entries)) if entries[i][0] == "S"),
                        len(entries))
            self._ran.append((len(prog), rebase(normalize(entries[start:stop]), start)))
        self.events: dict = {}
        self.handles: dict = {}
        self._pass = None
        self.pos = start
        stop = len(entries)
        while self.pos < stop:
            if entries[self.pos][0] == "S":
                self.pos += 1
                if self.close_steps:
                    self.clock.step()
                break
            self._one()
        return self.pos

    def _one(self) -> None:
        """Execute the entry at :attr:`pos` (a block with everything in it) and move on."""
        i = self.pos
        e = self.entries[i]
        t = e[0]
        if t == "B":
            if e[1] == "layer":
                self._layer(i)
            else:
                self._block(i)
        elif t == "C":
            self._call(i, e)
        elif t == "W":
            self._wait(e[1])
            self.pos += 1
        elif t == "R":
            source, nbytes, tag, group = e[1:]
            comm = self.comms[tuple(group)]
            self.handles[i] = comm.irecv(self.bind.receive_buffer(source, nbytes, tag),
                                         comm.group.index(source), tag=tag, phase="receive")
            self.pos += 1
        elif t == "A":
            self.comms[self._world_group()].waitall([self.handles[j] for j in e[1]])
            self.pos += 1
        else:
            raise ValueError(f"program entry {i}: unexpected {e!r}")

    def _world_group(self):
        return max(self.comms, key=len)

    def _ev(self, i):
        return None if i is None else self.events.get(i)

    # -- blocks ----------------------------------------------------------------------------------
    def _block(self, i: int) -> None:
        _, _, label, key, deps, stream, after = self.entries[i]
        j = self.ends[i]
        fn = self.bind.compute(label)
        if stream == "offload":
            # a worker beside this thread runs it: ``fn`` hands it over and returns its pending
            # time (:meth:`simulation.clock.SimClock.offload`); nothing is nested in it
            if j != i + 1:
                raise ValueError(f"program entry {i}: an offload block ({label!r}) holds "
                                 "entries")
            self.events[i] = self.clock.offload(
                label, fn, flops=self.bind.flops(label), deps=[self._ev(d) for d in deps],
                after=self._ev(after), key=key)
            self.pos = j + 1
            return
        with self.clock.compute(label, deps=[self._ev(d) for d in deps], stream=stream,
                                after=self._ev(after), key=key, flops=self.bind.flops(label)):
            self.pos = i + 1
            self.bind.block_begin(label, key, "clock")
            if isinstance(fn, Pass):
                self._run_pass(fn, j)
            else:
                if fn is not None:
                    fn()
                self._run_to(j)
            self.bind.block_end(label, key, "clock")
        self.events[i] = self.clock.last_event
        self.pos = j + 1

    def _run_to(self, stop: int) -> None:
        while self.pos < stop:
            self._one()

    def _layer(self, i: int) -> None:
        """A model unit the executor runs itself (a replay: the unit's profile time)."""
        label = self.entries[i][2]
        phase, _, name = label.partition(":")
        fn = self.bind.compute(label)
        with self.clock.layers.layer(phase, name):
            self.events[i] = self.clock.layers.open
            self.bind.block_begin(label, self.entries[i][3], "layer")
            if fn is not None:
                fn()
            self.bind.block_end(label, self.entries[i][3], "layer")
        self.events[i] = self.clock.layers.last
        self.pos = self.ends[i] + 1

    # -- a model's pass --------------------------------------------------------------------------
    def _run_pass(self, p: Pass, end: int) -> None:
        """Run the model; its ready hook walks the program (:meth:`_ready`); what is left in
        the block after its last unit runs when the model returns."""
        unit_of = {t: n for n, ts in p.units for t in ts}
        left = {n: len(ts) for n, ts in p.units}
        self._pass = (unit_of, left, end)
        try:
            p.run(self._ready)
        finally:
            self._pass = None
        while self.pos < end:
            e = self.entries[self.pos]
            if e[0] == "B" and e[1] == "layer":
                self.pos = self.ends[self.pos] + 1        # the model ran it
            else:
                self._one()

    def _ready(self, name: str) -> None:
        """The model wrote ``name``'s gradient: when that completes a unit's backward, skip the
        program to after that unit's layer entry and issue what the program lists there, up to
        the next unit."""
        self.bind.on_ready(name)
        unit_of, left, end = self._pass
        u = unit_of.get(name)
        if u is None:
            return
        left[u] -= 1
        if left[u]:
            return
        target = f"backward:{u}"
        layers = self.clock.layers
        while True:
            if self.pos >= end:
                raise ValueError(f"program: the model's backward of {u!r} has no layer entry "
                                 "in the pass block (generated for another model?)")
            e = self.entries[self.pos]
            if e[0] != "B" or e[1] != "layer":
                raise ValueError(f"program: entry {self.pos} ({e[0]} {e[2] if e[0] == 'B' else ''})"
                                 f" comes before the model's backward of {u!r}")
            j = self.ends[self.pos]
            if e[2] == target:
                self.events[self.pos] = layers.last if layers is not None else None
                self.pos = j + 1
                break
            self.pos = j + 1
        while self.pos < end:
            e = self.entries[self.pos]
            if e[0] == "B" and e[1] == "layer":
                return
            self._one()

    # -- calls -----------------------------------------------------------------------------------
    def _call(self, i: int, e) -> None:
        _, call, after, member, wait, tag = e
        if isinstance(call, dict):
            call = Call.from_dict(call)
        deps = None if after is None else [self._ev(a) for a in after]
        if not member:
            self.events[i] = self.rec.declare(call, deps, member=False)
            self.pos += 1
            return
        h = self._issue(call, deps, wait, tag)
        self.handles[i] = h
        self.events[i] = getattr(h, "event", None)
        if wait and h is not None and call.algorithm != "p2p":
            self.bind.received(call, h.result)
        self.pos += 1

    def _wait(self, i: int) -> None:
        h = self.handles[i]
        e = self.entries[i]
        result = h.wait()
        call = e[1] if isinstance(e[1], Call) else None
        if call is not None:
            self.bind.received(call, result)

    def _issue(self, call: Call, after, wait: bool, tag):
        """Run ``call`` on the bound buffer through its group's communicator."""
        comm = self.comms[call.group]
        a = call.algorithm
        buf = self.bind.buffer(call)
        if a == "p2p":
            me = comm.group[comm.rank]
            rows = call.pairs.tolist()
            if len(rows) != 1 or rows[0][0] != me:
                raise ValueError(f"call {call.phase!r}: a program sends one message per entry "
                                 f"(got {len(rows)} rows)")
            return comm.isend(buf, comm.group.index(rows[0][1]), tag=tag or 0,
                              phase=call.phase, after=after)
        if a == "allreduce":
            return comm.allreduce(buf, call.op or "sum", phase=call.phase, after=after,
                                  wait=wait)
        if a == "bcast":
            return comm.bcast(buf, call.root, phase=call.phase, after=after, wait=wait)
        if a == "allgather":
            if buf is None:                                    # zeros of the member's block
                dt = _dtype(call.itemsize, call.op)
                buf = np.zeros(call.blocks[comm.rank] // dt.itemsize, dtype=dt)
            counts = [b // buf.itemsize for b in call.blocks]
            if len(set(counts)) == 1:
                return comm.allgather(buf, phase=call.phase, after=after, wait=wait)
            return comm.allgatherv(buf.reshape(-1), counts, phase=call.phase, after=after)
        if a == "barrier":
            return comm.barrier(phase=call.phase, after=after)
        if a == "alltoallv":              # a plan's record: the whole byte matrix
            m = np.asarray(call.blocks, dtype=np.int64).reshape(call.size, call.size)
            i = comm.rank
            return comm.alltoallv(buf, m[i] // buf.itemsize, m[:, i] // buf.itemsize,
                                  phase=call.phase, after=after)
        raise ValueError(f"call {call.phase!r}: a {a} call cannot run from a program (a "
                         "member's record holds its own sends only)")
