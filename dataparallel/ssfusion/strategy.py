"""The SSFusion strategy: executes :class:`~dataparallel.ssfusion.SSFusionPlan` step by step
(warm-up all-reduces, then per fusion buffer the all-reduce of ``Buffer_AR`` and the all-gather of
``Buffer_AG``), every call through :class:`substrate.comm.Comm` with the dependencies the plan's
records name, so the run's timeline is the paper's pipeline (Fig. 10) and
:meth:`SSFusion.step_calls` hands the trainer exactly the records it executed.

The warm-up profiling, the decision and SSFusion-O's CPU worker are in
:mod:`dataparallel.ssfusion.profiling`."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from substrate.calls import bytes_by_phase
from substrate.compute import CpuTimeSource
from substrate.costmodel import INTER, INTRA
from volume.ssfusion import DENSE, SPARSE, WARMUP

from ..codec import ErrorFeedback, scatter_mean
from ..ddp import DDPOptions, DDPPlan
from ..sparsify import select
from ..strategy import Strategy, register
from .options import SSFusionOptions, needs_profile
from .plan import PROFILE_FIELDS, FusionBuffer, Segment, SSFusionPlan, plan_ssfusion
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
        self._step = 0  # the step whose backward runs (for on_ready)
        # the step in flight: calls issued (kind, buffer, handle) to wait and decode in sync,
        # the last call on the stream, each buffer's stage (1: Buffer_AR sent, 2: all sent)
        # and head event, the warm-up buffers sent
        self._issued: list = []
        self._prev = None
        self._stage: dict = {}
        self._head_ev: dict = {}
        self._warm_sent = 0
        self._init_profiling()
        # SSFusion-O: the worker's events are timed on its thread by the run's compute source;
        # a GPU run's worker does host work that CUDA events cannot see: its thread CPU time
        self._init_offload(ThreadPoolExecutor(1, "ssfusion-offload") if options.offload
                           else None,
                           CpuTimeSource("thread") if self.run.backend.is_gpu
                           else self.run.clock.source)
        # step bookkeeping and statistics
        self._last: tuple = ("none", False, False)
        self._records: dict = {}
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
        self.plan = plan
        self.buffers = plan.buffers
        self._bufs = [_Buffer(spec, xp.empty(spec.n_ar, dtype=np.float32), spec.row.empty(xp))
                      for spec in plan.layout]
        self._seg_of = {s.sid: (buf, s) for buf in self._bufs for s in buf.segments}
        self._buffer_of = {l: i for i, buf in enumerate(self._bufs) for l in range(buf.t0, buf.t1)}
        self._install_offload()

    def _counts(self) -> tuple[list[int], list[int], list[int]]:
        """Per buffer: all-reduced elements, all-gathered dense elements, sparse count."""
        return ([b.n_ar for b in self._bufs], [b.n_agd for b in self._bufs],
                [b.K for b in self._bufs])

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
        """Main thread, the part of one buffer before its split (``head``: momentum ``u = μ u +
        g`` of the ``Buffer_AR`` tensors, copied into ``ar_buf``) or after it (the later dense
        tensors, copied into the front of ``send``), and the sparsification of the part's
        segments not handed to the worker."""
        g = self.ctx.model.grads.flat
        dense = buf.ar if head else buf.agd
        if self.velocity is not None:
            u = self.velocity
            for ra, rb in dense:
                u[ra:rb] *= self.mu
                u[ra:rb] += g[ra:rb]
                g[ra:rb] = u[ra:rb]
        for seg in buf.segments:
            if buf.spec.head(seg) == head and not (seg.offload and seg.sid in self._futures):
                self._select(buf, seg, step)
        o = 0
        for ra, rb in dense:
            if head:
                buf.ar_buf[o:o + rb - ra] = g[ra:rb]
            else:
                buf.row.put_dense(buf.send, o, g[ra:rb])
            o += rb - ra

    def _part_flops(self, buf: _Buffer, head: bool) -> float:
        """Element operations of :meth:`_prepare` (the plan's count,
        :meth:`SSFusionPlan.part_flops`, for the segments this step runs on the main thread)."""
        plan, mom = self.plan, bool(self.mu)
        return (sum(plan.dense_flops(rb - ra, mom) for ra, rb in (buf.ar if head else buf.agd))
                + sum(plan.segment_flops(s.b - s.a, s.k, mom) for s in buf.segments
                      if buf.spec.head(s) == head
                      and not (s.offload and s.sid in self._futures)))

    # -- one step ---------------------------------------------------------------------------------
    def on_ready(self, name: str) -> None:
        """The backward wrote ``name``'s gradient (called between units, right after the unit
        that wrote it).  Warm-up profiling and SSFusion-O's submissions as before
        (:meth:`WarmupProfiler.on_ready`); then, with ``--overlap on``, the paper's pipeline
        (§IV-D, Fig. 10) for real: when the tensors before a buffer's split are written, their
        part is prepared here (momentum, sparsification, packing of ``Buffer_AR``: compute
        between units, so it delays the rest of the backward as a kernel on the compute stream
        would) and ``Buffer_AR``'s all-reduce goes to the communication stream; when the whole
        buffer is written, the rest is prepared, the worker's segments collected and the
        all-gather of ``Buffer_AG`` issued.  In a warm-up step with nothing to compute after the
        backward (no profiling, no momentum correction) each warm-up buffer's all-reduce is
        issued as soon as the backward wrote it.  :meth:`sync` waits and decodes."""
        super().on_ready(name)
        if not self.run.recorder.overlap:
            return                  # --overlap off: every call blocks in sync, after it
        l = self.index_of[name]
        if self.plan is None or self._step < self.warmup:
            if self.plan is not None and not self.mu:
                wb = self._template.warmup_buffers
                while self._warm_sent < len(wb) and l + 1 >= wb[self._warm_sent][1]:
                    self._send_warmup(self._warm_sent, self.ctx.model.grads.flat, [])
            return
        i = self._buffer_of[l]
        buf = self._bufs[i]
        if buf.c > buf.a and int(self.offsets[l + 1]) == buf.c:
            self._send_head(i, self._step)
        if l + 1 == buf.t1:
            self._send_tail(i, self._step)

    def _send_head(self, i: int, step: int) -> None:
        """Buffer ``i``'s part before its split: prepare it, then all-reduce ``Buffer_AR``
        after it, its gradients and the previous call on the stream."""
        clock, buf = self.run.clock, self._bufs[i]
        head = self._prepare_part(buf, step, True, f"ssf_sparsify_ar[{i}]")
        self._head_ev[i] = head
        if buf.n_ar:
            self._prev = self.topo.world.allreduce(
                buf.ar_buf, "avg", phase=DENSE, after=[clock.ready(buf.a, buf.c), head,
                                                        self._prev], wait=False)
            self._issued.append(("ar", i, self._prev))
        self._stage[i] = 1

    def _send_tail(self, i: int, step: int) -> None:
        """The rest of buffer ``i``: prepare the part after the split, collect the worker's
        segments (the host waits for them: the compute stream does too,
        ``ssf_offload_wait[i]``), then all-gather ``Buffer_AG`` after both parts, the worker's
        events and the previous call (``T2 = max(T_AR, Σ T_b + T_sp) + T_AG``)."""
        clock, buf = self.run.clock, self._bufs[i]
        if self._stage.get(i, 0) == 0 and buf.c > buf.a:
            self._send_head(i, step)
        tail = None
        if buf.b > buf.c:
            tail = self._prepare_part(buf, step, False, f"ssf_sparsify[{i}]")
        offloaded = self._collect_offloaded(buf)
        if offloaded:
            with clock.compute(f"ssf_offload_wait[{i}]", deps=offloaded):
                pass
        if buf.send.size:
            self._prev = self.topo.world.allgather(
                buf.send, phase=SPARSE, after=[clock.ready(buf.a, buf.b), self._head_ev.get(i),
                                               tail, *offloaded, self._prev], wait=False)
            self._issued.append(("ag", i, self._prev))
        self._stage[i] = 2

    def sync(self, state, buffers):
        """One sparse step, buffer by buffer in backward order, as :meth:`SSFusionPlan.calls`
        lists it.  With ``--overlap on`` the backward has already prepared every buffer and
        issued its calls (:meth:`on_ready`); what it did not (every buffer with ``--overlap
        off``, where each call blocks) is done here, after the backward, in the same order: the
        part before the split (momentum, sparsification, packing of ``Buffer_AR``), the
        all-reduce of ``Buffer_AR``, the part after the split, the worker's offloaded segments
        (:meth:`_collect_offloaded`), the all-gather of ``Buffer_AG``.  Then every call is waited
        for in issue order and its buffer decoded into the gradient (``ssf_unpack_dense[i]``,
        ``ssf_unpack_sparse[i]``: compute after their call).

        The tensor-missing rate (:meth:`_count_missing`, a diagnostic that is not part of the
        modeled system) is counted only on steps that write a metrics line
        (``state.logged``), so ordinary steps carry no diagnostic work and every step's
        ``step_wall_s`` is the whole step; the report's rates are means over those steps."""
        g = buffers.flat
        step = int(state.step)
        if self.plan is None or step < self.warmup:
            return self._warmup_sync(step, g)
        clock = self.run.clock
        p = self.topo.size
        for i in range(len(self._bufs)):
            if self._stage.get(i, 0) < 2:            # not sent during the backward
                self._send_tail(i, step)
        gathered_idx = []
        for kind, i, h in self._issued:
            buf = self._bufs[i]
            h.wait()
            if kind == "ar":
                with clock.compute(f"ssf_unpack_dense[{i}]", flops=float(buf.n_ar), deps=h):
                    o = 0
                    for ra, rb in buf.ar:
                        g[ra:rb] = buf.ar_buf[o:o + rb - ra]
                        o += rb - ra
                continue
            # element operations: the p dense blocks summed, the p K entries scatter-added,
            # the buffer's dense and sparse ranges written back
            with clock.compute(f"ssf_unpack_sparse[{i}]",
                               flops=float(p * buf.n_agd + 2 * p * buf.K + buf.b - buf.a),
                               deps=h):
                self._unpack_gathered(buf, h.result, g, p, gathered_idx)
        self._end_step()
        if state.logged:
            self._count_missing(gathered_idx)
        self._stats["sparse_steps"] += 1
        self._last = ("sparse", False, False)
        return g

    def _end_step(self) -> None:
        """Forget the step's calls (all waited for)."""
        self._issued, self._prev, self._warm_sent = [], None, 0
        self._stage, self._head_ev = {}, {}

    def _prepare_part(self, buf: _Buffer, step: int, head: bool, label: str):
        """:meth:`_prepare` as a compute event after the backward event that completes the
        part: run from the ready hook it is declared right there, between two units (the
        paper's pipeline, Fig. 10); run from :meth:`sync` it follows the backward, as it ran.
        Returns the event."""
        clock = self.run.clock
        lo, hi = (buf.a, buf.c) if head else (buf.c, buf.b)
        with clock.compute(label, flops=self._part_flops(buf, head), deps=clock.ready(lo, hi)):
            # host time of the preparation: on a GPU the time to queue it (no device wait
            # here: the staging copy waits for the compute stream's event, and the compute
            # event's CUDA timing has the device's time); on the CPU the work itself
            t = time.perf_counter()
            self._prepare(buf, step, head)
            self._stats["sparsify_s"] += time.perf_counter() - t
        return clock.last_event if clock.timeline is not None else None

    def _unpack_gathered(self, buf: _Buffer, rows, g, p: int, gathered_idx: list) -> None:
        """Average the gathered dense tensors and scatter-add the gathered sparse entries of
        one buffer into ``g``."""
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
            gathered_idx.append((idx, values))   # read by the diagnostic on logged steps

    def _warmup_sync(self, step: int, g):
        """Dense all-reduce of every warm-up buffer (with momentum correction, of ``u = μ u +
        g``); a plan that needs timings also profiles (T_b, T_sp, T_cpu) and, after the last
        warm-up step, is decided (:meth:`_decide`), as :meth:`SSFusionPlan.calls` lists it
        (``kind="warmup"``).

        On the timeline the profiling and the momentum update are compute events after the
        backward (they read the whole gradient); each warm-up buffer's all-reduce waits for
        its gradients, those events and the previous buffer's all-reduce."""
        clock = self.run.clock
        template = self._template
        profiling = self.plan is None
        before = []
        self._profile_event = None
        if profiling:
            with clock.compute("ssf_profile", flops=template.profile_flops()):
                t = time.perf_counter()
                self._profile_step(step, g)
                self._stats["profile_s"] += time.perf_counter() - t
            self._profile_event = clock.last_event if clock.timeline is not None else None
            before.append(self._profile_event)
        if self.velocity is not None:
            with clock.compute("ssf_momentum", flops=2.0 * g.size):
                self.velocity *= self.mu
                self.velocity += g
                g[...] = self.velocity
            before.append(clock.last_event if clock.timeline is not None else None)
        while self._warm_sent < len(template.warmup_buffers):   # not sent during the backward
            self._send_warmup(self._warm_sent, g, before)
        for _, _, h in self._issued:
            h.wait()
        last = self._prev
        self._end_step()
        decided = profiling and step == self.warmup - 1
        if decided:
            self._decide(last)
        self._last = ("warmup", decided, profiling)
        self._ready_count = 0
        return g

    def _send_warmup(self, j: int, g, before: list) -> None:
        """Warm-up buffer ``j``'s average all-reduce after its gradients, ``before`` (the
        step's profiling and momentum events) and the previous call on the stream."""
        t0, t1 = self._template.warmup_buffers[j]
        a, b = int(self.offsets[t0]), int(self.offsets[t1])
        self._prev = self.topo.world.allreduce(
            g[a:b], "avg", phase=WARMUP, after=[self.run.clock.ready(a, b), *before, self._prev],
            wait=False)
        self._issued.append(("warmup", j, self._prev))
        self._warm_sent = j + 1

    def after_step(self, state) -> None:
        self._step = int(state.step) + 1

    def step_calls(self) -> list:
        """The plan's records of the last :meth:`sync` (:meth:`SSFusionPlan.calls` on this
        run's placement)."""
        kind, decided, profiling = self._last
        if kind == "none":
            return []
        plan = self.plan if self.plan is not None else self._template
        key = (id(plan), kind, decided, profiling)
        if key not in self._records:
            self._records = {key: plan.calls(self.topo.placement, kind, decided,
                                             momentum=bool(self.mu), profiling=profiling)}
        return self._records[key]

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
