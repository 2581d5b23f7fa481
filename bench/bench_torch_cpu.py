"""One training step of the project's models against PyTorch CPU, side by side, one command.

Prints (not a test)::

    python bench/bench_torch_cpu.py [--cells gpt-w128-c64:32 ... resnet18:128]
                                    [--threads 1 2] [--repeat 5] [--windows 2]
                                    [--malloc keep|default] [--busy N]
                                    [--gemms MxKxN ...]

PyTorch is an optional *bench* comparator only (never imported by the package)::

    .venv/bin/pip install torch==2.13.0        # CPU build

Cells (``NAME:BATCH``; default: the set below)

* ``gpt-wD-cT``: the byte GPT (:func:`models.transformer.gpt`), width ``D``, context ``T``, 4
  layers, 4 heads, MLP 4x, untied head, causal-LM loss over every position, **AdamW**
  (lr 1e-3, weight decay 0.01 on weight matrices only, on both sides);
* ``vit``: the digits ViT (:func:`models.transformer.vit`: 2x2 patches, width 64, 4 layers),
  AdamW as above;
* ``resnet18``: ResNet-18 at CIFAR shape, **SGD** momentum 0.9; ``cnn``: the digits CNN.

The PyTorch twins are the same architectures (``torch.nn.functional``, pre-norm blocks,
tanh-GELU, ``scaled_dot_product_attention``; ``torch.nn`` modules for the CNNs) with the
project's initial weights copied in, float32.

Fairness
--------
* **One process per thread count** (``n`` in ``--threads``): the parent starts a child with
  ``NUMBA_NUM_THREADS=OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=n`` and
  ``OMP_WAIT_POLICY=PASSIVE`` in its environment (read when the libraries load: PyTorch's
  OpenMP workers sleep instead of spinning between parallel regions, which on shared cores
  starves everything else), then also ``torch.set_num_threads(n)`` and
  ``threadpoolctl.threadpool_limits(n)``.  Both sides run the same thread count.
* Memory: by default (``--malloc keep``) the child runs with glibc's ``MALLOC_MMAP_MAX_=0``
  and ``MALLOC_TRIM_THRESHOLD_=2^40``, so freed blocks stay in the process and the next step
  reuses them; otherwise every step faults its large temporaries in afresh (hundreds of MB,
  0.2-0.75 s of system time per step in the largest cells, for both frameworks).  Both sides
  share the process, so both get the same allocator.  ``--malloc default`` measures without.
* The BLAS libraries in the process are printed (threadpoolctl: library, version, kernel).
* Time per step is taken per window of consecutive steps (about 0.3 s or one step), as CPU time
  (``time.process_time``: every thread of the process) and wall time; the two frameworks'
  windows alternate (who goes first alternates too); the minimum over ``--windows`` windows is
  one *repeat*, and the table gives the **median over** ``--repeat`` repeats of each time and of
  each ratio (a repeat's ratio compares windows taken side by side).  ``ratio`` = project /
  PyTorch (lower is better for the project, 1.00 = parity).
* ``GF/s``: the step's model FLOPs (``6 x forward MACs x batch``: forward 2, backward 4 FLOPs
  per multiply-accumulate; attention counted over the full ``T x T`` score matrix, causal or
  not) per CPU second (``cpu``: the rate per busy core, what load from other processes
  disturbs least) and per wall second, beside the **GEMM peak** measured in the same process
  and thread count the same two ways (``float32 2048^3`` matmul, best of 8, NumPy's BLAS and
  PyTorch's).
* Before timing, one step of each from the same weights is compared (relative differences of
  the loss, and of the logits + SGD update (CNNs) or the gradient (transformers)): both sides
  compute the same thing to float32 round-off.
* The load average (1 min) is printed before > after each cell.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INSTALL_HINT = ("bench_torch_cpu: PyTorch is not installed; it is an optional bench comparator. "
                "Install the CPU build with\n    .venv/bin/pip install torch==2.13.0\n"
                "and run again.")

LR, MOMENTUM = 0.05, 0.9
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
DEFAULT_CELLS = ["gpt-w128-c64:32", "gpt-w128-c256:32", "gpt-w256-c64:32", "gpt-w256-c256:32",
                 "vit:32", "resnet18:32", "resnet18:128"]
THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


#: glibc malloc tunables of ``--malloc keep`` (both frameworks, one process): every block from
#: the heap (no mmap) and freed memory kept, so a step's large temporaries reuse last step's
#: pages instead of faulting fresh zeroed ones in (0.2-0.75 s of system time per step for the
#: largest cells, either framework)
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def thread_env(n: int, malloc: str = "keep") -> dict:
    """The child's environment for ``n`` threads (read when NumPy, Numba and PyTorch load),
    with the glibc malloc tunables of :data:`MALLOC_KEEP` unless ``malloc="default"``."""
    env = dict(os.environ)
    env.update({v: str(n) for v in THREAD_VARS})
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    # OpenBLAS workers sleep after a GEMM instead of spinning ~0.1 s (as runner.launch sets
    # for MPI ranks)
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if malloc == "keep":
        env.update(MALLOC_KEEP)
    return env


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


def torch_transformer_loss(torch, model, P: dict, xt, yt):
    """The loss of the project's ViT / GPT written with ``torch.nn.functional`` on the
    parameter dict ``P`` (the project's names): a closure ``() -> loss``."""
    F = torch.nn.functional
    depth = sum(1 for n in P if n.endswith("ln1.weight"))
    d = P["blocks.0.ln1.weight"].shape[0]
    layers = dict(model.root.walk())
    heads = layers["blocks.0."].heads

    def blocks(h, causal):
        N, T, _ = h.shape
        for b in range(depth):
            def p(name, b=b):
                return P[f"blocks.{b}.{name}"]
            a = F.layer_norm(h, (d,), p("ln1.weight"), p("ln1.bias"), 1e-5)
            q, k, v = F.linear(a, p("attn.qkv.weight"), p("attn.qkv.bias")).split(d, dim=-1)
            q, k, v = (t.reshape(N, T, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            h = h + F.linear(o.transpose(1, 2).reshape(N, T, d), p("attn.proj.weight"),
                             p("attn.proj.bias"))
            a = F.layer_norm(h, (d,), p("ln2.weight"), p("ln2.bias"), 1e-5)
            a = F.gelu(F.linear(a, p("mlp.fc1.weight"), p("mlp.fc1.bias")), approximate="tanh")
            h = h + F.linear(a, p("mlp.fc2.weight"), p("mlp.fc2.bias"))
        return h

    def loss_fn():
        if model.lm:
            N, T = xt.shape
            h = P["wte.weight"][xt] + P["wpe.weight"][:T]
            h = F.layer_norm(blocks(h, True), (d,), P["ln_f.weight"], P["ln_f.bias"], 1e-5)
            logits = F.linear(h, P["head.weight"])
            targets = torch.cat([xt[:, 1:], yt[:, None]], dim=1)
            return F.cross_entropy(logits.reshape(N * T, -1), targets.reshape(-1))
        N = xt.shape[0]
        C, H, W = model.input_shape
        p_ = layers["patch_embed."].patch
        cols = xt.reshape(N, C, H // p_, p_, W // p_, p_).permute(0, 2, 4, 1, 3, 5)
        h = F.linear(cols.reshape(N, -1, C * p_ * p_), P["patch_embed.proj.weight"],
                     P["patch_embed.proj.bias"])
        h = torch.cat([P["cls_token.weight"].expand(N, 1, d), h], dim=1) + P["pos_embed.weight"]
        h = F.layer_norm(blocks(h, False), (d,), P["norm.weight"], P["norm.bias"], 1e-5)
        return F.cross_entropy(F.linear(h[:, 0], P["head.weight"], P["head.bias"]), yt)

    return loss_fn


# ---------------------------------------------------------------------------------------------
# one cell
# ---------------------------------------------------------------------------------------------
def parse_cell(cell: str) -> tuple[str, int]:
    name, _, batch = cell.partition(":")
    if name.startswith("gpt-"):
        try:
            w, c = name[4:].split("-")
            if not (w[0] == "w" and c[0] == "c" and int(w[1:]) > 0 and int(c[1:]) > 0):
                raise ValueError
        except ValueError:
            raise ValueError(f"cell {cell!r}: a GPT cell is gpt-wWIDTH-cCONTEXT, e.g. "
                             "gpt-w128-c64:32") from None
    elif name not in ("vit", "resnet18", "cnn"):
        raise ValueError(f"cell {cell!r}: model must be gpt-wD-cT, vit, resnet18 or cnn")
    if not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"cell {cell!r}: give the batch size as NAME:BATCH, e.g. {name}:32")
    return name, int(batch)


class Pair:
    """The project's step and PyTorch's step on the same model, weights and batch."""

    def __init__(self, torch, name: str, batch: int, seed: int = 0):
        import numpy as np

        self.torch, self.name, self.batch = torch, name, batch
        rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        if name.startswith("gpt-") or name == "vit":
            self._transformer(np, rng, name, batch, seed)
        else:
            self._cnn(np, rng, name, batch, seed)
        self.flops = 6.0 * self.model.macs_per_sample() * batch

    # -- builders ---------------------------------------------------------------------------
    def _transformer(self, np, rng, name, batch, seed):
        from models.optim import AdamW, AdamWConfig
        from models.transformer import gpt, vit

        torch = self.torch
        if name == "vit":
            model = vit((1, 8, 8), 10, seed=seed)
            x = rng.standard_normal((batch, 1, 8, 8)).astype(np.float32)
            y = rng.integers(0, 10, batch)
        else:
            w, c = (int(s[1:]) for s in name[4:].split("-"))
            model = gpt((c,), 256, dim=w, depth=4, heads=4, seed=seed)
            x = rng.integers(0, 256, (batch, c))
            y = rng.integers(0, 256, batch)
        kinds = ("conv", "fc")
        opt = AdamW(model.params, model.grads, AdamWConfig(**ADAMW, decay_kinds=kinds))
        P = {n: torch.nn.Parameter(torch.tensor(model.params[n].copy()))
             for n in model.layout.names}
        decay = [p for n, p in P.items() if model.layout.kind(n) in kinds]
        rest = [p for n, p in P.items() if model.layout.kind(n) not in kinds]
        topt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                 **ADAMW)
        n_torch = sum(p.numel() for p in P.values())
        if n_torch != model.num_params:
            raise RuntimeError(f"twin has {n_torch} parameters, project {model.num_params}")
        loss_fn = torch_transformer_loss(torch, model, P, torch.tensor(x), torch.tensor(y))
        self.model, self.opt, self.topt, self.x, self.y = model, opt, topt, x, y
        self.P, self.loss_fn = P, loss_fn

    def _cnn(self, np, rng, name, batch, seed):
        from models.optim import SGD, SGDConfig
        from models.zoo import cnn, resnet

        torch = self.torch
        if name == "cnn":
            shape, k = (1, 8, 8), 10
            model = cnn(shape, k, seed=seed)
            tmodel = torch_cnn(torch, 1, 8, k)
        else:
            shape, k = (3, 32, 32), 10
            model = resnet(shape, k, depths=(2, 2, 2, 2), planes=(64, 128, 256, 512), seed=seed)
            tmodel = torch_resnet(torch, 3, k)
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
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        F = torch.nn.functional
        self.model, self.opt, self.topt, self.x, self.y = model, opt, topt, x, y
        self.tmodel = tmodel
        self.loss_fn = lambda: F.cross_entropy(tmodel(tx), ty)

    # -- steps ------------------------------------------------------------------------------
    def proj_step(self):
        self.model.loss_and_grad(self.x, self.y)
        self.opt.step()

    def torch_step(self):
        self.topt.zero_grad(set_to_none=False)
        self.loss_fn().backward()
        self.topt.step()

    def agreement(self) -> tuple[str, float, float]:
        """One step of each from the same weights: (what, loss rel diff, second rel diff)."""
        import numpy as np

        model = self.model
        before = model.params.flat.copy()
        loss, _logits = model.loss_and_grad(self.x, self.y)
        self.topt.zero_grad(set_to_none=False)
        tloss = self.loss_fn()
        tloss.backward()
        tl = float(tloss.detach())
        dloss = abs(loss - tl) / abs(tl)
        if hasattr(self, "P"):                      # transformers: the gradients
            g = np.concatenate([self.P[n].grad.numpy().ravel() for n in model.layout.names])
            ours = model.grads.flat
            second = float(np.linalg.norm(ours - g) / np.linalg.norm(g))
            self.opt.step()
            self.topt.step()
            return "loss grad", dloss, second
        self.opt.step()                             # CNNs: the SGD update
        self.topt.step()
        tparams = dict(self.tmodel.named_parameters())
        du = np.concatenate([(model.params[n] - tparams[n].detach().numpy()).ravel()
                             for n in model.params.names])
        upd = model.params.flat - before
        return "loss update", dloss, float(np.linalg.norm(du) / np.linalg.norm(upd))


def time_repeat(pair: Pair, steps: int, windows: int, flip: bool) -> list[float]:
    """Interleaved windows of ``steps`` steps; [proj cpu, proj wall, torch cpu, torch wall] per
    step, each the minimum over the windows."""
    best = {"proj": [math.inf, math.inf], "torch": [math.inf, math.inf]}
    order = [("proj", pair.proj_step), ("torch", pair.torch_step)]
    for w in range(windows):
        for key, fn in (order[::-1] if (w + flip) % 2 else order):
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                fn()
            c1, w1 = time.process_time(), time.perf_counter()
            best[key][0] = min(best[key][0], (c1 - c0) / steps)
            best[key][1] = min(best[key][1], (w1 - w0) / steps)
    return [*best["proj"], *best["torch"]]


def gemm_peak(torch, shape=(2048, 2048, 2048), repeat: int = 8) -> list:
    """Best float32 ``(m, k) @ (k, n)`` matmul rates of NumPy's BLAS and of PyTorch:
    ``[[numpy per wall s, numpy per CPU s], [torch ..., ...]]`` (GFLOP/s)."""
    import numpy as np

    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.empty((m, n), np.float32)
    ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c.copy())
    out = []
    for fn in (lambda: np.matmul(a, b, out=c), lambda: torch.matmul(ta, tb, out=tc)):
        fn()
        wall = cpu = math.inf
        for _ in range(repeat):
            w, t = time.perf_counter(), time.process_time()
            fn()
            wall = min(wall, time.perf_counter() - w)
            cpu = min(cpu, time.process_time() - t)
        out.append([2.0 * m * k * n / wall / 1e9, 2.0 * m * k * n / max(cpu, 1e-9) / 1e9])
    return out


def parse_gemm(text: str) -> tuple[int, int, int]:
    """``MxKxN`` -> ``(M, K, N)``, each >= 1."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"--gemms takes MxKxN shapes of positive integers, got {text!r}")
    return dims


# ---------------------------------------------------------------------------------------------
# child: one thread count
# ---------------------------------------------------------------------------------------------
def child(args) -> int:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    n = args.threads[0]
    torch.set_num_threads(n)
    from models.layers import _kernels

    _kernels()              # Numba loaded as the first BatchNorm forward would
    limiter = threadpool_limits(limits=n)
    import numba

    pools = sorted({f"{i.get('internal_api')} {i.get('version')} "
                    f"({i.get('architecture') or i.get('threading_layer') or '-'}, "
                    f"{i.get('num_threads')} thr)"
                    for i in threadpool_info()})
    peak_np, peak_torch = gemm_peak(torch)   # [wall, cpu] GF/s each
    print(json.dumps({"threads": n, "pools": pools, "numba_threads": numba.get_num_threads(),
                      "torch_threads": torch.get_num_threads(),
                      "gemm_numpy": peak_np, "gemm_torch": peak_torch}), flush=True)
    for shape in args.gemms:
        print(json.dumps({"gemm": shape, "rates": gemm_peak(torch, parse_gemm(shape))}),
              flush=True)
    for cell in args.cells:
        name, batch = parse_cell(cell)
        load0 = os.getloadavg()[0]
        pair = Pair(torch, name, batch)
        what, dloss, second = pair.agreement()
        t0 = time.perf_counter()            # one step of each sizes the windows
        pair.proj_step()
        t1 = time.perf_counter()
        pair.torch_step()
        t2 = time.perf_counter()
        steps = max(1, math.ceil(args.window_s / max(min(t1 - t0, t2 - t1), 1e-6)))
        rows = np.array([time_repeat(pair, steps, args.windows, flip=bool(r % 2))
                         for r in range(args.repeat)])
        print(json.dumps({"cell": f"{name}:{batch}", "threads": n, "rows": rows.tolist(),
                          "steps": steps, "flops": pair.flops, "load": [load0,
                          os.getloadavg()[0]], "agree": [what, dloss, second]}), flush=True)
        del pair
    limiter.restore_original_limits()
    return 0


# ---------------------------------------------------------------------------------------------
# parent: one child per thread count, one table
# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=DEFAULT_CELLS,
                        help="NAME:BATCH, NAME one of gpt-wD-cT, vit, resnet18, cnn")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5,
                        help="repeats per cell; the table shows medians over repeats")
    parser.add_argument("--windows", type=int, default=2,
                        help="timed windows per framework and repeat (the minimum is kept)")
    parser.add_argument("--window-s", type=float, default=0.3,
                        help="seconds a window aims at (at least one step)")
    parser.add_argument("--malloc", choices=("keep", "default"), default="keep",
                        help="keep: glibc malloc keeps freed memory (MALLOC_MMAP_MAX_=0, "
                             "MALLOC_TRIM_THRESHOLD_=2^40) for both frameworks; default: as "
                             "the environment has it")
    parser.add_argument("--busy", type=int, default=0,
                        help="run the table beside this many busy processes ('while True: "
                             "pass', substrate.testing.busy_loops): the shared-core load")
    parser.add_argument("--gemms", nargs="*", default=[], metavar="MxKxN",
                        help="also time these float32 GEMM shapes, NumPy's BLAS against "
                             "PyTorch's, at each thread count (e.g. a cell's largest GEMMs)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag in ("repeat", "windows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if any(t < 1 for t in args.threads):
        parser.error(f"--threads must be >= 1, got {args.threads}")
    try:
        for cell in args.cells:
            parse_cell(cell)
    except ValueError as exc:
        parser.error(str(exc))
    if args.busy < 0:
        parser.error(f"--busy must be >= 0, got {args.busy}")
    try:
        for shape in args.gemms:
            parse_gemm(shape)
    except ValueError as exc:
        parser.error(str(exc))
    if args.child:
        return child(args)
    if args.busy:
        sys.path.insert(0, str(ROOT))
        from substrate.testing import busy_loops

        with busy_loops(args.busy):
            return table(args)
    return table(args)


def table(args) -> int:
    """Run one child per thread count and print the side-by-side table."""
    try:
        import torch
    except ImportError:
        print(INSTALL_HINT)
        return 0
    import numpy as np

    print(f"bench_torch_cpu: one training step (forward + loss + backward + optimizer), "
          f"float32; NumPy {np.__version__}, PyTorch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    tunables = " ".join(f"{k}={v}" for k, v in MALLOC_KEEP.items())
    malloc = f"keep ({tunables})" if args.malloc == "keep" else "default"
    if args.busy:
        print(f"beside {args.busy} busy process(es) ('while True: pass') for the whole run")
    print(f"one process per thread count (NUMBA/OMP/OPENBLAS/MKL_NUM_THREADS=n, "
          f"OMP_WAIT_POLICY=PASSIVE, torch.set_num_threads(n), threadpool_limits(n)); malloc "
          f"{malloc}; per step: min over {args.windows} windows, median over {args.repeat} "
          f"repeats")
    head = (f"{'cell':<17} {'thr':>3} | {'proj cpu':>8} {'torch cpu':>9} {'ratio':>5} | "
            f"{'proj wall':>9} {'torch wall':>10} {'ratio':>5} | {'GF/s cpu p/t':>12} | "
            f"{'GF/s wall p/t':>13} | {'ratios cpu, each repeat':<29} | {'load':>9} | "
            f"{'rel diff':>15}")
    for n in args.threads:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--threads", str(n),
               "--repeat", str(args.repeat), "--windows", str(args.windows),
               "--window-s", str(args.window_s), "--cells", *args.cells,
               "--gemms", *args.gemms]
        proc = subprocess.Popen(cmd, env=thread_env(n, args.malloc), stdout=subprocess.PIPE,
                                text=True, cwd=str(ROOT))
        for line in proc.stdout:
            rec = json.loads(line)
            if "pools" in rec:
                print(f"\n[{n} thread(s)] pools: {'; '.join(rec['pools'])}; numba "
                      f"{rec['numba_threads']}, torch {rec['torch_threads']} thread(s)")
                print(f"[{n} thread(s)] GEMM peak (float32 2048^3): NumPy "
                      f"{rec['gemm_numpy'][0]:.1f} GF/s ({rec['gemm_numpy'][1]:.1f} per CPU s), "
                      f"PyTorch {rec['gemm_torch'][0]:.1f} GF/s ({rec['gemm_torch'][1]:.1f} per "
                      f"CPU s)")
                if not args.gemms:
                    print(head, flush=True)
                continue
            if "gemm" in rec:
                (nw, nc), (tw_, tc_) = rec["rates"]
                print(f"[{n} thread(s)] GEMM {rec['gemm']}: NumPy {nc:.1f}, PyTorch {tc_:.1f} "
                      f"GF/s per CPU s (NumPy / PyTorch time {tc_ / nc:.2f}; wall {nw:.1f} / "
                      f"{tw_:.1f})", flush=True)
                if rec["gemm"] == args.gemms[-1]:
                    print(head, flush=True)
                continue
            rows = np.array(rec["rows"])
            pc, pw, tc, tw = (float(np.median(rows[:, i])) for i in range(4))
            rc = rows[:, 0] / rows[:, 2]
            rw = rows[:, 1] / rows[:, 3]
            each = " ".join(f"{r:.2f}" for r in rc)
            _, dl, d2 = rec["agree"]
            f = rec["flops"] / 1e9
            print(f"{rec['cell']:<17} {n:>3} | {pc:8.4f} {tc:9.4f} {np.median(rc):5.2f} | "
                  f"{pw:9.4f} {tw:10.4f} {np.median(rw):5.2f} | {f / pc:5.1f} {f / tc:6.1f} | "
                  f"{f / pw:6.1f} {f / tw:6.1f} | "
                  f"{each:<29} | {rec['load'][0]:4.1f}>{rec['load'][1]:4.1f} | "
                  f"{dl:7.1e} {d2:7.1e}", flush=True)
        if proc.wait():
            print(f"bench_torch_cpu: the {n}-thread child failed (exit {proc.returncode})")
            return proc.returncode
    print("\ntimes in s per step; ratio = project / PyTorch (median over repeats of the "
          "per-repeat ratio); GF/s = 6 x forward MACs x batch / median CPU or wall time, project "
          "/ PyTorch; rel diff = "
          "loss and (gradient for transformers, SGD update for CNNs) of one step from the same "
          f"weights; load average (1 min) before>after each cell; at end "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
