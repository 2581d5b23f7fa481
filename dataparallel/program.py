"""One data-parallel optimizer step as a rank's program (:mod:`substrate.program`).

The trainer's step is the same for every strategy: the model's forward and backward (one block
of the units' layer entries, :meth:`models.Model.compute_units`), the strategy plan's records
of the step (its calls and compute items, :meth:`Strategy.records`) each where its
dependencies put it, then the optimizer after every call, then the records that wait for the
update (:data:`UPDATED`: B_b-SDP's parameter broadcast, PacTrain's GraSP scores at the end of
its warm-up, SDP's assembly of the model before an evaluation).  With ``overlap``
(``--overlap on``) a record goes out at the first unit boundary of the backward where what it
waits for is there (a gradient bucket as soon as the backward wrote it:
:class:`~substrate.calls.Ready`), in the plan's order; without, every record follows the
backward, blocking.  The same function gives the program the run executes
(:class:`substrate.executor.Executor`) and the one ``commvol`` simulates at any scale from a
shape-only model.
"""

from __future__ import annotations

import bisect
import itertools

from substrate.calls import Ready
from substrate.executor import Bindings, Executor, Pass
from substrate.program import Builder, Placer

__all__ = ["FORWARD_BACKWARD", "OPTIMIZER", "UPDATED", "StepBindings", "step_program",
           "sync_step", "unit_tensors"]

#: labels of the trainer's own blocks
FORWARD_BACKWARD = "forward+backward"
OPTIMIZER = "optimizer"
#: a record's ``after`` token: the optimizer's update of the step (the record works on the
#: updated parameters; it and every record after it in the plan's order follow the update)
UPDATED = "updated"


def step_program(units, records, placement, rank: int, *, overlap: bool = True,
                 leader_waits: bool = True) -> list:
    """The entries of one optimizer step of world rank ``rank``.

    Parameters
    ----------
    units : sequence
        The model's compute units in forward order, each with ``name``, ``lo``, ``hi`` (its
        slice of the flat gradient).
    records : sequence
        The strategy plan's records of the step (:class:`~substrate.calls.Call`,
        :class:`~substrate.calls.Work`), ``after`` naming earlier records,
        :class:`~substrate.calls.Ready` ranges and :data:`UPDATED`.
    placement : substrate.calls.Placement
    rank : int
    overlap : bool
        ``--overlap``: calls the plan issues without waiting go out during the backward.
    leader_waits : bool
        A follower waits for the calls on the node leaders' group (a hierarchical scheme's
        leaders' phase; :attr:`Strategy.leader_waits`), see :class:`~substrate.program.Placer`.
    """
    b = Builder()
    done: dict[str, int] = {}             # unit -> entry of its backward
    updated: list[int] = []               # the optimizer's entry, once there
    # the units' disjoint slices of the flat gradient, by offset: a range's units by bisection
    spans = sorted((int(u.lo), int(u.hi), u.name) for u in units if int(u.hi) > int(u.lo))
    ends = [hi for _, hi, _ in spans]

    def resolve(token):
        if isinstance(token, str) and token == UPDATED:
            return updated[0] if updated else None
        if not isinstance(token, Ready):
            raise ValueError(f"a data-parallel record waits for {token!r}: only records, "
                             "Ready(lo, hi) ranges of the gradient and UPDATED")
        over, covered = [], 0
        for lo, hi, n in itertools.islice(spans, bisect.bisect_right(ends, token.lo), None):
            if lo >= token.hi:
                break
            over.append(n)
            covered += min(hi, token.hi) - max(lo, token.lo)
        if covered < token.hi - token.lo:
            raise ValueError(f"Ready({token.lo}, {token.hi}) is not covered by the model's "
                             "units: the plan was built for another model")
        if any(n not in done for n in over):
            return None
        return max(done[n] for n in over)

    place = Placer(b, records, placement, rank, overlap=overlap, resolve=resolve,
                   leader_waits=leader_waits)
    b.begin(FORWARD_BACKWARD)
    for u in units:
        b.layer("forward", u.name)
    b.layer("forward", "loss")
    for u in reversed(units):
        done[u.name] = b.layer("backward", u.name)
        if overlap:
            place.emit_ready()
    b.end()
    place.emit_ready(during_pass=False)   # every record up to the first after the update
    place.wait_all()
    updated.append(b.block(OPTIMIZER, deps=place.calls()))
    place.emit_rest()                     # the records after the update
    place.wait_all()
    b.step()
    return b.entries


class StepBindings(Bindings):
    """A step's bindings: the trainer's blocks (the model's pass, the optimizer and its FLOPs)
    and everything else the strategy's (its buffers, codecs and compute items)."""

    def __init__(self, strategy, model_pass: Pass, optimizer=None, optimizer_flops=None) -> None:
        self.strategy = strategy
        self.model_pass = model_pass
        self.optimizer = optimizer
        self.optimizer_flops = optimizer_flops

    def compute(self, label: str):
        if label == FORWARD_BACKWARD:
            return self.model_pass
        if label == OPTIMIZER:
            return self.optimizer
        return self.strategy.compute(label)

    def flops(self, label: str):
        if label == OPTIMIZER:
            return self.optimizer_flops
        return self.strategy.flops(label)

    def buffer(self, call):
        return self.strategy.buffer(call)

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        return self.strategy.receive_buffer(source, nbytes, tag)

    def received(self, call, result) -> None:
        self.strategy.received(call, result)

    def on_ready(self, name: str) -> None:
        self.strategy.on_ready(name)


def unit_tensors(model) -> list:
    """``(unit name, its tensors' names)`` of the model's units (what a :class:`Pass`
    counts)."""
    layout = model.layout
    return [(u.name, tuple(n for n in layout.names if u.lo <= layout.offsets[n] < u.hi))
            for u in model.compute_units()]


def sync_step(strategy, state, executor: Executor | None = None, optimizer=None) -> list:
    """One step of ``strategy``'s program on the gradients already in its model's buffers (a
    check, a benchmark): its records where the step's program puts them, around a pass that
    only reports every gradient ready, on ``executor`` (default: the strategy's,
    :attr:`Strategy.executor`); ``optimizer``: the update the step's optimizer block runs
    (default: none; records after :data:`UPDATED` then follow an empty block).  Returns the
    step's records."""
    run, model = strategy.run, strategy.ctx.model
    records = strategy.records(state)
    program = step_program(model.compute_units(), records, run.topo.placement, run.rank,
                           overlap=run.recorder.overlap, leader_waits=strategy.leader_waits)

    def notify(ready) -> None:
        for name in model.layout.names:
            ready(name)

    bind = StepBindings(strategy, Pass(notify, unit_tensors(model)), optimizer)
    (executor or strategy.executor).run_step(program, bind)
    return records
