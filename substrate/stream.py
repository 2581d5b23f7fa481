"""The communication stream: one thread per process that runs the collectives a rank issues
without waiting (``Comm.allreduce(..., wait=False)``), in issue order, while the issuing thread
goes on computing.

This is how PyTorch DDP (a communication stream / the Gloo thread) and Horovod (its background
thread) overlap gradient communication with the backward pass: the bucket is handed over as soon
as the backward has written it, and the optimizer waits for every bucket.  Here the thread runs
the same exact algorithm (:mod:`substrate.collectives`) as a blocking call would, in the same
order, so results and bytes are bitwise those of the blocking run; only *when* the bytes move
changes.  Waits inside the thread test their requests every :data:`POLL_S` seconds and sleep in
between, so the thread does not take a core from the computation it overlaps (MPICH's blocking
calls spin) and MPI progresses at every test.

The stream needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default request): the issuing thread may make
point-to-point calls on other communicators while the stream runs.  Without it
(:func:`available`), calls issued without waiting run at once (blocking), and the run says so.
Every blocking call of a communicator first drains the stream (:meth:`CommStream.drain`), so the
two threads never use one communicator at the same time.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from mpi4py import MPI

__all__ = ["POLL_S", "CommStream", "available"]

#: Seconds between two tests of the stream's pending requests.
POLL_S = 50e-6
#: Python's thread switch interval while a stream exists (seconds; the default is 5 ms).
SWITCH_INTERVAL_S = 1e-4


def available() -> bool:
    """Whether MPI was initialized with ``MPI_THREAD_MULTIPLE`` (a stream may run)."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class CommStream:
    """A FIFO of communication work on one background thread (created on first use)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._lock = threading.Lock()
        self.enabled = available()
        #: how the thread waits for its requests: ``None`` blocks in MPI (the GIL is released;
        #: MPICH spins unless its progress throttle is set, as the launchers set it when ranks
        #: outnumber cores), or test every ``poll`` seconds and sleep in between
        self.poll = None

    def submit(self, fn) -> Future:
        """Run ``fn()`` on the stream after everything submitted before; returns its future.
        Without ``MPI_THREAD_MULTIPLE`` it runs here, now."""
        if not self.enabled:
            fut: Future = Future()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as a thread does
                fut.set_exception(exc)
            return fut
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="spardist-comm")
                # the thread needs the GIL for a moment between its MPI waits and reductions;
                # at Python's default 5 ms switch interval a computing main thread would hold
                # it up to 5 ms each time (every ring step of every bucket)
                sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._last = self._pool.submit(fn)
            return self._last

    def drain(self) -> None:
        """Wait until everything submitted so far has run (its errors stay with its future)."""
        last = self._last
        if last is not None:
            with contextlib.suppress(BaseException):  # the call's own handle raises it
                last.result()

    @property
    def busy(self) -> bool:
        return self._last is not None and not self._last.done()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
