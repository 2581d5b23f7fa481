"""One option set and one run context for every ``python -m <package> ...`` command.

>>> parser = argparse.ArgumentParser(); add_common_args(parser)
>>> args = parser.parse_args(argv)
>>> run = start_run(args, system="hsadmm", method="hsadmm", config=cfg)
>>> run.log(iteration=0, loss=1.2)
>>> summary = run.finish(metrics={"final_test_accuracy": 0.97})

Results are never lost: :func:`start_run` refuses an ``--out`` that holds a finished run
(``summary.json``) or the checkpoints of an interrupted one unless ``--overwrite`` (start afresh)
or ``--resume`` (continue it) is given, and refuses an ``--out`` that is a file or not writable;
rank 0 decides and every rank stops with the same message before any work.  Trainers add
``--checkpoint-every`` / ``--resume`` / ``--progress-every`` with :func:`add_training_args`,
save and resume with :class:`RunCheckpoints` and report progress on rank 0 with
:class:`Progress`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mpi4py
import numpy as np
from mpi4py import MPI

from . import collectives as coll
from . import costmodel as cm
from .backend import Backend, get_backend
from .clock import SOURCES, SimClock, make_source
from .costmodel import CostModel
from .ledger import Ledger
from .options import add_dataclass_args, check_range, option
from .profile import ProfileRecorder, write_profile
from .program import Program
from .results import CHECKPOINTS, SUMMARY, Checkpointer, RunWriter, recover_publish, to_jsonable
from .threads import cap_threads
from .timeline import Timeline
from .topology import Topology

__all__ = ["add_common_args", "add_training_args", "CommonConfig", "Run",
           "start_run", "main_guard", "versions", "check_world_size", "expected_world_size",
           "RunCheckpoints", "Progress"]


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every spardist command shares: the fields of :class:`CommonConfig`
    (results, seed, device, topology, collectives, cost model)."""
    return add_dataclass_args(parser, CommonConfig)


def add_cost_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the cost-model flags only (``--intra-bw`` ... ``--inter-lat``; commands that model but
    do not run, e.g. ``commvol predict``)."""
    return add_dataclass_args(parser, CommonConfig, only=COST_FIELDS)


#: the cost-model fields of :class:`CommonConfig`
COST_FIELDS = ("intra_bw", "inter_bw", "intra_lat", "inter_lat")


def add_training_args(parser: argparse.ArgumentParser, unit: str,
                      progress_every: int) -> argparse.ArgumentParser:
    """Add ``--checkpoint-every``, ``--resume`` and ``--progress-every`` (long MPI trainers).

    ``unit`` names what is counted ("iteration", "step"); ``progress_every`` is the default
    of ``--progress-every``.
    """
    g = parser.add_argument_group("checkpoints and progress")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help=f"checkpoint every rank's complete state after every N-th {unit} and at "
                        "the end, into OUT/checkpoints (default 0: never)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint intact on every "
                        "rank; the result equals an uninterrupted run")
    g.add_argument("--progress-every", type=int, default=progress_every, metavar="N",
                   help=f"rank 0 reports progress every N {unit}s on stderr (a progress bar when "
                        "stderr is a terminal; default %(default)s, 0: quiet)")
    return parser


RUN = "run (shared by every spardist command)"
CLOCK = "simulated clock"
#: ``--clock`` modes
CLOCKS = ("timeline", "additive")
COST = "cost model (alpha-beta per link class)"


@dataclass(frozen=True)
class CommonConfig:
    """The shared options, frozen (written into ``summary.json``); validated on construction
    (values are echoed in the units of the command line)."""

    out: str | None = option(
        None, "results directory (default: results/<system>_<method>); a directory holding a "
        "finished run is refused unless --overwrite is given", type=Path, group=RUN)
    overwrite: bool = option(
        False, "replace the run in --out (its checkpoints are removed at the start, its summary "
        "and metrics when this run finishes)", group=RUN)
    seed: int = option(0, "run seed (shared randomness)", group=RUN)
    device: str = option("cpu", "array backend: NumPy (cpu) or CuPy (gpu)",
                         choices=("cpu", "gpu"), group=RUN)
    ranks_per_node: int | None = option(
        None, "simulate nodes of R consecutive ranks (default: real shared-memory nodes)",
        metavar="R", group=RUN)
    node_map: str | None = option(
        None, "simulate nodes of any placement: round-robin:R (rank r on node r mod (world/R), "
        "as a hostfile cycled over hosts gives), block:R (= --ranks-per-node R) or the node of "
        "every rank (0,1,0,1)", metavar="MAP", group=RUN)
    collectives: str | None = option(
        None, "exact: spardist's own point-to-point collectives, the bytes booked are the bytes "
        "sent on any MPI; native: the MPI library's, pinned to the booked algorithm where known "
        "(default: $SPARDIST_COLLECTIVES or exact)", choices=coll.MODES, group=RUN)
    overlap: str = option(
        "on", "on: calls the system issues without waiting (DDP's buckets during the backward, "
        "SSFusion's buffers) run on a communication thread while the rank computes, and the "
        "timeline overlaps them the same way; off: every call blocks where it is issued, in "
        "the run and on the timeline (the no-overlap reference)", choices=("on", "off"),
        group=RUN)
    intra_bw: float = option(cm.DEFAULT_INTRA_GBPS, "intra-node bandwidth in Gbit/s "
                             "(default %(default)s: NVLink-class)", metavar="GBPS", group=COST)
    inter_bw: float = option(cm.DEFAULT_INTER_GBPS, "inter-node bandwidth in Gbit/s "
                             "(default %(default)s: InfiniBand-class)", metavar="GBPS",
                             group=COST)
    intra_lat: float = option(cm.DEFAULT_INTRA_LAT_US, "intra-node latency in microseconds",
                              metavar="US", group=COST)
    inter_lat: float = option(cm.DEFAULT_INTER_LAT_US, "inter-node latency in microseconds",
                              metavar="US", group=COST)
    clock: str = option(
        "timeline", "timeline: per-rank events (per-layer compute, transfers that start when "
        "their data is ready, links shared by concurrent transfers), step time = critical path; "
        "additive: compute + every call's alpha-beta time, no overlap", choices=CLOCKS,
        group=CLOCK)
    compute_source: str = option(
        "auto", "how compute events are timed: cpu (thread CPU time: does not grow when ranks "
        "share cores), calibrated (the least of the first measurements of each event, then "
        "fixed), wall (grows with load), cuda (CUDA events), flops (FLOP roofline at "
        "--device-tflops), profile (each event's least cost in --compute-profile FILE: "
        "load-independent); auto: cuda on a GPU, else cpu", choices=SOURCES, group=CLOCK)
    compute_profile: str | None = option(
        None, "compute profile read by --compute-source profile (a file written by "
        "--compute-profile-out on a quiet run of the same job)", metavar="FILE", group=CLOCK)
    compute_profile_partial: bool = option(
        False, "use --compute-profile although it was recorded for another job (other model, "
        "system, options or world size): events it lacks are measured, and the summary says "
        "what fraction of the compute that was", group=CLOCK)
    compute_profile_out: str | None = option(
        None, "record a compute profile of this run (per event: the least, median and count of "
        "its measurements by the compute source, per rank) into FILE when the run finishes; an "
        "existing FILE is refused unless --overwrite", metavar="FILE", group=CLOCK)
    device_tflops: float | None = option(
        None, "peak TFLOP/s of the modeled device (compute-source flops)", metavar="TFLOPS",
        group=CLOCK)
    device_gbs: float | None = option(
        None, "memory bandwidth in GB/s of the modeled device (roofline; compute-source flops)",
        metavar="GBS", group=CLOCK)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        check_range("--intra-bw", self.intra_bw, gt=0, unit="Gbit/s")
        check_range("--inter-bw", self.inter_bw, gt=0, unit="Gbit/s")
        check_range("--intra-lat", self.intra_lat, ge=0, unit="microseconds")
        check_range("--inter-lat", self.inter_lat, ge=0, unit="microseconds")
        for flag, v in (("--device-tflops", self.device_tflops),
                        ("--device-gbs", self.device_gbs)):
            if v is not None:
                check_range(flag, v, gt=0)
        if self.compute_source == "flops" and self.device_tflops is None:
            raise ValueError("--compute-source flops needs --device-tflops (the modeled "
                             "device's peak, e.g. 15.7 for a V100)")
        if self.compute_source in ("flops", "calibrated") and self.clock == "additive":
            raise ValueError(f"--compute-source {self.compute_source} needs --clock timeline")
        if self.compute_source == "profile" and self.compute_profile is None:
            raise ValueError("--compute-source profile needs --compute-profile FILE (a profile "
                             "written by --compute-profile-out FILE on a quiet run of the same "
                             "job)")
        if self.compute_profile is not None and self.compute_source != "profile":
            raise ValueError(f"--compute-profile {self.compute_profile} is only read by "
                             f"--compute-source profile (got --compute-source "
                             f"{self.compute_source}): add --compute-source profile or drop "
                             "--compute-profile")
        if self.compute_profile_out is not None and self.compute_source in ("profile", "flops"):
            raise ValueError(f"--compute-profile-out records measured compute, and "
                             f"--compute-source {self.compute_source} measures none: record "
                             "with --compute-source cpu (or calibrated, wall, cuda)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CommonConfig":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
        if kw.get("out") is not None:
            kw["out"] = str(kw["out"])
        if kw.get("collectives") is None:
            kw["collectives"] = coll.default_mode()
        return cls(**kw)

    def cost_model(self) -> CostModel:
        return CostModel.from_cli(self.intra_bw, self.inter_bw, self.intra_lat, self.inter_lat)


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


def git_commit(where: Path | None = None) -> str:
    """The commit of the checkout spardist runs from (``+dirty`` with local changes), or
    ``"not a checkout"``."""
    where = where or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
        if head.returncode:
            return "not a checkout"
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=False).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "not a checkout"


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
#: tag of the one point-to-point message of finish(): the busiest rank's last step to rank 0
_TAG_BUSIEST = 7301


class Run:
    """Everything a command needs: topology, communicators, ledger, cost model, clock, backend,
    results writer.  Built by :func:`start_run`.

    ``previous`` says what ``--out`` held when the run started: ``"new"`` (nothing to keep or
    replaced with ``--overwrite``), ``"interrupted"`` or ``"finished"`` (with ``--resume``).
    """

    def __init__(self, *, system: str, method: str, common: CommonConfig, config,
                 topo: Topology, backend: Backend, writer: RunWriter,
                 previous: str = "new", unit: str = "step") -> None:
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
        self.clock = SimClock(
            self.ledger, sync=sync, source=source, gpu=backend.is_gpu,
            timeline=Timeline(self.cost) if common.clock == "timeline" else None)
        self.recorder.timeline = self.clock.timeline   # every call declares its own event
        self.recorder.overlap = common.overlap == "on"
        #: the rank's event program, recorded beside the compute profile (for replay)
        self.program = None
        if common.compute_profile_out is not None and self.clock.timeline is not None:
            self.program = Program()
            self.recorder.program = self.clock.program = self.clock.layers.program = \
                self.program
        self.writer = writer
        self.out = writer.out
        self.previous = previous
        self._t0 = time.time()
        self.finished = False
        #: which collectives ran and whether the wire carries what the ledger books (collective)
        self.collectives = coll.describe(self.world.mode, self.world.mpi)

    def log(self, index: int | None = None, /, **record) -> None:
        """One ``metrics.jsonl`` line (written by rank 0; pass values already reduced).

        Every line has one schema: ``unit`` (:attr:`unit`), ``index`` (also under the unit's own
        name, e.g. ``"step": 12``), ``intra_node_bytes`` and ``inter_node_bytes`` (world totals
        since the previous line), then the system's values.  ``run.log(k, loss=...)``; the older
        keyword form ``run.log(step=k, ...)`` is accepted.
        """
        if index is None:
            for key in (self.unit, *UNITS):
                if key in record:
                    index = record.pop(key)
                    break
            else:
                raise TypeError(f"run.log needs the {self.unit} index: run.log(k, ...)")
        line = {"unit": self.unit, "index": int(index), self.unit: int(index),
                "intra_node_bytes": record.pop("intra_node_bytes", None),
                "inter_node_bytes": record.pop("inter_node_bytes", None)}
        line.update(record)
        self.writer.log(line)

    def finish(self, metrics: dict | None = None, predicted: dict | None = None,
               extra: dict | None = None) -> dict:
        """Reduce the ledger and timers over all ranks and publish ``summary.json`` (collective).

        Returns the summary dict on every rank.
        """
        measured = self.ledger.totals(self.world)
        t = self.clock.as_dict()
        timing = {k: float(self.world.mpi.allreduce(v, op=MPI.MAX)) for k, v in t.items()}
        # the timeline of rank 0 and of the rank with the longest simulated time (for Gantt
        # charts), and which compute source timed the events.  Only those two ranks' events
        # travel (the busiest sends its own to rank 0): this run-level bookkeeping is unbooked
        # traffic, so it is kept O(1) in the world size (a few KB; see the wire lab).
        sims = self.world.mpi.allgather(float(self.clock.sim_s))
        hosts = self.world.mpi.gather(platform.node(), root=0)
        busiest = int(np.argmax(sims))
        desc = self.clock.describe(events=self.rank in (0, busiest))
        gathered = self.world.mpi.gather((desc.get("compute_profile"),
                                          self.recorder.log.describe()), root=0)
        infos = [g[0] for g in gathered] if gathered is not None else None
        busiest_step = desc.get("last_step")
        if busiest != 0:
            if self.rank == busiest:
                self.world.mpi.send(busiest_step, dest=0, tag=_TAG_BUSIEST)
            elif self.rank == 0:
                busiest_step = self.world.mpi.recv(source=busiest, tag=_TAG_BUSIEST)
        tables = self.world.mpi.gather(
            (self.profile_recorder.table(),
             self.program.entries if self.program is not None else None), root=0) \
            if self.profile_recorder is not None else None
        timeline = None
        if self.rank == 0:
            timeline = {**{k: v for k, v in desc.items() if k != "last_step"},
                        "rank0": desc.get("last_step"), "busiest_rank": busiest,
                        "busiest": busiest_step}
            if infos[0] is not None and "fallback_blocks" in infos[0]:
                fb = sum(i["fallback_blocks"] for i in infos)
                fs = sum(i["fallback_s"] for i in infos)
                timeline["compute_profile"] = {
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
                timeline["compute_profile"] = self._write_profile(tables)
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
            "timeline": timeline,
            "calls": ({"per_rank": [g[1] for g in gathered],
                       "placement": self.topo.placement.describe()}
                      if gathered is not None else None),
        }
        if extra:
            summary.update(extra)
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
                            programs if all(p is not None for p in programs) else None)
        return {"recorded_to": str(path), "sha256": sha,
                "events_per_rank": [sum(len(p) for p in t.values()) for t in tables],
                "unlabelled_blocks": self.profile_recorder.unlabelled,
                "program_entries_per_rank": [len(p or ()) for p in programs],
                "program_unknown_deps": len(self.program.unknown) if self.program else None}


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


def _profile_provenance(run: "Run") -> dict:
    rec = run.profile_recorder
    return {"source": rec.base.describe(), "blas_threads": getattr(rec.base, "blas_threads",
                                                                   None),
            "job": job_of(run.system, run.method, run.size, run.config),
            "system": run.system, "method": run.method,
            "model": _config_dict(run.config).get("model"), "world": run.size,
            "ranks_per_node": run.common.ranks_per_node, "clock": run.common.clock,
            "out": str(run.out), "command": list(sys.argv), "spardist": versions()["spardist"]}


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)


def expected_world_size(env=None) -> tuple[int, str] | None:
    """The rank count the launcher asked for, and who said so, or ``None`` when unknown.

    In order: ``SPARDIST_NP`` (set by ``run_mpi.sh`` / ``substrate.launch``), the process
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
    raise ValueError(
        f"the launcher started {n} ranks ({var}={n}) but MPI sees a world of {size}: the ranks "
        f"did not find each other (singletons). Under Slurm with the MPICH wheel use "
        f"SPARDIST_LAUNCHER='srun --mpi=pmi2' (or plain mpiexec inside the allocation); with a "
        f"site MPI use the srun --mpi plugin it was built for (srun --mpi=list); make sure "
        f"mpiexec and mpi4py come from the same MPI library")


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
    if overwrite:
        for p in checkpoints:
            p.unlink(missing_ok=True)
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


def _inspect_profile_out(path: Path, *, overwrite: bool) -> str | None:
    """Why ``--compute-profile-out`` cannot be written at the end of the run, or ``None``: an
    existing file is kept unless ``--overwrite`` (the rule of ``--out``'s results)."""
    if path.is_dir():
        return (f"--compute-profile-out {path} is a directory: pass a file path (e.g. "
                f"{path / 'profile.json'})")
    if path.exists() and not overwrite:
        return (f"--compute-profile-out {path} already exists: pass --overwrite to replace it, "
                "or choose another file")
    why = _dir_write_error(path.parent)
    if why:
        return (f"--compute-profile-out {path}: its directory is not writable ({why}): choose a "
                "file in a directory you can write to")
    return None


def _prepare_out(out: Path, topo: Topology, *, resume: bool, overwrite: bool,
                 profile_out: str | None = None) -> str:
    """Collective: rank 0 inspects ``out`` (and ``--compute-profile-out``), every rank gets
    the verdict and raises the same error (bookkeeping: not booked in the ledger)."""
    verdict = None
    if topo.rank == 0:
        verdict = _inspect_out(out, resume=resume, overwrite=overwrite)
        if verdict[1] is None and profile_out is not None:
            verdict = (verdict[0], _inspect_profile_out(Path(profile_out), overwrite=overwrite))
    previous, error = topo.world.mpi.bcast(verdict, root=0)
    if error:
        raise ValueError(error)
    return previous


#: the link to the newest run folder in ``results/<system>_<method>/``
LATEST = "latest"


def _default_out(system: str, method: str, topo: Topology, resume: bool) -> Path:
    """The run folder when ``--out`` is not given (collective): a new
    ``results/<system>_<method>/run-N`` (``N`` one more than the largest there, created
    atomically, so no run ever lands in another's folder) with ``latest`` pointing at it; with
    ``--resume``, the folder ``latest`` points at."""
    base = Path("results") / f"{system}_{method}"
    verdict = None
    if topo.rank == 0:
        try:
            verdict = (str(_new_run_dir(base)), None) if not resume else _latest(base)
        except OSError as exc:
            verdict = (None, f"cannot create a run folder under {base} ({exc.strerror or exc}): "
                             "pass --out DIR in a directory you can write to")
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
    resume = bool(getattr(args, "resume", False))
    if comm is None:
        check_world_size(MPI.COMM_WORLD.Get_size())
    cost = common.cost_model()
    topo = Topology.from_comm(comm if comm is not None else MPI.COMM_WORLD,
                              ranks_per_node=common.ranks_per_node,
                              node_map=common.node_map, cost=cost,
                              collectives=common.collectives)
    out = Path(common.out) if common.out else _default_out(system, method, topo, resume)
    previous = _prepare_out(out, topo, resume=resume, overwrite=common.overwrite,
                            profile_out=common.compute_profile_out)
    # however the ranks were launched, each caps its own compute threads (plain mpiexec/srun
    # set nothing: its BLAS pools would take every core and the cpu clock would change)
    threads = cap_threads(topo.real_node_ranks)
    backend = get_backend(common.device, topo.gpu_index)
    topo.bind_backend(backend)
    writer = RunWriter(out, enabled=topo.rank == 0)
    run = Run(system=system, method=method, common=common, config=config, topo=topo,
              unit=unit, backend=backend, writer=writer, previous=previous)
    run.threads = threads
    blas = threads["blas_threads"] or 1
    if topo.rank == 0 and blas > 1 and common.compute_source in ("auto", "cpu") and \
            not backend.is_gpu:
        print(f"spardist: note: {blas} BLAS threads per rank ({threads['set_by']}): the cpu "
              "compute source reads the process's CPU time (all its threads), not the "
              "thread's; set OMP_NUM_THREADS=1 for load-independent per-thread times",
              file=sys.stderr, flush=True)
    return run


# -- checkpoints -------------------------------------------------------------------------------
_LINKS = {"none": (), cm.INTRA: (cm.INTRA,), cm.INTER: (cm.INTER,),
          "mixed": (cm.INTRA, cm.INTER)}


def _restore_ledger(ledger: Ledger, entries: dict) -> None:
    """Make ``ledger`` hold exactly ``entries`` (``Ledger.local()`` of a checkpoint)."""
    ledger.reset()
    for phase, e in entries.items():
        ledger.record(phase, payload=e["payload_bytes"], intra=e["intra_bytes"],
                      inter=e["inter_bytes"], messages=e["messages"], modeled_s=e["modeled_s"],
                      links=_LINKS[e["link"]], calls=e["calls"])


class RunCheckpoints:
    """Checkpoint and resume a training loop (every trainer uses this one class).

    A checkpoint holds the trainer's state (a dict of arrays; JSON text for nested values)
    plus the run's own: the ledger of this rank (so the resumed run's traffic is the whole
    run's), its measured compute time, rank 0's metrics lines up to the checkpoint (a resumed
    run neither loses nor repeats a line) and a fingerprint of everything that must not change.
    Files: ``OUT/checkpoints/ckpt-r{rank}-s{done:08d}.npz`` (newest two kept), written after every
    ``every``-th unit and at the end.

    Parameters
    ----------
    run : Run
    every : int
        ``--checkpoint-every`` (0: never save).
    fingerprint : dict
        JSON-able values a resumed run must share (configuration without the resumable fields);
        the common options but ``--out``/``--overwrite`` and the world size are added.
    unit, flag : str
        What is counted ("iteration") and the flag of the total ("--iters"), for messages.
    """

    def __init__(self, run: Run, *, every: int, fingerprint: dict, unit: str, flag: str) -> None:
        if every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got {every}")
        self.run = run
        self.every = every
        self.unit, self.flag = unit, flag
        common = {k: v for k, v in dataclasses.asdict(run.common).items()
                  if k not in ("out", "overwrite")}
        fp = {**fingerprint, **common, "world": run.size}
        self.fingerprint = json.loads(json.dumps(to_jsonable(fp)))  # as it comes back
        self.ckpt = Checkpointer(Path(run.out) / CHECKPOINTS, rank=run.rank)

    def due(self, done: int, last: bool) -> bool:
        """Whether to save after ``done`` units (``last``: the loop is over)."""
        return bool(self.every) and (done % self.every == 0 or last)

    def save(self, done: int, state: dict) -> None:
        """Write this rank's checkpoint after ``done`` units (every rank calls it)."""
        run = self.run
        full = {**state,
                "run/fingerprint": json.dumps(self.fingerprint),
                "run/ledger": json.dumps(run.ledger.local()),
                "run/clock": json.dumps(run.clock.state()),
                "run/metrics": json.dumps(run.writer.records)}
        self.ckpt.save(full, done)

    def resume(self, total: int) -> tuple[int, dict]:
        """Load the newest checkpoint intact on every rank (collective).

        Restores the ledger, the compute time and the metrics lines, checks the fingerprint and
        ``total``; returns ``(units done, the trainer's state)``.

        Raises
        ------
        ValueError
            No checkpoint; none intact on every rank (naming the damaged files); a different
            configuration; ``total`` below the units done; a finished run with nothing left.
        """
        run, ck = self.run, self.ckpt
        intact, corrupt = ck.scan()
        views = run.world.mpi.allgather((intact, corrupt))
        common = set(views[0][0]).intersection(*(set(v[0]) for v in views[1:]))
        damaged = [f"{Checkpointer(ck.dir, r).path(s)} ({why})"
                   for r, (_, bad) in enumerate(views) for s, why in sorted(bad.items())]
        if not common:
            if not damaged:
                have = ", ".join(f"rank {r}: {v[0]}" for r, v in enumerate(views) if v[0])
                raise ValueError(
                    f"--resume: no checkpoint of every rank in {ck.dir} "
                    f"({'steps per rank: ' + have if have else 'no checkpoint at all'}); run "
                    "without --resume to start afresh, or pass the --out of a run that used "
                    "--checkpoint-every N")
            good = {r: v[0][-1] for r, v in enumerate(views) if v[0]}
            last = ("; the last good checkpoint per rank: " + ", ".join(
                str(Checkpointer(ck.dir, r).path(s)) for r, s in good.items())) if good else ""
            raise ValueError(f"--resume: no checkpoint in {ck.dir} is intact on every rank: "
                             f"damaged: {'; '.join(damaged)}{last}; restore the files or start "
                             "afresh with --overwrite")
        step = max(common)
        newer_damaged = [(r, s) for r, (_, bad) in enumerate(views) for s in bad if s > step]
        if newer_damaged:
            for r, s in newer_damaged:
                if r == run.rank:
                    ck.set_aside(s)
            if run.rank == 0:
                print(f"spardist: warning: damaged checkpoint(s): {'; '.join(damaged)}; resuming "
                      f"from {self.unit} {step}, the newest checkpoint intact on every rank "
                      f"({ck.path(step)}): safe, the {self.unit}s after it are recomputed with "
                      "the same result (damaged files renamed to *.corrupt)",
                      file=sys.stderr, flush=True)
        state = ck.load(step)
        saved = json.loads(str(state.pop("run/fingerprint", "{}")))
        diff = sorted(k for k in set(saved) | set(self.fingerprint)
                      if saved.get(k) != self.fingerprint.get(k))
        if diff:
            raise ValueError(
                f"--resume: the checkpoint in {ck.dir} was written with different "
                + ", ".join(f"{k}={saved.get(k)!r} (now {self.fingerprint.get(k)!r})"
                            for k in diff)
                + f"; resume with the same options (only {self.flag}, --checkpoint-every and "
                  "--progress-every may change) or start afresh with --overwrite")
        if step > total:
            raise ValueError(f"--resume: {self.flag} {total} is smaller than the {step} "
                             f"{self.unit}s already done ({ck.path(step)}): pass {self.flag} "
                             f"{step} or more to continue, or start afresh with --overwrite")
        if step == total and run.previous == "finished":
            raise ValueError(f"--resume: the run in {run.out} already finished its {total} "
                             f"{self.unit}s ({SUMMARY}): pass a larger {self.flag} to train "
                             "further, or start afresh with --overwrite")
        _restore_ledger(run.ledger, json.loads(str(state.pop("run/ledger"))))
        run.clock.load_state(json.loads(str(state.pop("run/clock"))))
        for line in json.loads(str(state.pop("run/metrics"))):
            run.writer.log(json.loads(line))
        return step, state


# -- progress ----------------------------------------------------------------------------------
def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


class Progress:
    """Progress of a long run, on rank 0's stderr: a tqdm bar when stderr is a terminal,
    otherwise one line every ``every`` units (and at the last); ``every = 0`` is quiet.

    :meth:`update` takes the units done and named values, e.g. ``loss``, ``test_accuracy``:
    floats are printed with 4 decimals, ``inter_bytes`` / ``total_bytes`` (wire bytes so far) in
    MiB, NaN and ``None`` are left out (rank 0 alone evaluates, other ranks hold NaN).
    """

    def __init__(self, run: Run, *, total: int, unit: str, every: int, start: int = 0) -> None:
        if every < 0:
            raise ValueError(f"--progress-every must be >= 0 (0: quiet), got {every}")
        self.total, self.unit, self.every = total, unit, every
        self.enabled = run.rank == 0 and every > 0
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm  # noqa: PLC0415 (10 MiB a rank; rank 0 on a terminal only)

            self.bar = tqdm(total=total, initial=start, unit=unit, desc=run.method,
                            file=sys.stderr, leave=False)

    @staticmethod
    def _fields(values: dict) -> dict[str, str]:
        out = {}
        for key, v in values.items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            if key in ("inter_bytes", "total_bytes"):
                out[{"inter_bytes": "inter-node", "total_bytes": "total"}[key]] = _mib(v)
            elif isinstance(v, float):
                out[key] = f"{v:.4f}"
            else:
                out[key] = str(v)
        return out

    def update(self, done: int, **values) -> None:
        """Report ``done`` units of :attr:`total` (rank 0; other ranks do nothing)."""
        if not self.enabled:
            return
        fields = self._fields(values)
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(done - self.bar.n)  # redrawn at most every tqdm.mininterval
        elif done % self.every == 0 or done == self.total:
            text = "  ".join(f"{k} {v}" for k, v in fields.items())
            print(f"spardist: {self.unit} {done}/{self.total}  {text}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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
    text = f"{type(exc).__name__}: {exc}"
    detail = "" if isinstance(exc, ValueError) else traceback.format_exc()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if errors_comm is None:
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
