"""Every MPI trainer once, briefly, in one launch: ``schema_checks.py OUT`` (4 ranks as 2 virtual
nodes x 2).  Each run writes ``OUT/<name>/``; ``tests/runner/test_metrics_schema.py`` validates every
``metrics.jsonl`` line against ``runner/metrics.schema.json`` and checks the lines against the
run (bytes, evaluation schedule, units).
"""

import sys

from dataparallel.train import build_parser as dp_parser
from dataparallel.train import train as dp_train
from hsadmm.train import build_parser as hs_parser
from hsadmm.train import train as hs_train
from sparse_sgd.cli import _train as sparse_train
from sparse_sgd.cli import build_parser as sparse_parser

#: name -> (trainer, arguments); tests/runner/test_metrics_schema.py knows their schedules
RUNS = {
    "hsadmm": ("hsadmm", ["--iters", "3", "--local-steps", "2", "--freeze-iter", "1",
                          "--eval-every", "2"]),
    "flat-admm": ("hsadmm", ["--method", "flat-admm", "--iters", "2", "--local-steps", "2",
                             "--eval-every", "0"]),
    "ddp": ("dp", ["--method", "ddp"]),
    "topk": ("dp", ["--method", "topk", "--density", "0.05"]),
    "fp16": ("dp", ["--method", "fp16"]),
    "pactrain": ("dp", ["--method", "pactrain", "--warmup-steps", "1", "--stable-window", "1"]),
    "sdp": ("dp", ["--method", "sdp"]),
    "ssfusion": ("dp", ["--method", "ssfusion", "--fusion", "per-tensor", "--profile-steps",
                        "1", "--fusion-policy", "count"]),
    "sparse_sgd": ("sparse", ["train", "--neurons", "1024", "--layers", "3", "--steps", "5",
                              "--batch-size", "8", "--log-every", "2", "--eval-every", "3"]),
}
#: the data-parallel runs: 4 steps, evaluated after steps 2 and 4
DP_ARGS = ["--steps", "4", "--eval-every", "2", "--batch-size", "16"]


def main(out: str) -> None:
    for name, (kind, args) in RUNS.items():
        args = [*args, "--ranks-per-node", "2", "--progress-every", "0", "--out",
                f"{out}/{name}"]
        if kind == "hsadmm":
            hs_train(hs_parser().parse_args(args))
        elif kind == "dp":
            dp_train(dp_parser().parse_args([*DP_ARGS, *args]))
        else:
            sparse_train(sparse_parser().parse_args(args))


if __name__ == "__main__":
    main(sys.argv[1])
