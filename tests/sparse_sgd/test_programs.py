"""H-SGD runs from its programs: every interval of ``sparse_sgd train`` (the set-up, a step, the
held-out evaluation) is a rank's program generated from the plan's records
(:mod:`sparse_sgd.program`) and run by the one executor.

Without MPI: a rank's program holds its part of every exchange of the plan (a receive per
message it gets, a send per message it sends, with the exchange's tag and share), the layer's
blocks between them, and the collectives blocking.  Under MPI, on 2 x 2, 1 x 3, 2 x 3 and a
round-robin placement: a run that records its programs (``--compute-profile-out``) verified
every interval against the program it ran, and the programs regenerated here from the seed's
partition, without MPI, equal the recorded files entry for entry (every block, call, receive,
wait and dependency on every rank).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpi_helpers import assert_measured_equals_predicted, run_mpi

from partition.partitioners import random_partition
from sparse_sgd.plan import HSGDPlan, PartitionOptions, batches, plan_partition
from sparse_sgd.program import (
    eval_program,
    infer_program,
    pass_program,
    setup_program,
    step_program,
)
from sparse_sgd.radixnet import challenge_config, radixnet, random_regular_network
from substrate.calls import Placement
from substrate.program import normalize, rebase

#: placements of the runs: ranks and ``--node-map`` (2 x 2, one node of 3, 2 x 3, round-robin)
PLACEMENTS = {"2x2": (4, "block:2"), "1x3": (3, "block:3"), "2x3": (6, "block:3"),
              "round-robin": (4, "round-robin:2")}


def _plan(parts: int = 5):
    weights = random_regular_network(128, 4, 8, seed=3)
    return HSGDPlan.from_partition(weights, random_partition(weights, parts, seed=1))


def _entries(program, kind):
    return [(i, e) for i, e in enumerate(program) if e[0] == kind]


@pytest.mark.parametrize("node_map", ["0,0,0,1,1", "round-robin:1"])
def test_every_rank_takes_its_part_of_every_exchange(node_map):
    """Over the ranks, the programs' sends are the records' messages (each with its tag) and
    their receives the same messages from the other end."""
    plan = _plan()
    placement = Placement.parse(node_map, 5)
    L = plan.num_layers
    records = plan.tagged_calls(placement, 3, 4)
    want = {t: sorted(map(tuple, c.pairs.tolist())) for c, t in records if t is not None}
    assert sorted(want) == [*range(1, L + 1), *range(L + 2, 2 * L + 1)]
    sent, got = {}, {}
    for r in range(5):
        program = step_program(records, L, placement, r)
        for _, (_, call, after, member, wait, tag) in _entries(program, "C"):
            if call.algorithm != "p2p":
                continue
            assert (member, wait, call.group) == (True, False, placement.world)
            assert len(after) == 1 and program[after[0]][0] == "B"   # the block that filled it
            sent.setdefault(tag, []).extend(map(tuple, call.pairs.tolist()))
        for _, (_, src, nb, tag, group) in _entries(program, "R"):
            assert tuple(group) == placement.world
            got.setdefault(tag, []).append((src, r, nb))
        # the step ends with the loss all-reduce, blocking, after everything before
        assert program[-1] == ["S"] and program[-2][1].phase == "loss"
        assert program[-2][2] is None and program[-2][4]
    assert {t: sorted(v) for t, v in sent.items()} == want
    assert {t: sorted(v) for t, v in got.items()} == want


def test_a_layer_waits_for_its_messages_where_algs_2_and_3_do():
    plan = _plan()
    placement = Placement.parse("block:5", 5)
    L = plan.num_layers
    records = plan.tagged_calls(placement, 2, 8)
    program = normalize(step_program(records, L, placement, 2))
    labels = [e[2] for e in program if e[0] == "B"]
    assert labels[0] == "batch" and labels[-1] == "class_scores"
    assert labels[1:4] == ["spff_pack[1]", "spff_local[1]", "spff_remote[1]"]
    assert labels[3 * L + 1:3 * L + 5] == ["spbp_output", f"spbp_remote[{L}]",
                                           f"spbp_local[{L}]", f"spbp_update[{L}]"]
    assert labels[-2] == "spbp_update[1]"            # layer 1: the update alone
    for prefix, part in (("spff", "remote"), ("spbp", "delta")):
        for k in range(1 if prefix == "spff" else 2, L + 1):
            tag = k if prefix == "spff" else L + k
            i = next(i for i, e in enumerate(program)
                     if e[0] == "B" and e[2] == f"{prefix}_{part}[{k}]")
            # after the block before it (the local product / the update) and its sends ...
            deps = program[i][4]
            assert program[deps[0]][2] == (f"spff_local[{k}]" if prefix == "spff"
                                           else f"spbp_update[{k}]")
            assert [program[d][5] for d in deps[1:]] == \
                [e[5] for e in program if e[0] == "C" and e[5] == tag]
            # ... once its receives arrived
            received = [j for j, e in enumerate(program) if e[0] == "R" and e[3] == tag]
            assert received and program[i - 1] == ["A", received]


def test_a_cuda_aware_net_posts_its_receives_after_its_sends_and_overlap_off_blocks():
    plan = _plan()
    placement = Placement.parse("block:5", 5)
    records = plan.tagged_calls(placement, 2, 8)
    first = step_program(records, plan.num_layers, placement, 1)
    after = step_program(records, plan.num_layers, placement, 1, receives_first=False)
    kinds = lambda p, tag: [e[0] for e in p if (e[0] == "R" and e[3] == tag) or  # noqa: E731
                            (e[0] == "C" and e[5] == tag)]
    assert kinds(first, 1)[0] == "R" and kinds(after, 1)[-1] == "R"
    assert sorted(kinds(first, 1)) == sorted(kinds(after, 1))
    blocking = step_program(records, plan.num_layers, placement, 1, overlap=False)
    assert all(e[2] is None for e in blocking if e[0] == "C")
    assert [e[:2] for e in normalize(blocking) if e[0] != "C"] == \
        [e[:2] for e in normalize(first) if e[0] != "C"]


def test_the_net_passes_evaluation_inference_and_set_up():
    plan = _plan()
    placement = Placement.parse("block:5", 5)
    L = plan.num_layers
    step = plan.tagged_calls(placement, 4, 8)
    whole = normalize(step_program(step, L, placement, 3))
    fwd = normalize(pass_program(step, L, placement, 3, "spff"))
    bwd = normalize(pass_program(step, L, placement, 3, "spbp"))
    # the passes alone are the step without the trainer's blocks and the loss
    start = 2                                       # after the batch block
    assert fwd == rebase(whole[start:start + len(fwd)], start)
    start += len(fwd)
    assert bwd == rebase(whole[start:start + len(bwd)], start)
    ev = plan.tagged_calls(placement, 4, 8, "eval", samples=10)
    program = eval_program(ev, L, len(batches(10, 4)), placement, 3)
    assert [e[2] for e in program if e[0] == "B"].count("eval_batch") == 3
    assert program[-1][1].phase == "eval_scores"
    assert eval_program(plan.tagged_calls(placement, 4, 8, "eval"), L, 0, placement, 3) == []
    inf = plan.tagged_calls(placement, 4, 8, "infer", samples=5)
    program = infer_program(inf, L, 2, placement, 3)
    assert program[0][1].algorithm == "barrier" and program[-1][1].op == "max"
    assert "infer_remote[1]" in [e[2] for e in program if e[0] == "B"]
    setup = plan.tagged_calls(placement, 1, 8, "setup")
    assert [e[0] for e in setup_program(setup, placement, 0, net=True)] == ["C", "B", "E"]
    assert setup_program([], placement, 0, net=False) == []
    with pytest.raises(ValueError, match="is not a blocking collective where"):
        eval_program(ev, L, 1, placement, 3)            # records of three batches, one laid


def _concatenated(intervals) -> list:
    """The intervals' programs one after the other, indices counted over the whole run."""
    out = []
    for entries in intervals:
        out += rebase(normalize(entries), -len(out))
    return out


def _regenerated(n: int, node_map: str, images: int) -> tuple[list, HSGDPlan]:
    """Every rank's programs of ``sparse_sgd train --neurons 1024 --layers 4 --steps 2`` (seed
    0, batch 32, float64) from the plan alone: the set-up, two steps, the evaluation."""
    network = challenge_config(1024, 4, permute=True, seed=0)
    weights = radixnet(network)
    plan = HSGDPlan.from_partition(weights, plan_partition(
        weights, n, "hypergraph", PartitionOptions(), seed=0, network=network))
    placement = Placement.parse(node_map, n)
    L = plan.num_layers
    setup = plan.tagged_calls(placement, 1, 8, "setup")
    step = plan.tagged_calls(placement, 32, 8)
    ev = plan.tagged_calls(placement, 32, 8, "eval", samples=images)
    programs = [_concatenated([setup_program(setup, placement, r, net=True),
                               step_program(step, L, placement, r),
                               step_program(step, L, placement, r),
                               eval_program(ev, L, len(batches(images, 32)), placement, r)])
                + [["S"]]          # the run closes what followed its last step as a step
                for r in range(n)]
    return programs, plan


@pytest.mark.mpi
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
def test_recorded_programs_are_the_plans(where, tmp_path):
    n, node_map = PLACEMENTS[where]
    run_mpi(None, n, "train", "--neurons", 1024, "--layers", 4, "--steps", 2, "--node-map",
            node_map, "--out", tmp_path / "run", "--compute-profile-out",
            tmp_path / "programs.json", module="sparse_sgd", timeout=240)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # the set-up, two steps and the evaluation, each held to the program it ran
    assert summary["metrics"]["program_steps_verified"] == 4
    assert_measured_equals_predicted(summary)
    recorded = json.loads((tmp_path / "programs.json").read_text())["programs"]
    generated, plan = _regenerated(n, node_map, summary["metrics"]["test_images"])
    # the seed's partition, computed here without MPI, is the run's
    assert summary["metrics"]["partition_table1"] == json.loads(json.dumps(
        plan.metrics.table1()))
    assert len(recorded) == n
    for r, (rec, gen) in enumerate(zip(recorded, generated)):
        rec = normalize(rec)
        if rec != gen:
            i = next((i for i, (a, b) in enumerate(zip(rec, gen)) if a != b),
                     min(len(rec), len(gen)))
            pytest.fail(f"{where}: rank {r} entry {i}: recorded "
                        f"{rec[i] if i < len(rec) else None}, generated "
                        f"{gen[i] if i < len(gen) else None}")
    assert np.sum([e[0] == "C" and e[1]["algorithm"] == "p2p" for p in generated
                   for e in p]) > 0
