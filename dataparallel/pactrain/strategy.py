"""The PacTrain strategy (paper 002, Algorithm 1): :class:`PacTrain` runs a
:class:`~.plan.PacTrainPlan` from its step programs.

Warm-up or ``--init``, prune once, enforce gradient sparsity every step (eq. 2, a
:class:`models.MaskHook` on the optimizer), track each bucket's mask and all-reduce the packed
survivors of stable buckets (optionally ternarized, eq. 3), during the backward with
``--overlap on``.  Each step's records (:meth:`PacTrain.records`, the plan's
:meth:`~.plan.PacTrainPlan.records`) are laid into the step's program by the trainer; the
strategy binds their buffers (the gradient's buckets, the packed vectors, the scales and
codes) and their compute items (eq. 2, packing, TernGrad's encoding, unpacking, GraSP).  The
full description is :mod:`dataparallel.pactrain`'s docstring.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from models import MaskHook, iterate_batches
from substrate.calls import price

from ..strategy import Strategy, register
from .init_file import load_init
from .options import PacTrainOptions
from .plan import PacTrainPlan
from .pruning import (
    GRASP_REL_STEP,
    GRASP_SAMPLES,
    grasp_score,
    hessian_vector_fd,
    prunable_flags,
    prune_importance,
    prune_mask,
)
from .ternary import pack_2bit, ternarize, ternary_uniforms, unpack_2bit
from .tracker import MaskTracker

__all__ = ["PacTrain"]


@register
class PacTrain(Strategy):
    """Prune, enforce gradient sparsity, all-reduce every stable bucket's packed survivors
    (optionally ternarized); runs a :class:`PacTrainPlan`'s records (see the module
    docstring)."""

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
        self._records: dict = {}                     # (modes, gse, grasp) -> the step's records
        # before pruning: the keep-rate plan (its dense buckets and schedule)
        self.plan = self._build_plan(None)
        self.trackers = [MaskTracker(options.stable_window) for _ in self.plan.units]
        self._m = xp.ones(self.T, dtype=bool)      # this step's mask (θ ≠ 0 on conv/fc)
        self.hook: MaskHook | None = None
        self.pruned = False
        self.prune_step: int | None = None
        self.scores = None                           # host copy of the GraSP scores
        self.steps = 0
        self.packed_unit_steps = 0                   # Σ over steps of the units sent packed
        self.stable_steps: list[int] = []            # steps at which every unit (re)started packing
        self._was_packed = False
        # the step in flight: its number, its units' modes, TernGrad's uniforms (drawn at the
        # first encoding), the gathered codes of its ternary units; GraSP's state between its
        # records, its scores until the pruning
        self._live = 0
        self._modes = ("dense",) * self.plan.num_units
        self._uniforms = None
        self._gathered: dict = {}
        self._grasp: dict | None = None
        self._score = None
        self._setup: list = []
        if options.init is not None:
            load_init(options.init, ctx.model)
        if options.warmup == 0:
            if options.prune_score != "magnitude":     # GraSP's scores: a set-up
                self._setup = self.plan.grasp_records(self.topo.placement)
                self.executor.run_records(self._setup, self, self.topo.placement)
            self._prune(step=0)

    def _build_plan(self, mask) -> PacTrainPlan:
        """The plan of :meth:`PacTrainPlan.build` for ``mask`` (``None``: from the keep rate),
        with its index sets on the device (a new plan: new records)."""
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
            self._chunk_at = [np.concatenate(([0], np.cumsum(c))).astype(int).tolist()
                              for c in plan.chunks]
        self._records = {}
        return plan

    def setup_records(self) -> list:
        """GraSP's set-up (:meth:`PacTrainPlan.grasp_records`) when the constructor pruned with
        GraSP scores (``--warmup-steps 0``), run on :attr:`executor` before the first step."""
        return self._setup

    # -- pruning --------------------------------------------------------------------------------
    def _prune(self, step: int) -> None:
        xp, theta = self.xp, self.model.params.flat
        zero = theta == 0
        kind = self.options.prune_score
        score = None
        if kind != "magnitude":
            score, self._score = self._score, None
            if score is None:
                raise RuntimeError("PacTrain: pruning by GraSP scores before they were "
                                   "computed (the step's records hold GraSP's set-up)")
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

    @contextmanager
    def _unrecorded(self):
        """The model's passes of GraSP as part of one compute item, not layer events of their
        own (the numerics are the same with and without a recorder)."""
        model = self.model
        rec = model.recorder
        model.recorder = None
        try:
            yield
        finally:
            model.recorder = rec

    def _grasp_grad(self, theta):
        st = self._grasp
        with self._unrecorded():
            self.model.params.flat[...] = theta
            self.model.loss_and_grad(st["x"], st["y"])
        return self.model.grads.flat.copy()

    def _grasp_start(self) -> None:
        """``pactrain_grasp_grad``: the gradient ``∇ℓ`` at θ on :data:`GRASP_SAMPLES` samples of
        this rank's shard (its all-reduce averages it over the ranks); the model is kept to be
        restored."""
        model, cfg = self.model, self.ctx.config
        x, y = next(iterate_batches(self.ctx.train, min(GRASP_SAMPLES, len(self.ctx.train)),
                                    seed=int(cfg.seed), rank=self.topo.rank, epoch=0))
        self._grasp = {"x": x, "y": y, "theta0": model.params.flat.copy(),
                       "grads0": model.grads.flat.copy(),
                       "buffers0": {k: v.copy() for k, v in model.buffers.items()}}
        self._grasp["v"] = self._grasp_grad(self._grasp["theta0"])

    def _grasp_hvp(self) -> None:
        """``pactrain_grasp_hvp``: ``H v`` by a central finite difference of gradients around θ
        along the averaged ``v = ∇ℓ`` (its all-reduce averages it); the model restored."""
        xp, model, st = self.xp, self.model, self._grasp
        theta0, v = st["theta0"], st["v"]
        vnorm = float(xp.linalg.norm(v))
        if vnorm > 0:
            eps = GRASP_REL_STEP * max(float(xp.linalg.norm(theta0)), 1.0) / vnorm
            hv = hessian_vector_fd(self._grasp_grad, theta0, v, eps)
        else:
            hv = xp.zeros_like(theta0)
        st["hv"] = xp.ascontiguousarray(hv)
        model.params.flat[...] = theta0
        model.grads.flat[...] = st["grads0"]
        for k, buf in model.buffers.items():
            buf[...] = st["buffers0"][k]

    def _grasp_done(self) -> None:
        """``pactrain_grasp_score``: ``S = −θ ⊙ (H ∇ℓ)`` (eq. 4), the same on every rank, for
        the pruning that follows."""
        st, self._grasp = self._grasp, None
        score = grasp_score(st["theta0"], st["hv"])
        self.scores = score.get() if hasattr(score, "get") else np.array(score)
        self._score = score

    # -- the step's records ----------------------------------------------------------------------
    def records(self, state) -> list:
        """The records of step ``state.step``: once pruned, the mask trackers compare this
        step's mask ``θ ≠ 0`` (a change re-masks and re-plans) and fix every unit's mode (θ
        does not change before the update, so they compare it before the step runs); then the
        plan's :meth:`~PacTrainPlan.records` of those modes, with GraSP's set-up after the
        update where the warm-up ends.  One list per plan and kind of step."""
        xp, step = self.xp, int(state.step)
        modes = ["dense"] * self.plan.num_units
        if self.pruned:
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
        modes = tuple(modes)
        self._live, self._modes, self._uniforms = step, modes, None
        self.steps += 1
        n_packed = sum(m != "dense" for m in modes)
        self.packed_unit_steps += n_packed
        all_packed = n_packed == len(modes)
        if all_packed and not self._was_packed:
            self.stable_steps.append(step)
        self._was_packed = all_packed
        grasp = (not self.pruned and self.options.prune_score != "magnitude"
                 and step + 1 == self.options.warmup)
        key = (modes, self.pruned, grasp)
        out = self._records.get(key)
        if out is None:
            out = self._records[key] = self.plan.records(
                self.topo.placement, modes, gse=self.pruned,
                ternary_wait=self.options.ternary_wait, grasp=grasp)
        return out

    # -- bindings: buffers, codecs, compute items ---------------------------------------------------
    def buffer(self, call):
        """The array a record works on: a dense bucket of the gradient, a chunk of a unit's
        packed vector, a ternary unit's scales or codes, GraSP's vectors."""
        name, _, at = call.label.partition("[")
        at = at.rstrip("]")
        if name == "dense_allreduce":
            a, b = self.plan.buckets[int(at)]
            return self.model.grads.flat[a:b]
        if name == "packed_allreduce":
            u, c = (int(x) for x in at.split("."))
            lo, hi = self._chunk_at[u][c], self._chunk_at[u][c + 1]
            return self._packed[u][lo:hi]
        if name == "ternary_scale":
            return self._scale[int(at)]
        if name == "ternary_allgather":
            return self._codes[int(at)]
        if name == "grasp_allreduce":
            return self._grasp["v" if at == "0" else "hv"]
        return super().buffer(call)

    def received(self, call, result) -> None:
        """A ternary unit's gathered codes are kept for its decoding (every other record works
        in place)."""
        if call.phase == "ternary_allgather":
            self._gathered[int(call.label[len("ternary_allgather["):-1])] = result

    def compute(self, label: str):
        name, _, at = label.partition("[")
        at = at.rstrip("]")
        fns = {"pactrain_gse": self._gse, "pactrain_pack": self._pack,
               "pactrain_encode": self._encode, "pactrain_unpack": self._unpack}
        if name in fns:
            k = int(at)
            return lambda: fns[name](k)
        grasp = {"pactrain_grasp_grad": self._grasp_start, "pactrain_grasp_hvp": self._grasp_hvp,
                 "pactrain_grasp_score": self._grasp_done}
        if label in grasp:
            return grasp[label]
        return super().compute(label)

    def flops(self, label: str):
        """GraSP's passes: one forward and backward per sample for ``∇ℓ``, two for ``H ∇ℓ``
        (the codec's items have no FLOP count: measured)."""
        if label in ("pactrain_grasp_grad", "pactrain_grasp_hvp"):
            per = sum(u.forward_flops + u.backward_flops for u in self.model.compute_units())
            n = min(GRASP_SAMPLES, len(self.ctx.train))
            return float((1 if label == "pactrain_grasp_grad" else 2) * per * n)
        return None

    def _gse(self, k: int) -> None:
        """Eq. 2 (GSE) on dense bucket ``k``: ``g ← (θ ≠ 0) ⊙ g``."""
        a, b = self.plan.buckets[k]
        self.model.grads.flat[a:b] *= self._m[a:b]

    def _pack(self, u: int) -> None:
        """Unit ``u``'s survivors into its packed vector (eq. 2 + pack); ternary, also every
        segment's ``max|g|`` (its MAX all-reduce makes it the scale)."""
        xp = self.xp
        packed = self._packed[u]
        xp.take(self.model.grads.flat, self._idx[u], out=packed)
        if self._modes[u] == "ternary":
            scale = self._scale[u]
            for l, (sa, sb) in enumerate(self.plan.segments[u]):
                scale[l] = xp.abs(packed[sa:sb]).max() if sb > sa else 0

    def _encode(self, u: int) -> None:
        """TernGrad (eq. 3) on unit ``u``'s packed vector with its scales ``s``: codes
        ``sign(g) · b``, ``b ~ Bernoulli(|g|/s)`` from this rank's stream of the step, packed 4
        per byte."""
        xp, plan = self.xp, self.plan
        packed = self._packed[u]
        if self._uniforms is None:                       # one stream per rank and step
            self._uniforms = xp.asarray(ternary_uniforms(self.ctx.seed, self.topo.rank,
                                                         self._live, plan.kept,
                                                         dtype=packed.dtype))
        off = plan.packed_offsets[u]
        s = self._scale[u][self._segment_of[u]]
        pack_2bit(ternarize(packed, s, self._uniforms[off:off + packed.size]),
                  out=self._codes[u])

    def _unpack(self, u: int) -> None:
        """Unit ``u``'s average into its survivors, zeros elsewhere in the unit: the packed
        all-reduce's result, or TernGrad's ``(s/p) Σ_j sign(g_j) b_j`` (eq. 3)."""
        a, b = self.plan.units[u]
        g, packed = self.model.grads.flat, self._packed[u]
        if self._modes[u] == "ternary":
            total = unpack_2bit(self._gathered.pop(u), packed.size).sum(axis=0, dtype=np.int32)
            s = self._scale[u][self._segment_of[u]]
            packed[...] = total * s / self.topo.size
        g[a:b] = 0
        g[self._idx[u]] = packed

    def after_step(self, state) -> None:
        """Where the warm-up ends, prune (GraSP's scores were computed by the step's records
        after its update)."""
        if not self.pruned and state.step + 1 == self.options.warmup:
            self._prune(step=state.step + 1)

    def state_dict(self) -> dict:
        """Mask, pruning and mask-tracker state and step counters (the plan is rebuilt from the
        mask; GraSP's set-up of a constructor that pruned again is accounted before this
        process's first step, whatever the checkpoint)."""
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
