"""MPI checks of the data-parallel strategies: ``python -m mpi4py dp_checks.py CHECK``.

Each check builds the strategy on 2 virtual nodes x 2 ranks, feeds every rank its own seeded
random gradients, and compares the synchronized gradient with a serial NumPy reference computed
from all ranks' gradients (gathered here with plain mpi4py), and the ledger with the strategy's
closed form.
"""

import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dataparallel import STRATEGIES, StepState, SyncContext
from dataparallel.program import sync_step
from dataparallel.train import DPConfig
from models import SGD, SGDConfig, build_model
from runner.run import start_run
from substrate import collective_check
from substrate.calls import bytes_by_phase

R = 2

#: results directory of the runs built here (never finished, so never published)
CHECK_OUT = str(Path(tempfile.gettempdir()) / "spardist-checks" / "dp")


def _setup(method, **options):
    args = Namespace(out=CHECK_OUT, seed=0, device="cpu", ranks_per_node=R, intra_bw=2400.0,
                     inter_bw=100.0, intra_lat=2.0, inter_lat=5.0)
    run = start_run(args, system="dataparallel", method=method, config=DPConfig(method=method))
    run.writer.enabled = False
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    opt = SGD(model.params, model.grads, SGDConfig(lr=0.1))
    cls = STRATEGIES[method]
    strat = cls(SyncContext(run=run, model=model, opt=opt, train=None,
                            config=DPConfig(method=method)), cls.Options(**options))
    return run, model, strat


def _local_grad(model, rank, step):
    rng = np.random.default_rng([7, rank, step])
    # tensors at very different scales, as real layers have
    g = rng.standard_normal(model.layout.total).astype(np.float32)
    g *= model.layout.expand({n: 10.0 ** (i % 3 - 1) for i, n in enumerate(model.layout.names)},
                             dtype=np.float32)
    return g


def _check_ledger(run, strat, snap, steps):
    delta = run.ledger.since(snap)
    want = {}
    for b in steps:
        for phase, v in b.items():
            w = want.setdefault(phase, [0, 0])
            w[0] += v["intra"]
            w[1] += v["inter"]
    mine = {p: (e["intra_bytes"], e["inter_bytes"]) for p, e in delta.items()}
    totals = MPI.COMM_WORLD.allgather(mine)
    got = {}
    for d in totals:
        for p, (a, b) in d.items():
            g = got.setdefault(p, [0, 0])
            g[0] += a
            g[1] += b
    return got == want, f"measured {got} != predicted {want}"


def check_ddp(allreduce):
    run, model, strat = _setup("ddp", bucket_mib=0.01, allreduce=allreduce)
    rank = run.rank
    snap = run.ledger.local()
    ok, msgs, preds = True, [], []
    for step in range(2):
        g = _local_grad(model, rank, step)
        model.grads.flat[...] = g
        ref = np.mean(MPI.COMM_WORLD.allgather(g), axis=0)
        calls = sync_step(strat, StepState(step, 0, 0.0))
        out = model.grads.flat
        preds.append(bytes_by_phase(calls, run.topo.placement))
        if not np.allclose(out, ref, rtol=1e-5, atol=1e-6):
            ok, msgs = False, msgs + [f"step {step}: max err {np.abs(out - ref).max()}"]
    if len(strat.buckets) < 2:
        ok, msgs = False, msgs + [f"expected several buckets, got {strat.buckets}"]
    lok, lmsg = _check_ledger(run, strat, snap, preds)
    collective_check(MPI.COMM_WORLD, ok and lok, "; ".join(msgs) + ("" if lok else lmsg))


def _reference_topk(acc, offsets, ks):
    sent = np.zeros_like(acc)
    for l, k in enumerate(ks):
        a, b = offsets[l], offsets[l + 1]
        order = np.argsort(-np.abs(acc[a:b]), kind="stable")[:k]
        sent[a + order] = acc[a + order]
    return sent


def check_topk():
    run, model, strat = _setup("topk", density=0.05)
    rank, size = run.rank, run.size
    residuals = [np.zeros(model.layout.total, np.float32) for _ in range(size)]
    snap = run.ledger.local()
    ok, msgs, preds = True, [], []
    for step in range(3):
        g = _local_grad(model, rank, step)
        all_g = MPI.COMM_WORLD.allgather(g)
        total = np.zeros(model.layout.total, np.float64)
        for r in range(size):  # serial reference of every rank's error-feedback selection
            acc = all_g[r] + residuals[r]
            sent = _reference_topk(acc, strat.offsets, strat.ks)
            residuals[r] = acc - sent
            total += sent
        model.grads.flat[...] = g
        calls = sync_step(strat, StepState(step, 0, 0.0))
        out = model.grads.flat
        preds.append(bytes_by_phase(calls, run.topo.placement))
        if not np.allclose(out, total / size, rtol=1e-5, atol=1e-6):
            ok, msgs = False, msgs + [f"step {step}: max err {np.abs(out - total / size).max()}"]
        if not np.allclose(strat.residual, residuals[rank], atol=1e-6):
            ok, msgs = False, msgs + [f"step {step}: residual differs"]
    lok, lmsg = _check_ledger(run, strat, snap, preds)
    collective_check(MPI.COMM_WORLD, ok and lok, "; ".join(msgs) + ("" if lok else lmsg))


if __name__ == "__main__":
    name, *rest = sys.argv[1:]
    {"ddp": check_ddp, "topk": check_topk}[name](*rest)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"OK {' '.join(sys.argv[1:])}")
