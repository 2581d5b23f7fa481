"""Input guards of a run, decided before any work on every rank alike: the world size the launcher
asked for, and an ``--out`` that can take the run.

Results are never lost: an ``--out`` that holds a finished run (``summary.json``) or the
checkpoints of an interrupted one is refused unless ``--overwrite`` (start afresh) or
``--resume`` (continue it) is given, and so is an ``--out`` that is a file or not writable;
rank 0 decides and every rank stops with the same message before any work.  ``--overwrite``
deletes nothing at the start: the earlier run's checkpoints are set aside
(``OUT/checkpoints.replaced``) and removed only once the new run is published; a run that fails
puts them back (:mod:`substrate.results`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from substrate.results import (
    CHECKPOINTS,
    REPLACED,
    SUMMARY,
    Checkpointer,
    put_back_checkpoints,
    recover_publish,
    replacing_run_published,
    set_aside_checkpoints,
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
    checkpoints = Checkpointer.files(out / CHECKPOINTS)
    if (out / REPLACED).exists() and replacing_run_published(out):
        shutil.rmtree(out / REPLACED, ignore_errors=True)   # what its finish did not get to
    if (out / REPLACED).exists():
        problem = _replaced_leftover(out, checkpoints, resume=resume)
        if problem:
            return "new", problem
        checkpoints = Checkpointer.files(out / CHECKPOINTS)
    if overwrite:   # the earlier checkpoints are set aside once every check has passed
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


def _replaced_leftover(out: Path, checkpoints: list[Path], *, resume: bool) -> str | None:
    """``OUT/checkpoints.replaced`` left by an ``--overwrite`` run that was killed before it
    could finish or put them back: why the run cannot start, or ``None``.

    Killed before its first checkpoint, it left nothing to continue: the earlier run's
    checkpoints are put back.  Otherwise ``--resume`` continues the killed run (which removes
    them when it finishes), and any other run is refused, so that neither set is lost.
    """
    aside = out / REPLACED
    if not checkpoints:
        put_back_checkpoints(out, aside)
        print(f"spardist: note: put back the checkpoints in {out / CHECKPOINTS} that an "
              "--overwrite run which did not finish had set aside", file=sys.stderr, flush=True)
        return None
    if resume:
        return None
    return (f"--out {out} holds the checkpoints of an --overwrite run that did not finish "
            f"({out / CHECKPOINTS}) and, set aside, those of the run it was replacing ({aside}): "
            f"pass --resume to continue the unfinished run, or remove {out / CHECKPOINTS} and "
            f"rename {aside} to {out / CHECKPOINTS} to go back to the earlier run")


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
                 trace: str | None = None) -> tuple[str, Path | None]:
    """Collective: rank 0 inspects ``out`` (and ``--compute-profile-out``, ``--trace``), every
    rank gets the verdict and raises the same error (bookkeeping: not booked in the ledger).

    Returns ``(previous, replaced)``: what ``out`` held (see :class:`runner.run.Run`) and, on
    rank 0, the set-aside checkpoints of the run this one replaces (``OUT/checkpoints.replaced``:
    moved there now with ``--overwrite``, before any rank can write a checkpoint; left there by
    a killed ``--overwrite`` run that ``--resume`` continues), else ``None``.
    """
    verdict = replaced = None
    if topo.rank == 0:
        verdict = _inspect_out(out, resume=resume, overwrite=overwrite)
        for flag, path, example in (("--compute-profile-out", profile_out, "profile.json"),
                                    ("--trace", trace, "trace.json")):
            if verdict[1] is None and path is not None:
                verdict = (verdict[0], _inspect_file_out(flag, Path(path), overwrite=overwrite,
                                                         example=example))
        if verdict[1] is None and overwrite:
            try:
                replaced = set_aside_checkpoints(out)
            except OSError as exc:
                why = (f"--overwrite: cannot set the earlier run's checkpoints aside "
                       f"({out / CHECKPOINTS} -> {out / REPLACED}: {exc.strerror or exc}); "
                       "move or remove them and run again")
                verdict = (verdict[0], why)
        elif verdict[1] is None and resume and (out / REPLACED).is_dir():
            replaced = out / REPLACED
    previous, error = topo.world.mpi.bcast(verdict, root=0)
    if error:
        raise ValueError(error)
    return previous, replaced
