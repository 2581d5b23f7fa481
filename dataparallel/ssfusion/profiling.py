"""SSFusion's warm-up profiling and decision (§IV-B online profiling) and SSFusion-O's CPU
worker (§IV-C), as mixins of :class:`~dataparallel.ssfusion.SSFusion`.

Profiling (measurement, not program: the ``on_ready`` hook and the ``ssf_profile`` compute
item): ``T_b^l``, the gap between tensor ``l``'s gradient and the previous tensor's (the first
tensor gets 0 as the trainer has no backward-start hook), from the per-layer compute events of
the run's compute source (``on_ready`` wall-clock timestamps without per-layer events);
``T_sp^l`` by timing the sparsifier on tensor ``l`` itself after the backward, with the run's
compute source; so a loaded host or a replayed ``--compute-profile`` plans the same buffers.
``T_cpu^l`` (with ``--offload``, on every second warm-up step) by running it on the worker thread
from ``on_ready``, and the backward spans of the offload guard, stay wall-clock: they measure
contention between threads.  Communication times from the run's α–β model.  The timings are
max-reduced over all ranks, rank 0 plans and broadcasts the plan, so every rank uses the same
plan (the records: :meth:`SSFusionPlan.calls`, ``decided``; rank 0's planning:
:meth:`WarmupProfiler._decide`).

Offload: the plan lists the sparsification of each offloaded tensor as a compute item on the
``offload`` stream where the backward writes the tensor (``ssf_offload[l]``); its compute hands
it to one worker thread (:meth:`OffloadWorker._submit`), and the buffer's ``ssf_offload_wait[i]``
collects it before the all-gather.  The item's time is the worker's own reading of the run's
compute source (:meth:`simulation.clock.SimClock.offload`).
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from simulation.clock import PendingSeconds
from simulation.compute import resolve_pending

from ..codec import ErrorFeedback
from ..sparsify import selection_flops
from .plan import PROFILE_FIELDS, plan_ssfusion

__all__ = ["OffloadWorker", "WarmupProfiler"]


class WarmupProfiler:
    """Warm-up profiling, the decision and the ``on_ready`` hook of SSFusion (a mixin: the
    strategy provides ``plan``, ``options``, ``offsets``, ``_sparsify``, ``_install``, ...)."""

    def _init_profiling(self) -> None:
        # sums and step counts of T_b, T_sp, T_cpu per tensor and of the backward span without
        # / with the offload worker busy
        self._sums = {f: np.zeros(self.L) for f in PROFILE_FIELDS}
        self._sums.update(span_plain=np.zeros(1), span_worker=np.zeros(1))
        self._counts_prof = dict.fromkeys(self._sums, 0)
        self._profile: np.ndarray | None = None
        self._offload_guard: dict | None = None
        self._t_ready = np.zeros(self.L)
        self._ready_count = 0
        self._prof_futures: list = []

    def on_ready(self, name: str) -> None:
        """Warm-up only: the time the backward wrote tensor ``name`` and, on every second
        warm-up step with ``--offload``, its sparsification timed on the worker (``T_cpu``)."""
        if not (self.plan is None or self._step < self.warmup):
            return
        l = self.index_of[name]
        self._t_ready[l] = time.perf_counter()
        self._ready_count += 1
        if self._executor is not None and self.plan is None and self._step % 2 == 1:
            self._prof_futures.append(self._executor.submit(
                self._profile_job, l, self._step, self._t_ready[l]))

    def _profile_job(self, l: int, step: int, t_submit: float):
        """Worker thread, warm-up with ``--offload``: time tensor ``l``'s sparsification on the
        CPU worker while the backward goes on (read-only: the result is discarded)."""
        t_start = time.perf_counter()
        with self.run.backend.device():              # CuPy's device is per thread
            x = self.run.backend.asnumpy(
                self.ctx.model.grads.flat[self.offsets[l]:self.offsets[l + 1]])
        # service time by the run's compute source on this thread (consistent with T_b, T_sp)
        with self._worker_source.measure(selection_flops(x.size, self._k_full[l],
                                                          self.options.sparsifier,
                                                          self.options.sample_ratio)) as m:
            self._sparsify(x, self._k_full[l], self._rng(step, l))
        return l, t_submit, t_start, time.perf_counter(), m.seconds

    def _source_ready_times(self) -> np.ndarray | None:
        """When each tensor's gradient was written in this step's backward, in the compute
        source's seconds: the compute stream's blocks up to the backward block that wrote it
        (:meth:`SimClock.compute_before`); ``None`` without per-layer blocks (the ``on_ready``
        wall-clock timestamps are used then)."""
        clock = self.run.clock
        layers = clock.layers
        if layers.last is None:
            return None
        return np.array([clock.compute_before(layers.ready_event(
            int(self.offsets[l]), int(self.offsets[l + 1]))) for l in range(self.L)])

    def _profile_step(self, step: int, g) -> None:
        """One warm-up step's timings (sums, averaged in :meth:`_decide`).

        ``T_b`` from the compute source's per-layer events (:meth:`_source_ready_times`; else
        the ``on_ready`` timestamps) of steps without the worker; with
        ``--offload`` every second warm-up step runs each tensor's sparsification on the worker
        from ``on_ready``, concurrently with the rest of the backward as it will run: ``T_cpu``
        is its service time on the worker by the run's compute source (contention with the
        backward is left to the offload guard), and the backward span (first to last ready) of those steps against the plain ones measures how much the worker slows the
        backward down.  ``T_sp`` is timed on the main thread after the backward by the compute
        source (event ``ssf_tsp:l``).  Without
        offload profiling ``T_cpu = T_sp`` and both spans are 0.
        """
        backend = self.run.backend
        sums, counts = self._sums, self._counts_prof
        worker_step = bool(self._prof_futures)
        if self._ready_count == self.L:  # every on_ready seen this step
            span = self._t_ready[-1] - self._t_ready[0]
            if worker_step:
                sums["span_worker"] += span
                counts["span_worker"] += 1
            else:
                sums["span_plain"] += span
                counts["span_plain"] += 1
                t_ready = self._source_ready_times()
                if t_ready is None:            # no per-layer events: wall-clock timestamps
                    t_ready = self._t_ready
                sums["T_b"] += np.maximum(np.diff(t_ready, prepend=t_ready[0]), 0)
                counts["T_b"] += 1
        t_cpu = np.zeros(self.L)
        for fut in self._prof_futures:
            l, _, _, _, service_s = fut.result()
            t_cpu[l] = service_s
        if len(self._prof_futures) == self.L:
            sums["T_cpu"] += t_cpu
            counts["T_cpu"] += 1
        self._prof_futures.clear()
        source = self.run.clock.source
        # CUDA events time the kernels themselves: no host wait around each tensor, the
        # step's times are read together (a wall or CPU clock needs the device idle at both
        # ends of the block)
        deferred = getattr(source, "deferred", False)
        t_sp = sums["T_sp"]
        for l in range(self.L):
            a, b = int(self.offsets[l]), int(self.offsets[l + 1])
            if not deferred:
                backend.synchronize()
            # timed by the run's compute source (not the wall clock), so a loaded host or a
            # replayed profile plans the same buffers
            with source.measure(selection_flops(b - a, self._k_full[l],
                                                self.options.sparsifier,
                                                self.options.sample_ratio),
                                label=f"ssf_tsp:{l}") as m:
                self._sparsify(g[a:b], self._k_full[l], self._rng(step, l))
                if not deferred:
                    backend.synchronize()
            if getattr(m, "deferred", False) and not m.resolved:
                m.then(lambda sec, l=l: t_sp.__setitem__(l, t_sp[l] + sec))
            else:
                t_sp[l] += m.seconds
        counts["T_sp"] += 1

    def _profile_vector(self) -> np.ndarray:
        """The averaged profile, ``3L + 2`` float64 (:func:`~dataparallel.ssfusion.
        profile_length`): what the decision's MAX all-reduce sends."""
        resolve_pending(self.run.clock.source)     # the last warm-up step's T_sp
        sums, n = self._sums, self._counts_prof

        def mean(f, fallback):
            return sums[f] / n[f] if n[f] else fallback

        t_sp = mean("T_sp", np.zeros(self.L))
        spans = (np.concatenate([mean("span_plain", None), mean("span_worker", None)])
                 if n["span_plain"] and n["span_worker"] else np.zeros(2))
        return np.ascontiguousarray(np.concatenate(
            [mean("T_b", np.zeros(self.L)), t_sp, mean("T_cpu", t_sp), spans]),
            dtype=np.float64)

    def _decide(self, prof) -> np.ndarray:
        """Plan on the timings max-reduced over the ranks, ``prof`` (:func:`plan_ssfusion`) on
        rank 0, between the profile's all-reduce and the plan's broadcast (§IV-B online
        profiling: buffers and selection are recorded once and fixed; host work, not timed).
        Returns the broadcast form of the plan (zeros on the other ranks).

        Offload guard (not in the paper, whose backward runs on the GPU): the offload set of
        :func:`plan_offload` is kept only when the main-thread sparsification time it saves,
        ``Σ_{l∈O} T_sp^l``, exceeds the measured slowdown of the backward while the worker is
        busy (span with worker - span without).  On a CPU-only run with no spare core the worker
        competes with the backward and offloading is switched off.
        """
        o, L = self.options, self.L
        self._profile = np.array(prof[:3 * L]).reshape(len(PROFILE_FIELDS), L)
        T_b, T_sp, T_cpu = self._profile
        code = np.zeros_like(self._template.encode())
        if self.topo.world.rank == 0:
            plan = plan_ssfusion(*self._plan_args, profile=(T_b, T_sp, T_cpu))
            if o.offload:
                off = np.array(plan.offload)
                saved = float(T_sp[off].sum())
                slowdown = float(prof[3 * L + 1] - prof[3 * L])
                keep = saved > slowdown
                self._offload_guard = {"saved_s": saved, "backward_slowdown_s": slowdown,
                                       "candidates": [self.names[l] for l in np.flatnonzero(off)],
                                       "enabled": bool(keep)}
                if not keep:
                    plan = dataclasses.replace(plan, offload=(False,) * L)
            code[:] = plan.encode()
        return code

    # -- checkpoints ------------------------------------------------------------------------------
    def _profiling_state(self) -> dict:
        state = {"profile": (self._profile.copy() if self._profile is not None
                             else np.zeros((0, self.L))),
                 "offload_guard": json.dumps(self._offload_guard),
                 "counts_prof": json.dumps(self._counts_prof)}
        state.update({f"sums/{k}": v.copy() for k, v in self._sums.items()})
        return state

    def _load_profiling_state(self, state: dict) -> None:
        self._profile = state["profile"].copy() if state["profile"].size else None
        self._offload_guard = json.loads(str(state["offload_guard"]))
        self._counts_prof = json.loads(str(state["counts_prof"]))
        self._sums = {k: state[f"sums/{k}"].copy() for k in self._sums}


class OffloadWorker:
    """SSFusion-O (§IV-C): the plan's offloaded segments sparsified on one CPU worker thread
    during the backward (a mixin of :class:`~dataparallel.ssfusion.SSFusion`: the bindings of
    the plan's ``ssf_offload[l]`` and ``ssf_offload_wait[i]`` items)."""

    def _init_offload(self, executor, source) -> None:
        self._executor = executor
        self._worker_source = source
        self._futures: dict[int, object] = {}
        self._host_res: dict[int, np.ndarray] = {}
        self._host_vel: dict[int, np.ndarray] = {}

    def _install_offload(self) -> None:
        """A GPU run keeps the error-feedback residual (and velocity) of every offloaded
        segment on the host, where the worker sparsifies it, continuing from the device's:
        the warm-up's momentum (and any residual) moves with the segment, so a GPU run trains
        as the CPU run, whose worker keeps using the same arrays (the host velocity
        used to start at zero).  One copy per offloaded tensor, once per installed plan."""
        if not self.run.backend.is_gpu:
            return
        host = self.run.backend.asnumpy
        segs = [s for buf in self._bufs for s in buf.segments if s.offload]
        self._host_res = {s.sid: np.array(host(self.residual[s.a:s.b]), dtype=np.float32)
                          for s in segs}
        self._host_vel = ({s.sid: np.array(host(self.velocity[s.a:s.b]), dtype=np.float32)
                           for s in segs} if self.mu else {})

    def _submit(self, l: int, label: str) -> PendingSeconds:
        """``ssf_offload[l]`` (a compute item on the ``offload`` stream): hand tensor ``l``'s
        sparsification to the worker; returns its pending measurement, which
        :meth:`_collect_offloaded` delivers."""
        buf, seg = self._seg_of[l]
        pending = PendingSeconds()
        self._futures[l] = (self._executor.submit(self._offload_job, buf, seg, self._step,
                                                  self.flops(label), label), pending)
        return pending

    def _offload_job(self, buf, seg, step: int, flops: float, label: str):
        """Worker thread: sparsify one tensor on the CPU (on a GPU run: copy to the host, select
        with NumPy, keep its residual on the host; the main thread copies the result back).

        Returns ``(wall seconds, simulated seconds, host result or None)``: the simulated
        seconds are the run's compute source's reading of event ``label`` taken on this thread
        (thread CPU time of the worker, the plan's count ``flops``
        (:meth:`SSFusionPlan.segment_flops`) or a compute profile's; on a GPU run the
        worker's thread CPU time, as CUDA events would not see host work)."""
        t = time.perf_counter()
        with self._worker_source.measure(flops, None, label) as m:
            if not self.run.backend.is_gpu:
                self._select(buf, seg, step)
                host_out = None
            else:
                with self.run.backend.device():     # CuPy's device is per thread
                    host = self.ctx.model.grads.flat[seg.a:seg.b].get()
                if self.mu:
                    u = self._host_vel[seg.sid]
                    u *= self.mu
                    u += host
                    host = u
                ef = ErrorFeedback(self._host_res.get(seg.sid), self.options.error_feedback)
                acc = ef.accumulate(host)
                idx = self._sparsify(acc, seg.k, self._rng(step, seg.sid))
                values = acc[idx].copy()
                ef.sent(idx)
                if self.mu:
                    self._host_vel[seg.sid][idx] = 0
                host_out = (values, idx)
        return time.perf_counter() - t, m.seconds, host_out

    def _collect_offloaded(self, i: int) -> None:
        """``ssf_offload_wait[i]``: wait for the worker's segments of buffer ``i``, copy GPU-run
        results into its send buffer and deliver each segment's time to its ``ssf_offload[l]``
        item (SSFusion-O, §IV-C: the worker ran during the backward)."""
        buf, xp = self._bufs[i], self.xp
        for seg in buf.segments:
            job = self._futures.pop(seg.sid, None)
            if job is None:
                continue
            fut, pending = job
            dt, sim, host = fut.result()
            self._stats["worker_s"] += dt
            if host is not None:
                buf.row.put(buf.send, seg.slot, xp.asarray(host[0]), xp.asarray(host[1]),
                            base=seg.a, k=seg.k)
            pending.set(sim)

    def _offload_state(self) -> dict:
        state = {f"host_res/{sid}": r.copy() for sid, r in self._host_res.items()}
        state.update({f"host_vel/{sid}": r.copy() for sid, r in self._host_vel.items()})
        return state

    def _load_offload_state(self, state: dict) -> None:
        for sid, r in self._host_res.items():
            r[...] = state[f"host_res/{sid}"]
        for sid, r in self._host_vel.items():
            r[...] = state[f"host_vel/{sid}"]
