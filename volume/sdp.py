"""Closed-form communication volume of SDP (subnetwork data parallelism, paper 003).

SDP reduces each coordinate only among its *holders* (the workers whose subnetwork contains
it).  Coordinates are grouped by holder set ``H`` (a set of world ranks); every distinct set with
at least one coordinate and ``|H| >= 2`` is all-reduced on its own sub-communicator, whose rank
order is that of the world ranks (``Comm.sub`` keys by world rank).  The ring of that
all-reduce visits the members' nodes in ascending world-rank order, so its exact per-link-class
split is :func:`substrate.costmodel.ring_allreduce_split` of the members' node ids.

=====================  ====================================  ==================================
phase                  call                                  bytes on the wire
=====================  ====================================  ==================================
``sdp_gated_allreduce``  ring all-reduce of the ``n_H``        ``2 (|H|-1) · 4 n_H`` per set, per
                       coordinates of each holder set ``H``   sync (split by the ring's links)
``sdp_param_bcast``    B_b-SDP only: binomial bcast of the    ``(n - |H|) · 4 n_H`` per set, per
                       ``n_H`` updated parameters from the    sync (tree edges split by link)
                       set's lowest rank to the non-holders
``sdp_assemble``       forward masking, at evaluation steps:  ``4 · Σ_H n_H`` over the sets
                       each set without rank 0 sends its      without rank 0 (+ BN statistics),
                       coordinates from its lowest rank to 0   one message per sending rank
=====================  ====================================  ==================================

Singleton sets (``|H| = 1``) need no communication: their gated average (eq. "average") is the
holder's own gradient.  With the uniform mask (every coordinate on all ``n`` ranks) the gated
all-reduce is DDP's ring all-reduce over the world.

The functions above price given holder sets (the plan's).  :func:`neuron_sdp_bytes` and
:func:`block_sdp_bytes` are the second source, written from the paper's definitions and the
layer shapes alone: N-SDP at coverage ``p/n`` puts every masked parameter on exactly ``p`` of
the ``n`` workers (§4; neurons in ``n`` contiguous chunks, chunk ``c`` on the window
``{c..c+p-1} mod n``) and every other parameter on all ``n``; B-SDP / B_b-SDP deal ``b`` of the
``d`` blocks to every worker (``A = b/d``, §4; worker ``i`` takes slots ``i b .. i b + b - 1``
of the block order).  Each holder group all-reduces its parameters in one ring
(§3.2 "each parameter block is reduced only within its subset of workers"), so the total is
``2 (|H| - 1) · 4 · n_H`` summed over the groups, e.g. ``8 [(p - 1) N_masked + (n - 1)
N_rest]`` for N-SDP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from . import collectives as cm

__all__ = [
    "ASSEMBLE",
    "BCAST",
    "GATED",
    "assemble_bytes",
    "block_sdp_bytes",
    "gated_allreduce_bytes",
    "neuron_sdp_bytes",
    "param_bcast_bytes",
    "sdp_step_bytes",
]

GATED = "sdp_gated_allreduce"
BCAST = "sdp_param_bcast"
ASSEMBLE = "sdp_assemble"


def _zero() -> dict:
    return {cm.INTRA: 0, cm.INTER: 0}


def _add(acc: dict, part: dict, times: int = 1) -> dict:
    acc[cm.INTRA] += times * int(part[cm.INTRA])
    acc[cm.INTER] += times * int(part[cm.INTER])
    return acc


def gated_allreduce_bytes(members: Sequence[Sequence[int]], counts: Sequence[int],
                          node_of, itemsize: int = 4) -> dict:
    """Wire bytes of one gated average (paper 003, eq. "average") over all holder sets.

    Parameters
    ----------
    members : sequence of sequences of int
        World ranks of each holder set ``H`` (any order; the ring follows ascending rank).
    counts : sequence of int
        ``n_H``, the coordinates of each set.
    node_of : array of int
        Node id of every world rank.
    itemsize : int
        Bytes per gradient element.

    Returns
    -------
    dict
        ``{"intra": bytes, "inter": bytes}`` summed over the sets' ring all-reduces.
    """
    node_of = np.asarray(node_of)
    out = _zero()
    for ranks, n in zip(members, counts):
        ranks = sorted(int(r) for r in ranks)
        if len(ranks) < 2 or int(n) == 0:
            continue
        _add(out, cm.ring_allreduce_split(int(n), int(itemsize), node_of[ranks]))
    return out


def param_bcast_bytes(groups: Sequence[tuple[Sequence[int], int]], counts: Sequence[int],
                      node_of, itemsize: int = 4) -> dict:
    """Wire bytes of B_b-SDP's parameter refresh: per holder set, a binomial broadcast of its
    ``n_H`` updated parameters over ``{leader} ∪ non-holders``.

    Parameters
    ----------
    groups : sequence of (members, leader)
        World ranks of each broadcast communicator and the world rank of its root.
    counts : sequence of int
        Parameters broadcast in each group.
    node_of : array of int
        Node id of every world rank.
    """
    node_of = np.asarray(node_of)
    out = _zero()
    for (ranks, leader), n in zip(groups, counts):
        ranks = sorted(int(r) for r in ranks)
        if len(ranks) < 2 or int(n) == 0:
            continue
        _add(out, cm.bcast_split(int(n) * itemsize, node_of[ranks],
                                       ranks.index(int(leader))))
    return out


def assemble_bytes(sender_counts: Mapping[int, int], node_of, root: int = 0,
                   itemsize: int = 4) -> dict:
    """Wire bytes of assembling the full model on ``root``: one point-to-point message of
    ``sender_counts[r]`` elements from every rank ``r != root``."""
    node_of = np.asarray(node_of)
    out = _zero()
    for r, n in sender_counts.items():
        if int(r) == root or int(n) == 0:
            continue
        link = cm.INTRA if node_of[int(r)] == node_of[root] else cm.INTER
        out[link] += int(n) * itemsize
    return out


def sdp_step_bytes(*, gated: dict, syncs: int = 1, bcast: dict | None = None,
                   refreshes: int | None = None, assemble: dict | None = None) -> dict[str, dict]:
    """Per-phase bytes of one trainer step: ``syncs`` gated averages (more than one when
    FLOP-matching adds iterations), ``refreshes`` parameter broadcasts (B_b-SDP; default one
    per sync), and the assembly when the step is followed by an evaluation.  Phases without
    traffic are omitted."""
    out: dict[str, dict] = {}
    refreshes = syncs if refreshes is None else refreshes
    parts = ((GATED, gated, syncs), (BCAST, bcast, refreshes), (ASSEMBLE, assemble, 1))
    for phase, part, times in parts:
        if part is None or times == 0:
            continue
        b = _add(_zero(), part, times)
        if b[cm.INTRA] or b[cm.INTER]:
            out[phase] = b
    return out


# ---------------------------------------------------------------------------------------------
# second source: from the paper's coverage / active blocks and the layer shapes
# ---------------------------------------------------------------------------------------------
def _ring(count: int, ranks, node_of, itemsize: int) -> dict:
    """One ring all-reduce of ``count`` elements over ``ranks`` (ascending world rank)."""
    ranks = sorted(ranks)
    if len(ranks) < 2 or count == 0:
        return _zero()
    return cm.ring_allreduce_split(int(count), int(itemsize), np.asarray(node_of)[ranks])


def neuron_sdp_bytes(layers: Sequence[tuple[int, int, int]], rest: int, p: int, node_of,
                     itemsize: int = 4) -> dict[str, dict]:
    """N-SDP at coverage ``p/n`` (paper 003, §3.2 and §4) from the masked layers' shapes.

    Parameters
    ----------
    layers : sequence of (width, params, buffers)
        Every masked layer: its ``width`` neurons / channels, the parameters of one neuron
        (its output row and bias, its BatchNorm scale and shift, the next layer's input
        column(s)) and its BatchNorm running statistics per neuron (0 or 2).
    rest : int
        Parameters of the unmasked layers (held by all ``n`` workers).
    p : int
        Workers per masked parameter.
    node_of : array of int
        Node of every rank (``n = len(node_of)``).

    Returns
    -------
    dict
        ``{"gated": bytes of one gated average, "assemble": bytes of one evaluation's
        assembly on rank 0}``, each ``{"intra": .., "inter": ..}``.  Chunk ``c`` of every masked
        layer (``numpy.array_split`` of its neurons into ``n`` chunks) lives on the window
        ``W_c = {c, .., c+p-1} mod n``; the windows' parameters are all-reduced in one ring per
        window, the rest in one world ring.  Rank 0 lacks the windows ``c = 1 .. n-p``, whose
        lowest member ``c`` sends them (parameters and running statistics) to rank 0.
    """
    n = len(node_of)
    if not 1 <= p <= n:
        raise ValueError(f"p must be in 1..n = {n}, got {p}")
    per_window = np.zeros(n, dtype=np.int64)
    bufs = np.zeros(n, dtype=np.int64)
    for width, params, buffers in layers:
        chunk = np.array([len(a) for a in np.array_split(np.arange(width), n)])
        per_window += chunk * int(params)
        bufs += chunk * int(buffers)
    if p == n:  # every window is the whole world: one world ring of everything (DDP)
        return {"gated": _ring(int(rest) + int(per_window.sum()), range(n), node_of, itemsize),
                "assemble": _zero()}
    gated = _ring(int(rest), range(n), node_of, itemsize)
    for c in range(n):
        _add(gated, _ring(int(per_window[c]), [(c + k) % n for k in range(p)], node_of,
                          itemsize))
    assemble = _zero()
    for c in range(1, n - p + 1):  # windows without rank 0; their lowest member is c
        link = cm.INTRA if node_of[c] == node_of[0] else cm.INTER
        assemble[link] += int(itemsize) * int(per_window[c] + bufs[c])
    return {"gated": gated, "assemble": assemble}


def block_sdp_bytes(blocks: Sequence[int], rest: int, b: int, order: Sequence[int], node_of,
                    itemsize: int = 4, backward: bool = False) -> dict[str, dict]:
    """B-SDP / B_b-SDP with ``A = b/d`` (paper 003, §3.2 eq. 4 and §4) from the block sizes.

    Parameters
    ----------
    blocks : sequence of int
        Parameters of every residual block's main branch (``d = len(blocks)``).
    rest : int
        Parameters outside the main branches (stem, shortcuts, classifier): on all workers.
    b : int
        Active blocks per worker.
    order : sequence of int
        The block order (a permutation of ``0..d-1``; the run draws it from its seed): worker
        ``i`` keeps the blocks in slots ``i b, .., i b + b - 1 (mod d)``.
    backward : bool
        B_b-SDP: after the update, each holder group's lowest member broadcasts its blocks'
        parameters to the workers that do not hold them (binomial tree over the lowest member
        and the non-holders, in world-rank order).

    Returns
    -------
    dict
        ``{"gated": .., "bcast": .. (None unless backward)}``: blocks with the same holders
        form one group (one ring), the rest joins the group of all workers.
    """
    n, d = len(node_of), len(blocks)
    holders = [set() for _ in range(d)]
    for i in range(n):
        for k in range(b):
            holders[int(order[(i * b + k) % d])].add(i)
    groups: dict[frozenset, int] = {frozenset(range(n)): int(rest)}
    for h, size in zip(holders, blocks):
        groups[frozenset(h)] = groups.get(frozenset(h), 0) + int(size)
    gated = _zero()
    for h, count in groups.items():
        _add(gated, _ring(count, h, node_of, itemsize))
    bcast = None
    if backward:
        bcast = _zero()
        for h, count in groups.items():
            if len(h) == n or count == 0:
                continue
            ranks = sorted({min(h)} | (set(range(n)) - h))
            _add(bcast, cm.bcast_split(int(count) * int(itemsize),
                                       np.asarray(node_of)[ranks], ranks.index(min(h))))
    return {"gated": gated, "bcast": bcast}
