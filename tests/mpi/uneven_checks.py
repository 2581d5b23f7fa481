"""Every system once, briefly, in one MPI launch: ``uneven_checks.py OUT R [SYSTEM ...]``.

Run with a rank count and ``R`` ranks per node (3 here) that do not divide the element counts
of the rings (the digits CNN's T = 38,282 parameters, the buckets, the residuals, the loss
vector), so every closed form of the predictions has to follow the rings' uneven chunks.  Each
system writes ``OUT/<name>/summary.json``; ``tests/commvol/test_predict_vs_runs.py`` compares them with the
predictions.  Without SYSTEM arguments all of :data:`RUNS` run.
"""

import sys

from dataparallel.train import build_parser as dp_parser
from dataparallel.train import train as dp_train
from hsadmm.train import build_parser as hs_parser
from hsadmm.train import train as hs_train
from runner.probe import main as probe_main
from sparse_sgd.cli import _train as sparse_train
from sparse_sgd.cli import build_parser as sparse_parser

#: name -> (trainer, arguments); the data-parallel runs evaluate after every step
RUNS = {
    "hsadmm": ("hsadmm", ["--iters", "2", "--local-steps", "1", "--freeze-iter", "1"]),
    "flat-admm": ("hsadmm", ["--method", "flat-admm", "--iters", "1", "--local-steps", "1"]),
    "ddp": ("dp", ["--steps", "1"]),
    "ddp-hierarchical": ("dp", ["--steps", "1", "--allreduce", "hierarchical"]),
    "topk": ("dp", ["--method", "topk", "--steps", "1"]),
    "pactrain": ("dp", ["--method", "pactrain", "--steps", "3", "--stable-window", "1",
                        "--warmup-steps", "1", "--prune-score", "grasp"]),
    "pactrain-ternary": ("dp", ["--method", "pactrain", "--steps", "2", "--ternary",
                                "--stable-window", "1", "--warmup-steps", "0"]),
    "sdp": ("dp", ["--method", "sdp", "--steps", "1", "--coverage", "2/3"]),
    "sdp-block-backward": ("dp", ["--method", "sdp", "--steps", "1", "--model", "resnet",
                                  "--sdp-mode", "block-backward"]),
    "ssfusion-per-tensor": ("dp", ["--method", "ssfusion", "--steps", "2", "--fusion",
                                   "per-tensor", "--profile-steps", "1"]),
    "ssfusion-selective": ("dp", ["--method", "ssfusion", "--steps", "3", "--profile-steps",
                                  "2", "--density", "0.05"]),
    "sparse_sgd": ("sparse", ["train", "--neurons", "1024", "--layers", "3", "--partition",
                              "random", "--steps", "2", "--batch-size", "7",
                              "--test-fraction", "0"]),
    # the substrate's self-check: every wrapped call against substrate.costmodel's closed forms
    "probe": ("probe", []),
}


def main(out: str, R: str, names) -> None:
    for name in names or RUNS:
        kind, args = RUNS[name]
        args = [*args, "--ranks-per-node", R, "--out", f"{out}/{name}"]
        if kind == "hsadmm":
            hs_train(hs_parser().parse_args(args))
        elif kind == "dp":
            dp_train(dp_parser().parse_args(["--eval-every", "1", *args]))
        elif kind == "sparse":
            sparse_train(sparse_parser().parse_args(args))
        else:
            probe_main(args)  # its verdict is in the summary's metrics


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
