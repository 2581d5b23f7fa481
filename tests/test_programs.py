"""The plan is the program: what a run records of each step equals the program generated from
its plan, for every system, on uneven placements.

A run that records a compute profile also records every rank's program from the clock's and the
communicators' own hooks (:class:`substrate.program.Program`); the executor holds each step's
recording equal to the generated program it ran (:meth:`substrate.executor.Executor.verify`),
and the tests here regenerate the programs from the plans alone, without MPI, and compare them
with the files the runs wrote.
"""

from __future__ import annotations

import json

import pytest
from mpi_helpers import run_mpi

from dataparallel.ddp import DDPOptions, DDPPlan
from dataparallel.fp16 import FP16Options, FP16Plan
from dataparallel.program import step_program
from dataparallel.topk import TopKOptions, TopKPlan
from models import build_model
from substrate.calls import Placement
from substrate.program import normalize, steps

#: placements of the runs: ranks and ``--node-map`` (2 x 2, one node of 3, 2 x 3, round-robin)
PLACEMENTS = {"2x2": (4, "block:2"), "1x3": (3, "block:3"), "2x3": (6, "block:3"),
              "round-robin": (4, "round-robin:2")}


def _dp_records(method: str, model, placement):
    layout = model.layout
    if method == "ddp":
        return DDPPlan.for_layout(layout, DDPOptions(), 4).calls(placement)
    if method == "ddp-hierarchical":
        return DDPPlan.for_layout(layout, DDPOptions(allreduce="hierarchical"), 4).calls(
            placement)
    if method == "fp16":
        return FP16Plan.for_layout(layout, FP16Options(), 4).calls(placement)
    return TopKPlan.for_layout(layout, TopKOptions()).calls(placement)


def _assert_same(recorded: list, generated: list, what: str) -> None:
    for r, (rec, gen) in enumerate(zip(recorded, generated)):
        for k, step in enumerate(steps(normalize(rec))):
            want = normalize(gen)
            if step != want:
                i = next((i for i, (a, b) in enumerate(zip(step, want)) if a != b),
                         min(len(step), len(want)))
                pytest.fail(f"{what}: rank {r} step {k} entry {i}: recorded "
                            f"{step[i] if i < len(step) else None}, generated "
                            f"{want[i] if i < len(want) else None}")


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def dp_runs(request, tmp_path_factory):
    n, node_map = PLACEMENTS[request.param]
    out = tmp_path_factory.mktemp(f"programs-{request.param}")
    run_mpi("program_checks.py", n, out, node_map, timeout=240)
    return out, n, node_map


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["ddp", "ddp-hierarchical", "fp16", "topk"])
def test_dp_recorded_program_is_the_plans(dp_runs, method):
    out, n, node_map = dp_runs
    summary = json.loads((out / method / "summary.json").read_text())
    assert summary["metrics"]["program_steps_verified"] == 2
    doc = json.loads((out / f"{method}.json").read_text())
    placement = Placement.parse(node_map, n)
    model = build_model("cnn", (1, 8, 8), 10)
    records = _dp_records(method, model, placement)
    generated = [step_program(model.compute_units(), records, placement, r) for r in range(n)]
    _assert_same(doc["programs"], generated, f"{method} on {node_map}")


@pytest.mark.mpi
def test_a_run_that_strays_from_its_program_stops(tmp_path):
    res = run_mpi("program_checks.py", 2, tmp_path, "block:1", "mutate", timeout=120,
                  expect_fail=True)
    assert "differs from the generated one" in res.stderr
    assert "recorded ['B', 'layer', 'forward:loss'" in res.stderr
    assert "generated ['B', 'layer', 'forward:lost'" in res.stderr
