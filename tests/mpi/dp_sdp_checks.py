"""MPI checks of SDP: ``python -m mpi4py dp_sdp_checks.py CHECK MODE [COVERAGE]``.

On 2 virtual nodes x 2 ranks:

``gated``  every rank feeds seeded random gradients; the synchronized gradient must equal the
           gated average ``Σ_{i holds j} g_ij / d_j`` (paper 003, eq. "average") computed
           serially from all ranks' gradients and a mask built here independently (N-SDP on the
           cnn from the cyclic chunk rule; block modes checked structurally), zero elsewhere.
``train``  three real steps on digits: one SGD step against a serial reference, holders stay
           identical (forward masking: non-holders exactly zero; B_b: one global θ), rank 0's
           evaluation model equals the reference assembly from the holders (times the weight
           scaling rule with a third argument ``rescale``: ``--eval-rescale``), and the ledger
           equals the closed form summed over the steps.

Both run the strategy's step programs (:func:`dataparallel.program.sync_step`) and hold every
step's executed calls to the step's records (the plan's: gated all-reduces, B_b's broadcasts
after the update, the assembly on rank 0 in a step before an evaluation), and check that asking
for a kind of step's records again gives the same list.
"""

import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import numpy as np
from dp_checks import _check_ledger  # same folder: ledger delta == Σ step_bytes()
from mpi4py import MPI

from dataparallel import STRATEGIES, StepState, SyncContext
from dataparallel.program import sync_step
from dataparallel.train import DPConfig
from models import SGD, SGDConfig, build_model, iterate_batches, load_digits, shard
from runner.run import start_run
from substrate import collective_check
from substrate.calls import bytes_by_phase

R = 2
COMM = MPI.COMM_WORLD

#: results directory of the runs built here (never finished, so never published)
CHECK_OUT = str(Path(tempfile.gettempdir()) / "spardist-checks" / "dp_sdp")


def _setup(model_name, steps=3, **options):
    cfg = DPConfig(method="sdp", model=model_name, steps=steps, lr=0.05)
    args = Namespace(out=CHECK_OUT, seed=0, device="cpu", ranks_per_node=R, intra_bw=2400.0,
                     inter_bw=100.0, intra_lat=2.0, inter_lat=5.0)
    run = start_run(args, system="dataparallel", method="sdp", config=cfg)
    run.writer.enabled = False
    data = load_digits()
    train = shard(data.train, run.rank, run.size, seed=0)
    model = build_model(model_name, data.train.input_shape, 10, seed=0)
    opt = SGD(model.params, model.grads,
              SGDConfig(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                        decay_kinds=("conv", "fc")))
    cls = STRATEGIES["sdp"]
    strat = cls(SyncContext(run=run, model=model, opt=opt, train=train, config=cfg),
                cls.Options(**options))
    return cfg, run, data, train, model, opt, strat


def _step(run, strat, state, optimizer=None):
    """One step's program (:func:`sync_step`); the calls it ran must be the step's records
    (``Recorder.account`` raises on the first difference), and asking for the records of the
    same kind of step again gives the same list without a side effect.  Returns
    the step's bytes per phase and the messages."""
    records = sync_step(strat, state, optimizer=optimizer)
    run.recorder.account(records)
    msgs = [] if strat.records(state) is records else ["records() changed when asked again"]
    return bytes_by_phase(records, run.topo.placement), msgs


def reference_cnn_mask(model, n, p):
    """m (n x T) of N-SDP on the cnn, written from the paper's rule (§3.2, §4): every masked
    parameter on exactly p workers.  The masked layers are conv1 and fc1 (non-adjacent, the
    most parameters); neuron chunk c (of n contiguous chunks) lives on the window {c..c+p-1};
    a masked neuron's row, bias and the next layer's input column(s) carry its holders; conv2's
    and fc2's biases are on all.  Returns the mask and the weight-scaling factors of
    ``--eval-rescale`` (p/n on the input columns of a masked layer, 1 elsewhere)."""
    def holders(width):
        chunk = np.concatenate([[c] * len(a) for c, a in
                                enumerate(np.array_split(np.arange(width), n))])
        out = np.zeros((width, n), bool)
        for j, c in enumerate(chunk):
            out[j, [(c + i) % n for i in range(p)]] = True
        return out

    L = model.layout
    h1 = holders(L.shape("conv1.weight")[0])
    h3 = holders(L.shape("fc1.weight")[0])
    m = np.ones((n, L.total), bool)
    scale = np.ones(L.total)

    def rows(name, h):                       # axis 0 indexes the masked neurons
        shape = L.shape(name)
        per = np.broadcast_to(h.reshape((shape[0],) + (1,) * (len(shape) - 1) + (n,)),
                              shape + (n,))
        m[:, L.slice(name)] = per.reshape(-1, n).T

    def cols(name, h):                       # axis 1 indexes them (repeated per feature)
        shape = L.shape(name)
        hc = np.repeat(h, shape[1] // h.shape[0], axis=0)
        per = np.broadcast_to(hc.reshape((1, shape[1]) + (1,) * (len(shape) - 2) + (n,)),
                              shape + (n,))
        m[:, L.slice(name)] = per.reshape(-1, n).T
        scale[L.slice(name)] = p / n

    rows("conv1.weight", h1)
    rows("conv1.bias", h1)
    cols("conv2.weight", h1)
    rows("fc1.weight", h3)
    rows("fc1.bias", h3)
    cols("fc2.weight", h3)
    return m, scale


def structural_block_check(model, masks, b):
    """Block modes: each rank holds whole main branches of exactly b blocks, all else by all."""
    L = model.layout
    blocks = sorted({n.split(".")[0] + "." + n.split(".")[1] for n in L.names
                     if n.startswith("layer")})
    inside = np.zeros(L.total, bool)
    msgs = []
    for blk in blocks:
        names = [n for n in L.names if n.startswith(blk + ".") and ".shortcut." not in n]
        idx = np.concatenate([np.arange(L.slice(n).start, L.slice(n).stop) for n in names])
        inside[idx] = True
        for r in range(masks.shape[0]):
            if len(set(masks[r, idx].tolist())) != 1:
                msgs.append(f"rank {r} holds part of block {blk}")
    held_blocks = [sum(bool(masks[r, L.slice(n).start]) for n in
                       [next(x for x in L.names if x.startswith(b_ + ".")
                             and ".shortcut." not in x) for b_ in blocks])
                   for r in range(masks.shape[0])]
    if held_blocks != [b] * masks.shape[0]:
        msgs.append(f"blocks per rank {held_blocks}, want {b}")
    if not masks[:, ~inside].all():
        msgs.append("a coordinate outside the blocks' main branches is not held by all")
    return msgs


def gated(mode, coverage="3/4"):
    model_name = "cnn" if mode == "neuron" else "resnet"
    opts = {"sdp_mode": mode, "coverage": coverage}
    _cfg, run, _data, _train, model, _opt, strat = _setup(model_name, **opts)
    rank, n = run.rank, run.size
    T = model.layout.total
    masks = np.array(COMM.allgather(strat.mask.astype(bool)))
    msgs = []
    if mode == "neuron":
        num, den = (int(x) for x in coverage.split("/"))
        ref, _ = reference_cnn_mask(model, n, num * n // den)
        if not np.array_equal(ref, masks):
            msgs.append(f"mask differs from the reference in {(ref != masks).sum()} entries")
    else:
        ref = masks
        msgs += structural_block_check(model, masks, strat.plan.detail["b"])
    deg = ref.sum(axis=0)
    if deg.min() < 1:
        msgs.append(f"{(deg < 1).sum()} coordinates without a holder")
    snap = run.ledger.local()
    preds = []
    for step in range(2):
        rng = np.random.default_rng([11, rank, step])
        g = rng.standard_normal(T).astype(np.float32)
        model.grads.flat[...] = g
        all_g = np.array(COMM.allgather(g), dtype=np.float64)
        want = np.where(ref[rank], (ref * all_g).sum(axis=0) / deg, 0.0)
        got, bad = _step(run, strat, StepState(step, 0, 0.0))
        msgs += bad
        preds.append(got)
        out = model.grads.flat
        err = np.abs(out - want).max()
        if not np.allclose(out, want, rtol=1e-5, atol=1e-6):
            msgs.append(f"step {step}: gated average max error {err}")
    ok, lmsg = _check_ledger(run, strat, snap, preds)
    collective_check(COMM, not msgs and ok, "; ".join(msgs) + ("" if ok else lmsg))


def train(mode, coverage="3/4", rescale=""):
    model_name = "cnn" if mode == "neuron" else "resnet"
    steps = 3
    rescale = rescale == "rescale"
    cfg, run, data, train_, model, opt, strat = _setup(model_name, steps=steps,
                                                        sdp_mode=mode, coverage=coverage,
                                                        eval_rescale=rescale)
    rank, n = run.rank, run.size
    masks = np.array(COMM.allgather(strat.mask.astype(bool)))
    deg = masks.sum(axis=0)
    forward = mode != "block-backward"
    theta0 = build_model(model_name, data.train.input_shape, 10, seed=0).params.flat.copy()
    decay = model.layout.expand({nm: cfg.weight_decay if model.layout.kind(nm) in ("conv", "fc")
                                 else 0.0 for nm in model.layout.names}, dtype=np.float32)
    msgs = []
    if forward and not np.array_equal(model.params.flat, np.where(masks[rank], theta0, 0)):
        msgs.append("forward masking did not zero the parameters outside the subnetwork")
    snap = run.ledger.local()
    preds = []
    batches = iterate_batches(train_, cfg.batch_size, seed=cfg.seed, rank=rank, epoch=0)
    for step in range(steps):
        x, y = next(batches)
        loss, _ = model.loss_and_grad(x, y)
        if step == 0:  # serial reference of the first update: gated average, masked momentum SGD
            all_g = np.array(COMM.allgather(model.grads.flat.copy()), dtype=np.float64)
            g_hat = np.where(masks[rank], (masks * all_g).sum(axis=0) / deg, 0.0)
            th = model.params.flat.astype(np.float64)
            want1 = th - cfg.lr * masks[rank] * (g_hat + decay * th)
        # the last step is evaluated: its program assembles the model on rank 0
        state = StepState(step, 0, float(loss), evaluated=step == steps - 1)
        got, bad = _step(run, strat, state, optimizer=opt.step)
        strat.after_step(state)
        msgs += bad
        preds.append(got)
        if step == 0:
            got1 = model.params.flat
            if not forward:  # every rank's copy of a coordinate is its lowest holder's update
                lowest = masks.argmax(axis=0)
                want1 = np.array(COMM.allgather(want1))[lowest, np.arange(masks.shape[1])]
            err = np.abs(got1 - want1).max()
            if not np.allclose(got1, want1, rtol=1e-5, atol=1e-6):
                msgs.append(f"first update differs from the serial reference by {err}")
    all_theta = np.array(COMM.allgather(model.params.flat.copy()))
    if forward and np.any(all_theta[~masks] != 0):
        msgs.append("a non-holder's parameter moved away from zero")
    lowest = masks.argmax(axis=0)
    pick = all_theta[lowest, np.arange(all_theta.shape[1])]
    for r in range(n):
        held = masks[r] if forward else np.ones(masks.shape[1], bool)
        if not np.array_equal(all_theta[r][held], pick[held]):
            msgs.append(f"rank {r} disagrees with the lowest holder on "
                        f"{(all_theta[r][held] != pick[held]).sum()} coordinates")
    # rank 0's evaluation model = reference assembly from the holders (as assembled, the
    # paper's; weight-scaled with --eval-rescale)
    all_bufs = COMM.allgather({k: v.copy() for k, v in model.buffers.items()})
    if rank == 0:
        if not rescale:
            scale = np.ones(masks.shape[1])
        elif mode == "neuron":
            num, den = (int(x) for x in coverage.split("/"))
            _, scale = reference_cnn_mask(model, n, num * n // den)
        elif mode == "block":
            scale = np.ones(masks.shape[1])
            for nm in model.layout.names:
                if nm.startswith("layer") and ".bn2." in nm and ".shortcut." not in nm:
                    sl = model.layout.slice(nm)
                    scale[sl] = deg[sl] / n
        else:
            scale = np.ones(masks.shape[1])
        want = (pick * scale).astype(np.float32)
        got = strat.eval_params()
        if not np.allclose(got, want, rtol=1e-6, atol=1e-7):
            msgs.append(f"eval model differs from the assembly by {np.abs(got - want).max()}")
        if forward:  # BatchNorm statistics of channels rank 0 lacks come from their holder
            for name, buf in model.buffers.items():
                prm = name.replace("running_mean", "weight").replace("running_var", "weight")
                sl = model.layout.slice(prm)
                src = lowest[sl]
                want_b = np.array([all_bufs[s][name][c] for c, s in enumerate(src)])
                if not np.array_equal(buf, want_b):
                    msgs.append(f"buffer {name} not assembled from its holders")
    ok, lmsg = _check_ledger(run, strat, snap, preds)
    collective_check(COMM, not msgs and ok, "; ".join(msgs) + ("" if ok else lmsg))


CHECKS = {"gated": gated, "train": train}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](*sys.argv[2:])
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"OK {' '.join(sys.argv[1:])}")
