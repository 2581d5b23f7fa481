"""The PacTrain strategy (paper 002, Algorithm 1): :class:`PacTrain` executes a
:class:`~.plan.PacTrainPlan`.

Warm-up or ``--init``, prune once, enforce gradient sparsity every step (eq. 2, a
:class:`models.MaskHook` on the optimizer), track each bucket's mask and all-reduce the packed
survivors of stable buckets (optionally ternarized, eq. 3), during the backward with
``--overlap on``.  The full description is :mod:`dataparallel.pactrain`'s docstring.
"""

from __future__ import annotations

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
