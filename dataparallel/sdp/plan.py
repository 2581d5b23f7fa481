"""SDP's one plan (paper 003): the holder sets of every coordinate and everything a run
communicates, fixed before the first step, and the call records of a step
(:meth:`SDPPlan.calls`) that ``commvol`` prices, and every rank's records of a step from which
its step program is generated (:meth:`SDPPlan.records`).

Built without MPI by :meth:`SDPPlan.for_model` / :func:`plan_masks` from the model's layers
(:mod:`dataparallel.sdp.masks`), the world size and the options.  The records are held against
:mod:`volume.sdp`'s closed forms written from the paper (``tests/dataparallel/test_sdp_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

from models import BatchNorm2d
from substrate.calls import Call, Placement, Ready, Work

from ..program import UPDATED
from .masks import (
    _members,
    _popcount,
    _SetTable,
    _tensor_ids,
    masked_groups,
    neuron_groups,
    residual_blocks,
    window_sets,
)
from .options import SDP_MODES, SDPOptions, parse_active_blocks, parse_fraction

__all__ = ["ASSEMBLE", "BCAST", "GATED", "SDPPlan", "plan_masks"]

#: ledger phases of SDP's calls
GATED = "sdp_gated_allreduce"
BCAST = "sdp_param_bcast"
ASSEMBLE = "sdp_assemble"


@dataclass(frozen=True, eq=False)
class SDPPlan:
    """Everything one SDP run communicates, fixed before the first step (same on every rank).

    Built by :meth:`for_model` (or :func:`plan_masks`) without MPI; the strategy executes it
    and ``commvol``'s SDP model predicts from it.

    Attributes
    ----------
    n : int
        Workers.
    mode : str
        ``neuron``, ``block`` or ``block-backward``.
    sets : tuple of int
        Distinct holder sets as bitmasks over the ranks (``sets[0]``: all ranks).
    set_id : numpy.ndarray (T,) int32
        Holder set of every flat coordinate: ``m_ij = 1`` iff bit ``i`` of ``sets[set_id[j]]``.
    buffer_ids : dict of str -> numpy.ndarray
        Holder set of every BatchNorm running-statistic entry (follows its channel/block).
    scale : numpy.ndarray (T,) float64
        Weight-scaling factor of every coordinate (used only with ``--eval-rescale``; a
        read-only broadcast 1.0 when no factor differs from 1).
    coverage : Fraction
        Nominal coverage: ``p/n`` (neuron) or ``b/d`` (block modes); the realized one is
        :attr:`coverage_realized`.
    detail : dict
        ``p`` or ``b``/``d``, the masked groups or blocks (for the report).
    ranks_per_node : int
        Ranks per node of the prediction's node-major topology (:attr:`placement`).
    """

    n: int
    mode: str
    sets: tuple
    set_id: np.ndarray
    buffer_ids: dict
    scale: np.ndarray
    coverage: Fraction
    detail: dict
    ranks_per_node: int = 0

    @classmethod
    def for_model(cls, model, nodes: int, ranks_per_node: int, options: SDPOptions,
                  seed: int = 0) -> SDPPlan:
        """The plan of ``options`` for ``model``'s layers on ``nodes`` x ``ranks_per_node``
        workers (the one planning entry point of the run and of the prediction)."""
        for what, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"SDP plan: {what} must be a positive integer, got {v!r}")
        return plan_masks(model, options.sdp_mode, int(nodes) * int(ranks_per_node),
                          coverage=parse_fraction(options.coverage, "--coverage"),
                          active_blocks=parse_active_blocks(options.active_blocks),
                          seed=int(seed), ranks_per_node=int(ranks_per_node))

    # -- the mask --------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return int(self.set_id.size)

    @property
    def placement(self) -> Placement:
        """The prediction's node-major placement (``ranks_per_node`` consecutive ranks per
        node)."""
        rpn = self.ranks_per_node or self.n
        return Placement.node_major(self.n // rpn, rpn)

    @cached_property
    def _runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, ends, ids)`` of the runs of equal holder sets along the flat buffer
        (a mask follows tensors and rows: a 134 M-parameter model has a few hundred runs, and
        summing them is ~10x faster than counting 10^8 ids one by one)."""
        ids = self.set_id
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1]))) if ids.size \
            else np.zeros(0, dtype=np.int64)
        ends = np.concatenate((starts[1:], [ids.size])).astype(np.int64)
        return starts, ends, ids[starts]

    @cached_property
    def counts(self) -> np.ndarray:
        """Coordinates of each holder set."""
        starts, ends, run_ids = self._runs
        return np.bincount(run_ids, weights=ends - starts,
                           minlength=len(self.sets)).astype(np.int64)

    @cached_property
    def degrees(self) -> np.ndarray:
        """``d`` of each holder set (``|H|``)."""
        return np.array([_popcount(s) for s in self.sets], dtype=np.int64)

    def members(self, s: int) -> list[int]:
        """World ranks of holder set ``s`` (ascending)."""
        return _members(self.sets[s])

    def holds(self, rank: int) -> np.ndarray:
        """Boolean per holder set: does ``rank`` hold it."""
        return np.array([bool(s >> rank & 1) for s in self.sets])

    def mask(self, rank: int) -> np.ndarray:
        """Row ``rank`` of the mask matrix ``m`` (bool, length T)."""
        return self.holds(rank)[self.set_id]

    def held(self, rank: int) -> int:
        """``Σ_j m_rank,j``: coordinates in ``rank``'s subnetwork."""
        return int(self.counts[self.holds(rank)].sum())

    def distinct_mask(self) -> np.ndarray:
        """The ``n × k`` matrix of the distinct columns of ``m`` (holder sets with coordinates)."""
        used = [s for s, c in enumerate(self.counts) if c > 0]
        return np.array([[bool(self.sets[s] >> i & 1) for s in used] for i in range(self.n)])

    def degree_histogram(self) -> dict[int, int]:
        """``{d: coordinates with degree d}`` (paper §3.1: ``d_j = Σ_i m_ij``)."""
        out: dict[int, int] = {}
        for d, c in zip(self.degrees.tolist(), self.counts.tolist()):
            if c:
                out[d] = out.get(d, 0) + c
        return dict(sorted(out.items()))

    @property
    def coverage_realized(self) -> Fraction:
        """``Σ_j d_j / (n |J|)``: the mean fraction of workers holding a coordinate."""
        return Fraction(int((self.counts * self.degrees).sum()), self.n * self.total)

    def flop_factor(self) -> Fraction:
        """FLOP-matching step multiplier (paper §4.1.1): ``T / N_active`` for forward masking
        (``N_active`` = mean coordinates per worker), ``3 / (1 + 2 A)`` for backward masking
        (``A = N_active / T``: full forward, backward on the active part only)."""
        active_sum = int((self.counts * self.degrees).sum())  # Σ_i N_active,i
        T, n = self.total, self.n
        if self.mode == "block-backward":
            return Fraction(3 * T * n, T * n + 2 * active_sum)
        return Fraction(T * n, active_sum)

    # -- the communication -----------------------------------------------------------------------
    @cached_property
    def reduce_sets(self) -> tuple[int, ...]:
        """Holder sets all-reduced each step (``>= 2`` holders, ``>= 1`` coordinate); each has
        its own sub-communicator of :meth:`members`."""
        return tuple(s for s in range(len(self.sets))
                     if self.counts[s] > 0 and self.degrees[s] >= 2)

    def indices(self, s: int) -> np.ndarray:
        """Flat coordinates of holder set ``s`` (ascending)."""
        return np.flatnonzero(self.set_id == s)

    @cached_property
    def bcast_groups(self) -> tuple[tuple[int, tuple[int, ...], int], ...]:
        """B_b-SDP: ``(set, ranks, root)`` per holder set some rank lacks: the set's lowest
        holder (``root``) broadcasts its updated parameters over ``{root} ∪ non-holders``."""
        if self.mode != "block-backward":
            return ()
        out = []
        for s in range(len(self.sets)):
            if self.counts[s] > 0 and self.degrees[s] < self.n:
                mem = self.members(s)
                ranks = tuple(sorted({mem[0]} | (set(range(self.n)) - set(mem))))
                out.append((s, ranks, mem[0]))
        return tuple(out)

    @cached_property
    def assemble_sets(self) -> dict[int, tuple[int, ...]]:
        """Forward masking: ``{sender: holder sets}`` of what rank 0 lacks for evaluation, each
        set sent by its lowest holder (one message per sender)."""
        if self.mode == "block-backward":
            return {}
        held0 = self.holds(0)
        out: dict[int, list[int]] = {}
        for s in range(len(self.sets)):
            if not held0[s]:
                out.setdefault(self.members(s)[0], []).append(s)
        return {r: tuple(ss) for r, ss in sorted(out.items())}

    @cached_property
    def assemble_counts(self) -> dict[int, int]:
        """Elements (parameters + BatchNorm statistics) each sender of :attr:`assemble_sets`
        sends rank 0 (senders with nothing to send left out)."""
        out = {}
        for r, ss in self.assemble_sets.items():
            size = int(self.counts[list(ss)].sum()) + sum(
                int(np.isin(ids, ss).sum()) for ids in self.buffer_ids.values())
            if size:
                out[r] = size
        return out

    @cached_property
    def spans(self) -> dict[int, tuple[int, int]]:
        """``{set: (lo, hi)}``: the flat range ``[lo, hi)`` from the first to the last
        coordinate of each holder set with coordinates (its gradients are all written once the
        backward wrote ``flat[lo:hi]``)."""
        starts, ends, run_ids = self._runs
        out: dict[int, tuple[int, int]] = {}
        for s, a, b in zip(run_ids.tolist(), starts.tolist(), ends.tolist()):
            lo, hi = out.get(s, (a, b))
            out[s] = (min(lo, a), max(hi, b))
        return out

    def calls(self, placement: Placement, itemsize: int = 4, *, refresh: bool | None = None,
              assemble: bool = False) -> list[Call]:
        """The records of one step on ``placement`` (``n`` world ranks; any nodes), in the
        order every rank executes its part of them.

        * the gated average: per holder set of :attr:`reduce_sets`, a SUM ring all-reduce of
          its ``n_H`` coordinates over its members (a sub-communicator, ranks ascending; all
          ranks: the world), after the backward wrote the set's span (:attr:`spans`), on the
          communication stream;
        * ``refresh`` (default: B_b-SDP): per group of :attr:`bcast_groups`, a binomial
          broadcast of the set's updated parameters from its lowest holder over
          ``{root} ∪ non-holders``;
        * ``assemble``: the evaluation's assembly (:meth:`assembly_calls`).

        Every rank runs its calls in this order, so a record also waits for the previous
        record of each of its members (``after`` indices): calls on disjoint groups overlap,
        calls that share a rank do not.
        """
        return self._records(placement, itemsize, refresh, assemble, None)

    def records(self, placement: Placement, rank: int, itemsize: int = 4, *,
                evaluate: bool = False) -> list:
        """World rank ``rank``'s records of a step (:meth:`SDP.records <dataparallel.sdp.SDP.
        records>`): :meth:`calls`'s calls in the same order (the broadcasts of B_b-SDP, and the
        assembly when rank 0 ``evaluate`` s after the step, after the update:
        :data:`dataparallel.program.UPDATED`), with this rank's compute items
        (:class:`~substrate.calls.Work`): ``sdp_pack[j]`` gathers its coordinates of the
        ``j``-th holder set of :attr:`reduce_sets` it holds before the set's all-reduce,
        ``sdp_unpack[j]`` divides the sum by the set's degree and scatters it back after the
        backward, ``sdp_mask`` zeroes the gradient outside the subnetwork after every unpack,
        and on rank 0 ``sdp_assemble`` puts the BatchNorm statistics it received in place."""
        return self._records(placement, itemsize, None, evaluate and bool(self.assemble_counts),
                             int(rank))

    def _records(self, placement: Placement, itemsize: int, refresh, assemble: bool,
                 rank: int | None) -> list:
        if placement.size != self.n:
            raise ValueError(f"SDP plan of {self.n} workers on a placement of {placement.size} "
                             "ranks")
        w = int(itemsize)
        refresh = self.mode == "block-backward" if refresh is None else refresh
        work = rank is not None
        out: list = []
        last: dict[int, int] = {}                    # each rank's latest record

        def add(call: Call, ranks) -> None:
            for r in ranks:
                last[r] = len(out)
            out.append(call)

        def before(ranks) -> tuple:
            return tuple(sorted({last[r] for r in ranks if r in last}))

        mine = []                                    # (j, its call) of the sets rank holds
        for j, s in enumerate(self.reduce_sets):
            ranks = tuple(self.members(s))
            lo, hi = self.spans[s]
            n = int(self.counts[s])
            after = (Ready(lo, hi), *before(ranks))
            if work and rank in ranks:
                out.append(Work(f"sdp_pack[{j}]", nbytes=(2 * w + 8) * n,
                                after=(Ready(lo, hi),)))
                after = (*after, len(out) - 1)
            add(Call(GATED, "allreduce", ranks, w * n, w, op="sum", after=after,
                     label=f"{GATED}[{j}]", wait=False), ranks)
            if work and rank in ranks:
                mine.append((j, len(out) - 1))
        updated: tuple = ()
        if work:
            unpacks = []
            for j, i in mine:
                n = int(self.counts[self.reduce_sets[j]])
                out.append(Work(f"sdp_unpack[{j}]", nbytes=(3 * w + 8) * n, after=(i,)))
                unpacks.append(len(out) - 1)
            out.append(Work("sdp_mask", nbytes=3 * w * self.total,
                            after=(Ready(0, self.total), *unpacks)))
            updated = (UPDATED,)
        if refresh:
            for b, (s, ranks, root) in enumerate(self.bcast_groups):
                add(Call(BCAST, "bcast", ranks, w * int(self.counts[s]), w,
                         root=ranks.index(root), after=(*updated, *before(ranks)),
                         label=f"{BCAST}[{b}]"), ranks)
        if assemble:
            for c in self.assembly_calls(placement, w):
                out.append(Call(c.phase, c.algorithm, c.group, pairs=c.pairs, label=c.label,
                                after=(*updated, *before(c.pairs[:, 0].tolist()))))
                if work and rank == 0:
                    out.append(Work("sdp_assemble", after=(len(out) - 1,)))
        return out

    def assembly_calls(self, placement: Placement, itemsize: int = 4) -> list[Call]:
        """The evaluation's assembly on rank 0 (forward masking): one message per sender of
        :attr:`assemble_counts` (its sets' parameters and BatchNorm statistics) to rank 0, a
        ``p2p`` record over the world communicator; none without senders."""
        if not self.assemble_counts:
            return []
        pairs = [(r, 0, int(itemsize) * c) for r, c in sorted(self.assemble_counts.items())]
        return [Call(ASSEMBLE, "p2p", placement.world, pairs=pairs)]



def _check_connected(plan: SDPPlan, coverage: Fraction) -> None:
    """The worker-coordinate graph must be connected (paper §3.1, needed for convergence)."""
    comp = list(range(plan.n))

    def find(x):
        while comp[x] != x:
            comp[x] = comp[comp[x]]
            x = comp[x]
        return x

    for s in range(len(plan.sets)):
        if plan.counts[s]:
            ms = plan.members(s)
            for r in ms[1:]:
                comp[find(r)] = find(ms[0])
    if len({find(r) for r in range(plan.n)}) > 1:
        raise ValueError(f"--coverage {coverage} on {plan.n} workers: no parameter is shared "
                         f"between some workers' subnetworks, so the workers never agree "
                         f"(paper §3.1 assumes a connected mask); raise p in --coverage p/"
                         f"{plan.n}")


def plan_masks(model, mode: str, n: int, *, coverage: Fraction,
               active_blocks: tuple[int, int | None] | None = None, seed: int = 0,
               ranks_per_node: int | None = None) -> SDPPlan:
    """Build the mask of ``model`` for ``n`` workers (pure, identical on every rank).

    Parameters
    ----------
    model : models.Model
        Its layer tree (``model.root``), layout and buffers; no parameter value is read.
    mode : {"neuron", "block", "block-backward"}
    n : int
        Workers (world size).
    coverage : Fraction
        ``C``: neuron mode holds every masked parameter on ``p = C n`` workers; block modes
        default to ``b = round(C d)`` when ``active_blocks`` is None.
    active_blocks : (b, d or None), optional
        Blocks per worker (``d`` must equal the model's residual blocks when given).
    seed : int
        Run seed (permutes the block order; the neuron assignment is deterministic).
    ranks_per_node : int, optional
        Node-major topology of the plan's :attr:`SDPPlan.placement` (default: one node).

    Raises
    ------
    ValueError
        When the mask cannot give every coordinate a holder or does not fit the model.
    """
    if mode not in SDP_MODES:
        raise ValueError(f"--sdp-mode {mode!r} unknown; use one of {SDP_MODES}")
    rpn = n if ranks_per_node is None else int(ranks_per_node)
    if rpn < 1 or n % rpn:
        raise ValueError(f"SDP plan: {n} workers are not whole nodes of {rpn} ranks")
    layout = model.layout
    table = _SetTable(n)
    set_id = np.zeros(layout.total, dtype=np.int32)
    #: written only where a factor is not 1 (a transformer's block masks write none: its 10^8
    #: coordinates then share one read-only 1.0 instead of a GB of ones)
    scale_at: dict[str, np.ndarray] = {}
    buffer_ids = {name: np.zeros(buf.shape[0], dtype=np.int32)
                  for name, buf in model.buffers.items()}
    if mode == "neuron":
        pn = coverage * n
        if pn.denominator != 1:
            raise ValueError(f"--coverage {coverage} on {n} workers gives p = {float(pn):g} "
                             f"workers per parameter; p must be an integer: use --coverage "
                             f"p/{n}")
        p = int(pn)
        chains = neuron_groups(model)
        if not chains:
            raise ValueError(f"model {model.name!r} has no hidden layer to mask; use a model with "
                             f"hidden layers (cnn, mlp with --arch hidden=N, resnet)")
        sizes = layout.sizes
        chosen = [masked_groups(chain, sizes) for chain in chains]
        family = window_sets(n, p)
        rows: dict[str, list[int]] = {}
        cols: dict[str, tuple[list[int], int]] = {}
        buf_rows: dict[str, list[int]] = {}
        for groups in chosen:
            for g in groups:
                chunk = np.repeat(np.arange(n), [len(c) for c in
                                                 np.array_split(np.arange(g.width), n)])
                bits = [family[c] for c in chunk]
                for name in g.rows:
                    rows[name] = bits
                for name, rep in g.cols:
                    cols[name] = (bits, rep)
                for name in g.buffers:
                    buf_rows[name] = bits
        for name in layout.names:
            if name not in rows and name not in cols:
                continue
            shape = layout.shape(name)
            cbits, rep = cols.get(name, (None, 1))
            ids, sc = _tensor_ids(table, shape, rows.get(name), cbits, rep)
            sl = layout.slice(name)
            set_id[sl] = ids.reshape(-1)
            scale_at[name] = sc.reshape(-1)
        for name, bits in buf_rows.items():
            buffer_ids[name] = _tensor_ids(table, (len(bits),), bits, None, 1)[0]
        detail = {"p": p, "n": n, "masked_layers": sum(len(g) for g in chosen),
                  "hidden_layers": sum(len(c) for c in chains),
                  "masked": [g.rows[0].rsplit(".", 1)[0] for gs in chosen for g in gs]}
        cov = Fraction(p, n)
    else:
        blocks = residual_blocks(model)
        if not blocks:
            raise ValueError(f"--sdp-mode {mode} drops residual blocks, but model "
                             f"{model.name!r} has none; use --model resnet or --sdp-mode neuron")
        d = len(blocks)
        if active_blocks is None:
            b = max(1, min(d, round(coverage * d)))
        else:
            b, d_given = active_blocks
            if d_given is not None and d_given != d:
                raise ValueError(f"--active-blocks {b}/{d_given}: model {model.name!r} has "
                                 f"d = {d} residual blocks; use --active-blocks b/{d}")
            if b > d:
                raise ValueError(f"--active-blocks {b}: the model has only d = {d} residual "
                                 f"blocks; use 1 <= b <= {d}")
        if n * b < d:
            raise ValueError(f"--active-blocks {b}/{d} on {n} workers leaves blocks without a "
                             f"holder (n b = {n * b} < d = {d}); use b >= {-(-d // n)}")
        order = np.random.default_rng([seed, 0x5D9]).permutation(d)
        holders = [0] * d
        for i in range(n):
            for k in range(b):
                holders[int(order[(i * b + k) % d])] |= 1 << i
        for (prefix, blk), bits in zip(blocks, holders):
            sid = table.get(bits)
            main = [(f"{prefix}{name}.", layer) for name, layer in blk.children()
                    if name != "shortcut"]
            skip = prefix + "shortcut."
            for name in layout.names:
                if name.startswith(prefix) and not name.startswith(skip):
                    set_id[layout.slice(name)] = sid
            for name, ids in buffer_ids.items():
                if name.startswith(prefix) and not name.startswith(skip):
                    ids[:] = sid
            last_bn = [pm for pm, layer in main if isinstance(layer, BatchNorm2d)][-1:]
            for pm in last_bn:  # stochastic depth: the block's output times its survival rate
                for local in ("weight", "bias"):
                    scale_at[pm + local] = np.full(layout.sizes[pm + local],
                                                   _popcount(bits) / n)
        detail = {"b": b, "d": d, "block_degrees": [_popcount(h) for h in holders],
                  "blocks": [p[:-1] for p, _ in blocks]}
        cov = Fraction(b, d)
        detail["order"] = [int(k) for k in order]
    if scale_at:
        scale = np.ones(layout.total, dtype=np.float64)
        for name, sc in scale_at.items():
            scale[layout.slice(name)] = sc
    else:
        scale = np.broadcast_to(np.float64(1.0), (layout.total,))
    plan = SDPPlan(n=n, mode=mode, sets=tuple(table.sets), set_id=set_id,
                   buffer_ids=buffer_ids, scale=scale, coverage=cov, detail=detail,
                   ranks_per_node=rpn)
    _check_connected(plan, cov)
    return plan
