"""PacTrain (seed 002): Fig. 5, time to 84 % accuracy of ResNet-152 on CIFAR-10 at 1 Gbit/s,
PacTrain against the all-reduce (native DDP) and FP16 baselines.

Time to accuracy is (epochs to the target) x (time an epoch).  The paper states neither the
epochs to 84 % nor any time, only the two ratios; so the epochs are an input, and the paper
gives none: every method is taken to need the same number of epochs (the row says so), and the
prediction is the ratio of the times of an epoch -- ``ceil(50,000 / (8 x 32))`` steps, each the
job simulation of every rank's program (:class:`commvol.job.Job`) on ``pactrain-a40-1gbps``.  A
miss's diagnosis gives the ratio of epochs the paper's number implies.
"""

from __future__ import annotations

import math

from simulation.cluster import Cluster
from simulation.jobsim import JobSimOptions

from ..job import Job
from ..predict import resolve_model
from ..systems import get_system
from ..workload import DeviceModel, units_for_spec
from . import Figure, Input, Row, cluster_inputs, paper_value, toml_input

__all__ = ["figures", "inputs"]

PAPER = "pactrain"
CLUSTER = "pactrain-a40-1gbps"
DATASET_SIZE = 50_000
#: PyTorch DDP's default bucket (PacTrain's hook replaces DDP's all-reduce bucket by bucket)
DDP_BUCKET_MIB = 25.0
#: the three series: TOML vs-name -> (system, options)
SYSTEMS = {"All-reduce (native DDP)": ("ddp", {"bucket_mib": DDP_BUCKET_MIB}),
           "FP16": ("fp16", {"bucket_mib": DDP_BUCKET_MIB}),
           "PacTrain": ("pactrain", {"prune_ratio": 0.5, "ternary": True,
                                     "bucket_mib": DDP_BUCKET_MIB})}


def inputs() -> list[Input]:
    f = "fig5"
    return [toml_input(PAPER, f, "model"), toml_input(PAPER, f, "dataset"),
            Input("pactrain.dataset_size", DATASET_SIZE, "images an epoch",
                  "CIFAR-10's training set (Krizhevsky 2009: 50,000 training images)"),
            toml_input(PAPER, f, "workers"), toml_input(PAPER, f, "batch_per_gpu"),
            toml_input(PAPER, f, "bandwidth"), toml_input(PAPER, f, "pruning_ratio"),
            toml_input(PAPER, f, "gradient_quantization"),
            toml_input(PAPER, f, "target_accuracy"),
            Input("pactrain.epochs_to_target", "equal for the three methods", "",
                  "not stated in the paper (neither epochs nor times to 84 %, only the two "
                  "ratios): the one input the prediction cannot take from the paper; a miss's "
                  "diagnosis prints the ratio of epochs the paper's number implies"),
            Input("pytorch.ddp_bucket_cap_mb", DDP_BUCKET_MIB, "MiB",
                  "PyTorch torch.nn.parallel.DistributedDataParallel: bucket_cap_mb default 25 "
                  "(DDP, FP16 and PacTrain's communication hook work bucket by bucket)"),
            Input("jobsim.link_sharing", JobSimOptions().link_sharing, "",
                  "simulation.jobsim default (a NIC sends one message at a time)"),
            *cluster_inputs(Cluster.load(CLUSTER))]


def epoch_seconds(quick: bool = False) -> dict:
    """``{series: (step seconds, steps an epoch, seconds an epoch)}`` of the three methods."""
    cluster = Cluster.load(CLUSTER)
    spec = resolve_model("resnet152", "cifar10")
    units, _ = units_for_spec(spec, "resnet152", "cifar10")
    device = DeviceModel(cluster.device)
    workers, batch = 8, 32
    steps = math.ceil(DATASET_SIZE / (workers * batch))
    out = {}
    for series, (system, kw) in SYSTEMS.items():
        opts, assumptions = get_system(system).split(kw)
        job = Job(system, spec, workers, 1, opts, units, device, batch, steps=1 if quick else 2,
                  assumptions=assumptions)
        step = job.run(cluster, JobSimOptions(cluster=CLUSTER))["step_s"]
        out[series] = (step, steps, step * steps)
    return out


def fig5(quick: bool = False) -> Figure:
    t = epoch_seconds(quick)
    mine = t["PacTrain"][2]
    rows = []
    for vs in ("All-reduce (native DDP)", "FP16"):
        S = paper_value(PAPER, "fig5", series="PacTrain", quantity="time-to-accuracy speedup",
                        at={"accuracy_pct": 84, "bandwidth_gbps": 1}, vs=vs)
        ours = t[vs][2] / mine
        rows.append(Row("PacTrain", "84 %, 1 Gbit/s", f"time-to-accuracy speedup over {vs}",
                        "x", S, ours,
                        note=(f"equal epochs to 84 % assumed (the paper states none): the "
                              f"ratio of the times of an epoch, {t[vs][2]:.1f} s / {mine:.1f} s "
                              f"({t[vs][1]} steps of {t[vs][0]:.3f} s / {t['PacTrain'][0]:.3f}"
                              " s)"),
                        diagnosis=(f"the epochs to 84 % are not stated, so they are taken equal. "
                                   f"The single input: the ratio of epochs to 84 %; the paper's "
                                   f"{S}x with our times an epoch implies that {vs} needs "
                                   f"{S / ours:.2f}x PacTrain's epochs, i.e. PacTrain "
                                   + (f"{ours / S:.2f}x the baseline's (plausible for pruned, "
                                      "ternarized gradients, though the paper credits PacTrain "
                                      "with a better convergence rate, IV-C-2); or the wire "
                                      "format of the ternary values, not stated, is wider than "
                                      "the 2-bit codes we send" if S < ours else
                                      f"{ours / S:.2f}x the baseline's (plausible: the paper "
                                      "credits PacTrain's pruning and quantization with a "
                                      "better convergence rate, IV-C-2)"))))
    for r in rows:
        if r.within:
            r.diagnosis = ""
    return Figure(PAPER, "fig5", "Time to 84 % accuracy, ResNet-152 on CIFAR-10, 8 A40 workers "
                  "at 1 Gbit/s: PacTrain over all-reduce and FP16", rows, inputs(),
                  note=("Seconds an epoch (steps x the simulated steady step): " + ", ".join(
                      f"{s}: {v[2]:.1f} s" for s, v in t.items()) + ". PacTrain: pruning ratio "
                      "0.5, the packed survivors ternarized (TernGrad's 2-bit codes "
                      "all-gathered), once the masks are stable (the steady step)."))


def figures(quick: bool = False) -> list[Figure]:
    return [fig5(quick)]
