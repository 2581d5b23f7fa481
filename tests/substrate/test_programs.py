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
from dataparallel.ssfusion import SSFusionOptions, plan_ssfusion
from dataparallel.topk import TopKOptions, TopKPlan
from models import build_model
from substrate.calls import Placement
from substrate.costmodel import INTER, INTRA, CostModel
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
def test_ssfusion_recorded_programs_are_the_plans(dp_runs):
    """SSFusion's warm-up step (momentum of the whole gradient, then the warm-up buffers'
    all-reduces) and sparse step (per fusion buffer the sparsification and the all-gather,
    then the decoding) as the run recorded them are the programs of the plan's records of
    each kind of step."""
    out, n, node_map = dp_runs
    summary = json.loads((out / "ssfusion" / "summary.json").read_text())
    assert summary["metrics"]["program_steps_verified"] == 2
    doc = json.loads((out / "ssfusion.json").read_text())
    placement = Placement.parse(node_map, n)
    model = build_model("cnn", (1, 8, 8), 10)
    sizes = [int(model.layout.sizes[k]) for k in model.layout.names]
    plan = plan_ssfusion(sizes, n, INTER if placement.num_nodes > 1 else INTRA,
                         SSFusionOptions(fusion="per-tensor", fusion_policy="count", buffers=3,
                                         profile_steps=1), CostModel())
    units = model.compute_units()
    for r, rec in enumerate(doc["programs"]):
        got = steps(normalize(rec))
        want = [normalize(step_program(units, plan.calls(placement, kind, momentum=True),
                                       placement, r)) for kind in ("warmup", "sparse")]
        assert len(got) == 2
        for k, (a, b) in enumerate(zip(got, want)):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert a == b, (f"rank {r} step {k} entry {i}: recorded {a[i] if i < len(a) else None}"
                            f", generated {b[i] if i < len(b) else None}")


@pytest.mark.mpi
def test_a_run_that_strays_from_its_program_stops(tmp_path):
    res = run_mpi("program_checks.py", 2, tmp_path, "block:1", "mutate", timeout=120,
                  expect_fail=True)
    assert "differs from the generated one" in res.stderr
    assert "recorded ['B', 'layer', 'forward:loss'" in res.stderr
    assert "generated ['B', 'layer', 'forward:lost'" in res.stderr


def test_an_offload_block_runs_beside_the_thread_for_the_workers_time():
    """An ``offload``-stream block of a program (SSFusion-O's worker items): its compute hands
    the work over and the thread goes on; the block is an event on the offload stream, after
    what it names, of the seconds the worker reports when the work is collected; a block that
    names it waits for it; a recording clock records it as generated.  Without a compute (a
    replay) it costs what the source charges it."""
    from types import SimpleNamespace

    from simulation.clock import PendingSeconds, SimClock
    from simulation.compute import FlopSource
    from substrate.executor import Bindings, Executor
    from substrate.ledger import Ledger
    from substrate.program import Builder

    b = Builder()
    bwd = b.block("bwd")
    work = b.block("w", deps=[bwd], stream="offload")
    b.block("more", deps=[bwd])
    b.block("wait", deps=[work])
    b.step()

    class Bind(Bindings):
        """A worker's item "w" whose 2 s the "wait" block delivers; none with ``submit``
        false (a replay's bindings)."""

        def __init__(self, submit: bool):
            self.submit, self.pending = submit, PendingSeconds()

        def compute(self, label):
            if not self.submit:
                return None
            return {"w": lambda: self.pending, "wait": lambda: self.pending.set(2.0)}.get(
                label, lambda: None)

        def flops(self, label):
            return {"bwd": 1e12, "w": 0.25e12, "more": 0.5e12, "wait": 0.0}.get(label)

    for submit in (True, False):
        clock = SimClock(Ledger(), source=FlopSource(1.0), keep_program=True)
        run = SimpleNamespace(clock=clock, recorder=SimpleNamespace(program=None), rank=0,
                              topo=SimpleNamespace(world=None, intra=None, inter=None))
        bind = Bind(submit)
        Executor(run, {}).run_step(b.entries, bind)
        clock.step()
        sim = clock.simulate()           # the thread went on beside the worker ("more")
        assert sim == [("unit", pytest.approx(3.0 if submit else 1.5))]
        ends = {e["label"]: e["finish"] for e in clock.last_step["ranks"]["0"]}
        assert ends["more"] == pytest.approx(1.5)
        assert ends["w"] == pytest.approx(3.0 if submit else 1.25)   # 2 s, or the source's
        assert normalize(clock.program.entries) == normalize(b.entries)
