"""Input guards of a run, decided before any work on every rank alike: the world size the launcher
asked for, and an ``--out`` that can take the run.

Results are never lost: an ``--out`` that holds a finished run (``summary.json``) or the
checkpoints of an interrupted one is refused unless ``--overwrite`` (start afresh) or
``--resume`` (continue it) is given, and so is an ``--out`` that is a file or not writable;
rank 0 decides and every rank stops with the same message before any work.  ``--overwrite``
touches nothing of the earlier run at the start: the new run writes its checkpoints to
``OUT/checkpoints.pending``, which replace the earlier run's only once the new run is published;
a run that fails or is killed leaves the earlier one byte for byte as it was, and ``--resume``
continues it (:mod:`substrate.results`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

from substrate.results import (
    CHECKPOINTS,
    PENDING,
    SUMMARY,
    Checkpointer,
    recover_checkpoints,
    recover_publish,
    start_pending_checkpoints,
)
from substrate.topology import Topology


def expected_world_size(env=None) -> tuple[int, str] | None:
    """The rank count the launcher asked for, and who said so, or ``None`` when unknown.

    In order: ``SPARDIST_NP`` (set by ``run_mpi.sh`` / ``runner.launch``), the process
    manager's own size (``PMI_SIZE``: Hydra and PMI-1/2 launchers; ``OMPI_COMM_WORLD_SIZE``:
    Open MPI's mpirun), and last the Slurm step's task count (``SLURM_STEP_NUM_TASKS``), read
    only when no process manager variable is set: under Hydra's Slurm launcher the step's tasks
    are the per-node proxies, not the ranks.
    """
    env = os.environ if env is None else env
    for var in ("SPARDIST_NP", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if env.get(var, "").isdigit():
            return int(env[var]), var
    if env.get("SLURM_STEP_NUM_TASKS", "").isdigit() and not any(
            k.startswith(("PMI_", "PMIX_", "OMPI_")) for k in env):
        return int(env["SLURM_STEP_NUM_TASKS"]), "SLURM_STEP_NUM_TASKS"
    return None


def check_world_size(size: int, env=None) -> None:
    """Stop when MPI's world is not the one the launcher started (e.g. ``srun`` without a PMI
    the MPI library speaks starts N single-rank worlds that would race on one results folder).

    Raises
    ------
    ValueError
        Naming the expected and actual size and the fix.
    """
    want = expected_world_size(env)
    if want is None or want[0] == size:
        return
    n, var = want
    env = os.environ if env is None else env
    who = next((env[k] for k in ("SLURM_PROCID", "PMI_RANK", "PMIX_RANK",
                                 "OMPI_COMM_WORLD_RANK") if env.get(k, "").isdigit()), "0")
    err = ValueError(
        f"the launcher started {n} ranks ({var}={n}) but MPI sees a world of {size}: the ranks "
        f"did not find each other (singletons). With srun and the MPICH wheel launch with "
        f"srun --mpi=pmi2 ... (or plain mpiexec inside the allocation; ./run_mpi.sh and "
        f"spardist run do it for you); with a site MPI use the srun --mpi plugin it was built "
        f"for (srun --mpi=list); make sure mpiexec and mpi4py come from the same MPI library")
    # every singleton fails alike: only the launcher's first process says so
    err.quiet = who != "0"
    raise err


# -- the results directory ---------------------------------------------------------------------
def _dir_write_error(d: Path) -> str | None:
    """Why a file cannot be created in directory ``d`` (its ``OSError`` text), or ``None``:
    create ``d`` (and its missing parents) and a temporary file in it, then remove the
    directories created (the writer creates them again when it writes)."""
    missing = [p for p in (d, *d.parents) if not p.exists()]
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as exc:
        return str(exc.strerror or exc)
    finally:
        for m in missing:  # deepest first
            with contextlib.suppress(OSError):
                m.rmdir()
    return None


def _writable_check(out: Path) -> str | None:
    """Why ``out`` cannot hold results, or ``None``."""
    if out.exists() and not out.is_dir():
        return (f"--out {out} is an existing file, not a directory: pass a directory path (it is "
                "created when missing)")
    why = _dir_write_error(out)
    if why:
        return f"--out {out} is not writable ({why}): choose a directory you can write to"
    return None


def _inspect_out(out: Path, *, resume: bool, overwrite: bool) -> tuple[str, str | None]:
    """Rank 0's verdict on the results directory: ``(previous, error)`` (see :class:`Run`)."""
    if resume and overwrite:
        return "new", ("--resume continues the run in --out and --overwrite replaces it: pass "
                       "one of them")
    problem = _writable_check(out)
    if problem:
        return "new", problem
    finished = (out / SUMMARY).is_file()
    if finished:
        recover_publish(out)
    for note in recover_checkpoints(out):    # what a killed --overwrite run left
        print(f"spardist: note: {note}", file=sys.stderr, flush=True)
    checkpoints = Checkpointer.files(out / CHECKPOINTS)
    if overwrite:   # this run's checkpoints go apart once every check has passed
        return "new", None
    if resume:
        return ("finished" if finished else "interrupted"), None
    if finished:
        return "new", (f"--out {out} already holds a finished run ({SUMMARY}): pass --overwrite "
                       "to replace it, --resume to continue it from its checkpoints, or choose "
                       "another --out")
    if checkpoints:
        return "new", (f"--out {out} holds checkpoints of an interrupted run "
                       f"({out / CHECKPOINTS}): pass --resume to continue it, --overwrite to "
                       "discard them and start afresh, or choose another --out")
    return "new", None


def _inspect_file_out(flag: str, path: Path, *, overwrite: bool,
                      example: str = "out.json") -> str | None:
    """Why the file ``flag`` names cannot be written at the end of the run, or ``None``: an
    existing file is kept unless ``--overwrite`` (the rule of ``--out``'s results)."""
    if path.is_dir():
        return f"{flag} {path} is a directory: pass a file path (e.g. {path / example})"
    if path.exists() and not overwrite:
        return (f"{flag} {path} already exists: pass --overwrite to replace it, or choose "
                "another file")
    why = _dir_write_error(path.parent)
    if why:
        return (f"{flag} {path}: its directory is not writable ({why}): choose a file in a "
                "directory you can write to")
    return None


def _prepare_out(out: Path, topo: Topology, *, resume: bool, overwrite: bool,
                 profile_out: str | None = None,
                 trace: str | None = None) -> tuple[str, Path, Path | None]:
    """Collective: rank 0 inspects ``out`` (and ``--compute-profile-out``, ``--trace``), every
    rank gets the verdict and raises the same error (bookkeeping: not booked in the ledger).

    Returns ``(previous, checkpoints, pending)``: what ``out`` held (see
    :class:`runner.run.Run`), the folder every rank writes its checkpoints to, and on rank 0
    that folder when it is ``OUT/checkpoints.pending`` (else ``None``): an ``--overwrite`` run
    in an ``out`` that holds a run writes its checkpoints apart, created now, before any rank
    can write one, and they replace the earlier run's only once it is published.
    """
    verdict = pending = None
    if topo.rank == 0:
        verdict = _inspect_out(out, resume=resume, overwrite=overwrite)
        for flag, path, example in (("--compute-profile-out", profile_out, "profile.json"),
                                    ("--trace", trace, "trace.json")):
            if verdict[1] is None and path is not None:
                verdict = (verdict[0], _inspect_file_out(flag, Path(path), overwrite=overwrite,
                                                         example=example))
        if verdict[1] is None and overwrite and ((out / SUMMARY).exists() or
                                                 (out / CHECKPOINTS).exists()):
            try:
                pending = start_pending_checkpoints(out)
            except OSError as exc:
                why = (f"--overwrite: cannot create {out / PENDING} for this run's checkpoints "
                       f"({exc.strerror or exc}): make {out} writable, or choose another --out")
                verdict = (verdict[0], why)
        verdict = (*verdict, PENDING if pending is not None else CHECKPOINTS)
    previous, error, where = topo.world.mpi.bcast(verdict, root=0)
    if error:
        raise ValueError(error)
    return previous, out / where, pending
