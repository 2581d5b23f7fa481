"""The run context: topology, books, clock, results; its record and its summary.

>>> parser = argparse.ArgumentParser(); add_common_args(parser)
>>> args = parser.parse_args(argv)
>>> run = start_run(args, system="hsadmm", method="hsadmm", config=cfg)
>>> run.log(iteration=0, loss=1.2)
>>> summary = run.finish(metrics={"final_test_accuracy": 0.97})
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mpi4py
import numpy as np
from mpi4py import MPI

from simulation.clock import SimClock, make_source
from simulation.jobsim import JobSimOptions
from simulation.profile import ProfileRecorder, write_profile
from simulation.trace import parse_steps, trace_document
from substrate import collectives as coll
from substrate.backend import Backend, get_backend
from substrate.options import from_args
from substrate.program import normalize
from substrate.results import (
    CHECKPOINTS,
    RunWriter,
    atomic_write_bytes,
    to_jsonable,
)
from substrate.threads import cap_threads
from substrate.topology import Topology

from .guards import _prepare_out, check_world_size
from .launch import git_commit
from .options import CommonConfig


def _dist_version(name: str) -> str:
    """An installed distribution's version without importing it (SciPy costs ~30 MiB a rank)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def versions() -> dict:
    try:
        spardist = version("spardist")
    except PackageNotFoundError:
        spardist = "unknown"
    mpi = MPI.Get_library_version().replace("\x00", "").strip()   # Open MPI ends it in a NUL
    return {"spardist": spardist, "python": platform.python_version(), "numpy": np.__version__,
            "scipy": _dist_version("scipy"), "mpi4py": mpi4py.__version__,
            "mpi": mpi.splitlines()[0].strip() if mpi else "unknown"}


#: version of the ``summary.json`` layout (the ``record`` block and everything beside it)
SUMMARY_SCHEMA = 2


def run_record(argv, started: float, hosts: list[str]) -> dict:
    """The ``record`` block of ``summary.json``: how to run it again and where it ran."""
    argv = list(argv)
    prog = Path(argv[0]) if argv else Path("?")
    module = prog.parent.name if prog.name == "__main__.py" else ".".join(
        prog.with_suffix("").parts[-2:]) if prog.suffix == ".py" else str(prog)
    return {"schema": SUMMARY_SCHEMA, "argv": argv, "module": module, "args": argv[1:],
            "cwd": os.getcwd(), "git_commit": git_commit(), "versions": versions(),
            "hosts": sorted(set(hosts)), "hosts_per_rank": list(hosts),
            "launcher": {k: v for k, v in os.environ.items()
                         if k in ("SPARDIST_NP", "SLURM_JOB_ID", "PMI_SIZE",
                                  "OMPI_COMM_WORLD_SIZE")},
            "started": _iso(started), "finished": _iso(time.time())}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(
        timespec="seconds")


#: units a ``metrics.jsonl`` index may count
UNITS = ("iteration", "step", "epoch")


class Run:
    """Everything a command needs: topology, communicators, ledger, cost model, clock, backend,
    results writer.  Built by :func:`start_run`.

    ``previous`` says what ``--out`` held when the run started: ``"new"`` (nothing to keep or
    replaced with ``--overwrite``), ``"interrupted"`` or ``"finished"`` (with ``--resume``).
    """

    def __init__(self, *, system: str, method: str, common: CommonConfig, config,
                 topo: Topology, backend: Backend, writer: RunWriter,
                 previous: str = "new", unit: str = "step",
                 checkpoints: Path | None = None, jobsim: JobSimOptions | None = None) -> None:
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.system, self.method = system, method
        #: what one ``metrics.jsonl`` line's ``index`` counts: ``iteration`` (ADMM), ``step``
        #: (optimizer step) or ``epoch``
        self.unit = unit
        self.common = common
        self.config = config
        self.topo = topo
        self.world = topo.world
        self.rank = topo.rank
        self.size = topo.size
        self.backend = backend
        self.xp = backend.xp
        self.recorder = topo.recorder
        self.ledger = topo.recorder.ledger
        self.cost = topo.recorder.cost
        sync = backend.synchronize if backend.is_gpu else None
        # every rank reads --compute-profile itself: a bad file stops every rank alike
        source = make_source(common.compute_source, sync=sync, gpu=backend.is_gpu,
                             device_tflops=common.device_tflops, device_gbs=common.device_gbs,
                             profile=common.compute_profile, rank=topo.rank, ranks=topo.size)
        #: how this run's job differs from the one --compute-profile describes (``[]``: none)
        self.profile_differences = []
        if common.compute_profile is not None and system != "replay":
            self.profile_differences = check_profile_job(
                source.profile, job_of(system, method, topo.size, config),
                common.compute_profile_partial)
        #: the recorder of --compute-profile-out (``None`` without it)
        self.profile_recorder = None
        if common.compute_profile_out is not None:
            source = self.profile_recorder = ProfileRecorder(source)
        #: the job simulation's options (the network of every rank's steps)
        self.jobsim = jobsim or JobSimOptions()
        # every rank reads --cluster itself: a bad file stops every rank alike
        self.clock = SimClock(
            self.ledger, sync=sync, source=source, gpu=backend.is_gpu,
            network=self.jobsim.network(self.cost), jobsim=self.jobsim,
            node_of=topo.placement.node_of, rank=topo.rank, mpi=self.world.mpi,
            keep_program=common.compute_profile_out is not None)
        #: the rank's program as it runs (every call its communicators make is recorded in it)
        self.program = self.recorder.program = self.clock.program
        #: a run that keeps its whole program (for the replay) holds every step it executed
        #: equal to its recording (:meth:`substrate.executor.Executor.verify`)
        self.verify_programs = common.compute_profile_out is not None
        if common.trace is not None:
            self.clock.trace_steps = parse_steps(common.trace_steps)
        self.recorder.overlap = common.overlap == "on"
        self.writer = writer
        self.out = writer.out
        #: the folder of this run's checkpoints: ``OUT/checkpoints``, or with ``--overwrite``
        #: of a run ``OUT/checkpoints.pending`` until this run is published
        self.checkpoints = Path(checkpoints) if checkpoints is not None else \
            self.out / CHECKPOINTS
        self.previous = previous
        self._t0 = time.time()
        self.finished = False
        #: which collectives ran and whether the wire carries what the ledger books (collective)
        self.collectives = coll.describe(self.world.mode, self.world.mpi)

    def log(self, index: int | None = None, /, **record) -> None:
        """One ``metrics.jsonl`` line (written by rank 0; pass values already reduced):
        ``unit`` (:attr:`unit`), ``index``, the index under the unit's own name unless
        ``record`` has that key, then ``record`` in its order.

        The trainers write their lines through :class:`runner.loop.RunLoop`, in the one schema
        of ``runner/metrics.schema.json``.  ``run.log(k, loss=...)``; the older keyword form
        ``run.log(step=k, ...)`` is accepted.
        """
        if index is None:
            for key in (self.unit, *UNITS):
                if key in record:
                    index = record.pop(key)
                    break
            else:
                raise TypeError(f"run.log needs the {self.unit} index: run.log(k, ...)")
        line = {"unit": self.unit, "index": int(index)}
        if self.unit not in record:
            line[self.unit] = int(index)
        line.update(record)
        self.writer.log(line)

    def _steps_max(self) -> dict | None:
        """Every step of the run loop's simulated length, the job's (every rank holds the same
        list: :meth:`simulation.clock.SimClock.simulate` hands it to all); what the wire lab
        compares with the measured steps.  None without steps."""
        steps = self.clock.unit_steps()
        return {"step_s": steps} if steps else None

    def finish(self, metrics: dict | None = None, predicted: dict | None = None,
               extra: dict | None = None) -> dict:
        """Reduce the ledger and timers over all ranks and publish ``summary.json`` (collective).

        Returns the summary dict on every rank.
        """
        measured = self.ledger.totals(self.world)
        # what ran after the last step (a final evaluation) is a step of its own, then every
        # step not simulated yet is (collective: each rank closes it alike)
        if self.world.mpi.allreduce(int(self.clock.open_step), op=MPI.MAX):
            self.clock.step("end")
        self.clock.simulate()
        t = self.clock.as_dict()
        timing = {k: float(self.world.mpi.allreduce(v, op=MPI.MAX)) for k, v in t.items()}
        steps_max = self._steps_max()
        hosts = self.world.mpi.gather(platform.node(), root=0)
        desc = self.clock.describe()
        gathered = self.world.mpi.gather((desc.get("compute_profile"),
                                          self.recorder.log.describe()), root=0)
        infos = [g[0] for g in gathered] if gathered is not None else None
        tables = self.world.mpi.gather(
            (self.profile_recorder.table(), normalize(self.program.entries)), root=0) \
            if self.profile_recorder is not None else None
        clock = None
        if self.rank == 0:
            clock = dict(desc)
            if infos[0] is not None and "fallback_blocks" in infos[0]:
                fb = sum(i["fallback_blocks"] for i in infos)
                fs = sum(i["fallback_s"] for i in infos)
                clock["compute_profile"] = {
                    **infos[0], "fallback_blocks_all_ranks": fb, "fallback_s_all_ranks": fs,
                    "job_differences": self.profile_differences,
                    "fraction_measured_instead": fs / max(timing.get("compute_s", 0.0)
                                                          * self.size, 1e-300)}
                if fb:
                    print(f"spardist: warning: {fb} compute blocks (all ranks) are not in "
                          f"--compute-profile {infos[0]['file']} and were measured instead "
                          f"(rank 0: {infos[0]['fallback_labels']}); record the profile with "
                          "the same options", file=sys.stderr, flush=True)
            if tables is not None:
                clock["compute_profile"] = self._write_profile(tables)
        summary = {
            "record": run_record(sys.argv, self._t0, hosts) if self.rank == 0 else None,
            "system": self.system,
            "method": self.method,
            "config": _config_dict(self.config),
            "common": dataclasses.asdict(self.common),
            "versions": versions(),
            "topology": self.topo.describe(),
            "cost_model": self.cost.describe(),
            "collectives": self.collectives,
            "threads": getattr(self, "threads", None),
            "overlap": {"mode": self.common.overlap,
                        "communication_thread": bool(self.topo.stream.enabled),
                        "why_not": None if self.topo.stream.enabled else
                        "MPI was not initialized with MPI_THREAD_MULTIPLE: calls issued "
                        "without waiting ran blocking"},
            "traffic": {"measured": measured, "predicted": predicted or {}},
            "metrics": metrics or {},
            "timing": timing,
            "steps_max": steps_max,
            "clock": clock,
            "calls": ({"per_rank": [g[1] for g in gathered],
                       "placement": self.topo.placement.describe()}
                      if gathered is not None else None),
        }
        if extra:
            summary.update(extra)
        if self.common.trace is not None and self.rank == 0:
            doc = trace_document(self.clock.traced,
                                 {"system": self.system, "method": self.method,
                                  "steps": self.common.trace_steps,
                                  "compute_source": self.clock.source.describe()})
            atomic_write_bytes(self.common.trace, json.dumps(to_jsonable(doc)).encode() + b"\n")
            summary["trace"] = {"file": str(self.common.trace),
                                "events": len(doc["traceEvents"])}
        summary = to_jsonable(summary)
        self.writer.finish(summary)
        if self.rank == 0 and not self.collectives["verified"]:
            print(f"spardist: warning: traffic is {self.collectives['status']}", file=sys.stderr,
                  flush=True)
        self.finished = True
        return summary

    def _write_profile(self, tables: list[dict]) -> dict:
        """Rank 0: write ``--compute-profile-out`` (every rank's table; atomic) and say what was
        written, for ``summary.json``."""
        path = self.common.compute_profile_out
        programs = [p for _, p in tables]
        tables = [t for t, _ in tables]
        sha = write_profile(path, tables, _profile_provenance(self),
                            programs if all(p is not None for p in programs) else None,
                            step_kinds=[k for k, _ in self.clock.simulated])
        return {"recorded_to": str(path), "sha256": sha,
                "events_per_rank": [sum(len(p) for p in t.values()) for t in tables],
                "unlabelled_blocks": self.profile_recorder.unlabelled,
                "program_entries_per_rank": [len(p or ()) for p in programs]}


#: config fields that do not change what a step computes (a profile recorded with other values
#: still describes the job): run length, output, evaluation, checkpoints, seed, initial weights
JOB_NEUTRAL = frozenset({"out", "overwrite", "resume", "checkpoint_every", "progress_every",
                         "steps", "iters", "epochs", "seed", "eval_every", "log_every",
                         "target_accuracy", "init", "data_dir"})


def job_of(system: str, method: str, world: int, config) -> dict:
    """What a compute profile describes: the system, method, world size and every config field
    that changes the work of a step (not :data:`JOB_NEUTRAL`)."""
    cfg = {k: v for k, v in _config_dict(config).items()
           if k not in JOB_NEUTRAL and k != "method"}
    return to_jsonable({"system": system, "method": method, "world": int(world), "config": cfg})


def check_profile_job(profile: dict, job: dict, partial: bool) -> list[str]:
    """The fields in which ``profile``'s job differs from ``job`` (``[]``: the same job).

    Raises
    ------
    ValueError
        Naming ``--compute-profile``, the differences and the fix, unless ``partial``
        (``--compute-profile-partial``: use it anyway; the summary then says what fraction of
        the compute was measured instead).
    """
    have = (profile.get("provenance") or {}).get("job")
    if have is None:
        diffs = ["the profile records no job (written by an older spardist)"]
    else:
        diffs = [f"{k}: profile {have.get(k)!r}, this run {job[k]!r}"
                 for k in ("system", "method", "world") if have.get(k) != job[k]]
        a, b = have.get("config") or {}, job["config"]
        diffs += [f"{k}: profile {a.get(k)!r}, this run {b.get(k)!r}"
                  for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diffs and not partial:
        raise ValueError(f"--compute-profile {profile.get('path')}: recorded for another job "
                         f"({'; '.join(diffs[:4])}{' ...' if len(diffs) > 4 else ''}); record "
                         "one for this job with --compute-profile-out, or pass "
                         "--compute-profile-partial to cost what matches and measure the rest")
    return diffs


def _profile_provenance(run: Run) -> dict:
    rec = run.profile_recorder
    return {"source": rec.base.describe(), "blas_threads": getattr(rec.base, "blas_threads",
                                                                   None),
            "job": job_of(run.system, run.method, run.size, run.config),
            "system": run.system, "method": run.method,
            "model": _config_dict(run.config).get("model"), "world": run.size,
            "ranks_per_node": run.common.ranks_per_node,
            "out": str(run.out), "command": list(sys.argv), "spardist": versions()["spardist"]}


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)


#: the link to the newest run folder in ``results/<system>_<method>/``
LATEST = "latest"


def _default_out(system: str, method: str, topo: Topology, resume: bool) -> Path:
    """The run folder when ``--out`` is not given (collective): a new
    ``results/<system>_<method>/run-N`` (``N`` one more than the largest there, created
    atomically, so no run ever lands in another's folder) with ``latest`` pointing at it; with
    ``--resume``, the folder ``latest`` points at.  ``results/`` is relative to the working
    directory; the environment variable ``SPARDIST_RESULTS`` names another root."""
    base = Path(os.environ.get("SPARDIST_RESULTS") or "results") / f"{system}_{method}"
    verdict = None
    if topo.rank == 0:
        try:
            verdict = (str(_new_run_dir(base)), None) if not resume else _latest(base)
        except OSError as exc:
            why = (f"cannot create a run folder under {base} ({exc.strerror or exc}): "
                   "pass --out DIR in a directory you can write to")
            verdict = (None, why)
    path, error = topo.world.mpi.bcast(verdict, root=0)
    if error:
        raise ValueError(error)
    return Path(path)


def _new_run_dir(base: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[4:]) for p in base.glob("run-*") if p.name[4:].isdigit()]
    n = max(taken, default=0) + 1
    while True:
        d = base / f"run-{n}"
        try:
            d.mkdir()
            break
        except FileExistsError:     # another run took it a moment ago
            n += 1
    link = base / LATEST
    tmp = base / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(d.name)
    os.replace(tmp, link)
    return d


def _latest(base: Path) -> tuple[str | None, str | None]:
    link = base / LATEST
    if not link.is_symlink() and not link.is_dir():
        return None, (f"--resume without --out continues the newest run in {base}, and there is "
                      f"none: pass --out DIR of the run to continue")
    return str(link.resolve()), None


def start_run(args, *, system: str, method: str, config=None, comm=None,
              unit: str = "step") -> Run:
    """Build the run context from parsed common args (collective over ``comm``).

    Works serially too: without ``mpiexec`` the world has one rank.  Stops with a clear error
    (:func:`check_world_size`) when the launcher started more ranks than MPI connected, and on
    every rank when ``--out`` cannot take the run (see the module docstring); ``--resume`` is
    read from ``args`` when it has it.
    """
    common = args if isinstance(args, CommonConfig) else CommonConfig.from_args(args)
    jobsim = None if isinstance(args, CommonConfig) else from_args(JobSimOptions, args)
    resume = bool(getattr(args, "resume", False))
    if comm is None:
        check_world_size(MPI.COMM_WORLD.Get_size())
    cost = common.cost_model()
    topo = Topology.from_comm(comm if comm is not None else MPI.COMM_WORLD,
                              ranks_per_node=common.ranks_per_node,
                              node_map=common.node_map, cost=cost,
                              collectives=common.collectives)
    out = Path(common.out) if common.out else _default_out(system, method, topo, resume)
    previous, checkpoints, pending = _prepare_out(
        out, topo, resume=resume, overwrite=common.overwrite,
        profile_out=common.compute_profile_out, trace=common.trace)
    try:
        # however the ranks were launched, each caps its own compute threads (plain
        # mpiexec/srun set nothing: its BLAS pools would take every core and the cpu clock
        # would change)
        threads = cap_threads(topo.real_node_ranks)
        backend = get_backend(common.device, topo.gpu_index)
        topo.bind_backend(backend)
        # from here the writer removes this run's pending checkpoints if the run fails
        writer = RunWriter(out, enabled=topo.rank == 0, pending=pending)
    except BaseException:
        if pending is not None:
            shutil.rmtree(pending, ignore_errors=True)
        raise
    run = Run(system=system, method=method, common=common, config=config, topo=topo,
              unit=unit, backend=backend, writer=writer, previous=previous,
              checkpoints=checkpoints, jobsim=jobsim)
    run.threads = threads
    blas = threads["blas_threads"] or 1
    if topo.rank == 0 and blas > 1 and common.compute_source in ("auto", "cpu") and \
            not backend.is_gpu:
        print(f"spardist: note: {blas} BLAS threads per rank ({threads['set_by']}): the cpu "
              "compute source reads the process's CPU time (all its threads), not the "
              "thread's; set OMP_NUM_THREADS=1 for load-independent per-thread times",
              file=sys.stderr, flush=True)
    return run
