"""PacTrain (paper 002): pruning, gradient sparsity enforcement, mask tracker, compact all-reduce.

One run follows Algorithm 1 of the paper:

1. **Start from a pre-trained model** (Alg. 1 "Data: Pre-trained model"; §III-B): ``--init
   FILE`` loads the flat parameters of a trained model (an ``.npz`` written by
   :func:`save_init`) and prunes it at once; without ``--init`` the first ``--warmup-steps``
   steps (default :data:`DEFAULT_WARMUP_STEPS`) are plain dense all-reduce steps (eq. 1) on the
   unpruned model, our stand-in for the paper's pre-training on a generic dataset.
2. **Prune** once (Alg. 1 l. 2), right after the warm-up (in the constructor when there is
   none): every conv and fc weight tensor ``l`` keeps ``n_l − ⌊r n_l⌋`` entries (``r =
   --prune-ratio``), ranked per layer, so ``K`` is known from the layout; biases and BatchNorm
   parameters are never pruned.  ``--prune-score`` picks the ranking, all from the GraSP score
   of eq. 4, ``S = −θ ⊙ (H ∇ℓ)``, or the weights:

   * ``grasp-abs`` (default): keep the largest ``|S|``, the entries whose removal changes the
     gradient flow most, PacTrain's "retain parameters critical for maintaining essential
     gradient directions" (§III-D);
   * ``grasp``: GraSP's own rule [45]: remove the entries of **highest** ``S`` (importance
     ``−S``).  GraSP ranks at initialization; on the warmed-up digits CNN it leaves 0.09 test
     accuracy right after pruning and 0.79 after 96 steps (``|S|``: 0.98), see
     ``docs/bench_out/pactrain.md``;
   * ``magnitude``: ``|θ|`` (paper §III-D: "determining the pruning mask based on weight
     ranking").

   ``H ∇ℓ`` is a central finite difference of gradients, ``(∇ℓ(θ + εv) − ∇ℓ(θ − εv)) / 2ε`` with
   ``v = ∇ℓ``, where ``∇ℓ`` and the difference are averaged over all ranks (two recorded
   all-reduces), so every rank gets the same scores and the same mask.  Weights already exactly
   zero are pruned first.
3. **Gradient sparsity enforcement** (eq. 2, Alg. 1 l. 5) every step: ``g ← (θ ≠ 0) ⊙ g`` on
   the conv/fc entries; a :class:`models.MaskHook` on the optimizer masks the update (weight
   decay included) and the momentum, so pruned weights stay exactly zero.
4. **Mask tracker, per bucket** (Alg. 1 l. 6-11: ``foreach update ∈ model_updates``, the
   gradient buckets a DDP communication hook sees): the flat gradient is cut into DDP's buckets
   (``--bucket-mib``) and every bucket ``b`` has its own :class:`MaskTracker` over its slice of
   the mask ``m_t = (θ_t ≠ 0)`` (1 on bias/BN).  A bucket whose mask has been unchanged for
   ``--stable-window`` comparisons packs ``g_b[idx_b]`` (``idx_b`` = the bucket's survivors,
   identical on every rank, so no index travels) and all-reduces the ``K_b`` values
   (``packed_allreduce``); any other bucket is all-reduced densely (``dense_allreduce``).  A
   change of a bucket's mask (a surviving weight reaching exactly 0) re-plans and sends that
   bucket densely until it is stable again.  ``--mask-scope global`` (a named deviation) tracks
   one mask over the whole flat gradient and all-reduces the packed vector in chunks of at most
   one bucket.
5. ``--ternary``: TernGrad on each packed vector (eq. 3): ``s = max_j max|g_j|`` by a MAX
   all-reduce (``ternary_scale``), by default one ``s`` per tensor (TernGrad's layer-wise
   scaling; ``--ternary-scale global``: one ``s`` per packed vector), ``b ~ Bernoulli(|g|/s)``
   from a per-rank, per-step stream seeded from the run seed (:func:`ternary_uniforms`), codes
   ``sign(g) · b`` packed 4 per byte (:func:`pack_2bit`) and all-gathered
   (``ternary_allgather``: a sum all-reduce of 2-bit codes is not closed), then every rank
   decodes and averages ``(s/p) Σ_j sign(g_j) b_j``, an unbiased estimate of the average.

**During the backward** (``--overlap on``, as DDP's communication hook runs): the ready hook
(:meth:`PacTrain.on_ready`, between two units) sends every bucket as soon as the backward wrote
it, on the communication stream, in the plan's order; :meth:`PacTrain.sync` waits and
unpacks.  A ternary unit's encoding needs its scales' MAX all-reduce: the host waits for it
when the next bucket is ready (``--ternary-wait bucket``) or after the backward
(``backward``), then encodes and all-gathers (the paper's comm hook chains them on the
all-reduce's future without the host waiting: see the README's deviations).
``--overlap off``: every call blocks in :meth:`PacTrain.sync`, after the backward.

**One plan.** :meth:`PacTrainPlan.build` (pure: layout, options and the run's kept index set
or, for a prediction, the keep rate) gives ``K`` per tensor and bucket, the chunks, the TernGrad
segments, the dense-until-stable schedule and every step's call records
(:meth:`PacTrainPlan.calls`); the strategy executes them and :mod:`commvol.systems.pactrain`
prices them.  Independent closed forms from the paper: :mod:`volume.pactrain`.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np

from models import MaskHook, iterate_batches
from substrate.backend import array_module
from substrate.calls import Call, Placement, Ready, price
from substrate.options import option

from .ddp import flat_buckets
from .strategy import Strategy, register

__all__ = [
    "DEFAULT_WARMUP_STEPS",
    "GRASP_REL_STEP",
    "GRASP_SAMPLES",
    "MASK_SCOPES",
    "PRUNABLE_KINDS",
    "PRUNE_SCORES",
    "TERNARY_SCALES",
    "TERNARY_STREAM",
    "TERNARY_WAITS",
    "MaskTracker",
    "PacTrain",
    "PacTrainOptions",
    "PacTrainPlan",
    "grasp_score",
    "hessian_vector_fd",
    "load_init",
    "pack_2bit",
    "prunable_flags",
    "prune_importance",
    "prune_mask",
    "save_init",
    "ternarize",
    "ternary_uniforms",
    "unpack_2bit",
]

#: ``--prune-score`` choices: keep the largest ``|S|`` (eq. 4), GraSP's rule (remove the highest
#: ``S``), keep the largest ``|θ|``.
PRUNE_SCORES = ("grasp-abs", "grasp", "magnitude")
TERNARY_SCALES = ("tensor", "global")
#: ``--ternary-wait``: where the host waits for a ternary unit's scales before encoding it: when
#: the next bucket is ready (in the backward) or after the backward.
TERNARY_WAITS = ("bucket", "backward")
#: ``--mask-scope``: one mask tracker per gradient bucket (Algorithm 1) or one for all.
MASK_SCOPES = ("bucket", "global")
#: Parameter kinds that are pruned (biases and BatchNorm parameters are kept whole).
PRUNABLE_KINDS = ("conv", "fc")
#: Second word of the ternary streams' seed ``[seed, TERNARY_STREAM, rank, step]``.
TERNARY_STREAM = 2002
#: Samples of each rank's shard used for the GraSP gradient and Hessian-vector product.
GRASP_SAMPLES = 256
#: Finite-difference step of ``H v``: ``ε = GRASP_REL_STEP · max(‖θ‖, 1) / ‖v‖``.
GRASP_REL_STEP = 1e-3
#: Dense warm-up steps before pruning when no ``--init`` model is given (the pre-training of
#: Algorithm 1's input model): two epochs of the digits CNN at 4 ranks and batch 32, after which
#: dense DDP reaches 0.90-0.91 test accuracy (the default 0.9 target); see
#: ``docs/bench_out/pactrain.md``.
DEFAULT_WARMUP_STEPS = 24


# ---------------------------------------------------------------------------------------------
# pure pieces (tested without MPI)
# ---------------------------------------------------------------------------------------------
class MaskTracker:
    """Detects when the gradient mask has stopped changing (paper §III-C, "Mask Tracker").

    :meth:`observe` compares each step's mask with the previous one; after ``window``
    consecutive unchanged comparisons the mask is *stable* (packed mode).  A change resets the
    count and bumps :attr:`version` (the packed index set is re-planned once per version).

    Parameters
    ----------
    window : int
        Consecutive unchanged comparisons required (0: stable from the first observation).
    """

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"--stable-window must be >= 0, got {window}")
        self.window = int(window)
        self._prev = None
        self.unchanged = 0
        self.version = 0

    def observe(self, mask) -> bool:
        """Record this step's mask; returns whether it is stable (``unchanged >= window``)."""
        xp = array_module(mask)
        if self._prev is None or self._prev.shape != mask.shape or not bool(
                xp.array_equal(self._prev, mask)):
            self._prev = mask.copy()
            self.unchanged = 0
            self.version += 1
        else:
            self.unchanged += 1
        return self.stable

    @property
    def stable(self) -> bool:
        return self._prev is not None and self.unchanged >= self.window

    def state_dict(self, host) -> dict:
        """Host copies of the last mask (empty when none was observed) and the counters;
        ``host`` converts a device array to NumPy."""
        return {"prev": host(self._prev).copy() if self._prev is not None
                else np.zeros(0, bool), "has_prev": np.bool_(self._prev is not None),
                "unchanged": np.int64(self.unchanged), "version": np.int64(self.version)}

    def load_state_dict(self, state: dict, xp) -> None:
        self._prev = xp.asarray(state["prev"]) if state["has_prev"] else None
        self.unchanged = int(state["unchanged"])
        self.version = int(state["version"])


def prunable_flags(layout) -> np.ndarray:
    """Flat bool vector: ``True`` on the entries of conv and fc weight tensors."""
    return layout.expand({n: float(layout.kind(n) in PRUNABLE_KINDS) for n in layout.names},
                         dtype=np.float64) > 0


def prune_mask(importance, layout, ratio: float, zero=None) -> np.ndarray:
    """Per-layer pruning mask: each conv/fc tensor keeps its ``n_l − ⌊r n_l⌋`` entries of
    highest ``importance``; other tensors are kept whole.

    Parameters
    ----------
    importance : array (T,)
        Higher is more important (``|θ|`` for magnitude pruning, ``−S`` for GraSP, eq. 4).
    layout : ParamLayout
    ratio : float
        ``r`` in ``[0, 1)``.
    zero : bool array (T,), optional
        Entries that are already exactly zero: ranked below every other entry.

    Returns
    -------
    numpy.ndarray of bool (T,)
        Ties are broken towards the lower flat index (stable sort), so the mask is the same on
        every rank given the same scores.
    """
    imp = np.asarray(importance.get() if hasattr(importance, "get") else importance,
                     dtype=np.float64)
    if zero is not None:
        z = np.asarray(zero.get() if hasattr(zero, "get") else zero, dtype=bool)
        imp = np.where(z, -np.inf, imp)
    mask = np.ones(layout.total, dtype=bool)
    for name in layout.names:
        if layout.kind(name) not in PRUNABLE_KINDS:
            continue
        sl = layout.slice(name)
        n = sl.stop - sl.start
        drop = math.floor(ratio * n)
        if drop == 0:
            continue
        order = np.argsort(-imp[sl], kind="stable")  # most important first
        seg = np.zeros(n, dtype=bool)
        seg[order[:n - drop]] = True
        mask[sl] = seg
    return mask


def hessian_vector_fd(grad_fn, theta, v, eps: float):
    """Central finite difference ``H v ≈ (∇ℓ(θ + εv) − ∇ℓ(θ − εv)) / (2ε)`` (for eq. 4).

    Parameters
    ----------
    grad_fn : callable(theta) -> gradient (same shape)
    theta, v : arrays
    eps : float
        Step ``ε > 0`` (exact for a quadratic loss up to rounding).
    """
    if not eps > 0:
        raise ValueError(f"finite-difference step must be > 0, got {eps}")
    gp = grad_fn(theta + eps * v)
    gm = grad_fn(theta - eps * v)
    return (gp - gm) / (2 * eps)


def grasp_score(theta, hv):
    """GraSP score, paper eq. 4: ``S = −θ ⊙ (H ∇ℓ(θ))``; GraSP removes the largest ``S``."""
    return -theta * hv


def prune_importance(kind: str, theta, score=None):
    """Importance for :func:`prune_mask` (higher is kept) under ``--prune-score kind``:
    ``grasp``: ``−S`` (GraSP's rule: the entries of highest score ``S`` of eq. 4 are removed),
    ``grasp-abs``: ``|S|``, ``magnitude``: ``|θ|``."""
    if kind == "magnitude":
        return abs(theta)
    if score is None:
        raise ValueError(f"--prune-score {kind} needs the GraSP score S (eq. 4)")
    if kind == "grasp":
        return -score
    if kind == "grasp-abs":
        return abs(score)
    raise ValueError(f"--prune-score {kind!r} unknown; use one of {PRUNE_SCORES}")


def ternary_uniforms(seed: int, rank: int, step: int, n: int, dtype=np.float32) -> np.ndarray:
    """The uniforms ``u ∈ [0, 1)`` rank ``rank`` draws at ``step`` for the Bernoulli variables
    ``b = [u < |g|/s]``: ``default_rng([seed, TERNARY_STREAM, rank, step]).random(n)``
    (reproducible, independent of the global RNG, different on every rank and step)."""
    return np.random.default_rng([int(seed), TERNARY_STREAM, int(rank), int(step)]).random(
        int(n), dtype=dtype)


def ternarize(g, s, u):
    """TernGrad codes (paper §III-D): ``sign(g) · b`` with ``b = [u < |g|/s]``, as ``int8`` in
    ``{−1, 0, +1}``.

    ``s · ternarize(g, s, u)`` is unbiased, ``E = s · sign(g) · |g|/s = g`` (eq. 3), when
    ``s ≥ |g|`` elementwise and ``u ~ U[0, 1)``.  ``s`` is a scalar or one scale per element
    (broadcast); where ``s = 0`` the code is 0.
    """
    xp = array_module(g)
    s = xp.asarray(s, dtype=g.dtype)
    pos = s > 0
    b = (u < xp.abs(g) / xp.where(pos, s, 1)) & pos
    return (xp.sign(g) * b).astype(np.int8)


_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_DECODE = np.array([0, 1, 0, -1], dtype=np.int8)  # 2-bit code -> value (code 2 unused)


def pack_2bit(codes, out=None):
    """Pack ternary values ``{−1, 0, +1}`` (int8) into 2-bit codes, 4 per byte.

    Code of a value: ``0 → 0b00``, ``+1 → 0b01``, ``−1 → 0b11``; value ``i`` lands in byte
    ``i // 4`` at bit ``2 (i % 4)``; the tail is padded with zeros.  Returns (or fills ``out``)
    a ``uint8`` array of ``⌈n/4⌉`` bytes.
    """
    xp = array_module(codes)
    n = codes.shape[0]
    nb = -(-n // 4)
    c = xp.zeros(4 * nb, dtype=np.uint8)
    c[:n] = codes.view(np.uint8) & 3
    c = c.reshape(nb, 4) << xp.asarray(_SHIFTS)
    res = c[:, 0] | c[:, 1] | c[:, 2] | c[:, 3]
    if out is None:
        return res
    out[...] = res
    return out


def unpack_2bit(packed, n: int):
    """Inverse of :func:`pack_2bit`: ``(..., ⌈n/4⌉)`` bytes → ``(..., n)`` int8 values (a 2-D
    input decodes every rank's row at once)."""
    xp = array_module(packed)
    codes = (packed[..., :, None] >> xp.asarray(_SHIFTS)) & 3
    codes = codes.reshape(*packed.shape[:-1], -1)[..., :n]
    return xp.asarray(_DECODE)[codes]


#: what ``--init`` reads (its help, the README and every refusal say it)
INIT_FORMAT = ("an .npz archive (numpy.savez) holding 'params', the model's flat parameter "
               "vector (one finite number per parameter), and 'buffer:NAME' for each of the "
               "model's buffers (BatchNorm running statistics), as "
               "dataparallel.pactrain.save_init(path, model) writes it")
#: the fix every refusal of ``--init`` ends with
_INIT_FIX = ("write it with dataparallel.pactrain.save_init(path, model) from a model of the "
             "same --model, --arch and --dataset")
#: the first bytes of a NumPy ``.npy`` file and of a zip archive (``.npz``)
_NPY_MAGIC, _ZIP_MAGIC = b"\x93NUMPY", b"PK"


def save_init(path, model) -> None:
    """Write ``model``'s flat parameters (key ``params``) and buffers (``buffer:NAME``) to
    ``path``, the ``.npz`` :data:`INIT_FORMAT` describes (for ``--init``)."""
    def host(a):
        return a.get() if hasattr(a, "get") else np.asarray(a)
    np.savez(path, params=host(model.params.flat),
             **{f"buffer:{k}": host(v) for k, v in model.buffers.items()})


def check_init_file(path) -> list[str]:
    """The names in the ``--init`` archive ``path``, reading only its directory (a cheap check
    before a run starts; :func:`load_init` reads and checks the arrays).

    Raises
    ------
    ValueError
        Naming ``--init``, the file, what is wrong (missing, a directory, an ``.npy`` array,
        not a zip archive, damaged, no ``params``) and the fix.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        raise ValueError(f"--init {p} is a directory: pass the .npz file ({INIT_FORMAT})")
    try:
        with open(p, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    except FileNotFoundError:
        raise ValueError(f"--init {p}: no such file; {_INIT_FIX}") from None
    except OSError as exc:
        raise ValueError(f"--init {p} cannot be read ({exc.strerror or exc})") from None
    if head.startswith(_NPY_MAGIC):
        raise ValueError(f"--init {p} is a single .npy array, not an .npz archive: --init reads "
                         f"{INIT_FORMAT}; for a bare parameter vector write "
                         "numpy.savez(path, params=vector) (a model with BatchNorm also needs "
                         "its buffers: use save_init)")
    if not head.startswith(_ZIP_MAGIC):
        raise ValueError(f"--init {p} is not an .npz archive (it does not start like a zip "
                         f"file): --init reads {INIT_FORMAT}")
    try:
        with np.load(p, allow_pickle=False) as f:
            names = list(f.files)
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"--init {p} is not a readable .npz ({type(exc).__name__}: {exc}); "
                         f"pass a complete file: {_INIT_FIX}") from None
    if "params" not in names:
        raise ValueError(f"--init {p}: no 'params' array (the flat parameter vector; the file "
                         f"holds {', '.join(names) or 'nothing'}); {_INIT_FIX}")
    return names


def _read_init(path) -> dict:
    """Every array of an ``--init`` file (a damaged file is a ``ValueError`` naming it)."""
    check_init_file(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"--init {path} is not a readable .npz ({type(exc).__name__}: {exc}); "
                         f"pass a complete file: {_INIT_FIX}") from None


def _check_init_array(path, key: str, a: np.ndarray, shape: tuple, where=None) -> None:
    """``a`` (entry ``key`` of ``--init path``) has ``shape``, real numbers, all finite."""
    if a.shape != shape:
        raise ValueError(f"--init {path}: '{key}' has shape {a.shape} but the model needs "
                         f"{shape}; {_INIT_FIX}")
    if a.dtype.kind not in "fiu":
        raise ValueError(f"--init {path}: '{key}' holds {a.dtype} values, not real numbers; "
                         f"{_INIT_FIX}")
    bad = np.flatnonzero(~np.isfinite(a.reshape(-1))) if a.dtype.kind == "f" else ()
    if len(bad):
        at = where(int(bad[0])) if where is not None else f"index {int(bad[0])}"
        raise ValueError(f"--init {path}: '{key}' holds {len(bad)} non-finite value(s) (NaN or "
                         f"Inf; the first at {at}): a run cannot start from it; save a model "
                         "whose weights are finite (a run that did not diverge) with "
                         "dataparallel.pactrain.save_init(path, model)")


def load_init(path, model) -> None:
    """Load an ``.npz`` of :func:`save_init` into ``model`` (in place; every rank loads the same
    file, so every rank starts from the same model).

    Raises
    ------
    ValueError
        Naming ``--init``, the file and the fix, for anything but :data:`INIT_FORMAT` for this
        model: not an ``.npz``, damaged, ``params`` missing, of another size, not real numbers
        or not finite, a buffer missing, of another shape or unknown to the model.
    """
    f = _read_init(path)
    layout = model.layout
    names = list(layout.names)

    def tensor_at(i: int) -> str:
        name = max((n for n in names if layout.offsets[n] <= i), key=layout.offsets.get)
        return f"parameter {i}, tensor {name!r}"

    _check_init_array(path, "params", f["params"], (layout.total,), tensor_at)
    wanted = {f"buffer:{k}": v for k, v in model.buffers.items()}
    unknown = sorted(k for k in f if k != "params" and k not in wanted)
    if unknown:
        raise ValueError(f"--init {path}: {', '.join(repr(k) for k in unknown)} not a buffer of "
                         f"this model (its buffers: {', '.join(wanted) or 'none'}); {_INIT_FIX}")
    missing = [k for k in wanted if k not in f]
    if missing:
        raise ValueError(f"--init {path}: no {', '.join(repr(k) for k in missing)} (the model's "
                         f"running statistics); {_INIT_FIX}")
    for key, buf in wanted.items():
        _check_init_array(path, key, f[key], tuple(buf.shape))
    model.params.flat[...] = model.xp.asarray(f["params"], dtype=model.params.flat.dtype)
    for key, buf in wanted.items():
        buf[...] = model.xp.asarray(f[key], dtype=buf.dtype)


# ---------------------------------------------------------------------------------------------
# options and the plan
# ---------------------------------------------------------------------------------------------
def _whole(flag: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{flag} takes a whole number of steps, got {v!r}")  # noqa: TRY004 (bad flags are ValueErrors)


@dataclass(frozen=True)
class PacTrainOptions:
    """Options of PacTrain (the trainer's and ``commvol predict``'s: one declaration)."""

    prune_ratio: float = option(0.5, "fraction of every conv/fc weight tensor pruned, in [0, 1)")
    prune_score: str = option(
        "grasp-abs", "pruning rank, per layer, from the GraSP score S = -theta*(H grad) (eq. 4): "
        "grasp-abs = keep the largest |S|; grasp = GraSP's rule, remove the highest S; "
        "magnitude = keep the largest |theta|", choices=PRUNE_SCORES)
    stable_window: int = option(
        5, "steps a bucket's mask must stay unchanged before its packed all-reduce is used")
    warmup_steps: int | None = option(
        None, "dense all-reduce steps on the unpruned model before pruning (the paper prunes "
        f"a pre-trained model); default: 0 with --init, else {DEFAULT_WARMUP_STEPS}", type=int)
    init: str | None = option(
        None, f"start from (and prune at once) a trained model: {INIT_FORMAT}", type=str,
        metavar="FILE")
    mask_scope: str = option(
        "bucket", "mask tracking and packing per gradient bucket (Algorithm 1) or one mask over "
        "the whole flat gradient (global, a deviation)", choices=MASK_SCOPES)
    ternary: bool = option(False, "TernGrad on the packed gradient: 2-bit codes all-gathered "
                                  "(eq. 3)")
    ternary_scale: str = option(
        "tensor", "TernGrad scale s = max|g|: one per tensor (TernGrad's layer-wise scaling) or "
        "one per packed vector", choices=TERNARY_SCALES)
    ternary_wait: str = option(
        "bucket", "--ternary with --overlap on: the encoding needs the scales' MAX all-reduce; "
        "the host waits for a unit's scales when the next bucket is ready (bucket: later "
        "buckets go out during the backward, which waits for the scales) or after the backward "
        "(backward: the backward never waits, the calls after the first unit's scales follow "
        "it)", choices=TERNARY_WAITS)
    bucket_mib: float = option(32.0, "gradient bucket size in MiB")

    def __post_init__(self) -> None:
        if not 0 <= self.prune_ratio < 1:
            raise ValueError(f"--prune-ratio must be in [0, 1) (the fraction of each conv/fc "
                             f"tensor removed, e.g. 0.5); got {self.prune_ratio}")
        if self.prune_score not in PRUNE_SCORES:
            raise ValueError(f"--prune-score {self.prune_score!r} unknown; use one of "
                             f"{PRUNE_SCORES}")
        _whole("--stable-window", self.stable_window)
        if self.stable_window < 0:
            raise ValueError(f"--stable-window must be >= 0 (steps of unchanged mask before "
                             f"packing, e.g. 5); got {self.stable_window}")
        if self.warmup_steps is not None:
            _whole("--warmup-steps", self.warmup_steps)
            if self.warmup_steps < 0:
                raise ValueError(f"--warmup-steps must be >= 0 (0: prune at the start); got "
                                 f"{self.warmup_steps}")
        if self.init is not None and not os.path.isfile(self.init):
            raise ValueError(f"--init {self.init}: no such file; pass an .npz written by "
                             "dataparallel.pactrain.save_init(path, model)")
        if self.mask_scope not in MASK_SCOPES:
            raise ValueError(f"--mask-scope {self.mask_scope!r} unknown; use one of "
                             f"{MASK_SCOPES}")
        if self.ternary_wait not in TERNARY_WAITS:
            raise ValueError(f"--ternary-wait {self.ternary_wait!r} unknown; use one of "
                             f"{TERNARY_WAITS}")
        if self.ternary_scale not in TERNARY_SCALES:
            raise ValueError(f"--ternary-scale {self.ternary_scale!r} unknown; use one of "
                             f"{TERNARY_SCALES}")
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")

    @property
    def warmup(self) -> int:
        """Dense steps before pruning: ``--warmup-steps``, or by default 0 with ``--init`` (the
        file is the pre-trained model) and :data:`DEFAULT_WARMUP_STEPS` without."""
        if self.warmup_steps is not None:
            return int(self.warmup_steps)
        return 0 if self.init is not None else DEFAULT_WARMUP_STEPS


@dataclass(frozen=True, eq=False)
class PacTrainPlan:
    """What PacTrain sends, built once by :meth:`build` (pure: no communicator).

    Attributes
    ----------
    nodes, ranks_per_node, itemsize : int
        ``M``, ``P`` and the gradient's bytes per element.
    tensor_sizes, tensor_kept : tuple of int
        ``n_l`` and the kept count ``K_l`` of every tensor, in flat (backward) order.
    buckets : tuple of (int, int)
        DDP's gradient buckets ``[a, b)`` of the flat gradient (whole tensors, ``--bucket-mib``).
    units : tuple of (int, int)
        The flat ranges with a mask tracker of their own: the buckets (``--mask-scope
        bucket``, Algorithm 1's ``foreach update``) or ``[(0, T)]`` (``global``).
    unit_buckets : tuple of tuple of int
        Indices into :attr:`buckets` of the buckets a unit all-reduces when dense.
    unit_kept : tuple of int
        ``K_u``, the entries of unit ``u`` the mask keeps (the length of its packed vector).
    chunks : tuple of tuple of int
        Element counts of unit ``u``'s packed all-reduces: one of ``K_u`` per bucket (none when
        ``K_u = 0``); with ``global`` scope ``⌈K / B⌉`` chunks of at most one bucket ``B``.
    segments : tuple of tuple of (int, int)
        TernGrad scale segments of unit ``u`` in packed coordinates: one per tensor (``--ternary-
        scale tensor``; a tensor's survivors are contiguous in the packed vector) or one.
    packed_mode : str
        What a stable unit does: ``"packed"`` (float all-reduce) or ``"ternary"``.
    warmup_steps, dense_steps : int
        ``w`` (pruning happens before step ``w``) and ``w + W``: the mask trackers first compare
        at step ``w`` and call a mask stable after ``W = --stable-window`` unchanged comparisons,
        so steps ``0 .. w + W - 1`` are dense and every unit packs from step ``w + W`` on.
    grasp_step : int or None
        The step charged with GraSP's two all-reduces of ``T`` (``max(w - 1, 0)``).
    index : tuple of numpy arrays, or None
        Run plans: the sorted flat indices of unit ``u``'s survivors (``None`` for a prediction
        from the keep rate).
    """

    nodes: int
    ranks_per_node: int
    itemsize: int
    tensor_sizes: tuple
    tensor_kept: tuple
    buckets: tuple
    units: tuple
    unit_buckets: tuple
    unit_kept: tuple
    chunks: tuple
    segments: tuple
    packed_mode: str
    warmup_steps: int
    dense_steps: int
    grasp_step: int | None
    index: tuple | None = field(default=None, repr=False)

    @classmethod
    def build(cls, layout, nodes: int, ranks_per_node: int, options: PacTrainOptions,
              kept_index=None, itemsize: int = 4) -> PacTrainPlan:
        """The plan of a run (``kept_index``: the sorted flat indices the mask keeps) or of a
        prediction (``kept_index=None``: every conv/fc tensor keeps ``n − ⌊r n⌋`` entries, as
        :func:`prune_mask` does, every other tensor all of them)."""
        names = list(layout.names)
        sizes = [int(layout.sizes[n]) for n in names]
        offsets = [int(layout.offsets[n]) for n in names] + [int(layout.total)]
        T = int(layout.total)
        if kept_index is None:
            r = options.prune_ratio
            kept = [n - math.floor(r * n) if layout.kind(name) in PRUNABLE_KINDS else n
                    for name, n in zip(names, sizes)]
            idx = None
        else:
            idx = np.asarray(kept_index, dtype=np.int64).ravel()
            if idx.size and (idx[0] < 0 or idx[-1] >= T or np.any(np.diff(idx) <= 0)):
                raise ValueError(f"kept_index must be sorted, unique flat indices in [0, {T})")
            kept = np.diff(np.searchsorted(idx, offsets)).tolist()
        bucket_bytes = int(options.bucket_mib * (1 << 20))
        buckets = tuple(flat_buckets(layout, bucket_bytes, itemsize))
        if options.mask_scope == "bucket":
            units = buckets
            unit_buckets = tuple((b,) for b in range(len(buckets)))
        else:
            units = ((0, T),)
            unit_buckets = (tuple(range(len(buckets))),)
        # tensors of every unit (units are unions of whole tensors)
        starts = np.asarray(offsets[:-1])
        unit_tensors = [np.flatnonzero((starts >= a) & (starts < b)).tolist() for a, b in units]
        unit_kept = tuple(int(sum(kept[i] for i in ts)) for ts in unit_tensors)
        B = max(1, bucket_bytes // itemsize)
        if options.mask_scope == "bucket":
            chunks = tuple((k,) if k else () for k in unit_kept)
        else:
            chunks = tuple(tuple(min(B, k - a) for a in range(0, k, B)) for k in unit_kept)
        segs = []
        for ts, k in zip(unit_tensors, unit_kept):
            if options.ternary_scale == "tensor":
                ends = np.cumsum([kept[i] for i in ts]).tolist()
                segs.append(tuple(zip([0] + ends[:-1], ends)))
            else:
                segs.append(((0, k),))
        w = options.warmup
        index = None
        if idx is not None:
            index = tuple(idx[np.searchsorted(idx, a):np.searchsorted(idx, b)] for a, b in units)
        return cls(nodes=int(nodes), ranks_per_node=int(ranks_per_node), itemsize=int(itemsize),
                   tensor_sizes=tuple(sizes), tensor_kept=tuple(int(k) for k in kept),
                   buckets=buckets, units=tuple(units), unit_buckets=unit_buckets,
                   unit_kept=unit_kept, chunks=chunks, segments=tuple(segs),
                   packed_mode="ternary" if options.ternary else "packed", warmup_steps=w,
                   dense_steps=w + int(options.stable_window),
                   grasp_step=max(w - 1, 0) if options.prune_score != "magnitude" else None,
                   index=index)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """``T``."""
        return int(sum(self.tensor_sizes))

    @property
    def kept(self) -> int:
        """``K = Σ_u K_u``."""
        return int(sum(self.unit_kept))

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def packed_offsets(self) -> tuple:
        """Start of unit ``u``'s packed vector in the concatenation of all units' (the
        TernGrad uniforms of a step are drawn once for all ``K`` and sliced)."""
        return tuple(np.concatenate(([0], np.cumsum(self.unit_kept)[:-1])).astype(int).tolist())

    @property
    def num_scales(self) -> int:
        """TernGrad scales of a step in which every unit is ternary."""
        return int(sum(len(s) for s in self.segments))

    # -- the schedule and its records -----------------------------------------------------------
    def modes_at(self, step: int) -> tuple:
        """Every unit's mode at ``step`` when the mask stays stable once pruned: dense before
        :attr:`dense_steps`, :attr:`packed_mode` from then on."""
        mode = "dense" if step < self.dense_steps else self.packed_mode
        return (mode,) * self.num_units

    def calls(self, placement: Placement, modes=None, grasp: bool = False) -> list[Call]:
        """The world records of a step whose units run ``modes`` (default: dense), in the
        strategy's order, on one stream: per unit ``u`` (``[a, b)``), ``dense``: an average
        all-reduce per bucket after its gradients (:class:`~substrate.calls.Ready`) and the
        previous record; ``packed``: one per chunk of the ``K_u`` survivors, the first after
        ``Ready(a, b)``; ``ternary``: a MAX all-reduce of the scales, then the all-gather of
        ``⌈K_u/4⌉`` code bytes per rank.  ``grasp``: GraSP's two all-reduces of ``T`` (eq. 4),
        before the step's records when pruning precedes the first step (``w = 0``), else after
        them (pruning follows the update of step ``w - 1``)."""
        modes = ("dense",) * self.num_units if modes is None else tuple(modes)
        if len(modes) != self.num_units:
            raise ValueError(f"{len(modes)} modes for {self.num_units} mask units")
        world, w = placement.world, self.itemsize
        out: list[Call] = []

        def prev() -> tuple:
            return (len(out) - 1,) if out else ()

        def grasp_calls() -> None:
            for _ in range(2):
                out.append(Call("grasp_allreduce", "allreduce", world, w * self.total, w,
                                op="avg", after=prev()))

        if grasp and self.warmup_steps == 0:
            grasp_calls()
        for u, mode in enumerate(modes):
            a, b = self.units[u]
            if mode == "dense":
                for bi in self.unit_buckets[u]:
                    lo, hi = self.buckets[bi]
                    out.append(Call("dense_allreduce", "allreduce", world, w * (hi - lo), w,
                                    op="avg", after=(Ready(lo, hi), *prev())))
            elif mode == "packed":
                for c, k in enumerate(self.chunks[u]):
                    dep = (Ready(a, b), *prev()) if c == 0 else prev()
                    out.append(Call("packed_allreduce", "allreduce", world, w * k, w, op="avg",
                                    after=dep))
            elif mode == "ternary":
                out.append(Call("ternary_scale", "allreduce", world, w * len(self.segments[u]),
                                w, op="max", after=(Ready(a, b), *prev())))
                out.append(Call("ternary_allgather", "allgather", world,
                                blocks=(-(-self.unit_kept[u] // 4),) * placement.size,
                                after=prev()))
            else:
                raise ValueError(f"unknown PacTrain step mode {mode!r}; use dense, packed or "
                                 "ternary")
        if grasp and self.warmup_steps > 0:
            grasp_calls()
        return out

    def calls_at(self, placement: Placement, step: int) -> list[Call]:
        """The records of ``step`` of the schedule (:meth:`modes_at`, :attr:`grasp_step`)."""
        return self.calls(placement, self.modes_at(step), grasp=step == self.grasp_step)


# ---------------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------------
@register
class PacTrain(Strategy):
    """Prune, enforce gradient sparsity, all-reduce every stable bucket's packed survivors
    (optionally ternarized); executes a :class:`PacTrainPlan` (see the module docstring)."""

    name = "pactrain"
    Options = PacTrainOptions

    def __init__(self, ctx, options: PacTrainOptions) -> None:
        super().__init__(ctx, options)
        xp, layout = self.xp, self.layout
        self.model, self.opt = ctx.model, ctx.opt
        self.itemsize = ctx.model.grads.flat.dtype.itemsize
        self.T = layout.total
        flags = prunable_flags(layout)
        self.prunable = xp.asarray(flags)
        self.keep_always = ~self.prunable
        self.n_prunable = int(flags.sum())
        # before pruning: the keep-rate plan (its dense buckets and schedule)
        self.plan = self._build_plan(None)
        self.trackers = [MaskTracker(options.stable_window) for _ in self.plan.units]
        self._m = xp.ones(self.T, dtype=bool)      # this step's mask (θ ≠ 0 on conv/fc)
        self.hook: MaskHook | None = None
        self.pruned = False
        self.prune_step: int | None = None
        self.scores = None                           # host copy of the GraSP scores
        # what the last step executed (step_calls): its plan and modes, and whether GraSP's
        # all-reduces ran in it; GraSP in the constructor belongs to the first step
        self._step: tuple = (self.plan, ("dense",) * self.plan.num_units)
        self._grasp_pending = self._grasp_in_step = False
        self.steps = 0
        self.packed_unit_steps = 0                   # Σ over steps of the units sent packed
        self.stable_steps: list[int] = []            # steps at which every unit (re)started packing
        self._was_packed = False
        # the bucket of every tensor (buckets are whole tensors in backward order and do not
        # change when the mask re-plans), how many tensors each holds, its mask unit; and the
        # step in flight: the calls issued (to wait and unpack), the last one, a ternary unit
        # whose scales are in flight
        ends = [b for _, b in self.plan.buckets]
        offsets = layout.offsets
        self._bucket_of = {n: next(k for k, e in enumerate(ends) if offsets[n] < e)
                           for n in layout.names}
        self._bucket_tensors = [sum(1 for n in layout.names if self._bucket_of[n] == k)
                                for k in range(len(ends))]
        self._unit_of_bucket = {k: u for u, ks in enumerate(self.plan.unit_buckets) for k in ks}
        self._left = list(self._bucket_tensors)
        self._next = 0                               # the next bucket to send
        self._live: int | None = None
        self._issued: list = []
        self._prev = None
        self._pending = None
        self._uniforms = None
        if options.init is not None:
            load_init(options.init, ctx.model)
        if options.warmup == 0:
            self._prune(step=0)

    def _build_plan(self, mask) -> PacTrainPlan:
        """The plan of :meth:`PacTrainPlan.build` for ``mask`` (``None``: from the keep rate),
        with its index sets on the device."""
        idx = None if mask is None else self.run.backend.asnumpy(self.xp.flatnonzero(mask))
        plan = PacTrainPlan.build(self.layout, self.M, self.P or 0, self.options, kept_index=idx,
                                  itemsize=self.itemsize)
        if plan.index is not None:
            xp, dtype = self.xp, self.model.grads.flat.dtype
            self._idx = [xp.asarray(i) for i in plan.index]
            self._packed = [xp.empty(k, dtype=dtype) for k in plan.unit_kept]
            self._codes = [xp.empty(-(-k // 4), dtype=np.uint8) for k in plan.unit_kept]
            self._scale = [xp.zeros(len(s), dtype=dtype) for s in plan.segments]
            self._segment_of = [xp.asarray(np.repeat(np.arange(len(s)),
                                                     [b - a for a, b in s]))
                                for s in plan.segments]
        return plan

    # -- pruning --------------------------------------------------------------------------------
    def _prune(self, step: int) -> None:
        xp, theta = self.xp, self.model.params.flat
        zero = theta == 0
        kind = self.options.prune_score
        score = None if kind == "magnitude" else self._grasp_scores()
        importance = prune_importance(kind, theta, score)
        mask = xp.asarray(prune_mask(importance, self.layout, self.options.prune_ratio, zero))
        theta *= mask
        self._m[...] = mask & ~zero | self.keep_always
        self.hook = MaskHook(self._m)
        self.opt.add_hook(self.hook)
        if self.opt.momentum_buffer is not None:
            self.opt.momentum_buffer *= self._m
        self.plan = self._build_plan(self._m)
        self.pruned, self.prune_step = True, step

    def _grasp_scores(self):
        """``S = −θ ⊙ (H ∇ℓ)`` (eq. 4) with rank-averaged ``∇ℓ`` and finite-difference ``H v``
        on :data:`GRASP_SAMPLES` samples of each rank's shard; restores the model afterwards."""
        xp, model = self.xp, self.model
        cfg = self.ctx.config
        x, y = next(iterate_batches(self.ctx.train, min(GRASP_SAMPLES, len(self.ctx.train)),
                                    seed=int(cfg.seed), rank=self.topo.rank, epoch=0))
        theta0 = model.params.flat.copy()
        grads0 = model.grads.flat.copy()
        buffers0 = {k: v.copy() for k, v in model.buffers.items()}

        def grad_fn(theta):
            model.params.flat[...] = theta
            model.loss_and_grad(x, y)
            return model.grads.flat.copy()

        world = self.topo.world
        v = world.allreduce(grad_fn(theta0), "avg", phase="grasp_allreduce").result
        vnorm = float(xp.linalg.norm(v))
        if vnorm > 0:
            eps = GRASP_REL_STEP * max(float(xp.linalg.norm(theta0)), 1.0) / vnorm
            hv = hessian_vector_fd(grad_fn, theta0, v, eps)
        else:
            hv = xp.zeros_like(theta0)
        hv = world.allreduce(xp.ascontiguousarray(hv), "avg", phase="grasp_allreduce").result
        model.params.flat[...] = theta0
        model.grads.flat[...] = grads0
        for k, buf in model.buffers.items():
            buf[...] = buffers0[k]
        score = grasp_score(theta0, hv)
        self.scores = score.get() if hasattr(score, "get") else np.array(score)
        if self.steps:                   # after a step's update: part of that step
            self._grasp_in_step = True
        else:                            # in the constructor: part of the first step
            self._grasp_pending = True
        return score

    # -- the step ---------------------------------------------------------------------------------
    def _event(self):
        """The timeline event of the compute block that just closed (``None`` without one)."""
        clock = self.run.clock
        return clock.last_event if clock.timeline is not None else None

    def _begin(self, step: int) -> None:
        """Start step ``step`` before any of its buckets is sent: the mask trackers compare
        this step's mask ``θ ≠ 0`` (a change re-masks and re-plans) and fix every unit's mode.
        θ does not change during the backward, so this runs at the first ready bucket."""
        xp = self.xp
        self._grasp_in_step, self._grasp_pending = self._grasp_pending, False
        self.steps += 1
        self._live = int(step)
        modes = ["dense"] * self.plan.num_units
        if self.pruned:
            with self.run.clock.compute("pactrain_mask"):
                theta = self.model.params.flat
                xp.not_equal(theta, 0, out=self._m)
                self._m |= self.keep_always
                changed = False
                for u, (a, b) in enumerate(self.plan.units):
                    before = self.trackers[u].version
                    if self.trackers[u].observe(self._m[a:b]):
                        modes[u] = self.plan.packed_mode
                    changed |= self.trackers[u].version != before
                if changed:                              # a new mask: re-mask and re-plan
                    self.hook.set_mask(self._m)
                    self.plan = self._build_plan(self._m)
        self._step = (self.plan, tuple(modes))
        self._left = list(self._bucket_tensors)
        self._next = 0
        self._uniforms = None

    def on_ready(self, name: str) -> None:
        """The backward wrote ``name``'s gradient (called between units): when that completes
        a bucket, send it at once on the communication stream, as the plan's records say (a
        dense bucket after its gradients; a packed or ternary unit after its last bucket);
        :meth:`sync` waits and unpacks.  ``--overlap off``: nothing here, every call blocks in
        :meth:`sync`, after the backward."""
        k = self._bucket_of.get(name)
        if k is None or not self.run.recorder.overlap:
            return
        if self._live is None:
            self._begin(self.steps)
        self._left[k] -= 1
        held = self._pending is not None and self.options.ternary_wait == "backward"
        if self._left[k] == 0 and not held:
            self._bucket_done(k)

    def _bucket_done(self, k: int) -> None:
        """Send bucket ``k`` (buckets go out in order: ``k`` is the next one)."""
        if k != self._next:
            raise RuntimeError(f"PacTrain: bucket {k} ready before bucket {self._next} was sent")
        self._next += 1
        plan, modes = self._step
        u = self._unit_of_bucket[k]
        if modes[u] == "dense":
            self._send_dense(k)
        elif k == plan.unit_buckets[u][-1]:
            self._send_unit(u, modes[u])

    def _send_dense(self, k: int) -> None:
        """Bucket ``k`` of a dense unit: eq. 2 (GSE) once pruned, then its average all-reduce
        after its gradients and the previous call on the stream."""
        clock, g = self.run.clock, self.model.grads.flat
        a, b = self._step[0].buckets[k]
        after = [clock.ready(a, b), self._prev]
        if self.pruned:
            with clock.compute(f"pactrain_gse[{k}]"):
                g[a:b] *= self._m[a:b]                   # eq. 2 (GSE)
            after.append(self._event())
        self._flush()
        self._prev = self.topo.world.allreduce(g[a:b], "avg", phase="dense_allreduce",
                                               after=after, wait=False)
        self._issued.append(("dense", k, [self._prev], None))

    def _send_unit(self, u: int, mode: str) -> None:
        """Unit ``u`` once its last bucket is written: pack its survivors (eq. 2 + pack; for
        TernGrad also each segment's max|g|), then its packed all-reduces or, ternary, the MAX
        all-reduce of its scales (the encoding and the all-gather follow when the scales are
        back: :meth:`_flush`)."""
        xp, clock, world = self.xp, self.run.clock, self.topo.world
        plan, g = self._step[0], self.model.grads.flat
        a, b = plan.units[u]
        packed, idx = self._packed[u], self._idx[u]
        with clock.compute(f"pactrain_pack[{u}]"):
            xp.take(g, idx, out=packed)                  # eq. 2 + pack
            if mode == "ternary":
                scale = self._scale[u]
                for l, (sa, sb) in enumerate(plan.segments[u]):
                    scale[l] = xp.abs(packed[sa:sb]).max() if sb > sa else 0
        self._flush()
        dep = [clock.ready(a, b), self._event(), self._prev]
        if mode == "packed":
            hs, off = [], 0
            for n in plan.chunks[u]:
                self._prev = world.allreduce(packed[off:off + n], "avg",
                                             phase="packed_allreduce", after=dep, wait=False)
                hs.append(self._prev)
                dep, off = [self._prev], off + n
            self._issued.append(("packed", u, hs, None))
        elif mode == "ternary":
            self._prev = world.allreduce(self._scale[u], "max", phase="ternary_scale",
                                         after=dep, wait=False)
            self._pending = (u, self._prev)
        else:
            raise ValueError(f"unknown PacTrain step mode {mode!r}")

    def _flush(self) -> None:
        """Finish the ternary unit whose scales are in flight: wait for them (the host, as a
        blocking wait: the next compute waits for the MAX all-reduce), encode ``sign(g) · b``
        with ``b ~ Bernoulli(|g|/s)`` (eq. 3) into 2-bit codes and issue their all-gather.  Run
        before the next call is issued (the plan's order: a unit's all-gather precedes the next
        unit's first call) and at the end of the backward."""
        if self._pending is None:
            return
        u, h = self._pending
        self._pending = None
        xp, clock, plan = self.xp, self.run.clock, self._step[0]
        packed = self._packed[u]
        h.wait()
        with clock.compute(f"pactrain_encode[{u}]", deps=h):
            if self._uniforms is None:                   # one stream per rank and step
                self._uniforms = xp.asarray(ternary_uniforms(self.ctx.seed, self.topo.rank,
                                                             self._live, plan.kept,
                                                             dtype=packed.dtype))
            off = plan.packed_offsets[u]
            s = self._scale[u][self._segment_of[u]]
            pack_2bit(ternarize(packed, s, self._uniforms[off:off + packed.size]),
                      out=self._codes[u])
        self._prev = self.topo.world.allgather(self._codes[u], phase="ternary_allgather",
                                               after=[h, self._event()], wait=False)
        self._issued.append(("ternary", u, [self._prev], s))

    def sync(self, state, buffers):
        """Send what the backward did not (every bucket with ``--overlap off`` or without the
        ready hook, each as :meth:`on_ready` would), wait for every call in issue order and
        unpack: a packed unit's average into its survivors, a ternary one's ``(s/p) Σ_j
        sign(g_j) b_j`` (eq. 3), zeros elsewhere in the unit."""
        g, clock = buffers.flat, self.run.clock
        if self._live is None:
            self._begin(int(state.step))
        elif self._live != int(state.step):
            raise ValueError(f"PacTrain: the backward ran step {self._live} (the strategy's "
                             f"count), the trainer syncs step {state.step}; restore the "
                             "strategy's state with the trainer's (load_state_dict)")
        for k in range(self._next, len(self._left)):     # not sent during the backward
            self._bucket_done(k)
        self._flush()
        plan, modes = self._step
        p = self.topo.size
        for kind, u, hs, s in self._issued:
            for h in hs:
                h.wait()
            if kind == "dense":
                continue
            a, b = plan.units[u]
            packed, idx = self._packed[u], self._idx[u]
            with clock.compute(f"pactrain_unpack[{u}]", deps=hs[-1] if hs else None):
                if kind == "ternary":
                    total = unpack_2bit(hs[-1].result, packed.size).sum(axis=0, dtype=np.int32)
                    packed[...] = total * s / p
                g[a:b] = 0
                g[idx] = packed
        self._issued, self._prev, self._live = [], None, None
        n_packed = sum(m != "dense" for m in modes)
        self.packed_unit_steps += n_packed
        all_packed = n_packed == len(modes)
        if all_packed and not self._was_packed:
            self.stable_steps.append(state.step)
        self._was_packed = all_packed
        return g

    def after_step(self, state) -> None:
        if not self.pruned and state.step + 1 == self.options.warmup:
            self._prune(step=state.step + 1)

    def step_calls(self) -> list:
        """The plan's records of the last step as executed: its units' modes, and GraSP's
        all-reduces when pruning ran in it (no side effect: called any number of times)."""
        plan, modes = self._step
        return plan.calls(self.topo.placement, modes, grasp=self._grasp_in_step)

    def state_dict(self) -> dict:
        """Mask, pruning and mask-tracker state and step counters (the plan is rebuilt from the
        mask; GraSP's calls of a constructor that pruned again belong to this process's first
        step, whatever the checkpoint)."""
        host = self.run.backend.asnumpy
        out = {
            "mask": host(self._m).copy(), "pruned": np.bool_(self.pruned),
            "prune_step": np.int64(-1 if self.prune_step is None else self.prune_step),
            "hook_mask": (host(self.hook.mask).copy() if self.hook is not None
                          else np.zeros(0, np.float32)),
            "steps": np.int64(self.steps), "packed_unit_steps": np.int64(self.packed_unit_steps),
            "stable_steps": np.array(self.stable_steps, dtype=np.int64),
            "was_packed": np.bool_(self._was_packed),
        }
        for u, tr in enumerate(self.trackers):
            out.update({f"tracker/{u}/{k}": v for k, v in tr.state_dict(host).items()})
        return out

    def load_state_dict(self, state: dict) -> None:
        xp = self.xp
        self._m[...] = xp.asarray(state["mask"])
        self.pruned = bool(state["pruned"])
        self.prune_step = None if int(state["prune_step"]) < 0 else int(state["prune_step"])
        if self.pruned:
            hook_mask = xp.asarray(state["hook_mask"])
            if self.hook is None:  # pruned after a warm-up that this process did not run
                self.hook = MaskHook(hook_mask)
                self.opt.add_hook(self.hook)
            else:
                self.hook.set_mask(hook_mask)
            self.plan = self._build_plan(self._m)
        for u, tr in enumerate(self.trackers):
            tr.load_state_dict({k[len(f"tracker/{u}/"):]: v for k, v in state.items()
                                if k.startswith(f"tracker/{u}/")}, xp)
        self.steps = int(state["steps"])
        self.packed_unit_steps = int(state["packed_unit_steps"])
        self.stable_steps = state["stable_steps"].tolist()
        self._was_packed = bool(state["was_packed"])

    def report(self) -> dict:
        """``payload_ratio`` (packed payload / dense payload per rank and step, every unit
        packed), ``wire_ratio`` / ``inter_wire_ratio`` (the plan's bytes of such a step over a
        dense one: all links / inter-node links), ``prune_step``, ``mask_stable_step`` (first
        step with every unit packed; ``mask_stable_steps`` lists every such switch),
        ``packed_fraction`` (of all unit-steps), ``mask_changes`` (after pruning, summed over
        units), ``mask_units``, ``kept`` ``K``, ``density`` ``K / T`` and ``prunable_density``
        (kept conv/fc fraction)."""
        plan = self.plan
        K = plan.kept if self.pruned else self.T
        U = plan.num_units
        where = self.topo.placement
        dense, packed = (price(plan.calls(where, (m,) * U), where)
                         for m in ("dense", plan.packed_mode))
        w = self.itemsize
        payload = (sum(-(-k // 4) for k in plan.unit_kept) + w * plan.num_scales
                   if self.options.ternary else w * K) / (w * self.T)
        kept_prunable = int((self._m & self.prunable).sum()) if self.pruned else self.n_prunable
        return {
            "payload_ratio": payload,
            "wire_ratio": ((packed.intra + packed.inter) / (dense.intra + dense.inter)
                           if dense.intra + dense.inter else None),
            "inter_wire_ratio": packed.inter / dense.inter if dense.inter else None,
            "prune_step": self.prune_step,
            "mask_stable_step": self.stable_steps[0] if self.stable_steps else None,
            "mask_stable_steps": self.stable_steps,
            "packed_fraction": self.packed_unit_steps / (U * self.steps) if self.steps else 0.0,
            "mask_changes": sum(max(t.version - 1, 0) for t in self.trackers),
            "mask_units": U,
            "kept": K,
            "density": K / self.T,
            "prunable_density": kept_prunable / self.n_prunable if self.n_prunable else 1.0,
        }
