"""Runs of the data-parallel methods that record their programs: ``python -m mpi4py
program_checks.py OUT NODE_MAP [mutate]``.

Each method trains 2 steps with ``--compute-profile-out OUT/METHOD.json`` on the placement
``NODE_MAP``; the executor holds every step's recording equal to the generated program it ran
(:meth:`substrate.executor.Executor.verify`) and the test regenerates the programs from the
plans alone.  ``mutate``: the programs the trainer runs name the loss block differently from
what the model records: the run must stop naming the difference.
"""

import sys
from pathlib import Path

import dataparallel.fp16  # noqa: F401  (registers --method fp16 before the parser is built)
from dataparallel import train
from dataparallel.train import main

METHODS = {"ddp": [], "ddp-hierarchical": ["--method", "ddp", "--allreduce", "hierarchical"],
           "fp16": [], "topk": [],
           # a warm-up step and a sparse step of a plan its options fix
           "ssfusion": ["--method", "ssfusion", "--fusion", "per-tensor", "--fusion-policy",
                        "count", "--buffers", "3", "--profile-steps", "1"]}


def _mutated(step_program):
    def generate(*args, **kw):
        return [["B", "layer", "forward:lost", "forward:lost", *e[4:]] if e[:3] == [
            "B", "layer", "forward:loss"] else e for e in step_program(*args, **kw)]
    return generate


if __name__ == "__main__":
    out, node_map, *rest = sys.argv[1:]
    if rest == ["mutate"]:
        train.step_program = _mutated(train.step_program)
    for name, args in METHODS.items():
        args = args or ["--method", name]
        main(["train", *args, "--steps", "2", "--node-map", node_map, "--out",
              str(Path(out) / name), "--compute-profile-out", str(Path(out) / f"{name}.json")])
