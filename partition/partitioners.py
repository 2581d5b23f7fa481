"""Row partitions of a sparse DNN: hypergraph (H-SGD, §5) and uniformly random (SGD baseline).

A :class:`Partition` holds ``owners[k][i]``, the processor that computes x^k(i) (k = 0 is the
input vector), so the rows of W^k owned by processor m are ``owners[k] == m`` (the row-wise
partition of §4) and the x^{k-1} entries it owns are ``owners[k-1] == m``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from partition.hypergraph import LayerHypergraph, build_layer_hypergraph, compress_hypergraph

__all__ = [
    "PARTITIONERS",
    "HypergraphConfig",
    "Partition",
    "hypergraph_partition",
    "input_owner_from_connectivity",
    "make_partition",
    "random_partition",
]

PRESETS = ("default", "quality", "highest_quality", "deterministic", "deterministic_quality")


@dataclass(frozen=True)
class Partition:
    """Ownership of every neuron of every layer.

    Attributes
    ----------
    owners : tuple of np.ndarray
        ``owners[k]`` (k = 0..L) maps neuron i of layer k to its processor in [0, parts).
    parts : int
        Number of processors P.
    method : str
        Name of the partitioner that produced it.
    seconds : float
        Wall time spent partitioning.
    """

    owners: tuple
    parts: int
    method: str = "unknown"
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.parts < 1:
            raise ValueError(f"parts must be >= 1, got {self.parts}")
        for k, o in enumerate(self.owners):
            o = np.asarray(o)
            if o.ndim != 1 or (o.size and (o.min() < 0 or o.max() >= self.parts)):
                raise ValueError(f"owners[{k}] must be a 1-D array of parts in [0, {self.parts})")

    @property
    def num_layers(self) -> int:
        return len(self.owners) - 1

    def rows_of(self, k: int, m: int) -> np.ndarray:
        """Sorted global indices of x^k owned by processor m (rows of W^k_m for k >= 1)."""
        return np.flatnonzero(np.asarray(self.owners[k]) == m)

    def check_network(self, weights) -> None:
        """Raise ValueError unless the partition fits the layer sizes of ``weights``."""
        if len(weights) != self.num_layers:
            raise ValueError(f"partition has {self.num_layers} layers, network has "
                             f"{len(weights)}; partition the same network")
        for k, W in enumerate(weights, start=1):
            if W.shape != (self.owners[k].size, self.owners[k - 1].size):
                raise ValueError(f"layer {k}: W has shape {W.shape} but the partition covers "
                                 f"({self.owners[k].size}, {self.owners[k - 1].size})")

    def save(self, path) -> None:
        """Save to ``.npz`` (``owner_0 .. owner_L`` plus parts and method)."""
        arrays = {f"owner_{k}": np.asarray(o, dtype=np.int32) for k, o in enumerate(self.owners)}
        np.savez_compressed(path, parts=self.parts, method=self.method, seconds=self.seconds,
                            num_layers=self.num_layers, **arrays)

    @classmethod
    def load(cls, path) -> "Partition":
        """Load a partition written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as f:
            L = int(f["num_layers"])
            owners = tuple(np.asarray(f[f"owner_{k}"], dtype=np.int64) for k in range(L + 1))
            return cls(owners=owners, parts=int(f["parts"]), method=str(f["method"]),
                       seconds=float(f["seconds"]))


def _balanced_random_owner(n: int, P: int, rng: np.random.Generator) -> np.ndarray:
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = (np.arange(n) * P) // n
    return owner


def random_partition(weights, parts: int, *, seed: int = 0) -> Partition:
    """The "SGD" baseline of §6.1: neurons of every layer assigned uniformly at random.

    Every layer (and x^0) is split into ``parts`` parts of sizes differing by at most one.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    sizes = [weights[0].shape[1]] + [W.shape[0] for W in weights]
    owners = tuple(_balanced_random_owner(n, parts, rng) for n in sizes)
    return Partition(owners=owners, parts=parts, method="random",
                     seconds=time.perf_counter() - t0)


def input_owner_from_connectivity(W1: sp.spmatrix, owner1: np.ndarray, parts: int) -> np.ndarray:
    """Place x^0 from the connectivity of the nets of H(phi_1) (§5, Fig. 3).

    x^0(j) goes to the part holding most pins of net n_j (ties: lowest part id), so it is sent to
    lambda(n_j) - 1 parts and never adds a part to the net; unused entries are dealt round-robin.
    """
    A = sp.csr_matrix(W1, copy=True)
    A.data[:] = 1.0
    n0 = A.shape[1]
    onehot = sp.csr_matrix((np.ones(owner1.size), (owner1, np.arange(owner1.size))),
                           shape=(parts, owner1.size))
    C = sp.csc_matrix(onehot @ A)  # C[m, j] = pins of net j in part m
    owner0 = np.asarray(C.argmax(axis=0)).ravel().astype(np.int64)
    empty = np.flatnonzero(np.diff(C.indptr) == 0)
    owner0[empty] = np.arange(empty.size) % parts
    return owner0


@dataclass(frozen=True)
class HypergraphConfig:
    """Options of the Mt-KaHyPar backend.

    Attributes
    ----------
    epsilon : float
        Maximum allowed imbalance of eq. 2 (paper: 0.01).
    preset : str
        Mt-KaHyPar preset, one of ``default, quality, highest_quality, deterministic,
        deterministic_quality`` (``large_k`` does not support fixed vertices).
    threads : int
        Threads for Mt-KaHyPar (0: all cores available to the process).
    seed : int
        Mt-KaHyPar seed.
    compress : bool
        Hand Mt-KaHyPar the lossless-compressed H(phi_k) of :func:`compress_hypergraph`
        (identical rows grouped in chunks, one fixed vertex per part, identical nets merged with
        summed cost) instead of the full one.  Same cut size for every partition it can express.
    chunk_divisor : int
        Identical rows are grouped in chunks of at most ``max(1, N_k / (parts * chunk_divisor))``
        rows so balance stays reachable.
    """

    epsilon: float = 0.01
    preset: str = "default"
    threads: int = 0
    seed: int = 0
    compress: bool = True
    chunk_divisor: int = 1

    def __post_init__(self):
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.chunk_divisor < 1:
            raise ValueError(f"chunk_divisor must be >= 1, got {self.chunk_divisor}")
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {PRESETS}, got {self.preset!r}")


class _MtKaHyPar:
    """Process-wide Mt-KaHyPar handle (``mtkahypar.initialize`` may run once per process)."""

    _initializer = None
    _threads = None

    @classmethod
    def get(cls, threads: int):
        import mtkahypar

        if cls._initializer is None:
            cls._threads = threads
            cls._initializer = mtkahypar.initialize(threads, False)
        return mtkahypar, cls._initializer


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _block_capacity(total_free_weight: int, parts: int, epsilon: float) -> int:
    """Maximum free weight of a block, W_avg (1 + eps) of eq. 2 (at least ceil(W_avg))."""
    return max(int(np.floor(total_free_weight / parts * (1.0 + epsilon))),
               int(np.ceil(total_free_weight / parts)))


def _run_mtkahypar(hg: LayerHypergraph, parts: int, cfg: HypergraphConfig, layer: int,
                   cap: int) -> np.ndarray:
    """Partition one hypergraph with Mt-KaHyPar, objective km1, fixed vertices honoured.

    Fixed vertices carry weight 1 (Mt-KaHyPar 1.7 moves zero-weight fixed vertices out of their
    block), so each block's capacity is ``cap`` of free weight plus the number of fixed vertices
    pinned to that block.  Returns the block of every free vertex; raises RuntimeError if a fixed
    vertex left its block.
    """
    mtk, ini = _MtKaHyPar.get(cfg.threads or _available_cores())
    mtk.set_seed(int(cfg.seed) + layer)
    ctx = ini.context_from_preset(getattr(mtk.PresetType, cfg.preset.upper()))
    ctx.set_partitioning_parameters(parts, cfg.epsilon, mtk.Objective.KM1)
    ctx.logging = False
    n_fixed = (np.bincount(hg.fixed[hg.fixed >= 0], minlength=parts) if hg.has_fixed
               else np.zeros(parts, dtype=np.int64))
    vw = hg.vertex_weight.copy()
    vw[hg.num_rows:] = 1
    nets = np.split(hg.pins, hg.net_ptr[1:-1])
    h = ini.create_hypergraph(ctx, hg.num_vertices, hg.num_nets, [e.tolist() for e in nets],
                              vw.tolist(), hg.net_cost.tolist())
    if hg.has_fixed:
        h.add_fixed_vertices(hg.fixed.tolist(), parts)
    ctx.set_individual_target_block_weights((cap + n_fixed).tolist())
    part = np.asarray(h.partition(ctx).get_partition(), dtype=np.int64)
    if hg.has_fixed:
        moved = np.flatnonzero(part[hg.num_rows:] != hg.fixed[hg.num_rows:])
        if moved.size:
            raise RuntimeError(f"Mt-KaHyPar moved {moved.size} fixed vertices of layer {layer}; "
                               "the partition would not encode the communication of §5")
    return part[:hg.num_rows]


def partition_layer(W: sp.spmatrix, prev_owner: np.ndarray | None, parts: int,
                    cfg: HypergraphConfig, layer: int = 1) -> np.ndarray:
    """Phase phi_k: partition the rows of W^k with x^{k-1} placed by ``prev_owner`` (§5).

    Returns the part of every row; the balance of eq. 2 is enforced (repaired greedily if
    Mt-KaHyPar misses it) and fixed vertices are checked.
    """
    full = build_layer_hypergraph(W, prev_owner, fixed_weight=1)
    cap = _block_capacity(int(full.vertex_weight[:full.num_rows].sum()), parts, cfg.epsilon)
    if cfg.compress:
        chunk = max(1, W.shape[0] // (parts * cfg.chunk_divisor))
        small, row_to_vertex = compress_hypergraph(W, prev_owner, parts, chunk)
        owner = _run_mtkahypar(small, parts, cfg, layer, cap)[row_to_vertex]
    else:
        owner = _run_mtkahypar(full, parts, cfg, layer, cap)
    return _rebalance(full, owner, parts, cap)


def _rebalance(hg: LayerHypergraph, owner: np.ndarray, parts: int, cap: int) -> np.ndarray:
    """Move vertices out of blocks over ``cap`` (Mt-KaHyPar may miss a tight balance).

    Greedy: from the heaviest block move, into the lightest block, the vertex whose nets already
    touch the lightest block the most; only moves that lower the heavier of the two loads are
    made.  A no-op for a balanced partition; with vertex weights too coarse for ``cap`` it stops
    at the best balance it reaches (the imbalance is reported by the metrics).
    """
    w = hg.vertex_weight[:hg.num_rows]
    load = np.bincount(owner, weights=w, minlength=parts)
    if load.max() <= cap:
        return owner
    owner = owner.copy()
    part_full = np.concatenate((owner, np.maximum(hg.fixed[hg.num_rows:], 0)))
    net_of_pin = np.repeat(np.arange(hg.num_nets), np.diff(hg.net_ptr))
    row_mask = hg.pins < hg.num_rows
    vertex_nets = sp.csr_matrix((np.ones(int(row_mask.sum())),
                                 (hg.pins[row_mask], net_of_pin[row_mask])),
                                shape=(hg.num_rows, hg.num_nets))
    for _ in range(hg.num_rows):
        src = int(np.argmax(load))
        dst = int(np.argmin(load))
        if load[src] <= cap:
            break
        cand = np.flatnonzero(owner == src)
        cand = cand[load[dst] + w[cand] < load[src]]
        if cand.size == 0:
            break
        pin_in_dst = np.bincount(net_of_pin, weights=part_full[hg.pins] == dst,
                                 minlength=hg.num_nets)
        score = vertex_nets[cand] @ pin_in_dst
        v = int(cand[np.argmax(score)])
        owner[v] = dst
        part_full[v] = dst
        load[src] -= w[v]
        load[dst] += w[v]
    return owner


def hypergraph_partition(weights, parts: int, config: HypergraphConfig = HypergraphConfig()
                         ) -> Partition:
    """H-SGD partition: phases phi_1 .. phi_L of the fixed-vertex hypergraph model (§5).

    Phase phi_1 partitions W^1 without fixed vertices and places x^0 from net connectivity; phase
    phi_k (k >= 2) pins the fixed vertex of column j to the part that computed x^{k-1}(j).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    t0 = time.perf_counter()
    owners = [None] * (len(weights) + 1)
    if parts == 1:
        owners[0] = np.zeros(weights[0].shape[1], dtype=np.int64)
        for k, W in enumerate(weights, start=1):
            owners[k] = np.zeros(W.shape[0], dtype=np.int64)
    else:
        for k, W in enumerate(weights, start=1):
            owners[k] = partition_layer(W, None if k == 1 else owners[k - 1], parts, config, k)
            if k == 1:
                owners[0] = input_owner_from_connectivity(W, owners[1], parts)
    return Partition(owners=tuple(owners), parts=parts, method="hypergraph",
                     seconds=time.perf_counter() - t0,
                     info={"preset": config.preset, "epsilon": config.epsilon,
                           "compress": config.compress})


#: registry of partitioners keyed by ``--method``/``--partition`` name
PARTITIONERS = {
    "hypergraph": lambda weights, parts, seed=0, **kw: hypergraph_partition(
        weights, parts, HypergraphConfig(seed=seed, **kw)),
    "random": lambda weights, parts, seed=0, **kw: random_partition(weights, parts, seed=seed),
}


def make_partition(method: str, weights, parts: int, *, seed: int = 0, **kwargs) -> Partition:
    """Partition ``weights`` into ``parts`` with the registered ``method``."""
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partition method {method!r}: choose one of "
                         f"{sorted(PARTITIONERS)}")
    return PARTITIONERS[method](weights, parts, seed=seed, **kwargs)
