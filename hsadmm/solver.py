"""H-SADMM (PruneX Algorithm 1) and flat consensus ADMM on the substrate's communicators.

State ownership (§4.1.2), all as flat vectors in the model's parameter layout:

* device-local: ``theta`` (the model's own flat parameters) and the scaled dual ``u`` (eq. 12);
* node consensus: ``z_i`` and the scaled dual ``v`` (eq. 13), replicated on the node's ranks —
  every rank of a node computes them from the same all-reduced data, so they agree bit for bit;
* global consensus: ``z`` (eq. 11), produced by the leaders and broadcast to their followers.

One outer iteration (:meth:`HSADMM.iterate`):

1. local SGD with the proximal term ``rho1 ⊙ (theta - z_i + u)`` (eq. 8);
2. intra-node SUM all-reduce of ``theta + u`` and the dense candidate ``z~_i`` (eq. 9,
   ``gamma = lambda/M + P rho1 + rho2``);
3. projection ``z_i = Pi_S(z~_i)`` of the conv weights (eq. 10) and their masks; after freezing,
   ``z_i = z~_i ⊙ m`` with the frozen global mask;
4. leaders: bitwise-OR all-reduce of the packed masks (eq. 14; then broadcast in the node),
   compaction of ``z_i + v`` to the ``[K_out, K_in]`` slices (eq. 15), bucketed inter-node average,
   broadcast of the compact ``z`` to the followers, zero-fill expansion on every rank, and the
   ``v`` update (eq. 13);
5. ``u`` update (eq. 12), per-layer residuals at both levels, the stopping rule and residual
   balancing of ``rho1``/``rho2`` per layer (§3.4); mask freezing (§4.5).

Flat ADMM ("PruneX (AR)") replaces steps 2–4 by a dense SUM all-reduce of ``theta + u`` over all
ranks, ``z = Pi_S(rho1 Σ(theta + u) / (lambda + N rho1))``, with no hierarchy and no shrinkage.
"""

from __future__ import annotations

import numpy as np

from models import SGD, ProximalHook, SGDConfig, iterate_batches
from substrate.backend import array_module

from .penalty import balance_penalty, eps_dual, eps_primal
from .projection import keep_count, structured_mask
from .shrink import MaskCodec, ShrinkPlan

__all__ = ["ADMMState", "HSADMM", "FlatADMM", "SOLVERS"]


class ADMMState:
    """Flat ADMM variables and per-layer penalties for one rank."""

    def __init__(self, model, rho1: float, rho2: float) -> None:
        xp = array_module(model.params.flat)
        self.theta = model.params.flat
        self.u = xp.zeros_like(self.theta)
        self.z_i = self.theta.copy()
        self.v = xp.zeros_like(self.theta)
        self.z = self.theta.copy()
        L = len(model.layout)
        self.rho1 = np.full(L, float(rho1))
        self.rho2 = np.full(L, float(rho2))


class _Base:
    """Shared plumbing: local SGD (eq. 8), projection (eq. 10), residual reduction, penalties."""

    phase_names: tuple[str, ...] = ()

    def __init__(self, run, cfg, model, train_shard, keep_overrides: dict | None = None):
        self.run, self.cfg, self.model = run, cfg, model
        self.topo = run.topo
        self.xp = array_module(model.params.flat)
        self.layout = model.layout
        self.train = train_shard
        self.state = ADMMState(model, cfg.rho1, cfg.rho2)
        self.names = list(self.layout.names)
        self.slices = [self.layout.slice(n) for n in self.names]
        self.pruned = [i for i, n in enumerate(self.names) if self.layout.kind(n) == "conv"]
        overrides = keep_overrides or {}
        unknown = sorted(set(overrides) - {self.names[i] for i in self.pruned})
        if unknown:
            raise ValueError(f"keep overrides name unknown conv layers {unknown}; conv layers "
                             f"are {[self.names[i] for i in self.pruned]}")
        self.keep = {i: float(overrides.get(self.names[i], cfg.keep)) for i in self.pruned}
        for i, k in self.keep.items():
            keep_count(k, 1)  # validates (0, 1]
        self.kinds = cfg.sparsity_kinds
        self.prox = ProximalHook(self.layout, self.state.rho1, xp=self.xp, dtype=model.dtype)
        self.opt = SGD(model.params, model.grads,
                       SGDConfig(lr=cfg.lr, momentum=cfg.momentum,
                                 weight_decay=cfg.weight_decay, decay_kinds=("conv", "fc")),
                       hooks=[self.prox])
        self.local_steps = cfg.local_steps_for(len(train_shard))
        self.epoch = 0
        self._buf = self.xp.empty_like(self.state.theta)
        self._tmp = self.xp.empty_like(self.state.theta)
        self._segment = self.xp.asarray(self.layout.segment_ids())
        self.converged = False

    # -- phase 1 ---------------------------------------------------------------------------------
    def local_sgd(self) -> float:
        """``local_steps`` SGD steps on this rank's shard with the proximal term (eq. 8)."""
        s = self.state
        self.prox.set_rho(s.rho1)
        self.prox.set_center(s.z_i, s.u)
        losses, done = [], 0
        while done < self.local_steps:
            for x, y in iterate_batches(self.train, self.cfg.batch_size, seed=self.cfg.seed,
                                        rank=self.topo.rank, epoch=self.epoch):
                loss, _ = self.model.loss_and_grad(x, y)
                self.opt.step()
                losses.append(float(loss))
                done += 1
                if done == self.local_steps:
                    break
            else:
                self.epoch += 1
        return float(np.mean(losses))

    # -- phase 3 ---------------------------------------------------------------------------------
    def project_into(self, z_tilde, out) -> list:
        """``out = Pi_S(z_tilde)`` on conv weights, copy elsewhere; returns the local masks."""
        out[...] = z_tilde
        masks = []
        for i in self.pruned:
            sl = self.slices[i]
            shape = self.layout.shape(self.names[i])
            w = z_tilde[sl].reshape(shape)
            m = structured_mask(w, self.kinds, self.keep[i])
            out[sl].reshape(shape)[...] = self.xp.where(m, w, 0)
            masks.append(m)
        return masks

    def per_layer_sq(self, a, b=None) -> np.ndarray:
        """Per-layer ``||a - b||_F^2`` (or ``||a||_F^2``) in float64, on the host."""
        d = self._tmp
        if b is None:
            d[...] = a
        else:
            self.xp.subtract(a, b, out=d)
        d64 = d.astype(self.xp.float64)
        d64 *= d64
        sums = self.xp.bincount(self._segment, weights=d64, minlength=len(self.names))
        return np.asarray(self.run.backend.asnumpy(sums), dtype=np.float64)

    # -- phase 5 ---------------------------------------------------------------------------------
    def penalties_and_stop(self, res: np.ndarray, M: int, P: int) -> dict:
        """Residual norms, Boyd's stopping rule and residual balancing from the reduced sums.

        ``res`` rows (summed over ranks): 0 ``||theta - z_i||^2``, 1 ``||z_i - z_i_old||^2``,
        2 ``||z_i - z||^2``, 3 ``||z - z_old||^2``, 4 ``||theta||^2``, 5 ``||u||^2``,
        6 ``||z_i||^2`` (all ranks: stacked over the intra constraints), 7 ``||v||^2``,
        8 ``||z||^2`` (rows 2, 3, 7, 8 from one rank per node: stacked over the inter constraints).
        """
        s, cfg = self.state, self.cfg
        n = np.array([self.layout.sizes[k] for k in self.names], dtype=np.float64)
        N = M * P
        norm = np.sqrt(np.maximum(res, 0.0))
        r_intra, s_intra = norm[0], s.rho1 * norm[1]
        r_inter, s_inter = norm[2], s.rho2 * norm[3]
        eps_p1 = eps_primal(N * n, norm[4], norm[6], cfg.eps_abs, cfg.eps_rel)
        eps_d1 = eps_dual(N * n, s.rho1 * norm[5], cfg.eps_abs, cfg.eps_rel)
        eps_p2 = eps_primal(M * n, np.sqrt(np.maximum(res[6], 0) / P), norm[8], cfg.eps_abs,
                            cfg.eps_rel)
        eps_d2 = eps_dual(M * n, s.rho2 * norm[7], cfg.eps_abs, cfg.eps_rel)
        self.converged = bool(np.all(r_intra <= eps_p1) and np.all(s_intra <= eps_d1)
                              and np.all(r_inter <= eps_p2) and np.all(s_inter <= eps_d2))
        out = {"r_intra": r_intra.tolist(), "s_intra": s_intra.tolist(),
               "r_inter": r_inter.tolist(), "s_inter": s_inter.tolist(),
               "rho1": s.rho1.tolist(), "rho2": s.rho2.tolist(), "converged": self.converged}
        if cfg.adaptive_rho:
            s.rho1, scale1 = balance_penalty(s.rho1, r_intra, s_intra, rho_max=cfg.rho_max)
            s.rho2, scale2 = balance_penalty(s.rho2, r_inter, s_inter, rho_max=cfg.rho_max)
            if np.any(scale1 != 1):  # scaled duals follow their penalty (Boyd §3.4.1)
                s.u *= self.rho_flat(scale1)
            if np.any(scale2 != 1):
                s.v *= self.rho_flat(scale2)
        return out

    def rho_flat(self, rho):
        return self.xp.asarray(self.layout.expand(list(rho), dtype=self.state.theta.dtype))


class HSADMM(_Base):
    """Hierarchical structured ADMM (PruneX Algorithm 1); see the module docstring."""

    def __init__(self, run, cfg, model, train_shard, keep_overrides=None):
        super().__init__(run, cfg, model, train_shard, keep_overrides)
        xp = self.xp
        s = self.state
        self.M, self.P = self.topo.num_nodes, self.topo.ranks_per_node
        shapes = [self.layout.shape(n) for n in self.names]
        self.codec = MaskCodec([shapes[i] for i in self.pruned])
        self.m_global = [xp.ones(shapes[i], dtype=bool) for i in self.pruned]  # line 3: m <- 1
        self.frozen = False
        self.stable_iters = 0
        self.plan = self._make_plan()
        self.plan_builds = 1
        self._z_old = xp.empty_like(s.theta)
        self._zi_old = xp.empty_like(s.theta)

    def _make_plan(self) -> ShrinkPlan:
        masks: list = [None] * len(self.names)
        for j, i in enumerate(self.pruned):
            masks[i] = self.m_global[j]
        shapes = [self.layout.shape(n) for n in self.names]
        return ShrinkPlan(shapes, masks, dtype=self.state.theta.dtype, xp=self.xp,
                          bucket_bytes=int(self.cfg.bucket_mib * (1 << 20)))

    def _views(self, flat):
        return [flat[sl].reshape(self.layout.shape(n)) for sl, n in zip(self.slices, self.names)]

    def iterate(self, k: int) -> dict:
        """One outer iteration; returns the metrics of this iteration (identical on all ranks)."""
        run, s, xp, topo = self.run, self.state, self.xp, self.topo
        clock = run.clock
        cfg = self.cfg
        rho1, rho2 = self.rho_flat(s.rho1), self.rho_flat(s.rho2)
        # Phase 1: local computation
        with clock.compute():
            loss = self.local_sgd()
            buf = self._buf
            xp.add(s.theta, s.u, out=buf)
        # Phase 2: intra-node consensus (eq. 9)
        topo.intra.allreduce(buf, "sum", phase="intra_allreduce")
        with clock.compute():
            gamma = cfg.weight_decay / self.M + self.P * rho1 + rho2
            z_tilde = (rho1 * buf + rho2 * (s.z - s.v)) / gamma
            self._zi_old[...] = s.z_i
            self._z_old[...] = s.z
            # Phase 3: projection or frozen mask
            if self.frozen:
                s.z_i[...] = z_tilde
                for j, i in enumerate(self.pruned):
                    w = s.z_i[self.slices[i]].reshape(self.m_global[j].shape)
                    w *= self.m_global[j]
                local_masks = None
            else:
                local_masks = self.project_into(z_tilde, s.z_i)
        # Phase 4: mask OR-sync (leaders), broadcast of the global mask to followers
        drift = 0.0
        mask_synced = not self.frozen
        if mask_synced:
            packed = (self.codec.pack(local_masks) if topo.is_leader
                      else np.empty(self.codec.nbytes, dtype=np.uint8))
            if topo.is_leader:
                topo.inter.allreduce(packed, "bor", phase="mask_sync")
            topo.intra.bcast(packed, 0, phase="mask_bcast")
            with clock.compute():
                new = [xp.asarray(m) for m in self.codec.unpack(packed)]
                changed = sum(int((a != b).sum()) for a, b in zip(new, self.m_global))
                drift = changed / max(1, self.codec.nbits)
                self.m_global = new
                if changed:
                    self.plan = self._make_plan()
                    self.plan_builds += 1
                self.stable_iters = 0 if changed else self.stable_iters + 1
        plan = self.plan
        with clock.compute():
            xp.add(s.z_i, s.v, out=buf)  # c = z_i + v
            if topo.is_leader:
                plan.shrink(self._views(buf))
        if topo.is_leader:
            for a, b in plan.buckets:
                topo.inter.allreduce(plan.buffer[a:b], "avg", phase="inter_allreduce")
        topo.intra.bcast(plan.buffer, 0, phase="bcast_z")
        with clock.compute():
            plan.expand(plan.buffer, self._views(s.z))
            s.v += s.z_i
            s.v -= s.z  # eq. 13
            # Phase 5: dual update (eq. 12)
            s.u += s.theta
            s.u -= s.z_i
            lead = 1.0 if topo.is_leader else 0.0  # node-level rows: one rank per node
            sq = self.per_layer_sq
            res = np.stack([sq(s.theta, s.z_i), sq(s.z_i, self._zi_old),
                            lead * sq(s.z_i, s.z), lead * sq(s.z, self._z_old),
                            sq(s.theta), sq(s.u), sq(s.z_i), lead * sq(s.v), lead * sq(s.z)])
        topo.world.allreduce(res, "sum", phase="residuals")
        with clock.compute():
            out = self.penalties_and_stop(res, self.M, self.P)
            self._maybe_freeze(k)
        out.update(loss=loss, mask_drift=drift, mask_synced=mask_synced, frozen=self.frozen,
                   compact_elems=plan.compact_size, dense_elems=plan.dense_size,
                   compact_buckets=[b - a for a, b in plan.buckets])
        return out

    def _maybe_freeze(self, k: int) -> None:
        cfg = self.cfg
        if self.frozen:
            return
        if (cfg.freeze_iter and k + 1 >= cfg.freeze_iter) or (
                cfg.freeze_patience and self.stable_iters >= cfg.freeze_patience):
            self.frozen = True

    def predicted_phase_bytes(self, mask_synced: bool) -> dict:
        """Closed-form bytes of the iteration just run (from the plan, see commvol.hsadmm)."""
        from commvol.hsadmm import hsadmm_iteration_bytes  # noqa: PLC0415

        return hsadmm_iteration_bytes(
            M=self.M, P=self.P, total_params=self.layout.total,
            compact_sizes=[b - a for a, b in self.plan.buckets],
            mask_bytes=self.codec.nbytes if self.pruned else 0, mask_synced=mask_synced,
            num_layers=len(self.names), itemsize=self.state.theta.dtype.itemsize)


class FlatADMM(_Base):
    """Flat consensus ADMM ("PruneX (AR)"): every rank against the global ``z`` over the world
    communicator, dense, no hierarchy and no shrinkage.  ``z_i`` mirrors ``z`` (the proximal
    anchor of eq. 8 is the global variable)."""

    def __init__(self, run, cfg, model, train_shard, keep_overrides=None):
        super().__init__(run, cfg, model, train_shard, keep_overrides)
        self._z_old = self.xp.empty_like(self.state.theta)
        self.frozen = False

    def iterate(self, k: int) -> dict:
        run, s, xp, w = self.run, self.state, self.xp, self.topo.world
        clock, cfg = run.clock, self.cfg
        rho1 = self.rho_flat(s.rho1)
        with clock.compute():
            loss = self.local_sgd()
            buf = self._buf
            xp.add(s.theta, s.u, out=buf)
        w.allreduce(buf, "sum", phase="world_allreduce")
        with clock.compute():
            z_tilde = rho1 * buf / (cfg.weight_decay + w.size * rho1)
            self._z_old[...] = s.z
            self.project_into(z_tilde, s.z)
            s.z_i[...] = s.z
            s.u += s.theta
            s.u -= s.z
            sq, zero = self.per_layer_sq, np.zeros(len(self.names))
            res = np.stack([sq(s.theta, s.z), sq(s.z, self._z_old), zero, zero, sq(s.theta),
                            sq(s.u), sq(s.z), zero, zero])
        w.allreduce(res, "sum", phase="residuals")
        with clock.compute():
            out = self.penalties_and_stop(res, 1, w.size)
        out.update(loss=loss, mask_drift=0.0, mask_synced=False, frozen=False,
                   compact_elems=self.layout.total, dense_elems=self.layout.total,
                   compact_buckets=[])
        return out

    def predicted_phase_bytes(self, mask_synced: bool) -> dict:
        from commvol.hsadmm import flat_admm_iteration_bytes  # noqa: PLC0415

        return flat_admm_iteration_bytes(M=self.topo.num_nodes, P=self.topo.ranks_per_node,
                                         total_params=self.layout.total,
                                         num_layers=len(self.names),
                                         itemsize=self.state.theta.dtype.itemsize)


SOLVERS = {"hsadmm": HSADMM, "flat-admm": FlatADMM}
