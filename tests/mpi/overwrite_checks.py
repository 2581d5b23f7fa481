"""A toy trainer on the run loop, to replace a run with ``--overwrite`` and fail on the way.

``python -m mpi4py overwrite_checks.py --out OUT --steps N [--checkpoint-every K] [--resume |
--overwrite] [--fail-after M --how fails|killed]``: every step adds ``step + 1`` to a state kept
in the checkpoints and logged as ``loss``.  With ``--fail-after M`` the step after the first
``M`` (so after the checkpoint of step ``M``) fails: rank 1 alone raises a ``ValueError`` (the
job is aborted while rank 0 waits in a collective, without its clean-up) or, with ``--how
killed``, every rank ends at once as a killed process does.  Rank 0 prints ``RESUMED FROM S``
after a resume.
"""

import argparse
import os
import sys

import numpy as np

from runner.errors import main_guard
from runner.loop import LoopBody, RunLoop
from runner.options import add_common_args, add_training_args
from runner.run import start_run


class Toy(LoopBody):
    def __init__(self, run, fail_after, how):
        self.run, self.fail_after, self.how = run, fail_after, how
        self.w = np.zeros(3)

    def unit(self, due):
        if self.fail_after is not None and due.index == self.fail_after:
            if self.how == "killed":
                sys.stdout.flush()
                os._exit(9)
            if self.run.rank == 1:
                raise ValueError(f"made to fail after the checkpoint of step {due.index}")
        self.w += due.index + 1
        return []

    def line(self, interval):
        return {"loss": float(self.w.sum())}

    def state_dict(self):
        return {"toy/w": self.w}


@main_guard
def main(argv):
    p = argparse.ArgumentParser()
    add_training_args(add_common_args(p), "step", 0)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fail-after", type=int, default=None)
    p.add_argument("--how", choices=("fails", "killed"), default="fails")
    args = p.parse_args(argv)
    run = start_run(args, system="toy", method="overwrite")
    loop = RunLoop(run, total=args.steps, flag="--steps", checkpoint_every=args.checkpoint_every,
                   log_every=1, resume=args.resume)
    body = Toy(run, args.fail_after, args.how)
    state = loop.resume()
    if state is not None:
        body.w = np.array(state["toy/w"])
        if run.rank == 0:
            print(f"RESUMED FROM {loop.done}", flush=True)
    loop.run(body)
    run.finish(metrics={"w": body.w.tolist()}, predicted=loop.predicted.block())
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
