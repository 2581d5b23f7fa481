"""Communication and load metrics of a row partition (Table 1 of the H-SGD paper).

For layer k let D^k[m, n] be the number of x^{k-1} entries owned by processor n that rows of
W^k on processor m use (|x̂^{k-1}_{nm}| of eq. 9, m != n).  Then, per iteration and per column of
the mini-batch,

* SpFF (Alg. 2) sends D^k[m, n] words from n to m in one message when D^k[m, n] > 0;
* SpBP (Alg. 3) sends the same number of partial sums s^k back from m to n, for k = 2..L
  (s^1 would only build delta^0, which no weight update needs, so it is not communicated).

Summed over the layers this is exactly what :mod:`sparse_sgd.distributed` sends.

Table 1 of the paper counts one direction: the words and messages a processor *sends in SpFF*
per layer (:meth:`PartitionMetrics.table1`); SpFF + SpBP per iteration is
:meth:`PartitionMetrics.table1_spff_spbp`.  :func:`expected_random_spff` is the closed form of
the random ("SGD") row for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from partition.partitioners import Partition

__all__ = [
    "PartitionMetrics",
    "expected_random_spff",
    "format_table",
    "pair_volumes",
    "partition_metrics",
]


def pair_volumes(W: sp.spmatrix, owner: np.ndarray, prev_owner: np.ndarray, parts: int
                 ) -> np.ndarray:
    """D^k[m, n]: x^{k-1} entries of processor n needed by the rows of processor m (eqs. 8-9).

    The diagonal (local entries) is zeroed.  Returns a dense (parts, parts) int64 array.
    """
    A = sp.csr_matrix(W, copy=True)
    A.data[:] = 1.0
    n_rows, n_cols = A.shape
    rows_by_part = sp.csr_matrix((np.ones(n_rows), (owner, np.arange(n_rows))),
                                 shape=(parts, n_rows))
    need = rows_by_part @ A  # need[m, j] > 0 iff processor m uses x^{k-1}(j)
    need = sp.csr_matrix(need)
    need.data[:] = 1.0
    cols_by_part = sp.csr_matrix((np.ones(n_cols), (np.arange(n_cols), prev_owner)),
                                 shape=(n_cols, parts))
    D = np.rint((need @ cols_by_part).toarray()).astype(np.int64)
    np.fill_diagonal(D, 0)
    return D


@dataclass(frozen=True)
class PartitionMetrics:
    """Per-processor communication and work of one SpFF + SpBP iteration (batch column 1).

    Attributes
    ----------
    pair_words : np.ndarray, shape (L, P, P)
        ``pair_words[k-1, m, n]`` = D^k[m, n] (see module docstring).
    spff_volume, spbp_volume : np.ndarray, shape (L, P)
        Words sent by every processor in layer k of SpFF and SpBP.
    spff_messages, spbp_messages : np.ndarray, shape (L, P)
        Messages sent by every processor in layer k of SpFF and SpBP.
    flops : np.ndarray, shape (P,)
        Multiply-adds of one iteration: nnz(W^k_m) for SpFF, SpBP and the update (x 3).
    """

    parts: int
    pair_words: np.ndarray
    spff_volume: np.ndarray
    spbp_volume: np.ndarray
    spff_messages: np.ndarray
    spbp_messages: np.ndarray
    flops: np.ndarray

    @property
    def num_layers(self) -> int:
        return int(self.pair_words.shape[0])

    @property
    def send_volume(self) -> np.ndarray:
        """Words sent per processor per iteration, SpFF + SpBP, all layers."""
        return self.spff_volume.sum(axis=0) + self.spbp_volume.sum(axis=0)

    @property
    def send_messages(self) -> np.ndarray:
        """Messages sent per processor per iteration, SpFF + SpBP, all layers."""
        return self.spff_messages.sum(axis=0) + self.spbp_messages.sum(axis=0)

    @property
    def total_volume(self) -> int:
        return int(self.send_volume.sum())

    @property
    def total_messages(self) -> int:
        return int(self.send_messages.sum())

    @property
    def imbalance(self) -> float:
        """Computational imbalance max/avg of the flops (Table 1, column imb)."""
        return float(self.flops.max() / self.flops.mean()) if self.flops.mean() > 0 else 1.0

    def table1(self) -> dict:
        """Table 1 of the paper: SpFF words and messages a processor sends per layer (one
        direction, one input vector), average and maximum over processors, and the
        computational imbalance.

        ``avg_volume`` = mean_m (1/L) sum_k V^k_m and ``max_volume`` = max_m of the same (V^k_m:
        words processor m sends in SpFF of layer k); messages likewise.  The totals are SpFF
        words / messages of one forward pass over all processors and layers.
        """
        L = self.num_layers
        v, msg = self.spff_volume.sum(axis=0) / L, self.spff_messages.sum(axis=0) / L
        return {"avg_volume": float(v.mean()), "max_volume": float(v.max()),
                "avg_messages": float(msg.mean()), "max_messages": float(msg.max()),
                "imbalance": self.imbalance, "total_volume": int(self.spff_volume.sum()),
                "total_messages": int(self.spff_messages.sum())}

    def table1_spff_spbp(self) -> dict:
        """The Table-1 columns for one training iteration: SpFF + SpBP words and messages a
        processor sends per layer (SpBP sends back the partial sums s^k, k >= 2), the same
        averages / maxima / imbalance, and the SpFF + SpBP totals."""
        L = self.num_layers
        v, msg = self.send_volume / L, self.send_messages / L
        return {"avg_volume": float(v.mean()), "max_volume": float(v.max()),
                "avg_messages": float(msg.mean()), "max_messages": float(msg.max()),
                "imbalance": self.imbalance, "total_volume": self.total_volume,
                "total_messages": self.total_messages}

    def expected_traffic(self, batch: int, itemsize: int, iterations: int = 1) -> dict:
        """Exact bytes and messages of ``iterations`` SpFF+SpBP iterations on mini-batches.

        Returns ``{"spff": {"bytes", "messages"}, "spbp": {...}}``, summed over processors.
        """
        scale = batch * itemsize * iterations
        return {
            "spff": {"bytes": int(self.spff_volume.sum()) * scale,
                     "messages": int(self.spff_messages.sum()) * iterations},
            "spbp": {"bytes": int(self.spbp_volume.sum()) * scale,
                     "messages": int(self.spbp_messages.sum()) * iterations},
        }


def expected_random_spff(n_prev: int, parts: int, column_degree: int) -> dict:
    """Closed form of the random ("SGD") row of Table 1 for one layer.

    Processor n owns N_{k-1}/P entries of x^{k-1}; entry j is used by ``column_degree`` rows of
    W^k, each on a uniformly random processor, so it goes to
    (P - 1)(1 - (1 - 1/P)^d) other processors on average and

        E[R] = (N_{k-1}/P) (P - 1) (1 - (1 - 1/P)^d)

    words leave processor n in SpFF (the Graph Challenge networks: d = 32).  n sends no message
    to m only if none of its entries is used by m: E[messages] = (P - 1)(1 - (1 - q)^{N_{k-1}/P})
    with q = 1 - (1 - 1/P)^d (entries treated as independent).  Balanced random parts draw rows
    without replacement, so both are approximations (within ~2 % at the paper's sizes).
    """
    if parts < 1 or n_prev < 1 or column_degree < 0:
        raise ValueError("n_prev and parts must be >= 1 and column_degree >= 0")
    q = 1.0 - (1.0 - 1.0 / parts) ** column_degree
    per = n_prev / parts
    return {"avg_volume": per * (parts - 1) * q,
            "avg_messages": (parts - 1) * (1.0 - (1.0 - q) ** per)}


def partition_metrics(weights, partition: Partition) -> PartitionMetrics:
    """Communication volume, message counts and flops of SpFF + SpBP under ``partition``."""
    partition.check_network(weights)
    P, L = partition.parts, len(weights)
    pair = np.zeros((L, P, P), dtype=np.int64)
    flops = np.zeros(P, dtype=np.int64)
    for k, W in enumerate(weights, start=1):
        owner = np.asarray(partition.owners[k])
        pair[k - 1] = pair_volumes(W, owner, np.asarray(partition.owners[k - 1]), P)
        flops += 3 * np.bincount(owner, weights=np.diff(sp.csr_matrix(W).indptr),
                                 minlength=P).astype(np.int64)
    # SpFF: n sends D[m, n] to m -> column sums; SpBP (k >= 2): m sends D[m, n] to n -> row sums
    spff_volume = pair.sum(axis=1)
    spff_messages = (pair > 0).sum(axis=1)
    spbp_volume = pair.sum(axis=2)
    spbp_messages = (pair > 0).sum(axis=2)
    spbp_volume[0] = 0
    spbp_messages[0] = 0
    return PartitionMetrics(parts=P, pair_words=pair, spff_volume=spff_volume,
                            spbp_volume=spbp_volume, spff_messages=spff_messages,
                            spbp_messages=spbp_messages, flops=flops)


def format_table(rows: list[tuple[str, PartitionMetrics]]) -> str:
    """Table-1 style text, one line per (label, metrics): the paper's SpFF columns
    (:meth:`PartitionMetrics.table1`), then the SpFF + SpBP words per processor per layer."""
    head = (f"{'partition':<14}{'avg vol':>10}{'max vol':>10}{'avg msg':>9}{'max msg':>9}"
            f"{'imb':>7}{'total vol':>12}{'total msg':>11}{'ff+bp avg':>11}")
    lines = [head, "-" * len(head)]
    for label, m in rows:
        t, b = m.table1(), m.table1_spff_spbp()
        lines.append(f"{label:<14}{t['avg_volume']:>10.1f}{t['max_volume']:>10.1f}"
                     f"{t['avg_messages']:>9.2f}{t['max_messages']:>9.2f}{t['imbalance']:>7.3f}"
                     f"{t['total_volume']:>12d}{t['total_messages']:>11d}"
                     f"{b['avg_volume']:>11.1f}")
    return "\n".join(lines)
