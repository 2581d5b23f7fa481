"""PacTrain (paper 002): pruning, gradient sparsity enforcement, mask tracker, compact all-reduce.

One run (Algorithm 1 of the paper):

1. **Start from a trained model**: ``--init FILE`` loads the flat parameters (an ``.npz`` written
   by :func:`save_init`), and/or the first ``--warmup-steps`` steps are plain dense all-reduce
   steps (paper eq. 1) on the unpruned model.
2. **Prune** once, right after the warm-up (before the first post-warm-up gradient is computed;
   in the constructor when there is no warm-up): every conv and fc weight tensor ``l`` keeps its
   ``n_l − ⌊r n_l⌋`` most important entries (``r = --prune-ratio``).  Pruning is **per layer**
   (layer-wise ranking), so no layer can be wiped out and ``K`` is known from the layout; biases
   and BatchNorm parameters are never pruned.  Importance is ``|θ|`` (``--prune-score
   magnitude``) or the magnitude ``|S|`` of the GraSP score ``S = −θ ⊙ (H ∇ℓ)`` (eq. 4,
   ``--prune-score grasp``): the paper keeps "parameters critical for maintaining essential
   gradient directions", i.e. those whose removal changes the gradient flow most.  (GraSP's
   own rule, removing the largest signed ``S``, reached 0.53 test accuracy on digits at
   ``r = 0.5`` against 0.98 for ``|S|``.)  ``H ∇ℓ`` is a central finite difference of
   gradients, ``(∇ℓ(θ + εv) − ∇ℓ(θ − εv)) / 2ε`` with ``v = ∇ℓ``, where ``∇ℓ`` and the
   difference are averaged over all ranks (two recorded all-reduces), so every rank gets the
   same scores and the same mask.  Weights already exactly zero are pruned first.
3. **Gradient sparsity enforcement** (eq. 2) every step: ``g ← (θ ≠ 0) ⊙ g`` on the conv/fc
   entries; a :class:`models.MaskHook` on the optimizer masks the update (weight decay included)
   and the momentum, so pruned weights stay exactly zero.
4. **Mask tracker**: every step the mask ``m_t = (θ_t ≠ 0)`` (conv/fc; 1 on bias/BN) over the
   flat gradient buffer is compared with ``m_{t−1}``.  While it is unstable the masked gradient is
   averaged densely (``dense_allreduce``, DDP's buckets); once it has been unchanged for
   ``--stable-window`` consecutive comparisons every rank packs ``g[idx]`` (``idx`` =
   ``flatnonzero(m)``, identical everywhere, so no index travels) into one dense vector and
   all-reduces that (``packed_allreduce``).  The index set is planned once per stable mask; a
   change of the mask (a surviving weight reaching exactly 0) falls back to dense until it is
   stable again.
5. ``--ternary``: TernGrad on the packed vector (eq. 3): ``s = max_j max|g_j|`` by a MAX
   all-reduce (``ternary_scale``), by default one ``s`` per tensor (TernGrad's layer-wise
   scaling: ≈0.96 test accuracy on digits against ≈0.6 with ``--ternary-scale global``, one
   ``s`` for the whole vector: the variance ``s|g| − g²`` of every entry then grows with the
   largest gradient anywhere in the model),
   ``b ~ Bernoulli(|g|/s)`` from a per-rank, per-step stream
   seeded from the run seed (:func:`ternary_uniforms`), codes ``sign(g) · b`` packed 4 per byte
   (:func:`pack_2bit`) and all-gathered (``ternary_allgather``: a sum all-reduce of 2-bit codes
   is not closed), then every rank decodes and averages ``(s/p) Σ_j sign(g_j) b_j``, an unbiased
   estimate of the average gradient.

Closed forms: :mod:`commvol.pactrain`.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np

from commvol.pactrain import grasp_score_bytes, packed_payload_ratio, pactrain_step_bytes
from models import MaskHook, iterate_batches
from substrate import costmodel as cm
from substrate.backend import array_module

from .ddp import flat_buckets
from .strategy import Strategy, register

__all__ = ["PacTrainOptions", "PacTrain", "MaskTracker", "prunable_flags", "prune_mask",
           "hessian_vector_fd", "grasp_score", "ternary_uniforms", "ternarize", "pack_2bit",
           "unpack_2bit", "save_init", "load_init", "PRUNE_SCORES", "PRUNABLE_KINDS",
           "TERNARY_STREAM", "GRASP_SAMPLES", "GRASP_REL_STEP"]

PRUNE_SCORES = ("magnitude", "grasp")
TERNARY_SCALES = ("tensor", "global")
#: Parameter kinds that are pruned (biases and BatchNorm parameters are kept whole).
PRUNABLE_KINDS = ("conv", "fc")
#: Second word of the ternary streams' seed ``[seed, TERNARY_STREAM, rank, step]``.
TERNARY_STREAM = 2002
#: Samples of each rank's shard used for the GraSP gradient and Hessian-vector product.
GRASP_SAMPLES = 256
#: Finite-difference step of ``H v``: ``ε = GRASP_REL_STEP · max(‖θ‖, 1) / ‖v‖``.
GRASP_REL_STEP = 1e-3


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


def save_init(path, model) -> None:
    """Write ``model``'s flat parameters (key ``params``) and BatchNorm buffers to ``path`` (an
    ``.npz`` for ``--init``)."""
    def host(a):
        return a.get() if hasattr(a, "get") else np.asarray(a)
    np.savez(path, params=host(model.params.flat),
             **{f"buffer:{k}": host(v) for k, v in model.buffers.items()})


def _read_init(path) -> dict:
    """Every array of an ``--init`` file (a damaged file is a ``ValueError`` naming it)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"--init {path} is not a readable .npz ({type(exc).__name__}: {exc}); "
                         "pass a file written by dataparallel.pactrain.save_init(path, model)"
                         ) from None


def load_init(path, model) -> None:
    """Load an ``.npz`` of :func:`save_init` into ``model`` (in place; every rank loads the same
    file, so every rank starts from the same model)."""
    f = _read_init(path)
    if "params" not in f:
        raise ValueError(f"--init {path}: no 'params' array (the flat parameter vector); "
                         "write the file with dataparallel.pactrain.save_init(path, model)")
    flat = f["params"]
    if flat.shape != (model.layout.total,):
        raise ValueError(f"--init {path}: 'params' has shape {flat.shape} but the model has "
                         f"{model.layout.total} parameters; save it from the same --model "
                         "and --dataset")
    model.params.flat[...] = model.xp.asarray(flat, dtype=model.params.flat.dtype)
    for k, buf in model.buffers.items():
        key = f"buffer:{k}"
        if key in f:
            buf[...] = model.xp.asarray(f[key], dtype=buf.dtype)


# ---------------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PacTrainOptions:
    """Options of PacTrain."""

    prune_ratio: float = field(default=0.5, metadata={
        "help": "fraction of every conv/fc weight tensor pruned, in [0, 1)"})
    prune_score: str = field(default="magnitude", metadata={
        "help": "pruning importance: |theta| or |S| of the GraSP score S = -theta*(H grad) "
                "(eq. 4), both ranked per layer",
        "choices": PRUNE_SCORES})
    stable_window: int = field(default=5, metadata={
        "help": "steps the mask must stay unchanged before the packed all-reduce is used"})
    warmup_steps: int = field(default=0, metadata={
        "help": "dense all-reduce steps on the unpruned model before pruning"})
    init: str | None = field(default=None, metadata={
        "help": "start from this .npz of flat parameters (dataparallel.pactrain.save_init)",
        "type": str})
    ternary: bool = field(default=False, metadata={
        "help": "TernGrad on the packed gradient: 2-bit codes all-gathered (eq. 3)"})
    ternary_scale: str = field(default="tensor", metadata={
        "help": "TernGrad scale s = max|g|: one per tensor (TernGrad's layer-wise scaling) or "
                "one for the whole packed vector", "choices": TERNARY_SCALES})
    bucket_mib: float = field(default=32.0, metadata={"help": "gradient bucket size in MiB"})

    def __post_init__(self) -> None:
        if not 0 <= self.prune_ratio < 1:
            raise ValueError(f"--prune-ratio must be in [0, 1) (the fraction of each conv/fc "
                             f"tensor removed, e.g. 0.5); got {self.prune_ratio}")
        if self.prune_score not in PRUNE_SCORES:
            raise ValueError(f"--prune-score {self.prune_score!r} unknown; use one of "
                             f"{PRUNE_SCORES}")
        if self.stable_window < 0:
            raise ValueError(f"--stable-window must be >= 0 (steps of unchanged mask before "
                             f"packing, e.g. 5); got {self.stable_window}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0 (0: prune at the start); got "
                             f"{self.warmup_steps}")
        if self.init is not None and not os.path.isfile(self.init):
            raise ValueError(f"--init {self.init}: no such file; pass an .npz written by "
                             "dataparallel.pactrain.save_init(path, model)")
        if self.ternary_scale not in TERNARY_SCALES:
            raise ValueError(f"--ternary-scale {self.ternary_scale!r} unknown; use one of "
                             f"{TERNARY_SCALES}")
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")


@register
class PacTrain(Strategy):
    """Prune, enforce gradient sparsity, all-reduce the packed survivors once the mask is
    stable (optionally ternarized); see the module docstring."""

    name = "pactrain"
    Options = PacTrainOptions

    def __init__(self, ctx, options: PacTrainOptions) -> None:
        super().__init__(ctx, options)
        xp, layout = self.xp, self.layout
        self.model, self.opt = ctx.model, ctx.opt
        g = ctx.model.grads.flat
        self.itemsize = g.dtype.itemsize
        self.T = layout.total
        bucket_bytes = int(options.bucket_mib * (1 << 20))
        self.buckets = flat_buckets(layout, bucket_bytes, self.itemsize)
        self.bucket_elems = max(1, bucket_bytes // self.itemsize)
        self.prunable = xp.asarray(prunable_flags(layout))
        self.keep_always = ~self.prunable
        self.n_prunable = int(prunable_flags(layout).sum())
        #: TernGrad scales per step (one per tensor, or one)
        self.num_scales = len(layout) if options.ternary_scale == "tensor" else 1
        self.tracker = MaskTracker(options.stable_window)
        self._m = xp.ones(self.T, dtype=bool)      # this step's mask (θ ≠ 0 on conv/fc)
        self.hook: MaskHook | None = None
        self.pruned = False
        self.prune_step: int | None = None
        self.scores = None                           # host copy of the GraSP scores
        # the packed plan (once per stable mask version)
        self._plan_version = -1
        self.idx = None
        self.K = self.T
        # closed-form bytes: pruning traffic outside sync is charged to the current step
        self._pending: dict[str, dict] = {}
        self._step_bytes: dict[str, dict] = {}
        self.steps = self.packed_steps = 0
        self.stable_steps: list[int] = []            # steps at which packed mode (re)started
        self._was_packed = False
        if options.init is not None:
            load_init(options.init, ctx.model)
        if options.warmup_steps == 0:
            self._prune(step=0)

    # -- pruning --------------------------------------------------------------------------------
    def _prune(self, step: int) -> None:
        xp, theta = self.xp, self.model.params.flat
        zero = theta == 0
        if self.options.prune_score == "magnitude":
            importance = xp.abs(theta)
        else:
            importance = xp.abs(self._grasp_scores())
        mask = xp.asarray(prune_mask(importance, self.layout, self.options.prune_ratio, zero))
        theta *= mask
        self._m[...] = mask & ~zero | self.keep_always
        self.hook = MaskHook(self._m)
        self.opt.add_hook(self.hook)
        if self.opt.momentum_buffer is not None:
            self.opt.momentum_buffer *= self._m
        self.K = int(self._m.sum())
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
        v = world.allreduce(grad_fn(theta0), "avg", phase="grasp_allreduce")
        vnorm = float(xp.linalg.norm(v))
        if vnorm > 0:
            eps = GRASP_REL_STEP * max(float(xp.linalg.norm(theta0)), 1.0) / vnorm
            hv = hessian_vector_fd(grad_fn, theta0, v, eps)
        else:
            hv = xp.zeros_like(theta0)
        hv = world.allreduce(xp.ascontiguousarray(hv), "avg", phase="grasp_allreduce")
        model.params.flat[...] = theta0
        model.grads.flat[...] = grads0
        for k, buf in model.buffers.items():
            buf[...] = buffers0[k]
        score = grasp_score(theta0, hv)
        self.scores = score.get() if hasattr(score, "get") else np.array(score)
        self._charge({"grasp_allreduce": grasp_score_bytes(M=self.M, P=self.P, total=self.T,
                                                            itemsize=self.itemsize)})
        return score

    def _charge(self, phases: dict) -> None:
        """Add closed-form bytes of work done outside :meth:`sync` (pruning) to the current
        step, or to the first step when it happens in the constructor."""
        target = self._step_bytes if self.steps else self._pending
        for phase, v in phases.items():
            e = target.setdefault(phase, {cm.INTRA: 0, cm.INTER: 0})
            e[cm.INTRA] += v[cm.INTRA]
            e[cm.INTER] += v[cm.INTER]

    # -- the step ---------------------------------------------------------------------------------
    def _plan(self) -> None:
        """Index set and buffers of the packed vector for the current mask (once per version)."""
        xp = self.xp
        self.idx = xp.flatnonzero(self._m)
        self.K = int(self.idx.size)
        dtype = self.model.grads.flat.dtype
        self._packed = xp.empty(self.K, dtype=dtype)
        self._codes = xp.empty(-(-self.K // 4), dtype=np.uint8)
        if self.options.ternary_scale == "tensor":   # tensor l's survivors: packed[a_l:a_{l+1}]
            idx = self.idx.get() if hasattr(self.idx, "get") else self.idx
            offsets = [self.layout.offsets[n] for n in self.layout.names] + [self.T]
            bounds = np.searchsorted(idx, offsets)
        else:
            bounds = np.array([0, self.K])
        self._segments = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        self._segment_of = xp.asarray(np.repeat(np.arange(len(self._segments)), np.diff(bounds)))
        self._scale = xp.zeros(len(self._segments), dtype=dtype)
        self._plan_version = self.tracker.version

    def sync(self, state, buffers):
        xp, g, world = self.xp, buffers.flat, self.topo.world
        self._step_bytes, self._pending = self._pending, {}
        self.steps += 1
        mode = "dense"
        if self.pruned:
            theta = self.model.params.flat
            xp.not_equal(theta, 0, out=self._m)
            self._m |= self.keep_always
            before = self.tracker.version
            if self.tracker.observe(self._m):
                mode = "ternary" if self.options.ternary else "packed"
            if self.tracker.version != before:                # a new mask: re-mask the update
                self.hook.set_mask(self._m)
                self.K = int(self._m.sum())
            if mode != "dense" and self._plan_version != self.tracker.version:
                self._plan()
        if mode == "dense":
            if self.pruned:
                g *= self._m                                   # eq. 2 (GSE)
            for a, b in self.buckets:
                world.allreduce(g[a:b], "avg", phase="dense_allreduce")
        else:
            packed = self._packed
            xp.take(g, self.idx, out=packed)                   # eq. 2 + pack
            if mode == "packed":
                for a in range(0, self.K, self.bucket_elems):
                    world.allreduce(packed[a:a + self.bucket_elems], "avg",
                                    phase="packed_allreduce")
            else:
                self._ternary_average(packed, state.step)
            g.fill(0)
            g[self.idx] = packed
            self.packed_steps += 1
            if not self._was_packed:
                self.stable_steps.append(state.step)
        self._was_packed = mode != "dense"
        self._charge(self._closed_form(mode))
        return g

    def _ternary_average(self, packed, step: int) -> None:
        """Replace ``packed`` by ``(s/p) Σ_j ternarize(g_j)`` (eq. 3), identical on all ranks;
        ``s`` is the MAX all-reduce of each segment's (tensor's, or the whole vector's) max|g|."""
        xp, world = self.xp, self.topo.world
        scale = self._scale
        for l, (a, b) in enumerate(self._segments):
            scale[l] = xp.abs(packed[a:b]).max() if b > a else 0
        world.allreduce(scale, "max", phase="ternary_scale")
        s = scale[self._segment_of]
        u = xp.asarray(ternary_uniforms(self.ctx.seed, self.topo.rank, step, self.K,
                                        dtype=packed.dtype))
        pack_2bit(ternarize(packed, s, u), out=self._codes)
        gathered = world.allgather(self._codes, phase="ternary_allgather")
        total = unpack_2bit(gathered, self.K).sum(axis=0, dtype=np.int32)
        packed[...] = total * s / self.topo.size

    def after_step(self, state) -> None:
        if not self.pruned and state.step + 1 == self.options.warmup_steps:
            self._prune(step=state.step + 1)

    def step_bytes(self) -> dict[str, dict]:
        return self._step_bytes

    def state_dict(self) -> dict:
        """Mask, pruning and mask-tracker state, step counters and the pruning bytes still to
        charge (the packed plan is rebuilt from the mask)."""
        host = self.run.backend.asnumpy
        return {
            "mask": host(self._m).copy(), "pruned": np.bool_(self.pruned),
            "prune_step": np.int64(-1 if self.prune_step is None else self.prune_step),
            "hook_mask": (host(self.hook.mask).copy() if self.hook is not None
                          else np.zeros(0, np.float32)),
            **{f"tracker/{k}": v for k, v in self.tracker.state_dict(host).items()},
            "K": np.int64(self.K), "steps": np.int64(self.steps),
            "packed_steps": np.int64(self.packed_steps),
            "stable_steps": np.array(self.stable_steps, dtype=np.int64),
            "was_packed": np.bool_(self._was_packed), "pending": json.dumps(self._pending),
        }

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
        self.tracker.load_state_dict({k[len("tracker/"):]: v for k, v in state.items()
                                      if k.startswith("tracker/")}, xp)
        self._plan_version = -1  # re-planned from the mask at the next packed step
        self.K = int(state["K"])
        self.steps, self.packed_steps = int(state["steps"]), int(state["packed_steps"])
        self.stable_steps = state["stable_steps"].tolist()
        self._was_packed = bool(state["was_packed"])
        self._pending = json.loads(str(state["pending"]))

    def _closed_form(self, mode: str, kept: int | None = None) -> dict[str, dict]:
        return pactrain_step_bytes(M=self.M, P=self.P, mode=mode,
                                   bucket_sizes=[b - a for a, b in self.buckets],
                                   kept=self.K if kept is None else kept,
                                   bucket_elems=self.bucket_elems, itemsize=self.itemsize,
                                   scales=self.num_scales)

    def report(self) -> dict:
        """``payload_ratio`` (packed payload / dense payload per rank and step),
        ``wire_ratio`` / ``inter_wire_ratio`` (closed-form wire bytes of a packed step over a
        dense one: all links / inter-node links), ``prune_step``, ``mask_stable_step`` (first
        step in packed mode; ``mask_stable_steps`` lists every switch to packed),
        ``packed_fraction`` (of all steps), ``mask_changes`` (after pruning), ``kept`` ``K``,
        ``density`` ``K / T`` and ``prunable_density`` (kept conv/fc fraction)."""
        K = self.K if self.pruned else self.T
        dense = self._closed_form("dense", K)
        packed = self._closed_form("ternary" if self.options.ternary else "packed", K)

        def wire(d, links=(cm.INTRA, cm.INTER)):
            return sum(v[k] for v in d.values() for k in links)

        kept_prunable = int((self._m & self.prunable).sum()) if self.pruned else self.n_prunable
        return {
            "payload_ratio": packed_payload_ratio(kept=K, total=self.T,
                                                  ternary=self.options.ternary,
                                                  scales=self.num_scales, itemsize=self.itemsize),
            "wire_ratio": wire(packed) / wire(dense) if wire(dense) else None,
            "inter_wire_ratio": (wire(packed, (cm.INTER,)) / wire(dense, (cm.INTER,))
                                 if wire(dense, (cm.INTER,)) else None),
            "prune_step": self.prune_step,
            "mask_stable_step": self.stable_steps[0] if self.stable_steps else None,
            "mask_stable_steps": self.stable_steps,
            "packed_fraction": self.packed_steps / self.steps if self.steps else 0.0,
            "mask_changes": max(self.tracker.version - 1, 0),
            "kept": K,
            "density": K / self.T,
            "prunable_density": kept_prunable / self.n_prunable if self.n_prunable else 1.0,
        }
