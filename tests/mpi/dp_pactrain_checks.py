"""MPI checks of PacTrain: ``python -m mpi4py dp_pactrain_checks.py CHECK`` (4 ranks, 2 nodes).

Every check runs the strategy's step programs (:func:`dataparallel.program.sync_step`),
compares the synchronized gradient with a serial NumPy reference built here from all ranks'
local gradients (gathered with a recorded all-gather), written from the paper (eqs. 2-4) without
the strategy's helpers, and holds the calls every step ran to the step's records (the plan's,
mask changes and re-plans included; ``Recorder.account`` raises on the first difference):

``packed``   per-layer magnitude pruning; dense sync while the mask is new, packed sync once it
             is stable, both == the masked average; a mask change falls back to dense and
             re-plans; results identical on every rank (one bucket: one mask unit).
``buckets``  one mask tracker per gradient bucket (Algorithm 1): five buckets, a mask change in
             conv2's bucket sends that bucket alone densely (its ring bytes only) while the
             other four stay packed; every step == the masked average.
``ternary``  the ternarized packed average == the reference TernGrad average of every rank's
             seeded draws (per-tensor scales shared by MAX).
``fp16``     the FP16 baseline (PyTorch's fp16_compress_hook): every bucket's result is the
             fp16 sum of every rank's fp16(fp16(g_j) / p), within the ring's p - 1 fp16
             roundings of the exact sum, representable in fp16, identical on every rank; its
             bytes are the half-precision ring's (any ranks per node: run with 6 ranks, 3 per
             node).
``fp16train OUT``  ``dataparallel train --method fp16`` (registered by importing
             dataparallel.fp16 here) writing its summary to OUT.
``grasp``    the GraSP scores (rank-averaged finite-difference Hessian-vector product, the
             strategy's set-up records run by its executor) == a serial recomputation over all
             shards; the calls the set-up ran are its records; GraSP's rule removes the
             highest scores; the mask is identical on every rank.
"""

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
from mpi4py import MPI

import dataparallel.fp16  # noqa: F401  (registers --method fp16 before the parser is built)
from dataparallel.fp16 import FP16
from dataparallel.pactrain import TERNARY_STREAM, PacTrain
from dataparallel.program import sync_step
from dataparallel.strategy import StepState, SyncContext
from dataparallel.train import DPConfig, build_parser
from dataparallel.train import main as train_main
from models import SGD, SGDConfig, build_model, iterate_batches, load_digits, shard
from runner.run import start_run
from substrate import collective_check
from substrate.calls import bytes_by_phase
from volume.dataparallel import world_ring_bytes
from volume.pactrain import dense_allreduce_bytes

SEED = 3

#: results directory of the runs built here (never finished, so never published)
CHECK_OUT = str(Path(tempfile.gettempdir()) / "spardist-checks" / "dp_pactrain")


def _setup(strategy=PacTrain, ranks_per_node=2, **opts):
    if strategy is PacTrain:
        opts = {"warmup_steps": 0, "prune_score": "magnitude", **opts}   # prune at once
    cfg = DPConfig(method=strategy.name, seed=SEED)
    args = build_parser().parse_args(["--ranks-per-node", str(ranks_per_node), "--seed",
                                      str(SEED), "--out", CHECK_OUT])
    run = start_run(args, system="dataparallel", method=strategy.name, config=cfg)
    run.writer.enabled = False
    data = load_digits()
    train = shard(data.train, run.rank, run.size, seed=cfg.seed)
    model = build_model(cfg.model, data.train.input_shape, 10, seed=cfg.seed)
    opt = SGD(model.params, model.grads,
              SGDConfig(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                        decay_kinds=("conv", "fc")))
    st = strategy(SyncContext(run=run, model=model, opt=opt, train=train, config=cfg),
                  strategy.Options(**opts))
    return run, model, st, data


def _fresh_params(data):
    return build_model("cnn", data.train.input_shape, 10, seed=SEED).params.flat.copy()


def reference_mask(importance, layout, ratio):
    """Per conv/fc tensor: drop the floor(r n) entries of lowest importance (of equal ones, the
    higher flat index first); keep the rest."""
    keep = np.ones(layout.total, dtype=bool)
    for name in layout.names:
        if layout.kind(name) not in ("conv", "fc"):
            continue
        sl = layout.slice(name)
        drop = math.floor(ratio * (sl.stop - sl.start))
        n = sl.stop - sl.start
        lowest = np.lexsort((-np.arange(n), importance[sl]))[:drop]
        keep[sl.start + lowest] = False
    return keep


def _local_grad(rank, step, T):
    return np.random.default_rng([77, rank, step]).standard_normal(T).astype(np.float32)


def _gather(run, x):
    """All-gather ``x`` for a check; the call is the check's own, accounted by itself (the
    run's call log then holds exactly the strategy's calls of the next step)."""
    h = run.world.allgather(np.ascontiguousarray(x), phase="test_gather")
    run.recorder.account([h.call])
    return h.result


def _sync(run, model, st, step):
    """One step's program on seeded gradients (:func:`sync_step`); the calls it ran must be
    the step's records (``Recorder.account`` raises on the first difference).  Returns the
    synchronized gradient, every rank's local gradient and the step's bytes per phase."""
    g = _local_grad(run.rank, step, model.layout.total)
    model.grads.flat[...] = g
    everyone = _gather(run, g).astype(np.float64)
    records = sync_step(st, StepState(step=step, epoch=0, loss=0.0))
    out = model.grads.flat.copy()
    run.recorder.account(records)
    return out, everyone, bytes_by_phase(records, run.topo.placement)


def _same_everywhere(run, out, what):
    rows = _gather(run, out)
    collective_check(run.world, bool((rows == rows[0]).all()),
                     f"{what}: synchronized gradient differs between ranks")


def packed():
    run, model, st, data = _setup(prune_ratio=0.5, stable_window=1)
    layout = model.layout
    theta0 = _fresh_params(data)
    mask = reference_mask(np.abs(theta0), layout, 0.5)
    theta = model.params.flat
    collective_check(run.world, np.array_equal(theta, np.where(mask, theta0, 0)),
                     "pruned parameters != per-layer magnitude reference")
    # step 0: new mask -> dense; steps 1, 2: stable -> packed; step 3: one weight hits 0 ->
    # dense with the new mask; step 4: packed again with a re-planned index set
    expect = ["dense_allreduce", "packed_allreduce", "packed_allreduce", "dense_allreduce",
              "packed_allreduce"]
    kept_conv = layout.offsets["conv2.weight"] + int(np.flatnonzero(
        mask[layout.slice("conv2.weight")])[0])
    for step, phase in enumerate(expect):
        if step == 3:
            theta[kept_conv] = 0.0      # same on every rank: the mask changes
            mask[kept_conv] = False
        out, everyone, got = _sync(run, model, st, step)
        ref = (everyone * mask).mean(axis=0)
        ok = (list(got) == [phase] and np.allclose(out, ref, rtol=1e-5, atol=1e-6)
              and not out[~mask].any() and st.plan.kept == int(mask.sum()))
        collective_check(run.world, ok, f"step {step}: phases {list(got)} "
                         f"(want {phase}), K {st.plan.kept} vs {int(mask.sum())}, max error "
                         f"{np.abs(out - ref).max():.3g}")
        _same_everywhere(run, out, f"step {step}")
    rep = st.report()
    ok = (rep["mask_stable_steps"] == [1, 4] and rep["mask_changes"] == 1
          and rep["kept"] == int(mask.sum()) and rep["packed_fraction"] == 3 / 5)
    collective_check(run.world, ok, f"report {rep}")


def ternary():
    run, model, st, data = _setup(prune_ratio=0.5, stable_window=0, ternary=True)
    layout, p = model.layout, run.size
    mask = reference_mask(np.abs(_fresh_params(data)), layout, 0.5)
    idx = np.flatnonzero(mask)
    K = idx.size
    for step in (0, 1):
        out, everyone, got = _sync(run, model, st, step)
        vals = everyone[:, idx].astype(np.float32)          # (p, K) packed local gradients
        scale = np.empty(K, dtype=np.float32)                # s_l = max_j max|g_j,l| per tensor
        for name in layout.names:
            sl = layout.slice(name)
            sel = (idx >= sl.start) & (idx < sl.stop)
            scale[sel] = np.abs(vals[:, sel]).max()
        total = np.zeros(K)
        for j in range(p):
            u = np.random.default_rng([SEED, TERNARY_STREAM, j, step]).random(K,
                                                                              dtype=np.float32)
            b = u < np.abs(vals[j]) / scale
            total += np.sign(vals[j]) * b
        ref = np.zeros(layout.total)
        ref[idx] = total * scale / p
        ok = (sorted(got) == ["ternary_allgather", "ternary_scale"]
              and np.allclose(out, ref, rtol=1e-6, atol=0))
        collective_check(run.world, ok, f"ternary step {step}: phases {list(got)},"
                         f" max error {np.abs(out - ref).max():.3g}")
        _same_everywhere(run, out, f"ternary step {step}")


def grasp():
    run, model, st, data = _setup(prune_ratio=0.5, stable_window=0, prune_score="grasp")
    layout, p = model.layout, run.size
    setup = st.setup_records()
    run.recorder.account(setup)           # the calls the set-up ran are its records
    collective_check(run.world, [c.phase for c in setup if hasattr(c, "phase")] ==
                     ["grasp_allreduce"] * 2, f"GraSP's set-up records: {setup}")
    theta0 = _fresh_params(data)
    ref_model = build_model("cnn", data.train.input_shape, 10, seed=SEED)
    batches = []
    for j in range(p):
        tr = shard(data.train, j, p, seed=SEED)
        batches.append(next(iterate_batches(tr, min(256, len(tr)), seed=SEED, rank=j, epoch=0)))

    def mean_grad(theta):
        out = np.zeros(layout.total)
        for x, y in batches:
            ref_model.params.flat[...] = theta
            ref_model.loss_and_grad(x, y)
            out += ref_model.grads.flat
        return out / p

    v = mean_grad(theta0).astype(np.float32)
    eps = 1e-3 * max(np.linalg.norm(theta0), 1.0) / np.linalg.norm(v)
    hv = (mean_grad(theta0 + eps * v) - mean_grad(theta0 - eps * v)) / (2 * eps)
    score = -theta0 * hv                                        # eq. 4
    scale = np.abs(score).max()
    ok = np.allclose(st.scores, score, rtol=1e-3, atol=1e-4 * scale)
    collective_check(run.world, ok, f"GraSP scores differ from the serial reference: max error "
                                    f"{np.abs(st.scores - score).max():.3g} of {scale:.3g}")
    own = reference_mask(-st.scores, layout, 0.5)       # GraSP removes the highest S
    ref = reference_mask(-score, layout, 0.5)
    prunable = np.isin(np.repeat(np.arange(len(layout)), [layout.sizes[n] for n in layout.names]),
                       [i for i, n in enumerate(layout.names) if layout.kind(n) in ("conv", "fc")])
    m = model.params.flat != 0
    agree = (own == ref)[prunable].mean()
    ok = np.array_equal(m[prunable], own[prunable]) and agree > 0.99
    collective_check(run.world, ok, f"GraSP mask: kept weights != lowest S of the strategy's "
                                    f"scores, or agreement with the reference {agree:.4f}")
    bits = np.packbits(m)
    rows = run.world.allgather(bits, phase="test_gather").result
    collective_check(run.world, bool((rows == rows[0]).all()), "GraSP masks differ across ranks")


def buckets():
    run, model, st, data = _setup(prune_ratio=0.5, stable_window=1, bucket_mib=0.01)
    layout = model.layout
    mask = reference_mask(np.abs(_fresh_params(data)), layout, 0.5)
    theta = model.params.flat
    units = st.plan.units
    conv2 = layout.slice("conv2.weight")
    u2 = [u for u, (a, b) in enumerate(units) if (a, b) == (conv2.start, conv2.stop)]
    collective_check(run.world, len(units) >= 3 and len(u2) == 1,
                     f"mask units {units}: want several buckets, conv2.weight alone in one")
    kept_conv = conv2.start + int(np.flatnonzero(mask[conv2])[0])
    # step 0: new masks everywhere -> dense; 1: all packed; 2: conv2's mask changes -> its
    # bucket dense, the rest packed; 3: all packed again
    for step in range(4):
        if step == 2:
            theta[kept_conv] = 0.0
            mask[kept_conv] = False
        out, everyone, got = _sync(run, model, st, step)
        ref = (everyone * mask).mean(axis=0)
        if step == 0:
            ok_phases = set(got) == {"dense_allreduce"}
        elif step == 2:
            ok_phases = (set(got) == {"dense_allreduce", "packed_allreduce"}
                         and got["dense_allreduce"] == dense_allreduce_bytes(
                             M=2, P=2, bucket_sizes=[conv2.stop - conv2.start]))
        else:
            ok_phases = set(got) == {"packed_allreduce"}
        ok = ok_phases and np.allclose(out, ref, rtol=1e-5, atol=1e-6) and not out[~mask].any()
        collective_check(run.world, ok, f"step {step}: phases {got}, max error "
                         f"{np.abs(out - ref).max():.3g}")
        _same_everywhere(run, out, f"step {step}")
    rep = st.report()
    U = len(units)
    ok = (rep["mask_changes"] == 1 and rep["mask_units"] == U
          and rep["packed_fraction"] == (3 * U - 1) / (4 * U) and rep["kept"] == int(mask.sum())
          and rep["mask_stable_steps"] == [1, 3])
    collective_check(run.world, ok, f"report {rep}")


def fp16():
    run, model, st, _ = _setup(FP16, ranks_per_node=3, bucket_mib=0.01)
    p, u16 = run.size, 2.0 ** -11                     # fp16 unit roundoff
    sizes = [b - a for a, b in st.buckets]
    ok = len(sizes) >= 3 and sum(sizes) == model.layout.total
    collective_check(run.world, ok, f"fp16 buckets {st.buckets}")
    for step in range(2):
        g = _local_grad(run.rank, step, model.layout.total) * (10.0 ** (run.rank - 2))
        model.grads.flat[...] = g
        everyone = _gather(run, g)
        snap = run.ledger.local()
        calls = sync_step(st, StepState(step=step, epoch=0, loss=0.0))
        out = model.grads.flat.copy()
        sent = run.ledger.since(snap)
        run.recorder.account(calls)                # the step ran exactly the plan's calls
        q = (everyone.astype(np.float16) / np.float16(p)).astype(np.float64)   # fp16(g_j) / p
        exact = q.sum(axis=0)
        bound = (p - 1) * u16 * (1 + u16) ** p * np.abs(q).sum(axis=0) + 2.0 ** -24 * p
        err = np.abs(out - exact)
        ok = (bool(np.all(err <= bound)) and out.dtype == np.float32
              and np.array_equal(out, out.astype(np.float16).astype(np.float32))
              and not np.array_equal(out, everyone.mean(axis=0, dtype=np.float32)))
        collective_check(run.world, ok, f"fp16 step {step}: max error / bound "
                         f"{(err / bound).max():.3g}")
        _same_everywhere(run, out, f"fp16 step {step}")
        # the world's bytes (ledger, all ranks) == a ring of 2-byte values per bucket
        mine = np.array([sent["fp16_allreduce"]["intra_bytes"],
                         sent["fp16_allreduce"]["inter_bytes"]], dtype=np.int64)
        world = _gather(run, mine).sum(axis=0)
        closed = bytes_by_phase(calls, run.topo.placement)["fp16_allreduce"]
        ring = [world_ring_bytes(n, 2, 2, 3) for n in sizes]
        ok = (world.tolist() == [closed["intra"], closed["inter"]]
              and closed["intra"] == sum(r["intra"] for r in ring)
              and closed["inter"] == sum(r["inter"] for r in ring)
              and closed["intra"] + closed["inter"] == sum(2 * (p - 1) * 2 * n for n in sizes))
        collective_check(run.world, ok, f"fp16 bytes: ledger {world.tolist()}, closed form "
                                        f"{closed}")


def fp16train():
    train_main(["train", "--method", "fp16", "--ranks-per-node", "2", "--out", sys.argv[2],
                *sys.argv[3:]])


CHECKS = {"packed": packed, "buckets": buckets, "ternary": ternary, "grasp": grasp,
          "fp16": fp16, "fp16train": fp16train}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {sys.argv[1]}")
