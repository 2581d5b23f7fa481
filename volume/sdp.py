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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from substrate import costmodel as cm

__all__ = ["GATED", "BCAST", "ASSEMBLE", "gated_allreduce_bytes",
           "param_bcast_bytes", "assemble_bytes", "sdp_step_bytes"]

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
