"""Compute sources: how long a compute block of the simulated clock takes, independently of how
loaded the host is.

Compute sources (:class:`ComputeSource`) say how long a compute block takes, independently of
how loaded the host is:

``cpu`` (:class:`CpuTimeSource`)
    CPU time of the measuring thread (``time.thread_time_ns``), which does not grow when ranks
    share cores: a descheduled thread accrues none.  Multi-threaded BLAS spreads a block's work
    over threads the calling thread's clock does not see, so the source checks the BLAS/OpenMP
    pools (``threadpoolctl``): with one thread it uses thread time (``"cpu_thread"``), with more
    it uses the CPU time of the whole process (``"cpu_process"``: the sum over threads, i.e.
    single-core-equivalent seconds, which also counts any helper thread busy during the block).
    Run several ranks per core with ``OMP_NUM_THREADS=1`` / ``OPENBLAS_NUM_THREADS=1`` (the
    launchers and the wire lab set them) to get ``cpu_thread``.
``wall`` (:class:`WallSource`)
    ``time.perf_counter`` (the old clock; grows with the host's load).
``calibrated`` (:class:`CalibratedSource`)
    The least of the first few measurements of each event (by label), then fixed: a profiling
    pass taken in place, which drops warm-up and interference bursts.
``cuda`` (:class:`CudaEventSource`)
    CUDA events on the current CuPy stream (GPU time of the kernels of the block), read once
    per step with one host wait.
``flops`` (:class:`FlopSource`)
    ``seconds = max(FLOPs / peak, bytes / memory bandwidth)`` (a roofline with peak
    ``device_tflops`` and, optionally, ``device_gbs``) from the FLOP counts a model reports per
    layer (:meth:`models.network.Model.compute_units`); blocks without a FLOP count fall back to
    ``cpu`` and the fallback seconds are reported.
``profile`` (:class:`simulation.profile.ProfileSource`)
    Every event costs its least measurement in a compute profile (:mod:`simulation.profile`).

Every source has a ``name`` and :meth:`ComputeSource.describe` for ``summary.json``;
:func:`simulation.clock.make_source` builds one by its ``--compute-source`` name.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

from substrate.threads import blas_threads

__all__ = [
    "CalibratedSource",
    "ComputeSource",
    "CpuTimeSource",
    "CudaEventSource",
    "DeferredMeasurement",
    "FlopSource",
    "WallSource",
    "resolve_pending",
]


# -- compute sources -------------------------------------------------------------------------------

class ComputeSource:
    """How long a compute block takes.  ``with src.measure(flops=F, nbytes=B) as m: ...`` runs the
    block and sets ``m.seconds``."""

    name = "base"

    class Measurement:
        __slots__ = ("seconds",)

        def __init__(self) -> None:
            self.seconds = 0.0

    @contextmanager
    def measure(self, flops: float | None = None, nbytes: float | None = None,
                label: str | None = None):
        m = self.Measurement()
        t0 = self._now()
        try:
            yield m
        finally:
            m.seconds = max(0.0, self._now() - t0)

    def _now(self) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def new_step(self) -> None:
        """A step ended (:meth:`simulation.clock.SimClock.step`): sources that count the
        occurrences of a label per step start again."""

    def describe(self) -> str:
        return self.name

    def profile_info(self) -> dict | None:
        """The compute profile read or recorded, for ``summary.json`` (``None``: none)."""
        return None


class WallSource(ComputeSource):
    """Wall time (``time.perf_counter``), synchronizing the device first when ``sync`` is given.
    Grows with the host's load: the old clock's source."""

    name = "wall"

    def __init__(self, sync=None) -> None:
        self._sync = sync

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()


class CpuTimeSource(ComputeSource):
    """CPU time (see the module docstring).

    Parameters
    ----------
    mode : {"auto", "thread", "process"}
        ``thread``: ``time.thread_time_ns`` of the measuring thread; ``process``:
        ``time.process_time_ns`` (all threads of the process); ``auto``: ``thread`` when the
        BLAS/OpenMP pools have one thread, else ``process``.
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "thread", "process"):
            raise ValueError(f"CPU-time mode must be auto, thread or process, got {mode!r}")
        self.blas_threads = blas_threads()
        if mode == "auto":
            mode = "thread" if (self.blas_threads or 1) <= 1 else "process"
        self.mode = mode
        self.name = f"cpu_{mode}"
        self._clock = time.thread_time_ns if mode == "thread" else time.process_time_ns

    def _now(self) -> float:
        return self._clock() * 1e-9

    def describe(self) -> str:
        return f"{self.name} (blas_threads={self.blas_threads})"


class DeferredMeasurement(ComputeSource.Measurement):
    """A block timed by CUDA events whose seconds are read later, with every other pending
    block of the step (:meth:`CudaEventSource.resolve`).

    Reading :attr:`seconds` before then resolves at once (a host wait); consumers that can
    wait register :meth:`then` instead."""

    __slots__ = ("_callbacks", "_events", "_source", "_value")
    deferred = True

    def __init__(self, source: CudaEventSource) -> None:
        self._source = source
        self._events = None
        self._value = None
        self._callbacks: list = []

    @property
    def resolved(self) -> bool:
        return self._value is not None

    @property
    def seconds(self) -> float:
        if self._value is None:
            self._source.resolve()
        return self._value if self._value is not None else 0.0

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._set(float(value))

    def then(self, callback) -> None:
        """Call ``callback(seconds)`` once the block's time is known (now if it is)."""
        if self._value is not None:
            callback(self._value)
        else:
            self._callbacks.append(callback)

    def _set(self, value: float) -> None:
        self._value = max(0.0, value)
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self._value)


class CudaEventSource(ComputeSource):
    """GPU time of the block's kernels from two CUDA events on the current CuPy stream.

    Nothing waits when a block ends: its events are read once per step
    (:meth:`new_step`, or the first time a block's seconds are needed before then), after one
    host wait for the last end event, since every earlier event of the stream has completed
    by then.  A step of ``n`` timed blocks costs one host sync, not ``n``.  Measurements are
    :class:`DeferredMeasurement`; the clock (:class:`simulation.clock.SimClock`) files their
    seconds when they are read."""

    name = "cuda_events"
    deferred = True

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415

        self._cp = cupy
        self._pending: list[DeferredMeasurement] = []
        self.reads = 0          # host waits taken to read events (for the sync accounting)

    @contextmanager
    def measure(self, flops: float | None = None, nbytes: float | None = None,
                label: str | None = None):
        cp = self._cp
        m = DeferredMeasurement(self)
        start = cp.cuda.Event()
        start.record()
        try:
            yield m
        finally:
            end = cp.cuda.Event()
            end.record()
            m._events = (start, end)
            self._pending.append(m)

    def resolve(self) -> None:
        """Read every pending block's time after one host wait for the last end event."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        last = pending[-1]._events[1]
        if not last.done:
            last.synchronize()
        self.reads += 1
        for m in pending:
            start, end = m._events
            if not end.done:          # recorded on another stream: wait for it too
                end.synchronize()
            m._set(self._cp.cuda.get_elapsed_time(start, end) * 1e-3)

    def new_step(self) -> None:
        self.resolve()


class FlopSource(ComputeSource):
    """Roofline time from FLOP (and byte) counts: ``max(flops / (device_tflops 1e12),
    nbytes / (device_gbs 1e9))``; blocks without a FLOP count are measured by ``fallback``
    (default :class:`CpuTimeSource`) and summed in :attr:`fallback_s`."""

    def __init__(self, device_tflops: float, device_gbs: float | None = None,
                 fallback: ComputeSource | None = None) -> None:
        if not (isinstance(device_tflops, (int, float)) and math.isfinite(device_tflops)
                and device_tflops > 0):
            raise ValueError(f"--device-tflops must be a finite number > 0, got {device_tflops!r}")
        if device_gbs is not None and not (math.isfinite(device_gbs) and device_gbs > 0):
            raise ValueError(f"--device-gbs must be a finite number > 0, got {device_gbs!r}")
        self.device_tflops = float(device_tflops)
        self.device_gbs = None if device_gbs is None else float(device_gbs)
        self.fallback = fallback or CpuTimeSource()
        self.fallback_s = 0.0
        self.fallback_blocks = 0
        self.name = "flops"

    def seconds(self, flops: float, nbytes: float | None = None) -> float:
        s = float(flops) / (self.device_tflops * 1e12)
        if nbytes is not None and self.device_gbs is not None:
            s = max(s, float(nbytes) / (self.device_gbs * 1e9))
        return s

    @contextmanager
    def measure(self, flops: float | None = None, nbytes: float | None = None,
                label: str | None = None):
        if flops is None:
            with self.fallback.measure() as m:
                yield m
            self.fallback_s += m.seconds
            self.fallback_blocks += 1
            return
        m = self.Measurement()
        yield m
        m.seconds = self.seconds(flops, nbytes)

    def describe(self) -> str:
        mem = "" if self.device_gbs is None else f", {self.device_gbs:g} GB/s"
        return (f"flops ({self.device_tflops:g} TFLOP/s{mem}); blocks without a FLOP count: "
                f"{self.fallback.describe()}, {self.fallback_blocks} blocks, "
                f"{self.fallback_s:.6g} s")




class CalibratedSource(ComputeSource):
    """Per-event cost calibrated from the run itself: the first ``samples`` blocks with the same
    ``label`` are measured by ``base`` (default :class:`CpuTimeSource`) and every block of that
    label then costs the least of them (a quiet profiling pass, taken in place).
    The minimum drops warm-up (first-call allocation, page faults) and interference bursts;
    blocks without a label are measured every time."""

    def __init__(self, base: ComputeSource | None = None, samples: int = 5) -> None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"calibration samples must be an integer >= 1, got {samples!r}")
        self.base = base or CpuTimeSource()
        self.samples = samples
        self._seen: dict[str, list[float]] = {}
        self.name = f"calibrated_{self.base.name}"

    @contextmanager
    def measure(self, flops: float | None = None, nbytes: float | None = None,
                label: str | None = None):
        seen = self._seen.get(label) if label is not None else None
        if seen is not None and len(seen) >= self.samples:
            m = self.Measurement()
            yield m
            m.seconds = min(seen)
            return
        with self.base.measure(flops, nbytes, label) as m:
            yield m
        if label is not None:
            self._seen.setdefault(label, []).append(m.seconds)
            m.seconds = min(self._seen[label])

    def describe(self) -> str:
        return (f"calibrated: least of the first {self.samples} measurements per event by "
                f"{self.base.describe()}; {len(self._seen)} events")


def resolve_pending(source) -> None:
    """Read the pending measurements of ``source`` (or of the source it wraps) now: before
    code inspects the open step's event seconds (one host wait on a GPU, nothing otherwise)."""
    seen = set()
    while source is not None and id(source) not in seen:
        seen.add(id(source))
        fn = getattr(source, "resolve", None)
        if fn is not None:
            fn()
        source = getattr(source, "base", None) or getattr(source, "fallback", None) or \
            getattr(source, "source", None)
