"""Array backend: NumPy on CPU, CuPy on GPU, and the one adapter that hands arrays to MPI.

The backend is chosen once per run (``--device cpu|gpu``).  Everything else receives ``xp``
(the array module) or asks :func:`array_module` which module owns an array.

Handing device arrays to MPI
----------------------------
A communication call stages each buffer it hands to MPI with :meth:`Backend.stage`, in three
moves that may run on different threads (a call issued without waiting runs on the
communication thread, :mod:`substrate.stream`):

``stage(arr, send=, recv=)`` (the issuing thread)
    records an event on the current (compute) stream: the point after which the data is
    ready; with a host-only MPI it also leases a pinned host block of its own from the
    backend's bounded :class:`StagingPool`;
``Staged.pull()`` (the thread that runs MPI)
    returns what MPI reads and writes: NumPy arrays as they are; device memory when the MPI
    library is CUDA-aware (``MPI.Query_cuda_support()``, overridable with
    ``SPARDIST_CUDA_AWARE=0|1``; every rank must agree, else all stage), once the ready event
    has completed; else the leased host block, filled (send side) by a copy on the backend's
    side stream and waited for: the one host sync a host-only MPI needs per buffer;
``Staged.push()`` (the thread that completes the call)
    copies what MPI received back to the device on the side stream, makes the compute stream
    wait for that copy (no host sync) and returns the block to the pool, fenced by the copy.

Send and receive buffers of one call are distinct leases, and a lease is never handed out
again before the call that holds it has finished with it (and the copy that reads it has
completed), so no two buffers in flight share host memory, whatever their shapes: the pool is
correct by construction.  It is bounded (``SPARDIST_PINNED_POOL_MIB``, default 256 MiB per
rank): blocks are reused by size class (powers of two from 4 KiB) and, at the bound, the
oldest fenced block of the class is waited for; a buffer larger than the whole pool is staged
through a one-off block (reported in :meth:`Backend.describe` as ``overflow``).

Exact-mode all-reduces of device buffers (:mod:`substrate.collectives`) reduce on the device:
each received chunk is copied up, added by CuPy on the side stream and the sum copied back for
the next send (:func:`~substrate.collectives.ring_allreduce_staged`).  A chunk smaller than
``SPARDIST_DEVICE_REDUCE_BYTES`` (default 64 KiB) is reduced on the host instead: there the
host adds of a small chunk cost less than the ``p - 1`` extra host waits a device reduction
needs, and the result is bitwise the same (an element-wise IEEE add in the same ring order).
"""

from __future__ import annotations

import itertools
import os
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

__all__ = [
    "Backend",
    "Staged",
    "StagingPool",
    "array_module",
    "cupy_available",
    "device_slot",
    "get_backend",
]

#: smallest pool block (bytes); blocks are powers of two from here
MIN_BLOCK = 4096
#: the host path's :meth:`Backend.side` (a ``nullcontext`` is reusable and reentrant)
_NO_CONTEXT = nullcontext()


def _import_cupy() -> ModuleType | None:
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # noqa: BLE001  ImportError, CUDARuntimeError without a driver, ...
        return None


def cupy_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    return _import_cupy() is not None


def array_module(arr) -> ModuleType:
    """Return ``numpy`` or ``cupy``, whichever owns ``arr`` (NumPy for anything else)."""
    mod = type(arr).__module__
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def _mpi_cuda_aware() -> bool:
    env = os.environ.get("SPARDIST_CUDA_AWARE")
    if env is not None:
        return env not in ("0", "", "false", "no")
    try:
        from mpi4py import MPI  # noqa: PLC0415

        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001  a library without the query: not CUDA-aware
        return False


def _env_bytes(name: str, default: int, unit: int = 1) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        val = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not val >= 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return int(val * unit)


def device_slot(local_index: int, visible: int) -> tuple[int, bool]:
    """Device ordinal of the ``local_index``-th rank among the ranks of a real node that see
    the same ``visible`` devices, and whether that device is shared (oversubscribed).

    Pure: the binding rule of :class:`substrate.topology.Topology` (ranks fill the devices in
    order, then wrap around)."""
    if visible < 1:
        raise ValueError("no CUDA device visible to this rank (CUDA_VISIBLE_DEVICES is empty "
                         "or names no device)")
    return local_index % visible, local_index >= visible


# -- the pinned staging pool ----------------------------------------------------------------------------

class _Block:
    __slots__ = ("fence", "host", "mem", "pooled", "size")

    def __init__(self, mem, size: int, pooled: bool) -> None:
        self.mem = mem
        self.host = np.frombuffer(mem, np.uint8, size)
        self.size = size
        self.fence = None          # (seq, event) of the last copy that reads this block
        self.pooled = pooled


class Lease:
    """A pinned host block held by one staged buffer until :meth:`StagingPool.release`."""

    __slots__ = ("block", "nbytes")

    def __init__(self, block: _Block, nbytes: int) -> None:
        self.block, self.nbytes = block, nbytes

    def array(self, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        return self.block.host[:n * dtype.itemsize].view(dtype).reshape(shape)


class StagingPool:
    """Bounded pool of pinned host blocks (see the module docstring).

    Parameters
    ----------
    alloc : callable
        ``alloc(nbytes)`` -> pinned memory supporting the buffer protocol.
    limit : int
        Bytes of pinned memory the pool may hold.
    fence_done : callable
        ``fence_done(fence)`` -> whether the copy a fence stands for has completed, without
        waiting; ``wait(fence)`` waits for it.
    """

    def __init__(self, alloc, limit: int, fence_done, wait) -> None:
        self._alloc = alloc
        self.limit = int(limit)
        self._done = fence_done
        self._wait = wait
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = {}
        self.held = 0            # pinned bytes held by the pool (pooled blocks)
        self.blocks = 0
        self.leased = 0
        self.peak_leased = 0
        self.acquires = 0
        self.allocations = 0
        self.overflow = 0
        self.fence_waits = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(MIN_BLOCK, 1 << max(0, int(nbytes) - 1).bit_length())

    def acquire(self, nbytes: int) -> Lease:
        """A block of at least ``nbytes`` no buffer in flight uses."""
        size = self.size_class(nbytes)
        with self._lock:
            self.acquires += 1
            free = self._free.setdefault(size, [])
            block = None
            for i, b in enumerate(free):
                if b.fence is None or self._done(b.fence):
                    block = free.pop(i)
                    break
            if block is None and self.held + size > self.limit and free:
                block = free.pop(0)                 # the oldest fenced block: wait for it
                self.fence_waits += 1
                self._wait(block.fence)
            if block is None:
                pooled = self.held + size <= self.limit
                if not pooled:                      # make room: drop idle blocks of other sizes
                    for lst in self._free.values():
                        while lst and self.held + size > self.limit:
                            b = lst.pop()
                            if b.fence is not None:
                                self._wait(b.fence)
                            self.held -= b.size
                            self.blocks -= 1
                    pooled = self.held + size <= self.limit
                block = _Block(self._alloc(size), size, pooled)
                self.allocations += 1
                if pooled:
                    self.held += size
                    self.blocks += 1
                else:
                    self.overflow += 1
            block.fence = None
            self.leased += size
            self.peak_leased = max(self.peak_leased, self.leased)
            return Lease(block, int(nbytes))

    def release(self, lease: Lease, fence=None) -> None:
        """Give ``lease`` back; ``fence`` is the copy that still reads it (reuse waits for it)."""
        b = lease.block
        with self._lock:
            self.leased -= b.size
            if not b.pooled:
                return                  # a one-off block: dropped (freed when collected)
            b.fence = fence
            self._free.setdefault(b.size, []).append(b)

    def describe(self) -> dict:
        with self._lock:
            return {"limit_bytes": self.limit, "held_bytes": self.held, "blocks": self.blocks,
                    "acquires": self.acquires, "allocations": self.allocations,
                    "peak_leased_bytes": self.peak_leased, "overflow": self.overflow,
                    "fence_waits": self.fence_waits}


# -- one buffer handed to MPI ------------------------------------------------------------------------

class Staged:
    """One buffer of one communication call on its way to MPI and back (module docstring)."""

    __slots__ = (
        "_fence",
        "_landed",
        "_pulled",
        "_staged",
        "arr",
        "backend",
        "host",
        "lease",
        "ready",
        "recv",
        "send",
    )

    def __init__(self, backend: Backend, arr, send: bool, recv: bool) -> None:
        self.backend, self.arr, self.send, self.recv = backend, arr, send, recv
        self.lease = self.host = self.ready = self._fence = None
        self._pulled = self._landed = self._staged = False
        if backend.name == "gpu" and array_module(arr) is not np:
            self.ready = backend.xp.cuda.get_current_stream().record()
            if not backend.cuda_aware:
                self._staged = True
                self.lease = backend.pool.acquire(arr.nbytes)
                self.host = self.lease.array(arr.dtype, arr.shape)

    @property
    def device(self) -> bool:
        return self.ready is not None

    def pull(self, lo: int | None = None, hi: int | None = None):
        """What MPI reads and writes; on the send side the data is there when this returns.
        ``lo:hi`` (flat elements) copies only that part of a staged buffer."""
        self._pulled = True
        if self.ready is None:
            return self.arr
        be = self.backend
        if self.host is None:                     # CUDA-aware: device memory, once complete
            be.wait_event(self.ready)
            return self.arr
        if self.send:
            src, dst = self.arr.reshape(-1), self.host.reshape(-1)
            if lo is not None:
                src, dst = src[lo:hi], dst[lo:hi]
            be.to_host(src, dst, after=self.ready)
        return self.host

    def land(self, lo: int | None = None, hi: int | None = None) -> None:
        """After MPI, on the thread that ran it: the received data copied back to the device
        on the side stream (so a later call on the same buffer, queued on the communication
        thread, reads it in stream order) and the lease returned, fenced by that copy.  The
        compute stream is ordered after the copy by :meth:`push`.  Idempotent."""
        if self.ready is None or self._landed:
            return
        self._landed = True
        if self.host is None:
            return
        if self.recv and self._pulled:
            dst, src = self.arr.reshape(-1), self.host.reshape(-1)
            if lo is not None:
                dst, src = dst[lo:hi], src[lo:hi]
            # after the compute-stream work on the buffer that preceded the call: a receive-only
            # buffer was never pulled through the side stream, and the copy must not land
            # before (and be overwritten by) a write still queued there, e.g. its upload
            self._fence = self.backend.to_device(src, dst, wait=False, after=self.ready)
        self.backend.pool.release(self.lease, self._fence)
        self.lease = self.host = None

    def push(self, lo: int | None = None, hi: int | None = None) -> None:
        """Complete the hand-off where the call completes (the issuing thread): :meth:`land`
        if the MPI thread did not, then the compute stream waits for the copy back (no host
        wait).  Idempotent."""
        if self.ready is None:
            return
        self.land(lo, hi)
        be = self.backend
        if self._fence is not None:
            be.compute_waits(self._fence)
        elif self.recv and self._pulled and not be.pool_staged(self):
            be.order_after_side()
        self.ready = self._fence = None


# -- the backend -------------------------------------------------------------------------------------

@dataclass
class Backend:
    """The array module of a run plus the MPI hand-off adapter.

    Parameters
    ----------
    name : {"cpu", "gpu"}
        ``cpu`` uses NumPy, ``gpu`` uses CuPy.
    gpu_index : int
        The rank's device slot from :class:`substrate.topology.Topology` (its place among the
        real node's ranks that see the same devices); the device used is that slot modulo the
        visible devices, and sharing one is reported (:attr:`oversubscribed`).
    """

    name: str = "cpu"
    gpu_index: int = 0
    xp: ModuleType = field(init=False, repr=False)
    cuda_aware: bool = field(init=False, default=False)
    device_id: int | None = field(init=False, default=None)
    oversubscribed: bool = field(init=False, default=False)
    pool: StagingPool | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self._side = None
        self._compute = None
        self._fence_seq = itertools.count(1)
        self._fences_done = 0
        self._lock = threading.Lock()
        self.reduce_on_device_bytes = _env_bytes("SPARDIST_DEVICE_REDUCE_BYTES", 64 << 10)
        if self.name == "cpu":
            self.xp = np
        elif self.name == "gpu":
            cp = _import_cupy()
            if cp is None:
                raise ValueError(
                    "--device gpu needs CuPy and a visible CUDA device; install the 'gpu' extra "
                    "(pip install 'spardist[gpu]') on a GPU node, or run with --device cpu"
                )
            n = cp.cuda.runtime.getDeviceCount()
            self.device_id, self.oversubscribed = device_slot(int(self.gpu_index), n)
            cp.cuda.Device(self.device_id).use()
            self.xp = cp
            self.cuda_aware = _mpi_cuda_aware()
            self._compute = cp.cuda.get_current_stream()
            self._side = cp.cuda.Stream(non_blocking=True)   # now: threads use it at once
            self.pool = StagingPool(cp.cuda.alloc_pinned_memory,
                                    _env_bytes("SPARDIST_PINNED_POOL_MIB", 256 << 20, 1 << 20),
                                    self._fence_done, self._fence_wait)
        else:
            raise ValueError(f"unknown device {self.name!r}: use --device cpu or --device gpu")

    @property
    def is_gpu(self) -> bool:
        return self.name == "gpu"

    def asarray(self, a, dtype=None):
        """Move ``a`` to this backend (no copy when it already lives there)."""
        return self.xp.asarray(a, dtype=dtype)

    def asnumpy(self, a) -> np.ndarray:
        """Return ``a`` as a NumPy array (device-to-host copy for CuPy)."""
        if array_module(a) is np:
            return np.asarray(a)
        return a.get()

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    # -- devices and streams --------------------------------------------------------------------
    @contextmanager
    def device(self):
        """This backend's device current on the calling thread (CuPy's current device is per
        thread: the communication thread must select it before touching device memory)."""
        if not self.is_gpu:
            yield
            return
        with self.xp.cuda.Device(self.device_id):
            yield

    @property
    def side_stream(self):
        """The non-blocking stream the staging copies and exact-mode reductions run on."""
        if self._side is None:
            with self.device():
                self._side = self.xp.cuda.Stream(non_blocking=True)
        return self._side

    def side(self):
        """Context: this device and the side stream current (work of the communication path)."""
        if self.name != "gpu":
            return _NO_CONTEXT
        return _Both(self.device(), self.side_stream)

    def wait_event(self, event) -> None:
        """The host waits for ``event`` (a host sync, skipped when it already completed)."""
        if not event.done:
            event.synchronize()

    def to_host(self, src, dst: np.ndarray, after=None) -> None:
        """Device ``src`` into pinned host ``dst`` on the side stream, after ``after`` (an event
        of the compute stream), and wait for it: one host sync."""
        side = self.side_stream
        with self.device():
            if after is not None:
                side.wait_event(after)
            src.get(out=dst, stream=side, blocking=False)
            self.sync_side()

    def sync_side(self) -> None:
        """The host waits for the side stream; every fence recorded before is then complete."""
        seq = next(self._fence_seq)
        self.side_stream.synchronize()
        with self._lock:
            self._fences_done = max(self._fences_done, seq)

    def to_device(self, src: np.ndarray, dst, wait: bool = True, after=None):
        """Pinned host ``src`` into device ``dst`` on the side stream, after ``after`` (an event
        of the compute stream: the copy lands after the work queued there before it); with
        ``wait`` the compute stream waits for the copy (no host sync; else
        :meth:`compute_waits` later).  Returns the fence of the copy (for the pool)."""
        side = self.side_stream
        with self.device():
            if after is not None:
                side.wait_event(after)
            dst.set(src, stream=side)
            ev = side.record()
        fence = (next(self._fence_seq), ev)
        if wait:
            self.compute_waits(fence)
        return fence

    def compute_waits(self, fence) -> None:
        """Work issued on the compute stream from now on runs after the copy ``fence``."""
        with self.device():
            self._compute.wait_event(fence[1])

    @staticmethod
    def pool_staged(staged: Staged) -> bool:
        return staged._staged

    def order_after_side(self) -> None:
        """The compute stream waits for everything issued on the side stream so far."""
        with self.device():
            self._compute.wait_event(self.side_stream.record())

    def _fence_done(self, fence) -> bool:
        seq, ev = fence
        with self._lock:
            if seq <= self._fences_done:
                return True
        return bool(ev.done)

    def _fence_wait(self, fence) -> None:
        fence[1].synchronize()

    # -- MPI hand-off -------------------------------------------------------------------------
    def stage(self, arr, *, send: bool = True, recv: bool = True) -> Staged:
        """Stage ``arr`` for one communication call (the module docstring); ``send``: MPI reads
        it, ``recv``: MPI writes it."""
        return Staged(self, arr, send, recv)

    def reduce_on_device(self, chunk_bytes: int) -> bool:
        """Whether an exact-mode ring all-reduce with chunks of ``chunk_bytes`` reduces on the
        device (host-only MPI; see the module docstring)."""
        return chunk_bytes >= self.reduce_on_device_bytes

    def pinned(self, shape, dtype) -> np.ndarray:
        """A pinned host array owned by the caller (persistent message buffers)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not self.is_gpu:
            return np.empty(shape, dtype=dtype)
        mem = self.xp.cuda.alloc_pinned_memory(max(n, 1))
        return np.frombuffer(mem, dtype, n // dtype.itemsize).reshape(shape)

    # -- description ------------------------------------------------------------------------------
    def device_info(self) -> dict:
        """This rank's device, for the binding record (``topology.devices`` of summary.json)."""
        if not self.is_gpu:
            return {"device": "cpu"}
        cp = self.xp
        d = cp.cuda.Device(self.device_id)
        try:
            pci = str(d.pci_bus_id)
        except Exception:  # noqa: BLE001  a driver without the attribute: no PCI id
            pci = None
        try:
            raw = cp.cuda.runtime.getDeviceProperties(self.device_id).get("name", b"")
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception:  # noqa: BLE001  no properties: no name
            name = None
        return {"device": "gpu", "slot": int(self.gpu_index), "ordinal": int(self.device_id),
                "visible_devices": int(cp.cuda.runtime.getDeviceCount()),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "pci_bus_id": pci, "name": name}

    def describe(self) -> dict:
        """The backend block of ``summary.json``: device, MPI hand-off, staging pool."""
        out = {"device": self.name}
        if self.is_gpu:
            out.update(cuda_aware=self.cuda_aware, device_id=self.device_id,
                       handoff=("device memory (CUDA-aware MPI)" if self.cuda_aware else
                                "pinned host staging, copies on a side stream"),
                       device_reduce_min_chunk_bytes=self.reduce_on_device_bytes,
                       staging=self.pool.describe())
        return out


class _Both:
    """Enter a device context and a stream context together."""

    def __init__(self, dev, stream) -> None:
        self.dev, self.stream = dev, stream

    def __enter__(self):
        self.dev.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.dev.__exit__(*exc)


_BACKENDS: dict[tuple[str, int], Backend] = {}


def get_backend(device: str = "cpu", gpu_index: int = 0) -> Backend:
    """Return the (cached) :class:`Backend` for ``device`` (``"cpu"`` or ``"gpu"``)."""
    key = (device, gpu_index)
    if key not in _BACKENDS:
        _BACKENDS[key] = Backend(device, gpu_index)
    return _BACKENDS[key]
