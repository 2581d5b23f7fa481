"""H-SADMM system overheads and payloads, measured side by side in one run (PruneX §4.3-4.4).

    ./run_mpi.sh -n 4 --ranks-per-node 2 bench.bench_hsadmm [--iters 8] [--reps 15]
    ./run_mpi.sh -n 2 --ranks-per-node 1 bench.bench_hsadmm     (not oversubscribed on 2 cores)

(a) Overhead of the structured-sparsity machinery per outer iteration, as a fraction of phase-1
    local SGD (eq. 8) on the same rank: projection (eq. 10), mask sync (pack + OR all-reduce of
    the leaders + node broadcast + unpack, eq. 14), one shrink-plan rebuild (as if the mask
    changed every iteration), compaction (eq. 15) and zero-fill expansion (§4.4.3).  The solver
    runs on the embedded digits with the digits CNN and the small ResNet of ``models.zoo``
    (keep 0.5); local SGD, projection, compaction and expansion are the solver's own per-phase
    wall times (``HSADMM.phase_s``) on rank 0, a leader, averaged over the iterations before the
    mask freeze, skipping the first (warm-up).  The mask sync is timed in isolation between
    barriers (so the wait for the slower node is not counted); the headline uses its least
    disturbed repetition, as bench_layers does, with the median beside it, and a last column
    uses its alpha-beta time on the modeled cluster instead.  Target: <= 5 %.
(b) Compact / dense inter-node payload (``ShrinkPlan.ratio``; FC, biases and BN travel whole) at
    keep 0.5 channel and keep 0.5 filter+channel: for the small ResNet from the masks the solver
    reached in (a) and from keep rates alone, and for ResNet-18 / ResNet-152 (CIFAR variants of
    ``models.specs``) at paper scale from shapes only (masks from keep rates, no training).  The
    paper reports ~0.4 of dense after training (§5.3.1).
(c) Bucketed (32 MiB buckets, the plan's) vs per-layer inter-node all-reduce of the compact
    buffer of ResNet-18 at keep 0.5 channel, between the 2 node leaders, medians of interleaved
    repetitions; beside it the alpha-beta time the cost model assigns to the same calls.

With 4 ranks on a 2-core box the ranks are oversubscribed: collective timings include spinning
ranks and are noisy; compute ratios are less affected (both sides run on the same shared cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
from mpi4py import MPI

from bench.bench_collectives import _median_time
from hsadmm.config import HSADMMConfig
from hsadmm.shrink import ShrinkPlan
from hsadmm.solver import HSADMM
from models import build_model, get_spec, load_digits, shard
from runner.run import start_run
from substrate import Topology

OVERHEAD = ("projection", "mask_sync", "plan_build", "shrink", "expand")


def _run(model: str, sparsity: str, iters: int, reps: int, ranks_per_node: int | None) -> dict:
    """Train ``iters`` iterations with per-phase timers; returns rank 0's per-iteration means."""
    cfg = HSADMMConfig(sparsity=sparsity, freeze_iter=iters // 2)
    out = Path(tempfile.gettempdir()) / "spardist_bench_hsadmm"
    args = Namespace(out=str(out), seed=0, device="cpu", ranks_per_node=ranks_per_node,
                     intra_bw=2400.0, inter_bw=100.0, intra_lat=2.0, inter_lat=5.0)
    run = start_run(args, system="hsadmm", method="bench", config=cfg)
    data = load_digits()
    train = shard(data.train, run.rank, run.size, seed=0)
    net = build_model(model, data.train.input_shape, 10, seed=0)
    solver = HSADMM(run, cfg, net, train)
    per_iter = []
    for k in range(iters):
        before = dict(solver.phase_s)
        solver.iterate(k)
        if 0 < k < cfg.freeze_iter:  # dynamic masks, after the warm-up iteration
            per_iter.append({p: solver.phase_s.get(p, 0.0) - before.get(p, 0.0)
                             for p in solver.phase_s})
    mean = {p: float(np.mean([d.get(p, 0.0) for d in per_iter])) for p in per_iter[0]}
    # mask sync in isolation (the in-loop wall time also waits for the slower node)
    masks = [m.copy() for m in solver.m_global]
    snap = run.ledger.local()
    sync = [_median_time(lambda: solver.sync_masks(masks), run.world.mpi, 1)
            for _ in range(reps)]
    mean["mask_sync"], mean["mask_sync_median"] = min(sync), statistics.median(sync)
    sync_modeled = sum(e["modeled_s"] for e in run.ledger.since(snap).values()) / reps
    t = time.perf_counter()
    for _ in range(reps):
        solver._make_plan()
    mean["plan_build"] = (time.perf_counter() - t) / reps
    run.writer.abandon()
    return {"phases": mean, "ratio": solver.plan.ratio, "sync_modeled_s": sync_modeled,
            "local_steps": solver.local_steps, "world": run.size, "nodes": run.topo.num_nodes}


def keep_rate_plan(spec_or_model, sparsity: str, keep: float = 0.5) -> ShrinkPlan:
    """The solver's shrink plan for conv masks from keep rates alone
    (:meth:`ShrinkPlan.from_keep_rates`, as ``commvol predict`` builds it)."""
    return ShrinkPlan.from_keep_rates(spec_or_model.layout,
                                      HSADMMConfig(keep=keep, sparsity=sparsity))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ranks-per-node", type=int, default=None)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    rank0 = world.rank == 0

    # (a) overhead vs local compute ---------------------------------------------------------
    runs = {}
    for model, sparsity in (("cnn", "channel"), ("resnet", "channel"),
                            ("resnet", "filter+channel")):
        runs[model, sparsity] = _run(model, sparsity, args.iters, args.reps, args.ranks_per_node)
    if rank0:
        r = next(iter(runs.values()))
        print(f"# bench_hsadmm: {r['world']} ranks, {r['nodes']} nodes, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"\n(a) overhead per outer iteration vs phase-1 local SGD (rank 0, leader; mean of "
              f"iterations 1..{args.iters // 2 - 1}, before the freeze; keep 0.5)\n")
        print("| model | sparsity | local steps | local SGD (ms) | projection (ms) | mask sync "
              "min (ms) | plan rebuild (ms) | compaction (ms) | expansion (ms) | **overhead / "
              "local SGD** | mask sync median (ms) | overhead, median mask sync | mask sync "
              "modeled (ms) | overhead, modeled mask sync |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for (model, sparsity), r in runs.items():
            ph = r["phases"]
            local = sum(ph[p] for p in OVERHEAD if p != "mask_sync")
            frac = [(local + sync) / ph["local_sgd"] * 100 for sync in
                    (ph["mask_sync"], ph["mask_sync_median"], r["sync_modeled_s"])]
            print(f"| {model} | {sparsity} | {r['local_steps']} | {ph['local_sgd'] * 1e3:.2f} | "
                  + " | ".join(f"{ph[p] * 1e3:.3f}" for p in OVERHEAD)
                  + f" | **{frac[0]:.2f} %** | {ph['mask_sync_median'] * 1e3:.3f} | "
                  f"{frac[1]:.2f} % | {r['sync_modeled_s'] * 1e3:.4f} | {frac[2]:.2f} % |")

    # (b) compact / dense payload ---------------------------------------------------------------
    if rank0:
        digits = load_digits()
        small = build_model("resnet", digits.train.input_shape, 10)
        print("\n(b) compact / dense inter-node payload (ShrinkPlan.ratio; FC, biases, BN "
              "whole)\n")
        print("| model | params | keep 0.5 channel | keep 0.5 filter+channel | source |")
        print("|---|---:|---:|---:|---|")
        print(f"| small ResNet (digits) | {small.num_params:,} | "
              f"{runs['resnet', 'channel']['ratio']:.3f} | "
              f"{runs['resnet', 'filter+channel']['ratio']:.3f} | masks after (a)'s training |")
        rows = [("small ResNet (digits)", small)] + [(n, get_spec(n)) for n in
                                                     ("resnet18", "resnet152")]
        for label, m in rows:
            ch, fc = keep_rate_plan(m, "channel"), keep_rate_plan(m, "filter+channel")
            mb = ch.dense_size * 4 / 1e6
            print(f"| {label} | {ch.dense_size:,} ({mb:.1f} MB) | {ch.ratio:.3f} | "
                  f"{fc.ratio:.3f} | shapes + keep rates |")

    # (c) bucketed vs per-layer inter-node all-reduce of the ResNet-18 compact buffer ----------
    topo = Topology.from_comm(world, ranks_per_node=args.ranks_per_node)
    plan = keep_rate_plan(get_spec("resnet18"), "channel")
    plan.buffer[...] = 1.0
    layers = [(int(plan.offsets[i]), int(plan.offsets[i + 1])) for i in range(len(plan.sizes))]

    def reduce(spans):
        if topo.is_leader:
            for a, b in spans:
                topo.inter.allreduce(plan.buffer[a:b], "avg", phase="bench")

    times = {"bucketed": [], "per-layer": []}
    modeled = {}
    for _ in range(args.reps):  # interleaved
        for name, spans in (("bucketed", plan.buckets), ("per-layer", layers)):
            snap = topo.ledger.local()
            times[name].append(_median_time(lambda spans=spans: reduce(spans), world, 1))
            modeled[name] = topo.ledger.since(snap).get("bench", {}).get("modeled_s", 0.0)
    if rank0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n(c) inter-node all-reduce of the ResNet-18 compact buffer (keep 0.5 channel: "
              f"{plan.compact_size:,} float32 = {plan.compact_size * 4 / 2**20:.1f} MiB) between "
              f"{topo.num_nodes} leaders, {args.reps} interleaved reps\n")
        print("| variant | calls | measured median (ms) | modeled alpha-beta (ms) |")
        print("|---|---:|---:|---:|")
        print(f"| bucketed (32 MiB buckets) | {len(plan.buckets)} | {med['bucketed'] * 1e3:.2f} "
              f"| {modeled['bucketed'] * 1e3:.3f} |")
        print(f"| per-layer | {len(layers)} | {med['per-layer'] * 1e3:.2f} | "
              f"{modeled['per-layer'] * 1e3:.3f} |")
        print(f"| **speed-up** | | **{med['per-layer'] / med['bucketed']:.2f}x** | "
              f"**{modeled['per-layer'] / modeled['bucketed']:.2f}x** |")


if __name__ == "__main__":
    main()
