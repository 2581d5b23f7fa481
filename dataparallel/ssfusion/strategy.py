"""The SSFusion strategy: runs :class:`~dataparallel.ssfusion.SSFusionPlan`'s records step by
step from the step's program (:meth:`SSFusion.records`: the warm-up all-reduces, the decision,
then per fusion buffer the all-reduce of ``Buffer_AR`` and the all-gather of ``Buffer_AG``, the
sparsification, SSFusion-O's worker and the decoding as compute items) and binds what only it
knows: the arrays each call sends and what it does with the results (:meth:`SSFusion.buffer`,
:meth:`SSFusion.received`), the compute of each item (:meth:`SSFusion.compute`).  The program
places each record at the first unit boundary of the backward where what it waits for is there
(:func:`dataparallel.program.step_program`), so with ``--overlap on`` a run is the paper's
pipeline (Fig. 10); the strategy issues no call itself.

The warm-up profiling (measurement, not program: :meth:`SSFusion.on_ready`), the decision and
SSFusion-O's CPU worker are in :mod:`dataparallel.ssfusion.profiling`."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from simulation.compute import CpuTimeSource
from substrate.calls import Work, bytes_by_phase
from substrate.costmodel import INTER, INTRA

from ..codec import ErrorFeedback, scatter_mean
from ..ddp import DDPOptions, DDPPlan
from ..sparsify import select
from ..strategy import Strategy, register
from .options import SSFusionOptions, needs_profile
from .plan import (
    DENSE,
    PROFILE,
    PROFILE_FIELDS,
    SELECT,
    SPARSE,
    WARMUP,
    FusionBuffer,
    Segment,
    SSFusionPlan,
    plan_ssfusion,
)
from .profiling import OffloadWorker, WarmupProfiler
from .selection import per_tensor_counts

__all__ = ["SSFusion"]


@dataclass
class _Buffer:
    """A fusion buffer of the plan (:class:`~dataparallel.ssfusion.FusionBuffer`) with its
    send buffers: ``ar_buf`` (float32, ``Buffer_AR``) and ``send`` (int32, the
    :class:`~dataparallel.codec.SparseRow` of ``Buffer_AG``)."""

    spec: FusionBuffer
    ar_buf: object
    send: object

    def __getattr__(self, name):          # a, b, c, ar, agd, segments, n_ar, n_agd, K, row
        return getattr(self.spec, name)


def _index(label: str) -> int:
    """``i`` of a record labelled ``name[i]``."""
    return int(label[label.index("[") + 1:-1])


@register
class SSFusion(WarmupProfiler, OffloadWorker, Strategy):
    """Fusion buffers with selective (or per-tensor / multi-tensor) sparsification."""

    name = "ssfusion"
    Options = SSFusionOptions

    def __init__(self, ctx, options: SSFusionOptions) -> None:
        super().__init__(ctx, options)
        xp, layout = self.xp, self.layout
        g = ctx.model.grads.flat
        if g.dtype != np.float32:
            raise ValueError(f"ssfusion packs float32 values with int32 indices; the model is "
                             f"{g.dtype} (build it with dtype float32)")
        if layout.total >= 2 ** 31:
            raise ValueError(f"{layout.total} parameters do not fit int32 indices")
        self.names = layout.names
        self.L = len(self.names)
        self.sizes = [int(layout.sizes[n]) for n in self.names]
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        self._offsets_x = xp.asarray(self.offsets)
        self.index_of = {n: i for i, n in enumerate(self.names)}
        placement = self.topo.placement
        link = INTER if placement.num_nodes > 1 else INTRA   # a world ring's slowest link
        self._plan_args = (self.sizes, placement.size, link, options, self.run.cost)
        # the plan at once when it needs no timings; else a placeholder on a zero profile that
        # fixes the warm-up buffers and is replaced by the decided plan at the end of warm-up
        zero = np.zeros(self.L)
        self._template = plan_ssfusion(*self._plan_args, itemsize=g.dtype.itemsize,
                                       profile=(zero, zero, zero) if needs_profile(options)
                                       else None)
        self.buffers = self._template.buffers
        self.residual = xp.zeros_like(g)
        self._ef = ErrorFeedback(self.residual, options.error_feedback)
        self.warmup = int(options.profile_steps)
        self.plan: SSFusionPlan | None = None
        # DGC momentum correction: the optimizer's momentum moves here, before sparsification
        self.mu = 0.0
        opt_cfg = getattr(ctx.opt, "config", None)
        if options.momentum_correction and hasattr(ctx.opt, "exp_avg_sq"):
            raise ValueError("--momentum-correction moves SGD's momentum before sparsification "
                             "(DGC); AdamW keeps two moments it cannot move: add "
                             "--no-momentum-correction (or use --optimizer sgd)")
        if options.momentum_correction and getattr(ctx.opt, "momentum_buffer", None) is not None:
            if getattr(opt_cfg, "nesterov", False):
                raise ValueError("--momentum-correction implements DGC's heavy-ball momentum; "
                                 "Nesterov momentum is not supported: add "
                                 "--no-momentum-correction")
            self.mu = float(opt_cfg.momentum)
            ctx.opt.momentum_buffer = None  # the optimizer applies the synced update as is
        self.velocity = xp.zeros_like(g) if self.mu else None
        self._bufs: list[_Buffer] = []
        self._seg_of: dict = {}
        self._k_full = per_tensor_counts(self.sizes, options.density)
        # the step whose program runs (set by records(); after_step moves it on) and its kind
        self._step = 0
        self._kind = None
        # the records of the current kind of step and their bindings: the array of each call,
        # each compute item and its callable by label (cleared when a plan is installed)
        self._records: dict = {}
        self._work: dict[str, tuple] = {}
        self._call_buffer: dict = {}
        # what the step's calls brought back: the gathered rows of each buffer until its
        # decoding, every (indices, values) of the step for the tensor-missing diagnostic, the
        # decision's profile and plan code
        self._gathered: dict[int, object] = {}
        self._gathered_idx: list = []
        self._code = None
        self._init_profiling()
        # SSFusion-O: the worker's events are timed on its thread by the run's compute source;
        # a GPU run's worker does host work that CUDA events cannot see: its thread CPU time
        self._init_offload(ThreadPoolExecutor(1, "ssfusion-offload") if options.offload
                           else None,
                           CpuTimeSource("thread") if self.run.backend.is_gpu
                           else self.run.clock.source)
        self._stats = {"sparse_steps": 0, "sparsify_s": 0.0, "worker_s": 0.0,
                       "profile_s": 0.0, "missing": 0.0, "missing_global": 0.0,
                       "missing_steps": 0}
        self._missing_by_tensor = np.zeros(self.L)
        if not needs_profile(options):
            self._install(self._template)

    # -- plan installation ------------------------------------------------------------------------
    def _install(self, plan: SSFusionPlan) -> None:
        """Execute the plan: allocate the fixed send buffers of its fusion buffers (plan once,
        run many)."""
        xp = self.xp
        if any(plan.offload) and self._executor is None:
            raise ValueError("the plan offloads tensors to the CPU worker (SSFusion-O) but the "
                             "strategy has none: build it with --offload")
        self.plan = plan
        self.buffers = plan.buffers
        self._bufs = [_Buffer(spec, xp.empty(spec.n_ar, dtype=np.float32), spec.row.empty(xp))
                      for spec in plan.layout]
        self._seg_of = {s.sid: (buf, s) for buf in self._bufs for s in buf.segments}
        self._records = {}
        self._install_offload()

    def _counts(self) -> tuple[list[int], list[int], list[int]]:
        """Per buffer: all-reduced elements, all-gathered dense elements, sparse count."""
        return ([b.n_ar for b in self._bufs], [b.n_agd for b in self._bufs],
                [b.K for b in self._bufs])

    # -- the program ------------------------------------------------------------------------------
    def records(self, state) -> list:
        """The plan's records of step ``state.step`` (:meth:`SSFusionPlan.calls`): a warm-up
        step (profiling the timings when the plan needs them; the last one decides the plan),
        or a sparse step of the installed plan.  The same list for every step of one kind."""
        step = int(state.step)
        self._step = step
        self._ready_count = 0
        if self.plan is None or step < self.warmup:
            profiling = self.plan is None
            key = ("warmup", profiling and step == self.warmup - 1, profiling)
        else:
            key = ("sparse", False, False)
        self._kind = key[0]
        if key not in self._records:
            plan = self.plan if self.plan is not None else self._template
            records = plan.calls(self.topo.placement, key[0], key[1], momentum=bool(self.mu),
                                 profiling=key[2])
            self._records = {key: records}
            self._bind(records)
        return self._records[key]

    def _bind(self, records) -> None:
        """The arrays of ``records``' calls that send what is there already (a warm-up
        buffer's slice of the gradient, a fusion buffer's ``Buffer_AR`` and ``Buffer_AG``), and
        the compute items by label."""
        g = self.ctx.model.grads.flat
        off = self.offsets
        arrays = {}
        for c in records:
            if isinstance(c, Work):
                continue
            if c.phase == WARMUP:
                t0, t1 = self._template.warmup_buffers[_index(c.label)]
                arrays[c.label] = g[off[t0]:off[t1]]
            elif c.phase == DENSE:
                arrays[c.label] = self._bufs[_index(c.label)].ar_buf
            elif c.phase == SPARSE:
                arrays[c.label] = self._bufs[_index(c.label)].send
        self._call_buffer = arrays
        self._work = {w.label: (w, self._item(w.label)) for w in records if isinstance(w, Work)}

    def _item(self, label: str):
        """The callable of compute item ``label`` (``name[i]``: of fusion buffer or tensor
        ``i``)."""
        name = label.partition("[")[0]
        if name == "ssf_profile":
            return self._run_profile
        if name == "ssf_momentum":
            return self._run_momentum
        i = _index(label)
        return {"ssf_sparsify_ar": partial(self._prepare_part, i, True),
                "ssf_sparsify": partial(self._prepare_part, i, False),
                "ssf_offload": partial(self._submit, i, label),
                "ssf_offload_wait": partial(self._collect_offloaded, i),
                "ssf_unpack_dense": partial(self._unpack_dense, i),
                "ssf_unpack_sparse": partial(self._unpack_sparse, i)}[name]

    def buffer(self, call):
        """What ``call`` sends: its slice of the gradient (warm-up), ``Buffer_AR`` or
        ``Buffer_AG`` (prepared by the compute items before it), the averaged profile (the
        decision's MAX all-reduce) or the plan rank 0 decided (its broadcast)."""
        if call.phase == PROFILE:
            return self._profile_vector()
        if call.phase == SELECT:
            return self._code
        return self._call_buffer[call.label]

    def received(self, call, result) -> None:
        """A buffer's gathered rows wait for its decoding; the profile max-reduced over the
        ranks is planned on rank 0 (:meth:`_decide`), the broadcast plan installed.  The
        all-reduces average in place."""
        if call.phase == SPARSE:
            self._gathered[_index(call.label)] = result
        elif call.phase == PROFILE:
            self._code = self._decide(result)
        elif call.phase == SELECT:
            self._install(self._template.decode(result))
            self._code = None

    def compute(self, label: str):
        """The compute item ``label`` of the step's records (an ``offload``-stream item hands
        its work to the worker and returns its pending time)."""
        return self._work[label][1]

    def flops(self, label: str) -> float | None:
        """The compute item's element operations (the plan's counts)."""
        w = self._work.get(label)
        return None if w is None else w[0].flops

    def after_step(self, state) -> None:
        """The tensor-missing rate (:meth:`_count_missing`, a diagnostic that is not part of the
        modeled system) of a sparse step that writes a metrics line (``state.logged``), so
        ordinary steps carry no diagnostic work and every step's ``step_wall_s`` is the whole
        step; the report's rates are means over those steps."""
        if self._kind == "sparse":
            self._stats["sparse_steps"] += 1
            if state.logged:
                self._count_missing(self._gathered_idx)
        self._gathered_idx = []
        self._step = int(state.step) + 1

    # -- compute items ----------------------------------------------------------------------------
    def _run_profile(self) -> None:
        """``ssf_profile``: one warm-up step's timings (:meth:`_profile_step`)."""
        t = time.perf_counter()
        self._profile_step(self._step, self.ctx.model.grads.flat)
        self._stats["profile_s"] += time.perf_counter() - t

    def _run_momentum(self) -> None:
        """``ssf_momentum``: the warm-up's momentum ``u = μ u + g``, sent as the gradient."""
        g = self.ctx.model.grads.flat
        self.velocity *= self.mu
        self.velocity += g
        g[...] = self.velocity

    def _prepare_part(self, i: int, head: bool) -> None:
        """``ssf_sparsify_ar[i]`` (``head``) / ``ssf_sparsify[i]``: :meth:`_prepare`.  On a GPU
        its host time is the time to queue it (no device wait here: the staging copy waits for
        the compute stream's event, and the compute block's CUDA timing has the device's
        time); on the CPU the work itself."""
        t = time.perf_counter()
        self._prepare(self._bufs[i], self._step, head)
        self._stats["sparsify_s"] += time.perf_counter() - t

    def _unpack_dense(self, i: int) -> None:
        """``ssf_unpack_dense[i]``: the averaged ``Buffer_AR`` back into the gradient."""
        g, buf = self.ctx.model.grads.flat, self._bufs[i]
        o = 0
        for ra, rb in buf.ar:
            g[ra:rb] = buf.ar_buf[o:o + rb - ra]
            o += rb - ra

    def _unpack_sparse(self, i: int) -> None:
        """``ssf_unpack_sparse[i]``: average the gathered dense tensors and scatter-add the
        gathered sparse entries of buffer ``i`` into the gradient (element operations: the
        ``p`` dense blocks summed, the ``p K`` entries scatter-added, the buffer's dense and
        sparse ranges written back)."""
        g, buf, p = self.ctx.model.grads.flat, self._bufs[i], self.topo.size
        rows = self._gathered.pop(i)
        row = buf.row
        if buf.n_agd:
            dense = row.dense_mean(rows, p)
            o = 0
            for ra, rb in buf.agd:
                g[ra:rb] = dense[o:o + rb - ra]
                o += rb - ra
        if buf.K:
            values, idx = row.values(rows), row.indices(rows)
            summed = scatter_mean(values, idx, buf.b - buf.a, p, base=buf.a)
            for seg in buf.segments:
                g[seg.a:seg.b] = summed[seg.a - buf.a:seg.b - buf.a]
            self._gathered_idx.append((idx, values))   # read by the diagnostic on logged steps

    # -- sparsification ---------------------------------------------------------------------------
    def _rng(self, step: int, sid: int) -> tuple:
        """Key of the segment's sampling generator (:func:`dataparallel.sparsify.segment_rng`:
        run seed, rank, step, segment), built lazily by the sparsifier."""
        return (self.ctx.seed, self.topo.rank, step, sid)

    def _sparsify(self, x, k: int, key: tuple):
        """Positions of (at most) ``k`` large ``|x|`` by ``--sparsifier``."""
        return select(self.options.sparsifier, x, k, key, self.options.sample_ratio)

    def _select(self, buf: _Buffer, seg: Segment, step: int) -> None:
        """Sparsify one segment in place: with momentum correction ``u = μ u + g`` and ``a =
        e + u`` (else ``a = e + g``), top-``k`` of ``a`` into ``buf.send``, ``e = a`` and ``u``
        with the sent entries zeroed (DGC's momentum factor masking)."""
        g = self.ctx.model.grads.flat
        a, b = seg.a, seg.b
        src = g[a:b]
        if self.velocity is not None:
            u = self.velocity[a:b]
            u *= self.mu
            u += src
            src = u
        acc = self._ef.accumulate(src, a, b)
        idx = self._sparsify(acc, seg.k, self._rng(step, seg.sid))
        buf.row.put(buf.send, seg.slot, acc[idx], idx, base=seg.a, k=seg.k)
        self._ef.sent(idx, a, b)
        if self.velocity is not None:
            self.velocity[a:b][idx] = 0

    def _prepare(self, buf: _Buffer, step: int, head: bool) -> None:
        """The part of one buffer before its split (``head``: momentum ``u = μ u + g`` of the
        ``Buffer_AR`` tensors, copied into ``ar_buf``) or after it (the later dense tensors,
        copied into the front of ``send``), and the sparsification of the part's segments the
        plan does not hand to the worker."""
        g = self.ctx.model.grads.flat
        dense = buf.ar if head else buf.agd
        if self.velocity is not None:
            u = self.velocity
            for ra, rb in dense:
                u[ra:rb] *= self.mu
                u[ra:rb] += g[ra:rb]
                g[ra:rb] = u[ra:rb]
        for seg in buf.segments:
            if buf.spec.head(seg) == head and not seg.offload:
                self._select(buf, seg, step)
        o = 0
        for ra, rb in dense:
            if head:
                buf.ar_buf[o:o + rb - ra] = g[ra:rb]
            else:
                buf.row.put_dense(buf.send, o, g[ra:rb])
            o += rb - ra

    # -- diagnostics (not part of the simulated system) -------------------------------------------
    def _count_missing(self, gathered_idx) -> None:
        """Tensor-missing rate (Table I): tensors with no entry sent (with a non-zero value) by
        this rank, and by no rank (dense tensors are never missing).  ``gathered_idx`` holds
        the step's gathered ``(indices, values)``; the non-zero entries are counted per tensor
        by a scatter-add (no compaction, so a device reads nothing until the one result)."""
        xp = self.xp
        own = [(buf.send[buf.n_agd + buf.K:], buf.send[buf.n_agd:buf.n_agd + buf.K])
               for buf in self._bufs if buf.K]
        dense = np.array([k < 0 for k in self.plan.k], dtype=bool)

        def missing(pairs) -> np.ndarray:
            if not pairs:
                return ~dense
            idx = xp.concatenate([i for i, _ in pairs])
            nonzero = xp.concatenate([v != 0 for _, v in pairs]).astype(np.float64)
            tid = xp.clip(xp.searchsorted(self._offsets_x, idx, side="right") - 1, 0,
                          self.L - 1)
            hit = scatter_mean(nonzero, tid, self.L, 1) > 0
            hit = hit.get() if hasattr(hit, "get") else hit
            return ~(hit | dense)

        mine = missing(own)
        self._stats["missing_steps"] += 1
        self._missing_by_tensor += mine
        self._stats["missing"] += mine.sum() / self.L
        self._stats["missing_global"] += missing(gathered_idx).sum() / self.L

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Error-feedback residuals (the host-side ones of offloaded tensors on a GPU run), the
        installed selection, the profile sums or the decided profile and offload guard, the
        statistics and the step whose backward runs next.  The plan decided from the warm-up
        timings is saved whole, so a run resumed after the warm-up runs it unchanged (the
        timings of a resumed process never re-decide it)."""
        host = self.run.backend.asnumpy
        state = {
            "residual": host(self.residual).copy(),
            "velocity": (host(self.velocity).copy() if self.velocity is not None
                         else np.zeros(0, np.float32)),
            "plan": self.plan.encode() if self.plan is not None else np.zeros(0, np.int64),
            "stats": json.dumps(self._stats),
            "missing_by_tensor": self._missing_by_tensor.copy(), "step": np.int64(self._step),
        }
        state.update(self._profiling_state())
        state.update(self._offload_state())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.residual[...] = self.xp.asarray(state["residual"])
        if self.velocity is not None:
            self.velocity[...] = self.xp.asarray(state["velocity"])
        if state["plan"].size:
            self._install(self._template.decode(state["plan"]))
        self._stats = json.loads(str(state["stats"]))
        self._missing_by_tensor = state["missing_by_tensor"].copy()
        self._step = int(state["step"])
        self._load_profiling_state(state)
        self._load_offload_state(state)
        source = getattr(self.run.clock.source, "name", "")
        if self.plan is None and needs_profile(self.options) and self.run.rank == 0 \
                and source not in ("profile", "flops"):
            # the decided plan is in every later checkpoint; one inside the warm-up has only
            # the timings of the steps before it
            print(f"spardist: warning: resuming inside SSFusion's warm-up (step {self._step} "
                  f"of --profile-steps {self.warmup}): the fusion plan will be decided on "
                  "timings this run measures for the remaining warm-up steps, so it may differ "
                  "from the plan of an uninterrupted run; a resume after the warm-up reuses "
                  "the decided plan, and --compute-source profile makes the timings "
                  "load-independent", file=sys.stderr, flush=True)

    # -- summary ----------------------------------------------------------------------------------
    def report(self) -> dict:
        o, st = self.options, self._stats
        out = {"fusion": o.fusion, "fusion_policy": o.fusion_policy, "sparsifier": o.sparsifier,
               "momentum_correction": self.mu, "buffers": len(self.buffers),
               "buffer_tensors": [list(self.names[t0:t1]) for t0, t1 in self.buffers],
               "warmup_buffer_tensors": [list(self.names[t0:t1])
                                         for t0, t1 in self._template.warmup_buffers],
               "profile_steps": self.warmup, "sparse_steps": st["sparse_steps"]}
        if self.plan is None:
            return out
        ar, agd, ks = self._counts()
        placement = self.topo.placement
        sparse = bytes_by_phase(self.plan.calls(placement), placement)
        ddp = bytes_by_phase(DDPPlan.for_layout(self.layout, DDPOptions(), 4).calls(placement),
                             placement)
        ddp_total = sum(sum(v.values()) for v in ddp.values())
        n = max(1, st["sparse_steps"])
        n_missing = max(1, st["missing_steps"])
        row_bytes = sum(b.row.nbytes for b in self._bufs) + 4 * sum(ar)
        out.update({
            "payload_ratio": row_bytes / (4 * self.layout.total),
            "bytes_per_step_vs_ddp": (sum(sum(v.values()) for v in sparse.values()) / ddp_total
                                      if ddp_total else None),
            "transmitted_elements": sum(ar) + sum(agd) + sum(ks),
            "target_elements": sum(self._k_full),
            "tensor_missing_rate": st["missing"] / n_missing,
            "tensor_missing_rate_global": st["missing_global"] / n_missing,
            "missing_by_tensor": {self.names[l]: float(c / n_missing)
                                  for l, c in enumerate(self._missing_by_tensor) if c},
            "missing_rate_steps": st["missing_steps"],
            "sparsify_s_per_step": st["sparsify_s"] / n,
            "offload_worker_s_per_step": st["worker_s"] / n,
            "selection": {
                "dense": [self.names[l] for l in self.plan.dense()],
                "offloaded": [self.names[l] for l, f in enumerate(self.plan.offload) if f],
                "k": ({f"buffer{i}": b.K for i, b in enumerate(self._bufs)}
                      if o.fusion == "multi-tensor" else
                      {self.names[l]: int(k) for l, k in enumerate(self.plan.k) if k >= 0}),
                "split": list(self.plan.split),
                "allreduce_elements": ar, "allgather_dense_elements": agd,
                "sparse_elements": ks},
        })
        if self._profile is not None:
            out["profile"] = {f: {self.names[l]: float(v) for l, v in enumerate(row)}
                              for f, row in zip(PROFILE_FIELDS, self._profile)}
            out["profile_s"] = st["profile_s"]
        if self._offload_guard is not None:
            out["offload_guard"] = self._offload_guard
        return out
