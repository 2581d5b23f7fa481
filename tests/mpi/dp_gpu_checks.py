"""Data-parallel strategies on the strict CuPy stand-in against the CPU path, step by step:
``python -m mpi4py dp_gpu_checks.py CHECK OUTDIR`` (``tests/strictcupy`` on ``PYTHONPATH``).

``offload_momentum``: SSFusion-O with DGC momentum correction.  A CPU and a GPU
strategy on 4 ranks (2 virtual nodes) get the same gradients; after the dense warm-up (where
the velocity builds up) both install the same plan, which hands every second sparse tensor to
the CPU worker (the plan's ``ssf_offload[l]`` items, during the backward of the step's program
as the trainer runs it).  Every sparse step's
synchronized gradient, velocity and residual must equal the CPU run's: bitwise for the
synchronized gradient (the same selections, the same ring order), within float32 rounding for
the state.  Before the fix the GPU worker's host velocity started at zero at the plan's
installation and the first sparse step already differed.
"""

import dataclasses
import sys
from argparse import Namespace
from pathlib import Path

import cupy as cp
import numpy as np

from dataparallel import StepState, SyncContext
from dataparallel.program import sync_step
from dataparallel.ssfusion import SSFusion, SSFusionOptions
from dataparallel.train import DPConfig
from models import SGD, SGDConfig, build_model, load_digits
from runner.run import start_run
from substrate import collective_check

assert hasattr(cp, "_strict"), "runs on the strict stand-in (tests/strictcupy)"
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/dp_gpu_checks")


def _strategy(device, options):
    cfg = DPConfig(method="ssfusion", seed=3)
    args = Namespace(out=str(OUT / device), seed=cfg.seed, device=device, ranks_per_node=2,
                     intra_bw=2400.0, inter_bw=100.0, intra_lat=2.0, inter_lat=5.0,
                     compute_source="flops", device_tflops=15.7)
    run = start_run(args, system="dataparallel", method="ssfusion-gpu-test", config=cfg)
    data = load_digits()
    kw = {"xp": cp} if device == "gpu" else {}
    model = build_model("cnn", data.train.input_shape, 10, seed=cfg.seed, **kw)
    opt = SGD(model.params, model.grads, SGDConfig(momentum=0.9))
    strat = SSFusion(SyncContext(run=run, model=model, opt=opt, train=None, config=cfg), options)
    return run, model, strat


def _gradient(layout, rank, step):
    rng = np.random.default_rng([13, rank, step])
    return np.concatenate([rng.standard_normal(layout.sizes[n]) * (1.0 if i % 2 else 1e-3)
                           for i, n in enumerate(layout.names)]).astype(np.float32)


def _state(strat, host):
    """(velocity, residual) as the CPU run keeps them: on a GPU run the offloaded segments'
    live on the host."""
    vel, res = host(strat.velocity).copy(), host(strat.residual).copy()
    for sid, v in strat._host_vel.items():
        _, seg = strat._seg_of[sid]
        vel[seg.a:seg.b] = v
    for sid, r in strat._host_res.items():
        _, seg = strat._seg_of[sid]
        res[seg.a:seg.b] = r
    return vel, res


def offload_momentum():
    options = SSFusionOptions(fusion="selective", fusion_policy="count", buffers=3,
                              profile_steps=2, offload=True)
    runs = {d: _strategy(d, options) for d in ("cpu", "gpu")}
    run = runs["cpu"][0]
    cpu_strat = runs["cpu"][2]
    # the same hand-made plan on both: every second sparse tensor offloaded
    base = cpu_strat._template
    sparse = [l for l, k in enumerate(base.k) if k >= 0]
    offload = tuple(l in sparse[::2] for l in range(len(base.k)))
    plan = dataclasses.replace(base, offload=offload, profiled=True)
    problems = []
    warm = cpu_strat.warmup
    for step in range(warm + 4):
        out = {}
        for device, (r, model, strat) in runs.items():
            conv = cp.asarray if device == "gpu" else (lambda a: a)
            g = _gradient(model.layout, r.rank, step)
            model.grads.flat[...] = conv(g)
            if step == warm:
                strat._install(plan)
            state = StepState(step=step, epoch=0, loss=0.0)
            sync_step(strat, state)              # the backward's ready hooks, in order
            strat.after_step(state)
            host = r.backend.asnumpy
            out[device] = (host(model.grads.flat).copy(), *_state(strat, host))
        if step < warm:
            continue
        if not any(s.offload for b in runs["gpu"][2]._bufs for s in b.segments):
            problems.append("the GPU plan offloads nothing")
        (gc, vc, rc), (gg, vg, rg) = out["cpu"], out["gpu"]
        if not np.array_equal(gc, gg):
            bad = np.flatnonzero(gc != gg)
            problems.append(f"step {step}: synced gradient differs at {bad.size} entries "
                            f"(first {bad[:4].tolist()})")
        for what, a, b in (("velocity", vc, vg), ("residual", rc, rg)):
            if not np.allclose(a, b, rtol=1e-6, atol=1e-7 * np.abs(a).max()):
                problems.append(f"step {step}: {what} differs at "
                                f"{int((~np.isclose(a, b, rtol=1e-6)).sum())} entries")
    collective_check(run.world, not problems, "; ".join(problems[:6]))
    if run.rank == 0:
        print("OK offload_momentum")


if __name__ == "__main__":
    {"offload_momentum": offload_momentum}[sys.argv[1]]()
