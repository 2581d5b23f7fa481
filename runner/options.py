"""The options every spardist command shares (one frozen dataclass, one flag each)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from simulation.clock import SOURCES
from simulation.jobsim import JobSimOptions
from simulation.trace import parse_steps
from substrate import costmodel as cm
from substrate import pinning as coll
from substrate.costmodel import CostModel
from substrate.options import add_dataclass_args, check_range, option


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every spardist command shares: the fields of :class:`CommonConfig`
    (results, seed, device, topology, collectives, cost model, clock), the job simulation's
    (:class:`simulation.jobsim.JobSimOptions`: the network the run's steps are simulated on),
    and ``--version``."""
    add_version_arg(parser)
    add_dataclass_args(parser, CommonConfig)
    return add_dataclass_args(parser, JobSimOptions)


def add_version_arg(parser: argparse.ArgumentParser) -> None:
    """``--version``: the installed spardist's version (once per parser)."""
    if "--version" not in parser._option_string_actions:
        try:
            v = version("spardist")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        parser.add_argument("--version", action="version", version=f"spardist {v}")


def add_cost_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the cost-model flags only (``--intra-bw`` ... ``--inter-lat``; commands that model but
    do not run, e.g. ``commvol predict``)."""
    return add_dataclass_args(parser, CommonConfig, only=COST_FIELDS)


#: the cost-model fields of :class:`CommonConfig`
COST_FIELDS = ("intra_bw", "inter_bw", "intra_lat", "inter_lat")


def cost_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model of the cost-model flags alone (:func:`add_cost_args`: a command that
    models without running), checked as every command checks them."""
    return CommonConfig(**{k: getattr(args, k) for k in COST_FIELDS}).cost_model()


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
COST = "cost model (alpha-beta per link class)"


@dataclass(frozen=True)
class CommonConfig:
    """The shared options, frozen (written into ``summary.json``); validated on construction
    (values are echoed in the units of the command line)."""

    out: str | None = option(
        None, "results directory (default: results/<system>_<method>); a directory holding a "
        "finished run is refused unless --overwrite is given", type=Path, group=RUN)
    overwrite: bool = option(
        False, "replace the run in --out when this run finishes: until then its summary, "
        "metrics and checkpoints stay as they are (this run's checkpoints wait in "
        "OUT/checkpoints.pending); a run that fails leaves it as it was", group=RUN)
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
        "on", "on: calls the system issues without waiting (the buckets of DDP and "
        "PacTrain, SDP's holder sets and SSFusion's buffers, sent from the backward as it "
        "writes them) run on a communication thread while the rank computes, and the job "
        "simulation overlaps them the same way; off: every call blocks where it is issued "
        "(after the backward), in the run and in its simulation (the no-overlap reference)",
        choices=("on", "off"),
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
    trace: str | None = option(
        None, "write the simulated steps --trace-steps of every rank (the job simulation's "
        "compute blocks and calls) as Chrome Trace Event JSON into FILE when the run finishes (Perfetto, chrome://tracing); an existing FILE is refused "
        "unless --overwrite", metavar="FILE", group=CLOCK)
    trace_steps: str = option(
        "last", "steps written by --trace: indices and ranges (0,3-5), last, or all",
        metavar="STEPS", group=CLOCK)
    device_tflops: float | None = option(
        None, "peak TFLOP/s of the modeled device (compute-source flops)", metavar="TFLOPS",
        group=CLOCK)
    device_gbs: float | None = option(
        None, "memory bandwidth in GB/s of the modeled device (roofline; compute-source flops)",
        metavar="GBS", group=CLOCK)

    def __post_init__(self) -> None:
        parse_steps(self.trace_steps)          # a malformed --trace-steps stops here
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
    def from_args(cls, args: argparse.Namespace) -> CommonConfig:
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
        if kw.get("out") is not None:
            kw["out"] = str(kw["out"])
        if kw.get("collectives") is None:
            kw["collectives"] = coll.default_mode()
        return cls(**kw)

    def cost_model(self) -> CostModel:
        return CostModel.from_cli(self.intra_bw, self.inter_bw, self.intra_lat, self.inter_lat)
