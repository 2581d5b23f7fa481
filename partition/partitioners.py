"""Row partitions of a sparse DNN: hypergraph (H-SGD, §5) and uniformly random (SGD baseline).

A :class:`Partition` holds ``owners[k][i]``, the processor that computes x^k(i) (k = 0 is the
input vector), so the rows of W^k owned by processor m are ``owners[k] == m`` (the row-wise
partition of §4) and the x^{k-1} entries it owns are ``owners[k-1] == m``.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import multiprocessing
import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from partition.hypergraph import (
    LayerHypergraph,
    build_layer_hypergraph,
    compress_hypergraph,
    connectivity_cutsize,
)
from partition.period import LayerPeriod, find_period, layer_period
from partition.placement import INPUT_PLACEMENTS, place_inputs
from substrate.options import check_choices, option
from substrate.results import atomic_write_bytes

__all__ = [
    "DEFAULT_PRESET",
    "ENGINES",
    "KAHYPAR_PRESETS",
    "MTKAHYPAR_PRESETS",
    "PARTITIONERS",
    "PHASES",
    "PRESETS",
    "HypergraphConfig",
    "Partition",
    "PartitionOptions",
    "cpu_seconds",
    "hypergraph_partition",
    "input_owner_from_connectivity",
    "layer_period",
    "make_partition",
    "partitioner_errors",
    "random_partition",
]

#: partitioning engines (``--engine``): Mt-KaHyPar (shared memory, parallel) and sequential
#: KaHyPar (PyPI ``kahypar``), both with fixed vertices and the km1 objective (eq. 1)
ENGINES = ("mtkahypar", "kahypar")
#: Mt-KaHyPar presets (``large_k`` does not support fixed vertices)
MTKAHYPAR_PRESETS = ("default", "quality", "highest_quality", "deterministic",
                     "deterministic_quality")
#: KaHyPar presets: direct k-way km1 configurations written out by :func:`_kahypar_ini`.
#: ``fast``: single-level: no coarsening, no community detection; recursive
#: bisection of the whole hypergraph, each bisection one greedy-global growing run refined by
#: 2-way FM stopped after 10 moves without gain; no k-way FM after the bisections (it changed no
#: partition measured and took minutes on a 16384-row random layer).  It measured the
#: multilevel form it replaced (coarsening to 160 k vertices, then inside every bisection to 400)
#: as slower and worse on every input tried: a 16384-row random 32-regular layer with fixed
#: vertices 0.58 vs 2.84 s CPU at km1 278,177 vs 291,596 (a random partition: 324,108); four
#: 16384-row banded layers 1.29 vs 4.00 s at 665 vs 782 words (``fast_communities`` 38.2 s,
#: 475 words); eight relabelled Graph Challenge layers 262.6 vs 267.0 words.  Heavy-edge
#: matching on layers without clusters merges unrelated rows, and without k-way refinement the
#: coarse partition is never repaired; ``fast_communities``: the earlier ``fast``
#: (Louvain communities, multilevel, one run of the pool of initial partitioners, k-way FM);
#: ``km1``: 20 runs; ``km1_flows``: 20 runs and flow-based refinement
KAHYPAR_PRESETS = ("fast", "fast_communities", "km1", "km1_flows")
PRESETS = MTKAHYPAR_PRESETS + KAHYPAR_PRESETS
#: how the phases of the multi-phase model follow each other (``HypergraphConfig.phases``)
PHASES = ("chained", "independent")
#: the preset each engine uses when none is given (deterministic for a given seed)
DEFAULT_PRESET = {"mtkahypar": "deterministic", "kahypar": "fast"}


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
        """Save to ``.npz`` (``owner_0 .. owner_L`` plus parts and method), atomically."""
        arrays = {f"owner_{k}": np.asarray(o, dtype=np.int32) for k, o in enumerate(self.owners)}
        buf = io.BytesIO()
        np.savez_compressed(buf, parts=self.parts, method=self.method, seconds=self.seconds,
                            num_layers=self.num_layers, **arrays)
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path) -> Partition:
        """Load a partition written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as f:
            L = int(f["num_layers"])
            owners = tuple(np.asarray(f[f"owner_{k}"], dtype=np.int64) for k in range(L + 1))
            return cls(owners=owners, parts=int(f["parts"]), method=str(f["method"]),
                       seconds=float(f["seconds"]))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def partitioner_errors():
    """Turn an error raised inside Mt-KaHyPar (ANSI-coloured, naming no input) into a
    ``ValueError`` that says which tool failed and what to check."""
    try:
        yield
    except Exception as exc:
        if not type(exc).__module__.startswith("mtkahypar"):
            raise
        text = _ANSI.sub("", str(exc)).strip()
        raise ValueError(f"Mt-KaHyPar rejected a layer's hypergraph ({type(exc).__name__}: "
                         f"{text}); check the network (every layer needs nonzero weights) or "
                         "use --method random / --partition random") from None


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


def input_owner_from_connectivity(W1: sp.spmatrix, owner1: np.ndarray, parts: int,
                                  rule: str = "balanced") -> np.ndarray:
    """Place x^0 inside the connectivity sets of the nets of H(phi_1) (§5, Fig. 3), balancing
    the entries and the layer-1 sends per processor (:func:`partition.placement.place_inputs`)."""
    return place_inputs(W1, owner1, parts, rule)


@dataclass(frozen=True)
class HypergraphConfig:
    """Options of the hypergraph partitioning of §5.

    Attributes
    ----------
    epsilon : float
        Maximum allowed imbalance of eq. 2 (paper: 0.01).
    engine : str
        ``"kahypar"`` (sequential KaHyPar, the default of every command: ``sparse_sgd``'s
        :class:`~sparse_sgd.plan.PartitionOptions` and ``python -m partition layers``) or
        ``"mtkahypar"`` (Mt-KaHyPar).
    preset : str or None
        Engine preset: Mt-KaHyPar's ``default, quality, highest_quality, deterministic,
        deterministic_quality`` or KaHyPar's ``fast, fast_communities, km1, km1_flows``
        (:data:`KAHYPAR_PRESETS`); None picks
        :data:`DEFAULT_PRESET` of the engine (both deterministic for a given seed).
    threads : int
        Mt-KaHyPar threads (0: all cores available to the process).  Ignored by KaHyPar.
    seed : int
        Partitioner seed (layer k uses ``seed + k``).
    compress : bool
        Hand the engine the lossless-compressed H(phi_k) of :func:`compress_hypergraph`
        (identical rows grouped in chunks, one fixed vertex per part, identical nets merged with
        summed cost) instead of the full one.  Same cut size for every partition it can express.
    chunk_divisor : int
        Identical rows are grouped in chunks of at most ``max(1, N_k / (parts * chunk_divisor))``
        rows so balance stays reachable.
    phases : str
        ``independent`` (the default, a deviation): every phase is partitioned without fixed
        vertices, all at once (``workers`` processes), then the part ids of layer k are permuted
        to agree best with layer k-1 (:func:`_align_parts`: the permutation that keeps most
        x^{k-1}(j) inside the connectivity set of their net, an exact linear assignment on the
        cut size of eq. 1).  ``chained`` (§5, the paper's order): phase phi_k pins the fixed
        vertex of net n_j to the part that computed x^{k-1}(j) in phase phi_{k-1}, one phase
        after the other, on one core.  On layers without structure both cut alike (random
        32-regular, N = 1024, L = 120, P = 32: 547.38 and 547.37 SpFF words per processor per
        layer); the chain cannot use a second core.  Used for layers that no structure covers
        (the period of a tiled network is always chained).
    workers : int
        Processes partitioning independent phases at the same time (0: every core this process
        may run on; a command run as an MPI rank passes the rank's share of its node's cores).
        KaHyPar only, Mt-KaHyPar runs its own threads.  The result does not depend on it.
    input_placement : str
        How x^0 is placed after phase phi_1 (:data:`partition.placement.INPUT_PLACEMENTS`):
        ``balanced`` (inside the nets' connectivity sets, balancing entries and layer-1 sends)
        or ``most_pins`` (the earlier rule).
    tile : bool
        When the layer sequence is periodic, exactly (:func:`partition.period.layer_period`:
        W^{k+p} has the sparsity of W^k for every k) or up to a relabelling of the hidden
        neurons found from the data (:func:`partition.period.relabelled_period`, e.g. the Graph
        Challenge files), partition one period, then the period's first layer again with its
        fixed vertices from the period's last layer (the wrap-around phase), and repeat that
        period's owners over all layers (through the relabelling).  A valid partition of every
        layer; its volumes are measured on the full network like any other partition.
    """

    epsilon: float = 0.01
    engine: str = "kahypar"
    preset: str | None = None
    threads: int = 1
    seed: int = 0
    compress: bool = True
    chunk_divisor: int = 1
    tile: bool = True
    input_placement: str = "balanced"
    phases: str = "independent"
    workers: int = 0

    def __post_init__(self):
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.chunk_divisor < 1:
            raise ValueError(f"chunk_divisor must be >= 1, got {self.chunk_divisor}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        presets = MTKAHYPAR_PRESETS if self.engine == "mtkahypar" else KAHYPAR_PRESETS
        if self.preset is not None and self.preset not in presets:
            raise ValueError(f"preset {self.preset!r} is not a {self.engine} preset: choose one "
                             f"of {presets}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: all cores), got {self.threads}")
        if self.phases not in PHASES:
            raise ValueError(f"phases must be one of {PHASES}, got {self.phases!r}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: all cores), got {self.workers}")
        if self.input_placement not in INPUT_PLACEMENTS:
            raise ValueError(f"input_placement must be one of {INPUT_PLACEMENTS}, got "
                             f"{self.input_placement!r}")

    @property
    def resolved_preset(self) -> str:
        return self.preset or DEFAULT_PRESET[self.engine]


#: the ``--help`` group of :class:`PartitionOptions`
PARTITION_GROUP = "row partition (H-SGD §5)"


@dataclass(frozen=True)
class PartitionOptions:
    """The hypergraph partitioner's command-line options, declared once for every command that
    partitions (``python -m partition layers``, ``sparse_sgd train|infer|partition``,
    ``commvol predict --system hsgd``, ``commvol partition-table``); defaults are
    :class:`HypergraphConfig`'s."""

    engine: str = option("kahypar", "hypergraph partitioner: sequential KaHyPar or Mt-KaHyPar",
                         choices=ENGINES, group=PARTITION_GROUP)
    preset: str | None = option(
        None, f"engine preset (kahypar: {', '.join(KAHYPAR_PRESETS)}; mtkahypar: "
        f"{', '.join(MTKAHYPAR_PRESETS)}; default: fast / deterministic, both deterministic "
        "for the seed)", choices=PRESETS, group=PARTITION_GROUP)
    epsilon: float = option(0.01, "allowed imbalance of eq. 2", group=PARTITION_GROUP)
    threads: int = option(1, "Mt-KaHyPar threads (0: all cores; more than one makes the "
                          "partition depend on thread timing)", group=PARTITION_GROUP)
    tile: bool = option(True, "partition every layer (default: partition one period of a "
                        "periodic layer sequence, exact or up to a relabelling of the hidden "
                        "neurons, and repeat it)", group=PARTITION_GROUP)
    phases: str = option("independent", "independent: every layer without fixed vertices, in "
                         "--workers processes, part ids aligned to the previous layer (a "
                         "deviation, the default: it uses every core); chained: phase k's fixed "
                         "vertices from phase k-1, one layer after the other (§5)",
                         choices=PHASES, group=PARTITION_GROUP)
    workers: int = option(0, "processes for --phases independent (0: this rank's share of its "
                          "node's cores)", group=PARTITION_GROUP)

    def __post_init__(self) -> None:
        check_choices(self)  # every field's choices, a subclass's too
        self.hypergraph_config(0)  # validates epsilon/threads/workers, the preset for the engine

    def hypergraph_config(self, seed: int, *, cores: int | None = None) -> HypergraphConfig:
        """The library configuration; ``cores`` replaces ``workers = 0`` (a rank's share)."""
        workers = self.workers or (cores or 0)
        return HypergraphConfig(epsilon=self.epsilon, engine=self.engine, preset=self.preset,
                                threads=self.threads, seed=seed, tile=self.tile,
                                phases=self.phases, workers=workers)


class _MtKaHyPar:
    """Process-wide Mt-KaHyPar handle (``mtkahypar.initialize`` may run once per process, so
    the first call's thread count stays for the process)."""

    _initializer = None
    _threads = None

    @classmethod
    def get(cls, threads: int):
        import mtkahypar  # noqa: PLC0415 (optional partitioner, compiled extension)

        if cls._initializer is None:
            cls._threads = threads
            cls._initializer = mtkahypar.initialize(threads, False)
        return mtkahypar, cls._initializer


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (the
    workers of independent phases are joined before a partitioning returns)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _block_capacity(total_free_weight: int, parts: int, epsilon: float) -> int:
    """Maximum free weight of a block, W_avg (1 + eps) of eq. 2 (at least ceil(W_avg))."""
    return max(int(np.floor(total_free_weight / parts * (1.0 + epsilon))),
               int(np.ceil(total_free_weight / parts)))


def _free_capacities(hg: LayerHypergraph, parts: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Vertex weights with fixed vertices at weight 1 and the block capacities that allow
    ``cap`` free weight per block plus its fixed vertices (both engines move zero-weight fixed
    vertices out of their block, so fixed vertices weigh 1)."""
    n_fixed = (np.bincount(hg.fixed[hg.fixed >= 0], minlength=parts) if hg.has_fixed
               else np.zeros(parts, dtype=np.int64))
    vw = hg.vertex_weight.copy()
    vw[hg.num_rows:] = 1
    return vw, cap + n_fixed


def _check_fixed(hg: LayerHypergraph, part: np.ndarray, layer: int, engine: str) -> None:
    if hg.has_fixed:
        moved = np.flatnonzero(part[hg.num_rows:] != hg.fixed[hg.num_rows:])
        if moved.size:
            raise RuntimeError(f"{engine} moved {moved.size} fixed vertices of layer {layer}; "
                               "the partition would not encode the communication of §5")


def _run_mtkahypar(hg: LayerHypergraph, parts: int, cfg: HypergraphConfig, layer: int,
                   cap: int) -> np.ndarray:
    """Partition one hypergraph with Mt-KaHyPar, objective km1, fixed vertices honoured.

    Returns the block of every free vertex; raises RuntimeError if a fixed vertex left its
    block.
    """
    mtk, ini = _MtKaHyPar.get(cfg.threads or _available_cores())
    mtk.set_seed(int(cfg.seed) + layer)
    ctx = ini.context_from_preset(getattr(mtk.PresetType, cfg.resolved_preset.upper()))
    ctx.set_partitioning_parameters(parts, cfg.epsilon, mtk.Objective.KM1)
    ctx.logging = False
    vw, caps = _free_capacities(hg, parts, cap)
    nets = np.split(hg.pins, hg.net_ptr[1:-1])
    h = ini.create_hypergraph(ctx, hg.num_vertices, hg.num_nets, [e.tolist() for e in nets],
                              vw.tolist(), hg.net_cost.tolist())
    if hg.has_fixed:
        h.add_fixed_vertices(hg.fixed.tolist(), parts)
    ctx.set_individual_target_block_weights(caps.tolist())
    part = np.asarray(h.partition(ctx).get_partition(), dtype=np.int64)
    _check_fixed(hg, part, layer, "Mt-KaHyPar")
    return part[:hg.num_rows]


#: KaHyPar direct k-way configurations (its INI keys), km1 objective, fixed vertices allowed in
#: coarsening; ``fast`` and ``km1`` refine with k-way FM, ``km1_flows`` adds flow-based
#: refinement
_KAHYPAR_COMMON = {
    "mode": "direct", "objective": "km1", "seed": "0", "cmaxnet": "-1", "vcycles": "0",
    "p-use-sparsifier": "false", "p-detect-communities": "true",
    "p-detect-communities-in-ip": "true", "p-reuse-communities": "false",
    "p-max-louvain-pass-iterations": "100", "p-min-eps-improvement": "0.0001",
    "p-louvain-edge-weight": "hybrid", "p-large-he-threshold": "1000",
    "p-smallest-maxnet-threshold": "50000", "p-maxnet-removal-factor": "0.01",
    "c-type": "ml_style", "c-s": "1", "c-t": "160", "c-rating-score": "heavy_edge",
    "c-rating-use-communities": "true", "c-rating-heavy_node_penalty": "no_penalty",
    "c-rating-acceptance-criterion": "best_prefer_unmatched",
    "c-fixed-vertex-acceptance-criterion": "fixed_vertex_allowed",
    "i-mode": "recursive", "i-technique": "multi", "i-c-type": "ml_style", "i-c-s": "1",
    "i-c-t": "150", "i-c-rating-score": "heavy_edge", "i-c-rating-use-communities": "true",
    "i-c-rating-heavy_node_penalty": "no_penalty",
    "i-c-rating-acceptance-criterion": "best_prefer_unmatched",
    "i-c-fixed-vertex-acceptance-criterion": "fixed_vertex_allowed",
    "i-algo": "pool", "i-runs": "20", "i-bp-algorithm": "worst_fit",
    "i-bp-heuristic-prepacking": "false", "i-bp-early-restart": "true",
    "i-bp-late-restart": "true", "i-r-type": "twoway_fm", "i-r-runs": "-1",
    "i-r-fm-stop": "simple", "i-r-fm-stop-i": "50",
    "r-runs": "-1", "r-fm-stop": "adaptive_opt", "r-fm-stop-alpha": "1", "r-fm-stop-i": "350",
}
#: KaHyPar coarsens until c-t * k vertices remain: this c-t leaves every hypergraph uncoarsened
_NO_COARSENING = 2**30
_KAHYPAR_PRESETS = {
    "fast": {**_KAHYPAR_COMMON, "r-type": "do_nothing", "i-runs": "1",
             "p-detect-communities": "false", "p-detect-communities-in-ip": "false",
             "c-rating-use-communities": "false", "i-c-rating-use-communities": "false",
             # single level: contraction limit c-t * k above any vertex count, flat bisections
             "c-t": str(_NO_COARSENING), "i-technique": "flat",
             "i-algo": "greedy_global", "i-r-fm-stop-i": "10"},
    "fast_communities": {**_KAHYPAR_COMMON, "r-type": "kway_fm_km1", "i-runs": "1"},
    "km1": {**_KAHYPAR_COMMON, "r-type": "kway_fm_km1"},
    "km1_flows": {**_KAHYPAR_COMMON, "r-type": "kway_fm_hyperflow_cutter_km1",
                  "r-flow-execution-policy": "exponential", "r-hfc-size-constraint": "mf-style",
                  "r-hfc-scaling": "16", "r-hfc-distance-based-piercing": "true",
                  "r-hfc-mbc": "true"},
}
_KAHYPAR_INI: dict[str, str] = {}


def _kahypar_ini(preset: str) -> str:
    """Path of the INI file of a KaHyPar preset (written once per process: the PyPI wheel ships
    no configuration files and ``Context.loadINIconfiguration`` only reads files)."""
    path = _KAHYPAR_INI.get(preset)
    if path is None or not os.path.exists(path):
        fd, path = tempfile.mkstemp(prefix=f"spardist-kahypar-{preset}-", suffix=".ini")
        with os.fdopen(fd, "w") as fh:
            fh.writelines(f"{k}={v}\n" for k, v in _KAHYPAR_PRESETS[preset].items())
        _KAHYPAR_INI[preset] = path
    return path


def _run_kahypar(hg: LayerHypergraph, parts: int, cfg: HypergraphConfig, layer: int,
                 cap: int) -> np.ndarray:
    """Partition one hypergraph with sequential KaHyPar (same contract as Mt-KaHyPar's)."""
    import kahypar  # noqa: PLC0415 (optional partitioner)

    vw, caps = _free_capacities(hg, parts, cap)
    h = kahypar.Hypergraph(hg.num_vertices, hg.num_nets, hg.net_ptr.tolist(), hg.pins.tolist(),
                           parts, hg.net_cost.tolist(), vw.tolist())
    for v in np.flatnonzero(hg.fixed >= 0).tolist():
        h.fixNodeToBlock(v, int(hg.fixed[v]))
    ctx = kahypar.Context()
    ctx.loadINIconfiguration(_kahypar_ini(cfg.resolved_preset))
    ctx.setK(parts)
    ctx.setEpsilon(cfg.epsilon)
    ctx.setCustomTargetBlockWeights(caps.tolist())
    ctx.setSeed(int(cfg.seed) + layer)
    ctx.suppressOutput(True)
    kahypar.partition(h, ctx)
    part = np.fromiter((h.blockID(v) for v in range(hg.num_vertices)), dtype=np.int64,
                       count=hg.num_vertices)
    _check_fixed(hg, part, layer, "KaHyPar")
    return part[:hg.num_rows]


_ENGINE_RUN = {"mtkahypar": _run_mtkahypar, "kahypar": _run_kahypar}


def partition_layer(W: sp.spmatrix, prev_owner: np.ndarray | None, parts: int,
                    cfg: HypergraphConfig, layer: int = 1) -> np.ndarray:
    """Phase phi_k: partition the rows of W^k with x^{k-1} placed by ``prev_owner`` (§5).

    Returns the part of every row; the balance of eq. 2 is enforced (repaired greedily if
    the engine misses it) and fixed vertices are checked.
    """
    W = sp.csr_matrix(W)
    weight = np.maximum(np.diff(W.indptr), 1)  # the vertex weights of build_layer_hypergraph
    cap = _block_capacity(int(weight.sum()), parts, cfg.epsilon)
    run = _ENGINE_RUN[cfg.engine]
    full = None
    if cfg.compress:
        chunk = max(1, W.shape[0] // (parts * cfg.chunk_divisor))
        small, row_to_vertex = compress_hypergraph(W, prev_owner, parts, chunk)
        if small.num_nets == 0:  # no net can be cut (KaHyPar 1.3 crashes on such a hypergraph)
            owner = _packed(small.vertex_weight[:small.num_rows], parts)[row_to_vertex]
        else:
            owner = run(small, parts, cfg, layer, cap)[row_to_vertex]
    else:
        full = build_layer_hypergraph(W, prev_owner, fixed_weight=1)
        owner = run(full, parts, cfg, layer, cap)
    if np.bincount(owner, weights=weight, minlength=parts).max() <= cap:
        return owner
    if full is None:
        full = build_layer_hypergraph(W, prev_owner, fixed_weight=1)
    return _rebalance(full, owner, parts, cap)


def _packed(weight: np.ndarray, parts: int) -> np.ndarray:
    """Vertices packed into ``parts`` blocks, heaviest first into the lightest block (LPT): the
    partition of a hypergraph without nets, where only the balance of eq. 2 counts."""
    load = [(0, b) for b in range(parts)]
    owner = np.empty(weight.size, dtype=np.int64)
    for v in np.argsort(-weight, kind="stable").tolist():
        w, b = heapq.heappop(load)
        owner[v] = b
        heapq.heappush(load, (w + int(weight[v]), b))
    return owner


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


def _phase_chain(weights, parts: int, config: HypergraphConfig, first_prev, first_k: int,
                 count: int) -> list:
    """Owners of layers first_k .. first_k + count - 1 partitioned phase by phase (§5)."""
    owners, prev = [], first_prev
    for k in range(first_k, first_k + count):
        prev = partition_layer(weights[k - 1], prev, parts, config, k)
        owners.append(prev)
    return owners


#: (weights, parts, config) of the independent phases, inherited by forked workers
_FREE_PHASES: tuple = ()


def _free_phase(k: int) -> np.ndarray:
    """Phase phi_k without fixed vertices (a worker of :func:`_independent_phases`)."""
    weights, parts, config = _FREE_PHASES
    return partition_layer(weights[k - 1], None, parts, config, k)


def _max_assignment(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns of the permutation maximising the sum of ``M`` (the linear assignment
    of :func:`scipy.optimize.linear_sum_assignment`, exact).  scipy.optimize is imported here:
    it takes 0.2 s, which every rank importing :mod:`partition` would pay at start."""
    from scipy.optimize import linear_sum_assignment  # noqa: PLC0415 (0.2 s to import)
    return linear_sum_assignment(-M)


def _align_parts(W, owner: np.ndarray, prev_owner: np.ndarray, parts: int) -> np.ndarray:
    """Permute the part ids of ``owner`` (rows of W) to minimise the cut size of eq. 1 with
    fixed vertices ``prev_owner``.

    Under a permutation sigma, net n_j has the parts sigma(S_j) of its rows plus the fixed part
    o_j, so lambda(n_j) = |S_j| + [o_j not in sigma(S_j)]: the cut size falls by one for every
    net whose fixed part is the image of one of its row parts.  sigma maximises
    sum_{a,b} [sigma(a) = b] M[a, b] with M[a, b] = #{j : a in S_j, o_j = b}: a linear
    assignment (:func:`scipy.optimize.linear_sum_assignment`), exact.
    """
    W = sp.csr_matrix(W)
    n_cols = W.shape[1]
    row_part = np.repeat(np.asarray(owner, dtype=np.int64), np.diff(W.indptr))
    if parts * n_cols <= _DENSE_SETS:  # a in S_j as a P x N_{k-1} mask
        in_set = np.zeros((parts, n_cols), dtype=bool)
        in_set[row_part, W.indices] = True
        a, j = np.nonzero(in_set)
    else:
        pairs = np.sort(row_part * n_cols + W.indices)
        a, j = np.divmod(pairs[np.r_[True, pairs[1:] != pairs[:-1]]], n_cols)
    M = np.bincount(a * parts + np.asarray(prev_owner, dtype=np.int64)[j],
                    minlength=parts * parts).reshape(parts, parts)
    rows, cols = _max_assignment(M)
    sigma = np.empty(parts, dtype=np.int64)
    sigma[rows] = cols
    return sigma[owner]


#: the largest P x N_{k-1} boolean mask :func:`_align_parts` builds (64 MiB); beyond, it sorts
_DENSE_SETS = 1 << 26
#: layers a worker of :func:`_independent_phases` takes at a time: few enough that
#: no worker idles long at the end, large enough that the hand-offs cost nothing measurable
_PHASES_PER_TASK = 2


def _independent_phases(weights, parts: int, config: HypergraphConfig, first_prev,
                        first_k: int, count: int) -> list:
    """Owners of layers first_k .. first_k + count - 1, each phase partitioned without fixed
    vertices (in ``config.workers`` processes), then aligned to the previous layer one after
    the other (:func:`_align_parts`), each as soon as it and its predecessor are done.

    The workers are forked (they inherit the network instead of receiving it); they never call
    MPI, and end with ``os._exit`` as every ``multiprocessing`` child does, so a rank that
    partitions inside an MPI job keeps its connections to itself.
    """
    global _FREE_PHASES
    layers = list(range(first_k, first_k + count))
    workers = config.workers or _available_cores()
    workers = min(workers, count) if config.engine == "kahypar" else 1
    if multiprocessing.current_process().daemon or \
            "fork" not in multiprocessing.get_all_start_methods():
        workers = 1  # a daemonic process may not have children; no fork, no inherited network
    owners, prev = [], first_prev
    _FREE_PHASES = (weights, parts, config)
    try:
        with contextlib.ExitStack() as stack:
            if workers > 1:
                pool = stack.enter_context(ProcessPoolExecutor(
                    workers, mp_context=multiprocessing.get_context("fork")))
                free = pool.map(_free_phase, layers, chunksize=_PHASES_PER_TASK)
            else:
                free = map(_free_phase, layers)
            for k, owner in zip(layers, free):
                if prev is not None:
                    owner = _align_parts(weights[k - 1], owner, prev, parts)
                owners.append(owner)
                prev = owner
    finally:
        _FREE_PHASES = ()
    return owners


def _boundary_words(W, owner, prev_owner) -> int:
    """Connectivity-1 cut size (eq. 1) of one layer under a given partition."""
    hg = build_layer_hypergraph(W, prev_owner)
    return connectivity_cutsize(hg, np.concatenate((owner, hg.fixed[hg.num_rows:])))


def _tile_relabelling(W_entry, entry, last, wrap, parts: int) -> np.ndarray:
    """Part relabelling sigma applied once per repeat of the first period.

    Repeat r of the period uses sigma^r of the first period's owners; the layer between repeats
    r and r + 1 then costs what W^{p+1} costs with owners sigma(``entry``) (the owners of layer 1
    carried to layer p + 1) and fixed vertices ``last`` (the owners of layer p), since volumes
    do not change when part ids are permuted.  ``wrap`` is the wrap-around phase (W^{p+1}
    partitioned with fixed vertices ``last``); sigma maximises the agreement sigma(entry) = wrap
    (a linear assignment on the P x P overlap).  The identity is kept when it gives the cheaper
    boundary (both are evaluated exactly with eq. 1).
    """
    overlap = np.zeros((parts, parts), dtype=np.int64)
    np.add.at(overlap, (entry, wrap), 1)
    rows, cols = _max_assignment(overlap)
    sigma = np.empty(parts, dtype=np.int64)
    sigma[rows] = cols
    identity = np.arange(parts)
    cost = {name: _boundary_words(W_entry, s[entry], last)
            for name, s in (("identity", identity), ("sigma", sigma))}
    return sigma if cost["sigma"] < cost["identity"] else identity


def _tiled_owners(weights, parts: int, config: HypergraphConfig, found: LayerPeriod) -> list:
    """Owners of layers 1 .. L from phases phi_1 .. phi_p repeated over the layers (see
    :func:`hypergraph_partition`); a relabelled period carries them through its maps."""
    p, L = found.period, len(weights)
    first = _phase_chain(weights, parts, config, None, 1, p)
    wrap = partition_layer(weights[p], first[-1], parts, config, p + 1)
    base = [None, *first]  # base[k]: layer k's owners before the part relabelling
    for k in range(p + 1, L + 1):
        base.append(found.carry(base[k - p], k - p))
    sigma = _tile_relabelling(weights[p], base[p + 1], first[-1], wrap, parts)
    owners, step = [], np.arange(parts)
    for k in range(1, L + 1):
        r, j = divmod(k - 1, p)
        if j == 0 and r > 0:
            step = sigma[step]
        owners.append(step[base[k]])
    return owners


def hypergraph_partition(weights, parts: int, config: HypergraphConfig = HypergraphConfig()
                         ) -> Partition:
    """H-SGD partition: phases phi_1 .. phi_L of the fixed-vertex hypergraph model (§5).

    Phase phi_1 partitions W^1 without fixed vertices and places x^0 inside the connectivity
    sets of its nets (:func:`partition.placement.place_inputs`, ``config.input_placement``);
    phase phi_k (k >= 2) pins the fixed vertex of column j to the part that computed
    x^{k-1}(j) (``config.phases="chained"``, the paper's order); by default
    (``"independent"``) every phase runs without fixed vertices, in parallel, and the part ids
    are aligned afterwards (:func:`_independent_phases`).  With
    ``config.tile`` and a layer sequence of period p with 2p < L, exact or relabelled
    (:func:`partition.period.find_period`), phases phi_1 .. phi_p run once and are repeated:
    layer k = r p + j gets the owners of layer j, carried through the period's maps, with part
    ids permuted by sigma^r (:func:`_tile_relabelling`, chosen from the wrap-around phase
    phi_{p+1}: W^{p+1} with fixed vertices from phi_p).  Every layer inside a repeat has
    exactly the volume it had in phases 1 .. p (the maps are isomorphisms of the layers); only
    the first layer of each repeat sees other fixed vertices than in phase phi_1.  The time
    of the period search is part of ``seconds``.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    t0 = time.perf_counter()
    L = len(weights)
    owners = [None] * (L + 1)
    found = find_period(weights) if config.tile and parts > 1 else None
    if parts == 1:
        owners[0] = np.zeros(weights[0].shape[1], dtype=np.int64)
        for k, W in enumerate(weights, start=1):
            owners[k] = np.zeros(W.shape[0], dtype=np.int64)
    elif found is None:
        phases = _phase_chain if config.phases == "chained" else _independent_phases
        owners[1:] = phases(weights, parts, config, None, 1, L)
    else:
        owners[1:] = _tiled_owners(weights, parts, config, found)
    if parts > 1:
        owners[0] = input_owner_from_connectivity(weights[0], owners[1], parts,
                                                  config.input_placement)
    return Partition(owners=tuple(owners), parts=parts, method="hypergraph",
                     seconds=time.perf_counter() - t0,
                     info={"engine": config.engine, "preset": config.resolved_preset,
                           "epsilon": config.epsilon, "compress": config.compress,
                           "input_placement": config.input_placement,
                           "phases": config.phases,
                           "period": found.period if found else 0,
                           "relabelled": bool(found and found.relabelled)})


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
