"""One transformer training step: spardist (NumPy, hand-written backward) vs PyTorch CPU.

The comparison (GPT widths 128/256 x contexts 64/256, the digits ViT and ResNet-18,
one process per thread count, CPU and wall ratios, GF/s beside the GEMM peak) is
``bench/bench_torch_cpu.py``; this script keeps the small models and the
``dp-adamw`` runner.

Prints (not a test)::

    python bench/bench_transformer.py [--batch-size 32] [--repeat 10] [--threads 1]
    mpiexec -n 4 python bench/bench_transformer.py dp-adamw [--cosine-steps N] --method ddp \
        --model vit ...

The second form runs ``python -m dataparallel train`` with **AdamW** (constant ``--lr``,
decoupled ``--weight-decay`` on conv/fc weights, ``--momentum`` as beta1) in place of the
trainer's SGD: a stand-in until the trainer has an ``--optimizer`` flag (transformers barely
train under plain SGD from the GPT-2 initialization).  Everything else (strategy, ledger,
predicted traffic, summary.json) is the trainer's own.

For the digits ViT (``--model vit``: 2x2 patches, dim 64, depth 4, [class] token) and the byte
GPT (``--model gpt``: context 64, dim 64, depth 2, untied head), one step is forward + loss +
backward + AdamW update on a batch.  The PyTorch comparator is the same architecture written
with ``torch.nn.functional`` (pre-norm blocks, tanh-GELU, ``scaled_dot_product_attention``), the
same parameter count (checked), float32, the same thread count.  ``ratio`` is spardist's time
over PyTorch's (lower is better for spardist).  Without PyTorch installed the script prints
spardist's times only and exits 0.  Times are minima over interleaved repetitions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_torch_cpu import torch_transformer_loss
from models.optim import AdamW, AdamWConfig
from models.transformer import gpt, vit


def best_times(fns, repeat: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def spardist_step(model, x, y):
    opt = AdamW(model.params, model.grads, AdamWConfig(lr=1e-3, weight_decay=0.01,
                                                       decay_kinds=("conv", "fc")))

    def step():
        model.loss_and_grad(x, y)
        opt.step()
    return step


def torch_step(torch, model, x, y):
    """The same architecture in PyTorch, parameters copied from the spardist model (the loss
    is :func:`bench.bench_torch_cpu.torch_transformer_loss`, the one PyTorch transcription)."""
    P = {n: torch.nn.Parameter(torch.tensor(model.params[n].copy())) for n in model.layout.names}
    opt = torch.optim.AdamW(list(P.values()), lr=1e-3, weight_decay=0.01)
    lm = model.lm
    loss_fn = torch_transformer_loss(torch, model, P, torch.tensor(x), torch.tensor(y))

    def step():
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    ours = float(model.lm_loss(x, y)[0] if lm else model.loss_and_grad(x, y)[0])
    with torch.no_grad():
        theirs = float(loss_fn())
    return step, ours, theirs, sum(p.numel() for p in P.values())


def dp_adamw(argv) -> int:
    """``python -m dataparallel train ARGV`` with AdamW instead of SGD (see the docstring).

    ``--cosine-steps N`` (consumed here): cosine schedule over N steps with 5 % linear warm-up
    instead of the constant ``--lr``."""
    import dataparallel.train as dpt
    from models.optim import AdamW, AdamWConfig, make_schedule

    argv = list(argv)
    cosine = None
    if "--cosine-steps" in argv:
        i = argv.index("--cosine-steps")
        cosine = int(argv[i + 1])
        del argv[i:i + 2]

    def adamw(params, grads, cfg):
        schedule = (None if cosine is None else
                    make_schedule("cosine", cfg.lr, cosine, warmup_steps=cosine // 20))
        return AdamW(params, grads, AdamWConfig(lr=cfg.lr, beta1=cfg.momentum or 0.9,
                                                weight_decay=cfg.weight_decay,
                                                decay_kinds=cfg.decay_kinds),
                     schedule=schedule)
    plain_evaluate = dpt.evaluate

    def evaluate(model, data, *a, **kw):
        # language models: also print the held-out next-byte loss over every position
        out = plain_evaluate(model, data, *a, **kw)
        if getattr(model, "lm", False):
            from models.text import unigram_entropy
            lm, h = model.evaluate_lm(data), unigram_entropy()
            print(f"held-out LM loss {lm['loss']:.4f} nats/byte (unigram entropy {h:.4f}: "
                  f"{100 * (1 - lm['loss'] / h):.1f} % below), perplexity "
                  f"{lm['perplexity']:.3f}", file=sys.stderr, flush=True)
        return out

    dpt.SGD = adamw
    dpt.evaluate = evaluate
    return dpt.main(["train", *argv])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["dp-adamw"]:
        return dp_adamw(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="BLAS / torch threads")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    B = args.batch_size
    cases = [
        ("vit (digits, 16 patches + cls)", vit((1, 8, 8), 10),
         rng.standard_normal((B, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, B)),
        ("gpt (bytes, context 64)", gpt((64,), 256),
         rng.integers(0, 256, (B, 64)), rng.integers(0, 256, B)),
    ]
    print(f"# bench_transformer: batch {B}, {args.threads} thread(s), min of {args.repeat} "
          f"interleaved steps (forward + backward + AdamW)")
    print("| model | params | spardist ms/step | PyTorch ms/step | ratio | loss spardist | "
          "loss torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with threadpool_limits(limits=args.threads, user_api="blas"):
        for label, model, x, y in cases:
            ours = spardist_step(model, x, y)
            if torch is None:
                (t_ours,) = best_times([ours], args.repeat)
                print(f"| {label} | {model.num_params:,} | {1e3 * t_ours:.2f} | (no torch) | "
                      f"| | |")
                continue
            theirs, l_ours, l_theirs, n = torch_step(torch, model, x, y)
            if n != model.num_params:
                raise SystemExit(f"PyTorch model has {n} parameters, spardist "
                                 f"{model.num_params}")
            t_ours, t_theirs = best_times([ours, theirs], args.repeat)
            print(f"| {label} | {model.num_params:,} | {1e3 * t_ours:.2f} | "
                  f"{1e3 * t_theirs:.2f} | {t_ours / t_theirs:.2f} | {l_ours:.5f} | "
                  f"{l_theirs:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
