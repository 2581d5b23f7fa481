"""SDP: subnetwork data parallelism with fixed masks and gated averaging (paper 003).

A fixed assignment mask ``m ∈ {0,1}^{n×|J|}`` (eq. "gate") puts every coordinate ``j`` of the
flat parameter vector on the ``d_j = Σ_i m_ij >= 1`` workers that *hold* it.  Worker ``i`` trains
its subnetwork; every step the gradients are combined by the gated average (eq. "average")

    ĝ_j = (1 / d_j) Σ_i m_ij g_ij ,

computed by reducing each coordinate only among its holders: coordinates are grouped by holder
set ``H`` (a bitmask over the ranks), each distinct set with ``|H| >= 2`` and at least one
coordinate gets one sub-communicator (built once, ``Comm.sub``) and one contiguous buffer
(planned once), all-reduced with SUM and divided by ``|H|``; a singleton set needs no message.
Coordinates outside every structured mask (stem, shortcut, classifier, normalisation of the
residual stream) are held by all ranks: a world all-reduce.

Everything a run communicates is decided once, without MPI, by :meth:`SDPPlan.for_model`
(model layers, nodes, ranks per node, :class:`SDPOptions`, seed): holder sets and their index
sets, the sub-communicators' member sets, B_b-SDP's broadcast roots and the evaluation senders.
The strategy executes that plan and ``commvol``'s SDP model predicts from the same plan; the
bytes are checked against :mod:`volume.sdp`'s closed forms written from the paper's coverage
and layer shapes (``tests/test_sdp_plan.py``).

Masks (identical on every rank: deterministic cyclic assignment, block order from the run seed):

``--sdp-mode neuron`` (N-SDP, forward masking, §3.2)
    Every masked parameter lives on exactly ``p`` of the ``n`` workers (``--coverage p/n``, the
    paper's §4 definition "for every parameter θ_j ... exactly p of the n workers participate").
    A masked layer's neurons / channels are cut into ``n`` contiguous chunks and chunk ``c``
    goes to the *window* ``{c, ..., c+p-1} mod n``; the layer's output rows (weight, bias,
    BatchNorm) and the next layer's input columns are masked together (§3.2: "dropping outputs
    of layer l naturally removes the corresponding inputs of layer l+1"), so both carry the
    neuron's ``p`` holders.  A weight between two masked layers would be held by the
    *intersection* of two holder sets, which has fewer than ``p`` members unless the sets are
    equal, so masked layers are never adjacent: the paper's construction masks pairs
    ``(W^l, W^{l+1})`` (its example, and the inner channels of a residual block or an MLP
    block).  On a plain chain the masked hidden layers are the non-adjacent set holding the most
    parameters (dynamic programming over the chain; the digits CNN masks conv1 and fc1, the
    conv2 channels stay on all workers); in a ResNet each block's inner channels (the residual
    stream is never masked).  Everything else is held by all ``n``.  ``summary.json`` reports
    the degree histogram and the realized coverage ``Σ_j d_j / (n |J|)``.
``--sdp-mode block`` (B-SDP, forward masking, eq. 4)
    Each worker keeps ``b`` of the ``d`` residual blocks (``--active-blocks b/d``): the blocks,
    in an order permuted by the run seed, are dealt cyclically, worker ``i`` taking slots
    ``i b, ..., i b + b - 1 (mod d)`` (block degrees ``floor`` / ``ceil`` of ``n b / d``).  A
    dropped block's main branch is zero, so the block computes its shortcut only
    (``m B(x) + x``; a projection shortcut is kept and held by all).
``--sdp-mode block-backward`` (B_b-SDP, backward masking, §3.1)
    The same block mask, but the forward pass uses the full model (``m_fwd = m_uni``): only the
    gradients, their reduction and the optimizer state are masked.  Since non-holders never
    update a parameter but run it forward, after each step the lowest-ranked holder of every
    set broadcasts the updated parameters to the non-holders (phase ``sdp_param_bcast``), so
    ``θ`` stays one global vector as in the paper's update ``θ ← θ − OptUpdate(ĝ)``.

Forward masking zeroes a worker's parameters outside its subnetwork; backward masking (all
modes) masks the update and freezes the momentum outside (:class:`models.MaskHook`).  Holders of
a coordinate apply identical updates, so they stay identical; the full model is assembled for
evaluation from any holder (the lowest rank of each set sends what rank 0 lacks, at evaluation
steps only, phase ``sdp_assemble``) and evaluated as assembled, as in the paper.  Not in the
paper, off by default: ``--eval-rescale`` multiplies it by the dropout / stochastic-depth
weight-scaling rule: weight ``W[j, k]`` by the fraction ``|H_j ∩ H_k| / |H_j|`` of the workers
running neuron ``j`` that also run input ``k`` (``p / n`` on the inputs from a masked layer), a
block's output (its last BatchNorm's scale and shift) by ``d_block / n``.

Reported (:meth:`SDP.report`): the degree histogram and realized coverage, per-worker memory of
parameters + gradients + momentum against DDP's ``(2 + 1) · 4 T`` bytes, the spectral gap ρ of
eq. (1) from the mask matrix, the bytes a step puts on the wire against DDP's
(``payload_ratio``: gated all-reduces plus B_b-SDP's broadcasts), and the FLOP-matching factor
``f``.  ``--flop-match`` makes the run ``floor(f · B)`` steps for the trainer's budget of ``B``
steps (:meth:`SDP.total_steps`; §4.1.1: "scaling training epochs inversely with the number of
active parameters", ``f = T / mean_i N_i`` with the exact per-worker counts; for B_b-SDP
``f = 3 / (1 + 2 A)``, ``A = mean_i N_i / T``, the backward costing twice the forward),
continuing the same data stream with the trainer's constant learning rate.  Memory is
accounted, not allocated: the simulator keeps full-length flat vectors on every rank and zeroes
(forward) or freezes (backward) what a worker does not hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

from models import (
    BasicBlock,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    Flatten,
    Linear,
    MaskHook,
    MaxPool2d,
    ReLU,
    Sequential,
)
from models.transformer import TransformerBlock
from substrate.options import option
from volume.dataparallel import world_ring_bytes
from volume.sdp import assemble_bytes, gated_allreduce_bytes, param_bcast_bytes, sdp_step_bytes

from .strategy import Strategy, register

__all__ = ["SDP_MODES", "SDPOptions", "SDPPlan", "SDP", "parse_fraction", "parse_active_blocks",
           "window_sets", "neuron_groups", "masked_groups", "residual_blocks", "plan_masks",
           "worker_memory", "spectral_gap"]

SDP_MODES = ("neuron", "block", "block-backward")


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------
def parse_fraction(text, flag: str = "--coverage") -> Fraction:
    """``"p/n"`` (positive integers) or a decimal fraction, as an exact :class:`Fraction`
    in ``(0, 1]``; anything else raises ``ValueError`` naming ``flag``."""
    s = str(text).strip()
    try:
        if "/" in s:
            a, b = s.split("/")
            num, den = int(a), int(b)
            if den <= 0:
                raise ValueError
            f = Fraction(num, den)
        else:
            f = Fraction(s)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{flag} {text!r} is malformed; write p/n (e.g. 3/4) or a fraction in "
                         f"(0, 1] (e.g. 0.75)") from None
    if not 0 < f <= 1:
        raise ValueError(f"{flag} must be in (0, 1] (p of n workers, 0 < p <= n), got {text!r}; "
                         f"e.g. {flag} 3/4")
    return f


def parse_active_blocks(text) -> tuple[int, int | None] | None:
    """``"b/d"`` -> ``(b, d)``, ``"b"`` -> ``(b, None)``, ``""`` -> ``None``; ``1 <= b <= d``."""
    s = str(text).strip()
    if not s:
        return None
    try:
        if "/" in s:
            a, c = s.split("/")
            b, d = int(a), int(c)
        else:
            b, d = int(s), None
    except ValueError:
        raise ValueError(f"--active-blocks {text!r} is malformed; write b/d, e.g. 2/3 for 2 of "
                         f"3 residual blocks per worker") from None
    if d is not None and d < 1:
        raise ValueError(f"--active-blocks {text!r}: d must be >= 1 (the model's residual "
                         f"blocks)")
    if b < 1:
        raise ValueError(f"--active-blocks {text!r}: every worker needs b >= 1 active block")
    if d is not None and b > d:
        raise ValueError(f"--active-blocks {text!r}: b = {b} exceeds the d = {d} blocks; use "
                         f"1 <= b <= d")
    return b, d


@dataclass(frozen=True)
class SDPOptions:
    """Options of SDP (paper 003)."""

    sdp_mode: str = option(
        "neuron", "neuron (N-SDP), block (B-SDP) or block-backward (B_b-SDP: full forward, "
                  "masked backward)")
    coverage: str = option(
        "3/4", "coverage C = p/n: every masked parameter lives on exactly p of the n workers "
               "(N-SDP; paper §4); 'p/n' or a fraction in (0, 1]")
    active_blocks: str = option(
        "", "b/d residual blocks kept per worker (block modes); empty: b = round(C d)")
    flop_match: bool = option(
        False, "run T/N_active (block-backward: 3/(1+2A)) times the trainer's steps so the "
               "total FLOPs match DDP's (paper §4.1.1)")
    eval_rescale: bool = option(
        False, "not in the paper: evaluate the assembled model with the dropout / "
               "stochastic-depth weight-scaling rule (inputs of masked neurons times p/n, a "
               "block's output times its degree / n)")

    def __post_init__(self) -> None:
        if self.sdp_mode not in SDP_MODES:
            raise ValueError(f"--sdp-mode {self.sdp_mode!r} unknown; use one of {SDP_MODES}")
        parse_fraction(self.coverage, "--coverage")
        blocks = parse_active_blocks(self.active_blocks)
        if blocks is not None and self.sdp_mode == "neuron":
            raise ValueError("--active-blocks applies to --sdp-mode block|block-backward; with "
                             "--sdp-mode neuron set --coverage p/n instead")


# ---------------------------------------------------------------------------------------------
# mask construction (pure: no MPI, parametrized by the number of workers n)
# ---------------------------------------------------------------------------------------------
def _bits(ranks) -> int:
    out = 0
    for r in ranks:
        out |= 1 << int(r)
    return out


def _members(bits: int) -> list[int]:
    return [r for r in range(bits.bit_length()) if bits >> r & 1]


def window_sets(n: int, p: int) -> list[int]:
    """Holder bitmask of chunk ``c``: the window ``{c, ..., c+p-1} mod n`` (``p`` workers per
    chunk, each worker in ``p`` of the ``n`` windows)."""
    return [_bits((c + k) % n for k in range(p)) for c in range(n)]


@dataclass(frozen=True)
class NeuronGroup:
    """One masked layer of neurons/channels.

    Attributes
    ----------
    width : int
        Neurons (channels).
    rows : tuple of str
        Parameters whose axis 0 indexes these neurons (producer weight, bias, BatchNorm).
    cols : tuple of (str, int)
        ``(parameter, repeat)`` whose axis 1 indexes them, ``repeat`` columns per neuron (a
        flattened conv feature map feeding a linear layer).
    buffers : tuple of str
        BatchNorm running statistics indexed by these channels.
    """

    width: int
    rows: tuple[str, ...]
    cols: tuple[tuple[str, int], ...]
    buffers: tuple[str, ...]


def _chain_groups(items: list[tuple[str, object]], what: str) -> list[NeuronGroup]:
    """Masked groups of a forward chain ``[(prefix, layer)]``: the outputs of every conv/linear
    layer but the last, with the BatchNorm that follows and the next layer's input columns."""
    prod_idx = [i for i, (_, layer) in enumerate(items) if isinstance(layer, (Conv2d, Linear))]
    groups = []
    for a, b in zip(prod_idx[:-1], prod_idx[1:]):
        pa, la = items[a]
        pb, lb = items[b]
        width = la.out_channels if isinstance(la, Conv2d) else la.out_features
        rows = [pa + "weight"] + ([pa + "bias"] if la.bias else [])
        bufs = []
        for pm, mid in items[a + 1:b]:
            if isinstance(mid, BatchNorm2d) and mid.num_features == width:
                rows += [pm + "weight", pm + "bias"]
                bufs += [pm + "running_mean", pm + "running_var"]
            elif not isinstance(mid, (ReLU, MaxPool2d, Flatten)):
                raise ValueError(f"--sdp-mode neuron cannot follow channels through "
                                 f"{type(mid).__name__} in {what}; use --sdp-mode block for "
                                 f"residual models or a cnn/mlp/resnet model")
        fan_in = lb.in_channels if isinstance(lb, Conv2d) else lb.in_features
        if fan_in % width:
            raise ValueError(f"{what}: {pb}weight has {fan_in} inputs, not a multiple of the "
                             f"{width} outputs of {pa}weight; N-SDP needs whole channels")
        groups.append(NeuronGroup(width, tuple(rows), ((pb + "weight", fan_in // width),),
                                  tuple(bufs)))
    return groups


def residual_blocks(model) -> list[tuple[str, object]]:
    """``(prefix, block)`` of every residual block (BasicBlock / Bottleneck, and a transformer's
    pre-norm Attention + MLP block: SDP's block unit on Swin and LLaMA), forward order.  A block
    whose tensors are all zero on a worker is the identity there."""
    return [(prefix, layer) for prefix, layer in model.root.walk()
            if isinstance(layer, (BasicBlock, Bottleneck, TransformerBlock))]


def neuron_groups(model) -> list[list[NeuronGroup]]:
    """Chains of masked neuron groups of ``model`` (see the module docstring).

    A model with residual blocks masks each block's inner channels (one chain per block); a
    plain :class:`~models.Sequential` chain masks all its hidden layers.
    """
    blocks = residual_blocks(model)
    if any(isinstance(blk, TransformerBlock) for _, blk in blocks):
        raise ValueError(f"--sdp-mode neuron (over attention heads / MLP neurons) is not "
                         f"implemented for the transformer {model.name!r}; use --sdp-mode "
                         "block or block-backward (SDP over Attention + MLP blocks)")
    if blocks:
        chains = []
        for prefix, blk in blocks:
            main = [(f"{prefix}{name}.", layer) for name, layer in blk.children()
                    if name != "shortcut"]
            chains.append(_chain_groups(main, f"block {prefix[:-1]}"))
        return [c for c in chains if c]
    root = model.root
    if not isinstance(root, Sequential):
        raise ValueError(f"--sdp-mode neuron needs a Sequential model (cnn, mlp, resnet), got "
                         f"{type(root).__name__}")
    chain = _chain_groups([(f"{name}.", layer) for name, layer in root.children()],
                          f"model {model.name}")
    return [chain] if chain else []


def masked_groups(chain: list[NeuronGroup], sizes) -> list[NeuronGroup]:
    """The groups of ``chain`` N-SDP masks: no two adjacent (group ``k``'s input columns are
    group ``k+1``'s producer, so a weight between two masked groups would live on the
    intersection of two holder sets, fewer than ``p`` workers), and among those sets the one
    holding the most parameters (``sizes[name]``: elements of a tensor); a tie masks the
    earlier groups.  A chain of one group (a residual block's inner channels, an MLP's hidden
    layer) masks it."""
    w = [sum(sizes[r] for r in g.rows) + sum(sizes[c] for c, _ in g.cols) for g in chain]
    best: list[tuple[int, tuple[int, ...]]] = [(0, ()), (0, ())]  # best[i]: over chain[:i]
    for i, wi in enumerate(w):
        skip, take = best[i + 1], (best[i][0] + wi, best[i][1] + (i,))
        best.append(take if take[0] > skip[0] else skip)
    return [chain[i] for i in best[-1][1]]


def _popcount(x: int) -> int:
    return bin(x).count("1")


class _SetTable:
    """Distinct holder sets, numbered in order of first use (index 0: all ranks)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sets: list[int] = [(1 << n) - 1]
        self.index = {self.sets[0]: 0}

    def get(self, bits: int) -> int:
        if bits == 0:
            raise ValueError("internal: a coordinate without holders (degree 0)")
        i = self.index.get(bits)
        if i is None:
            i = self.index[bits] = len(self.sets)
            self.sets.append(bits)
        return i


def _tensor_ids(table: _SetTable, shape, rows, cols, repeat: int):
    """Holder-set id and eval scale of every element of one tensor from the bitmasks of its
    rows (axis 0) and columns (axis 1, ``repeat`` per neuron); ``None``: held by all."""
    full = table.sets[0]
    n_out = shape[0]
    n_in = shape[1] if len(shape) > 1 else 1
    rows = [full] * n_out if rows is None else rows
    cols = [full] * (n_in // repeat) if cols is None else cols
    r_uni, r_idx = np.unique(np.array(rows, dtype=object), return_inverse=True)
    c_uni, c_idx = np.unique(np.array(cols, dtype=object), return_inverse=True)
    pair_id = np.empty((len(r_uni), len(c_uni)), dtype=np.int32)
    pair_scale = np.empty((len(r_uni), len(c_uni)), dtype=np.float64)
    for a, ra in enumerate(r_uni):
        for b, cb in enumerate(c_uni):
            both = int(ra) & int(cb)
            pair_id[a, b] = table.get(both)
            pair_scale[a, b] = _popcount(both) / _popcount(int(ra))
    c_idx = np.repeat(c_idx, repeat)
    if len(shape) == 1:
        return pair_id[r_idx, 0], pair_scale[r_idx, 0]
    ids = pair_id[r_idx[:, None], c_idx[None, :]]
    scale = pair_scale[r_idx[:, None], c_idx[None, :]]
    extra = (1,) * (len(shape) - 2)
    return (np.broadcast_to(ids.reshape(ids.shape + extra), shape),
            np.broadcast_to(scale.reshape(scale.shape + extra), shape))


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
        Weight-scaling factor of every coordinate (used only with ``--eval-rescale``).
    coverage : Fraction
        Nominal coverage: ``p/n`` (neuron) or ``b/d`` (block modes); the realized one is
        :attr:`coverage_realized`.
    detail : dict
        ``p`` or ``b``/``d``, the masked groups or blocks (for the report).
    ranks_per_node : int
        Ranks per node of the prediction's node-major topology (:attr:`node_of`).
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
                  seed: int = 0) -> "SDPPlan":
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
    def node_of(self) -> np.ndarray:
        """Node of every rank, node-major (``ranks_per_node`` consecutive ranks per node)."""
        return np.arange(self.n) // (self.ranks_per_node or self.n)

    @cached_property
    def counts(self) -> np.ndarray:
        """Coordinates of each holder set."""
        return np.bincount(self.set_id, minlength=len(self.sets)).astype(np.int64)

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

    def gated_bytes(self, node_of=None, itemsize: int = 4) -> dict:
        """Wire bytes of one gated average (:func:`volume.sdp.gated_allreduce_bytes`)."""
        node_of = self.node_of if node_of is None else node_of
        rs = list(self.reduce_sets)
        return gated_allreduce_bytes([self.members(s) for s in rs], self.counts[rs], node_of,
                                     itemsize)

    def bcast_bytes(self, node_of=None, itemsize: int = 4) -> dict | None:
        """Wire bytes of B_b-SDP's parameter broadcasts (``None`` in the forward modes)."""
        if self.mode != "block-backward":
            return None
        node_of = self.node_of if node_of is None else node_of
        g = self.bcast_groups
        return param_bcast_bytes([(ranks, root) for _, ranks, root in g],
                                 self.counts[[s for s, _, _ in g]], node_of, itemsize)

    def assembly_bytes(self, node_of=None, itemsize: int = 4) -> dict:
        """Wire bytes of one evaluation's assembly on rank 0."""
        node_of = self.node_of if node_of is None else node_of
        return assemble_bytes(self.assemble_counts, node_of, 0, itemsize)


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
        Node-major topology of the plan's :attr:`SDPPlan.node_of` (default: one node).

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
    scale = np.ones(layout.total, dtype=np.float64)
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
                             f"hidden layers (cnn, mlp with --hidden, resnet)")
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
            scale[sl] = sc.reshape(-1)
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
            for name in buffer_ids:
                if name.startswith(prefix) and not name.startswith(skip):
                    buffer_ids[name][:] = sid
            last_bn = [pm for pm, layer in main if isinstance(layer, BatchNorm2d)][-1:]
            for pm in last_bn:  # stochastic depth: the block's output times its survival rate
                for local in ("weight", "bias"):
                    scale[layout.slice(pm + local)] = _popcount(bits) / n
        detail = {"b": b, "d": d, "block_degrees": [_popcount(h) for h in holders],
                  "blocks": [p[:-1] for p, _ in blocks]}
        cov = Fraction(b, d)
        detail["order"] = [int(k) for k in order]
    plan = SDPPlan(n=n, mode=mode, sets=tuple(table.sets), set_id=set_id,
                   buffer_ids=buffer_ids, scale=scale, coverage=cov, detail=detail,
                   ranks_per_node=rpn)
    _check_connected(plan, cov)
    return plan


def worker_memory(plan: SDPPlan, itemsize: int = 4, momentum: bool = True) -> dict:
    """Per-worker bytes of parameters + gradients + optimizer momentum, and DDP's (§3.2).

    Forward masking materialises only worker ``i``'s ``N_i`` coordinates:
    ``itemsize (2 + s) N_i`` (``s = 1`` with momentum); backward masking keeps the full
    parameters for its full forward pass: ``itemsize (T + (1 + s) N_i)``; DDP holds
    ``itemsize (2 + s) T`` (= 3 × 4 × T for float32 SGD with momentum).
    """
    T, s = plan.total, int(bool(momentum))
    held = [plan.held(r) for r in range(plan.n)]
    if plan.mode == "block-backward":
        mem = [itemsize * (T + (1 + s) * h) for h in held]
    else:
        mem = [itemsize * (2 + s) * h for h in held]
    ddp = itemsize * (2 + s) * T
    return {"memory_bytes": mem, "memory_ddp_bytes": ddp,
            "memory_ratio_mean": float(np.mean(mem) / ddp),
            "memory_ratio_max": float(max(mem) / ddp),
            "held_fraction": [h / T for h in held]}


def spectral_gap(mask) -> float:
    """Spectral gap ρ of the masking operator, eq. (1) of paper 003, from a mask matrix.

    Parameters
    ----------
    mask : array (n, |J|) of bool / 0-1
        ``m_ij = 1`` when worker ``i`` holds coordinate ``j``; every column needs ``d_j >= 1``.

    Returns
    -------
    float
        ``ρ = sup ||m̄(g)||`` over ``Σ_i ||g_i||² <= 1`` with ``m̄_uni(g) = 0``.  The operator
        acts column by column, so it is block diagonal over the coordinates: block ``j`` is the
        functional ``a_jᵀ = m_{:,j}ᵀ / d_j`` on ``1^⊥`` and ρ is the largest singular value
        of the blocks ``a_jᵀ (I - 11ᵀ/n)`` (equal columns give equal blocks, so only distinct
        columns are evaluated).  Closed form for comparison: ``sqrt(1/min_j d_j - 1/n)``.
    """
    m = np.asarray(mask).astype(bool)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"mask must be a non-empty (n, |J|) matrix, got shape {m.shape}")
    cols = np.unique(m, axis=1)
    d = cols.sum(axis=0)
    if (d == 0).any():
        raise ValueError("a coordinate has no holder (d_j = 0); the gated average needs "
                         "d_j >= 1 for every j")
    a = cols.T / d[:, None]                        # rows a_jᵀ, k × n
    blocks = a - a.mean(axis=1, keepdims=True)     # a_jᵀ (I - 11ᵀ/n)
    sv = [np.linalg.svd(row[None, :], compute_uv=False)[0] for row in blocks]
    return float(max(sv))


# ---------------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------------
@register
class SDP(Strategy):
    """Subnetwork data parallelism: fixed masks, gated average among each coordinate's holders.

    See the module docstring for the masks, the communication and the reported quantities.
    """

    name = "sdp"
    Options = SDPOptions

    def __init__(self, ctx, options: SDPOptions) -> None:
        super().__init__(ctx, options)
        xp, topo = self.xp, self.topo
        rank = topo.rank
        model, opt = ctx.model, ctx.opt
        self.model, self.opt = model, opt
        self.plan = plan = SDPPlan.for_model(model, topo.num_nodes, topo.ranks_per_node,
                                             options, seed=ctx.seed)
        self.forward_masking = options.sdp_mode != "block-backward"
        g = model.grads.flat
        self.itemsize = g.dtype.itemsize
        node_of = topo.node_of  # the run's own nodes (the plan's are node-major)

        # this rank's row of m: forward masking zeroes the parameters outside the subnetwork;
        # every mode masks the update and freezes the momentum outside (backward masking)
        self.mask = xp.asarray(plan.mask(rank).astype(g.dtype))
        if self.forward_masking:
            model.params.flat[...] *= self.mask
        self.hook = MaskHook(self.mask)
        opt.add_hook(self.hook)

        # gated average: one all-reduce per holder set of the plan, on its own sub-communicator
        reduce_sets = plan.reduce_sets
        self._reduce = []
        for s, comm in zip(reduce_sets, self._build_comms([plan.members(s)
                                                           for s in reduce_sets])):
            if comm is not None:
                idx = plan.indices(s)
                self._reduce.append((xp.asarray(idx), xp.empty(idx.size, dtype=g.dtype), comm,
                                     int(plan.degrees[s])))
        self._gated_bytes = plan.gated_bytes(node_of, self.itemsize)
        self.num_reduce_sets = len(reduce_sets)

        # B_b-SDP: the lowest holder broadcasts updated parameters to the non-holders
        self._bcast = []
        self._bcast_bytes = plan.bcast_bytes(node_of, self.itemsize)
        groups = plan.bcast_groups
        for (s, ranks, root), comm in zip(groups, self._build_comms([list(r) for _, r, _ in
                                                                     groups])):
            if comm is not None:
                idx = plan.indices(s)
                self._bcast.append((xp.asarray(idx), xp.empty(idx.size, dtype=g.dtype), comm,
                                    ranks.index(root)))

        # evaluation: rank 0 lacks the sets it does not hold; each set's lowest rank sends them
        self._send = None
        self._recv: list = []
        for r, ss in plan.assemble_sets.items():
            if r not in plan.assemble_counts:
                continue
            pidx = np.flatnonzero(np.isin(plan.set_id, ss))
            bidx = {name: np.flatnonzero(np.isin(ids, ss))
                    for name, ids in sorted(plan.buffer_ids.items())}
            bidx = {k: xp.asarray(v) for k, v in bidx.items() if v.size}
            entry = (r, xp.asarray(pidx), bidx,
                     xp.zeros(plan.assemble_counts[r], dtype=g.dtype))
            if rank == r:
                self._send = entry
            if rank == 0:
                self._recv.append(entry)
        self._assemble_bytes = plan.assembly_bytes(node_of, self.itemsize)
        self._needs_assembly = bool(plan.assemble_counts)
        self._full = xp.empty_like(model.params.flat) if rank == 0 else None
        self._scale = (xp.asarray(plan.scale.astype(g.dtype))
                       if rank == 0 and options.eval_rescale and self.forward_masking else None)

        self.flop_factor = plan.flop_factor()
        self._syncs = self._refreshes = 0
        self._assembled_now = False

    # -- planning helpers ------------------------------------------------------------------------
    def _build_comms(self, member_lists: list[list[int]]) -> list:
        """One sub-communicator per member list (``None`` where this rank is not a member).

        ``Comm.sub`` is collective over the world, so pairwise-disjoint lists share one split
        (greedy rounds, the same on every rank); the full list reuses the world communicator.
        Members are ordered by world rank.
        """
        world, rank, n = self.topo.world, self.topo.rank, self.topo.size
        out: list = [None] * len(member_lists)
        rounds: list[list] = []  # [indices, union bitmask]
        for i, ms in enumerate(member_lists):
            if len(ms) == n:
                out[i] = world
                continue
            bits = _bits(ms)
            for rd in rounds:
                if not rd[1] & bits:
                    rd[0].append(i)
                    rd[1] |= bits
                    break
            else:
                rounds.append([[i], bits])
        for idxs, _ in rounds:
            color = next((i for i in idxs if rank in member_lists[i]), -1)
            comm = world.sub(color)
            if color >= 0:
                out[color] = comm
        return out

    # -- every step ------------------------------------------------------------------------------
    def sync(self, state, buffers):
        """Gated average (eq. "average"): ``ĝ_j = Σ_{i ∈ H_j} g_ij / d_j`` on the holders,
        zero elsewhere."""
        xp, g = self.xp, buffers.flat
        for idx, buf, comm, d in self._reduce:
            xp.take(g, idx, out=buf)
            comm.allreduce(buf, "sum", phase="sdp_gated_allreduce")
            buf /= d
            g[idx] = buf
        g *= self.mask
        self._syncs += 1
        return g

    def _refresh_params(self) -> None:
        """B_b-SDP: broadcast the updated parameters of every set to its non-holders."""
        xp, theta = self.xp, self.model.params.flat
        for idx, buf, comm, root in self._bcast:
            if comm.rank == root:
                xp.take(theta, idx, out=buf)
            comm.bcast(buf, root, phase="sdp_param_bcast")
            theta[idx] = buf
        self._refreshes += 1

    def _assemble(self) -> None:
        """Send what rank 0 lacks (parameters and BatchNorm statistics) from each set's lowest
        holder to rank 0 (evaluation steps only)."""
        world, xp = self.topo.world, self.xp
        if self._send is not None:
            _, pidx, bidx, buf = self._send
            theta = self.model.params.flat
            xp.take(theta, pidx, out=buf[:pidx.size])
            off = pidx.size
            for name, idx in bidx.items():
                buf[off:off + idx.size] = self.model.buffers[name][idx]
                off += idx.size
            world.waitall([world.isend(buf, 0, tag=7, phase="sdp_assemble")])
        if self._recv:
            world.waitall([world.irecv(buf, r, tag=7, phase="sdp_assemble")
                           for r, _, _, buf in self._recv])
            for _, pidx, bidx, buf in self._recv:
                off = int(pidx.size)
                for name, idx in bidx.items():
                    # rank 0 does not hold these channels: its own running statistics of them
                    # are never used in training, so the holder's replace them for evaluation
                    self.model.buffers[name][idx] = buf[off:off + idx.size]
                    off += idx.size
        self._assembled_now = True

    def total_steps(self, base_steps: int) -> int:
        """``floor(f · base_steps)`` SDP iterations with ``--flop-match`` (§4.1.1)."""
        if self.options.flop_match:
            return math.floor(base_steps * self.flop_factor)
        return base_steps

    def before_eval(self) -> None:
        if self._needs_assembly:
            self._assemble()

    def after_step(self, state) -> None:
        if not self.forward_masking:
            self._refresh_params()

    def step_bytes(self) -> dict[str, dict]:
        out = sdp_step_bytes(gated=self._gated_bytes, syncs=self._syncs,
                             bcast=self._bcast_bytes, refreshes=self._refreshes,
                             assemble=self._assemble_bytes if self._assembled_now else None)
        self._syncs, self._refreshes, self._assembled_now = 0, 0, False
        return out

    def eval_params(self):
        """Rank 0: the full model assembled from the holders (its own coordinates plus those
        received at the last evaluation step), weight-scaled only with ``--eval-rescale``."""
        theta = self.model.params.flat
        if not self.forward_masking:
            return theta
        full = self._full
        full[...] = theta
        for _, pidx, _, buf in self._recv:
            full[pidx] = buf[:pidx.size]
        if self._scale is not None:
            full *= self._scale
        return full

    # -- report ----------------------------------------------------------------------------------
    def report(self) -> dict:
        """Mask statistics, spectral gap ρ (eq. 1, numerical and closed form), wire bytes of one
        step (gated average + B_b-SDP's broadcasts) and their ratio to DDP's world ring
        all-reduce (``payload_ratio``), the FLOP-matching factor, and :func:`worker_memory`.

        ``coverage`` is the realized ``Σ_j d_j / (n T)`` (``degree_histogram`` gives every
        degree); the nominal ``p/n`` is ``coverage_nominal`` (``active_blocks`` ``b/d`` in the
        block modes).

        ρ is computed by :func:`spectral_gap` from the ``n × T`` matrix ``m`` of this run over
        every flat coordinate (those held by all included, ``d_j = n``), i.e. the aggregation
        mask ``m_bwd`` (which equals ``m_fwd`` in the forward-masking modes), evaluated on its
        distinct columns.
        """
        plan, n = self.plan, self.plan.n
        used = plan.counts > 0
        dmin = int(plan.degrees[used].min())
        gated = self._gated_bytes["intra"] + self._gated_bytes["inter"]
        bcast = (0 if self._bcast_bytes is None
                 else self._bcast_bytes["intra"] + self._bcast_bytes["inter"])
        ddp = world_ring_bytes(plan.total, self.itemsize, self.M, self.P)
        ddp_total = ddp["intra"] + ddp["inter"]
        nominal = ("coverage_nominal" if plan.mode == "neuron" else "active_blocks")
        out = {"sdp_mode": plan.mode, "coverage": str(plan.coverage_realized),
               "coverage_realized": float(plan.coverage_realized), nominal: str(plan.coverage),
               "degree_histogram": {str(d): c for d, c in plan.degree_histogram().items()},
               **{k: v for k, v in plan.detail.items() if k != "order"},
               "holder_sets": int(used.sum()), "reduce_sets": self.num_reduce_sets,
               "degree_min": dmin, "degree_max": int(plan.degrees[used].max()),
               "spectral_gap": spectral_gap(plan.distinct_mask()),
               "spectral_gap_closed_form": math.sqrt(max(0.0, 1 / dmin - 1 / n)),
               "gated_bytes_per_sync": gated, "bcast_bytes_per_sync": bcast,
               "payload_ratio": (gated + bcast) / ddp_total if ddp_total else 0.0,
               "flop_factor": float(self.flop_factor),
               "flop_factor_exact": str(self.flop_factor), "flop_match": self.options.flop_match,
               "eval_rescale": bool(self.options.eval_rescale and self.forward_masking)}
        out.update(worker_memory(plan, self.itemsize, self.opt.momentum_buffer is not None))
        return out
