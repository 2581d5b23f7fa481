"""The gradient-sync strategy interface and registry.

Every data-parallel method is a :class:`Strategy`: built once from a :class:`SyncContext` and
its own frozen options dataclass (plan once: buckets, masks, index sets, sub-communicators).
Each step the trainer asks it for its plan's records of the step (:meth:`Strategy.records`:
calls and compute items with their dependencies), lays them into the step's program with the
model's forward and backward and the optimizer (:func:`dataparallel.program.step_program`) and
runs that program (:class:`substrate.executor.Executor`).  The strategy is the program's
:class:`~substrate.executor.Bindings`: the array each call works on (its encoding, e.g. a
packed row or fp16 values), the compute of each of its items, and what it does with a result
(its decoding).  It never issues a call itself.  The trainer has no per-method branches: it
looks the class up in :data:`STRATEGIES` by the ``--method`` name.

Adding a method::

    @register
    class MyStrategy(Strategy):
        name = "mine"
        Options = MyOptions          # frozen dataclass; fields become CLI flags
        def records(self, state): ...          # the plan's records of the coming step
        def buffer(self, call): ...            # what each call sends (encode)
        def received(self, call, result): ...  # what a result becomes (decode)
        def compute(self, label): ...          # the plan's compute items
        def state_dict(self): ...    # state carried from step to step, for checkpoints
        def load_state_dict(self, state): ...
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from substrate.executor import Bindings, Executor
from substrate.options import add_dataclass_args, flag_of, from_args

__all__ = [
    "STRATEGIES",
    "NoOptions",
    "StepState",
    "Strategy",
    "SyncContext",
    "add_options_args",
    "add_strategy_args",
    "check_unused_options",
    "options_from_args",
    "register",
]


@dataclass
class SyncContext:
    """What a strategy may use when it plans (built once by the trainer).

    Attributes
    ----------
    run : runner.run.Run
        Topology (``run.topo``: world / intra / inter communicators), ledger, clock, backend.
    model : models.Model
        The rank's model (``model.layout`` is the flat layout in backward order).
    opt : models.SGD
        The optimizer (strategies may add gradient hooks, e.g. masks).
    train : models.Dataset
        This rank's shard (for warm-up, pruning scores or profiling).
    config : object
        The trainer's frozen configuration (batch size, lr, seed, ...).
    """

    run: Any
    model: Any
    opt: Any
    train: Any
    config: Any

    @property
    def topo(self):
        return self.run.topo

    @property
    def xp(self):
        return self.run.xp

    @property
    def layout(self):
        return self.model.layout

    @property
    def seed(self) -> int:
        return int(self.config.seed)


@dataclass
class StepState:
    """Per-step state handed to :meth:`Strategy.records` (or :meth:`Strategy.sync`).

    ``logged``: the step writes a metrics line (:class:`runner.loop.Due`); per-step
    diagnostics that are not part of the modeled system (SSFusion's tensor-missing rate) run
    only then.  Callers outside the trainer get every step diagnosed.  ``evaluated``: rank 0
    evaluates :meth:`Strategy.eval_params` after the step (a strategy that assembles the model
    for it does so in the step's program, e.g. SDP); callers outside the trainer say so
    themselves.
    """

    step: int
    epoch: int
    loss: float
    logged: bool = True
    evaluated: bool = False


@dataclass(frozen=True)
class NoOptions:
    """A strategy without options of its own."""


class Strategy(Bindings):
    """Base class of gradient-sync strategies; see the module docstring."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions

    def __init__(self, ctx: SyncContext, options) -> None:
        self.ctx = ctx
        self.options = options
        self.run = ctx.run
        self.topo = ctx.run.topo
        self.xp = ctx.run.xp
        self.layout = ctx.model.layout
        self.M, self.P = self.topo.num_nodes, self.topo.ranks_per_node

    def on_ready(self, name: str) -> None:
        """Called during backward as soon as tensor ``name``'s gradient is written (backward
        order), before the program goes on, for work that is not the program's (profiling
        timings).  Default: nothing."""

    #: whether a rank outside a call on the node leaders' group waits for it (a hierarchical
    #: scheme's leaders' phase, e.g. DDP's two-level all-reduce); ``False`` where such a group
    #: is only a coincidence of the plan's (SDP's holder sets)
    leader_waits: ClassVar[bool] = True

    def records(self, state: StepState) -> list:
        """The plan's records (calls and compute items) of the step about to run; the same
        list object for the same kind of step (the trainer keeps each list's program)."""
        raise NotImplementedError(f"{type(self).__name__} lists no records of its step")

    @property
    def executor(self) -> Executor:
        """The one executor of this strategy's programs, built on first use on the run and
        :meth:`communicators`: the trainer runs every step's program on it, the strategy the
        records it runs outside a step (:meth:`setup_records`), so a run that records its
        program holds every one of them to what ran (:meth:`Executor.verify`)."""
        ex = self.__dict__.get("_records_executor")     # (not _executor: SSFusion's CPU pool)
        if ex is None:
            ex = self.__dict__["_records_executor"] = Executor(self.run, self.communicators())
        return ex

    def setup_records(self) -> list:
        """The plan's records the strategy ran on :attr:`executor` while it was built (a set-up
        before the first step, e.g. PacTrain's GraSP all-reduces when it prunes at once); the
        trainer accounts them before the first step, with its metrics line.  Default: none."""
        return []

    def flops(self, label: str) -> float | None:
        """FLOPs of compute item ``label`` for the ``flops`` compute source (default: none)."""
        return None

    def communicators(self) -> dict:
        """``{group: Comm}`` of the communicators the strategy's records use beyond the
        topology's world, node and leaders communicators (built once, collectively; e.g. SDP's
        holder sets).  Default: none."""
        return {}

    def total_steps(self, base_steps: int) -> int:
        """Optimizer steps of the run given the trainer's budget ``base_steps`` (e.g. more
        steps for FLOP-matched schedules).  Default: ``base_steps``."""
        return base_steps

    def after_step(self, state: StepState) -> None:
        """Called after the optimizer applied the synchronized gradient (e.g. to re-apply a
        weight mask or to track a mask's stability).  Default: nothing."""

    def eval_params(self):
        """The flat parameter vector to evaluate (default: the model's own)."""
        return self.ctx.model.params.flat

    def report(self) -> dict:
        """Strategy-specific summary metrics (e.g. payload ratio, memory)."""
        return {}

    def state_dict(self) -> dict:
        """What this strategy carries from one step to the next, beyond the model and the
        optimizer (error-feedback residuals, masks, statistics), as host arrays (JSON text for
        nested values) for a checkpoint, taken after :meth:`after_step` and the evaluation.
        Default: nothing (a stateless strategy)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output after construction, so the next step continues
        exactly as in an uninterrupted run.  Default: nothing to restore."""


STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: add ``cls`` to :data:`STRATEGIES` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise ValueError(f"strategy name {cls.name!r} registered twice")
    STRATEGIES[cls.name] = cls
    return cls


def add_options_args(parser: argparse.ArgumentParser, options_cls: type, title: str) -> None:
    """Add one flag per field of the frozen dataclass ``options_cls``
    (:func:`substrate.options.add_dataclass_args`; a flag another strategy already added is
    shared, which requires the same default)."""
    add_dataclass_args(parser, options_cls, title)


def add_strategy_args(parser: argparse.ArgumentParser) -> None:
    """Add every registered strategy's options, one group per method; a flag several methods
    read (``--density``: topk and ssfusion) appears once, in the first method's group, and its
    help names every method that uses it."""
    users: dict[str, list[str]] = {}
    for name, cls in sorted(STRATEGIES.items()):
        add_options_args(parser, cls.Options, f"--method {name}")
        for f in dataclasses.fields(cls.Options):
            users.setdefault(f.name, []).append(name)
    for action in parser._actions:  # argparse keeps no public list of its actions
        methods = users.get(action.dest, [])
        if len(methods) > 1 and action.help is not None:
            action.help = f"{action.help} [used by --method {', '.join(methods)}]".lstrip()


def check_unused_options(args: argparse.Namespace, method: str, shared=()) -> None:
    """Refuse options that only other strategies read (e.g. ``--density`` with ``--method ddp``),
    recognised by a value other than their default; ``shared``: trainer options every method
    reads (e.g. ``--init``).

    Raises
    ------
    ValueError
        Naming each such flag and the methods that use it.
    """
    own = {f.name for f in dataclasses.fields(STRATEGIES[method].Options)}
    users: dict[str, tuple[str, object, list[str]]] = {}
    for name, cls in sorted(STRATEGIES.items()):
        for f in dataclasses.fields(cls.Options):
            users.setdefault(f.name, (flag_of(cls.Options, f.name), f.default, []))[2].append(name)
    unused = [f"{flag} (used by --method {' / '.join(methods)})"
              for dest, (flag, default, methods) in users.items()
              if dest not in own and dest not in shared and hasattr(args, dest)
              and getattr(args, dest) != default]
    if unused:
        raise ValueError(f"--method {method} does not use {', '.join(unused)}: drop "
                         f"{'it' if len(unused) == 1 else 'them'} or choose a method that "
                         "uses it")


def options_from_args(options_cls: type, args: argparse.Namespace):
    """Build the frozen options of a strategy from parsed arguments (its constructor
    validates)."""
    return from_args(options_cls, args)
