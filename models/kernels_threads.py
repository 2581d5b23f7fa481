"""The threads and GEMMs under the Numba kernels (:mod:`models.kernels`): :func:`parallel_for`
and :func:`matmul`.

Imported only through :mod:`models.kernels` (itself loaded lazily by
:mod:`models.kernel_loader`), so a run that never loads the kernels never imports Numba.

Threads
-------
Every kernel is a serial, GIL-free loop over a range ``[lo, hi)`` of its outer index (rows of
an image, blocks of rows, elements).  :func:`parallel_for` cuts the range into chunks that the
calling thread and ``numba.get_num_threads() - 1`` helper threads take from a shared counter
(dynamic scheduling: a helper that the OS has not scheduled yet leaves its chunks to the
others, so a loaded machine costs no straggler wait, and idle helpers block rather than spin
against OpenBLAS's threads).  The thread count is Numba's, which is the process's configured
count: ``NUMBA_NUM_THREADS`` (the launcher sets it per rank), else ``OMP_NUM_THREADS`` when
only that is set, else all cores; ``numba.set_num_threads`` changes it.  One thread, or a pass
too small to share (:data:`MIN_PARALLEL`), runs inline.  Reductions sum fixed blocks of
:data:`ROW_BLOCK` rows into per-block partials and add the partials in block order, so no
result depends on the thread count.

GEMMs (:func:`matmul`): a large GEMM is cut into :data:`GEMM_PARTS` row or column parts, each
one single-threaded BLAS call, taken by :func:`parallel_for`'s threads with the BLAS pool held
at one thread (:class:`blas_on_one_thread`).  A BLAS pool splits statically and sleeps between
calls, so on a shared core one late thread (or one wake-up per small GEMM) stalls every GEMM.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

__all__ = [
    "CHUNKS_PER_THREAD",
    "GEMM_MIN_SPLIT",
    "GEMM_PARTS",
    "MIN_PARALLEL",
    "ROW_BLOCK",
    "blas_on_one_thread",
    "configured_threads",
    "matmul",
    "parallel_for",
]

_JIT = {"nopython": True, "nogil": True, "cache": True, "fastmath": False}

#: rows per block of the reductions (fixed, so the sums do not depend on the threads)
ROW_BLOCK = 256
#: passes touching fewer elements than this run on the calling thread alone
MIN_PARALLEL = 1 << 15
#: chunks per thread (more chunks balance better; each costs a few microseconds)
CHUNKS_PER_THREAD = 4


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------
def configured_threads() -> int:
    """The process's thread count: ``NUMBA_NUM_THREADS`` when set (the launcher sets it per
    rank), else ``OMP_NUM_THREADS`` when set (the BLAS convention), else all cores; at most
    the pool Numba started with."""
    limit = numba.config.NUMBA_NUM_THREADS
    if "NUMBA_NUM_THREADS" in os.environ:
        return limit
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return max(1, min(limit, int(omp))) if omp.isdigit() else limit


numba.set_num_threads(configured_threads())

_POOL: list = []                 # [(helper count, ThreadPoolExecutor)], grown on demand
_POOL_LOCK = threading.Lock()


def _helpers(n: int) -> ThreadPoolExecutor:
    """An executor with at least ``n`` helper threads (created on first use)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0][0] < n:
            if _POOL:
                _POOL.pop()[1].shutdown(wait=False)
            _POOL.append((n, ThreadPoolExecutor(max_workers=n,
                                                thread_name_prefix="spardist-kernels")))
        return _POOL[0][1]


def parallel_for(kernel, n: int, work: int, *args) -> None:
    """``kernel(*args, lo, hi)`` over chunks covering ``[0, n)``, on up to
    ``numba.get_num_threads()`` threads (the caller included).

    ``work`` (elements touched) decides whether sharing pays (:data:`MIN_PARALLEL`).  Chunks go
    to whichever thread asks next; the caller returns when every chunk is done, waiting only
    on chunks a helper has started.
    """
    threads = numba.get_num_threads()
    if threads <= 1 or n <= 1 or work < MIN_PARALLEL:
        kernel(*args, 0, n)
        return
    nchunks = min(n, CHUNKS_PER_THREAD * threads)
    bounds = [n * c // nchunks for c in range(nchunks + 1)]
    counter = itertools.count()
    state = {"done": 0, "error": None}
    cv = threading.Condition()

    def drain() -> None:
        taken = 0
        try:
            while (c := next(counter)) < nchunks:
                taken += 1
                kernel(*args, bounds[c], bounds[c + 1])
        except BaseException as exc:            # noqa: BLE001 (handed to the caller)
            state["error"] = exc
            while next(counter) < nchunks:      # skip (and count) the chunks left
                taken += 1
        finally:
            if taken:
                with cv:
                    state["done"] += taken
                    cv.notify_all()

    pool = _helpers(threads - 1)
    for _ in range(threads - 1):
        pool.submit(drain)
    drain()
    with cv:
        cv.wait_for(lambda: state["done"] >= nchunks)
    if state["error"] is not None:
        raise state["error"]


# ---------------------------------------------------------------------------------------------
# GEMMs on the same threads
# ---------------------------------------------------------------------------------------------
#: GEMMs with fewer multiply-accumulates run as one BLAS call on the calling thread
GEMM_MIN_SPLIT = 1 << 22
#: a split GEMM is cut into this many parts (fixed: the cut does not depend on the threads):
#: fewer, larger BLAS calls than eight (equal or faster in 9 of 10 cells of
#: ``bench/bench_torch_cpu.py`` at two threads, free or shared cores), still two parts a
#: thread to even out a late one
GEMM_PARTS = 4

_BLAS: list = []


def _blas_pools():
    """threadpoolctl's controllers of the BLAS libraries loaded in the process (NumPy's
    OpenBLAS), found once; empty without threadpoolctl."""
    if not _BLAS:
        try:
            from threadpoolctl import ThreadpoolController  # noqa: PLC0415 (optional)
            _BLAS.append(list(ThreadpoolController().select(user_api="blas").lib_controllers))
        except Exception:                       # noqa: BLE001 (no control: BLAS as it is)
            _BLAS.append([])
    return _BLAS[0]


class blas_on_one_thread:
    """Context: the BLAS pools run each call on the calling thread (then restored), so that
    GEMMs issued by :func:`parallel_for`'s threads neither wake nor wait for BLAS's own
    threads.  A BLAS pool splits every GEMM statically over its threads and sleeps between
    calls (``OPENBLAS_THREAD_TIMEOUT``): on a shared core one late thread stalls the whole
    GEMM, and hundreds of small GEMMs each pay a wake-up; the model's step collapsed (a
    two-thread GPT step 3-7x slower than one thread beside one busy process)."""

    def __enter__(self):
        self._saved = []
        for lib in _blas_pools():
            n = lib.num_threads
            if n > 1:
                lib.set_num_threads(1)
                self._saved.append((lib, n))
        return self

    def __exit__(self, *exc):
        for lib, n in self._saved:
            lib.set_num_threads(n)
        return False


def _gemm_parts(a, b, out, axis, edges, lo, hi):
    """Parts ``lo..hi-1`` of a GEMM cut along ``axis`` of ``out`` at ``edges`` (0: GEMMs of a
    stack, 1: rows, 2: columns of the last two axes)."""
    for p in range(lo, hi):
        s = slice(edges[p], edges[p + 1])
        if axis == 0:
            np.matmul(a[s] if a.ndim == 3 else a, b[s] if b.ndim == 3 else b, out=out[s])
        elif axis == 1:
            np.matmul(a[..., s, :], b, out=out[..., s, :])
        else:
            np.matmul(a, b[..., :, s], out=out[..., :, s])


def matmul(a, b, out=None):
    """``out = a @ b`` (2-D, or stacks of equal 2-D shapes) on the process's threads.

    One thread, or a GEMM under :data:`GEMM_MIN_SPLIT` multiply-accumulates: one
    ``np.matmul`` call on the calling thread (inside :class:`blas_on_one_thread` when the
    process has more threads: OpenBLAS splits GEMMs from about 2^18 multiply-accumulates over
    its own pool, and one of its threads descheduled by another process stalls the call; the
    digits ViT trained 2.1x slower beside one busy process).  Otherwise the output is cut into
    :data:`GEMM_PARTS` parts, one single-threaded BLAS call each, taken by
    :func:`parallel_for`'s threads as they come (a descheduled thread leaves its parts to the
    others) inside :class:`blas_on_one_thread`:

    * a stack of at least :data:`GEMM_PARTS` GEMMs (Winograd's 16 products per tile
      position) is cut into runs of whole GEMMs, so no operand is packed twice;
    * a single GEMM is cut into blocks of rows, or of columns when it has more columns than
      rows: each part packs the operand it shares again, and the cut along the longer side
      shares the smaller one.

    Each output element is the same dot product either way (OpenBLAS cuts the inner dimension
    alike), so the values agree to round-off with the single call, and do not depend on the
    thread count.
    """
    if out is None:
        shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
        out = np.empty(shape, dtype=np.result_type(a, b))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    macs = out.size * k
    if out.ndim == 3 and out.shape[0] >= GEMM_PARTS:
        axis, size, least = 0, out.shape[0], GEMM_PARTS
    else:
        axis, size, least = (1, m, 2 * GEMM_PARTS) if m >= n else (2, n, 2 * GEMM_PARTS)
    if numba.get_num_threads() <= 1:
        np.matmul(a, b, out=out)
        return out
    if macs < GEMM_MIN_SPLIT or size < least:
        with blas_on_one_thread():      # else BLAS splits it over its own (late) threads
            np.matmul(a, b, out=out)
        return out
    edges = [size * p // GEMM_PARTS for p in range(GEMM_PARTS + 1)]
    with blas_on_one_thread():
        parallel_for(_gemm_parts, GEMM_PARTS, macs, a, b, out, axis, edges)
    return out

