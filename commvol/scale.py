"""``python -m commvol scale``: strong-scaling speedup and efficiency on a cluster, from the job
simulation of every rank's generated program.

    python -m commvol scale --system hsadmm ddp topk --model resnet152 --gpus 8 16 32 64 \\
        --gpus-per-node 4 --cluster prunex-puhti [--compute-s-per-sample S] [--out scale.json]

One pass over the data (an "epoch", fixed total work: strong scaling) on ``p`` GPUs, ``M = p /
gpus-per-node`` nodes, ``D`` samples (``--dataset-size``, default 50,000: CIFAR-10), ``D / p`` per
rank, ``b`` per step (``--batch-size``).  For each system and GPU count, every rank's program of
a step is generated from the system's plan (:mod:`commvol.job`: the model's layers, the plan's
calls and compute items where their dependencies put them, the optimizer) and the programs run
together on the cluster (:class:`simulation.jobsim.JobSim`: every collective's messages on the
NICs, fabric and switches of ``--cluster``, or of the two tiers of the cost flags).  Each block
costs what the device model says (:class:`commvol.workload.DeviceModel`: the cluster's device,
a roofline plus a launch overhead per kernel), or what a time per sample sets
(``--compute-s-per-sample``, or measured here when neither a cluster nor a time is given).
Data-parallel systems run ``ceil(D / (p b))`` steps per epoch (the last one partial: simulated
on its own batch); ADMM systems one outer iteration per ``local-epochs`` epochs of local SGD.
Two steps run one after the other and the second is the steady one.

Speedup ``S(p) = T(p_0) / T(p)`` against the first GPU count ``p_0``; efficiency
``S(p) p_0 / p``.  The α–β time of the step's calls added to its compute is printed beside as a
bound (nothing overlapped, no contention).

H-SGD and SGD (``--system hsgd sgd``, paper 001) are model-parallel: ``--gpus`` counts the
processors (one rank a core: ``--gpus-per-node 16`` on the paper's ``--cluster
hsgd-warwick-nextscale``), ``--neurons`` / ``--layers`` / ``--seed`` name the RadiX-Net, and all
processors work on every mini-batch of ``--batch-size`` input vectors: an epoch is
``ceil(D / b)`` training steps of ``sparse_sgd train`` (SpFF, SpBP with the update, the loss
all-reduce), each the job simulation of every rank's program (:func:`commvol.job.sparse_step`:
the layers beyond two periods of the partition extended from the second).  Each block costs
its FLOPs and memory traffic on the cluster's device (one core there).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from runner.options import cost_from_args
from simulation.cluster import Cluster, Device
from simulation.jobsim import JobSimOptions
from substrate.backend import get_backend
from substrate.calls import Call, Ready, Work, price
from substrate.costmodel import CostModel
from substrate.options import add_dataclass_args, from_args

from .hsgd import RadixNetSpec
from .job import Job, sparse_step
from .predict import (
    add_cost_args,
    add_model_args,
    add_system_option_args,
    resolve_model,
    system_options,
)
from .specs import build_trainable
from .systems import get_system
from .workload import DeviceModel, units_for_spec

__all__ = [
    "add_parser",
    "epoch",
    "format_scaling",
    "measure_compute_s_per_sample",
    "run",
    "scaling",
]


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


def _check_gpus(sm, system: str, gpus, gpus_per_node: int, spec=None) -> list[int]:
    kind = "radixnet" if isinstance(spec, RadixNetSpec) else "model"
    if spec is not None and sm.spec_kind != kind:
        want = ("a RadiX-Net (--neurons, --layers)" if sm.spec_kind == "radixnet" else
                "a model (--model)")
        raise ValueError(f"--system {system} scales {want}, not the {kind} given; scale sparse "
                         "SGD (hsgd, sgd) and data-parallel systems in separate runs")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be an integer >= 1, got {gpus_per_node!r}")
    gpus = [int(g) for g in gpus]
    bad = [g for g in gpus if g < 1 or g % gpus_per_node]
    if bad or not gpus:
        raise ValueError(f"--gpus {bad or gpus} must be positive multiples of --gpus-per-node "
                         f"{gpus_per_node}")
    return gpus


def _batches(samples: float, batch: int) -> list[float]:
    """The batches of one pass over ``samples`` (the last one partial)."""
    steps = max(1, math.ceil(samples / batch - 1e-12))
    return [float(batch)] * (steps - 1) + [samples - (steps - 1) * batch]


def epoch(system: str, spec, M: int, P: int, options, units, device: DeviceModel,
          cluster: Cluster, samples_per_rank: float, batch: int,
          jobsim: JobSimOptions | None = None) -> dict:
    """One pass over the data of ``system`` on ``M x P`` ranks, from the job simulation
    (:class:`commvol.job.Job`): ``{iterations_per_epoch, step_s, time_s, compute_s,
    bound_time_s, inter_bytes, sim_s}``.  H-SGD: ``samples_per_rank`` is the whole epoch's
    input vectors (every rank works on every one)."""
    sm = get_system(system)
    batches = _batches(samples_per_rank, batch)
    t0 = time.perf_counter()
    if sm.loop == "hsgd":
        def step(b):
            return sparse_step(system, spec, M, P, options, device, cluster, int(b),
                               jobsim=jobsim)

        full = step(batches[0])
        last = full if batches[-1] == batches[0] else step(batches[-1])
        n = len(batches)
        return {"iterations_per_epoch": n, "step_s": full["step_s"],
                "time_s": (n - 1) * full["step_s"] + last["step_s"],
                "compute_s": (n - 1) * full["compute_s"] + last["compute_s"],
                "bound_time_s": (n - 1) * full["bound_s"] + last["bound_s"],
                "inter_bytes": full["bytes"]["inter"], "sim_s": time.perf_counter() - t0}
    if sm.loop == "admm":
        E = float(options.local_epochs)
        whole = max(1, round(E)) if E >= 1 else 1
        local = batches * whole if E >= 1 else batches[:max(1, math.ceil(E * len(batches)))]
        job = Job(system, spec, M, P, options, units, device, local)
        r = job.run(cluster, jobsim)
        per_epoch = 1.0 / E
        time_s = r["step_s"] * per_epoch
        compute = (sum(device.forward(u, b) + device.backward(u, b) for u in units
                       for b in local) + len(local) * device.optimizer(spec.layout.total))
        comm = _comm_s(job, cluster)
        bound = (compute + sum(device.work(w) for w in job.records if isinstance(w, Work))
                 + comm) * per_epoch
        compute *= per_epoch
        steps = per_epoch
    else:
        full = Job(system, spec, M, P, options, units, device, batches[0])
        r = full.run(cluster, jobsim)
        step_s, n = r["step_s"], len(batches)
        time_s = (n - 1) * step_s
        last = batches[-1]
        tail = r if last == batches[0] else \
            Job(system, spec, M, P, options, units, device, last, steps=1).run(cluster, jobsim)
        time_s += tail["step_s"]

        def busy(b):
            return (sum(device.forward(u, b) + device.backward(u, b) for u in units)
                    + device.optimizer(spec.layout.total)
                    + sum(device.work(w) for w in full.records if isinstance(w, Work)))

        compute = (n - 1) * busy(batches[0]) + busy(last)
        bound = compute + n * _comm_s(full, cluster)
        steps = n
    return {"iterations_per_epoch": steps, "step_s": r["step_s"], "time_s": time_s,
            "compute_s": compute, "bound_time_s": bound,
            "inter_bytes": r["bytes"]["inter"], "sim_s": time.perf_counter() - t0}


def _comm_s(job: Job, cluster: Cluster) -> float:
    """The α–β seconds of a step's calls on its busiest rank, added up (a bound)."""
    return max(price(job.records, job.placement, cluster.cost_model()).rank_s)


def scaling(system: str, spec, gpus, gpus_per_node: int, *, units, device: DeviceModel,
            cluster: Cluster, dataset_size: int = 50_000, batch_size: int = 128,
            jobsim: JobSimOptions | None = None, **options) -> list[dict]:
    """Strong scaling from the job simulation (see the module docstring): rows ``{gpus,
    nodes, iterations_per_epoch, step_s, time_s, compute_s, bound_time_s, speedup,
    efficiency}`` per GPU count (times per epoch; ``step_s``: one full-batch step, or one
    outer ADMM iteration).

    Raises
    ------
    ValueError
        For a GPU count that is not a positive multiple of ``gpus_per_node``, a system whose
        programs are not generated at scale, or a non-positive dataset size or batch.
    """
    sm = get_system(system)
    gpus = _check_gpus(sm, system, gpus, gpus_per_node, spec)
    for name, v in (("--dataset-size", dataset_size), ("--batch-size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if "batch_size" in sm.fields():
        options = {**options, "batch_size": batch_size}
    opts, _ = sm.split(options)
    rows = []
    for g in gpus:
        M = g // gpus_per_node
        samples = dataset_size if sm.loop == "hsgd" else dataset_size / g
        r = epoch(system, spec, M, gpus_per_node, opts, units, device, cluster,
                  samples, batch_size, jobsim)
        rows.append({"system": system, "gpus": g, "nodes": M, **r})
    t0, p0 = rows[0]["time_s"], rows[0]["gpus"]
    for r in rows:
        r["speedup"] = t0 / r["time_s"] if r["time_s"] > 0 else float("nan")
        r["efficiency"] = r["speedup"] * p0 / r["gpus"]
    return rows


def format_scaling(table: dict[str, list[dict]]) -> str:
    """Markdown table of :func:`scaling` rows."""
    out = [("| system | GPUs | nodes | iters/epoch | s/iteration | compute s | time s/epoch | "
            "speedup | efficiency | bound s/epoch |"),
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rows in table.items():
        for r in rows:
            out.append(f"| {name} | {r['gpus']} | {r['nodes']} | {r['iterations_per_epoch']:.3g} "
                       f"| {r['step_s']:.4f} | {r['compute_s']:.3f} | {r['time_s']:.3f} | "
                       f"{r['speedup']:.2f}x | {100 * r['efficiency']:.1f} % | "
                       f"{r['bound_time_s']:.3f} |")
    return "\n".join(out)


def _system_notes(name: str, spec, opts, cost: CostModel | None = None, M: int = 2,
                  P: int = 4) -> str:
    """One line on what ``name``'s step holds, read off its records (the plan's, the same for
    every system): calls per phase, compute items, and whether the calls overlap the backward
    (a call that waits for part of the gradients only)."""
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
            " (on the device's roofline)"
    overlap = (f"{early} call(s) wait for part of the gradients only (they can start "
               "during the backward)" if early else
               "none: the calls start after the whole backward / the local epochs")
    head = pred.notes[0] if pred.notes else ""
    return f"{name}: {head}; records per iteration ({M} x {P}): {what}; overlap: {overlap}"


def add_parser(sub) -> None:
    p = sub.add_parser("scale", help="strong-scaling speedup and efficiency on a cluster (the "
                       "job simulation of the generated programs)", description=__doc__,
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
    g = p.add_argument_group("compute (default: the --cluster's device; without a cluster, "
                             "measured here)")
    g.add_argument("--compute-s-per-sample", type=float, default=None,
                   help="forward + backward seconds per sample (a measured or stated time)")
    g.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where to measure (default %(default)s)")
    g.add_argument("--timing-batch", type=int, default=4)
    g.add_argument("--timing-reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None,
                   help="write the rows as JSON (input of `plot-scaling` and `report --scaling`)")
    add_system_option_args(p, exclude=("batch_size",))
    add_cost_args(p)
    add_dataclass_args(p, JobSimOptions)
    p.set_defaults(func=run)


def run(args) -> dict:
    kinds = {get_system(name).spec_kind for name in args.system}  # unknown names: listed
    if kinds == {"radixnet"}:
        return _run_sparse(args)
    if "radixnet" in kinds:
        raise ValueError(f"--system {' '.join(args.system)}: sparse SGD (hsgd, sgd) scales a "
                         "RadiX-Net, the others a model; scale them in separate runs")
    if args.model is None:
        raise ValueError("scale needs --model (e.g. resnet152, or cnn for the digits model)")
    spec = resolve_model(args.model, args.dataset)
    jobsim = from_args(JobSimOptions, args)
    cluster = jobsim.network(cost_from_args(args))
    units, flop_how = units_for_spec(spec, args.model, args.dataset)
    if args.compute_s_per_sample is not None:
        device = DeviceModel.from_seconds_per_sample(
            units, args.compute_s_per_sample, cluster.device, "given (--compute-s-per-sample)")
    elif jobsim.cluster is not None:
        d = cluster.device
        device = DeviceModel(d, how=f"{d.name}: {d.peak_tflops:g} TFLOP/s x efficiency "
                                    f"{d.efficiency:g}, {d.memory_gbs:g} GB/s, "
                                    f"{d.launch_us:g} us a kernel (--cluster)")
    else:
        t_s = measure_compute_s_per_sample(args.model, args.dataset, batch=args.timing_batch,
                                           reps=args.timing_reps, device=args.device)
        device = DeviceModel.from_seconds_per_sample(
            units, t_s, Device(), f"measured on this machine ({args.device}, batch "
                                  f"{args.timing_batch}, {args.timing_reps} passes)")
    table, notes = {}, []
    for name in args.system:
        kw = {k: v for k, v in system_options(name, args).items() if k != "batch_size"}
        table[name] = scaling(name, spec, args.gpus, args.gpus_per_node, units=units,
                              device=device, cluster=cluster, dataset_size=args.dataset_size,
                              batch_size=args.batch_size, jobsim=jobsim, **kw)
        sm = get_system(name)
        opts, _ = sm.split({**kw, **({"batch_size": args.batch_size}
                                     if "batch_size" in sm.fields() else {})})
        notes.append(_system_notes(name, spec, opts, cluster.cost_model(),
                                   args.gpus[0] // args.gpus_per_node, args.gpus_per_node))
    fwd = sum(u.forward_flops for u in units)
    bwd = sum(u.backward_flops for u in units)
    iters = ", ".join(f"{g} GPUs: {math.ceil(args.dataset_size / (g * args.batch_size))}"
                      for g in args.gpus)
    n = cluster.node
    assumptions = [
        (f"model: {spec.name} ({spec.num_params:,} parameters), input {spec.input_shape}; "
         f"{fwd / 1e9:.3f} GFLOP forward + {bwd / 1e9:.3f} GFLOP backward per sample, "
         f"{flop_how}"),
        (f"compute: {device.how}; layers at {device.tflops:.4g} TFLOP/s, memory-bound blocks "
         f"at {device.device.memory_gbs:g} GB/s"),
        (f"epoch = {args.dataset_size} samples, batch {args.batch_size} per GPU; data-parallel "
         f"steps per epoch ({iters}), the last one partial"),
        (f"cluster: {cluster.name}: {n.devices if jobsim.cluster else args.gpus_per_node} "
         f"devices a node on {n.fabric} ({n.fabric_gbps:g} Gbit/s, {n.fabric_latency_us:g} "
         f"us), {n.nics} x {n.nic_gbps:g} Gbit/s NICs ({n.nic_latency_us:g} us), "
         f"{len(cluster.tiers)} switch tiers, {cluster.library.name} "
         f"({cluster.library.call_us:g} us a call, {cluster.library.transport}); "
         f"{jobsim.link_sharing} links"),
        *notes,
    ]
    _print(f"{spec.name} ({spec.num_params:,} parameters), baseline {args.gpus[0]} GPUs",
           table, assumptions)
    doc = {"model": spec.name, "gpus_per_node": args.gpus_per_node,
           "model_of_time": "simulation.jobsim: the job simulation of every rank's program "
                            "generated from the plans (commvol.job)",
           "compute": device.how, "layer_tflops": device.tflops,
           "cluster": cluster.describe(), "dataset_size": args.dataset_size,
           "batch_size": args.batch_size, "assumptions": assumptions, "systems": table}
    return _write(args, doc)


def _print(what: str, table: dict, assumptions: list) -> None:
    print(f"# strong scaling of {what}: the job simulation of every rank's program (bound: "
          "compute plus the alpha-beta time of the calls, nothing overlapped)\n")
    print(format_scaling(table))
    print("\nassumptions:")
    for a in assumptions:
        print(f"- {a}")


def _write(args, doc: dict) -> dict:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return doc


def _run_sparse(args) -> dict:
    """``scale --system hsgd sgd``: the RadiX-Net of ``--neurons`` / ``--layers`` on
    ``--gpus`` processors (see the module docstring)."""
    if args.compute_s_per_sample is not None:
        raise ValueError("--compute-s-per-sample is a data-parallel model's time per sample; "
                         "H-SGD's blocks are costed from their FLOPs and bytes on the "
                         "--cluster's device: leave it out")
    spec = RadixNetSpec(args.neurons, args.layers, seed=args.seed)
    spec.config()  # a bad --neurons / --layers is named before any work
    jobsim = from_args(JobSimOptions, args)
    cluster = jobsim.network(cost_from_args(args))
    d = cluster.device
    device = DeviceModel(d, how=f"{d.name}: {d.peak_tflops:g} TFLOP/s x efficiency "
                                f"{d.efficiency:g}, {d.memory_gbs:g} GB/s"
                                + ("" if jobsim.cluster else " (no --cluster: the two-tier "
                                   "cluster's default device)"))
    table = {}
    for name in args.system:
        kw = {k: v for k, v in system_options(name, args).items() if k != "batch_size"}
        table[name] = scaling(name, spec, args.gpus, args.gpus_per_node, units=None,
                              device=device, cluster=cluster, dataset_size=args.dataset_size,
                              batch_size=args.batch_size, jobsim=jobsim, **kw)
    n = cluster.node
    assumptions = [
        (f"network: {spec.name} (RadiX-Net, seed {spec.seed}); every processor works on every "
         f"mini-batch of {args.batch_size} input vectors: {args.dataset_size} vectors an epoch "
         f"= {math.ceil(args.dataset_size / args.batch_size)} steps"),
        (f"compute: {device.how}; each block its FLOPs and compulsory memory traffic "
         "(sparse_sgd.program.block_work), a roofline"),
        ("a step: SpFF (Alg. 2), SpBP with the update (Alg. 3), the loss all-reduce; layers "
         "beyond two periods of the partition extended from the second "
         "(commvol.job.sparse_step)"),
        (f"cluster: {cluster.name}: {n.devices if jobsim.cluster else args.gpus_per_node} "
         f"ranks a node on {n.fabric} ({n.fabric_gbps:g} Gbit/s), {n.nics} x "
         f"{n.nic_gbps:g} Gbit/s NICs ({n.nic_latency_us:g} us); {jobsim.link_sharing} links"),
    ]
    _print(f"{spec.name}, baseline {args.gpus[0]} processors", table, assumptions)
    doc = {"model": spec.name, "gpus_per_node": args.gpus_per_node,
           "model_of_time": "simulation.jobsim: the job simulation of every rank's program "
                            "generated from the H-SGD plans (commvol.job.sparse_step)",
           "compute": device.how, "cluster": cluster.describe(),
           "dataset_size": args.dataset_size, "batch_size": args.batch_size,
           "assumptions": assumptions, "systems": table}
    return _write(args, doc)
