"""Simulated step time of every system's recorded steps (the job simulation).

``python bench/bench_clock_systems.py --part ssfusion`` trains SSFusion with ``--fusion
selective``, ``per-tensor`` and ``multi-tensor`` (and dense DDP for reference) for a few steps
on 2 nodes x 2 ranks and prints, per mode and inter-node link speed, the mean simulated step
(``step_sim_s`` of ``metrics.jsonl``: every rank's recorded steps run together on the network)
of the sparse steps beside the alpha-beta sum of the step's calls (the bound: each call alone on
its links, nothing overlapped).  ``--compute-source flops`` (default) times compute from the
model's FLOP counts at ``--device-tflops``; ``--compute-source cpu`` from this host's thread
CPU time.  The images are random CIFAR-10-shaped batches written to a temporary directory (step
times depend on shapes only).

``--part admm`` and ``--part hsgd`` print the same readings for H-SADMM / flat ADMM and H-SGD
(``sparse_sgd train``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESNET18 = ("--model", "resnet", "--arch", "depths=2,2,2,2", "--arch", "planes=64,128,256,512")


def write_cifar_shaped(root: Path, n_train: int, n_test: int, seed: int = 0) -> None:
    """Random CIFAR-10 python batches (uint8 pixels, labels 0..9) under ``root``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    per = max(1, n_train // 5)
    for name, n in [(f"data_batch_{i}", per) for i in range(1, 6)] + [("test_batch", n_test)]:
        obj = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
               b"labels": rng.integers(0, 10, n).tolist()}
        (root / name).write_bytes(pickle.dumps(obj))


#: ``dataparallel train`` with a FLOP count for its ``optimizer`` block (momentum SGD with
#: weight decay: about 6 FLOPs per parameter), which the trainer times by the fallback CPU
#: clock otherwise (its block has no count): a bench-side stand-in for that one-line change
OPTIMIZER_FLOPS = """
import sys
import models.optim as mo
from simulation.clock import SimClock
size = {}
make = mo.make_optimizer
def make_optimizer(name, params, *a, **kw):
    size["n"] = int(params.flat.size)
    return make(name, params, *a, **kw)
mo.make_optimizer = make_optimizer
compute = SimClock.compute
def counted(self, label="compute", *, flops=None, **kw):
    if label == "optimizer" and flops is None:
        flops = 6.0 * size.get("n", 0)
    return compute(self, label, flops=flops, **kw)
SimClock.compute = counted
from dataparallel.train import main
sys.exit(main(sys.argv[1:]))
"""


def launch(n: int, module: str, args, out: Path) -> list[dict]:
    """``mpiexec -n n python -m module args --out out``; returns the metrics.jsonl records."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    entry = (["-c", OPTIMIZER_FLOPS] if module == "dataparallel" and "flops" in map(str, args)
             else ["-m", module])
    cmd = [mpiexec, "-n", str(n), sys.executable, *entry, *map(str, args), "--out",
           str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def clock_args(a) -> list:
    out = ["--compute-source", a.compute_source]
    if a.compute_source == "flops":
        out += ["--device-tflops", a.device_tflops]
    return out


def ssfusion(a, tmp: Path) -> None:
    model = RESNET18 if a.model == "resnet18" else ("--model", "resnet")
    data = tmp / "cifar"
    write_cifar_shaped(data, n_train=4 * a.batch_size * (a.profile_steps + a.sparse_steps),
                       n_test=16)
    steps = a.profile_steps + a.sparse_steps
    common = ["train", "--dataset", "cifar10", "--data-dir", data, *model,
              "--batch-size", a.batch_size, "--steps", steps, "--eval-every", 1,
              "--ranks-per-node", 2, "--inter-lat", 5, *clock_args(a)]
    modes = [("ddp", ["--method", "ddp", "--bucket-mib", 25])]
    for fusion in ("selective", "per-tensor", "multi-tensor"):
        modes.append((f"ssfusion {fusion}",
                      ["--method", "ssfusion", "--fusion", fusion, "--profile-steps",
                       a.profile_steps, "--density", a.density, *a.ssfusion_args]))
    print(f"# {'ResNet-18' if a.model == 'resnet18' else 'small ResNet'} (CIFAR shape), batch {a.batch_size}/rank, 2 x 2 ranks, compute "
          f"{a.compute_source}" + (f" at {a.device_tflops} TFLOP/s" if
                                   a.compute_source == "flops" else "")
          + f", density {a.density}, mean over the last {a.sparse_steps} steps")
    print(f"{'inter Gbit/s':>12} {'mode':<24} {'step_sim s':>11} {'alpha-beta s':>13}")
    for gbps in a.inter_gbps:
        for name, extra in modes:
            out = tmp / f"{name.replace(' ', '_')}_{gbps}"
            recs = launch(4, "dataparallel", [*common, "--inter-bw", gbps, *extra], out)
            last = recs[-a.sparse_steps:]
            sim = float(np.mean([r["step_sim_s"] for r in last]))
            ab = float(np.mean([_alpha_beta(r) for r in last]))
            print(f"{gbps:>12g} {name:<24} {sim:>11.5f} {ab:>13.5f}", flush=True)


def _alpha_beta(line: dict) -> float:
    """The alpha-beta seconds of a line's calls per unit (rank 0's; the bound)."""
    return sum(line["phase_modeled_s"].values()) / line["interval_units"]


def admm(a, tmp: Path) -> None:
    print(f"# digits CNN, 2 x 2 ranks, 2 local steps per iteration, compute {a.compute_source}")
    print(f"{'method':<10} {'iteration':>9} {'step_sim s':>11} {'alpha-beta s':>13}")
    for method in ("hsadmm", "flat-admm"):
        recs = launch(4, "hsadmm", ["train", "--method", method, "--iters", 3, "--local-steps",
                                    2, "--ranks-per-node", 2, *clock_args(a)],
                      tmp / method)
        for r in recs:
            print(f"{method:<10} {r['index']:>9} {r['step_sim_s']:>11.6f} "
                  f"{_alpha_beta(r):>13.6f}")


def hsgd(a, tmp: Path) -> None:
    print(f"# RadiX-Net 1024 neurons x 6 layers, batch 16, 2 x 2 ranks, compute "
          f"{a.compute_source}")
    print(f"{'partition':<11} {'step':>4} {'step_sim s':>11} {'alpha-beta s':>13}")
    for part in ("hypergraph", "random"):
        recs = launch(4, "sparse_sgd", ["train", "--neurons", 1024, "--layers", 6,
                                        "--partition", part, "--steps", 4, "--batch-size", 16,
                                        "--log-every", 1, "--ranks-per-node", 2,
                                        *clock_args(a)], tmp / part)
        for r in recs:
            print(f"{part:<11} {r['index']:>4} {r['step_sim_s']:>11.6f} "
                  f"{_alpha_beta(r):>13.6f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("ssfusion", "admm", "hsgd"), default="ssfusion")
    p.add_argument("--compute-source", choices=("flops", "cpu"), default="flops")
    p.add_argument("--device-tflops", type=float, default=15.7)
    p.add_argument("--inter-gbps", type=float, nargs="+", default=[10.0, 25.0, 100.0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--model", choices=("resnet18", "small"), default="resnet18",
                   help="ssfusion: ResNet-18 or the default small ResNet (3 stages, 16-64)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--sparse-steps", type=int, default=2)
    p.add_argument("--ssfusion-args", nargs=argparse.REMAINDER, default=[],
                   help="further ssfusion flags (last on the line)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        {"ssfusion": ssfusion, "admm": admm, "hsgd": hsgd}[a.part](a, Path(tmp))


if __name__ == "__main__":
    main()
