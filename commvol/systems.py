"""Registry of per-system communication models: bytes per link class, messages and α–β time.

Every entry of :data:`SYSTEMS` is a :class:`SystemModel` whose ``predict`` has one signature::

    predict(spec, nodes, gpus_per_node, options, cost=None) -> Prediction

``spec`` is a shape-only model (:class:`models.ModelSpec`; :class:`commvol.hsgd.RadixNetSpec` for
the sparse-DNN systems), ``options`` the system's frozen options dataclass (``SystemModel.Options``;
its fields become ``python -m commvol predict`` flags) and ``cost`` a
:class:`substrate.costmodel.CostModel`.  A :class:`Prediction` holds the per-iteration
``{phase: {"intra": bytes, "inter": bytes}}`` (as stages: H-SADMM synchronizes masks only until
the freeze), the messages of every phase summed over ranks and the modeled time of every phase on
its busiest rank — the ledger's conventions, so a run's ``traffic.measured`` and
``timing.comm_modeled_s`` are reproduced exactly (bytes, messages) and to rounding (time).

The **bytes** come from the very functions the systems use for their ``summary.json``
``predicted`` blocks (:mod:`commvol.hsadmm`, :mod:`commvol.dataparallel`,
:mod:`sparse_sgd.traffic` via :mod:`commvol.hsgd`).  Messages and time are derived here from the
same list of collective calls with :class:`substrate.costmodel.CostModel`.

Adding a system is one :func:`register` call::

    register(SystemModel("pactrain", predict_pactrain, PacTrainPredictOptions,
                         description="..."))

Assumptions of the PacTrain model (printed by ``predict``):

* ``K`` from ``--prune-ratio`` as the strategy prunes, per layer: every conv/fc weight tensor
  keeps ``n - floor(r n)`` entries, biases and BatchNorm parameters are dense
  (:func:`pactrain_kept`);
* the mask is stable from the pruning on (pruned weights stay exactly zero), so steps
  ``0 .. warmup_steps + stable_window - 1`` are dense and packing starts at step
  ``warmup_steps + stable_window`` (the run's ``mask_stable_step``); GraSP's two all-reduces of
  ``T`` belong to step ``max(warmup_steps - 1, 0)``.

Assumptions of the SDP model: the masks of :func:`dataparallel.sdp.plan_masks` for the model
named by the spec (built from its name: the masks follow its layers) and the run seed
(``--seed``, block order); the sub-communicators the strategy builds; the model is assembled on
rank 0 at the trainer's evaluations only (``--eval-every`` steps and the last step;
:attr:`Prediction.evaluation`), and since ranks sit in different holder sets the modeled time is
the busiest rank's over all phases (:attr:`IterCost.rank_s`).

Assumptions of the SSFusion model (printed by ``predict``): fusion buffers, counts and splits
from the strategy's own planning helpers (:func:`ssfusion_plan`); ``--fusion per-tensor`` and
``multi-tensor`` are fully determined by the options.  The selective mode fixes its dense/sparse
selection from timings profiled during warm-up, which a prediction cannot know: by default it
applies the strategy's eq. 2 rule and T1+T2 split to an assumed profile (``--backward-ns``,
``--sparsify-ns`` per parameter, α–β communication times); ``--selection-from RUN`` (or
``--dense-tensors`` with ``--interleave-split``) reproduces a run's recorded selection exactly.

Assumptions of the H-SADMM model (printed by ``predict``):

* masks from keep rates on the spec shapes, following eq. 15 literally: ``K_out`` = filters with
  any kept entry, ``K_in`` = input channels with any kept entry *of the same layer's mask*
  (:func:`keep_rate_mask`).  Channel sparsity at keep ``k`` keeps all filters and
  ``keep_count(k, C_in)`` channels; filter sparsity the converse; ``filter+channel`` both.
  A filter whose output channel the *next* layer prunes is not removed (eq. 15 does not look
  across layers).  Shape sparsity keeps ``alpha`` kernel columns spread over the live channels
  first (``K_in = min(live channels, alpha)``, the largest ``K_in`` a shape mask can have).
* all nodes agree on the masks (the OR of eq. 14 adds nothing).  A real run's OR over nodes can
  keep more; pass its measured sizes as ``compact_elems`` (``--compact-elems``).
* masks are synchronized in iterations ``0 .. freeze_iter - 1`` (the trainer's ``--freeze-iter``;
  the data-dependent ``--freeze-patience`` is not modeled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hsadmm.projection import keep_count, parse_sparsity
from hsadmm.shrink import MaskCodec, ShrinkPlan
from hsadmm.train import HSADMMConfig
from substrate import costmodel as cm
from substrate.costmodel import CostModel

from .dataparallel import (ddp_step_bytes, hierarchical_step_bytes, topk_k, topk_step_bytes,
                           world_ring_bytes)
from .hsadmm import RESIDUALS_PER_LAYER, flat_admm_iteration_bytes, hsadmm_iteration_bytes

__all__ = ["IterCost", "Prediction", "SystemModel", "SYSTEMS", "register", "get_system",
           "CallCost", "keep_rate_mask", "hsadmm_plan", "HSADMMPredictOptions",
           "FlatADMMPredictOptions", "DPPredictOptions", "TopKPredictOptions",
           "predict_hsadmm", "predict_flat_admm", "predict_ddp", "predict_ddp_hierarchical",
           "predict_topk", "PacTrainPredictOptions", "pactrain_kept", "predict_pactrain",
           "SDPPredictOptions", "sdp_plan", "predict_sdp", "SSFusionPredictOptions",
           "ssfusion_plan", "predict_ssfusion", "predict_hsgd", "predict_sgd",
           "ITEMSIZE"]

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
        Modeled seconds of every world rank (all phases), when the calls involve different
        ranks (SDP's holder groups): the run's ``timing.comm_modeled_s`` is the maximum over
        ranks of their sums, which differs from the sum of the phases' maxima when no rank takes
        part in every call.  Empty: some rank takes part in all calls (:attr:`time_s` is then the
        sum of the phases).
    """

    phases: dict
    messages: dict
    modeled_s: dict
    payload_bytes: int = 0
    dense_payload_bytes: int = 0
    rank_s: tuple = ()

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

    def times(self, k: int) -> "IterCost":
        """``k`` repetitions (e.g. ``k`` DDP steps per iteration)."""
        return IterCost({p: {cm.INTRA: k * v[cm.INTRA], cm.INTER: k * v[cm.INTER]}
                         for p, v in self.phases.items()},
                        {p: k * m for p, m in self.messages.items()},
                        {p: k * t for p, t in self.modeled_s.items()},
                        k * self.payload_bytes, k * self.dense_payload_bytes,
                        tuple(k * t for t in self.rank_s))

    @staticmethod
    def sum(costs) -> "IterCost":
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

    def per_iteration(self, k: int) -> IterCost:
        """Cost of iteration ``k`` (0-based) of a longer run (with its periodic evaluation; the
        evaluation after a run's last iteration is in :meth:`schedule` and :meth:`total`)."""
        for first, last, cost in self._stage_ranges(k + 1):
            if first <= k <= last:
                if self.evaluation is not None and self.eval_every and \
                        (k + 1) % self.eval_every == 0:
                    return IterCost.sum([cost, self.evaluation])
                return cost
        raise AssertionError("unreachable")

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


# ---------------------------------------------------------------------------------------------
# messages and α–β time of the collective calls (ledger conventions)
# ---------------------------------------------------------------------------------------------
class CallCost:
    """Accumulates messages and modeled time of one iteration's collective calls.

    Groups are ``"world"`` (all ``p = M P`` ranks, node-major), ``"intra"`` (the ``M`` node
    communicators of ``P`` ranks, calling in parallel) and ``"inter"`` (the ``M`` leaders).
    A communicator whose ring crosses nodes is timed at the inter-node link (the ledger's
    ``slowest``), as :mod:`substrate.comm` does.

    With ``per_rank=True`` the time of every call is charged to the world ranks that make it,
    so the calls may also run on arbitrary member sets (:meth:`allreduce_ranks`,
    :meth:`bcast_ranks`, :meth:`send`): a phase's time is then its busiest rank's and the
    iteration keeps every rank's total (:attr:`IterCost.rank_s`).
    """

    def __init__(self, nodes: int, gpus_per_node: int, cost: CostModel | None = None,
                 per_rank: bool = False) -> None:
        self.M, self.P = int(nodes), int(gpus_per_node)
        self.cost = cost or CostModel()
        self.messages: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._rank_s: dict[str, np.ndarray] | None = {} if per_rank else None

    def _group(self, group: str) -> tuple[int, int, str, object]:
        """(size, parallel groups, slowest link, world ranks taking part)."""
        M, P = self.M, self.P
        if group == "world":
            return M * P, 1, cm.INTER if M > 1 else cm.INTRA, slice(None)
        if group == "intra":
            return P, M, cm.INTRA, slice(None)
        if group == "inter":
            return M, 1, cm.INTER if M > 1 else cm.INTRA, np.arange(M) * P
        raise ValueError(f"unknown group {group!r}; use world, intra or inter")

    def _add(self, phase: str, messages: int, seconds: float, ranks=None) -> None:
        self.messages[phase] = self.messages.get(phase, 0) + int(messages)
        if self._rank_s is None:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + float(seconds)
            return
        if ranks is None:
            raise ValueError(f"phase {phase!r}: a per-rank CallCost needs the ranks of every "
                             "call; pass ranks=")
        v = self._rank_s.setdefault(phase, np.zeros(self.M * self.P))
        v[ranks] += float(seconds)

    def _members_link(self, ranks) -> str:
        """Slowest link of a communicator of these world ranks: its ring (or any spanning
        tree) crosses nodes iff the members live on more than one node."""
        nodes = {int(r) // self.P for r in ranks}
        return cm.INTER if len(nodes) > 1 else cm.INTRA

    def allreduce(self, phase: str, nbytes: int, group: str, calls: int = 1) -> None:
        """Ring all-reduce of ``nbytes`` per rank: ``2 (g-1)`` messages per rank."""
        g, n, link, ranks = self._group(group)
        self._add(phase, calls * n * g * 2 * (g - 1),
                  calls * self.cost.ring_allreduce_time(nbytes, g, link), ranks)

    def bcast(self, phase: str, nbytes: int, group: str, calls: int = 1) -> None:
        """Binomial broadcast of ``nbytes``: ``g - 1`` messages per group."""
        g, n, link, ranks = self._group(group)
        self._add(phase, calls * n * (g - 1), calls * self.cost.bcast_time(nbytes, g, link),
                  ranks)

    def allgather(self, phase: str, block_bytes: int, group: str, calls: int = 1) -> None:
        """Ring all-gather of one ``block_bytes`` block per rank: ``g - 1`` messages per rank."""
        g, n, link, ranks = self._group(group)
        self._add(phase, calls * n * g * (g - 1),
                  calls * self.cost.ring_allgather_time(g * block_bytes, g, link), ranks)

    def allreduce_ranks(self, phase: str, nbytes: int, ranks) -> None:
        """Ring all-reduce of ``nbytes`` on a sub-communicator of the world ranks ``ranks``."""
        ranks = sorted(int(r) for r in ranks)
        g = len(ranks)
        self._add(phase, g * 2 * (g - 1),
                  self.cost.ring_allreduce_time(nbytes, g, self._members_link(ranks)), ranks)

    def bcast_ranks(self, phase: str, nbytes: int, ranks, root: int) -> None:
        """Binomial broadcast of ``nbytes`` from world rank ``root`` to the world ranks
        ``ranks`` (``g - 1`` messages; every member waits for the whole tree)."""
        ranks = sorted(int(r) for r in ranks)
        if int(root) not in ranks:
            raise ValueError(f"bcast root {root} is not one of the ranks {ranks}")
        g = len(ranks)
        self._add(phase, g - 1,
                  self.cost.bcast_time(nbytes, g, self._members_link(ranks)), ranks)

    def send(self, phase: str, nbytes: int, src: int, dst: int) -> None:
        """One point-to-point message of ``nbytes`` (timed on the sender, as the ledger)."""
        link = cm.INTRA if int(src) // self.P == int(dst) // self.P else cm.INTER
        self._add(phase, 1, self.cost.p2p_time(nbytes, link), [int(src)])

    def add(self, phase: str, messages: int, seconds: float, ranks=None) -> None:
        """Messages and time computed elsewhere (e.g. point-to-point patterns); ``ranks``:
        the world ranks that spend ``seconds`` (needed with ``per_rank``)."""
        self._add(phase, messages, seconds, ranks)

    def finish(self, phases: dict, payload: int = 0, dense: int = 0) -> IterCost:
        """Bind the calls to the phase bytes of the closed form."""
        if self._rank_s is None:
            return IterCost(dict(phases), dict(self.messages), dict(self.seconds),
                            int(payload), int(dense))
        secs = {p: float(v.max()) for p, v in self._rank_s.items()}
        total = sum(self._rank_s.values(), np.zeros(self.M * self.P))
        return IterCost(dict(phases), dict(self.messages), secs, int(payload), int(dense),
                        tuple(float(t) for t in total))


def _check_topology(nodes: int, gpus_per_node: int) -> None:
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
def _dp_units_per_epoch(options, samples_per_rank: float, batch_size: int) -> float:
    """Data-parallel: one iteration is ``steps_per_iter`` optimizer steps of ``batch_size``."""
    steps = math.ceil(samples_per_rank / batch_size)
    return steps / getattr(options, "steps_per_iter", 1)


def _admm_units_per_epoch(options, samples_per_rank: float, batch_size: int) -> float:
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
        ``predict(spec, nodes, gpus_per_node, options, cost=None) -> Prediction``.
    Options : type
        Frozen dataclass of the system's options (defaults = the system's trainer defaults).
    spec_kind : str
        ``"model"`` (a :class:`models.ModelSpec`) or ``"radixnet"``
        (:class:`commvol.hsgd.RadixNetSpec`).
    description : str
    units_per_epoch : callable
        ``(options, samples_per_rank, batch_size) -> iterations per pass over the data`` (used by
        ``scale``); default: data-parallel steps.
    baseline : str or None
        System ``predict`` compares against (dense DDP for the data-parallel family).
    """

    name: str
    predict: Callable
    Options: type
    spec_kind: str = "model"
    description: str = ""
    units_per_epoch: Callable = _dp_units_per_epoch
    baseline: str | None = "ddp"


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
# H-SADMM and flat ADMM (PruneX)
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


_HS = HSADMMConfig()


@dataclass(frozen=True)
class HSADMMPredictOptions:
    """Options of the H-SADMM model (defaults: ``python -m hsadmm train``'s)."""

    keep: float = field(default=_HS.keep, metadata={"help": "H-SADMM keep rate in (0, 1]"})
    sparsity: str = field(default=_HS.sparsity, metadata={
        "help": "H-SADMM sparsity: channel, filter, shape or an intersection like filter+channel"})
    freeze_iter: int = field(default=_HS.freeze_iter, metadata={
        "help": "H-SADMM: masks are synchronized in iterations < this (0: never frozen)"})
    bucket_mib: float = field(default=_HS.bucket_mib, metadata={
        "help": "all-reduce bucket size in MiB"})
    compact_elems: tuple | None = field(default=None, metadata={
        "type": _int_list, "help": "H-SADMM: measured compact elements per iteration (a run's "
        "metrics.jsonl compact_elems, comma-separated) instead of keep-rate masks"})
    local_epochs: float = field(default=_HS.local_epochs, metadata={
        "help": "ADMM: local epochs per outer iteration (scale only)"})

    def __post_init__(self) -> None:
        keep_count(self.keep, 1)
        parse_sparsity(self.sparsity)
        if self.freeze_iter is None or self.freeze_iter < 0:
            raise ValueError(f"--freeze-iter must be >= 0 (0: never), got {self.freeze_iter}")
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")
        if not self.local_epochs > 0:
            raise ValueError(f"--local-epochs must be > 0, got {self.local_epochs}")
        if self.compact_elems is not None:
            ce = _int_list(self.compact_elems)
            if not ce or min(ce) < 1:
                raise ValueError("--compact-elems needs positive integers, one per iteration")
            object.__setattr__(self, "compact_elems", ce)


@dataclass(frozen=True)
class FlatADMMPredictOptions:
    """Options of flat consensus ADMM ("PruneX (AR)")."""

    local_epochs: float = field(default=_HS.local_epochs, metadata={
        "help": "ADMM: local epochs per outer iteration (scale only)"})

    def __post_init__(self) -> None:
        if not self.local_epochs > 0:
            raise ValueError(f"--local-epochs must be > 0, got {self.local_epochs}")


def keep_rate_mask(shape, kinds: tuple[str, ...], keep: float) -> np.ndarray:
    """A structured mask with the support sizes the projection of eq. 10 keeps at ``keep``.

    Which groups are kept does not matter for the volume, only how many: filter ``alpha_out``
    filters, channel ``alpha_in`` input channels (``keep_count``), applied in the projection order
    (filter, channel, shape).  Shape sparsity keeps ``alpha_kern`` of the ``C_in K_H K_W`` kernel
    columns, dealt over the live channels position by position (the widest ``K_in``).

    Parameters
    ----------
    shape : tuple
        ``(C_out, C_in, K_H, K_W)`` (or ``(d_out, d_in)``).
    kinds : tuple of str
        From :func:`hsadmm.projection.parse_sparsity`.
    keep : float
        Keep rate in ``(0, 1]``.
    """
    shape = tuple(int(s) for s in shape)
    s4 = shape if len(shape) == 4 else (shape[0], shape[1], 1, 1)
    co, ci, kh, kw = s4
    mask = np.ones(s4, dtype=bool)
    if "filter" in kinds:
        mask[keep_count(keep, co):] = False
    if "channel" in kinds:
        mask[:, keep_count(keep, ci):] = False
    if "shape" in kinds:
        alpha = keep_count(keep, ci * kh * kw)
        live = np.flatnonzero(mask.any(axis=(0, 2, 3)))
        cols = np.zeros((ci, kh * kw), dtype=bool)
        order = [(c, q) for q in range(kh * kw) for c in live][:alpha]
        for c, q in order:
            cols[c, q] = True
        mask &= cols.reshape(1, ci, kh, kw)
    return mask.reshape(shape)


def hsadmm_plan(spec, keep: float, sparsity: str, bucket_mib: float):
    """The solver's compact layout for keep-rate masks on ``spec``'s conv weights.

    Returns ``(plan, mask_bytes, num_layers, has_masks)``: the :class:`hsadmm.shrink.ShrinkPlan`
    (compact buckets exactly as :class:`hsadmm.solver.HSADMM` cuts them), the packed mask bytes
    ``B`` of :class:`hsadmm.shrink.MaskCodec`, the tensor count ``L`` and whether any layer is
    pruned.
    """
    layout = spec.layout
    kinds = parse_sparsity(sparsity)
    names = list(layout.names)
    shapes = [layout.shape(n) for n in names]
    pruned = [i for i, n in enumerate(names) if layout.kind(n) == "conv"]  # as the solver
    masks: list = [None] * len(names)
    for i in pruned:
        masks[i] = keep_rate_mask(shapes[i], kinds, keep)
    plan = ShrinkPlan(shapes, masks, dtype=np.float32, xp=np,
                      bucket_bytes=int(bucket_mib * (1 << 20)))
    mask_bytes = MaskCodec([shapes[i] for i in pruned]).nbytes if pruned else 0
    return plan, mask_bytes, len(names), bool(pruned)


def _hsadmm_cost(M, P, T, buckets, mask_bytes, has_masks, synced, L, cost) -> IterCost:
    phases = hsadmm_iteration_bytes(M=M, P=P, total_params=T, compact_sizes=buckets,
                                    mask_bytes=mask_bytes if has_masks else 0,
                                    mask_synced=synced, num_layers=L, itemsize=ITEMSIZE)
    C = int(sum(buckets))
    calls = CallCost(M, P, cost)
    calls.allreduce("intra_allreduce", ITEMSIZE * T, "intra")
    if synced:  # the solver packs and syncs even an empty mask buffer
        calls.allreduce("mask_sync", mask_bytes, "inter")
        calls.bcast("mask_bcast", mask_bytes, "intra")
    for n in buckets:
        calls.allreduce("inter_allreduce", ITEMSIZE * n, "inter")
    calls.bcast("bcast_z", ITEMSIZE * C, "intra")
    calls.allreduce("residuals", 8 * RESIDUALS_PER_LAYER * L, "world")
    return calls.finish(phases, ITEMSIZE * C, ITEMSIZE * T)


def predict_hsadmm(spec, nodes: int, gpus_per_node: int, options: HSADMMPredictOptions,
                   cost: CostModel | None = None) -> Prediction:
    """H-SADMM (PruneX Algorithm 1): bytes from :func:`commvol.hsadmm.hsadmm_iteration_bytes`
    with the compact sizes of eq. 15 for keep-rate masks (see the module docstring)."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    plan, B, L, has_masks = hsadmm_plan(spec, options.keep, options.sparsity, options.bucket_mib)
    T = spec.layout.total
    notes = [f"compact [K_out, K_in] slices of eq. 15 from keep-rate masks ({options.sparsity}, "
             f"keep {options.keep}): compact/dense = {plan.compact_size}/{plan.dense_size} = "
             f"{plan.ratio:.4f} (conv layers pruned; FC, BN and biases travel whole)",
             "all nodes agree on the masks (the OR of eq. 14 keeps nothing extra)",
             f"masks synchronized in iterations 0..{options.freeze_iter - 1}, frozen after"
             if options.freeze_iter else "masks never frozen (synchronized every iteration)",
             f"{len(plan.buckets)} compact bucket(s) of <= {options.bucket_mib:g} MiB",
             "PruneX Fig. 6 reports compact ~ 0.40 of dense at keep 0.5 (ResNet-18/152, "
             "WRN-50-2); eq. 15 with per-layer masks gives 0.50 at keep 0.5 and 0.40 at keep 0.4 "
             "(channel), which reproduces Fig. 6b's totals (e.g. ResNet-152 13.00 -> 5.21 GiB)"]
    buckets = [b - a for a, b in plan.buckets]

    def one(synced, bk=buckets):
        return _hsadmm_cost(M, P, T, bk, B, has_masks, synced, L, cost)

    if options.compact_elems is not None:
        nb = len(buckets)
        stages = []
        for k, c in enumerate(options.compact_elems):
            bk = [int(c) // nb + (1 if j < int(c) % nb else 0) for j in range(nb)]
            synced = not options.freeze_iter or k < options.freeze_iter
            stages.append((1, one(synced, bk)))
        notes[0] = (f"compact sizes given per iteration ({len(stages)} values; the last repeats); "
                    f"split over the keep-rate plan's {nb} bucket(s) for messages and time")
        notes[1] = "measured compact sizes include the OR of the nodes' masks (eq. 14)"
    elif options.freeze_iter:
        stages = [(options.freeze_iter, one(True)), (None, one(False))]
    else:
        stages = [(None, one(True))]
    return Prediction("hsadmm", spec.name, M, P, "iteration", tuple(stages), notes=tuple(notes),
                      num_params=T)


def predict_flat_admm(spec, nodes: int, gpus_per_node: int, options: FlatADMMPredictOptions,
                      cost: CostModel | None = None) -> Prediction:
    """Flat consensus ADMM: one dense world all-reduce of ``θ + u`` per iteration
    (:func:`commvol.hsadmm.flat_admm_iteration_bytes`)."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    T, L = spec.layout.total, len(spec.layout)
    phases = flat_admm_iteration_bytes(M=M, P=P, total_params=T, num_layers=L,
                                       itemsize=ITEMSIZE)
    calls = CallCost(M, P, cost)
    calls.allreduce("world_allreduce", ITEMSIZE * T, "world")
    calls.allreduce("residuals", 8 * RESIDUALS_PER_LAYER * L, "world")
    it = calls.finish(phases, ITEMSIZE * T, ITEMSIZE * T)
    return Prediction("flat-admm", spec.name, M, P, "iteration", ((None, it),),
                      notes=("dense world all-reduce of theta+u, no hierarchy, no shrinkage",),
                      num_params=T)


# ---------------------------------------------------------------------------------------------
# data parallel: DDP (ring / hierarchical), Top-K
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DPPredictOptions:
    """Options of the dense DDP models (defaults: ``python -m dataparallel train``'s)."""

    bucket_mib: float = field(default=32.0, metadata={"help": "all-reduce bucket size in MiB"})
    steps_per_iter: int = field(default=1, metadata={
        "flag": "--ddp-steps-per-iter",
        "help": "data-parallel optimizer steps per iteration: 1 = one synchronization of the "
                "model per iteration (PruneX Fig. 6b's Dense DDP), or the steps of the local "
                "epochs of one ADMM iteration (ceil(samples per rank / batch) x local epochs)"})

    def __post_init__(self) -> None:
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")
        if not isinstance(self.steps_per_iter, (int, np.integer)) or self.steps_per_iter < 1:
            raise ValueError(f"--ddp-steps-per-iter must be an integer >= 1, got "
                             f"{self.steps_per_iter}")


@dataclass(frozen=True)
class TopKPredictOptions(DPPredictOptions):
    """Options of the Top-K model (default density: ``dataparallel``'s 1 %)."""

    density: float = field(default=0.01, metadata={
        "help": "Top-K: fraction of each tensor's entries sent per step"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.density <= 1:
            raise ValueError(f"--density must be in (0, 1] (e.g. 0.01 for 1 %), got "
                             f"{self.density}")


def _unit(steps: int) -> str:
    return f"{steps} step" + ("s" if steps > 1 else "")


def _ddp_buckets(spec, bucket_mib: float) -> list[int]:
    from dataparallel.ddp import flat_buckets  # noqa: PLC0415 (dataparallel imports commvol)

    return [b - a for a, b in flat_buckets(spec.layout, int(bucket_mib * (1 << 20)), ITEMSIZE)]


def _predict_ddp(spec, nodes, gpus_per_node, options, cost, hierarchical: bool) -> Prediction:
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    buckets = _ddp_buckets(spec, options.bucket_mib)
    T = spec.layout.total
    calls = CallCost(M, P, cost)
    if hierarchical:
        phases = hierarchical_step_bytes(M=M, P=P, bucket_sizes=buckets, itemsize=ITEMSIZE)
        for n in buckets:
            calls.allreduce("intra_allreduce", ITEMSIZE * n, "intra")
            calls.allreduce("inter_allreduce", ITEMSIZE * n, "inter")
            calls.bcast("intra_bcast", ITEMSIZE * n, "intra")
        name = "ddp-hierarchical"
        how = "per bucket: SUM ring all-reduce in each node, leaders' ring, binomial bcast"
    else:
        phases = ddp_step_bytes(M=M, P=P, bucket_sizes=buckets, itemsize=ITEMSIZE)
        for n in buckets:
            calls.allreduce("grad_allreduce", ITEMSIZE * n, "world")
        name = "ddp"
        how = "per bucket: one ring all-reduce over all ranks (node-major)"
    step = calls.finish(phases, ITEMSIZE * T, ITEMSIZE * T)
    s = options.steps_per_iter
    notes = (f"{len(buckets)} gradient bucket(s) of <= {options.bucket_mib:g} MiB; {how}",
             f"one iteration = {_unit(s)} (--ddp-steps-per-iter {s})")
    return Prediction(name, spec.name, M, P, _unit(s), ((None, step.times(s)),), notes=notes,
                      num_params=T)


def predict_ddp(spec, nodes, gpus_per_node, options: DPPredictOptions, cost=None) -> Prediction:
    """Dense DDP with a ring all-reduce per bucket (:func:`commvol.dataparallel.ddp_step_bytes`)."""
    return _predict_ddp(spec, nodes, gpus_per_node, options, cost, hierarchical=False)


def predict_ddp_hierarchical(spec, nodes, gpus_per_node, options: DPPredictOptions,
                             cost=None) -> Prediction:
    """DDP with the two-level all-reduce (:func:`commvol.dataparallel.hierarchical_step_bytes`)."""
    return _predict_ddp(spec, nodes, gpus_per_node, options, cost, hierarchical=True)


def predict_topk(spec, nodes, gpus_per_node, options: TopKPredictOptions,
                 cost=None) -> Prediction:
    """Top-K: ring all-gather of ``K`` values + indices (:func:`commvol.dataparallel.topk_k`,
    :func:`commvol.dataparallel.topk_step_bytes`)."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    layout = spec.layout
    K = int(sum(topk_k([layout.sizes[n] for n in layout.names], options.density)))
    phases = topk_step_bytes(M=M, P=P, k_total=K)
    calls = CallCost(M, P, cost)
    calls.allgather("topk_allgather", 8 * K, "world")
    step = calls.finish(phases, 8 * K, ITEMSIZE * layout.total)
    s = options.steps_per_iter
    notes = (f"K = sum_l max(1, ceil({options.density:g} n_l)) = {K} of {layout.total} "
             f"(float32 value + int32 index each: payload ratio {2 * K / layout.total:.4f})",
             f"one iteration = {_unit(s)} (--ddp-steps-per-iter {s})")
    return Prediction("topk", spec.name, M, P, _unit(s), ((None, step.times(s)),), notes=notes,
                      num_params=layout.total)


register(SystemModel("hsadmm", predict_hsadmm, HSADMMPredictOptions,
                     description="PruneX H-SADMM: intra all-reduce, mask OR-sync, compact "
                                 "inter-node all-reduce, bcast",
                     units_per_epoch=_admm_units_per_epoch))
register(SystemModel("flat-admm", predict_flat_admm, FlatADMMPredictOptions,
                     description="flat consensus ADMM (PruneX (AR)): dense world all-reduce",
                     units_per_epoch=_admm_units_per_epoch))
register(SystemModel("ddp", predict_ddp, DPPredictOptions,
                     description="dense DDP, ring all-reduce per bucket"))
register(SystemModel("ddp-hierarchical", predict_ddp_hierarchical, DPPredictOptions,
                     description="dense DDP, two-level all-reduce per bucket"))
register(SystemModel("topk", predict_topk, TopKPredictOptions,
                     description="Top-K (DGC) gradient sparsification, all-gather"))


# ---------------------------------------------------------------------------------------------
# data parallel: PacTrain (paper 002), SDP (paper 003)
# ---------------------------------------------------------------------------------------------
#: ``dataparallel.pactrain.PRUNE_SCORES`` / ``TERNARY_SCALES`` (literal here: ``dataparallel``
#: imports ``commvol``, so this module imports it lazily; a test keeps them equal)
_PRUNE_SCORES = ("magnitude", "grasp")
_TERNARY_SCALES = ("tensor", "global")


@dataclass(frozen=True)
class PacTrainPredictOptions:
    """Options of the PacTrain model (names and defaults: ``dataparallel.pactrain``'s
    :class:`~dataparallel.pactrain.PacTrainOptions`, which validates them)."""

    prune_ratio: float = field(default=0.5, metadata={
        "help": "PacTrain: fraction of every conv/fc weight tensor pruned, in [0, 1)"})
    prune_score: str = field(default="magnitude", metadata={
        "help": "PacTrain: pruning importance (grasp adds the score's two all-reduces of T)",
        "choices": _PRUNE_SCORES})
    stable_window: int = field(default=5, metadata={
        "help": "PacTrain: steps the mask must stay unchanged before the packed all-reduce"})
    warmup_steps: int = field(default=0, metadata={
        "help": "PacTrain: dense steps on the unpruned model before pruning"})
    ternary: bool = field(default=False, metadata={
        "help": "PacTrain: TernGrad on the packed gradient (scale MAX all-reduce + 2-bit "
                "all-gather)"})
    ternary_scale: str = field(default="tensor", metadata={
        "help": "PacTrain: TernGrad scales, one per tensor or one in all",
        "choices": _TERNARY_SCALES})
    bucket_mib: float = field(default=32.0, metadata={"help": "all-reduce bucket size in MiB"})

    def __post_init__(self) -> None:
        from dataparallel.pactrain import PacTrainOptions  # noqa: PLC0415

        for flag, v in (("--stable-window", self.stable_window),
                        ("--warmup-steps", self.warmup_steps)):
            if not isinstance(v, (int, np.integer)):
                raise ValueError(f"{flag} takes a whole number of steps, got {v!r}")
        PacTrainOptions(**{f: getattr(self, f) for f in self.__dataclass_fields__})


def pactrain_kept(layout, prune_ratio: float) -> int:
    """``K``: entries PacTrain's per-layer pruning keeps (:func:`dataparallel.pactrain.
    prune_mask`): every conv/fc weight tensor of ``n`` entries keeps ``n - floor(r n)``, biases
    and BatchNorm parameters are kept whole (``r`` = ``prune_ratio``)."""
    from dataparallel.pactrain import PRUNABLE_KINDS  # noqa: PLC0415

    return int(sum(n - math.floor(prune_ratio * n) if layout.kind(name) in PRUNABLE_KINDS else n
                   for name, n in ((nm, layout.sizes[nm]) for nm in layout.names)))


def predict_pactrain(spec, nodes, gpus_per_node, options: PacTrainPredictOptions,
                     cost=None) -> Prediction:
    """PacTrain: dense all-reduce of DDP's buckets until the pruning mask is stable, then the
    packed all-reduce of the ``K`` survivors or TernGrad's scale all-reduce + 2-bit all-gather
    (:func:`commvol.pactrain.pactrain_step_bytes`).

    The strategy prunes before step ``w`` (``--warmup-steps``; in its constructor when
    ``w = 0``) and its mask tracker declares the mask stable after ``W`` (``--stable-window``)
    unchanged comparisons, the first made at step ``w``: steps ``0 .. w + W - 1`` are dense,
    packing starts at step ``w + W`` (the run's ``mask_stable_step``).  GraSP's two all-reduces
    of ``T`` are charged to step ``max(w - 1, 0)``, as the strategy does.
    """
    from commvol.pactrain import (packed_chunks, packed_payload_ratio,  # noqa: PLC0415
                                  pactrain_step_bytes, ternary_code_bytes)

    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    layout = spec.layout
    T = layout.total
    buckets = _ddp_buckets(spec, options.bucket_mib)
    bucket_elems = max(1, int(options.bucket_mib * (1 << 20)) // ITEMSIZE)
    K = pactrain_kept(layout, options.prune_ratio)
    L = len(layout) if options.ternary_scale == "tensor" else 1
    mode = "ternary" if options.ternary else "packed"
    chunks = packed_chunks(K, bucket_elems)

    def step(m: str, grasp: bool) -> IterCost:
        phases = pactrain_step_bytes(M=M, P=P, mode=m, bucket_sizes=buckets, kept=K,
                                     bucket_elems=bucket_elems, itemsize=ITEMSIZE, scales=L,
                                     grasp_total=T if grasp else None)
        calls = CallCost(M, P, cost)
        if m == "dense":
            for n in buckets:
                calls.allreduce("dense_allreduce", ITEMSIZE * n, "world")
        elif m == "packed":
            for n in chunks:
                calls.allreduce("packed_allreduce", ITEMSIZE * n, "world")
        else:
            calls.allreduce("ternary_scale", ITEMSIZE * L, "world")
            calls.allgather("ternary_allgather", ternary_code_bytes(K), "world")
        if grasp:
            calls.allreduce("grasp_allreduce", ITEMSIZE * T, "world", calls=2)
        ratio = 1.0 if m == "dense" else packed_payload_ratio(
            kept=K, total=T, ternary=m == "ternary", scales=L, itemsize=ITEMSIZE)
        return calls.finish(phases, round(ratio * ITEMSIZE * T), ITEMSIZE * T)

    w, W = options.warmup_steps, options.stable_window
    D = w + W                                        # dense steps
    grasp_at = max(w - 1, 0) if options.prune_score == "grasp" else None
    dense, packed = step("dense", False), step(mode, False)
    if grasp_at is None:
        stages = [(D, dense), (None, packed)]
    elif grasp_at < D:
        stages = [(grasp_at, dense), (1, step("dense", True)), (D - grasp_at - 1, dense),
                  (None, packed)]
    else:                                            # w = W = 0: packed from the first step
        stages = [(1, step(mode, True)), (None, packed)]
    stages = [(c, s) for c, s in stages if c != 0]
    how = (f"packed ring all-reduce of the K survivors in {len(chunks)} chunk(s) of <= "
           f"{options.bucket_mib:g} MiB (no indices: every rank packs the same index set)"
           if mode == "packed" else
           f"TernGrad: ring MAX all-reduce of {L} scale(s) (--ternary-scale "
           f"{options.ternary_scale}) + ring all-gather of ceil(K/4) = {ternary_code_bytes(K)} "
           f"code bytes per rank")
    notes = [f"K = {K} of T = {T} entries kept ({K / T:.4f}): every conv/fc weight tensor keeps "
             f"n - floor({options.prune_ratio:g} n) (per-layer pruning), biases and BatchNorm "
             "parameters travel whole",
             f"dense all-reduce of DDP's {len(buckets)} bucket(s) in steps 0..{D - 1} "
             f"({w} warm-up step(s) + --stable-window {W} steps of mask tracking)"
             if D else "no dense step (--warmup-steps 0, --stable-window 0)",
             f"from step {D} (the run's mask_stable_step): {how}",
             "the mask stays stable once pruned (pruned weights stay exactly zero); a surviving "
             "weight that reaches exactly 0 would re-plan and fall back to dense for "
             "--stable-window steps (not modeled), and --init weights that are already zero "
             "would lower K"]
    if grasp_at is not None:
        notes.append(f"GraSP score (eq. 4): two ring all-reduces of the T-element gradient "
                     f"(grad and H grad) in step {grasp_at}")
    return Prediction("pactrain", spec.name, M, P, "1 step", tuple(stages), notes=tuple(notes),
                      num_params=T)


@dataclass(frozen=True)
class SDPPredictOptions:
    """Options of the SDP model (names and defaults of ``dataparallel.sdp``'s
    :class:`~dataparallel.sdp.SDPOptions`, which validates them, plus the run seed and the
    trainer's evaluation interval)."""

    sdp_mode: str = field(default="neuron", metadata={
        "help": "SDP: neuron (N-SDP), block (B-SDP) or block-backward (B_b-SDP)"})
    coverage: str = field(default="3/4", metadata={
        "help": "SDP: coverage p/n, every neuron/channel on p of the n workers (neuron mode; "
                "block modes: b = round(C d) without --active-blocks)"})
    active_blocks: str = field(default="", metadata={
        "help": "SDP: b/d residual blocks kept per worker (block modes)"})
    eval_every: int = field(default=0, metadata={
        "help": "SDP: the trainer's --eval-every; every evaluation assembles the full model on "
                "rank 0 (after every eval-every-th step and after the last). 0 here: after the "
                "last step only (the trainer's 0 means once per epoch: pass ceil(shard / "
                "batch-size))"})
    seed: int = field(default=0, metadata={"help": "run seed (SDP: block order)"})

    def __post_init__(self) -> None:
        from dataparallel.sdp import SDPOptions  # noqa: PLC0415

        SDPOptions(sdp_mode=self.sdp_mode, coverage=self.coverage,
                   active_blocks=self.active_blocks)
        if not isinstance(self.eval_every, (int, np.integer)) or self.eval_every < 0:
            raise ValueError(f"--eval-every must be an integer >= 0 (steps between evaluations; "
                             f"0: only after the last step), got {self.eval_every!r}")


def _planning_model(spec):
    """The trainable model of ``spec``'s name (SDP's masks follow the layer tree, which a
    shape-only spec lacks); its layout must be the spec's."""
    from models import MODELS, build_model  # noqa: PLC0415

    from .scale import SPEC_ARCH, build_trainable  # noqa: PLC0415

    if spec.name in SPEC_ARCH:
        model = build_trainable(spec.name)
    elif spec.name in MODELS:
        model = build_model(spec.name, spec.input_shape, spec.num_classes)
    else:
        names = sorted(set(MODELS) | set(SPEC_ARCH))
        raise ValueError(f"--system sdp plans its masks on the model's layers; model "
                         f"{spec.name!r} has none: use one of {names}")
    if [(n, model.layout.shape(n)) for n in model.layout.names] != \
            [(n, spec.layout.shape(n)) for n in spec.layout.names]:
        raise ValueError(f"model {spec.name!r} built from its name does not match the given "
                         "spec; pass the spec of the trainer's model (resolve_model)")
    return model


def sdp_plan(spec, n: int, options: SDPPredictOptions):
    """SDP's mask for ``n`` workers (:func:`dataparallel.sdp.plan_masks`, as the strategy
    plans it from its options and the run seed)."""
    from dataparallel.sdp import parse_active_blocks, parse_fraction, plan_masks  # noqa: PLC0415

    return plan_masks(_planning_model(spec), options.sdp_mode, n,
                      coverage=parse_fraction(options.coverage, "--coverage"),
                      active_blocks=parse_active_blocks(options.active_blocks),
                      seed=int(options.seed))


def predict_sdp(spec, nodes, gpus_per_node, options: SDPPredictOptions,
                cost=None) -> Prediction:
    """SDP: per step a ring all-reduce of every holder set with ``>= 2`` holders on its own
    sub-communicator (:func:`commvol.sdp.gated_allreduce_bytes`), B_b-SDP's parameter
    broadcasts (:func:`commvol.sdp.param_bcast_bytes`) and, at the trainer's evaluations, the
    assembly of the model on rank 0 (:func:`commvol.sdp.assemble_bytes`), with the communicators
    the strategy builds from :func:`sdp_plan`."""
    from commvol.sdp import (ASSEMBLE, BCAST, GATED, assemble_bytes,  # noqa: PLC0415
                             gated_allreduce_bytes, param_bcast_bytes, sdp_step_bytes)

    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    n = M * P
    node_of = np.arange(n) // P
    plan = sdp_plan(spec, n, options)
    T = plan.total
    counts, degrees = plan.counts, plan.degrees
    everyone = set(range(n))

    # gated average: one ring all-reduce per holder set with >= 2 holders and >= 1 coordinate
    reduce_sets = [s for s in range(len(plan.sets)) if counts[s] > 0 and degrees[s] >= 2]
    members = [plan.members(s) for s in reduce_sets]
    calls = CallCost(M, P, cost, per_rank=True)
    for s, ms in zip(reduce_sets, members):
        calls.allreduce_ranks(GATED, ITEMSIZE * int(counts[s]), ms)
    gated = gated_allreduce_bytes(members, counts[reduce_sets], node_of, ITEMSIZE)
    # B_b-SDP: each set's lowest holder broadcasts the updated parameters to the non-holders
    bcast = None
    if options.sdp_mode == "block-backward":
        bsets = [s for s in range(len(plan.sets)) if counts[s] > 0 and degrees[s] < n]
        groups = [(sorted({plan.members(s)[0]} | (everyone - set(plan.members(s)))),
                   plan.members(s)[0]) for s in bsets]
        for s, (ranks, root) in zip(bsets, groups):
            calls.bcast_ranks(BCAST, ITEMSIZE * int(counts[s]), ranks, root)
        bcast = param_bcast_bytes(groups, counts[bsets], node_of, ITEMSIZE)
    held = ITEMSIZE * sum(int(counts[s] * degrees[s]) for s in reduce_sets)
    step = calls.finish(sdp_step_bytes(gated=gated, bcast=bcast), round(held / n), ITEMSIZE * T)

    # evaluation (forward masking): each set rank 0 lacks comes from its lowest holder
    senders: dict[int, int] = {}
    if options.sdp_mode != "block-backward":
        held0 = plan.holds(0)
        lacking: dict[int, list[int]] = {}
        for s in range(len(plan.sets)):
            if not held0[s]:
                lacking.setdefault(plan.members(s)[0], []).append(s)
        for r, ss in sorted(lacking.items()):
            size = int(counts[ss].sum()) + sum(int(np.isin(ids, ss).sum())
                                               for ids in plan.buffer_ids.values())
            if size:
                senders[r] = size
    evaluation = None
    if senders:
        ecalls = CallCost(M, P, cost, per_rank=True)
        for r, size in senders.items():
            ecalls.send(ASSEMBLE, ITEMSIZE * size, r, 0)
        evaluation = ecalls.finish(sdp_step_bytes(gated=gated, syncs=0,
                                                  assemble=assemble_bytes(senders, node_of, 0,
                                                                          ITEMSIZE)))
    what = (f"coverage {plan.coverage} (p = {plan.detail['p']} of n = {n} per neuron, "
            f"{plan.detail['masked_layers']} masked layer(s))" if plan.mode == "neuron" else
            f"{plan.detail['b']}/{plan.detail['d']} residual blocks per worker, block degrees "
            f"{plan.detail['block_degrees']} (order from --seed {options.seed})")
    gated_wire = gated[cm.INTRA] + gated[cm.INTER]
    ddp_wire = sum(world_ring_bytes(T, ITEMSIZE, M, P).values())
    notes = [f"--sdp-mode {plan.mode}: {what}; masks of dataparallel.sdp.plan_masks",
             f"{len(reduce_sets)} holder set(s) with >= 2 holders, each one ring all-reduce of "
             f"its coordinates on its own sub-communicator per step (gated average): "
             f"{gated_wire:,} wire bytes"
             + (f" = {gated_wire / ddp_wire:.4f} of DDP's world ring" if ddp_wire else ""),
             "payload / sender: mean bytes a rank feeds into the gated all-reduces"]
    if bcast is not None:
        notes.append(f"B_b-SDP: {len(groups)} binomial broadcast(s) per step of the updated "
                     "parameters from each set's lowest holder to its non-holders")
    if evaluation is not None:
        when = (f"every {options.eval_every} step(s) and after the last" if options.eval_every
                else "after the last step only (--eval-every 0)")
        notes.append(f"evaluation: {len(senders)} rank(s) send rank 0 the parameters and "
                     f"BatchNorm statistics it lacks (one message each), {when}")
    elif plan.mode != "block-backward":
        notes.append("evaluation: rank 0 holds every coordinate, no assembly")
    notes.append(f"--flop-match multiplies the steps by f = {float(plan.flop_factor()):.4f}, not "
                 "a step's traffic: pass --iters accordingly")
    notes.append("modeled time: busiest rank over all phases (ranks sit in different holder "
                 "sets)")
    return Prediction("sdp", spec.name, M, P, "1 step", ((None, step),), notes=tuple(notes),
                      num_params=T, evaluation=evaluation, eval_every=options.eval_every)


register(SystemModel("pactrain", predict_pactrain, PacTrainPredictOptions,
                     description="PacTrain: prune, dense all-reduce until the mask is stable, "
                                 "then packed (or ternary all-gather) survivors"))
register(SystemModel("sdp", predict_sdp, SDPPredictOptions,
                     description="SDP: gated all-reduce of every holder set on its own "
                                 "sub-communicator (+ B_b-SDP bcast, evaluation assembly)"))


# ---------------------------------------------------------------------------------------------
# sparse SGD on RadiX-Nets (H-SGD paper): hypergraph (H-SGD) vs random (SGD) row partitions
# ---------------------------------------------------------------------------------------------
from . import hsgd as _hsgd  # noqa: E402  (hsgd imports the result types above lazily)


def predict_hsgd(spec, nodes, gpus_per_node, options, cost=None) -> Prediction:
    """H-SGD: SpFF/SpBP under the multi-phase hypergraph partition (Mt-KaHyPar)."""
    _check_topology(nodes, gpus_per_node)
    return _hsgd.predict_partitioned(spec, nodes, gpus_per_node, options, cost, "hypergraph")


def predict_sgd(spec, nodes, gpus_per_node, options, cost=None) -> Prediction:
    """SGD: SpFF/SpBP under the uniformly random row partition."""
    _check_topology(nodes, gpus_per_node)
    return _hsgd.predict_partitioned(spec, nodes, gpus_per_node, options, cost, "random")


register(SystemModel("hsgd", predict_hsgd, _hsgd.HSGDPredictOptions, spec_kind="radixnet",
                     description="H-SGD: SpFF/SpBP, hypergraph row partition", baseline="sgd"))
register(SystemModel("sgd", predict_sgd, _hsgd.HSGDPredictOptions, spec_kind="radixnet",
                     description="SGD: SpFF/SpBP, random row partition", baseline=None))


# ---------------------------------------------------------------------------------------------
# data parallel: SSFusion (paper 004)
# ---------------------------------------------------------------------------------------------
#: ``dataparallel.ssfusion.FUSION_MODES`` (literal: ``dataparallel`` imports ``commvol``; a test
#: keeps them equal)
_FUSION_MODES = ("selective", "per-tensor", "multi-tensor")


def _name_list(text):
    """``"a,b c"`` or a sequence of names -> tuple of str (``None`` stays ``None``)."""
    if text is None:
        return None
    items = str(text).replace(",", " ").split() if isinstance(text, str) else list(text)
    return tuple(str(x) for x in items)


def _split_list(text):
    """``--interleave-split``: one integer ``l'_i`` per fusion buffer."""
    return _int_list(text, "--interleave-split",
                     "one integer l'_i per fusion buffer (comma-separated)")


@dataclass(frozen=True)
class SSFusionPredictOptions:
    """Options of the SSFusion model: the strategy's traffic-relevant options (names and
    defaults of :class:`dataparallel.ssfusion.SSFusionOptions`, which validates them) plus the
    selective mode's selection, which a run profiles and a prediction has to assume."""

    density: float = field(default=0.01, metadata={
        "help": "Top-K: fraction of each tensor's entries sent per step"})
    density_floor: float = field(default=0.001, metadata={
        "help": "ssfusion: lowest density the density-aware adjustment may give a tensor"})
    fusion: str = field(default="selective", metadata={
        "help": "ssfusion: selective | per-tensor | multi-tensor sparsification"})
    buffers: int = field(default=4, metadata={
        "help": "ssfusion: number of fusion buffers (equal tensor counts, backward order)"})
    buffer_mib: float = field(default=0.0, metadata={
        "help": "ssfusion: fusion-buffer byte budget in MiB (> 0 overrides --buffers)"})
    profile_steps: int = field(default=5, metadata={
        "help": "ssfusion: dense warm-up steps (selective: profiling, then the selection)"})
    interleave: bool = field(default=True, metadata={
        "help": "ssfusion: all-reduce the dense part, all-gather the sparse part "
                "(disable with --no-interleave)"})
    dense_tensors: tuple | None = field(default=None, metadata={
        "type": _name_list,
        "help": "ssfusion selective: the tensors left dense (comma-separated names, e.g. a "
                "run's summary.json metrics.selection.dense) instead of the eq. 2 rule on "
                "assumed timings"})
    interleave_split: tuple | None = field(default=None, metadata={
        "type": _split_list,
        "help": "ssfusion selective: l'_i per fusion buffer (a run's metrics.selection.split; "
                "with --dense-tensors) instead of the T1+T2 split on assumed timings"})
    selection_from: str = field(default="", metadata={
        "help": "ssfusion selective: a run directory or its summary.json whose recorded "
                "selection (dense tensors and splits) to reproduce"})
    backward_ns: float = field(default=2.0, metadata={
        "help": "ssfusion selective, assumed profile: backward time T_b per parameter in ns "
                "(eq. 2 stand-in for the run's profiled timings)"})
    sparsify_ns: float = field(default=5.0, metadata={
        "help": "ssfusion selective, assumed profile: sparsification time T_sp per parameter "
                "in ns"})

    def __post_init__(self) -> None:
        from dataparallel.ssfusion import SSFusionOptions  # noqa: PLC0415

        for flag, v in (("--buffers", self.buffers), ("--profile-steps", self.profile_steps)):
            if not isinstance(v, (int, np.integer)):
                raise ValueError(f"{flag} takes a whole number, got {v!r}")
        SSFusionOptions(density=self.density, density_floor=self.density_floor,
                        fusion=self.fusion, buffers=self.buffers, buffer_mib=self.buffer_mib,
                        profile_steps=self.profile_steps, interleave=self.interleave)
        for flag, v in (("--backward-ns", self.backward_ns),
                        ("--sparsify-ns", self.sparsify_ns)):
            if not (isinstance(v, (int, float, np.number)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be a finite time >= 0 in ns per parameter, "
                                 f"got {v!r}")
        object.__setattr__(self, "dense_tensors", _name_list(self.dense_tensors))
        object.__setattr__(self, "interleave_split", _split_list(self.interleave_split))
        given = [f for f, v in (("--dense-tensors", self.dense_tensors),
                                ("--interleave-split", self.interleave_split),
                                ("--selection-from", self.selection_from)) if v]
        if given and self.fusion != "selective":
            raise ValueError(f"{', '.join(given)} set(s) the selective mode's selection; use "
                             f"--fusion selective or drop them (got --fusion {self.fusion})")
        if self.selection_from and (self.dense_tensors is not None
                                    or self.interleave_split is not None):
            raise ValueError("--selection-from takes the dense tensors and splits from the run; "
                             "drop --dense-tensors / --interleave-split, or --selection-from")
        if self.interleave_split is not None and self.dense_tensors is None:
            raise ValueError("--interleave-split needs --dense-tensors (the split places the "
                             "dense tensors); pass both, or --selection-from a run")
        if self.interleave_split is not None and not self.interleave and \
                any(self.interleave_split):
            raise ValueError("--no-interleave all-gathers whole buffers (l'_i = 0); drop "
                             "--interleave-split or its non-zero entries")


def _recorded_selection(path: str) -> tuple[dict, list]:
    """``(metrics.selection, metrics.buffer_tensors)`` of a run directory or summary.json."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise ValueError(f"--selection-from {path}: no summary.json there; pass a run directory "
                         "of `dataparallel train --method ssfusion` or its summary.json")
    metrics = json.loads(p.read_text()).get("metrics", {})
    sel = metrics.get("selection")
    if metrics.get("fusion") != "selective" or not isinstance(sel, dict):
        raise ValueError(f"--selection-from {path}: not a finished --fusion selective ssfusion "
                         "run (its summary.json metrics has no selection)")
    return sel, metrics.get("buffer_tensors", [])


def ssfusion_plan(spec, p: int, link: str, options: SSFusionPredictOptions, cost=None) -> dict:
    """SSFusion's fixed per-buffer communication layout for ``spec`` on ``p`` ranks.

    The strategy's pure planning helpers, as it plans: :func:`dataparallel.ssfusion.
    fusion_buffers`; per-tensor / multi-tensor counts of :func:`~dataparallel.ssfusion.
    per_tensor_plan`; selective: the dense tensors and splits given (``--dense-tensors``,
    ``--interleave-split``, ``--selection-from``) or :func:`~dataparallel.ssfusion.
    plan_selective` (eq. 2 and the T1+T2 split, §IV-B/D) on the assumed profile ``T_b^l =
    backward_ns · n_l``, ``T_sp^l = T_cpu^l = sparsify_ns · n_l`` with the α–β times of
    :func:`~dataparallel.ssfusion.alpha_beta_times`; counts of the sparse tensors from
    :func:`commvol.ssfusion.density_aware_counts` (a given dense set that is infeasible at the
    floor raises).

    Returns
    -------
    dict
        ``names, sizes, buffers, buffer_sizes, dense`` (tensor indices), ``split``, ``k`` (per
        tensor, -1 dense) and per buffer ``ar, agd, ks`` (all-reduced, all-gathered dense and
        sparse elements), ``source`` (how the selection was obtained).
    """
    from dataparallel.ssfusion import (alpha_beta_times, fusion_buffers,  # noqa: PLC0415
                                       interleave_split, per_tensor_plan, plan_selective)
    from .ssfusion import density_aware_counts  # noqa: PLC0415

    o = options
    layout = spec.layout
    names = list(layout.names)
    sizes = [int(layout.sizes[n]) for n in names]
    L = len(names)
    buffers = fusion_buffers(sizes, buffers=int(o.buffers),
                             buffer_bytes=int(o.buffer_mib * (1 << 20)), itemsize=ITEMSIZE)
    T_b = o.backward_ns * 1e-9 * np.asarray(sizes, dtype=np.float64)
    T_sp = o.sparsify_ns * 1e-9 * np.asarray(sizes, dtype=np.float64)
    times = alpha_beta_times(cost or CostModel(), p, link)
    dense_names, split, source = o.dense_tensors, o.interleave_split, "given"
    if o.selection_from:
        sel, recorded_buffers = _recorded_selection(o.selection_from)
        mine = [names[t0:t1] for t0, t1 in buffers]
        if recorded_buffers and [list(b) for b in recorded_buffers] != mine:
            raise ValueError(f"--selection-from {o.selection_from}: the run's fusion buffers "
                             f"{recorded_buffers} differ from {mine}; pass the run's --model, "
                             "--buffers / --buffer-mib")
        dense_names, split = tuple(sel["dense"]), tuple(int(v) for v in sel["split"])
        source = f"recorded by the run ({o.selection_from})"
    if o.fusion != "selective":
        k = list(per_tensor_plan(sizes, buffers, o.density).k)
        split, source = [0] * len(buffers), f"--fusion {o.fusion}: every tensor sparse"
    elif dense_names is None:
        plan = plan_selective(sizes, buffers, T_b, T_sp, T_sp, density=o.density,
                              density_floor=o.density_floor, comm_times=times,
                              interleave=o.interleave)
        k, split = list(plan.k), list(plan.split)
        source = (f"eq. 2 rule on an assumed profile (T_b = {o.backward_ns:g} ns, T_sp = "
                  f"{o.sparsify_ns:g} ns per parameter) and the alpha-beta model")
    else:
        index = {n: i for i, n in enumerate(names)}
        unknown = [n for n in dense_names if n not in index]
        if unknown:
            raise ValueError(f"--dense-tensors: {unknown} are not tensors of model "
                             f"{spec.name!r}; its tensors are {names}")
        if split is not None and (len(split) != len(buffers) or any(
                not 0 <= lp <= t1 - t0 for lp, (t0, t1) in zip(split, buffers))):
            raise ValueError(f"--interleave-split {list(split)} needs one l'_i in 0..n_i per "
                             f"fusion buffer (tensors per buffer: "
                             f"{[t1 - t0 for t0, t1 in buffers]})")
        dense = {index[n] for n in dense_names}
        k, lps = [0] * L, []
        for i, (t0, t1) in enumerate(buffers):
            sz = sizes[t0:t1]
            d = {l - t0 for l in dense if t0 <= l < t1}
            kb = density_aware_counts(sz, d, o.density, o.density_floor)
            if split is not None:
                lps.append(split[i])
            elif o.interleave:
                lps.append(interleave_split(sz, d, kb, T_b[t0:t1], T_sp[t0:t1], times)[0])
            else:
                lps.append(0)
            for j in range(t1 - t0):
                k[t0 + j] = -1 if j in d else kb[j]
        if split is None and o.interleave:
            source += (f"; splits l'_i by the T1+T2 rule on an assumed profile (T_b = "
                       f"{o.backward_ns:g} ns, T_sp = {o.sparsify_ns:g} ns per parameter)")
        split = lps
        if o.selection_from and {nm: kk for nm, kk in sel.get("k", {}).items()} != \
                {names[l]: k[l] for l in range(L) if k[l] >= 0}:
            raise ValueError(f"--selection-from {o.selection_from}: the run's counts "
                             f"{sel.get('k')} differ from density-aware ones; pass the run's "
                             "--density and --density-floor")
    ar, agd, ks = [], [], []
    for i, (t0, t1) in enumerate(buffers):
        ar.append(sum(sizes[l] for l in range(t0, t1) if k[l] < 0 and l - t0 < split[i]))
        agd.append(sum(sizes[l] for l in range(t0, t1) if k[l] < 0 and l - t0 >= split[i]))
        ks.append(sum(k[l] for l in range(t0, t1) if k[l] >= 0))
    return {"names": names, "sizes": sizes, "buffers": buffers,
            "buffer_sizes": [sum(sizes[t0:t1]) for t0, t1 in buffers],
            "dense": [l for l in range(L) if k[l] < 0], "split": list(split), "k": k,
            "ar": ar, "agd": agd, "ks": ks, "source": source}


def predict_ssfusion(spec, nodes, gpus_per_node, options: SSFusionPredictOptions,
                     cost=None) -> Prediction:
    """SSFusion: ``--profile-steps`` dense steps (a ring all-reduce per fusion buffer,
    :func:`commvol.ssfusion.warmup_step_bytes`), selective only: the one-off profile MAX
    all-reduce and plan broadcast at the end of warm-up (:func:`commvol.ssfusion.
    selection_bytes`), then per buffer the all-reduce of ``Buffer_AR`` and the all-gather of
    ``Buffer_AG`` (:func:`commvol.ssfusion.sparse_step_bytes`) with the layout of
    :func:`ssfusion_plan`."""
    from . import ssfusion as cv  # noqa: PLC0415

    _check_topology(nodes, gpus_per_node)
    M, P = int(nodes), int(gpus_per_node)
    o = options
    link = cm.INTER if M > 1 else cm.INTRA
    plan = ssfusion_plan(spec, M * P, link, o, cost)
    T, L, NB = spec.layout.total, len(plan["names"]), len(plan["buffers"])
    dense_payload = ITEMSIZE * T

    def warm(select: bool) -> IterCost:
        phases = cv.warmup_step_bytes(M=M, P=P, buffer_sizes=plan["buffer_sizes"],
                                      itemsize=ITEMSIZE)
        calls = CallCost(M, P, cost)
        for n in plan["buffer_sizes"]:
            calls.allreduce(cv.WARMUP, ITEMSIZE * n, "world")
        if select:
            phases.update(cv.selection_bytes(M=M, P=P, num_tensors=L, num_buffers=NB))
            calls.allreduce(cv.PROFILE, 8 * cv.profile_length(L), "world")
            calls.bcast(cv.SELECT, 8 * cv.plan_length(L, NB), "world")
        return calls.finish(phases, dense_payload, dense_payload)

    ar, agd, ks = plan["ar"], plan["agd"], plan["ks"]
    calls = CallCost(M, P, cost)
    for n_ar, n_agd, k in zip(ar, agd, ks):
        if n_ar:
            calls.allreduce(cv.DENSE, ITEMSIZE * n_ar, "world")
        if n_agd + k:
            calls.allgather(cv.SPARSE, ITEMSIZE * n_agd + 8 * k, "world")
    ratio = cv.payload_ratio(T, ar, agd, ks)
    sparse = calls.finish(cv.sparse_step_bytes(M=M, P=P, ar_counts=ar, ag_dense_counts=agd,
                                               ag_sparse_counts=ks),
                          round(ratio * dense_payload), dense_payload)
    w = int(o.profile_steps)
    if o.fusion == "selective":
        stages = [(w - 1, warm(False)), (1, warm(True)), (None, sparse)]
    else:
        stages = [(w, warm(False)), (None, sparse)]
    stages = [(c, s) for c, s in stages if c != 0]
    names = plan["names"]
    dense = [names[l] for l in plan["dense"]]
    notes = [f"{NB} fusion buffer(s) of {[t1 - t0 for t0, t1 in plan['buffers']]} tensors "
             f"({plan['buffer_sizes']} elements; "
             + (f"--buffer-mib {o.buffer_mib:g})" if o.buffer_mib > 0 else
                f"--buffers {o.buffers})"),
             f"steps 0..{w - 1}: dense ring all-reduce (avg) of every buffer (--profile-steps "
             f"{w})" if w else "no warm-up step (--profile-steps 0)",
             f"from step {w}: per buffer a ring all-reduce of Buffer_AR ({ar} elements) and a "
             f"ring all-gather of Buffer_AG ({agd} dense float32 + {ks} sparse float32 values "
             f"with int32 indices per rank); payload ratio {ratio:.4f} of dense",
             f"selection: {plan['source']}"]
    if o.fusion == "selective":
        notes += [f"dense tensors {dense or 'none'}, splits l'_i = {plan['split']}; the sparse "
                  f"ones sent at density-aware counts (--density {o.density:g}, "
                  f"--density-floor {o.density_floor:g}: every buffer sends K_i = "
                  f"sum ceil(d n_l) elements)",
                  f"step {w - 1}: + MAX all-reduce of the {cv.profile_length(L)} float64 "
                  f"timings and binomial broadcast of the {cv.plan_length(L, NB)} int64 plan",
                  "the run's selection follows its profiled timings (not predictable): pass "
                  "--selection-from RUN (or --dense-tensors and --interleave-split from its "
                  "summary.json metrics.selection) to reproduce it; --offload, "
                  "--sample-ratio and --no-error-feedback do not change the traffic"]
    elif o.fusion == "multi-tensor":
        notes.append("multi-tensor: one top-K_i per buffer, the same bytes as per-tensor")
    return Prediction("ssfusion", spec.name, M, P, "1 step", tuple(stages), notes=tuple(notes),
                      num_params=T)


register(SystemModel("ssfusion", predict_ssfusion, SSFusionPredictOptions,
                     description="SSFusion: fusion buffers, selective sparsification, "
                                 "all-reduce of the dense part + all-gather of the sparse part"))
