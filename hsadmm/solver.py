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

The solver issues no call itself: an iteration is the program generated from its plan's records
(:mod:`hsadmm.plan`), run by the one executor (:class:`substrate.executor.Executor`); the solver
binds only what it alone knows, the compute of each block, the array each call works on and the
mask codec (pack before the leaders' OR, unpack after the node's broadcast).

Flat ADMM ("PruneX (AR)", §5.1.4) differs only in topology: it replaces steps 2–4 by a dense SUM
all-reduce of ``theta + u`` over all ranks, ``z = Pi_S(rho1 Σ(theta + u) / (lambda + N rho1))``
(every rank computes the same ``z`` and so the same masks: no mask synchronization), with no
hierarchy and no shrinkage; masks are tracked, their drift reported and frozen exactly as in
H-SADMM (§4.5), after which ``z = z~ ⊙ m``.

Penalties are per layer (§3.4): the tensors of one layer (``conv1.weight`` and ``conv1.bias``;
a BatchNorm's scale and shift) share ``rho1``/``rho2`` and one residual each; ``--rho-scope
tensor`` keeps one per tensor.  ``lambda`` (``weight_decay``) enters eq. 9's ``gamma`` for every
tensor; the local step (eq. 8) has no weight decay unless ``--theta-weight-decay``.

Local SGD reads one endless mini-batch stream per rank (epoch after epoch, each shuffled by
``(seed, rank, epoch)``); an outer iteration continues where the previous one stopped.
:meth:`_Base.state_dict` / :meth:`_Base.load_state_dict` capture everything an outer iteration
reads (variables, penalties, masks, freezing state, the stream position ``(epoch, batch)``,
the SGD momentum and step count, BatchNorm buffers), so a run resumed at an iteration boundary
continues bit for bit.  ``phase_s`` accumulates the wall seconds of each phase (benchmarks).
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager

import numpy as np

from models import SGD, ProximalHook, SGDConfig, iterate_batches
from substrate.backend import array_module
from substrate.executor import Bindings, Executor, Pass

from .penalty import balance_penalty, eps_dual, eps_primal, increase_penalty, penalty_groups
from .plan import (
    EXPAND_DUALS,
    LOCAL_SGD,
    MASK_UPDATE,
    PENALTIES,
    SHRINK,
    Z_UPDATE,
    FlatADMMPlan,
    HSADMMPlan,
    bucket_label,
    iteration_programs,
)
from .projection import keep_count, structured_mask
from .shrink import MaskCodec, ShrinkPlan, pruned_names

__all__ = ["HSADMM", "SOLVERS", "ADMMState", "FlatADMM"]


class ADMMState:
    """Flat ADMM variables and per-group penalties (one group per layer) for one rank."""

    def __init__(self, model, rho1: float, rho2: float, groups: int) -> None:
        xp = array_module(model.params.flat)
        self.theta = model.params.flat
        self.u = xp.zeros_like(self.theta)
        self.z_i = self.theta.copy()
        self.v = xp.zeros_like(self.theta)
        self.z = self.theta.copy()
        self.rho1 = np.full(groups, float(rho1))
        self.rho2 = np.full(groups, float(rho2))


class _Base(Bindings):
    """Shared plumbing: local SGD (eq. 8), projection (eq. 10), residual reduction, penalties,
    global masks and their freezing (§4.5), and the iteration's program: generated from the
    plan's records (:func:`hsadmm.plan.iteration_programs`) and run by the executor
    (:class:`substrate.executor.Executor`) with the solver bound to it
    (:class:`substrate.executor.Bindings`: the arrays its calls work on, the compute of its
    blocks, the mask codec)."""

    phase_names: tuple[str, ...] = ()

    def __init__(self, run, cfg, model, train_shard, keep_overrides: dict | None = None):
        self.run, self.cfg, self.model = run, cfg, model
        self.seed = int(run.common.seed)
        self.topo = run.topo
        self.xp = array_module(model.params.flat)
        self.layout = model.layout
        self.train = train_shard
        self.group_names, self.group_of = penalty_groups(self.layout, cfg.rho_scope)
        self.state = ADMMState(model, cfg.rho1, cfg.rho2, len(self.group_names))
        self.names = list(self.layout.names)
        self.slices = [self.layout.slice(n) for n in self.names]
        conv = set(pruned_names(self.layout))
        self.pruned = [i for i, n in enumerate(self.names) if n in conv]
        overrides = keep_overrides or {}
        unknown = sorted(set(overrides) - {self.names[i] for i in self.pruned})
        if unknown:
            raise ValueError(f"keep overrides name unknown conv layers {unknown}; conv layers "
                             f"are {[self.names[i] for i in self.pruned]}")
        self.keep = {i: float(overrides.get(self.names[i], cfg.keep)) for i in self.pruned}
        for k in self.keep.values():
            keep_count(k, 1)  # validates (0, 1]
        self.kinds = cfg.sparsity_kinds
        self.prox = ProximalHook(self.layout, self.rho_per_tensor(self.state.rho1), xp=self.xp,
                                 dtype=model.dtype)
        # eq. 8 has no weight decay; --theta-weight-decay adds lambda on conv/fc weights
        self.opt = SGD(model.params, model.grads,
                       SGDConfig(lr=cfg.lr, momentum=cfg.momentum,
                                 weight_decay=cfg.weight_decay if cfg.theta_weight_decay else 0.0,
                                 decay_kinds=("conv", "fc")),
                       hooks=[self.prox])
        self.local_steps = cfg.local_steps_for(len(train_shard))
        self.epoch = 0  # mini-batch stream position: epoch and batches consumed in it
        self.batch_pos = 0
        self._stream = None
        self.phase_s: dict[str, float] = {}
        self._buf = self.xp.empty_like(self.state.theta)
        self._tmp = self.xp.empty_like(self.state.theta)
        self._segment = self.xp.asarray(self.group_of[self.layout.segment_ids()])
        self.converged = False
        shapes = [self.layout.shape(n) for n in self.names]
        self.codec = MaskCodec([shapes[i] for i in self.pruned])
        self.m_global = [self.xp.ones(shapes[i], dtype=bool) for i in self.pruned]  # m <- 1
        #: host copies of ``m_global`` when they came from the host (GPU runs compare there)
        self._m_host = [np.ones(shapes[i], dtype=bool) for i in self.pruned]
        self.frozen = False
        self.stable_iters = 0
        # the iteration's program and what its blocks and calls are bound to
        self.units = model.compute_units()
        self.executor = Executor(run)
        self._programs: dict = {}
        self._parts_run = 0
        self._parts: list[int] = []      # program parts run in all after each iteration
        self._k, self._loss, self._drift = -1, float("nan"), 0.0
        self._res = self._out = None
        self._compute = {LOCAL_SGD: Pass(self._local_epochs, ()), PENALTIES: self._penalties}

    @contextmanager
    def timed(self, phase: str):
        """Add the wall seconds of the enclosed block to ``phase_s[phase]``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - t

    # -- phase 1 ---------------------------------------------------------------------------------
    def _next_batch(self):
        """Next mini-batch of this rank's endless stream; advances ``(epoch, batch_pos)``."""
        while True:
            if self._stream is None:
                it = iterate_batches(self.train, self.cfg.batch_size, seed=self.seed,
                                     rank=self.topo.rank, epoch=self.epoch)
                # resumed mid-epoch: skip the batches already consumed (once per resume)
                self._stream = itertools.islice(it, self.batch_pos, None)
            batch = next(self._stream, None)
            if batch is not None:
                self.batch_pos += 1
                return batch
            self._stream = None
            self.epoch += 1
            self.batch_pos = 0

    def local_sgd(self) -> float:
        """``local_steps`` SGD steps on this rank's shard with the proximal term (eq. 8).

        The steps continue this rank's mini-batch stream (epoch ``e`` shuffled by
        ``(seed, rank, e)``) where the previous outer iteration left it.
        """
        s = self.state
        self.prox.set_rho(self.rho_per_tensor(s.rho1))
        self.prox.set_center(s.z_i, s.u)
        losses = []
        for _ in range(self.local_steps):
            x, y = self._next_batch()
            loss, _ = self.model.loss_and_grad(x, y)
            self.opt.step()
            losses.append(float(loss))
        return float(np.mean(losses))

    def _local_epochs(self, ready=None) -> None:
        """The ``local_sgd`` block: eq. 8's local steps (the model records their layers), then
        ``θ + u``, what the first all-reduce sums."""
        with self.timed("local_sgd"):
            self._loss = self.local_sgd()
        self.xp.add(self.state.theta, self.state.u, out=self._buf)

    # -- the iteration's program -----------------------------------------------------------------
    def iteration_records(self, plan, mask_synced: bool) -> list:
        """The records of an iteration with ``plan`` on this run's placement (calls and compute
        items: :meth:`HSADMMPlan.records`, :meth:`FlatADMMPlan.records`)."""
        raise NotImplementedError

    def _program(self, plan, mask_synced: bool) -> list[list]:
        """The parts of the iteration's program on this rank with ``plan``
        (:func:`hsadmm.plan.iteration_programs`; kept for the plans in use)."""
        key = (plan, bool(mask_synced))
        parts = self._programs.get(key)
        if parts is None:
            if len(self._programs) >= 8:
                self._programs.clear()
            parts = self._programs[key] = iteration_programs(
                self.iteration_records(plan, mask_synced), self.units, self.local_steps,
                self.topo.placement, self.topo.rank, overlap=self.run.recorder.overlap)
        return parts

    def _run(self, part: list) -> None:
        """Run one part of the iteration's program with this solver bound to it."""
        self.executor.run_step(part, self)
        self._parts_run += 1

    def iterations_verified(self) -> int:
        """Iterations whose every program part the executor has held equal to what the run
        recorded of it (:meth:`substrate.executor.Executor.verify`; only while the run records
        its program, ``--compute-profile-out``); raises ``ValueError`` at a difference."""
        self.executor.verify()
        done = self.executor.steps_verified
        return sum(1 for n in self._parts if n <= done)

    def compute(self, label: str):
        """The compute of the program's block ``label`` (the local epochs: a :class:`Pass`)."""
        fn = self._compute.get(label)
        if fn is None:
            raise ValueError(f"{type(self).__name__}: an iteration has no compute block "
                             f"{label!r}; blocks are {sorted(self._compute)}")
        return fn

    def _penalties(self) -> None:
        """The ``penalties`` block: residual norms, stopping rule and residual balancing from
        the reduced sums (§3.4), then the freezing rule (§4.5)."""
        with self.timed("duals_residuals"):
            self._out = self.penalties_and_stop(self._res, self.M, self.P)
            self._maybe_freeze(self._k)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Host copies of this rank's complete solver state (for :class:`Checkpointer`).

        Keys: ``theta``, ``u``, ``z_i``, ``v``, ``z`` (flat vectors), ``rho1``, ``rho2`` (per
        layer), ``epoch`` and ``batch_pos`` (mini-batch stream), ``sgd_step_count`` and
        ``sgd_momentum`` (when momentum is on), ``converged``, ``buffer/<name>`` for every
        model buffer (BatchNorm running statistics), the packed global masks, ``frozen`` and
        ``stable_iters``.
        """
        s, host = self.state, self.run.backend.asnumpy
        out = {k: np.array(host(getattr(s, k)), copy=True) for k in ("theta", "u", "z_i", "v", "z")}
        out.update(rho1=s.rho1.copy(), rho2=s.rho2.copy(), epoch=np.int64(self.epoch),
                   batch_pos=np.int64(self.batch_pos), converged=np.bool_(self.converged),
                   masks=self.codec.pack(self.m_global), frozen=np.bool_(self.frozen),
                   stable_iters=np.int64(self.stable_iters))
        opt = self.opt.state_dict()
        out["sgd_step_count"] = np.int64(opt["step_count"])
        if opt["momentum_buffer"] is not None:
            out["sgd_momentum"] = opt["momentum_buffer"]
        for name, buf in self.model.buffers.items():
            out[f"buffer/{name}"] = np.array(host(buf), copy=True)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output in place (views into the model stay valid).

        Raises
        ------
        ValueError
            If a key is missing or an array has the wrong shape (a checkpoint of another model
            or configuration).
        """
        s, xp = self.state, self.xp
        want = {k: getattr(s, k).shape for k in ("theta", "u", "z_i", "v", "z")}
        want.update(rho1=s.rho1.shape, rho2=s.rho2.shape)
        want.update({f"buffer/{n}": b.shape for n, b in self.model.buffers.items()})
        for key, shape in want.items():
            if key not in state:
                raise ValueError(f"checkpoint has no {key!r}; it was not written by this solver "
                                 "version/model: start a fresh run without --resume")
            if tuple(np.shape(state[key])) != tuple(shape):
                raise ValueError(f"checkpoint {key!r} has shape {tuple(np.shape(state[key]))}, "
                                 f"this model needs {tuple(shape)}: resume with the model and "
                                 "configuration of the run that wrote it")
        for k in ("theta", "u", "z_i", "v", "z"):
            getattr(s, k)[...] = xp.asarray(state[k])
        s.rho1 = np.array(state["rho1"], dtype=np.float64)
        s.rho2 = np.array(state["rho2"], dtype=np.float64)
        self.epoch, self.batch_pos = int(state["epoch"]), int(state["batch_pos"])
        self._stream = None
        self.converged = bool(state["converged"])
        self.opt.load_state_dict({"step_count": int(state["sgd_step_count"]),
                                  "momentum_buffer": state.get("sgd_momentum")})
        for name, buf in self.model.buffers.items():
            buf[...] = xp.asarray(state[f"buffer/{name}"])
        packed = np.asarray(state.get("masks", np.empty(0, np.uint8)), dtype=np.uint8)
        if packed.shape != (self.codec.nbytes,):
            raise ValueError(f"checkpoint masks hold {packed.size} bytes, this model needs "
                             f"{self.codec.nbytes}: resume with the model of the run that wrote it")
        self._m_host = self.codec.unpack(packed)
        self.m_global = [xp.asarray(m) for m in self._m_host]
        self.frozen = bool(state["frozen"])
        self.stable_iters = int(state["stable_iters"])

    def global_masks(self) -> dict:
        """``{conv weight name: global mask}`` (eq. 14), e.g. for :func:`hsadmm.export`."""
        return {self.names[i]: self.m_global[j] for j, i in enumerate(self.pruned)}

    def _update_masks(self, new) -> float:
        """Adopt the global masks ``new`` (host or device arrays); returns the mask drift, the
        fraction of mask bits that changed (0 when no layer is pruned).  On a GPU the count is
        read once (host masks are compared with the host copy of the current ones, device
        masks on the device), not once per layer."""
        xp = self.xp
        host_new = all(isinstance(m, np.ndarray) for m in new)
        dev_new = [xp.asarray(m) for m in new]
        if xp is np or not new:
            changed = sum(int((a != b).sum()) for a, b in zip(dev_new, self.m_global))
        elif host_new and self._m_host is not None:
            changed = sum(int((a != b).sum()) for a, b in zip(new, self._m_host))
        else:
            changed = int(xp.stack([(a != b).sum() for a, b in zip(dev_new, self.m_global)])
                          .sum())
        self._m_host = [np.asarray(m) for m in new] if host_new else None
        new = dev_new
        self.m_global = new
        self.stable_iters = 0 if changed else self.stable_iters + 1
        return changed / max(1, self.codec.nbits)

    def _apply_frozen_masks(self, flat) -> None:
        """``flat ⊙ m`` on the conv weights, in place (Algorithm 1 line 13)."""
        for j, i in enumerate(self.pruned):
            w = flat[self.slices[i]].reshape(self.m_global[j].shape)
            w *= self.m_global[j]

    def _maybe_freeze(self, k: int) -> None:
        """Freeze the masks after iteration ``T_freeze`` or after ``freeze_patience``
        iterations without a change (§4.5)."""
        cfg = self.cfg
        if self.frozen:
            return
        if (cfg.freeze_iter and k + 1 >= cfg.freeze_iter) or (
                cfg.freeze_patience and self.stable_iters >= cfg.freeze_patience):
            self.frozen = True

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

    def residual_rows(self, rows) -> np.ndarray:
        """``np.stack([factor * per_layer_sq(a, b) ...])`` for ``rows`` of ``(a, b, factor)``
        (``a`` None: a row of zeros), as a host ``(len(rows), groups)`` float64 array.  On a
        GPU the squared norms are summed per layer on the device and read in one copy, not
        with two syncs (``bincount``) and a read per row."""
        G = len(self.group_names)
        xp = self.xp
        if xp is np:
            return np.stack([np.zeros(G) if a is None else f * self.per_layer_sq(a, b)
                             for a, b, f in rows])
        import cupyx  # noqa: PLC0415  optional GPU backend

        sums = xp.zeros((len(rows), G), dtype=xp.float64)
        d = self._tmp
        for r, (a, b, f) in enumerate(rows):
            if a is None:
                continue
            if b is None:
                d[...] = a
            else:
                xp.subtract(a, b, out=d)
            d64 = d.astype(xp.float64)
            d64 *= d64
            cupyx.scatter_add(sums[r], self._segment, d64)
            if f != 1.0:
                sums[r] *= f
        return np.asarray(self.run.backend.asnumpy(sums), dtype=np.float64)

    def host_masks(self, masks) -> list:
        """Device masks as host arrays with one copy (the mask OR-sync packs them on the
        host)."""
        xp = self.xp
        if xp is np or not masks:
            return masks
        flat = self.run.backend.asnumpy(xp.concatenate([m.reshape(-1) for m in masks]))
        out, o = [], 0
        for m in masks:
            out.append(flat[o:o + m.size].reshape(m.shape))
            o += m.size
        return out

    def per_layer_sq(self, a, b=None) -> np.ndarray:
        """Per-group (layer) ``||a - b||_F^2`` (or ``||a||_F^2``) in float64, on the host."""
        d = self._tmp
        if b is None:
            d[...] = a
        else:
            self.xp.subtract(a, b, out=d)
        d64 = d.astype(self.xp.float64)
        d64 *= d64
        sums = self.xp.bincount(self._segment, weights=d64, minlength=len(self.group_names))
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
        n = np.bincount(self.group_of, weights=[self.layout.sizes[k] for k in self.names],
                        minlength=len(self.group_names))
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
        if cfg.adaptive_rho and cfg.rho_update == "increase":
            s.rho1, scale1 = increase_penalty(s.rho1, rho_max=cfg.rho_max)
            s.rho2, scale2 = increase_penalty(s.rho2, rho_max=cfg.rho_max)
        elif cfg.adaptive_rho:
            s.rho1, scale1 = balance_penalty(s.rho1, r_intra, s_intra, rho_max=cfg.rho_max)
            s.rho2, scale2 = balance_penalty(s.rho2, r_inter, s_inter, rho_max=cfg.rho_max)
        if cfg.adaptive_rho:
            if np.any(scale1 != 1):  # scaled duals follow their penalty (Boyd §3.4.1)
                s.u *= self.rho_flat(scale1)
            if np.any(scale2 != 1):
                s.v *= self.rho_flat(scale2)
        return out

    def rho_per_tensor(self, rho) -> list[float]:
        """Per-group penalties (or factors) as one value per tensor."""
        return [float(x) for x in np.asarray(rho)[self.group_of]]

    def rho_flat(self, rho):
        """Per-group penalties (or factors) broadcast over the flat parameter vector."""
        return self.xp.asarray(self.layout.expand(self.rho_per_tensor(rho),
                                                  dtype=self.state.theta.dtype))


class HSADMM(_Base):
    """Hierarchical structured ADMM (PruneX Algorithm 1); see the module docstring."""

    def __init__(self, run, cfg, model, train_shard, keep_overrides=None):
        super().__init__(run, cfg, model, train_shard, keep_overrides)
        xp = self.xp
        s = self.state
        self.M = self.topo.num_nodes
        self.P = self.topo.require_uniform(
            "H-SADMM", "eq. 9's gamma = lambda/M + P rho1 + rho2 counts P ranks on every node")
        self.plan = self._make_plan()
        self.plan_builds = 1
        self._z_old = xp.empty_like(s.theta)
        self._zi_old = xp.empty_like(s.theta)
        self._rho = None
        self._local_masks = self._packed = self._masks_in = None
        self._compute.update({Z_UPDATE: self._z_update, MASK_UPDATE: self._mask_update,
                              SHRINK: self._shrink, EXPAND_DUALS: self._expand_duals})

    def _make_plan(self) -> ShrinkPlan:
        """The shrink plan of the current global masks (:meth:`ShrinkPlan.for_layout`)."""
        return ShrinkPlan.for_layout(self.layout, self.global_masks(),
                                     bucket_mib=self.cfg.bucket_mib,
                                     dtype=self.state.theta.dtype, xp=self.xp)

    def state_dict(self) -> dict:
        """:meth:`_Base.state_dict` plus ``plan_builds``."""
        out = super().state_dict()
        out.update(plan_builds=np.int64(self.plan_builds))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; the shrink plan is rebuilt from the masks."""
        super().load_state_dict(state)
        self.plan = self._make_plan()
        self.plan_builds = int(state["plan_builds"])

    def _views(self, flat):
        return [flat[sl].reshape(self.layout.shape(n)) for sl, n in zip(self.slices, self.names)]

    def iterate(self, k: int) -> dict:
        """One outer iteration; returns the metrics of this iteration (identical on all ranks).

        The iteration is its plan's program (:meth:`HSADMMPlan.records`, laid out by
        :func:`hsadmm.plan.iteration_programs`), run by the executor with this solver bound to
        its blocks and calls.  PruneX runs Algorithm 1's phases in sequence (§4.2), each call
        after the compute that writes its buffer, each compute that reads a result after its
        call: ``local_sgd`` (eq. 8, then ``theta + u``) -> ``intra_allreduce`` (SUM) ->
        ``z_update`` (eq. 9, the projection of eq. 10 or the frozen mask, ``c = z_i + v``) ->
        ``mask_sync`` (leaders' OR of the packed masks) -> ``mask_bcast`` -> ``mask_update``
        (the global masks, the shrink plan rebuilt when they changed) -> ``shrink`` (eq. 15,
        leaders) -> ``inter_allreduce`` per compact bucket, each after the previous one (the
        leaders' blocking loop) -> ``bcast_z`` (one broadcast of the whole compact buffer) ->
        ``expand_duals`` (zero-fill recovery, eqs. 12-13, residual sums) -> ``residuals`` ->
        ``penalties``.  The mask update can change the compact buckets, so the program runs in
        two parts: up to the mask update, then the rest generated from the plan it left.  A
        follower waits for the leaders' calls in its program (its ``bcast`` cannot start
        earlier) without executing or booking them.  The code reduces whole vectors, phase
        after phase, so the data flow allows no pipelining of intra- and inter-node phases
        across layers or buckets: the step's critical path is its no-overlap sum.

        Wall seconds of the compute accumulate in ``phase_s``: ``local_sgd`` (eq. 8),
        ``z_update`` (eq. 9), ``projection`` (eq. 10 or the frozen mask), ``mask_sync`` (the
        mask update and plan rebuild, eq. 14), ``shrink`` (eq. 15), ``expand`` (zero-fill
        recovery, §4.4.3) and ``duals_residuals`` (eqs. 12-13, residuals, penalties).
        """
        s = self.state
        self._k, self._drift = k, 0.0
        self._rho = (self.rho_flat(s.rho1), self.rho_flat(s.rho2))
        synced = not self.frozen
        self._run(self._program(self.iteration_plan(), synced)[0])
        self._run(self._program(self.iteration_plan(), synced)[-1])   # the plan it left
        self._parts.append(self._parts_run)
        plan, out = self.plan, self._out
        out.update(loss=self._loss, mask_drift=self._drift, mask_synced=synced,
                   frozen=self.frozen, compact_elems=plan.compact_size,
                   dense_elems=plan.dense_size, compact_buckets=[b - a for a, b in plan.buckets])
        return out

    # -- the blocks' compute ---------------------------------------------------------------------
    def _z_update(self) -> None:
        """The ``z_update`` block: ``z~_i`` of eq. 9 (``gamma = lambda/M + P rho1 + rho2``) from
        the node's SUM of ``theta + u``, ``z_i = Pi_S(z~_i)`` (eq. 10; after the freeze
        ``z~_i ⊙ m``, Algorithm 1 line 13) and ``c = z_i + v`` (the masks do not change it)."""
        s, xp, buf = self.state, self.xp, self._buf
        rho1, rho2 = self._rho
        with self.timed("z_update"):
            gamma = self.cfg.weight_decay / self.M + self.P * rho1 + rho2
            z_tilde = (rho1 * buf + rho2 * (s.z - s.v)) / gamma
            self._zi_old[...] = s.z_i
            self._z_old[...] = s.z
        with self.timed("projection"):
            if self.frozen:  # Algorithm 1 line 13
                s.z_i[...] = z_tilde
                self._apply_frozen_masks(s.z_i)
                self._local_masks = None
            else:
                self._local_masks = self.project_into(z_tilde, s.z_i)
        self._packed = None
        xp.add(s.z_i, s.v, out=buf)

    def _mask_update(self) -> None:
        """The ``mask_update`` block: adopt the global masks (eq. 14) and their drift; the
        shrink plan is rebuilt when they changed."""
        with self.timed("mask_sync"):
            self._drift = self._update_masks(self._masks_in)
            if self._drift:
                self.plan = self._make_plan()
                self.plan_builds += 1

    def _shrink(self) -> None:
        """The ``shrink`` block: the leaders compact ``c`` to the ``[K_out, K_in]`` slices of
        the shrink plan's buffer (eq. 15)."""
        with self.timed("shrink"):
            if self.topo.is_leader:
                self.plan.shrink(self._views(self._buf))

    def _expand_duals(self) -> None:
        """The ``expand_duals`` block: ``z`` recovered from the compact average with zeros
        (§4.4.3), the duals ``v`` (eq. 13) and ``u`` (eq. 12), and the residual sums (node-level
        rows from one rank per node)."""
        s, plan = self.state, self.plan
        with self.timed("expand"):
            plan.expand(plan.buffer, self._views(s.z))
        with self.timed("duals_residuals"):
            s.v += s.z_i
            s.v -= s.z  # eq. 13
            s.u += s.theta
            s.u -= s.z_i  # eq. 12
            lead = 1.0 if self.topo.is_leader else 0.0  # node-level rows: one rank per node
            self._res = self.residual_rows([
                (s.theta, s.z_i, 1.0), (s.z_i, self._zi_old, 1.0), (s.z_i, s.z, lead),
                (s.z, self._z_old, lead), (s.theta, None, 1.0), (s.u, None, 1.0),
                (s.z_i, None, 1.0), (s.v, None, lead), (s.z, None, lead)])

    # -- the calls' buffers and the mask codec ---------------------------------------------------
    def buffer(self, call):
        """The array ``call`` works on: ``theta + u`` (intra-node SUM), the packed local masks
        (the leaders' OR: the codec's encode, eq. 14) and the global ones (their broadcast),
        a bucket of the compact buffer (inter-node average, eq. 15) and the whole of it (the
        broadcast of ``z``), the residual sums."""
        phase = call.phase
        if phase == "intra_allreduce":
            return self._buf
        if phase == "mask_sync":
            self._packed = self.codec.pack(self.host_masks(self._local_masks))
            return self._packed
        if phase == "mask_bcast":
            if self._packed is None:               # a follower receives the global masks
                self._packed = np.empty(self.codec.nbytes, dtype=np.uint8)
            return self._packed
        if phase == "inter_allreduce":
            labels = [bucket_label(j) for j in range(len(self.plan.buckets))]
            a, b = self.plan.buckets[labels.index(call.label)]
            return self.plan.buffer[a:b]
        if phase == "bcast_z":
            return self.plan.buffer
        if phase == "residuals":
            return self._res
        return super().buffer(call)

    def received(self, call, result) -> None:
        """The global masks broadcast in the node, unpacked (the codec's decode)."""
        if call.phase == "mask_bcast":
            self._masks_in = self.codec.unpack(result)

    def sync_masks(self, local_masks) -> float:
        """The mask synchronization alone, as the iteration runs it (eq. 14: the leaders' OR of
        the packed ``local_masks``, the broadcast in every node, the mask update;
        :meth:`HSADMMPlan.mask_records`), outside an iteration (a benchmark).  Returns the mask
        drift."""
        self._local_masks, self._packed = local_masks, None
        placement = self.topo.placement
        self.executor.run_records(self.iteration_plan().mask_records(placement), self,
                                  placement)
        return self._drift

    # -- the plan --------------------------------------------------------------------------------
    def iteration_plan(self) -> HSADMMPlan:
        """The communication plan of an iteration with the current shrink plan (the one the
        last :meth:`iterate` used after its mask synchronization)."""
        return HSADMMPlan.from_shrink(self.plan, len(self.group_names))

    def iteration_records(self, plan: HSADMMPlan, mask_synced: bool) -> list:
        return plan.records(self.topo.placement, mask_synced=mask_synced)

    def iteration_calls(self, mask_synced: bool) -> list:
        """The calls of the iteration just run (:meth:`HSADMMPlan.calls` on this run's
        placement): what :meth:`iterate` executed, call for call."""
        return self.iteration_plan().calls(self.topo.placement, mask_synced=mask_synced)


class FlatADMM(_Base):
    """Flat consensus ADMM ("PruneX (AR)"): every rank against the global ``z`` over the world
    communicator, dense, no hierarchy and no shrinkage.  ``z_i`` mirrors ``z`` (the proximal
    anchor of eq. 8 is the global variable).  Masks, their drift and freezing are H-SADMM's
    (§4.5): every rank projects the same ``z~``, so the masks agree without synchronization.
    The stopping rule sees one node of all ``N`` ranks (``M = 1``, ``P = N``)."""

    def __init__(self, run, cfg, model, train_shard, keep_overrides=None):
        super().__init__(run, cfg, model, train_shard, keep_overrides)
        self._z_old = self.xp.empty_like(self.state.theta)
        self.M, self.P = 1, self.topo.world.size
        self._rho = None
        self._compute[Z_UPDATE] = self._z_update

    def iterate(self, k: int) -> dict:
        """One iteration: the program of :meth:`FlatADMMPlan.records` (one part), run by the
        executor.  In order: ``local_sgd`` -> ``world_allreduce`` -> ``z_update`` (z,
        projection, duals and residual sums) -> ``residuals`` -> ``penalties``, each after the
        previous (the data flow is a chain: nothing overlaps)."""
        self._k, self._drift = k, 0.0
        self._rho = self.rho_flat(self.state.rho1)
        for part in self._program(self.iteration_plan(), False):
            self._run(part)
        self._parts.append(self._parts_run)
        out = self._out
        out.update(loss=self._loss, mask_drift=self._drift, mask_synced=False,
                   frozen=self.frozen, compact_elems=self.layout.total,
                   dense_elems=self.layout.total, compact_buckets=[])
        return out

    def _z_update(self) -> None:
        """The ``z_update`` block: ``z = Pi_S(rho1 Σ(theta + u) / (lambda + N rho1))`` (after
        the freeze ``z~ ⊙ m``) and its masks' drift, ``z_i = z``, the dual ``u`` (eq. 12) and
        the residual sums."""
        s, cfg, rho1 = self.state, self.cfg, self._rho
        with self.timed("z_update"):
            z_tilde = rho1 * self._buf / (cfg.weight_decay + self.topo.world.size * rho1)
            self._z_old[...] = s.z
        with self.timed("projection"):
            if self.frozen:
                s.z[...] = z_tilde
                self._apply_frozen_masks(s.z)
            else:
                self._drift = self._update_masks(self.project_into(z_tilde, s.z))
        with self.timed("duals_residuals"):
            s.z_i[...] = s.z
            s.u += s.theta
            s.u -= s.z
            self._res = self.residual_rows([
                (s.theta, s.z, 1.0), (s.z, self._z_old, 1.0), (None, None, 1.0),
                (None, None, 1.0), (s.theta, None, 1.0), (s.u, None, 1.0),
                (s.z, None, 1.0), (None, None, 1.0), (None, None, 1.0)])

    def buffer(self, call):
        """The array ``call`` works on: ``theta + u`` (the world SUM), the residual sums."""
        if call.phase == "world_allreduce":
            return self._buf
        if call.phase == "residuals":
            return self._res
        return super().buffer(call)

    def iteration_plan(self) -> FlatADMMPlan:
        return FlatADMMPlan(self.layout.total, len(self.group_names),
                            self.state.theta.dtype.itemsize)

    def iteration_records(self, plan: FlatADMMPlan, mask_synced: bool = False) -> list:
        return plan.records(self.topo.placement)

    def iteration_calls(self, mask_synced: bool = False) -> list:
        """The calls of one iteration (:meth:`FlatADMMPlan.calls` on this run's placement);
        masks never travel (``mask_synced`` is ignored)."""
        return self.iteration_plan().calls(self.topo.placement)


SOLVERS = {"hsadmm": HSADMM, "flat-admm": FlatADMM}
