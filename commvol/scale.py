"""``python -m commvol scale``: strong-scaling speedup and efficiency (the PruneX Fig. 9 analogue).

    python -m commvol scale --system hsadmm ddp topk --model resnet152 --gpus 8 16 32 64 \\
        --gpus-per-node 4 [--compute-s-per-sample S | --device-tflops F] [--out scale.json]

Model of one pass over the data (an "epoch", fixed total work: strong scaling) on ``p`` GPUs,
``M = p / gpus-per-node`` nodes::

    T(p) = (D / p) · t_s  +  u(p) · c(p)

* ``D`` samples (``--dataset-size``, default 50,000: CIFAR-10), ``t_s`` seconds of forward +
  backward per sample and rank: measured here (a few ``loss_and_grad`` passes of the real model on
  this machine, ``--device``), or ``--compute-s-per-sample``, or ``3 x FLOPs per sample /
  (--device-tflops x 1e12)`` (backward ~ 2 x forward);
* ``c(p)``: modeled communication time of one iteration (:mod:`commvol.systems`, the α–β cost
  model; H-SADMM after the mask freeze), ``u(p)`` iterations per epoch: ``ceil(D / (p b)) /
  steps-per-iter`` for data-parallel systems (``b`` = ``--batch-size`` per rank), ``1 /
  local-epochs`` for ADMM (one outer iteration runs ``local-epochs`` epochs of local SGD).

Speedup ``S(p) = T(p_0) / T(p)`` against the first GPU count ``p_0``; efficiency ``S(p) p_0 / p``.
Communication is not overlapped with compute (as the simulated clock), and Top-K's selection cost
is not modeled (PruneX attributes part of Top-K's poor scaling to it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from substrate.backend import get_backend

from .predict import (
    add_cost_args,
    add_model_args,
    add_system_option_args,
    cost_from_args,
    resolve_model,
    system_options,
)
from .specs import SPEC_ARCH, build_trainable
from .systems import get_system

__all__ = ["SPEC_ARCH", "build_trainable", "measure_compute_s_per_sample", "strong_scaling",
           "format_scaling", "add_parser", "run"]

def measure_compute_s_per_sample(model: str, dataset: str = "digits", *, batch: int = 4,
                                 reps: int = 2, device: str = "cpu") -> float:
    """Seconds of one forward + backward pass per sample: one warm-up, then ``reps`` timed
    ``loss_and_grad`` calls on a random batch of ``batch`` samples."""
    if batch < 1 or reps < 1:
        raise ValueError(f"--timing-batch and --timing-reps must be >= 1, got {batch}, {reps}")
    backend = get_backend(device)
    xp = backend.xp
    net = build_trainable(model, dataset, xp=xp)
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((batch, *net.input_shape)).astype(np.float32))
    y = xp.asarray(rng.integers(0, net.num_classes, batch))
    net.loss_and_grad(x, y)
    backend.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        net.loss_and_grad(x, y)
    backend.synchronize()
    return (time.perf_counter() - t) / (reps * batch)


def strong_scaling(system: str, spec, gpus, gpus_per_node: int, *, compute_s_per_sample: float,
                   dataset_size: int = 50_000, batch_size: int = 128, cost=None,
                   **options) -> list[dict]:
    """Rows ``{gpus, nodes, compute_s, comm_s, time_s, speedup, efficiency, ...}`` per GPU count
    (see the module docstring).

    Raises
    ------
    ValueError
        For a GPU count that is not a positive multiple of ``gpus_per_node``, or a system that is
        not data-parallel training of a model.
    """
    sm = get_system(system)
    if sm.spec_kind != "model":
        raise ValueError(f"scale models data-parallel training of a model; --system {system} is "
                         "model-parallel sparse SGD: use `predict` or `partition-table`")
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    gpus = [int(g) for g in gpus]
    bad = [g for g in gpus if g < 1 or g % gpus_per_node]
    if bad or not gpus:
        raise ValueError(f"--gpus {bad or gpus} must be positive multiples of --gpus-per-node "
                         f"{gpus_per_node}")
    if not compute_s_per_sample >= 0 or dataset_size < 1 or batch_size < 1:
        raise ValueError("--compute-s-per-sample must be >= 0, --dataset-size and --batch-size "
                         ">= 1")
    if "batch_size" in sm.fields():
        options = {**options, "batch_size": batch_size}
    opts, assumptions = sm.split(options)
    rows = []
    for g in gpus:
        M = g // gpus_per_node
        pred = sm(spec, M, gpus_per_node, options, cost)
        it = pred.steady
        per_rank = dataset_size / g
        units = sm.units_per_epoch(opts, per_rank, batch_size, assumptions)
        compute = per_rank * compute_s_per_sample
        comm = units * it.time_s
        rows.append({"system": system, "gpus": g, "nodes": M, "iterations_per_epoch": units,
                     "comm_s_per_iteration": it.time_s, "inter_bytes_per_iteration": it.inter,
                     "compute_s": compute, "comm_s": comm, "time_s": compute + comm})
    t0, p0 = rows[0]["time_s"], rows[0]["gpus"]
    for r in rows:
        r["speedup"] = t0 / r["time_s"] if r["time_s"] > 0 else float("nan")
        r["efficiency"] = r["speedup"] * p0 / r["gpus"]
    return rows


def format_scaling(table: dict[str, list[dict]]) -> str:
    out = ["| system | GPUs | nodes | iters/epoch | compute s | comm s | time s/epoch | speedup "
           "| efficiency |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rows in table.items():
        for r in rows:
            out.append(f"| {name} | {r['gpus']} | {r['nodes']} | {r['iterations_per_epoch']:.3g} "
                       f"| {r['compute_s']:.3f} | {r['comm_s']:.3f} | {r['time_s']:.3f} | "
                       f"{r['speedup']:.2f}x | {100 * r['efficiency']:.1f} % |")
    return "\n".join(out)


def add_parser(sub) -> None:
    p = sub.add_parser("scale", help="strong-scaling speedup and efficiency (PruneX Fig. 9)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", nargs="+", default=["hsadmm", "ddp", "topk"],
                   help="systems to scale (default %(default)s)")
    add_model_args(p)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="GPU counts; the first is the baseline (default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--dataset-size", type=int, default=50_000,
                   help="samples per epoch (default %(default)s: CIFAR-10)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="per-GPU batch of the data-parallel systems (default %(default)s: "
                        "PruneX §5.1.5)")
    g = p.add_argument_group("compute time per sample (one of; default: measure here)")
    g.add_argument("--compute-s-per-sample", type=float, default=None)
    g.add_argument("--device-tflops", type=float, default=None,
                   help="derive it from the model's FLOPs at this sustained rate")
    g.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where to measure (default %(default)s)")
    g.add_argument("--timing-batch", type=int, default=4)
    g.add_argument("--timing-reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None,
                   help="write the rows as JSON (input of `report --scaling`)")
    add_system_option_args(p, exclude=("batch_size",))
    add_cost_args(p)
    p.set_defaults(func=run)


def run(args) -> dict:
    if args.model is None:
        raise ValueError("scale needs --model (e.g. resnet152, or cnn for the digits model)")
    spec = resolve_model(args.model, args.dataset)
    for name in args.system:
        get_system(name)  # unknown names list the valid ones before any timing
    if args.compute_s_per_sample is not None and args.device_tflops is not None:
        raise ValueError("pass --compute-s-per-sample or --device-tflops, not both")
    if args.compute_s_per_sample is not None:
        t_s, how = args.compute_s_per_sample, "given (--compute-s-per-sample)"
    elif args.device_tflops is not None:
        if not args.device_tflops > 0:
            raise ValueError(f"--device-tflops must be > 0, got {args.device_tflops}")
        t_s = 3 * spec.flops_per_sample / (args.device_tflops * 1e12)
        how = (f"3 x {spec.flops_per_sample / 1e9:.2f} GFLOP forward per sample at "
               f"{args.device_tflops:g} TFLOP/s (--device-tflops)")
    else:
        t_s = measure_compute_s_per_sample(args.model, args.dataset, batch=args.timing_batch,
                                           reps=args.timing_reps, device=args.device)
        how = (f"measured on this machine ({args.device}, batch {args.timing_batch}, "
               f"{args.timing_reps} passes after a warm-up)")
    cost = cost_from_args(args)
    table = {name: strong_scaling(name, spec, args.gpus, args.gpus_per_node,
                                  compute_s_per_sample=t_s, dataset_size=args.dataset_size,
                                  batch_size=args.batch_size, cost=cost,
                                  **{k: v for k, v in system_options(name, args).items()
                                     if k != "batch_size"})
             for name in args.system}
    d = cost.describe()
    print(f"# strong scaling of {spec.name} ({spec.num_params:,} parameters), baseline "
          f"{args.gpus[0]} GPUs\n")
    print(format_scaling(table))
    print(f"\n- compute: {t_s:.6g} s per sample per rank, {how}\n"
          f"- bandwidth: intra {d['intra_gbps']:g} Gbit/s ({d['intra_lat_us']:g} us), inter "
          f"{d['inter_gbps']:g} Gbit/s ({d['inter_lat_us']:g} us); a ring that crosses nodes "
          f"runs at the inter-node rate\n"
          f"- epoch = {args.dataset_size} samples, batch {args.batch_size} per GPU; "
          "communication not overlapped with compute; Top-K selection time not modeled; "
          "H-SADMM iterations after the mask freeze")
    doc = {"model": spec.name, "gpus_per_node": args.gpus_per_node,
           "compute_s_per_sample": t_s, "compute_source": how, "cost_model": d,
           "dataset_size": args.dataset_size, "batch_size": args.batch_size, "systems": table}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return doc
