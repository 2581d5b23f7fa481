"""The strict CuPy stand-in: NumPy arrays behind CuPy's rules, with every host sync counted.

What it enforces (as CuPy does, or stricter where a real GPU would give wrong data silently):

* **no implicit host conversion**: ``numpy.asarray(a)`` raises ``TypeError``; ``float(a)``,
  ``int(a)``, ``bool(a)``, ``a.item()``, ``a.tolist()``, ``repr(a)``, ``a.get()`` and
  ``cupy.asnumpy(a)`` work and are **counted as host syncs**;
* **no mixing with NumPy arrays**: a ufunc, operator or CuPy function given a
  ``numpy.ndarray`` raises ``TypeError`` (scalars are fine); ``cupy.asarray`` / ``cupy.array``
  are the explicit host-to-device copies (counted as transfers, not syncs);
* **reductions return 0-d device arrays**, not Python scalars (``cupy.sum``, ``a.max()``,
  ``cupy.count_nonzero``, ``a[3]``), so reading one on the host is a counted sync;
* **calls that synchronize inside CuPy are counted** where CuPy syncs: boolean-mask indexing,
  ``nonzero`` / ``flatnonzero`` / ``argwhere`` / ``where(cond)`` / ``unique`` / ``compress`` (one
  each), ``bincount`` (two: its non-negativity check and its length);
* **devices**: ``STRICTCUPY_DEVICES`` physical devices (default 1), narrowed by
  ``CUDA_VISIBLE_DEVICES`` as CUDA does; every array remembers its device, and an operation
  run on a thread whose current device differs raises like CuPy;
* **streams and events**: kernels run eagerly, but copies that CuPy runs asynchronously
  (``ndarray.get(out=, stream=, blocking=False)``, ``ndarray.set(pinned, stream=)``) are
  *deferred*: a device-to-host copy lands in host memory only when its stream (or an event
  after it) is synchronized, and a host-to-device copy from pinned memory reads its source
  only then, or when the stream issues its next operation, or when another stream waits on an
  event after it.  Code that reads a staging buffer too early, or reuses one too soon, gets
  wrong data, as on a GPU.  ``Stream.done`` / ``Event.done`` report only what a sync has
  completed (a pessimistic device: nothing finishes on its own);
* **cross-stream order**: an asynchronous copy into or out of an array raises unless its
  stream is ordered after the array's last write on another stream (same stream, that stream
  synchronized since, an event after the write waited for, or the legacy default stream's
  implicit order): kernels run eagerly here, so such a race would otherwise pass unseen;
* **CUDA-aware hand-off**: ``__cuda_array_interface__`` (what mpi4py reads) refuses memory
  whose last writer stream has not been synchronized since the write.

Counters live in :data:`counter` (``cupy._strict``): host syncs by kind, by call site and by
thread, bytes moved each way, pinned allocations.
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
import threading
import time
import weakref
from collections import Counter

import numpy as _np

_HERE = os.path.dirname(os.path.abspath(__file__))
_STRICT_DIR = os.path.dirname(_HERE)


class CUDARuntimeError(RuntimeError):
    """The stand-in's ``cupy.cuda.runtime.CUDARuntimeError``."""


# -- counters -----------------------------------------------------------------------------------------

def _site(depth: int = 2) -> str:
    """``module:function`` of the first caller outside the stand-in."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_STRICT_DIR):
        f = f.f_back
    if f is None:
        return "?"
    mod = f.f_globals.get("__name__", "?")
    return f"{mod}:{getattr(f.f_code, 'co_qualname', f.f_code.co_name)}"


class StrictCounter:
    """Host syncs and transfers of this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.syncs = 0
            self.main_syncs = 0
            self.by_kind: Counter = Counter()
            self.by_site: Counter = Counter()
            self.by_thread: Counter = Counter()
            self.d2h_bytes = 0
            self.h2d_bytes = 0
            self.d2h_copies = 0
            self.h2d_copies = 0
            self.pinned_allocs = 0
            self.pinned_bytes = 0

    def sync(self, kind: str, n: int = 1) -> None:
        site = _site(3)
        th = threading.current_thread()
        main = th is threading.main_thread()
        with self._lock:
            self.syncs += n
            if main:
                self.main_syncs += n
            self.by_kind[kind] += n
            self.by_site[f"{site} [{kind}]"] += n
            self.by_thread["main" if main else th.name] += n

    def d2h(self, nbytes: int) -> None:
        with self._lock:
            self.d2h_bytes += int(nbytes)
            self.d2h_copies += 1

    def h2d(self, nbytes: int) -> None:
        with self._lock:
            self.h2d_bytes += int(nbytes)
            self.h2d_copies += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"syncs": self.syncs, "main_syncs": self.main_syncs,
                    "by_kind": dict(self.by_kind), "by_site": dict(self.by_site),
                    "by_thread": dict(self.by_thread),
                    "d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes,
                    "d2h_copies": self.d2h_copies, "h2d_copies": self.h2d_copies,
                    "pinned_allocs": self.pinned_allocs, "pinned_bytes": self.pinned_bytes}


counter = StrictCounter()


# -- devices ------------------------------------------------------------------------------------------

def _physical_devices() -> list[int]:
    """Physical device ids this process sees, in ordinal order (``CUDA_VISIBLE_DEVICES``)."""
    n = int(os.environ.get("STRICTCUPY_DEVICES", "1"))
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return list(range(n))
    out = []
    for tok in vis.split(","):
        tok = tok.strip()
        if not tok:
            continue
        if not tok.lstrip("-").isdigit() or int(tok) < 0 or int(tok) >= n:
            break                      # CUDA stops at the first invalid entry
        out.append(int(tok))
    return out


_tls = threading.local()


def _current_device() -> int:
    return getattr(_tls, "device", 0)


def _check_device(arrays) -> None:
    cur = _current_device()
    for a in arrays:
        if a._dev != cur:
            raise ValueError(f"Array device must be same as the current device: array device = "
                             f"{a._dev} while current = {cur}")


# -- streams and events ---------------------------------------------------------------------------------

_seq = itertools.count(1)


class Stream:
    """A CUDA stream: ops are stamped with a sequence number; deferred copies wait here."""

    null = None  # set below

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.is_null = bool(null)
        self.non_blocking = non_blocking
        self.last = 0          # sequence number of the last op issued on this stream
        self.last_op = 0       # ... of the last kernel or copy (events are not ops)
        self.synced = 0        # every op with a sequence number <= this has completed
        self.pending: list = []  # deferred copies: (seq, kind "h2d"|"d2h", fn)
        self._lock = threading.RLock()
        self.device_id = _current_device()
        self._prev: list = []
        self.deps: list = []     # (stream, seq) this stream waits for (wait_event)
        self.waited: dict = {}   # id(stream) -> (stream, latest event seq waited for)

    @property
    def ptr(self) -> int:
        return 0 if self.is_null else id(self)

    def _stamp(self, op: bool = True) -> int:
        s = next(_seq)
        with self._lock:
            self.last = s
            if op:
                self.last_op = s
        return s

    def _flush(self, upto: int | None = None, kinds=("h2d",)) -> None:
        """Run deferred copies of ``kinds`` with sequence numbers <= ``upto`` (all by default).
        Device consumers need the host-to-device copies; a device-to-host copy lands in host
        memory only when the host learns the stream got there (``_complete``)."""
        with self._lock:   # held while the copies run: a concurrent flush waits for them
            keep, run = [], []
            for item in self.pending:
                s, kind, _ = item
                (run if (upto is None or s <= upto) and kind in kinds else keep).append(item)
            self.pending = keep
            for _, _, fn in run:
                fn()

    def _complete(self, upto: int) -> None:
        self._resolve_deps(True, upto)
        self._flush(upto, ("h2d", "d2h"))
        with self._lock:
            self.synced = max(self.synced, upto)

    def synchronize(self) -> None:
        counter.sync("stream.synchronize")
        self._complete(self.last)

    @property
    def done(self) -> bool:
        """Non-blocking query: true only when a sync has completed every op issued."""
        return self.synced >= self.last_op

    def record(self, event: Event | None = None) -> Event:
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        """Later ops on this stream come after ``event``: the deferred copies before it run
        when this stream next runs an op (or completes), not before."""
        if event.stream is not None and event.stream is not self:
            pos = self._stamp(op=False)
            with self._lock:
                self.deps.append((pos, event.stream, event.seq))
                prev = self.waited.get(id(event.stream))
                if prev is None or prev[1] < event.seq:
                    self.waited[id(event.stream)] = (event.stream, event.seq)

    def after(self, other: Stream, seq: int) -> bool:
        """Whether work issued on this stream now runs after ``other``'s op ``seq``: the same
        stream, ``other`` synchronized past it, an event after it waited for, or CUDA's legacy
        default stream ordering the null stream and the blocking streams."""
        if other is self or other.synced >= seq:
            return True
        waited = self.waited.get(id(other))
        if waited is not None and waited[1] >= seq:
            return True
        return (other.is_null and not self.non_blocking) or \
            (self.is_null and not other.non_blocking)

    def _resolve_deps(self, complete: bool, upto: int | None = None) -> None:
        with self._lock:
            run = [d for d in self.deps if upto is None or d[0] <= upto]
        # resolved before they leave the list: a concurrent resolver runs them too (the
        # other stream's flush is idempotent and waits for one in progress)
        for _, other, seq in run:
            if complete:
                other._complete(seq)
            else:
                other._flush(seq)
        if run:
            with self._lock:
                self.deps = [d for d in self.deps if d not in run]

    def use(self) -> Stream:
        _tls.stream = self
        return self

    def __enter__(self) -> Stream:  # noqa: PYI034 (CuPy's Stream.__enter__ returns the stream)
        self._prev.append(getattr(_tls, "stream", None))
        _tls.stream = self
        return self

    def __exit__(self, *exc) -> None:
        _tls.stream = self._prev.pop()

    def __repr__(self) -> str:
        return f"<strictcupy Stream {'null' if self.is_null else hex(id(self))}>"


Stream.null = Stream(null=True)


def get_current_stream(device_id=None) -> Stream:
    return getattr(_tls, "stream", None) or Stream.null


class Event:
    """A CUDA event: records a stream position and the host time of recording."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.stream: Stream | None = None
        self.seq = 0
        self.op_seq = 0
        self.t = None
        self.disable_timing = disable_timing

    def record(self, stream: Stream | None = None) -> None:
        st = stream if stream is not None else get_current_stream()
        self.stream = st
        self.op_seq = st.last_op        # the event completes when these ops have
        self.seq = st._stamp(op=False)
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        counter.sync("event.synchronize")
        if self.stream is not None:
            self.stream._complete(self.seq)

    @property
    def done(self) -> bool:
        return self.stream is None or self.stream.synced >= self.op_seq


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two completed events (raises like CUDA when one is not)."""
    for ev in (start, end):
        if ev.t is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle: event not recorded")
        if not ev.done:
            raise CUDARuntimeError("cudaErrorNotReady: device not ready (the event has not "
                                   "completed: synchronize before reading its time)")
    return (end.t - start.t) * 1e3


# -- write stamps (the CUDA-aware hand-off and cross-stream order checks) ---------------------------------

_stamps_lock = threading.Lock()
#: id(root) -> (weakref to root, [(lo, hi, stream, seq), ...]): the byte ranges written last,
#: by stream (views of one allocation, e.g. DDP's buckets, are written independently)
_writes: dict = {}
#: ranges kept per allocation (oldest dropped first)
MAX_WRITES = 256


def _span(x: _np.ndarray) -> tuple[int, int]:
    """Address range ``[lo, hi)`` a (possibly strided) array touches."""
    if x.size == 0:
        return 0, 0
    lo = hi = x.__array_interface__["data"][0]
    for n, stride in zip(x.shape, x.strides):
        d = (n - 1) * stride
        if d < 0:
            lo += d
        else:
            hi += d
    return lo, hi + x.itemsize


def _record_write(r, ref, a: _np.ndarray, st: Stream, seq: int) -> None:
    """Under ``_stamps_lock``: ``a`` (a view of root ``r``) written on ``st`` at ``seq``."""
    lo, hi = _span(a)
    ent = _writes.get(id(r))
    if ent is None or ent[0]() is not r:
        ent = _writes[id(r)] = (ref, [])
    keep = [w for w in ent[1] if w[2].synced < w[3] and
            not (w[2] is st and lo <= w[0] and w[1] <= hi)]
    keep.append((lo, hi, st, seq))
    ent[1][:] = keep[-MAX_WRITES:]


def _root(a: _np.ndarray):
    r = a
    while isinstance(r, _np.ndarray) and r.base is not None:
        r = r.base
    return r


def _stamp_write(arrs) -> None:
    st = get_current_stream()
    seq = st._stamp()
    with _stamps_lock:
        for a in arrs:
            r = _root(a._a)
            try:
                ref = weakref.ref(r)
            except TypeError:
                continue
            _record_write(r, ref, a._a, st, seq)


def _order_before_op(st: Stream) -> None:
    """An op on ``st`` runs after the host-to-device copies issued on it before, and (CUDA's
    legacy default stream) the null stream and the blocking streams wait for each other."""
    st._resolve_deps(False)
    st._flush()
    if st.is_null:
        for other in _all_streams():
            if other is not st and not other.non_blocking:
                other._flush()
    elif not st.non_blocking:
        Stream.null._flush()


def _check_stream_order(a, st: Stream, what: str) -> None:
    """An asynchronous copy on ``st`` that touches ``a`` must run after ``a``'s last write on
    another stream: on a GPU the two race (a copy into a buffer landing before, and being
    overwritten by, an upload still queued on the compute stream)."""
    for writer, seq in _writes_over(a):
        if not st.after(writer, seq):
            raise RuntimeError(f"strictcupy: {what} on {st!r} is not ordered after the last "
                               f"write to the same memory on {writer!r} (record an event after "
                               "the write and make the copy's stream wait for it)")


def _writes_over(a) -> list:
    """``(stream, seq)`` of the recorded writes that touch ``a``'s memory."""
    r = _root(a._a)
    lo, hi = _span(a._a)
    with _stamps_lock:
        ent = _writes.get(id(r))
        writes = list(ent[1]) if ent is not None and ent[0]() is r else []
    return [(writer, seq) for wlo, whi, writer, seq in writes if wlo < hi and lo < whi]


def _unsynced_writer(a) -> Stream | None:
    """A stream that wrote ``a``'s memory and has not been synchronized since, else None."""
    return next((st for st, seq in _writes_over(a) if st.synced < seq), None)


# -- pinned memory ---------------------------------------------------------------------------------------

class PinnedMemory(bytearray):
    """Page-locked host memory (a bytearray the stand-in can recognise)."""


class PinnedMemoryPointer:
    """``cupy.cuda.alloc_pinned_memory``'s result: supports the buffer protocol (via ``mem``)."""

    def __init__(self, size: int) -> None:
        self.mem = PinnedMemory(max(int(size), 1))
        self.size = int(size)
        with counter._lock:
            counter.pinned_allocs += 1
            counter.pinned_bytes += self.size

    @property
    def ptr(self) -> int:
        return _np.frombuffer(self.mem, _np.uint8).ctypes.data

    def __buffer__(self, flags):  # Python 3.12+
        return memoryview(self.mem)

    def __len__(self) -> int:
        return self.size


def alloc_pinned_memory(size: int):
    """Pinned host memory: pass the result to ``numpy.frombuffer``."""
    return PinnedMemoryPointer(size).mem


def is_pinned(a) -> bool:
    if not isinstance(a, _np.ndarray):
        return False
    r = _root(a)
    if isinstance(r, memoryview):
        r = r.obj
    return isinstance(r, PinnedMemory)


# -- arrays ----------------------------------------------------------------------------------------------

_REFUSE_NUMPY = ("Unsupported type <class 'numpy.ndarray'>: CuPy does not mix with NumPy arrays; "
                 "convert with cupy.asarray() (host to device) or .get() (device to host)")


def _is_np_array(x) -> bool:
    return isinstance(x, _np.ndarray)


def _unwrap(x, fakes: list, allow_numpy: bool = False):
    """NumPy data of ``x`` (recursively through lists/tuples/dicts); refuses NumPy arrays."""
    if isinstance(x, ndarray):
        fakes.append(x)
        return x._a
    if _is_np_array(x):
        if allow_numpy:
            return x
        raise TypeError(_REFUSE_NUMPY)
    if isinstance(x, (list, tuple)):
        vals = [_unwrap(v, fakes, allow_numpy) for v in x]
        return type(x)(vals) if isinstance(x, list) else tuple(vals)
    if isinstance(x, dict):
        return {k: _unwrap(v, fakes, allow_numpy) for k, v in x.items()}
    if isinstance(x, _SparseBase):
        raise TypeError("a cupyx sparse matrix cannot be passed here")
    return x


def _wrap(x, dev: int | None = None):
    if isinstance(x, _np.ndarray):
        return ndarray._from(x, dev)
    if isinstance(x, _np.generic):
        return ndarray._from(_np.asarray(x), dev)
    if isinstance(x, tuple):
        return tuple(_wrap(v, dev) for v in x)
    if isinstance(x, list):
        return [_wrap(v, dev) for v in x]
    return x


def _wrap_result(res, fakes, out_map=None):
    """Wrap ``res``; an array that *is* one of the inputs' data returns that input."""
    if isinstance(res, _np.ndarray):
        for f in fakes:
            if f._a is res:
                return f
        if out_map is not None and id(res) in out_map:
            return out_map[id(res)]
    if isinstance(res, tuple):
        return tuple(_wrap_result(r, fakes, out_map) for r in res)
    if isinstance(res, list):
        return [_wrap_result(r, fakes, out_map) for r in res]
    return _wrap(res)


def _outs(kwargs, fakes_out: list):
    out = kwargs.get("out")
    if out is None:
        return
    if isinstance(out, tuple):
        for o in out:
            if isinstance(o, ndarray):
                fakes_out.append(o)
            elif _is_np_array(o):
                raise TypeError(_REFUSE_NUMPY)
    elif isinstance(out, ndarray):
        fakes_out.append(out)
    elif _is_np_array(out):
        raise TypeError(_REFUSE_NUMPY)


def _call(fn, args, kwargs, *, allow_numpy=False, no_kernel=False, owner=None):
    fakes: list = [] if owner is None else [owner]
    outs: list = []
    _outs(kwargs, outs)
    a = _unwrap(args, fakes, allow_numpy)
    k = _unwrap(kwargs, fakes, allow_numpy)
    _check_device(fakes)
    if not no_kernel:
        _order_before_op(get_current_stream())
    res = fn(*a, **k)
    wrapped = _wrap_result(res, fakes + outs)
    written = list(outs)
    roots = {id(_root(f._a)) for f in fakes}
    fresh = [wrapped] if isinstance(wrapped, ndarray) else \
        [w for w in wrapped if isinstance(w, ndarray)] if isinstance(wrapped, (tuple, list)) \
        else []
    # a new array is written by a kernel (a view of an input, or an empty allocation, is not)
    written += [w for w in fresh if id(_root(w._a)) not in roots and not no_kernel]
    if written:
        _stamp_write(written)
    return wrapped


def _is_bool_index(ix) -> bool:
    if isinstance(ix, ndarray):
        return ix.dtype == _np.bool_ and ix.ndim > 0
    if isinstance(ix, _np.ndarray):
        return ix.dtype == _np.bool_ and ix.ndim > 0
    return False


def _index(key, fakes):
    """NumPy index from ``key``: device index arrays unwrapped; NumPy index arrays allowed (CuPy
    copies them to the device); a boolean mask is a sync (CuPy counts its ``True`` entries)."""
    parts = key if isinstance(key, tuple) else (key,)
    if any(_is_bool_index(p) for p in parts):
        counter.sync("boolean mask")
    out = []
    for p in parts:
        if isinstance(p, ndarray):
            fakes.append(p)
            out.append(p._a)
        elif isinstance(p, (list, _np.ndarray)):
            out.append(_np.asarray(p))
        else:
            out.append(p)
    return tuple(out) if isinstance(key, tuple) else out[0]


class _Flags:
    def __init__(self, a: _np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = a.base is None

    def __getitem__(self, k):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[k]


class MemoryPointer:
    def __init__(self, a: _np.ndarray) -> None:
        self.ptr = a.ctypes.data if a.size else 0


#: ndarray methods that write into the array
_INPLACE_METHODS = {"fill", "sort", "put", "partition", "setflags", "resize", "itemset"}
#: ndarray methods that synchronize (host values)
_SYNC_METHODS = {"nonzero": "nonzero", "compress": "compress", "tobytes": "tobytes",
                 "tofile": "tofile", "dump": "dump", "dumps": "dumps"}


class ndarray:
    """A device array of the stand-in (NumPy data, CuPy's rules)."""

    __array_priority__ = 100
    __slots__ = ("__weakref__", "_a", "_dev")

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C") -> None:
        self._a = _np.empty(shape, dtype=dtype, order=order)
        self._dev = _current_device()

    @classmethod
    def _from(cls, a: _np.ndarray, dev: int | None = None) -> ndarray:
        obj = cls.__new__(cls)
        obj._a = a
        obj._dev = _current_device() if dev is None else dev
        return obj

    # -- attributes ---------------------------------------------------------------------------
    @property
    def shape(self):
        return self._a.shape

    @shape.setter
    def shape(self, v):
        self._a.shape = v

    dtype = property(lambda s: s._a.dtype)
    size = property(lambda s: s._a.size)
    ndim = property(lambda s: s._a.ndim)
    itemsize = property(lambda s: s._a.itemsize)
    nbytes = property(lambda s: s._a.nbytes)
    strides = property(lambda s: s._a.strides)
    flags = property(lambda s: _Flags(s._a))
    data = property(lambda s: MemoryPointer(s._a))

    @property
    def device(self) -> Device:
        return Device(self._dev)

    @property
    def base(self):
        return None if self._a.base is None else ndarray._from(self._a.base, self._dev)

    @property
    def T(self) -> ndarray:
        return ndarray._from(self._a.T, self._dev)

    @property
    def real(self):
        return ndarray._from(self._a.real, self._dev)

    @property
    def imag(self):
        return ndarray._from(self._a.imag, self._dev)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr, self._dev)
        if name in _SYNC_METHODS:
            counter.sync(_SYNC_METHODS[name])

        def method(*args, **kwargs):
            res = _call(attr, args, kwargs, owner=self)
            if name in _INPLACE_METHODS:
                _stamp_write([self])
            return res

        return method

    # -- the host boundary -------------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __cuda_array_interface__get(self):
        st = _unsynced_writer(self)
        if st is not None:
            # mpi4py turns any error here into "expecting buffer": say it on stderr too
            sys.stderr.write("strictcupy: device memory handed over through the CUDA array "
                             "interface before its writer stream was synchronized\n")
            raise RuntimeError("strictcupy: device memory handed over (CUDA array interface, "
                               "e.g. to a CUDA-aware MPI) before the stream that wrote it was "
                               f"synchronized ({st!r})")
        if not self._a.flags.c_contiguous:
            raise ValueError("strictcupy: CUDA array interface of a non-contiguous array")
        return {"shape": self._a.shape, "typestr": self._a.dtype.str,
                "data": (self._a.ctypes.data if self._a.size else 0, False), "version": 3,
                "strides": None, "stream": None}

    __cuda_array_interface__ = property(__cuda_array_interface__get)

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Device to host.  ``blocking=False`` with ``out`` (pinned) defers the copy to the
        stream's next sync (as the asynchronous copy CuPy issues)."""
        if out is not None:
            if not isinstance(out, _np.ndarray) or out.shape != self._a.shape:
                raise ValueError("get(out=): a NumPy array of the same shape is needed")
            if out.dtype != self._a.dtype:
                raise TypeError("get(out=): dtype mismatch")
        if not blocking:
            if out is None or not is_pinned(out):
                raise ValueError("strictcupy: get(blocking=False) needs out= in pinned memory")
            st = stream if stream is not None else get_current_stream()
            _check_stream_order(self, st, "an asynchronous device-to-host copy")
            _order_before_op(st)
            snap = self._a.copy()          # stream order: what the copy reads is fixed now
            counter.d2h(self._a.nbytes)

            def land(out=out, snap=snap):
                _np.copyto(out, snap)

            seq = st._stamp()
            with st._lock:
                st.pending.append((seq, "d2h", land))
            return out
        counter.sync("get")
        counter.d2h(self._a.nbytes)
        st = stream if stream is not None else get_current_stream()
        st._complete(st.last)
        if out is None:
            return _np.array(self._a, copy=True, order=order)
        _np.copyto(out, self._a)
        return out

    def set(self, arr, stream=None):
        """Host to device.  From pinned memory the copy is asynchronous: it reads ``arr``
        when the stream next runs an op or is synchronized."""
        if not isinstance(arr, _np.ndarray):
            raise TypeError("set() takes a numpy.ndarray")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("set(): shape/dtype mismatch")
        counter.h2d(arr.nbytes)
        st = stream if stream is not None else get_current_stream()
        if is_pinned(arr):
            _check_stream_order(self, st, "an asynchronous host-to-device copy")
            dst = self._a

            def land(dst=dst, arr=arr):
                _np.copyto(dst, arr)

            seq = st._stamp()
            with st._lock:
                st.pending.append((seq, "h2d", land))
            with _stamps_lock:
                r = _root(self._a)
                _record_write(r, weakref.ref(r), self._a, st, seq)
            return
        with st:
            _np.copyto(self._a, arr)
            _stamp_write([self])

    def item(self):
        counter.sync("item")
        return self._a.item()

    def tolist(self):
        counter.sync("tolist")
        return self._a.tolist()

    def __float__(self):
        counter.sync("float()")
        return float(self._a)

    def __int__(self):
        counter.sync("int()")
        return int(self._a)

    def __complex__(self):
        counter.sync("complex()")
        return complex(self._a)

    def __bool__(self):
        counter.sync("bool()")
        return bool(self._a)

    def __index__(self):
        counter.sync("index")
        return operator.index(self._a)

    def __repr__(self):
        counter.sync("repr")
        return "strictcupy." + repr(self._a)

    def __str__(self):
        counter.sync("str")
        return str(self._a)

    def __format__(self, spec):
        counter.sync("format")
        return format(self._a, spec) if self._a.ndim == 0 else format(str(self._a), spec)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        for i in range(self._a.shape[0]):
            yield ndarray._from(self._a[i], self._dev) if self._a.ndim > 1 else \
                ndarray._from(self._a[i:i + 1].reshape(()), self._dev)

    def __contains__(self, v):
        counter.sync("in")
        return v in self._a

    __hash__ = None

    def __reduce__(self):
        raise TypeError("strictcupy: pickling a device array copies it to the host: use .get()")

    # -- indexing -------------------------------------------------------------------------------
    def __getitem__(self, key):
        fakes: list = [self]
        ix = _index(key, fakes)
        _check_device(fakes)
        _order_before_op(get_current_stream())
        res = self._a[ix]
        return _wrap(res, self._dev) if isinstance(res, (_np.ndarray, _np.generic)) else res

    def __setitem__(self, key, value):
        fakes: list = [self]
        ix = _index(key, fakes)
        parts = ix if isinstance(ix, tuple) else (ix,)
        advanced = any(isinstance(p, _np.ndarray) for p in parts)
        if isinstance(value, ndarray):
            fakes.append(value)
            v = value._a
        elif _is_np_array(value):
            if value.ndim and not advanced:
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            counter.h2d(value.nbytes)
            v = value
        else:
            v = _unwrap(value, fakes)
        _check_device(fakes)
        _order_before_op(get_current_stream())
        self._a[ix] = v
        region = None if advanced else self._a[ix]     # basic indexing: the view written
        _stamp_write([ndarray._from(region, self._dev)
                      if isinstance(region, _np.ndarray) else self])

    # -- NumPy protocols --------------------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for x in inputs:
            if not isinstance(x, (ndarray, _np.ndarray, _np.generic, int, float, complex,
                                  bool)) and x is not None:
                return NotImplemented
        fn = getattr(ufunc, method)
        return _call(fn, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        mod = sys.modules[__package__]
        name = func.__name__
        impl = getattr(mod, name, None)
        if impl is None or not callable(impl):
            return NotImplemented
        return impl(*args, **kwargs)


def _binop(ufunc, reflected=False, inplace=False):
    def op(self, other):
        if isinstance(other, _SparseBase):
            return NotImplemented
        if not isinstance(other, (ndarray, _np.ndarray, _np.generic, int, float, complex, bool,
                                  list, tuple)):
            return NotImplemented
        if inplace:
            return _call(ufunc, (self, other), {"out": self})
        args = (other, self) if reflected else (self, other)
        return _call(ufunc, args, {})
    return op


for _name, _uf in {"add": _np.add, "sub": _np.subtract, "mul": _np.multiply,
                   "truediv": _np.true_divide, "floordiv": _np.floor_divide, "mod": _np.remainder,
                   "pow": _np.power, "and": _np.bitwise_and, "or": _np.bitwise_or,
                   "xor": _np.bitwise_xor, "lshift": _np.left_shift,
                   "rshift": _np.right_shift}.items():
    setattr(ndarray, f"__{_name}__", _binop(_uf))
    setattr(ndarray, f"__r{_name}__", _binop(_uf, reflected=True))
    setattr(ndarray, f"__i{_name}__", _binop(_uf, inplace=True))
for _name, _uf in {"lt": _np.less, "le": _np.less_equal, "gt": _np.greater,
                   "ge": _np.greater_equal, "eq": _np.equal, "ne": _np.not_equal}.items():
    setattr(ndarray, f"__{_name}__", _binop(_uf))


def _matmul(self, other):
    if isinstance(other, _SparseBase):
        return NotImplemented
    return _call(_np.matmul, (self, other), {})


def _rmatmul(self, other):
    if isinstance(other, _SparseBase):
        return NotImplemented
    return _call(_np.matmul, (other, self), {})


ndarray.__matmul__ = _matmul
ndarray.__rmatmul__ = _rmatmul
ndarray.__neg__ = lambda s: _call(_np.negative, (s,), {})
ndarray.__pos__ = lambda s: _call(_np.positive, (s,), {})
ndarray.__abs__ = lambda s: _call(_np.absolute, (s,), {})
ndarray.__invert__ = lambda s: _call(_np.invert, (s,), {})


# -- ufuncs and functions ------------------------------------------------------------------------------

class ufunc:
    """A CuPy ufunc over the stand-in's arrays (``__call__``, ``at``, ``reduce``,
    ``accumulate``, ``outer``)."""

    def __init__(self, np_ufunc) -> None:
        self._u = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __call__(self, *args, **kwargs):
        return _call(self._u, args, kwargs)

    def __getattr__(self, name):
        fn = getattr(self._u, name)
        if name in ("at", "reduce", "accumulate", "outer", "reduceat"):
            def method(*args, **kwargs):
                res = _call(fn, args, kwargs)
                if name == "at" and args and isinstance(args[0], ndarray):
                    _stamp_write([args[0]])
                return res
            return method
        return fn


#: functions CuPy runs with a host sync inside (count)
SYNCING = {"nonzero": 1, "flatnonzero": 1, "argwhere": 1, "unique": 1, "bincount": 2,
           "compress": 1, "extract": 1, "intersect1d": 1, "union1d": 1, "setdiff1d": 1}
#: NumPy returns a Python scalar, CuPy a 0-d array
SCALAR_TO_ARRAY = {"count_nonzero", "array_equal", "allclose", "array_equiv"}
#: allocations that launch no kernel (nothing to wait for before handing the memory over)
NO_KERNEL = {"empty", "empty_like"}
#: the explicit host-to-device conversions
CONVERT = {"array", "asarray", "asanyarray", "ascontiguousarray", "asfortranarray"}
#: NumPy functions CuPy does not have
MISSING = {"errstate", "seterr", "geterr", "set_printoptions", "frombuffer", "fromfile",
           "loadtxt", "savetxt", "genfromtxt", "add_newdoc"}


def _convert(name, fn):
    def conv(obj, *args, **kwargs):
        if isinstance(obj, ndarray):
            return _call(fn, (obj, *args), kwargs)
        data = fn(obj, *args, **kwargs)
        if isinstance(data, _np.ndarray):
            counter.h2d(data.nbytes)
            if data is obj or (isinstance(obj, _np.ndarray) and _np.shares_memory(data, obj)):
                data = data.copy()     # device memory never aliases host memory
        out = _wrap(data)
        _stamp_write([out])
        return out
    conv.__name__ = name
    return conv


def _function(name, fn):
    n_sync = SYNCING.get(name, 0)
    scalar = name in SCALAR_TO_ARRAY

    def f(*args, **kwargs):
        if name == "where" and len(args) + len(kwargs) == 1:
            counter.sync("where(cond)")
        elif n_sync:
            counter.sync(name, n_sync)
        if name == "repeat" and len(args) > 1 and isinstance(args[1], ndarray):
            raise TypeError("cupy.repeat: repeats must be an int, list or tuple")
        res = _call(fn, args, kwargs, no_kernel=name in NO_KERNEL)
        if scalar and not isinstance(res, ndarray):
            res = _wrap(_np.asarray(res))
        return res
    f.__name__ = name
    return f


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    """Device to host (a counted sync for a device array; NumPy arrays pass through)."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if isinstance(a, _SparseBase):
        return a.get()
    res = _np.asarray(a, order=order)
    if out is not None:
        _np.copyto(out, res)
        return out
    return res


def get_array_module(*args):
    for a in args:
        if isinstance(a, (ndarray, _SparseBase)):
            return sys.modules[__package__]
    return _np


def fuse(*args, **kwargs):
    if args and callable(args[0]) and len(args) == 1 and not kwargs:
        return args[0]
    return lambda fn: fn


class _NoKernel:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the strict CuPy stand-in cannot compile CUDA kernels "
                                  "(ElementwiseKernel / RawKernel); give the code a path "
                                  "built from CuPy array operations")


ElementwiseKernel = RawKernel = ReductionKernel = RawModule = _NoKernel


# -- devices API -----------------------------------------------------------------------------------------

class Device:
    """A device ordinal of this process (after ``CUDA_VISIBLE_DEVICES``)."""

    def __init__(self, device=None) -> None:
        self.id = _current_device() if device is None else int(device)
        self._prev: list = []

    def _check(self) -> None:
        n = len(_physical_devices())
        if not 0 <= self.id < n:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id} "
                                   f"({n} visible)")

    def use(self) -> None:
        self._check()
        _tls.device = self.id

    def __enter__(self):
        self._check()
        self._prev.append(_current_device())
        _tls.device = self.id
        return self

    def __exit__(self, *exc) -> None:
        _tls.device = self._prev.pop()

    def synchronize(self) -> None:
        counter.sync("device.synchronize")
        for st in list(_all_streams()):
            st._complete(st.last)

    @property
    def pci_bus_id(self) -> str:
        self._check()
        return f"0000:{_physical_devices()[self.id] + 1:02X}:00.0"

    @property
    def compute_capability(self) -> str:
        return "00"

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


_streams: weakref.WeakSet[Stream] = weakref.WeakSet()
_orig_stream_init = Stream.__init__


def _stream_init(self, *a, **k):
    _orig_stream_init(self, *a, **k)
    _streams.add(self)


Stream.__init__ = _stream_init
_streams.add(Stream.null)


def _all_streams():
    return list(_streams)


def reset_for_tests() -> None:
    """Forget every stream's pending work and stamps and zero the counters (tests)."""
    for st in _all_streams():
        st._complete(st.last)
    with _stamps_lock:
        _writes.clear()
    counter.reset()
    _tls.__dict__.clear()


# -- sparse (cupyx.scipy.sparse) ----------------------------------------------------------------------

class _SparseBase:
    """Marker base of the stand-in's sparse matrices."""


__all__ = [
    "CUDARuntimeError",
    "Device",
    "Event",
    "Stream",
    "alloc_pinned_memory",
    "asnumpy",
    "counter",
    "get_array_module",
    "get_elapsed_time",
    "ndarray",
    "ufunc",
]
