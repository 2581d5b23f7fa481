"""MPI checks of SSFusion: ``python -m mpi4py dp_ssfusion_checks.py CHECK OUTDIR``.

``reference``: 4 ranks on 2 virtual nodes.  For each fusion mode (selective from a real warm-up
profile, a hand-made selective plan with dense tensors in both Buffer_AR and Buffer_AG,
per-tensor, multi-tensor, and selective with DGC momentum correction) every rank writes a
gradient whose tensors have very different scales, the strategy synchronizes it, and every
rank's gradient, residual and velocity before and after are gathered and compared with a serial
NumPy reference written from the papers: ``a = g + e`` (with momentum correction ``u = μ u +
g``, ``a = e + u``; DGC Alg. 1), exact top-``k`` per sparse tensor (per buffer for multi-tensor)
by a full sort, dense tensors summed as they are (``u`` with momentum correction), the sum
divided by ``p``; the new residual is ``a`` with the sent entries zeroed, the new velocity ``u``
with them zeroed (momentum factor masking).  It also recomputes the tensor-missing rate
(Table I), holds every step's calls to the plan's records the step ran from
(:func:`dataparallel.program.sync_step`, ``Recorder.account``) and checks that the ledger's
``ssf_*`` phases equal the sum of the records' bytes.

``offload_program``: SSFusion-O's recorded steps are the plan's programs (see
:func:`offload_program`).

``traffic CONFIGS``: ``dataparallel.train`` (``M`` nodes of 2 ranks, ``M`` from the world size)
for selective (with and without interleaving,
with offload), per-tensor and multi-tensor; measured bytes == the trainer's per-step prediction ==
:func:`volume.ssfusion.run_bytes` for the whole run, per phase.
"""

import dataclasses
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dataparallel import StepState, SyncContext
from dataparallel.program import StepBindings, step_program, sync_step, unit_tensors
from dataparallel.ssfusion import SSFusion, SSFusionOptions
from dataparallel.train import DPConfig, build_parser, train
from models import SGD, SGDConfig, build_model, load_digits
from runner.run import start_run
from substrate import collective_check
from substrate.calls import Call, bytes_by_phase
from substrate.executor import Executor, Pass
from volume import ssfusion as cv

R = 2
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/ssfusion_checks")


def _setup(tag, momentum=0.0, record=None, **opts):
    cfg = DPConfig(method="ssfusion", seed=3)
    args = Namespace(out=str(OUT / tag), seed=cfg.seed, device="cpu", ranks_per_node=R,
                     intra_bw=2400.0, inter_bw=100.0, intra_lat=2.0, inter_lat=5.0,
                     compute_profile_out=record)
    run = start_run(args, system="dataparallel", method="ssfusion-test", config=cfg)
    data = load_digits()
    model = build_model("cnn", data.train.input_shape, 10, seed=cfg.seed)
    opt = SGD(model.params, model.grads, SGDConfig(momentum=momentum)) if momentum else None
    strat = SSFusion(SyncContext(run=run, model=model, opt=opt, train=None, config=cfg),
                     SSFusionOptions(**opts))
    assert strat.mu == momentum and (opt is None or opt.momentum_buffer is None)
    return run, model, strat


def _gradient(layout, rank, step):
    """Tensors alternate between scale 1 and 1e-4 (biases large, weights small), so a
    buffer-wide top-k can miss whole weight tensors."""
    rng = np.random.default_rng([11, rank, step])
    parts = [rng.standard_normal(layout.sizes[n]) * (1.0 if i % 2 == 0 else 1e-4)
             for i, n in enumerate(layout.names)]
    return np.concatenate(parts).astype(np.float32)


def _exact_topk(a, k):
    return np.argsort(-np.abs(a), kind="stable")[:k]


def _reference(strat, gs, es, us, mu):
    """Synchronized gradient, new residuals, new velocities and per-rank missing counts, from
    the plan alone."""
    off, plan, p = strat.offsets, strat.plan, len(gs)
    multi = strat.options.fusion == "multi-tensor"
    total = np.zeros(off[-1])
    new_res, new_vel, missing = [], [], []
    any_sent = np.zeros(off[-1], dtype=bool)
    for g, e, u in zip(gs, es, us):
        u = mu * u.astype(np.float64) + g if mu else g.astype(np.float64)
        a = e + u
        dense = np.zeros(off[-1], dtype=bool)
        for l, k in enumerate(plan.k):
            dense[off[l]:off[l + 1]] = k < 0
        a = np.where(dense, u, a)  # dense tensors send u (or g) as it is, no residual
        sent = np.zeros(off[-1], dtype=bool)
        if multi:
            for t0, t1 in plan.buffers:
                lo, hi = off[t0], off[t1]
                sent[lo + _exact_topk(a[lo:hi], sum(plan.k[t0:t1]))] = True
        else:
            for l, k in enumerate(plan.k):
                lo, hi = off[l], off[l + 1]
                if k < 0:
                    sent[lo:hi] = True
                else:
                    sent[lo + _exact_topk(a[lo:hi], k)] = True
        total += np.where(sent, a, 0.0)
        new_res.append(np.where(sent, 0.0, a).astype(np.float32))
        new_vel.append(np.where(sent & ~dense, 0.0, u).astype(np.float32))
        missing.append(sum(not sent[off[l]:off[l + 1]].any() for l in range(len(plan.k))))
        any_sent |= sent
    missing_global = sum(not any_sent[off[l]:off[l + 1]].any() for l in range(len(plan.k)))
    return total / p, new_res, new_vel, missing + [missing_global]


def _check_mode(tag, plan=None, momentum=0.0, **opts):
    run, model, strat = _setup(tag, momentum, **opts)
    g = model.grads.flat
    layout = model.layout
    steps = 3
    warm = strat.warmup
    bytes_pred: dict = {}
    ok, msgs = True, []
    ref_missing = []
    for step in range(warm + steps):
        g[...] = _gradient(layout, run.rank, step)
        e = strat.residual.copy()
        u = strat.velocity.copy() if momentum else np.zeros_like(e)
        gs = run.world.allgather(g.copy(), phase="test_gather").result
        es = run.world.allgather(e, phase="test_gather").result
        us = run.world.allgather(u, phase="test_gather").result
        gathers = [Call("test_gather", "allgather", run.world.group,
                        blocks=(a.nbytes,) * run.size, itemsize=a.itemsize) for a in (g, e, u)]
        if plan is not None and step == warm:
            strat._install(plan)
        state = StepState(step=step, epoch=0, loss=0.0)
        records = sync_step(strat, state)
        strat.after_step(state)
        # the run holds itself to the plan's records (raises on the first difference)
        run.recorder.account([*gathers, *records])
        for ph, b in bytes_by_phase(records, run.topo.placement).items():
            acc = bytes_pred.setdefault(ph, {"intra": 0, "inter": 0})
            acc["intra"] += b["intra"]
            acc["inter"] += b["inter"]
        if step < warm:
            src = gs.astype(np.float64) + momentum * us
            want = src.mean(axis=0)
            if momentum and not np.allclose(strat.velocity, src[run.rank], rtol=1e-6):
                ok = False
                msgs.append(f"warm-up step {step}: velocity is not mu u + g")
            err = np.abs(g - want).max()
            ok &= bool(err <= 1e-6 * np.abs(want).max())
            msgs.append(f"warm-up step {step}: |err| {err:.3g}")
            continue
        want, res, vel, missing = _reference(strat, list(gs), list(es), list(us), momentum)
        ref_missing.append(missing)
        for l, n in enumerate(layout.names):
            sl = layout.slice(n)
            scale = np.abs(want[sl]).max() + 1e-30
            err = np.abs(g[sl] - want[sl]).max()
            if not err <= 1e-5 * scale:
                ok = False
                msgs.append(f"step {step} tensor {n}: synced error {err:.3g} (scale {scale:.3g})")
        # one float32 operation per entry without momentum (exact); with momentum two (u, then
        # e + u): within float32 rounding of each tensor's scale
        for what, mine, ref in (("residual", strat.residual, res[run.rank]),
                                ("velocity", strat.velocity, vel[run.rank])):
            if what == "velocity" and not momentum:
                continue
            for n in layout.names:
                sl = layout.slice(n)
                tol = 1e-6 * np.abs(ref[sl]).max() if momentum else 0.0
                bad = np.flatnonzero(np.abs(mine[sl] - ref[sl]) > tol)
                if bad.size:
                    ok = False
                    msgs.append(f"step {step} tensor {n}: {what} differs at {bad.size} entries")
    rep = strat.report()
    ref = np.array(ref_missing, dtype=float) / strat.L  # steps x (ranks + global)
    for key, want_rate in (("tensor_missing_rate", ref[:, run.rank].mean()),
                           ("tensor_missing_rate_global", ref[:, -1].mean())):
        if not np.isclose(rep[key], want_rate):
            ok = False
            msgs.append(f"{key} {rep[key]} != reference {want_rate}")
    # the ledger's ssf_* phases equal the sum of the records' bytes (over all ranks)
    meas = run.ledger.totals(run.world)["by_phase"]
    meas = {ph: {"intra": v["intra_bytes"], "inter": v["inter_bytes"]} for ph, v in meas.items()
            if ph.startswith("ssf_")}
    if meas != bytes_pred:
        ok = False
        msgs.append(f"ledger {meas} != the records' bytes {bytes_pred}")
    collective_check(run.world, ok, f"{tag} on rank {run.rank}: " + "; ".join(msgs[-4:]))
    return rep


def reference():
    reps = {}
    reps["selective"] = _check_mode("selective", fusion="selective", profile_steps=2)
    # a hand-made plan: fc1.bias dense in Buffer_AR (split 1), conv2.weight dense in Buffer_AG
    # (split 0), conv1.bias dense in Buffer_AR (split 2), the rest sparse
    _, model, probe = _setup("probe", fusion="per-tensor", fusion_policy="count",
                             profile_steps=0)
    names = list(model.layout.names)
    k = list(probe.plan.k)
    for n in ("fc1.bias", "conv2.weight", "conv1.bias"):
        k[names.index(n)] = -1
    plan = dataclasses.replace(probe.plan, fusion="selective", k=tuple(k), split=(0, 1, 0, 2),
                               profiled=True)
    reps["hand"] = _check_mode("hand", plan=plan, fusion="selective", profile_steps=1,
                               fusion_policy="count")
    reps["momentum"] = _check_mode("momentum", plan=plan, momentum=0.9, fusion="selective",
                                   profile_steps=2, fusion_policy="count")
    reps["per-tensor"] = _check_mode("per-tensor", fusion="per-tensor", profile_steps=1)
    reps["multi-tensor"] = _check_mode("multi-tensor", fusion="multi-tensor", profile_steps=0,
                                       fusion_policy="count")
    hand = reps["hand"]["selection"]
    ok = (hand["allreduce_elements"][1] == 64 and hand["allgather_dense_elements"][2] == 4608
          and hand["allreduce_elements"][3] == 16)
    # Table I: no tensor missing without multi-tensor fusion; multi-tensor misses fc2.weight
    # and conv1.weight (scale 1e-4 next to a bias of scale 1 in a buffer of too small a K)
    ok &= all(reps[m]["tensor_missing_rate"] == 0
              for m in ("selective", "hand", "momentum", "per-tensor"))
    ok &= reps["multi-tensor"]["tensor_missing_rate"] > 0
    ok &= set(reps["multi-tensor"]["missing_by_tensor"]) >= {"fc2.weight", "conv1.weight"}
    rates = {m: r.get("tensor_missing_rate") for m, r in reps.items()}
    collective_check(MPI.COMM_WORLD, ok, f"missing rates {rates}, hand-made plan {hand}")


def offload_program():
    """SSFusion-O's steps as the run records them (the clock's and the communicators' own
    hooks, with the model's per-layer events) are the programs generated from the plan's
    records (:meth:`substrate.executor.Executor.verify`): after a profiled warm-up, a plan
    that hands fc2.weight (before fusion buffer 0's split), fc1.weight (after it) and
    conv2.weight to the CPU worker; each worker item is an event on the offload stream of the
    worker's own time, which the buffer's collection waits for."""
    run, model, strat = _setup("offload-program", momentum=0.9, record=str(OUT / "prog.json"),
                               fusion="selective", fusion_policy="count", buffers=2,
                               profile_steps=2, offload=True)
    names = list(model.layout.names)
    offload = tuple(n in ("fc2.weight", "fc1.weight", "conv2.weight") for n in names)
    k = list(strat._template.k)
    k[names.index("fc1.bias")] = -1
    plan = dataclasses.replace(strat._template, k=tuple(k), split=(3, 0), offload=offload)
    data = load_digits()
    x, y = data.train.x[:16], data.train.y[:16]
    model.recorder = run.clock.layers
    executor = Executor(run)
    units, tensors = model.compute_units(), unit_tensors(model)
    steps, problems = strat.warmup + 3, []
    for step in range(steps):
        if step == strat.warmup:
            strat._install(plan)
        state = StepState(step=step, epoch=0, loss=0.0)
        records = strat.records(state)
        program = step_program(units, records, run.topo.placement, run.rank)
        bind = StepBindings(strat, Pass(lambda ready: model.loss_and_grad(x, y, ready=ready),
                                        tensors))
        start = len(run.clock.program)
        executor.run_step(program, bind)
        if step >= strat.warmup:
            entries = run.clock.program.since(start)
            seconds = {b.index: b.seconds for b in run.clock._blocks}
            work = {e[2]: start + i for i, e in enumerate(entries)
                    if e[0] == "B" and e[5] == "offload"}
            if sorted(work) != sorted(f"ssf_offload[{names.index(n)}]" for n in
                                      ("fc2.weight", "fc1.weight", "conv2.weight")):
                problems.append(f"step {step}: offload blocks {sorted(work)}")
            wait = [e for e in entries if e[0] == "B" and e[2].startswith("ssf_offload_wait")]
            if not all((seconds[i] or 0) > 0 for i in work.values()) or len(wait) != 2 or \
                    not set(wait[0][4]) >= {work["ssf_offload[1]"], work["ssf_offload[3]"]}:
                problems.append(f"step {step}: the worker's blocks or their collection")
        run.clock.step()
        strat.after_step(state)
    executor.verify()
    if executor.steps_verified != steps:
        problems.append(f"{executor.steps_verified} of {steps} steps verified")
    collective_check(run.world, not problems, f"rank {run.rank}: " + "; ".join(problems))


TRAFFIC_CONFIGS = {"selective": [], "naive": ["--no-interleave"], "offload": ["--offload"],
                   "per-tensor": ["--fusion", "per-tensor"],
                   "multi-tensor": ["--fusion", "multi-tensor", "--buffers", "2"],
                   "count": ["--fusion", "per-tensor", "--fusion-policy", "count", "--buffers",
                             "3"],
                   "gaussiank": ["--sparsifier", "gaussiank", "--first-buffer", "exclude",
                                 "--no-momentum-correction"]}
STEPS, WARM = 5, 2


def traffic():
    """Configurations from ``sys.argv[3]`` (comma-separated keys of TRAFFIC_CONFIGS)."""
    base = ["--method", "ssfusion", "--steps", str(STEPS), "--profile-steps", str(WARM),
            "--ranks-per-node", str(R), "--eval-every", str(STEPS), "--batch-size", "8"]
    msgs, ok = [], True
    for tag in sys.argv[3].split(","):
        extra = TRAFFIC_CONFIGS[tag]
        args = build_parser().parse_args(base + extra + ["--out", str(OUT / f"train_{tag}")])
        s = train(args)
        meas, pred = s["traffic"]["measured"], s["traffic"]["predicted"]
        m = {ph: {"intra": v["intra_bytes"], "inter": v["inter_bytes"]}
             for ph, v in meas["by_phase"].items()}
        pr = {ph: {"intra": v["intra_bytes"], "inter": v["inter_bytes"]}
              for ph, v in pred["by_phase"].items()}
        met = s["metrics"]
        sel = met["selection"]
        L = sum(len(t) for t in met["buffer_tensors"])
        sizes = [int(v) for v in _buffer_sizes(met["warmup_buffer_tensors"])]
        M = MPI.COMM_WORLD.size // R
        whole = cv.run_bytes(M=M, P=R, steps=STEPS, warmup_steps=WARM,
                             warmup_buffer_sizes=sizes, ar_counts=sel["allreduce_elements"],
                             ag_dense_counts=sel["allgather_dense_elements"],
                             ag_sparse_counts=sel["sparse_elements"], num_tensors=L,
                             selection=(met["fusion"] == "selective"
                                        or met["fusion_policy"] == "cupcake"))
        good = (m == pr == whole and meas["inter_node_bytes"] == pred["inter_node_bytes"] > 0
                and meas["intra_node_bytes"] == pred["intra_node_bytes"] > 0)
        ok &= good
        if not good:
            msgs.append(f"{tag}: measured {m} predicted {pr} closed form {whole}")
    collective_check(MPI.COMM_WORLD, ok, "; ".join(msgs))


def _buffer_sizes(buffer_tensors):
    model = build_model("cnn", load_digits().train.input_shape, 10, seed=0)
    return [sum(model.layout.sizes[n] for n in names) for names in buffer_tensors]


CHECKS = {"reference": reference, "traffic": traffic, "offload_program": offload_program}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {sys.argv[1]}")
