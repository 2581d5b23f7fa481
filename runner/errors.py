"""The rank-consistent error path: one error line naming the input and the fix, from every rank,
and the job aborted rather than left hanging."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import time
import traceback

from substrate.results import RunWriter

# -- failures ----------------------------------------------------------------------------------
#: seconds rank 0 waits for the other ranks' errors before it prints and aborts the job
ERROR_GATHER_S = 3.0
#: seconds another rank waits for rank 0 to print (and abort) before it prints its own error
ERROR_FALLBACK_S = ERROR_GATHER_S + 3.0
#: seconds between printing and aborting (the abort may cut the forwarding of the output)
ERROR_FLUSH_S = 0.5
_ERROR_TAG = 16


def _rank_list(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 0-3`` or ``ranks 0, 2, 5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _print_errors(errors: dict[int, tuple[str, str]]) -> None:
    """One ``spardist: error on ...`` line per distinct message (with its traceback once)."""
    by_text: dict[str, list[int]] = {}
    details: dict[str, str] = {}
    for rank, (text, detail) in sorted(errors.items()):
        by_text.setdefault(text, []).append(rank)
        details.setdefault(text, detail)
    for text, ranks in by_text.items():
        detail = details[text]
        print(f"spardist: error on {_rank_list(ranks)}: {text}", file=sys.stderr, flush=True)
        if detail:
            print(detail, file=sys.stderr, end="", flush=True)


def _fail(exc: BaseException, errors_comm) -> None:
    """Report ``exc`` once per distinct message over the job, then end the job (no return).

    Rank 0 gathers the errors the other ranks send within :data:`ERROR_GATHER_S` (all at once
    when they fail alike), prints each distinct message once naming its ranks, and aborts the
    job.  Another rank sends its error to rank 0 and waits; if rank 0 is not failing (it is
    waiting in a collective), the rank prints its own message after :data:`ERROR_FALLBACK_S`
    and aborts the job.
    """
    from mpi4py import MPI  # noqa: PLC0415 (an offline command's error path starts no MPI)

    text = f"{type(exc).__name__}: {exc}"
    detail = "" if isinstance(exc, ValueError) else traceback.format_exc()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if errors_comm is None:
        if not getattr(exc, "quiet", False):   # one of many singletons: the first one speaks
            _print_errors({rank: (text, detail)})
        sys.exit(1)
    # the job's abort interrupts every rank: end quietly, not with a KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    size = errors_comm.Get_size()
    if rank == 0:
        errors = {0: (text, detail)}
        deadline = time.monotonic() + ERROR_GATHER_S
        status = MPI.Status()
        while len(errors) < size and time.monotonic() < deadline:
            if errors_comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ERROR_TAG, status=status):
                src = status.Get_source()
                errors[src] = errors_comm.recv(source=src, tag=_ERROR_TAG)
            else:
                time.sleep(0.01)
        _print_errors(errors)
        time.sleep(ERROR_FLUSH_S)  # let the launcher forward the message before the abort
    else:
        request = errors_comm.isend((text, detail), dest=0, tag=_ERROR_TAG)
        deadline = time.monotonic() + ERROR_FALLBACK_S
        while time.monotonic() < deadline:  # rank 0 prints and aborts the job meanwhile
            try:
                request.Test()  # drives MPI progress, so rank 0 can receive a long traceback
            except MPI.Exception:  # the job is being aborted: rank 0 has printed
                os._exit(1)
            time.sleep(0.01)
        _print_errors({rank: (text, detail)})
        time.sleep(ERROR_FLUSH_S)
    sys.stdout.flush()
    world.Abort(1)
    os._exit(1)  # MPI_Abort may return while the process manager ends the job


@contextlib.contextmanager
def _argparse_on_rank0_only(rank: int):
    """Every rank parses the same command line: only rank 0 prints argparse's usage, help and
    errors (the other ranks exit alike, silently)."""
    if rank == 0:
        yield
        return
    original = argparse.ArgumentParser._print_message
    argparse.ArgumentParser._print_message = lambda self, message, file=None: None
    try:
        yield
    finally:
        argparse.ArgumentParser._print_message = original


def offline_guard(main):
    """Wrap the ``main(argv)`` of a command that runs no MPI job (``commvol``): an exception is
    one ``spardist: error: ...`` line (with the traceback for errors other than ``ValueError``)
    and a non-zero exit status, without initialising MPI."""

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001
            if not isinstance(exc, ValueError):
                traceback.print_exc()
            print(f"spardist: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapped


def main_guard(main):
    """Wrap a CLI ``main(argv)`` so an exception on any rank ends the whole job cleanly.

    A failed run's in-progress metrics are dropped (:meth:`RunWriter.abandon_open`); the error
    is printed once per distinct message as ``spardist: error on rank R: ...`` or ``spardist:
    error on ranks 0-3: ...`` (:func:`_fail`), with the traceback for errors other than
    ``ValueError``; a multi-rank job is aborted (no rank is left waiting in a collective).
    Exit status is non-zero.
    """

    @functools.wraps(main)
    def wrapped(argv=None):
        from mpi4py import MPI  # noqa: PLC0415 (imported by the ranks of a job, not offline)

        world = MPI.COMM_WORLD
        errors_comm = world.Dup() if world.Get_size() > 1 else None
        try:
            with _argparse_on_rank0_only(world.Get_rank()):
                result = main(argv)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001
            RunWriter.abandon_open()
            _fail(exc, errors_comm)
        if errors_comm is not None:
            errors_comm.Free()
        return result

    return wrapped
