"""``python -m commvol scale``: strong-scaling speedup and efficiency (the PruneX Fig. 9 analogue).

    python -m commvol scale --system hsadmm ddp topk --model resnet152 --gpus 8 16 32 64 \\
        --gpus-per-node 4 [--compute-s-per-sample S | --device-tflops F] [--out scale.json]

Model of one pass over the data (an "epoch", fixed total work: strong scaling) on ``p`` GPUs,
``M = p / gpus-per-node`` nodes, ``D`` samples (``--dataset-size``, default 50,000: CIFAR-10),
``D / p`` per rank, ``b`` per step (``--batch-size``).

**Timeline** (the ``time s`` and ``speedup`` columns): one iteration of one rank is scheduled on
the trainers' event timeline (:mod:`commvol.timeline_scale`, :class:`substrate.timeline.Timeline`):
per-layer forward and backward compute events from the model's per-layer FLOPs (backward 2 x
forward), gradients ready in backward order, and the system's collective calls as transfers with
the dependencies its plan dictates (DDP buckets overlapping the backward, Top-K's selection then
all-gather, H-SADMM's intra -> inter compact -> bcast chain after local training), on link
resources of the α–β cost model (concurrent transfers share a link).  Data-parallel systems run
``ceil(D / (p b))`` steps per epoch (the last one partial); ADMM systems one outer iteration per
``local-epochs`` epochs of local SGD.  The compute rate is ``--device-tflops`` or the rate that
reproduces ``--compute-s-per-sample`` (or a time measured here: a few ``loss_and_grad`` passes of
the real model, ``--device``).

**No overlap** (the ``no-overlap`` columns): the same events added up, ``Σ compute + Σ α–β``: the
additive clock.  :func:`strong_scaling` keeps the earlier closed form
``T(p) = (D / p) t_s + u(p) c(p)`` (``c(p)``: the predicted communication of one iteration,
``u(p)`` iterations per epoch), which ignores Top-K's selection, the optimizer update and the
partial last batch.

Speedup ``S(p) = T(p_0) / T(p)`` against the first GPU count ``p_0``; efficiency ``S(p) p_0 / p``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from substrate.backend import get_backend
from substrate.calls import Call, Ready, Work
from substrate.costmodel import CostModel

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
from .timeline_scale import ComputeModel, epoch_timing, units_for_spec

__all__ = [
    "PRUNEX_FIG9",
    "SPEC_ARCH",
    "add_parser",
    "build_trainable",
    "format_paper_comparison",
    "format_scaling",
    "measure_compute_s_per_sample",
    "run",
    "strong_scaling",
    "timeline_scaling",
]

#: PruneX (paper 000) §5.4, Fig. 9: measured speedup on 64 GPUs over 8 GPUs (ResNet-152,
#: CIFAR-10, batch 128 per GPU, 4 V100 per node, 100 Gbit/s HDR InfiniBand).
PRUNEX_FIG9 = {"hsadmm": 6.75, "ddp": 5.81, "topk": 3.71}
#: V100 HBM2 memory bandwidth (GB/s): the memory-bound events' default rate
V100_GBS = 900.0
#: PruneX §5.3, Fig. 7: the dense DDP baseline's measured communication latency per iteration,
#: "approximately 0.50 s" (ResNet-152, 64 GPUs on 16 nodes of Puhti).
PRUNEX_FIG7_DDP_COMM_S = 0.50
PRUNEX_FIG7_GPUS = 64


def paper_inter_gbps(spec, comm_s: float = PRUNEX_FIG7_DDP_COMM_S,
                     gpus: int = PRUNEX_FIG7_GPUS) -> float:
    """The inter-node bandwidth (Gbit/s) at which a ring all-reduce of ``spec``'s float32
    gradients over ``gpus`` ranks takes ``comm_s`` (PruneX Fig. 7's measured DDP latency):
    ``2 (p-1)/p · 4 T / comm_s``.  The cluster's nominal link is 100 Gbit/s HDR InfiniBand; the
    paper's own measurement says its DDP synchronization moved gradients at this effective rate
    (NCCL over the shared fabric, framework overhead included), which is the rate a prediction
    of the paper's runs has to use.  It is read off Fig. 7, not fitted to Fig. 9."""
    p = int(gpus)
    return 2 * (p - 1) / p * 4 * spec.layout.total / comm_s * 8 / 1e9

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


def _check_gpus(sm, system: str, gpus, gpus_per_node: int) -> list[int]:
    if sm.spec_kind != "model":
        raise ValueError(f"scale models data-parallel training of a model; --system {system} is "
                         "model-parallel sparse SGD: use `predict` or `partition-table`")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be an integer >= 1, got {gpus_per_node!r}")
    gpus = [int(g) for g in gpus]
    bad = [g for g in gpus if g < 1 or g % gpus_per_node]
    if bad or not gpus:
        raise ValueError(f"--gpus {bad or gpus} must be positive multiples of --gpus-per-node "
                         f"{gpus_per_node}")
    return gpus


def strong_scaling(system: str, spec, gpus, gpus_per_node: int, *, compute_s_per_sample: float,
                   dataset_size: int = 50_000, batch_size: int = 128, cost=None,
                   **options) -> list[dict]:
    """The earlier additive closed form ``T(p) = (D / p) t_s + u(p) c(p)``: rows ``{gpus,
    nodes, compute_s, comm_s, time_s, speedup, efficiency, ...}`` per GPU count (see the module
    docstring; :func:`timeline_scaling` is the timeline model).

    Raises
    ------
    ValueError
        For a GPU count that is not a positive multiple of ``gpus_per_node``, or a system that is
        not data-parallel training of a model.
    """
    sm = get_system(system)
    gpus = _check_gpus(sm, system, gpus, gpus_per_node)
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



def _speedups(rows: list[dict], key: str, prefix: str = "") -> None:
    t0, p0 = rows[0][key], rows[0]["gpus"]
    for r in rows:
        r[prefix + "speedup"] = t0 / r[key] if r[key] > 0 else float("nan")
        r[prefix + "efficiency"] = r[prefix + "speedup"] * p0 / r["gpus"]


def timeline_scaling(system: str, spec, gpus, gpus_per_node: int, *, compute: ComputeModel,
                     dataset_size: int = 50_000, batch_size: int = 128, cost=None,
                     **options) -> list[dict]:
    """Strong scaling on the event timeline (see the module docstring): rows ``{gpus, nodes,
    iterations_per_epoch, step_s, no_overlap_step_s, compute_s, comm_s, exposed_comm_s, time_s,
    no_overlap_time_s, speedup, efficiency, no_overlap_speedup, no_overlap_efficiency}`` per GPU
    count (times per epoch; ``step_s``: one full-batch step, or one outer ADMM iteration).

    Raises
    ------
    ValueError
        For a GPU count that is not a positive multiple of ``gpus_per_node``, a system that is
        not data-parallel training of a model, or a non-positive dataset size or batch.
    """
    sm = get_system(system)
    gpus = _check_gpus(sm, system, gpus, gpus_per_node)
    for name, v in (("--dataset-size", dataset_size), ("--batch-size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if "batch_size" in sm.fields():
        options = {**options, "batch_size": batch_size}
    opts, _ = sm.split(options)
    cost = cost or CostModel()
    rows = []
    for g in gpus:
        M = g // gpus_per_node
        r = epoch_timing(system, spec, M, gpus_per_node, opts, cost, compute,
                         dataset_size / g, batch_size)
        rows.append({"system": system, "gpus": g, "nodes": M, **r})
    _speedups(rows, "time_s")
    _speedups(rows, "no_overlap_time_s", "no_overlap_")
    return rows


def format_scaling(table: dict[str, list[dict]]) -> str:
    """Markdown table of :func:`timeline_scaling` rows (or :func:`strong_scaling` rows, which
    have no no-overlap columns)."""
    timeline = all("no_overlap_time_s" in r for rows in table.values() for r in rows)
    if not timeline:
        out = [("| system | GPUs | nodes | iters/epoch | compute s | comm s | time s/epoch | "
               "speedup | efficiency |"), ("| --- | ---: | ---: | ---: | ---: | ---: | ---: | "
               "---: | ---: |")]
        for name, rows in table.items():
            for r in rows:
                out.append(f"| {name} | {r['gpus']} | {r['nodes']} | "
                           f"{r['iterations_per_epoch']:.3g} | {r['compute_s']:.3f} | "
                           f"{r['comm_s']:.3f} | {r['time_s']:.3f} | {r['speedup']:.2f}x | "
                           f"{100 * r['efficiency']:.1f} % |")
        return "\n".join(out)
    out = [("| system | GPUs | nodes | iters/epoch | s/iteration | compute s | comm s | exposed "
           "comm s | time s/epoch | speedup | efficiency | no-overlap s/epoch | no-overlap speedup |"),
           ("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
           "| ---: |")]
    for name, rows in table.items():
        for r in rows:
            out.append(f"| {name} | {r['gpus']} | {r['nodes']} | {r['iterations_per_epoch']:.3g} "
                       f"| {r['step_s']:.4f} | {r['compute_s']:.3f} | {r['comm_s']:.3f} | "
                       f"{r['exposed_comm_s']:.3f} | {r['time_s']:.3f} | {r['speedup']:.2f}x | "
                       f"{100 * r['efficiency']:.1f} % | {r['no_overlap_time_s']:.3f} | "
                       f"{r['no_overlap_speedup']:.2f}x |")
    return "\n".join(out)


def format_paper_comparison(table: dict, additive: dict | None = None, p0: int = 8,
                            p1: int = 64) -> str | None:
    """Our speedup ``p0 -> p1`` beside PruneX Fig. 9's (:data:`PRUNEX_FIG9`); ``None`` when no
    system of the table is in the paper's figure or the GPU counts are missing."""
    lines = [(f"| system | PruneX Fig. 9 ({p0} -> {p1} GPUs) | timeline | no-overlap | "
             "earlier additive model |"), "| --- | ---: | ---: | ---: | ---: |"]
    any_row = False
    for name, paper in PRUNEX_FIG9.items():
        rows = {r["gpus"]: r for r in table.get(name, [])}
        if p0 not in rows or p1 not in rows:
            continue
        any_row = True
        a, b = rows[p0], rows[p1]
        tl = a["time_s"] / b["time_s"]
        no = a["no_overlap_time_s"] / b["no_overlap_time_s"]
        old = "-"
        if additive and name in additive:
            ar = {r["gpus"]: r for r in additive[name]}
            old = f"{ar[p0]['time_s'] / ar[p1]['time_s']:.2f}x"
        lines.append(f"| {name} | {paper:.2f}x | {tl:.2f}x | {no:.2f}x | {old} |")
    return "\n".join(lines) if any_row else None


def _system_notes(name: str, spec, opts, cost: CostModel | None = None, M: int = 2,
                  P: int = 4) -> str:
    """One line on how ``name``'s iteration is laid on the timeline, read off its records (the
    plan's ``calls()``, the same for every system): calls per phase, compute items, and whether
    the calls overlap the backward (a call that waits for part of the gradients only)."""
    sm = get_system(name)
    pred = sm.predict(spec, M, P, opts, cost) if sm.Assumptions is None else \
        sm.predict(spec, M, P, opts, cost, None)
    calls = [c for c in pred.steady.calls if isinstance(c, Call)]
    work: dict[str, int] = {}
    for w in pred.steady.calls:
        if isinstance(w, Work):
            base = w.label.split("[", 1)[0]
            work[base] = work.get(base, 0) + 1
    phases: dict[str, int] = {}
    for c in calls:
        phases[c.phase] = phases.get(c.phase, 0) + 1
    T = spec.layout.total
    early = sum(any(isinstance(t, Ready) and (t.lo, t.hi) != (0, T) for t in c.after)
                for c in calls)
    what = ", ".join(f"{n} x {ph}" for ph, n in phases.items())
    if work:
        what += "; compute items " + ", ".join(f"{n} x {w}" if n > 1 else w
                                               for w, n in work.items()) + \
            " (roofline at --device-gbs)"
    overlap = (f"{early} call(s) wait for part of the gradients only (they can start "
               "during the backward)" if early else
               "none: the calls start after the whole backward / the local epochs")
    head = pred.notes[0] if pred.notes else ""
    return f"{name}: {head}; records per iteration ({M} x {P}): {what}; overlap: {overlap}"


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
                   help="per-GPU batch of every system (default %(default)s: PruneX §5.1.5)")
    g = p.add_argument_group("compute time per sample (one of; default: measure here)")
    g.add_argument("--compute-s-per-sample", type=float, default=None)
    g.add_argument("--device-tflops", type=float, default=None,
                   help="derive it from the model's per-layer FLOPs at this sustained rate")
    g.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where to measure (default %(default)s)")
    g.add_argument("--timing-batch", type=int, default=4)
    g.add_argument("--timing-reps", type=int, default=2)
    p.add_argument("--device-gbs", type=float, default=V100_GBS,
                   help="memory bandwidth (GB/s) of the memory-bound events: Top-K selection "
                        "and decoding, the optimizer update (default %(default)s: V100 HBM2)")
    p.add_argument("--paper-network", action="store_true",
                   help="inter-node bandwidth from PruneX Fig. 7's measured DDP communication "
                        f"({PRUNEX_FIG7_DDP_COMM_S:g} s per iteration at "
                        f"{PRUNEX_FIG7_GPUS} GPUs) instead of --inter-bw")
    p.add_argument("--out", type=Path, default=None,
                   help="write the rows as JSON (input of `plot-scaling` and `report --scaling`)")
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
    units, flop_how = units_for_spec(spec, args.model, args.dataset)
    if args.device_tflops is not None:
        if not (math.isfinite(args.device_tflops) and args.device_tflops > 0):
            raise ValueError(f"--device-tflops must be a finite number > 0, got "
                             f"{args.device_tflops}")
        compute = ComputeModel(tuple(units), args.device_tflops, args.device_gbs)
        how = f"per-layer FLOPs at {args.device_tflops:g} TFLOP/s (--device-tflops)"
    else:
        if args.compute_s_per_sample is not None:
            t_s, how = args.compute_s_per_sample, "given (--compute-s-per-sample)"
        else:
            t_s = measure_compute_s_per_sample(args.model, args.dataset,
                                               batch=args.timing_batch, reps=args.timing_reps,
                                               device=args.device)
            how = (f"measured on this machine ({args.device}, batch {args.timing_batch}, "
                   f"{args.timing_reps} passes after a warm-up)")
        compute = ComputeModel.from_seconds_per_sample(units, t_s, args.device_gbs)
        how += (f", spread over the layers by their FLOPs (effective "
                f"{compute.rate_tflops:.4g} TFLOP/s)")
    t_s = compute.seconds_per_sample
    if args.paper_network:
        args.inter_bw = paper_inter_gbps(spec)
    cost = cost_from_args(args)
    table, additive, notes = {}, {}, []
    for name in args.system:
        kw = {k: v for k, v in system_options(name, args).items() if k != "batch_size"}
        table[name] = timeline_scaling(name, spec, args.gpus, args.gpus_per_node,
                                       compute=compute, dataset_size=args.dataset_size,
                                       batch_size=args.batch_size, cost=cost, **kw)
        additive[name] = strong_scaling(name, spec, args.gpus, args.gpus_per_node,
                                        compute_s_per_sample=t_s,
                                        dataset_size=args.dataset_size,
                                        batch_size=args.batch_size, cost=cost, **kw)
        sm = get_system(name)
        opts, _ = sm.split({**kw, **({"batch_size": args.batch_size}
                                     if "batch_size" in sm.fields() else {})})
        notes.append(_system_notes(name, spec, opts, cost, args.gpus[0] // args.gpus_per_node,
                                   args.gpus_per_node))
    d = cost.describe()
    fwd = sum(u.forward_flops for u in units)
    iters = ", ".join(f"{g} GPUs: {math.ceil(args.dataset_size / (g * args.batch_size))}"
                      for g in args.gpus)
    assumptions = [
        (f"model: {spec.name} ({spec.num_params:,} parameters), input {spec.input_shape}; "
        f"{fwd / 1e9:.3f} GFLOP forward + {(compute.flops_per_sample - fwd) / 1e9:.3f} GFLOP "
        f"backward per sample, {flop_how}"),
        (f"compute: {t_s:.6g} s per sample per rank ({how}); "
        f"{args.batch_size * t_s:.4g} s forward+backward per step of {args.batch_size}"),
        (f"memory-bound events (Top-K selection/decode, SGD-momentum update: 20 B per "
        f"parameter) at {args.device_gbs:g} GB/s (--device-gbs)"),
        (f"epoch = {args.dataset_size} samples, batch {args.batch_size} per GPU; data-parallel "
        f"steps per epoch ({iters}), the last one partial"),
        (f"links: intra {d['intra_gbps']:g} Gbit/s ({d['intra_lat_us']:g} us), inter "
        f"{d['inter_gbps']:g} Gbit/s ({d['inter_lat_us']:g} us), {args.gpus_per_node} GPUs per "
        "node; a ring that crosses nodes runs at the inter-node rate; concurrent transfers on "
        "one link share its bandwidth; one rank's timeline (every rank does the same work)"),
        *([(f"inter-node bandwidth {args.inter_bw:.4g} Gbit/s: the effective rate of PruneX "
           f"Fig. 7 (dense DDP's measured {PRUNEX_FIG7_DDP_COMM_S:g} s of communication per "
           f"iteration at {PRUNEX_FIG7_GPUS} GPUs = a ring all-reduce of the "
           f"{4 * spec.layout.total / 1e6:.1f} MB gradient at that rate; --paper-network)")]
          if args.paper_network else []),
        *notes,
    ]
    print(f"# strong scaling of {spec.name} ({spec.num_params:,} parameters), baseline "
          f"{args.gpus[0]} GPUs, event timeline (no-overlap: the same events added up)\n")
    print(format_scaling(table))
    paper_setup = spec.name == "resnet152" and args.gpus[0] == 8 and args.gpus[-1] == 64
    cmp = format_paper_comparison(table, additive, 8, 64) if paper_setup else None
    if cmp:
        print(f"\n## speedup {args.gpus[0]} -> {args.gpus[-1]} GPUs beside PruneX Fig. 9\n")
        print(cmp)
    print("\nassumptions:")
    for a in assumptions:
        print(f"- {a}")
    if cmp:
        print("- differs from the paper's testbed (Puhti: 4 x V100 32 GB per node, NVLink, "
              "100 Gbit/s HDR InfiniBand, PyTorch 2.9 + NCCL): compute at the stated rate with "
              "no kernel-launch, data-loading or Python overhead; collectives as alpha-beta "
              "rings and trees, not NCCL's measured behaviour; per-layer FLOPs at CIFAR-10 "
              "shape (PruneX Table 2's 11.3 GFLOPs are ImageNet-224 MACs); H-SADMM after the "
              "mask freeze; Top-K selection as memory passes (the paper attributes Top-K's 3.71x "
              "to sorting and irregular memory access); the paper's DDP spends ~0.5 s per "
              "iteration in communication (its Fig. 7)")
    doc = {"model": spec.name, "gpus_per_node": args.gpus_per_node,
           "compute_s_per_sample": t_s, "compute_source": how,
           "device_tflops": compute.rate_tflops, "device_gbs": args.device_gbs,
           "cost_model": d, "dataset_size": args.dataset_size, "batch_size": args.batch_size,
           "clock": "timeline", "assumptions": assumptions, "systems": table,
           "additive": additive,
           "paper": {"source": "PruneX Fig. 9 (8 -> 64 GPUs)", "gpus": [8, 64],
                     "speedup": PRUNEX_FIG9} if cmp else None}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return doc
