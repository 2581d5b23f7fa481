"""MPI checks of PacTrain: ``python -m mpi4py dp_pactrain_checks.py CHECK`` (4 ranks, 2 nodes).

Every check compares the strategy's synchronized gradient with a serial NumPy reference built
here from all ranks' local gradients (gathered with a recorded all-gather), written from the
paper (eqs. 2-4) without the strategy's helpers:

``packed``   per-layer magnitude pruning; dense sync while the mask is new, packed sync once it
             is stable, both == the masked average; a mask change falls back to dense and
             re-plans; results identical on every rank.
``ternary``  the ternarized packed average == the reference TernGrad average of every rank's
             seeded draws (per-tensor scales shared by MAX).
``grasp``    the GraSP scores (rank-averaged finite-difference Hessian-vector product) == a serial
             recomputation over all shards; the mask is identical on every rank.
"""

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dataparallel.pactrain import PacTrain, PacTrainOptions, TERNARY_STREAM
from dataparallel.strategy import StepState, SyncContext
from dataparallel.train import DPConfig, build_parser
from models import SGD, SGDConfig, build_model, iterate_batches, load_digits, shard
from substrate import collective_check, start_run

SEED = 3

#: results directory of the runs built here (never finished, so never published)
CHECK_OUT = str(Path(tempfile.gettempdir()) / "spardist-checks" / "dp_pactrain")


def _setup(**opts):
    cfg = DPConfig(method="pactrain", seed=SEED)
    args = build_parser().parse_args(["--ranks-per-node", "2", "--seed", str(SEED),
                                      "--out", CHECK_OUT])
    run = start_run(args, system="dataparallel", method="pactrain", config=cfg)
    run.writer.enabled = False
    data = load_digits()
    train = shard(data.train, run.rank, run.size, seed=cfg.seed)
    model = build_model(cfg.model, data.train.input_shape, 10, seed=cfg.seed)
    opt = SGD(model.params, model.grads,
              SGDConfig(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                        decay_kinds=("conv", "fc")))
    st = PacTrain(SyncContext(run=run, model=model, opt=opt, train=train, config=cfg),
                  PacTrainOptions(**opts))
    return run, model, st, data


def _fresh_params(data):
    return build_model("cnn", data.train.input_shape, 10, seed=SEED).params.flat.copy()


def reference_mask(importance, layout, ratio):
    """Per conv/fc tensor: drop the floor(r n) entries of lowest importance; keep the rest."""
    keep = np.ones(layout.total, dtype=bool)
    for name in layout.names:
        if layout.kind(name) not in ("conv", "fc"):
            continue
        sl = layout.slice(name)
        drop = math.floor(ratio * (sl.stop - sl.start))
        lowest = np.argsort(importance[sl])[:drop]
        keep[sl.start + lowest] = False
    return keep


def _local_grad(rank, step, T):
    return np.random.default_rng([77, rank, step]).standard_normal(T).astype(np.float32)


def _sync(run, model, st, step):
    g = _local_grad(run.rank, step, model.layout.total)
    model.grads.flat[...] = g
    everyone = run.world.allgather(g, phase="test_gather").astype(np.float64)
    out = st.sync(StepState(step=step, epoch=0, loss=0.0), model.grads).copy()
    return out, everyone


def _same_everywhere(run, out, what):
    rows = run.world.allgather(np.ascontiguousarray(out), phase="test_gather")
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
        out, everyone = _sync(run, model, st, step)
        ref = (everyone * mask).mean(axis=0)
        ok = (list(st.step_bytes()) == [phase] and np.allclose(out, ref, rtol=1e-5, atol=1e-6)
              and not out[~mask].any() and st.K == int(mask.sum()))
        collective_check(run.world, ok, f"step {step}: phases {list(st.step_bytes())} "
                         f"(want {phase}), K {st.K} vs {int(mask.sum())}, max error "
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
        out, everyone = _sync(run, model, st, step)
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
        ok = (sorted(st.step_bytes()) == ["ternary_allgather", "ternary_scale"]
              and np.allclose(out, ref, rtol=1e-6, atol=0))
        collective_check(run.world, ok, f"ternary step {step}: phases {list(st.step_bytes())},"
                         f" max error {np.abs(out - ref).max():.3g}")
        _same_everywhere(run, out, f"ternary step {step}")


def grasp():
    run, model, st, data = _setup(prune_ratio=0.5, stable_window=0, prune_score="grasp")
    layout, p = model.layout, run.size
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
    own = reference_mask(np.abs(st.scores), layout, 0.5)       # keep the largest |S|
    ref = reference_mask(np.abs(score), layout, 0.5)
    prunable = np.isin(np.repeat(np.arange(len(layout)), [layout.sizes[n] for n in layout.names]),
                       [i for i, n in enumerate(layout.names) if layout.kind(n) in ("conv", "fc")])
    m = model.params.flat != 0
    agree = (own == ref)[prunable].mean()
    ok = np.array_equal(m[prunable], own[prunable]) and agree > 0.99
    collective_check(run.world, ok, f"GraSP mask: kept weights != largest |S| of the strategy's "
                                    f"scores, or agreement with the reference {agree:.4f}")
    bits = np.packbits(m)
    rows = run.world.allgather(bits, phase="test_gather")
    collective_check(run.world, bool((rows == rows[0]).all()), "GraSP masks differ across ranks")


CHECKS = {"packed": packed, "ternary": ternary, "grasp": grasp}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {sys.argv[1]}")
