"""Result types and the registry of :mod:`commvol.systems` (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from substrate import costmodel as cm
from substrate.calls import Call, Placement, price
from substrate.costmodel import CostModel

__all__ = [
    "ITEMSIZE",
    "SYSTEMS",
    "IterCost",
    "Prediction",
    "SystemModel",
    "_admm_units_per_epoch",
    "_check_topology",
    "_dp_units_per_epoch",
    "_int_list",
    "get_system",
    "register",
]

#: float32 parameters/gradients, as every trainer of the project builds its models
ITEMSIZE = 4


# ---------------------------------------------------------------------------------------------
# result types
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IterCost:
    """Communication of one iteration of a system (all ranks together).

    Attributes
    ----------
    phases : dict
        ``{phase: {"intra": wire bytes, "inter": wire bytes}}``: the phases of the system's
        closed form (a phase called on one-rank communicators only is listed with zero bytes
        where the ledger lists it).
    messages : dict
        ``{phase: messages}`` summed over ranks (a ring all-reduce over ``g`` ranks is
        ``g · 2 (g-1)``, a binomial broadcast ``g - 1``, a ring all-gather ``g (g-1)``).
    modeled_s : dict
        ``{phase: seconds}``: α–β time of the phase's calls on the rank that takes part in all of
        them (the ledger's maximum over ranks).
    payload_bytes, dense_payload_bytes : int
        Bytes one sender contributes to the main exchange (PruneX Fig. 6's "message size": the
        compact buffer of one leader; the dense model for DDP; ``8K`` for Top-K) and the dense
        equivalent.
    rank_s : tuple of float
        Modeled seconds of every world rank (all phases): the run's ``timing.comm_modeled_s``
        is the maximum over ranks of their sums, which differs from the sum of the phases'
        maxima when no rank takes part in every call (SDP's holder groups).  Empty:
        :attr:`time_s` is the sum of the phases.
    calls : tuple
        The plan's records of one repetition (:class:`substrate.calls.Call`, and
        :class:`substrate.calls.Work` compute items) the numbers were priced from, on
        :attr:`placement`.
    """

    phases: dict
    messages: dict
    modeled_s: dict
    payload_bytes: int = 0
    dense_payload_bytes: int = 0
    rank_s: tuple = ()
    calls: tuple = ()
    placement: Placement | None = None

    @classmethod
    def from_calls(cls, calls, placement: Placement, cost: CostModel | None = None,
                   payload: int = 0, dense: int = 0) -> IterCost:
        """Price the records of one iteration (:func:`substrate.calls.price`): every number of
        a prediction comes from the plan's records by the one generic rule; ``calls`` are kept
        for the job simulation at paper scale (:mod:`commvol.job`)."""
        calls = tuple(calls)
        pr = price([c for c in calls if isinstance(c, Call)], placement, cost)
        return cls(pr.phases, pr.messages, pr.seconds, int(payload), int(dense), pr.rank_s,
                   calls, placement)

    @property
    def intra(self) -> int:
        return int(sum(v[cm.INTRA] for v in self.phases.values()))

    @property
    def inter(self) -> int:
        return int(sum(v[cm.INTER] for v in self.phases.values()))

    @property
    def total_messages(self) -> int:
        return int(sum(self.messages.values()))

    @property
    def time_s(self) -> float:
        """Modeled communication time of the iteration on the busiest rank: the maximum of
        :attr:`rank_s` when tracked, else the sum of the phases."""
        if self.rank_s:
            return float(max(self.rank_s))
        return float(sum(self.modeled_s.values()))

    def times(self, k: int) -> IterCost:
        """``k`` repetitions (e.g. ``k`` DDP steps per iteration)."""
        return IterCost({p: {cm.INTRA: k * v[cm.INTRA], cm.INTER: k * v[cm.INTER]}
                         for p, v in self.phases.items()},
                        {p: k * m for p, m in self.messages.items()},
                        {p: k * t for p, t in self.modeled_s.items()},
                        k * self.payload_bytes, k * self.dense_payload_bytes,
                        tuple(k * t for t in self.rank_s), self.calls, self.placement)

    @staticmethod
    def sum(costs) -> IterCost:
        """Phase-wise sum of several costs (:attr:`rank_s` rank-wise when every cost tracks it
        for the same ranks, else dropped)."""
        costs = list(costs)
        phases: dict = {}
        msgs: dict = {}
        secs: dict = {}
        pay = dense = 0
        widths = {len(c.rank_s) for c in costs}
        rank_s = (tuple(float(sum(t)) for t in zip(*(c.rank_s for c in costs)))
                  if len(widths) == 1 and 0 not in widths else ())
        for c in costs:
            for p, v in c.phases.items():
                e = phases.setdefault(p, {cm.INTRA: 0, cm.INTER: 0})
                e[cm.INTRA] += v[cm.INTRA]
                e[cm.INTER] += v[cm.INTER]
            for p, m in c.messages.items():
                msgs[p] = msgs.get(p, 0) + m
            for p, t in c.modeled_s.items():
                secs[p] = secs.get(p, 0.0) + t
            pay += c.payload_bytes
            dense += c.dense_payload_bytes
        return IterCost(phases, msgs, secs, pay, dense, rank_s)

    def as_dict(self) -> dict:
        """JSON-ready view in the ``traffic`` schema (``by_phase`` with bytes/messages/time)."""
        names = sorted(set(self.phases) | set(self.messages) | set(self.modeled_s))
        by_phase = {p: {"intra_bytes": int(self.phases.get(p, {}).get(cm.INTRA, 0)),
                        "inter_bytes": int(self.phases.get(p, {}).get(cm.INTER, 0)),
                        "messages": int(self.messages.get(p, 0)),
                        "modeled_s": float(self.modeled_s.get(p, 0.0))} for p in names}
        return {"inter_node_bytes": self.inter, "intra_node_bytes": self.intra,
                "messages": self.total_messages, "modeled_s": self.time_s,
                "payload_bytes": int(self.payload_bytes),
                "dense_payload_bytes": int(self.dense_payload_bytes), "by_phase": by_phase}


@dataclass(frozen=True)
class Prediction:
    """A system's predicted communication, iteration by iteration.

    Attributes
    ----------
    system, model : str
    nodes, gpus_per_node : int
    unit : str
        What one iteration is (e.g. ``"iteration"``, ``"1 step"``).
    stages : tuple of (int or None, IterCost)
        Consecutive runs of identical iterations; ``None`` (last stage only) means "every
        remaining iteration".
    setup : IterCost or None
        One-off traffic before the first iteration (e.g. the partition broadcast of sparse SGD).
    notes : tuple of str
        Assumptions behind the numbers.
    num_params : int
        Parameters (or weights) of the model.
    evaluation : IterCost or None
        Traffic of one evaluation of the data-parallel trainer (SDP assembles the model on
        rank 0), added to the iterations :meth:`eval_iterations` names; not part of
        :attr:`steady` (training traffic only).
    eval_every : int
        The trainer's rule (``dataparallel.train``): it evaluates after every
        ``eval_every``-th step and after the last one; 0: after the last one only.
    """

    system: str
    model: str
    nodes: int
    gpus_per_node: int
    unit: str
    stages: tuple
    setup: IterCost | None = None
    notes: tuple = ()
    num_params: int = 0
    evaluation: IterCost | None = None
    eval_every: int = 0

    def eval_iterations(self, iters: int) -> list[int]:
        """0-based iterations of a run of ``iters`` after which the trainer evaluates:
        ``k`` with ``(k + 1) % eval_every == 0``, and ``iters - 1`` (none without
        :attr:`evaluation`)."""
        if self.evaluation is None or iters < 1:
            return []
        ks = list(range(self.eval_every - 1, iters, self.eval_every)) if self.eval_every else []
        if not ks or ks[-1] != iters - 1:
            ks.append(iters - 1)
        return ks

    def schedule(self, iters: int) -> list[tuple[int, int, IterCost]]:
        """``[(first, last, cost), ...]`` covering iterations ``0 .. iters-1`` (an iteration
        followed by an evaluation carries :attr:`evaluation` too)."""
        ranges = self._stage_ranges(iters)
        evals = self.eval_iterations(iters)
        if not evals:
            return ranges
        out: list = []

        def push(a, b, c):
            if out and out[-1][2] is c and out[-1][1] == a - 1:
                out[-1] = (out[-1][0], b, c)
            else:
                out.append((a, b, c))

        i = 0
        for first, last, cost in ranges:
            with_eval = IterCost.sum([cost, self.evaluation])
            k = first
            while i < len(evals) and evals[i] <= last:
                e = evals[i]
                if e > k:
                    push(k, e - 1, cost)
                push(e, e, with_eval)
                k, i = e + 1, i + 1
            if k <= last:
                push(k, last, cost)
        return out

    def _stage_ranges(self, iters: int) -> list[tuple[int, int, IterCost]]:
        """:attr:`stages` laid over iterations ``0 .. iters-1``."""
        if iters < 1:
            raise ValueError(f"--iters must be >= 1, got {iters}")
        out, k = [], 0
        for count, cost in self.stages:
            n = iters - k if count is None else min(count, iters - k)
            if n > 0:
                out.append((k, k + n - 1, cost))
                k += n
            if k >= iters:
                break
        if k < iters:  # the last stage repeats
            out.append((k, iters - 1, self.stages[-1][1]))
        return out

    @property
    def steady(self) -> IterCost:
        """Cost of the iterations of the last stage (e.g. after the mask freeze)."""
        return self.stages[-1][1]

    def total(self, iters: int, setup: bool = True) -> IterCost:
        """Sum over ``iters`` iterations (plus the one-off setup traffic)."""
        parts = [cost.times(last - first + 1) for first, last, cost in self.schedule(iters)]
        if setup and self.setup is not None:
            parts.append(self.setup)
        return IterCost.sum(parts)

    def as_dict(self, iters: int) -> dict:
        return {"system": self.system, "model": self.model, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "unit": self.unit,
                "num_params": self.num_params, "iterations": iters,
                "schedule": [{"first": a, "last": b, **c.as_dict()}
                             for a, b, c in self.schedule(iters)],
                "setup": self.setup.as_dict() if self.setup else None,
                "evaluation": self.evaluation.as_dict() if self.evaluation else None,
                "eval_iterations": self.eval_iterations(iters),
                "total": self.total(iters).as_dict(), "notes": list(self.notes)}


def _check_topology(nodes: int, gpus_per_node: int) -> None:
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
def _dp_units_per_epoch(options, samples_per_rank: float, batch_size: int,
                        assumptions=None) -> float:
    """Data-parallel: one iteration is ``steps_per_iter`` optimizer steps of ``batch_size``."""
    steps = math.ceil(samples_per_rank / batch_size)
    return steps / getattr(assumptions, "steps_per_iter", getattr(options, "steps_per_iter", 1))


def _admm_units_per_epoch(options, samples_per_rank: float, batch_size: int,
                          assumptions=None) -> float:
    """ADMM: one outer iteration runs ``local_epochs`` epochs of local SGD."""
    return 1.0 / options.local_epochs


@dataclass(frozen=True)
class SystemModel:
    """One registered system.

    Attributes
    ----------
    name : str
        ``--system`` name.
    predict : callable
        ``predict(spec, nodes, gpus_per_node, options, cost=None) -> Prediction``, with a
        further ``assumptions`` argument when :attr:`Assumptions` is set.
    Options : type
        The system's own frozen options dataclass (the strategy's ``Options`` or the solver's
        config): a prediction takes exactly the options a run takes, declared once.
    Assumptions : type or None
        Frozen dataclass of what a prediction must assume that no run option says (e.g. how
        many data-parallel steps make one iteration); its fields must not repeat an option.
    spec_kind : str
        ``"model"`` (a :class:`models.ModelSpec`) or ``"radixnet"``
        (:class:`commvol.hsgd.RadixNetSpec`).
    description : str
    units_per_epoch : callable
        ``(options, samples_per_rank, batch_size) -> iterations per pass over the data`` (used by
        ``scale``); default: data-parallel steps.
    baseline : str or None
        System ``predict`` compares against (dense DDP for the data-parallel family).
    loop : {"dp", "admm", "hsgd"}
        What one iteration is in a job at paper scale (:mod:`commvol.job`): a
        data-parallel optimizer step (records wait for :class:`substrate.calls.Ready` tokens),
        an ADMM iteration (records wait for ``"local"``, the local epochs), or H-SGD's own.
    """

    name: str
    predict: Callable
    Options: type
    spec_kind: str = "model"
    description: str = ""
    units_per_epoch: Callable = _dp_units_per_epoch
    baseline: str | None = "ddp"
    Assumptions: type | None = None
    loop: str = "dp"

    def __post_init__(self) -> None:
        if self.Assumptions is not None:
            both = set(self.Options.__dataclass_fields__) & set(
                self.Assumptions.__dataclass_fields__)
            if both:
                raise ValueError(f"system {self.name!r}: assumption(s) {sorted(both)} repeat "
                                 "options of the run; declare each once")

    def fields(self) -> set[str]:
        """Names of every option and assumption ``predict`` accepts."""
        names = set(self.Options.__dataclass_fields__)
        if self.Assumptions is not None:
            names |= set(self.Assumptions.__dataclass_fields__)
        return names

    def split(self, kw: dict):
        """``(Options(...), Assumptions(...) or None)`` from keyword values (each validates)."""
        opts = self.Options(**{k: v for k, v in kw.items()
                               if k in self.Options.__dataclass_fields__})
        if self.Assumptions is None:
            return opts, None
        return opts, self.Assumptions(**{k: v for k, v in kw.items()
                                         if k in self.Assumptions.__dataclass_fields__})

    def __call__(self, spec, nodes: int, gpus_per_node: int, kw: dict,
                 cost: CostModel | None = None):
        """Predict from keyword option values (see :meth:`split`)."""
        opts, assumptions = self.split(kw)
        if assumptions is None:
            return self.predict(spec, nodes, gpus_per_node, opts, cost)
        return self.predict(spec, nodes, gpus_per_node, opts, cost, assumptions)


SYSTEMS: dict[str, SystemModel] = {}


def register(model: SystemModel) -> SystemModel:
    """Add ``model`` to :data:`SYSTEMS` (a name may be registered once)."""
    if not model.name:
        raise ValueError("a SystemModel needs a non-empty name")
    if model.name in SYSTEMS and SYSTEMS[model.name] is not model:
        raise ValueError(f"system {model.name!r} registered twice")
    SYSTEMS[model.name] = model
    return model


def get_system(name: str) -> SystemModel:
    """``SYSTEMS[name]``; ValueError listing the valid names for an unknown one."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; valid systems: {', '.join(sorted(SYSTEMS))}")
    return SYSTEMS[name]


# ---------------------------------------------------------------------------------------------
def _int_list(text, flag: str = "--compact-elems",
              what: str = "comma-separated integers"):
    """``"1,2 3"`` or a sequence of integers -> tuple of int (``None`` stays ``None``);
    ValueError naming ``flag`` otherwise."""
    if text is None:
        return None
    items = str(text).replace(",", " ").split() if isinstance(text, str) else list(text)
    try:
        return tuple(int(x) for x in items)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} takes {what}, got {text!r}") from None


