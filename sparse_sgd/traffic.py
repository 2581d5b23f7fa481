"""Predicted traffic of a sparse-SGD run, in the ledger's ``traffic`` schema.

SpFF/SpBP bytes and messages come from the partition metrics (:mod:`partition.metrics`):
per iteration, D^k[m, n] words go from n to m in SpFF and back in SpBP (k >= 2), each word
``batch * itemsize`` bytes.  The few collectives of the driver (partition broadcast, per-iteration
loss all-reduce) are predicted with the documented algorithms of :mod:`substrate.costmodel`.
"""

from __future__ import annotations

import numpy as np

from partition.metrics import PartitionMetrics
from substrate.costmodel import INTER, INTRA, bcast_split, ring_allreduce_split

__all__ = ["TrafficPrediction", "allreduce_phase", "bcast_phase", "p2p_phases"]


def _entry(intra: int = 0, inter: int = 0, messages: int = 0) -> dict:
    return {"bytes": int(intra + inter), "intra_bytes": int(intra), "inter_bytes": int(inter),
            "messages": int(messages)}


def p2p_phases(metrics: PartitionMetrics, node_of: np.ndarray, *, batch: int, itemsize: int,
               iterations: int, spbp: bool = True) -> dict:
    """``{"spff": entry, "spbp": entry}`` for ``iterations`` SpFF(+SpBP) passes on ``batch``.

    ``node_of[r]`` is the node of rank r, which decides the link class of each pair.
    """
    node_of = np.asarray(node_of)
    same = node_of[:, None] == node_of[None, :]
    D = metrics.pair_words  # (L, m, n): n -> m in SpFF, m -> n in SpBP
    scale = batch * itemsize * iterations
    total_words = D.sum(axis=0)
    out = {"spff": _entry(int(total_words[same].sum()) * scale,
                          int(total_words[~same].sum()) * scale,
                          int((D > 0).sum()) * iterations)}
    if spbp:
        Db = D[1:]
        tw = Db.sum(axis=0)
        out["spbp"] = _entry(int(tw[same].sum()) * scale, int(tw[~same].sum()) * scale,
                             int((Db > 0).sum()) * iterations)
    return out


def bcast_phase(nbytes: int, node_of: np.ndarray, root: int = 0, calls: int = 1) -> dict:
    """Binomial-tree broadcast of ``nbytes`` from ``root``: ``p - 1`` messages, one per tree edge
    ``r & (r-1) -> r`` (relative ranks), each on its link class
    (:func:`substrate.costmodel.bcast_split`, exact for any layout and rank count)."""
    node_of = np.asarray(node_of)
    p = node_of.size
    b = bcast_split(int(nbytes), node_of, root)
    return _entry(b[INTRA] * calls, b[INTER] * calls, max(p - 1, 0) * calls)


def allreduce_phase(count: int, itemsize: int, node_of: np.ndarray, calls: int = 1) -> dict:
    """Ring all-reduce of ``count`` elements over all ranks, ``calls`` times.

    ``2 (p-1) · count · itemsize`` bytes in ``p · 2 (p-1)`` messages; rank i sends
    ``2 count - c_{i+1} - c_{i+2}`` elements to rank i+1 (``numpy.array_split`` chunk sizes
    ``c``), so the node-crossing links carry exactly :func:`substrate.costmodel.
    ring_allreduce_split` for any ``count`` and rank count.
    """
    node_of = np.asarray(node_of)
    p = node_of.size
    b = ring_allreduce_split(int(count), int(itemsize), node_of)
    msgs = p * 2 * (p - 1) if p > 1 else 0
    return _entry(b[INTRA] * calls, b[INTER] * calls, msgs * calls)


class TrafficPrediction:
    """Collects predicted phases and renders the ``traffic.predicted`` dict."""

    def __init__(self) -> None:
        self.by_phase: dict[str, dict] = {}

    def add(self, phase: str, entry: dict) -> None:
        old = self.by_phase.get(phase)
        if old is None:
            self.by_phase[phase] = dict(entry)
        else:
            for f in ("bytes", "intra_bytes", "inter_bytes", "messages"):
                old[f] += entry[f]

    def as_dict(self) -> dict:
        bp = {k: v for k, v in sorted(self.by_phase.items()) if v["bytes"] or v["messages"]}
        return {"inter_node_bytes": sum(e["inter_bytes"] for e in bp.values()),
                "intra_node_bytes": sum(e["intra_bytes"] for e in bp.values()),
                "messages": sum(e["messages"] for e in bp.values()),
                "by_phase": bp}
