"""SGD with momentum and AdamW on the flat buffers, learning-rate schedules, gradient hooks.

:class:`AdamW` (decoupled weight decay, Loshchilov & Hutter 2019) has the same interface and
hooks as :class:`SGD` (see its docstring for the update); :func:`make_optimizer` builds either by
name.  :class:`CosineLR` has a linear warm-up, optionally starting from a fraction of the peak.

One optimizer step is a handful of vectorised element-wise operations on the flat vector (no
per-tensor loop; :class:`SGD` runs them on cache-sized blocks, shared over the process's threads
once the Numba kernels are loaded, with the same bits), in this order::

    d  = g + wd ⊙ θ                      (g = grads.flat, never modified; wd per element or scalar)
    for hook in hooks: hook(d, opt)      (in place: proximal term, gradient mask, ...)
    b  = μ b + d                         (momentum buffer, PyTorch convention, no dampening)
    d  = d + μ b   if nesterov else  b
    θ  = θ − η_t d                       (η_t = schedule(step))

Hooks are callables ``hook(d, opt) -> None`` that modify the flat update direction ``d`` in place;
``opt`` gives access to ``opt.params``, ``opt.momentum_buffer``, ``opt.step_count``, ``opt.lr``.
Two are provided: :class:`ProximalHook` (H-SADMM, paper 000 eq. 8: ``d += ρ ⊙ (θ − z + u)`` with
one ρ per tensor) and :class:`MaskHook` (PacTrain, paper 002: ``d ← m ⊙ d``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from substrate.backend import array_module

from .kernel_loader import numba_kernels as _numba_kernels
from .params import PARAM_KINDS, FlatTensors, ParamLayout

#: elements per block of the optimizer's element-wise passes (four float32 vectors of one
#: block fit a 2 MiB L2 cache)
STEP_BLOCK = 1 << 16

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "SGD",
    "AdamW",
    "AdamWConfig",
    "ConstantLR",
    "CosineLR",
    "GradHook",
    "MaskHook",
    "ProximalHook",
    "SGDConfig",
    "StepLR",
    "make_optimizer",
    "make_schedule",
]


# ---------------------------------------------------------------------------------------------
# learning-rate schedules: frozen dataclasses, callable(step) -> lr
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConstantLR:
    """``η_t = lr``."""

    lr: float

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")

    def __call__(self, step: int) -> float:
        return float(self.lr)


@dataclass(frozen=True)
class StepLR:
    """``η_t = lr · gamma^floor(t / step_size)`` (t counts optimizer steps)."""

    lr: float
    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if self.step_size < 1:
            raise ValueError(f"step_size must be >= 1 optimizer step, got {self.step_size}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")

    def __call__(self, step: int) -> float:
        return float(self.lr * self.gamma ** (step // self.step_size))


@dataclass(frozen=True)
class CosineLR:
    """Linear warm-up then cosine decay to ``min_lr`` at ``total_steps``.

    ``η_t = min_lr + (lr − min_lr) · (1 + cos(π (t − w) / (T − w))) / 2`` for ``w <= t < T``,
    ``η_t = lr (t + 1) / w`` for ``t < w``, and ``min_lr`` for ``t >= T``.

    ``warmup_start = f > 0`` starts the warm-up from a fraction of the peak instead:
    ``η_t = lr (f + (1 − f)(t + 1) / w)`` for ``t < w`` (SDP paper 003, App. D: "cosine learning
    rate schedule with 10% warmup (from 10% of peak LR)" is ``warmup_steps = T / 10``,
    ``warmup_start = 0.1``).  ``f = 0`` is the plain linear warm-up above.
    """

    lr: float
    total_steps: int
    min_lr: float = 0.0
    warmup_steps: int = 0
    warmup_start: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if not 0 <= self.warmup_start < 1:
            raise ValueError(f"warmup_start (fraction of the peak lr the warm-up starts from) "
                             f"must be in [0, 1), got {self.warmup_start}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr], got {self.min_lr}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps), got {self.warmup_steps}")

    def __call__(self, step: int) -> float:
        w, T = self.warmup_steps, self.total_steps
        if step < w:
            f = self.warmup_start
            return float(self.lr * (f + (1.0 - f) * (step + 1) / w))
        if step >= T:
            return float(self.min_lr)
        frac = (step - w) / (T - w)
        return float(self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac)))


#: ``--lr-schedule`` name -> schedule class
SCHEDULES = {"constant": ConstantLR, "step": StepLR, "cosine": CosineLR}


def make_schedule(name: str, lr: float, total_steps: int, *, step_size: int | None = None,
                  gamma: float = 0.1, min_lr: float = 0.0, warmup_steps: int = 0,
                  warmup_start: float = 0.0):
    """Build a schedule by name.

    Parameters
    ----------
    name : {"constant", "step", "cosine"}
    lr : float
        Base learning rate.
    total_steps : int
        Optimizer steps of the whole run (cosine horizon; default step size is a third of it).
    step_size, gamma : StepLR parameters.
    min_lr, warmup_steps, warmup_start : CosineLR parameters.
    """
    if name == "constant":
        return ConstantLR(lr)
    if name == "step":
        return StepLR(lr, step_size if step_size is not None else max(1, total_steps // 3), gamma)
    if name == "cosine":
        return CosineLR(lr, total_steps, min_lr, warmup_steps, warmup_start)
    raise ValueError(f"unknown lr schedule {name!r}; valid names: {sorted(SCHEDULES)}")


# ---------------------------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------------------------
class GradHook(Protocol):
    """``hook(d, opt)`` modifies the flat update direction ``d`` in place."""

    def __call__(self, d, opt: SGD) -> None: ...


def _per_element(layout: ParamLayout, value, xp, dtype, what: str):
    """Scalar stays scalar; dict / per-tensor sequence / flat vector becomes a flat xp vector."""
    if np.isscalar(value):
        return float(value)
    if isinstance(value, dict):
        return xp.asarray(layout.expand(value, dtype=dtype))
    arr = np.asarray(value.get() if hasattr(value, "get") else value)
    if arr.shape == (layout.total,):
        return xp.asarray(arr, dtype=dtype)
    if arr.shape == (len(layout),):
        return xp.asarray(layout.expand(list(arr), dtype=dtype))
    raise ValueError(
        f"{what} must be a scalar, a dict name -> value, {len(layout)} per-tensor values in "
        f"layout.names order, or a flat vector of length {layout.total}; got shape {arr.shape}")


class ProximalHook:
    """H-SADMM proximal term (paper 000, eq. 8): ``d += ρ ⊙ (θ − z + u)``.

    Parameters
    ----------
    layout : ParamLayout
    rho : float, dict name -> float, sequence or flat vector
        The per-layer penalty ρ₁ broadcast over each tensor (a sequence has one value per
        tensor in ``layout.names`` order).
    center : flat array, optional
        ``c = z − u`` (so the term is ``ρ ⊙ (θ − c)``); set later with :meth:`set_center`.

    Notes
    -----
    Buffers are allocated once (plan once, run many); :meth:`set_rho` and :meth:`set_center` copy
    into them.  Until a center is set the hook is inactive.
    """

    def __init__(self, layout: ParamLayout, rho, center=None, *, xp=np, dtype=np.float32):
        self.layout, self.xp, self.dtype = layout, xp, np.dtype(dtype)
        self.rho = _per_element(layout, rho, xp, self.dtype, "rho")
        self._center = xp.zeros(layout.total, dtype=self.dtype)
        self._tmp = xp.empty(layout.total, dtype=self.dtype)
        self.active = False
        if center is not None:
            self.set_center(center)

    def set_rho(self, rho) -> None:
        """Replace ρ (scalar, dict, per-tensor sequence or flat vector)."""
        self.rho = _per_element(self.layout, rho, self.xp, self.dtype, "rho")

    def set_center(self, z, u=None) -> None:
        """Set the anchor to ``z − u`` (``u`` optional), both flat vectors of length ``total``."""
        if tuple(z.shape) != (self.layout.total,):
            raise ValueError(f"z must be a flat vector of length {self.layout.total}, "
                             f"got shape {tuple(z.shape)}")
        self._center[...] = z
        if u is not None:
            if tuple(u.shape) != (self.layout.total,):
                raise ValueError(f"u must be a flat vector of length {self.layout.total}, "
                                 f"got shape {tuple(u.shape)}")
            self._center -= u
        self.active = True

    @property
    def center(self):
        """The current anchor ``z − u`` (flat)."""
        return self._center

    def __call__(self, d, opt: SGD) -> None:
        if not self.active:
            return
        tmp = self._tmp
        self.xp.subtract(opt.params.flat, self._center, out=tmp)
        tmp *= self.rho
        d += tmp


class MaskHook:
    """PacTrain gradient sparsity enforcement (paper 002): ``d ← m ⊙ d``.

    Parameters
    ----------
    mask : flat array (bool or 0/1) of length ``total``
    freeze_momentum : bool, default True
        Also zero the momentum buffer where ``m = 0`` so masked weights stay exactly where they
        are (without it, momentum accumulated before masking would keep moving them).
    """

    def __init__(self, mask, *, freeze_momentum: bool = True):
        self.freeze_momentum = freeze_momentum
        self._mask = None
        self.set_mask(mask)

    def set_mask(self, mask) -> None:
        """Replace the mask (copied into a float vector of the same dtype as the update)."""
        if mask.ndim != 1:
            raise ValueError(f"mask must be a flat 1-D vector, got shape {tuple(mask.shape)}")
        xp = array_module(mask)
        m = mask.astype(np.float32) if mask.dtype == bool else mask
        if self._mask is not None and self._mask.shape == m.shape:
            self._mask[...] = m
        else:
            self._mask = xp.array(m, copy=True)

    @property
    def mask(self):
        return self._mask

    def __call__(self, d, opt: SGD) -> None:
        if d.shape != self._mask.shape:
            raise ValueError(f"mask has length {self._mask.shape[0]} but the model has "
                             f"{d.shape[0]} parameters; build the mask from model.layout")
        d *= self._mask
        if self.freeze_momentum and opt.momentum_buffer is not None:
            opt.momentum_buffer *= self._mask


# ---------------------------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------------------------
def _check_decay(config) -> None:
    """Validate ``weight_decay`` and ``decay_kinds`` of an optimizer config (frozen: the kinds
    are stored as a tuple)."""
    if config.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {config.weight_decay}")
    if config.decay_kinds is not None:
        bad = [k for k in config.decay_kinds if k not in PARAM_KINDS]
        if bad:
            raise ValueError(f"decay_kinds {bad} unknown; valid kinds are {PARAM_KINDS}")
        object.__setattr__(config, "decay_kinds", tuple(config.decay_kinds))


@dataclass(frozen=True)
class SGDConfig:
    """SGD hyper-parameters.

    Attributes
    ----------
    lr : float
        Learning rate when no schedule is given.
    momentum : float
        μ in ``b = μ b + d``; 0 disables the buffer.
    nesterov : bool
        Nesterov momentum (needs ``momentum > 0``).
    weight_decay : float
        λ in ``d = g + λ θ``.
    decay_kinds : tuple of str or None
        Parameter kinds that get weight decay (``None``: all).  The paper's objective (000 eq. 1)
        decays weights only: ``("conv", "fc")``.
    """

    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    decay_kinds: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (e.g. momentum=0.9)")
        _check_decay(self)


class _FlatOptimizer:
    """What SGD and AdamW share: the flat parameter / gradient pair, the schedule, the gradient
    hooks, the per-element weight-decay vector and two scratch vectors."""

    def _bind(self, params: FlatTensors, grads: FlatTensors, config, schedule, hooks):
        if params.layout is not grads.layout and params.layout.names != grads.layout.names:
            raise ValueError("params and grads must share one layout (use model.params, "
                             "model.grads)")
        self.params, self.grads, self.config = params, grads, config
        self.schedule = schedule if schedule is not None else ConstantLR(config.lr)
        self.hooks: list[GradHook] = list(hooks)
        self.xp = array_module(params.flat)
        self.step_count = 0
        return self.xp

    def _scratch_and_decay(self, params: FlatTensors, config) -> None:
        """Scratch vectors and ``λ`` per element (0 outside ``config.decay_kinds``)."""
        xp = self.xp
        self._d = xp.empty_like(params.flat)
        self._tmp = xp.empty_like(params.flat)
        if config.weight_decay == 0:
            self._wd = 0.0
        elif config.decay_kinds is None:
            self._wd = float(config.weight_decay)
        else:
            vals = {n: (config.weight_decay if params.layout.kind(n) in config.decay_kinds else 0.0)
                    for n in params.layout.names}
            self._wd = xp.asarray(params.layout.expand(vals, dtype=params.dtype))

    @property
    def lr(self) -> float:
        """Learning rate the next :meth:`step` will use."""
        return self.schedule(self.step_count)

    def add_hook(self, hook: GradHook) -> None:
        """Append a hook (runs after the existing ones)."""
        self.hooks.append(hook)

    def zero_grad(self) -> None:
        """Zero ``grads.flat`` (not needed between steps: backward overwrites gradients)."""
        self.grads.zero_()

    def flops(self) -> float:
        """Element operations of one :meth:`step` (``ops per parameter × parameters``, the
        optimizer's block for the ``flops`` compute source; hooks not counted)."""
        return float(self._ops_per_element()) * self.params.flat.size

    def _weight_decayed(self) -> bool:
        return not (isinstance(self._wd, float) and self._wd == 0.0)


class SGD(_FlatOptimizer):
    """SGD with momentum / Nesterov / weight decay on flat buffers, with gradient hooks.

    Parameters
    ----------
    params, grads : FlatTensors
        ``model.params`` and ``model.grads`` (same layout).
    config : SGDConfig
    schedule : callable(step) -> lr, optional
        Default ``ConstantLR(config.lr)``.  ``step`` counts calls to :meth:`step`.
    hooks : iterable of GradHook
        Applied in order after weight decay, before momentum.
    """

    def __init__(self, params: FlatTensors, grads: FlatTensors, config: SGDConfig = SGDConfig(),
                 schedule: Callable[[int], float] | None = None,
                 hooks: Iterable[GradHook] = ()):
        xp = self._bind(params, grads, config, schedule, hooks)
        self.momentum_buffer = xp.zeros_like(params.flat) if config.momentum > 0 else None
        self._scratch_and_decay(params, config)

    def step(self) -> float:
        """Apply one update to ``params.flat`` in place; returns the learning rate used.

        Every operation is element-wise, so the flat vector is updated in blocks of
        :data:`STEP_BLOCK` elements (cache-sized: one block's ``g, θ, b, d`` stay in cache across
        the operations), the blocks shared over the process's threads once the Numba kernels
        are loaded (:func:`models.kernel_loader.numba_kernels`); the same operations element by
        element, so the same bits for any blocking and thread count.  Hooks see the whole
        ``d``: with hooks the pass is split into the part before them and the part after.
        """
        lr = self.schedule(self.step_count)
        n = self.params.flat.size
        block = STEP_BLOCK if self.xp is np else max(n, 1)    # CuPy: whole-vector kernels
        nblocks = -(-n // block)
        k = _numba_kernels(self.xp)
        if k is not None:
            def run(part):
                k.parallel_for(part, nblocks, 4 * n, lr, block)
        else:
            def run(part):
                part(lr, block, 0, nblocks)
        if self.hooks:
            run(self._direction)
            for hook in self.hooks:
                hook(self._d, self)
            run(self._update)
        else:
            run(self._direction_update)
        self.step_count += 1
        return lr

    def _direction(self, lr, block, lo, hi):
        """Blocks ``lo..hi-1`` (of ``block`` elements) of ``d = g + λ θ``."""
        theta, d, tmp = self.params.flat, self._d, self._tmp
        for i in range(lo, hi):
            s = slice(i * block, (i + 1) * block)
            d[s] = self.grads.flat[s]
            if self._weight_decayed():
                wd = self._wd if isinstance(self._wd, float) else self._wd[s]
                self.xp.multiply(theta[s], wd, out=tmp[s])
                d[s] += tmp[s]

    def _update(self, lr, block, lo, hi):
        """Blocks ``lo..hi-1`` of ``b = μ b + d``, ``d = d + μ b`` (Nesterov) or ``b``,
        ``θ = θ − η d``."""
        theta, tmp, mu = self.params.flat, self._tmp, self.config.momentum
        for i in range(lo, hi):
            s = slice(i * block, (i + 1) * block)
            d = self._d[s]
            if self.momentum_buffer is not None:
                b = self.momentum_buffer[s]
                b *= mu
                b += d
                if self.config.nesterov:
                    self.xp.multiply(b, mu, out=tmp[s])
                    d += tmp[s]
                else:
                    d = b
            self.xp.multiply(d, lr, out=tmp[s])
            theta[s] -= tmp[s]

    def _direction_update(self, lr, block, lo, hi):
        """Both passes, block by block (no hooks between them)."""
        for i in range(lo, hi):
            self._direction(lr, block, i, i + 1)
            self._update(lr, block, i, i + 1)

    def _ops_per_element(self) -> int:
        # copy g, [λθ, +], [μb, +], [μb, + (Nesterov)], lr·d, θ − …
        return (1 + 2 * self._weight_decayed() + 2 * (self.momentum_buffer is not None)
                + 2 * bool(self.config.nesterov) + 2)

    def state_dict(self) -> dict:
        """``{"step_count": int, "momentum_buffer": numpy array or None}`` (host copies)."""
        b = self.momentum_buffer
        host = None if b is None else (b.get() if hasattr(b, "get") else b.copy())
        return {"step_count": self.step_count, "momentum_buffer": host}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (in place)."""
        self.step_count = int(state["step_count"])
        b = state.get("momentum_buffer")
        if (b is None) != (self.momentum_buffer is None):
            raise ValueError("optimizer state and config disagree on momentum (buffer present in "
                             "one but not the other)")
        if b is not None:
            if tuple(b.shape) != tuple(self.momentum_buffer.shape):
                raise ValueError(f"momentum buffer has shape {tuple(b.shape)}, expected "
                                 f"{tuple(self.momentum_buffer.shape)}")
            self.momentum_buffer[...] = self.xp.asarray(b)


# ---------------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters (Loshchilov & Hutter 2019, Algorithm 2; PyTorch ``AdamW``).

    Attributes
    ----------
    lr : float
        Peak learning rate η when no schedule is given.
    beta1, beta2 : float
        Decay rates of the first and second moment estimates.
    eps : float
        ε added to ``sqrt(v̂)``.
    weight_decay : float
        Decoupled decay λ: ``θ ← θ − η λ θ`` (not added to the gradient).
    decay_kinds : tuple of str or None
        Parameter kinds that get weight decay (``None``: all).  Transformers usually decay the
        weight matrices only: ``("conv", "fc")`` (no decay of biases and norm gains).
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_kinds: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        _check_decay(self)


class AdamW(_FlatOptimizer):
    """AdamW on flat buffers (Loshchilov & Hutter 2019, Algorithm 2, with η_t = schedule(t)).

    One step, ``t = step_count + 1``, all element-wise on the whole flat vector::

        d  = g;  for hook in hooks: hook(d, opt)
        m  = β1 m + (1 − β1) d
        v  = β2 v + (1 − β2) d²
        θ  = θ − η_t λ ⊙ θ                          (decoupled weight decay, λ per element)
        θ  = θ − η_t m / (1 − β1^t) / (sqrt(v / (1 − β2^t)) + ε)

    Same interface as :class:`SGD` (``step``, ``lr``, ``step_count``, hooks, ``state_dict``);
    ``momentum_buffer`` is the first moment ``m``, so :class:`MaskHook` (which zeros it where the
    mask is 0) freezes masked weights under AdamW too.
    """

    def __init__(self, params: FlatTensors, grads: FlatTensors,
                 config: AdamWConfig = AdamWConfig(),
                 schedule: Callable[[int], float] | None = None,
                 hooks: Iterable[GradHook] = ()):
        xp = self._bind(params, grads, config, schedule, hooks)
        self.momentum_buffer = xp.zeros_like(params.flat)
        self.exp_avg_sq = xp.zeros_like(params.flat)
        self._scratch_and_decay(params, config)

    def step(self) -> float:
        """Apply one update to ``params.flat`` in place; returns the learning rate used.

        With the Numba kernels loaded (a transformer's layers load them), one fused pass in
        blocks of :data:`STEP_BLOCK` elements shared over the process's threads, in the same
        float32 operation order as the array path below (the same bits); the gradient is
        copied into ``d`` only when hooks are to modify it."""
        xp, c = self.xp, self.config
        lr = self.schedule(self.step_count)
        t = self.step_count + 1
        theta, d, tmp = self.params.flat, self._d, self._tmp
        m, v = self.momentum_buffer, self.exp_avg_sq
        k = _numba_kernels(xp)
        if k is not None and theta.dtype.kind == "f":
            if self.hooks:
                d[...] = self.grads.flat
                for hook in self.hooks:
                    hook(d, self)
            else:
                d = self.grads.flat
            k.adamw_step(theta, d, m, v, self._wd, lr, c.beta1, c.beta2, c.eps,
                         1.0 - c.beta1 ** t, 1.0 - c.beta2 ** t, STEP_BLOCK)
            self.step_count = t
            return lr
        d[...] = self.grads.flat
        for hook in self.hooks:
            hook(d, self)
        m *= c.beta1
        xp.multiply(d, 1.0 - c.beta1, out=tmp)
        m += tmp
        v *= c.beta2
        xp.multiply(d, d, out=tmp)
        tmp *= 1.0 - c.beta2
        v += tmp
        if not (isinstance(self._wd, float) and self._wd == 0.0):
            xp.multiply(theta, self._wd, out=tmp)
            tmp *= lr
            theta -= tmp
        bc1, bc2 = 1.0 - c.beta1 ** t, 1.0 - c.beta2 ** t
        xp.divide(v, bc2, out=tmp)
        xp.sqrt(tmp, out=tmp)
        tmp += c.eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / bc1
        theta -= tmp
        self.step_count = t
        return lr

    def _ops_per_element(self) -> int:
        # copy g; m: ·β1, (1−β1)·d, +; v: ·β2, d², ·(1−β2), +; [λθ, ·lr, −]; v/bc2, √, +ε, m/…,
        # ·lr/bc1, θ − …
        return 1 + 3 + 4 + 3 * self._weight_decayed() + 6

    def state_dict(self) -> dict:
        """``{"step_count", "momentum_buffer" (m), "exp_avg_sq" (v)}`` (host copies)."""
        def host(a):
            return a.get() if hasattr(a, "get") else a.copy()
        return {"step_count": self.step_count, "momentum_buffer": host(self.momentum_buffer),
                "exp_avg_sq": host(self.exp_avg_sq)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (in place); both moments are required."""
        missing = [k for k in ("step_count", "momentum_buffer", "exp_avg_sq") if
                   state.get(k) is None]
        if missing:
            raise ValueError(f"AdamW state lacks {missing}; save it with AdamW.state_dict()")
        for key, buf in (("momentum_buffer", self.momentum_buffer),
                         ("exp_avg_sq", self.exp_avg_sq)):
            if tuple(state[key].shape) != tuple(buf.shape):
                raise ValueError(f"AdamW {key} has shape {tuple(state[key].shape)}, expected "
                                 f"{tuple(buf.shape)}")
            buf[...] = self.xp.asarray(state[key])
        self.step_count = int(state["step_count"])


#: ``--optimizer`` name -> config class
OPTIMIZERS = {"sgd": SGDConfig, "adamw": AdamWConfig}


def make_optimizer(name: str, params: FlatTensors, grads: FlatTensors, *, lr: float,
                   weight_decay: float = 0.0, momentum: float = 0.9, nesterov: bool = False,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   decay_kinds: tuple[str, ...] | None = None, schedule=None,
                   hooks: Iterable[GradHook] = ()):
    """:class:`SGD` (``"sgd"``) or :class:`AdamW` (``"adamw"``) on ``params`` / ``grads``."""
    if name == "sgd":
        cfg = SGDConfig(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        decay_kinds=decay_kinds)
        return SGD(params, grads, cfg, schedule=schedule, hooks=hooks)
    if name == "adamw":
        cfg = AdamWConfig(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                          weight_decay=weight_decay, decay_kinds=decay_kinds)
        return AdamW(params, grads, cfg, schedule=schedule, hooks=hooks)
    raise ValueError(f"unknown optimizer {name!r}; valid names: {sorted(OPTIMIZERS)}")
