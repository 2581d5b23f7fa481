"""Conv2d forward+backward speed vs the equivalent GEMMs and vs scipy.signal.correlate.

Prints (not a test)::

    python bench/bench_layers.py [--device cpu|gpu] [--batch 64] [--repeat 20]

For each conv shape, the forward + backward of :class:`models.layers.Conv2d` does three GEMMs
of ``2·C_out·(C_in·kH·kW)·(N·H_out·W_out)`` FLOPs each (forward, weight gradient, input
gradient) plus the im2col / col2im data movement.  ``fraction`` is the conv layer's GFLOP/s
divided by the GFLOP/s of the same three GEMMs run alone by the same array library (target
>= 0.5).  ``vs scipy`` is how many times faster the im2col forward is than a direct forward built
from ``scipy.signal.correlate`` (one call per sample and output channel; timed on a slice of the
batch and scaled to the full batch).  Last, training steps per second of the digits CNN.
Times are minima over interleaved repetitions, so other load on the machine perturbs them less.
The GEMMs use every BLAS thread while im2col/col2im are single-threaded NumPy, so on several
cores ``fraction`` is lower for small layers (where the data movement dominates) than with
``OPENBLAS_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.layers import Conv2d
from models.network import Model

# (label, C_in, C_out, H=W, kernel, stride, padding)
SHAPES = [
    ("digits cnn conv1", 1, 16, 8, 3, 1, 1),
    ("digits cnn conv2", 16, 32, 8, 3, 1, 1),
    ("resnet 28x28 s2 ", 16, 32, 28, 3, 2, 1),
    ("resnet 32x32    ", 16, 16, 32, 3, 1, 1),
    ("resnet18 layer1 ", 64, 64, 32, 3, 1, 1),
]


def _sync(xp):
    if xp.__name__ == "cupy":
        xp.cuda.get_current_stream().synchronize()


def best_times(fns, xp, repeat: int, warmup_s: float = 0.5) -> list[float]:
    """Minimum wall time of each function over ``repeat`` rounds, calling them in turn.

    Interleaving the candidates exposes them to the same machine conditions (other processes,
    frequency changes); the minimum is the least disturbed run.  A warm-up of ``warmup_s``
    seconds first lets the allocator settle.
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        for fn in fns:
            fn()
        _sync(xp)
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            _sync(xp)
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def bench_conv(xp, label, c_in, c_out, hw, k, s, p, batch, repeat):
    layer = Conv2d(c_in, c_out, k, stride=s, padding=p, bias=False)
    model = Model(layer, (c_in, hw, hw), None, xp=xp, dtype=np.float32, seed=0)
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((batch, c_in, hw, hw), dtype=np.float32))
    _, ho, wo = layer.output_shape((c_in, hw, hw))
    dy = xp.asarray(rng.standard_normal((batch, c_out, ho, wo), dtype=np.float32))

    def conv_fwd_bwd():
        model.forward(x)
        model.backward(dy)

    M, K, Nn = c_out, c_in * k * k, batch * ho * wo
    flops = 3 * 2 * M * K * Nn
    a = xp.asarray(rng.standard_normal((M, K), dtype=np.float32))
    b = xp.asarray(rng.standard_normal((K, Nn), dtype=np.float32))
    c = xp.asarray(rng.standard_normal((M, Nn), dtype=np.float32))

    def gemms():
        a @ b            # forward       (M x K) (K x Nn)
        c @ b.T          # weight grad   (M x Nn) (Nn x K)
        a.T @ c          # input grad    (K x M) (M x Nn)

    t_conv, t_gemm, t_fwd = best_times([conv_fwd_bwd, gemms, lambda: model.forward(x)], xp,
                                       repeat)
    scipy_ratio = None
    if xp is np:
        from scipy import signal

        w = layer.P["weight"]
        n_ref = min(batch, 4)
        xpad = np.pad(x[:n_ref], ((0, 0), (0, 0), (p, p), (p, p)))

        def direct():
            for n in range(n_ref):
                for o in range(c_out):
                    signal.correlate(xpad[n], w[o], mode="valid")[0, ::s, ::s]

        t_ref = best_times([direct], np, max(1, repeat // 10), warmup_s=0.0)[0] * batch / n_ref
        scipy_ratio = t_ref / t_fwd
    return {
        "label": label, "shape": f"{c_in:>3}->{c_out:<3} {hw:>2}x{hw:<2} k{k} s{s}",
        "gflops_conv": flops / t_conv / 1e9, "gflops_gemm": flops / t_gemm / 1e9,
        "fraction": t_gemm / t_conv, "ms": t_conv * 1e3, "scipy": scipy_ratio,
    }


def bench_digits_cnn(xp, batch, window=20, windows=10):
    """Training steps per second of the digits CNN: best of ``windows`` runs of ``window``
    consecutive steps (forward + backward + SGD), robust to other processes on the machine."""
    from models.data import load_digits
    from models.optim import SGD, SGDConfig
    from models.zoo import cnn

    train = load_digits().train.to(xp)
    model = cnn(train.input_shape, 10, xp=xp, seed=0)
    opt = SGD(model.params, model.grads, SGDConfig(lr=0.05, momentum=0.9))
    xb, yb = train.x[:batch], train.y[:batch]

    def steps():
        for _ in range(window):
            model.loss_and_grad(xb, yb)
            opt.step()

    return window / best_times([steps], xp, repeat=windows)[0]


def _blas_threads() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if info:
            return f"{info[0]['num_threads']} ({info[0].get('internal_api', 'blas')})"
    except ImportError:
        pass
    return os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20,
                        help="timed calls per measurement; the minimum is reported")
    args = parser.parse_args(argv)
    if args.device == "gpu":
        from substrate.backend import cupy_available

        if not cupy_available():
            print("bench_layers --device gpu: skipped (CuPy not installed or no CUDA device "
                  "visible)")
            return 0
        import cupy as xp
        lib = f"CuPy {xp.__version__} on {xp.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    else:
        xp = np
        lib = f"NumPy {np.__version__}"
    threads = _blas_threads()
    print(f"bench_layers: Conv2d forward+backward (im2col + GEMM), float32, batch {args.batch}, "
          f"{lib}, {os.cpu_count()} CPUs, BLAS threads {threads}")
    print(f"{'layer':<17} {'shape':<24} {'ms':>8} {'conv GF/s':>10} {'GEMM GF/s':>10} "
          f"{'fraction':>9} {'vs scipy':>9}")
    for label, *shape in SHAPES:
        r = bench_conv(xp, label, *shape, args.batch, args.repeat)
        sc = f"{r['scipy']:8.1f}x" if r["scipy"] is not None else f"{'n/a':>9}"
        print(f"{r['label']:<17} {r['shape']:<24} {r['ms']:8.2f} {r['gflops_conv']:10.1f} "
              f"{r['gflops_gemm']:10.1f} {r['fraction']:9.2f} {sc}")
    for bs in (32, args.batch):
        print(f"digits CNN training: {bench_digits_cnn(xp, bs):8.1f} steps/s (batch {bs}, "
              "forward + backward + SGD step; best of 10 x 20 steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
