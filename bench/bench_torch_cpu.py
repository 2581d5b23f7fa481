"""One training step of the project's models against PyTorch CPU, side by side in one process.

Prints (not a test)::

    python bench/bench_torch_cpu.py [--models cnn resnet18] [--batches 32 128]
                                    [--threads 1 2] [--repeat 3] [--windows 2] [--steps 0]

PyTorch is an optional *bench* dependency only (never imported by the package)::

    .venv/bin/pip install torch==2.13.0        # CPU build

For every (model, batch size, thread count) cell, both frameworks run the same training step
(forward in training mode + softmax cross-entropy + backward + SGD with momentum 0.9) on the
same float32 weights (the project's initial weights are copied into the PyTorch module by name)
and the same batch.  Threads: ``threadpoolctl.threadpool_limits(n)`` caps every BLAS/OpenMP
pool loaded in the process (NumPy's OpenBLAS and PyTorch's OpenMP/MKL), ``torch.set_num_threads
(n)`` sets PyTorch's intra-op pool, and ``numba.set_num_threads(n)`` the pool of the project's
Numba kernels (loaded before timing for a model with BatchNorm, as its first forward would).
Time is taken per window of ``--steps`` consecutive steps, as CPU time (``time.process_time``:
all threads of the process) and wall time (``time.perf_counter``); the two frameworks' windows
are interleaved and the minimum over ``--windows`` windows is one *repeat* (the least disturbed
window; other processes on the machine perturb the rest).  Each cell is repeated ``--repeat``
times and the table gives the **median** over repeats of each time and of each ratio (the
ratio of one repeat compares windows taken side by side).  ``ratio`` is project / PyTorch
(lower is better for the project; 1.0 = parity).  The load average (1 min) is printed before
and after each cell.

Before timing, one step of each is compared: the max relative difference of the logits and of
the parameter update shows that both compute the same thing (float32 round-off).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import OrderedDict
from pathlib import Path

# OpenBLAS workers sleep after a GEMM instead of spinning ~0.1 s, which starves the layer kernels'
# helper threads on small core counts (what runner.launch sets for MPI ranks); read when NumPy
# loads OpenBLAS. PyTorch's wheel has its own pools and is not affected.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INSTALL_HINT = ("bench_torch_cpu: PyTorch is not installed; it is an optional bench comparator. "
                "Install the CPU build with\n    .venv/bin/pip install torch==2.13.0\n"
                "and run again.")

LR, MOMENTUM = 0.05, 0.9


# ---------------------------------------------------------------------------------------------
# PyTorch twins of the project's models (same parameter and buffer names)
# ---------------------------------------------------------------------------------------------
def torch_cnn(torch, c_in: int, hw: int, num_classes: int, channels=(16, 32), hidden=64):
    """PyTorch twin of :func:`models.zoo.cnn_layers` (names conv1, conv2, fc1, fc2)."""
    nn = torch.nn
    c1, c2 = channels
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(c_in, c1, 3, padding=1)), ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(c1, c2, 3, padding=1)), ("relu2", nn.ReLU()),
        ("pool", nn.MaxPool2d(2)), ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(c2 * (hw // 2) * (hw // 2), hidden)), ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(hidden, num_classes)),
    ]))


def torch_resnet(torch, c_in: int, num_classes: int, depths=(2, 2, 2, 2),
                 planes=(64, 128, 256, 512)):
    """PyTorch twin of :func:`models.zoo.resnet_layers` with basic blocks (CIFAR stem: 3x3 conv,
    stride 1, no max-pool; shortcut = 1x1 conv + BN when the shape changes)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.projection = stride != 1 or cin != cout
            if self.projection:
                self.shortcut = nn.Sequential(OrderedDict([
                    ("conv", nn.Conv2d(cin, cout, 1, stride, bias=False)),
                    ("bn", nn.BatchNorm2d(cout))]))

        def forward(self, x):
            h = torch.relu(self.bn1(self.conv1(x)))
            h = self.bn2(self.conv2(h))
            return torch.relu(h + (self.shortcut(x) if self.projection else x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, planes[0], 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes[0])
            cin = planes[0]
            for s, (d, p) in enumerate(zip(depths, planes)):
                blocks = []
                for b in range(d):
                    blocks.append(Block(cin, p, 1 if (s == 0 or b > 0) else 2))
                    cin = p
                setattr(self, f"layer{s + 1}", nn.Sequential(*blocks))
            self.nstages = len(depths)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = torch.relu(self.bn1(self.conv1(x)))
            for s in range(self.nstages):
                x = getattr(self, f"layer{s + 1}")(x)
            return self.fc(x.mean(dim=(2, 3)))

    return Net()


# ---------------------------------------------------------------------------------------------
# one cell
# ---------------------------------------------------------------------------------------------
def build_pair(torch, name: str, batch: int, seed: int = 0):
    """Project model + optimizer, PyTorch twin + optimizer (same weights), one batch."""
    from models.optim import SGD, SGDConfig  # noqa: PLC0415
    from models.zoo import cnn, resnet  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    if name == "cnn":
        shape, k = (1, 8, 8), 10
        model = cnn(shape, k, seed=seed)
        tmodel = torch_cnn(torch, 1, 8, k)
    elif name == "resnet18":
        shape, k = (3, 32, 32), 10
        model = resnet(shape, k, depths=(2, 2, 2, 2), planes=(64, 128, 256, 512), seed=seed)
        tmodel = torch_resnet(torch, 3, k)
    else:
        raise ValueError(f"unknown model {name!r}; use cnn or resnet18")
    state = {n: torch.from_numpy(np.array(v)) for n, v in model.state_dict().items()}
    missing, unexpected = tmodel.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise RuntimeError(f"twin mismatch: missing {missing}, unexpected {unexpected}")
    tmodel.train()
    opt = SGD(model.params, model.grads, SGDConfig(lr=LR, momentum=MOMENTUM))
    topt = torch.optim.SGD(tmodel.parameters(), lr=LR, momentum=MOMENTUM)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, k, batch)
    return model, opt, tmodel, topt, x, y


def agreement(torch, model, opt, tmodel, topt, x, y) -> dict:
    """One step of each from the same weights: relative differences of the logits (max abs
    difference / max abs value) and of the parameter update (``||du|| / ||u||`` over the flat
    vector, ``u`` = the parameter change of the step)."""
    import torch.nn.functional as F  # noqa: PLC0415, N812

    before = model.params.flat.copy()
    loss, logits = model.loss_and_grad(x, y)
    opt.step()
    topt.zero_grad(set_to_none=False)
    tl = tmodel(torch.from_numpy(x))
    tloss = F.cross_entropy(tl, torch.from_numpy(y))
    tloss.backward()
    topt.step()
    tl = tl.detach().numpy()
    tparams = dict(tmodel.named_parameters())
    du = np.concatenate([(model.params[n] - tparams[n].detach().numpy()).ravel()
                         for n in model.params.names])
    upd = model.params.flat - before
    return {"logits": float(np.abs(logits - tl).max() / np.abs(tl).max()),
            "loss": abs(loss - float(tloss.detach())) / abs(float(tloss.detach())),
            "update": float(np.linalg.norm(du) / np.linalg.norm(upd))}


def time_pair(torch, model, opt, tmodel, topt, x, y, steps: int, windows: int,
              warmup: int = 1) -> dict:
    """Interleaved windows of ``steps`` steps; minimum CPU and wall seconds per step of each."""
    import torch.nn.functional as F  # noqa: PLC0415, N812

    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def proj():
        model.loss_and_grad(x, y)
        opt.step()

    def tor():
        topt.zero_grad(set_to_none=False)
        F.cross_entropy(tmodel(tx), ty).backward()
        topt.step()

    best = {"proj": [np.inf, np.inf], "torch": [np.inf, np.inf]}
    for fn in (proj, tor):
        for _ in range(warmup):
            fn()
    for _ in range(windows):
        for key, fn in (("proj", proj), ("torch", tor)):
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                fn()
            c1, w1 = time.process_time(), time.perf_counter()
            best[key][0] = min(best[key][0], (c1 - c0) / steps)
            best[key][1] = min(best[key][1], (w1 - w0) / steps)
    return best


def set_threads(torch, n: int):
    """Cap every thread pool at ``n``; returns the threadpoolctl limiter (keep it alive)."""
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    limiter = threadpool_limits(limits=n)
    torch.set_num_threads(n)
    if "numba" in sys.modules:
        import numba  # noqa: PLC0415

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return limiter


def run_cell(torch, name: str, batch: int, n: int, steps: int, windows: int, repeat: int):
    """``repeat`` timings of one cell; returns per-repeat rows and the agreement of step 1."""
    torch.manual_seed(0)
    pair = build_pair(torch, name, batch)       # fresh: agreement from the same start
    if name == "resnet18":
        from models.layers import _kernels  # noqa: PLC0415

        _kernels()          # Numba loaded as the first BatchNorm forward would, then capped
    limiter = set_threads(torch, n)
    try:
        agree = agreement(torch, *pair)
        rows = []
        for _ in range(repeat):
            t = time_pair(torch, *pair, steps=steps, windows=windows)
            rows.append((*t["proj"], *t["torch"], os.getloadavg()[0]))
    finally:
        limiter.restore_original_limits()
    return np.array(rows), agree


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet18"],
                        choices=("cnn", "resnet18"))
    parser.add_argument("--batches", "--batch-size", nargs="+", type=int, default=[32, 128],
                        dest="batches")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3,
                        help="repeats per cell; the table shows medians over repeats")
    parser.add_argument("--windows", type=int, default=2,
                        help="timed windows per framework and repeat (the minimum is kept)")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps per window (0: 20 for cnn, 1 for resnet18)")
    args = parser.parse_args(argv)
    for flag in ("repeat", "windows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.steps < 0:
        parser.error(f"--steps must be >= 0 (0: the per-model default), got {args.steps}")
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        print(INSTALL_HINT)
        return 0
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    blas = [f"{i.get('internal_api')} {i.get('version')}" for i in threadpool_info()
            if i.get("user_api") == "blas"]
    print(f"bench_torch_cpu: one training step (forward + cross-entropy + backward + SGD "
          f"momentum {MOMENTUM}), float32, NumPy {np.__version__} ({', '.join(blas)}), "
          f"PyTorch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()[0]:.2f}")
    print(f"threads: threadpoolctl.threadpool_limits(n) on every BLAS/OpenMP pool + "
          f"torch.set_num_threads(n) + numba.set_num_threads(n); per step: min over "
          f"{args.windows} windows, median over {args.repeat} repeats")
    print(f"{'model':<9} {'batch':>5} {'thr':>3} | {'proj cpu':>8} {'torch cpu':>9} "
          f"{'ratio':>5} | {'proj wall':>9} {'torch wall':>10} {'ratio':>5} | "
          f"{'ratios cpu / wall, each repeat':<32} | {'load':>9} | {'rel diff':>15}")
    for name in args.models:
        for batch in args.batches:
            for n in args.threads:
                load0 = os.getloadavg()[0]
                steps = args.steps or (20 if name == "cnn" else 1)
                rows, agree = run_cell(torch, name, batch, n, steps, args.windows, args.repeat)
                pc, pw, tc, tw = (np.median(rows[:, i]) for i in range(4))
                rc, rw = rows[:, 0] / rows[:, 2], rows[:, 1] / rows[:, 3]
                each = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(rc, rw))
                print(f"{name:<9} {batch:>5} {n:>3} | {pc:8.3f} {tc:9.3f} {np.median(rc):5.2f} | "
                      f"{pw:9.3f} {tw:10.3f} {np.median(rw):5.2f} | {each:<32} | "
                      f"{load0:4.1f}>{rows[-1, 4]:4.1f} | "
                      f"{agree['logits']:7.1e} {agree['update']:7.1e}", flush=True)
    print(f"times in s per step; ratio = project / PyTorch; rel diff = (logits, update) of "
          f"step 1; load average (1 min) before>after each cell; at end "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
