"""Table 1 of the H-SGD paper on its own terms: SpFF words and messages a processor sends per
layer (one direction, one input vector), average and maximum over processors, and the
computational imbalance; the random row's closed form E[R] and a lower bound beside them.

Used by ``python -m sparse_sgd partition`` and ``python -m commvol partition-table``.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from partition.metrics import expected_random_spff, partition_metrics
from partition.partitioners import cpu_seconds, partitioner_errors
from sparse_sgd.plan import PartitionOptions, plan_partition
from sparse_sgd.radixnet import RadixNetConfig, spff_lower_bound

__all__ = ["LABELS", "format_table1", "table1_rows"]

#: row labels of the measured partitions
LABELS = {"hypergraph": "H (hypergraph)", "random": "R (random)"}


def table1_rows(weights, parts: int, methods, options: PartitionOptions | None = None, *,
                seed: int = 0, network: RadixNetConfig | None = None) -> tuple[list, dict]:
    """Partitions of ``weights`` and their Table-1 rows.

    Returns ``(rows, partitions)``: rows are dicts with ``label``, ``method`` and the
    :meth:`~partition.PartitionMetrics.table1` keys (plus ``seconds``: the wall time of the whole
    partitioning step, ``cpu_seconds``, ``partitioner_seconds``: the partitioner's own
    :attr:`~partition.Partition.seconds`, and ``spff_spbp_avg_volume``) for measured
    partitions; an ``E[R]`` row (closed form,
    :func:`partition.expected_random_spff` averaged over the layers) follows the random row and
    an ``LB`` row (:func:`sparse_sgd.radixnet.spff_lower_bound`, volume only) closes the table
    of a generated network (``network`` given).
    """
    options = options or PartitionOptions()
    rows, parts_by = [], {}
    L = len(weights)
    for method in methods:
        t0, w0 = cpu_seconds(), time.perf_counter()
        with partitioner_errors():
            part = plan_partition(weights, parts, method, options, seed=seed, network=network)
        wall, cpu = time.perf_counter() - w0, cpu_seconds() - t0
        m = partition_metrics(weights, part)
        # the whole step the user waits for (Partition.seconds leaves out what
        # plan_partition does around the partitioner, e.g. building an unpermuted twin)
        rows.append({"label": LABELS[method], "method": method, **m.table1(),
                     "seconds": wall, "cpu_seconds": cpu, "partitioner_seconds": part.seconds,
                     "spff_spbp_avg_volume": m.table1_spff_spbp()["avg_volume"]})
        parts_by[method] = part
        if method == "random":
            e = [expected_random_spff(W.shape[1], parts,
                                      int(np.diff(sp.csc_matrix(W).indptr).max()))
                 for W in weights]
            rows.append({"label": "E[R] closed form", "method": "E[R]",
                         "avg_volume": sum(x["avg_volume"] for x in e) / L,
                         "avg_messages": sum(x["avg_messages"] for x in e) / L})
    if network is not None:
        lb = spff_lower_bound(network, parts, options.epsilon)
        rows.append({"label": "LB lower bound", "method": "LB",
                     "avg_volume": float(lb.mean() / parts)})
    return rows, parts_by


def format_table1(rows: list) -> str:
    """Rows of :func:`table1_rows` as text; missing values print as ``-``."""
    head = (f"{'row':<18}{'avg vol':>9}{'max vol':>9}{'avg msg':>9}{'max msg':>9}{'imb':>7}"
            f"{'ff+bp avg':>11}{'wall s':>9}{'cpu s':>8}")
    lines = [head, "-" * len(head)]

    def f(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    for r in rows:
        lines.append(f"{r['label']:<18}{f(r, 'avg_volume', '.2f'):>9}"
                     f"{f(r, 'max_volume', '.2f'):>9}{f(r, 'avg_messages', '.2f'):>9}"
                     f"{f(r, 'max_messages', '.2f'):>9}{f(r, 'imbalance', '.3f'):>7}"
                     f"{f(r, 'spff_spbp_avg_volume', '.2f'):>11}{f(r, 'seconds', '.2f'):>9}"
                     f"{f(r, 'cpu_seconds', '.2f'):>8}")
    return "\n".join(lines)
