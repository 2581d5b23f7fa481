"""Distributed SpFF/SpBP under MPI against the serial SciPy reference, every interval's calls
against the plan's records (message by message) and the ledger against the records and the
partition metrics, on 1 rank, 2 nodes x 2, 2 x 3 and 1 x 3 (1024 rows over 3 or 6 ranks: uneven
parts; batches of 6 and 3 values; a short last inference batch); a run on a mutated plan stops;
and the ``sparse_sgd`` CLI end to end.  (One node of 6 adds nothing to 2 x 3, the same partition
and messages, and 1 x 3, a node's ranks without an inter-node link.)"""

import json

import pytest
from mpi_helpers import JobBatch, assert_measured_equals_predicted, run_mpi

pytestmark = pytest.mark.mpi

#: (ranks, ranks per node): one rank, 2 x 2, 2 x 3, 1 x 3
LAYOUTS = [(1, 1), (4, 2), (6, 3), (3, 3)]
#: the layouts inference is checked on
INFER_LAYOUTS = [(4, 2), (6, 3)]
METHODS = ["hypergraph", "random"]


@pytest.fixture(scope="module")
def layout_checks(tmp_path_factory):
    """``sparse_checks.py`` on a layout: every check of that layout in one launch, once."""
    root, done = tmp_path_factory.mktemp("sparse_checks"), {}

    def run(n, R):
        if (n, R) not in done:
            specs = [f"train:{m}" for m in METHODS]
            if (n, R) in INFER_LAYOUTS:
                specs += [f"infer:{m}" for m in METHODS]
            done[(n, R)] = "the launch did not finish"
            try:
                res = run_mpi("sparse_checks.py", n, ",".join(specs), R, root / f"{n}x{R}",
                              timeout=120 * len(specs))
            except pytest.fail.Exception as exc:
                done[(n, R)] = AssertionError(str(exc))
                raise
            done[(n, R)] = res.stdout
        if isinstance(done[(n, R)], AssertionError):
            pytest.fail(f"the launch of layout {n}x{R} failed:\n{done[(n, R)]}")
        return done[(n, R)]

    return run


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n,R", LAYOUTS, ids=[f"{n // R}x{R}" for n, R in LAYOUTS])
def test_train_matches_serial_and_runs_its_plan(layout_checks, method, n, R):
    assert f"OK train {method} P={n}" in layout_checks(n, R)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n,R", INFER_LAYOUTS, ids=["2x2", "2x3"])
def test_infer_matches_serial_challenge_reference(layout_checks, method, n, R):
    assert f"OK infer {method} P={n}" in layout_checks(n, R)


def test_a_run_on_a_mutated_plan_stops_at_the_first_step(tmp_path):
    """SpFF messages one word short (an off-by-one in the plan's pair words): the first step's
    calls differ from the plan on every rank, which stops the job before it writes anything."""
    res = run_mpi("sparse_checks.py", 4, "mutant:random", 2, tmp_path / "out", timeout=240,
                  expect_fail=True)
    # the account names the call, what ran and what the plan said (the messages of the pairs)
    err = res.stderr
    assert "call 0 of the interval differs from the plan: ran spff" in err, err
    assert "planned" in err and "messages" in err, err
    assert not (tmp_path / "out" / "mutant-random" / "summary.json").exists()


@pytest.fixture(scope="module")
def cli_jobs(tmp_path_factory):
    """The ``sparse_sgd`` CLI runs of this module: one launch per world size."""
    from sparse_sgd.cli import main as sparse_main

    b = JobBatch(tmp_path_factory.mktemp("sparse_cli"))
    root = b.root
    for method in METHODS:
        b.add(f"train-{method}", 4, "sparse_sgd", "train", "--neurons", 1024, "--layers", 6,
              "--partition", method, "--steps", 12, "--batch-size", 16, "--lr", 0.05,
              "--ranks-per-node", 2, "--log-every", 4, "--out", root / f"train-{method}")
    sparse_main(["generate", "--neurons", "1024", "--layers", "4", "--out", str(root / "net"),
                 "--num-inputs", "60"])
    net = root / "net"
    b.add("infer", 2, "sparse_sgd", "infer", "--neurons", 1024, "--layers", 4, "--network-dir",
          net, "--inputs", net / "sparse-images-1024.tsv", "--categories",
          net / "neuron1024-l4-categories.tsv", "--batch-size", 25, "--out", root / "infer",
          "--check")
    sparse_main(["partition", "--neurons", "1024", "--layers", "4", "--parts", "2",
                 "--method", "hypergraph", "--hmetis", "--out", str(root / "h2")])
    for name, pfile in (("from-file", root / "h2" / "partition.npz"),
                        ("from-hmetis", root / "h2" / "hmetis")):
        b.add(name, 2, "sparse_sgd", "train", "--neurons", 1024, "--layers", 4,
              "--partition-file", pfile, "--steps", 3, "--batch-size", 8, "--out", root / name)
    return b


def _summary(jobs, name):
    return json.loads((jobs.run(name) / "summary.json").read_text())


def test_cli_train_measured_equals_predicted_and_hypergraph_moves_less(cli_jobs):
    sh, sr = _summary(cli_jobs, "train-hypergraph"), _summary(cli_jobs, "train-random")
    for s in (sh, sr):
        assert_measured_equals_predicted(s)  # and the run accounted every step's messages
        assert set(s["traffic"]["predicted"]["by_phase"]) == {
            "partition", "spff", "spbp", "loss", "eval", "eval_scores"}
        losses = s["metrics"]["loss_trajectory"]
        assert sum(losses[-3:]) < sum(losses[:3])  # the loss goes down
    # same seed, same mini-batches, same math: only the traffic differs between partitions
    assert sh["metrics"]["loss_trajectory"] == pytest.approx(sr["metrics"]["loss_trajectory"],
                                                            rel=1e-9)

    def p2p(s):
        bp = s["traffic"]["measured"]["by_phase"]
        return bp["spff"]["bytes"] + bp["spbp"]["bytes"]

    assert p2p(sr) >= 3 * p2p(sh)
    # metrics.jsonl: one schema; a line after steps 1, 5, 9 (--log-every 4) and the last, whose
    # bytes (the plan's records: set-up on the first line, the evaluation on the last) add up
    # to the run's measured traffic
    lines = [json.loads(x) for x in (cli_jobs.root / "train-hypergraph" / "metrics.jsonl")
             .read_text().splitlines()]
    assert [x["step"] for x in lines] == [x["index"] for x in lines] == [1, 5, 9, 12]
    assert [x["interval_units"] for x in lines] == [1, 4, 4, 3] and lines[0]["unit"] == "step"
    assert all(x["step_wall_s"] > 0 for x in lines)
    assert [x["test_accuracy"] is None for x in lines] == [True, True, True, False]
    assert lines[-1]["test_accuracy"] == sh["metrics"]["test_accuracy"]
    m = sh["traffic"]["measured"]
    for link in ("inter_node_bytes", "intra_node_bytes"):
        assert sum(x[link] for x in lines) == m[link]
    bp = m["by_phase"]
    assert lines[0]["inter_node_bytes"] + lines[0]["intra_node_bytes"] == \
        bp["partition"]["bytes"] + (bp["spff"]["bytes"] + bp["spbp"]["bytes"]
                                    + bp["loss"]["bytes"]) // 12
    assert 0 <= sh["metrics"]["test_accuracy"] <= 1 and sh["metrics"]["test_images"] == 359


def test_cli_infer_generated_network_categories(cli_jobs):
    net = cli_jobs.root / "net"
    assert (net / "neuron1024" / "n1024-l4.tsv").is_file()  # the challenge's folder layout
    out = cli_jobs.run("infer")
    s = json.loads((out / "summary.json").read_text())
    assert s["metrics"]["categories_match"] is True
    assert s["metrics"]["serial_reference_match"] is True
    assert_measured_equals_predicted(s)
    assert set(s["traffic"]["predicted"]["by_phase"]) == {"partition", "sync", "spff",
                                                          "categories"}
    assert s["traffic"]["measured"]["by_phase"]["spff"]["bytes"] > 0
    assert "EQUAL" in cli_jobs.stdout("infer")


def test_cli_train_with_saved_partition_file(cli_jobs, tmp_path):
    s = _summary(cli_jobs, "from-file")
    pred = s["traffic"]["predicted"]
    assert "partition" not in pred["by_phase"]  # read from the file on every rank: no bcast
    assert s["metrics"]["partition_method"] == "hypergraph"
    assert_measured_equals_predicted(s)
    # the same partition through its hMetis files (partition.hmetis): the same run, byte for byte
    h = _summary(cli_jobs, "from-hmetis")
    assert h["metrics"]["partition_method"] == "hmetis"
    assert h["traffic"]["measured"] == s["traffic"]["measured"]
    assert h["metrics"]["test_accuracy"] == s["metrics"]["test_accuracy"]
    run_mpi(None, 4, "train", "--neurons", 1024, "--layers", 4, "--partition-file",
            cli_jobs.root / "h2" / "partition.npz", "--steps", 1, "--out", tmp_path / "bad",
            module="sparse_sgd", timeout=120, expect_fail=True)
