"""MPI checks of the H-SADMM solver: ``python -m mpi4py hsadmm_checks.py CHECK``.

``one_iteration`` runs the real solver on 2 virtual nodes x 2 ranks and compares every rank's
theta, u, z_i, v and z with a serial NumPy re-implementation of eqs. 8-13 (written here from the
paper, sharing no code with the solver except the model's forward/backward for gradients).

``checkpoint`` round-trips one solver's state through :class:`substrate.Checkpointer` into a fresh
solver mid-epoch and before the mask freeze, and checks both continue bit for bit.

``accounting`` (any world and ``R`` ranks per node: ``hsadmm_checks.py accounting R``) holds
every iteration's executed calls against the plan's records (:meth:`Recorder.account`, which
raises on the first difference), the records' bytes against the ledger summed over the ranks and
against :mod:`volume.hsadmm`'s closed forms, for H-SADMM (masks synced, then frozen; several
compact buckets) and flat ADMM; and a plan that is not what ran is refused.

``programs OUT NODE_MAP`` trains H-SADMM and flat ADMM briefly on the placement ``NODE_MAP``
(masks synchronized, then frozen; several compact buckets) with ``--compute-profile-out
OUT/METHOD.json``: the executor holds every iteration's recording equal to the program it ran
(:meth:`substrate.executor.Executor.verify`), and ``tests/hsadmm/test_under_mpi.py`` regenerates the
programs from the plans alone.
"""

import dataclasses
import itertools
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hsadmm.config import HSADMMConfig
from hsadmm.penalty import penalty_groups
from hsadmm.solver import HSADMM, FlatADMM
from hsadmm.train import main as train_main
from models import build_model, iterate_batches, load_digits, shard
from runner.run import start_run
from substrate import Checkpointer, collective_check
from substrate.ledger import merge_phase_dicts
from volume.hsadmm import flat_admm_iteration_bytes, hsadmm_iteration_bytes

R = 2

#: results directory of the runs built here (never finished, so never published)
CHECK_OUT = str(Path(tempfile.gettempdir()) / "spardist-checks" / "hsadmm")


SEED = 0
MODEL = "cnn"


def _setup(solver=HSADMM, ranks_per_node=R, node_map=None, **kw):
    cfg = HSADMMConfig(**kw)
    args = Namespace(out=CHECK_OUT, seed=SEED, device="cpu", ranks_per_node=ranks_per_node,
                     node_map=node_map, intra_bw=2400.0, inter_bw=100.0, intra_lat=2.0,
                     inter_lat=5.0)
    run = start_run(args, system="hsadmm", method="test", config=cfg)
    run.writer.enabled = False
    data = load_digits()
    train = shard(data.train, run.rank, run.size, seed=SEED)
    model = build_model(MODEL, data.train.input_shape, 10, seed=SEED)
    return cfg, run, data, model, solver(run, cfg, model, train)


def _reference_channel_projection(w, keep):
    """Keep the keep * C_in (nearest, ties up) input channels of largest Frobenius norm (ties:
    lower index)."""
    norms = np.sqrt((w.astype(np.float64) ** 2).sum(axis=(0, 2, 3)))
    alpha = max(1, int(np.floor(keep * w.shape[1] + 0.5)))
    keep_idx = np.argsort(-norms, kind="stable")[:alpha]
    mask = np.zeros(w.shape, bool)
    mask[:, keep_idx] = True
    return np.where(mask, w, 0).astype(w.dtype), mask


def reference(cfg, data, size, M):
    """Serial re-implementation of one H-SADMM iteration for all ranks (eqs. 8-13); eq. 8 has no
    weight decay unless ``cfg.theta_weight_decay`` (then lambda on conv/fc weights)."""
    P = size // M
    models = [build_model(MODEL, data.train.input_shape, 10, seed=SEED)
              for _ in range(size)]
    layout = models[0].layout
    theta0 = models[0].params.flat.copy()
    rho1 = np.float32(cfg.rho1)
    rho2 = np.float32(cfg.rho2)
    lam = cfg.weight_decay if cfg.theta_weight_decay else 0.0
    decay = layout.expand({n: lam if layout.kind(n) in ("conv", "fc") else 0.0
                           for n in layout.names}, dtype=np.float32)
    thetas, us = [], []
    for r, m in enumerate(models):  # eq. 8: SGD with momentum (+ wd) + proximal term
        train = shard(data.train, r, size, seed=SEED)
        z_i, u = theta0.copy(), np.zeros_like(theta0)
        b = np.zeros_like(theta0)
        steps = 0
        for x, y in iterate_batches(train, cfg.batch_size, seed=SEED, rank=r, epoch=0):
            m.loss_and_grad(x, y)
            th = m.params.flat
            d = m.grads.flat + decay * th + rho1 * (th - z_i + u)
            b = cfg.momentum * b + d
            th -= np.float32(cfg.lr) * b
            steps += 1  # noqa: SIM113 (counts the local steps taken, read after the loop)
            if steps == cfg.local_steps:
                break
        thetas.append(m.params.flat.copy())
        us.append(u)
    z = theta0.copy()
    v = [np.zeros_like(theta0) for _ in range(M)]
    gamma = np.float32(cfg.weight_decay / M) + P * rho1 + rho2
    z_i, masks = [], []
    for i in range(M):  # eqs. 9-10 per node
        s = sum(thetas[r] + us[r] for r in range(i * P, (i + 1) * P))
        zt = (rho1 * s + rho2 * (z - v[i])) / gamma
        zi = zt.copy()
        node_masks = {}
        for n in layout.names:
            if layout.kind(n) == "conv":
                sl = layout.slice(n)
                w = zt[sl].reshape(layout.shape(n))
                proj, mk = _reference_channel_projection(w, cfg.keep)
                zi[sl] = proj.ravel()
                node_masks[n] = mk
        z_i.append(zi)
        masks.append(node_masks)
    # eq. 14 (OR), eq. 15 (compaction), eq. 11 (average), recovery with zeros
    z_new = np.zeros_like(theta0)
    c = [z_i[i] + v[i] for i in range(M)]
    for n in layout.names:
        sl = layout.slice(n)
        if layout.kind(n) != "conv":
            z_new[sl] = sum(ci[sl] for ci in c) / np.float32(M)
            continue
        mg = np.logical_or.reduce([masks[i][n] for i in range(M)])
        k_out = np.flatnonzero(mg.any(axis=(1, 2, 3)))
        k_in = np.flatnonzero(mg.any(axis=(0, 2, 3)))
        full = np.zeros(layout.shape(n), np.float32)
        ix = np.ix_(k_out, k_in)
        full[ix] = sum(ci[sl].reshape(layout.shape(n))[ix] for ci in c) / np.float32(M)
        z_new[sl] = full.ravel()
    v_new = [v[i] + z_i[i] - z_new for i in range(M)]  # eq. 13
    u_new = [us[r] + thetas[r] - z_i[r // P] for r in range(size)]  # eq. 12
    return thetas, u_new, z_i, v_new, z_new


def one_iteration(**kw):
    cfg, run, data, _model, solver = _setup(local_steps=4, adaptive_rho=False, freeze_iter=0,
                                           freeze_patience=0, **kw)
    solver.iterate(0)
    th, u, zi, v, z = reference(cfg, data, run.size, run.topo.num_nodes)
    s, r, node = solver.state, run.rank, run.topo.node
    errs = {"theta": np.abs(s.theta - th[r]).max(), "u": np.abs(s.u - u[r]).max(),
            "z_i": np.abs(s.z_i - zi[node]).max(), "v": np.abs(s.v - v[node]).max(),
            "z": np.abs(s.z - z).max()}
    scale = max(1.0, float(np.abs(th[r]).max()))
    collective_check(run.world, all(e <= 1e-5 * scale for e in errs.values()),
                     f"rank {r} differs from the serial reference: {errs}")
    # the consensus z is identical on every rank
    zs = run.world.mpi.allgather(s.z)
    collective_check(run.world, all(np.array_equal(zs[0], x) for x in zs), "z differs by rank")


def one_iteration_theta_decay():
    """--theta-weight-decay: lambda as SGD weight decay in eq. 8 (the named deviation)."""
    one_iteration(theta_weight_decay=True, weight_decay=0.01)


def freezing():
    _cfg, run, _data, _model, solver = _setup(local_steps=2, freeze_iter=2)
    solver.iterate(0)
    solver.iterate(1)
    ok = solver.frozen
    masks = [m.copy() for m in solver.m_global]
    builds, buf_id, plan = solver.plan_builds, id(solver.plan.buffer), solver.plan
    for k in range(2, 5):
        out = solver.iterate(k)
        ok = ok and out["mask_drift"] == 0 and not out["mask_synced"]
    ok = ok and all(np.array_equal(a, b) for a, b in zip(masks, solver.m_global))
    ok = ok and solver.plan is plan and solver.plan_builds == builds
    ok = ok and id(solver.plan.buffer) == buf_id
    # the frozen support holds on z: nothing outside the global mask
    for j, i in enumerate(solver.pruned):
        w = solver.state.z[solver.slices[i]].reshape(masks[j].shape)
        ok = ok and not np.any(w[~masks[j]])
    phases = run.ledger.local()
    calls_sync = phases.get("mask_sync", {}).get("calls", 0)
    ok = ok and calls_sync == (2 if run.topo.is_leader else 0)
    collective_check(run.world, ok, f"freezing broken on rank {run.rank}: builds "
                     f"{solver.plan_builds}, mask_sync calls {calls_sync}")


def checkpoint():
    # 5 local steps do not divide the 12 batches of a shard epoch: resumption is mid-epoch;
    # freezing after iteration 3 happens in the resumed part
    kw = {"local_steps": 5, "freeze_iter": 3}
    cfg, run, data, _model, a = _setup(**kw)
    for k in range(2):
        a.iterate(k)
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d, rank=run.rank)
        ck.save(a.state_dict(), 2)
        state = ck.load(2)
    train = shard(data.train, run.rank, run.size, seed=SEED)
    b = HSADMM(run, cfg, build_model(MODEL, data.train.input_shape, 10, seed=SEED), train)
    b.load_state_dict(state)
    ok = b.batch_pos == a.batch_pos and 0 < a.batch_pos
    for k in range(2, 5):
        out_a, out_b = a.iterate(k), b.iterate(k)
        ok = ok and out_a == out_b
    sa, sb = a.state_dict(), b.state_dict()
    bad = sorted(k for k in sa if not np.array_equal(sa[k], sb[k]))
    ok = ok and not bad and a.frozen and b.frozen
    collective_check(run.world, ok, f"resumed solver differs on rank {run.rank}: {bad}")


def flat_freezing():
    """Flat ADMM (PruneX (AR)) tracks the masks of z's projection, reports their real drift and
    freezes them as H-SADMM does (§4.5); it never synchronizes masks on the wire."""
    _cfg, run, _data, _model, solver = _setup(FlatADMM, local_steps=3, freeze_iter=3,
                                           freeze_patience=0)
    drifts, history = [], []
    for k in range(5):
        out = solver.iterate(k)
        drifts.append(out["mask_drift"])
        history.append([m.copy() for m in solver.m_global])
        ok_frozen = out["frozen"] == (k + 1 >= 3)
        if not ok_frozen:
            break
    # iteration 0 leaves m = 1 for the keep-0.5 support: exactly half the channel bits flip
    # (conv1 has 1 input channel, kept whole)
    conv = [(solver.names[i], solver.layout.shape(solver.names[i])) for i in solver.pruned]
    kept = sum(int(np.prod(s)) // s[1] * max(1, int(np.floor(0.5 * s[1] + 0.5)))
               for _, s in conv)
    want0 = 1 - kept / solver.codec.nbits
    # the drift is the fraction of changed bits between consecutive global masks
    real = [float(np.mean(np.concatenate([(a != b).ravel() for a, b in zip(h0, h1)])))
            for h0, h1 in itertools.pairwise(history)]
    ok = ok_frozen and abs(drifts[0] - want0) < 1e-12
    ok = ok and all(abs(d - r) < 1e-12 for d, r in zip(drifts[1:], real))
    ok = ok and drifts[3:] == [0.0, 0.0]  # frozen after iteration 3 (index 2)
    for j, i in enumerate(solver.pruned):  # z lives on the frozen support
        w = solver.state.z[solver.slices[i]].reshape(history[-1][j].shape)
        ok = ok and not np.any(w[~history[-1][j]])
    phases = run.ledger.local()
    ok = ok and "mask_sync" not in phases
    zs = run.world.mpi.allgather(solver.state.z)
    ok = ok and all(np.array_equal(zs[0], x) for x in zs)
    collective_check(run.world, ok, f"flat ADMM freezing broken on rank {run.rank}: drifts "
                     f"{drifts} (want first {want0}), real {real}, phases {sorted(phases)}")


def _world_phases(run, snap) -> dict:
    """``{phase: (intra, inter)}`` the ledgers of all ranks booked since ``snap``."""
    merged = merge_phase_dicts(run.world.mpi.allgather(run.ledger.since(snap)))["by_phase"]
    return {ph: (e["intra_bytes"], e["inter_bytes"]) for ph, e in merged.items()}


def accounting(layout="2"):
    """``layout``: ranks per node (node-major virtual nodes), or a ``--node-map`` (e.g.
    ``round-robin:2``; the closed forms of :mod:`volume.hsadmm` are node-major: there the
    records are held against the ledger only)."""
    place = {"ranks_per_node": int(layout)} if layout.isdigit() else \
        {"ranks_per_node": None, "node_map": layout}
    failures = []
    for solver_cls in (HSADMM, FlatADMM):
        cfg, run, _, _, solver = _setup(solver_cls, local_steps=1, freeze_iter=2,
                                        bucket_mib=0.02, **place)
        M, P, T = run.topo.num_nodes, run.topo.ranks_per_node, solver.layout.total
        node_major = run.topo.placement.node_major_layout
        L = len(penalty_groups(solver.layout, cfg.rho_scope)[0])
        run.recorder.account([])              # nothing ran before the first iteration
        for k in range(3):
            snap = run.ledger.local()
            out = solver.iterate(k)
            planned = solver.iteration_calls(out["mask_synced"])
            got = run.recorder.account(planned)       # raises if anything else ran
            got = {ph: (b["intra"], b["inter"]) for ph, b in got.items()}
            if solver_cls is HSADMM:
                want = hsadmm_iteration_bytes(M=M, P=P, total_params=T,
                                              compact_sizes=out["compact_buckets"],
                                              mask_bytes=solver.codec.nbytes,
                                              mask_synced=out["mask_synced"], num_layers=L)
                if out["mask_synced"] != (k < 2) or len(out["compact_buckets"]) < 2:
                    failures.append(f"iteration {k}: synced {out['mask_synced']}, buckets "
                                    f"{out['compact_buckets']}")
            else:
                want = flat_admm_iteration_bytes(M=M, P=P, total_params=T, num_layers=L)
            want = {ph: (b["intra"], b["inter"]) for ph, b in want.items()}
            measured = _world_phases(run, snap)
            if not node_major:
                want = measured
            if not got == want == measured:
                failures.append(f"{solver_cls.__name__} iteration {k}: records {got}, closed "
                                f"form {want}, ledger {measured}")
        # a plan that is not what ran is refused: residuals of one float64 more (every rank),
        # H-SADMM without its first compact bucket (the leaders, who sent it)
        def more_residuals(planned):
            return planned[:-1] + [dataclasses.replace(planned[-1],
                                                       nbytes=planned[-1].nbytes + 8)]

        def one_bucket_less(planned):
            first = [c.phase for c in planned].index("inter_allreduce")
            return planned[:first] + planned[first + 1:]

        wrong = [(more_residuals, True)]
        if solver_cls is HSADMM:
            wrong.append((one_bucket_less, run.topo.is_leader))
        for k, (mutate, refuse) in enumerate(wrong, start=3):
            out = solver.iterate(k)
            try:
                run.recorder.account(mutate(solver.iteration_calls(out["mask_synced"])))
                refused = False
            except ValueError:
                refused = True
            if refused != refuse:
                failures.append(f"{solver_cls.__name__}: {mutate.__name__} was "
                                f"{'refused' if refused else 'accepted'}")
    collective_check(run.world, not failures, f"rank {run.rank}: {failures}")


def programs(out, node_map):
    for method in ("hsadmm", "flat-admm"):
        train_main(["train", "--method", method, "--iters", "2", "--local-steps", "1",
                    "--freeze-iter", "1", "--bucket-mib", "0.02", "--eval-every", "0",
                    "--node-map", node_map, "--out", str(Path(out) / method),
                    "--compute-profile-out", str(Path(out) / f"{method}.json")])


CHECKS = {"one_iteration": one_iteration, "one_iteration_theta_decay": one_iteration_theta_decay,
          "freezing": freezing, "checkpoint": checkpoint, "flat_freezing": flat_freezing,
          "accounting": accounting, "programs": programs}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](*sys.argv[2:])
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {sys.argv[1]}")
