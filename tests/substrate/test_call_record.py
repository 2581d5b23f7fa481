"""Adding a system is one plan: a made-up system, defined here as a plan with ``calls()`` and the
bindings of a data-parallel strategy (which arrays its calls work on), trains through the same
trainer, program generator and executor as every real system, is booked (measured ==
predicted under MPI, on any placement), runs exactly its generated program, and is predicted
(``IterCost.from_calls``) and scaled, with no other code of its own."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from mpi_helpers import assert_measured_equals_predicted, read_summary, run_mpi

from dataparallel.strategy import Strategy
from substrate.calls import Call, Placement, Ready, price, wire_bytes
from substrate.costmodel import CostModel


@dataclass(frozen=True)
class ToyPlan:
    """A made-up system: a world all-reduce of the gradients (after the backward), a broadcast
    inside every node after it, and a ring of messages between the node leaders."""

    elements: int

    def calls(self, placement: Placement) -> list:
        n = 4 * self.elements
        out = [Call("toy_allreduce", "allreduce", placement.world, n, 4, op="sum",
                    after=(Ready(0, self.elements),))]
        for m in range(placement.num_nodes):
            out.append(Call("toy_bcast", "bcast", placement.members(m), n, 4, after=(0,)))
        lead = placement.leaders
        if len(lead) > 1:           # one node: no leaders' ring, no record (nothing is sent)
            pairs = [(lead[i], lead[(i + 1) % len(lead)], 8 * (i + 1))
                     for i in range(len(lead))]
            out.append(Call("toy_ring", "p2p", placement.world, pairs=pairs, after=(0,)))
        return out


class ToyStrategy(Strategy):
    """The made-up system as a data-parallel method: its plan, and the arrays its calls work
    on (the first gradients for the all-reduce and the broadcast; the leaders' ring sends and
    receives zeros).  Nothing else."""

    name = "toy"

    def __init__(self, ctx, options) -> None:
        super().__init__(ctx, options)
        self._records = ToyPlan(1001).calls(self.topo.placement)

    def records(self, state) -> list:
        return self._records

    def buffer(self, call):
        if call.algorithm == "p2p":
            return np.zeros(int(call.pairs[0, 2]), dtype=np.uint8)
        return self.ctx.model.grads.flat[:1001]

    def receive_buffer(self, source, nbytes, tag):
        return np.zeros(nbytes, dtype=np.uint8)


@pytest.mark.mpi
@pytest.mark.parametrize("n,node_map", [(4, "block:2"), (4, "round-robin:2"),
                                        (6, "0,1,2,0,1,2"), (3, "block:3")])
def test_a_plan_alone_is_executed_booked_and_accounted(tmp_path, n, node_map):
    out = tmp_path / "toy"
    run_mpi("toy_checks.py", n, "train", "--method", "toy", "--steps", 3, "--out", out,
            "--node-map", node_map, "--compute-profile-out", tmp_path / "toy.json",
            timeout=120)
    s = read_summary(out)
    assert_measured_equals_predicted(s)
    assert s["metrics"]["program_steps_verified"] == 3
    pl = Placement.parse(node_map, n)
    want = price(ToyPlan(1001).calls(pl), pl)
    got = s["traffic"]["measured"]["by_phase"]
    for ph, b in want.phases.items():
        assert (got[ph]["intra_bytes"], got[ph]["inter_bytes"]) == (3 * b["intra"],
                                                                   3 * b["inter"])
    assert s["timing"]["sim_s"] > 0 and s["clock"]["steps"] == 3


def test_a_plan_alone_is_predicted_and_scaled(monkeypatch):
    from commvol.systems import core
    from models.layers import Linear, Sequential
    from models.modelspec import spec_from_layers
    from substrate.options import option

    @dataclass(frozen=True)
    class ToyOptions:
        elements: int = option(1001, "toy elements")

    def predict(spec, M, P, options, cost=None):
        pl = Placement.node_major(M, P)
        it = core.IterCost.from_calls(ToyPlan(spec.layout.total).calls(pl), pl, cost)
        return core.Prediction("toy", spec.name, M, P, "1 step", ((None, it),))

    monkeypatch.setitem(core.SYSTEMS, "toy", core.SystemModel("toy", predict, ToyOptions))
    spec = spec_from_layers("tiny", Sequential([("fc", Linear(4, 8, bias=False))]), (4,), 8)
    pred = core.get_system("toy")(spec, 2, 2, {})
    pl = Placement.node_major(2, 2)
    assert pred.steady.phases == {c.phase: wire_bytes(c, pl) for c in
                                  ToyPlan(32).calls(pl) if c.phase != "toy_bcast"} | {
        "toy_bcast": {"intra": 2 * 4 * 32, "inter": 0}}
    from commvol.job import Job
    from commvol.workload import DeviceModel, Unit
    from simulation.cluster import Cluster, Device

    job = Job("toy", spec, 2, 2, ToyOptions(), [Unit("fc", 0, 32, 1e6, 2e6)],
              DeviceModel(Device(peak_tflops=1.0, memory_gbs=1.0)), 10)
    r = job.run(Cluster.two_tier(CostModel(inter_bw=1e6, inter_lat=1e-4)))
    phases = {e[1].phase for p in job.programs for e in p if e[0] == "C"}
    assert phases == {"toy_allreduce", "toy_bcast", "toy_ring"}
    assert r["bytes"]["inter"] == price(ToyPlan(32).calls(pl), pl).inter
    compute = 10 * 3e6 / 1e12
    assert r["step_s"] > compute
