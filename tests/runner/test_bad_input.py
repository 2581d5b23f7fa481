"""Hostile command lines: each fails fast with one message naming the input and the
fix, and writes nothing.

The serial table runs every command's ``main`` in this process under
:func:`runner.run.main_guard` (as ``python -m`` does); a few cases run on 2 ranks to show
that every rank fails with the same message, printed once, and nothing is written.
"""

from __future__ import annotations

import json

import pytest
from mpi_helpers import assert_fails_on_every_rank

from commvol.__main__ import main as commvol_main
from dataparallel.pactrain import save_init
from dataparallel.train import main as dp_main
from hsadmm.train import main as hsadmm_main
from models import build_model
from models.train import main as models_main
from partition.cli import main as partition_main
from partition.cli import partitioner_errors
from runner.errors import main_guard
from sparse_sgd.cli import main as sparse_main
from sparse_sgd.io import write_challenge_network
from sparse_sgd.radixnet import graph_challenge_network

BIG = "100000"
SHARD = "larger than each rank's shard of the 1438 digits training samples split over 1 ranks"
DP_METHODS = ("ddp", "topk", "pactrain", "sdp", "ssfusion")


def _guarded(main):
    """``main`` as ``python -m`` runs it."""
    return lambda argv: main_guard(main)(argv)


def _sparse(argv):
    return sparse_main(argv)  # decorated with main_guard already


def _partition(argv):
    """``python -m partition`` prints its own errors and returns 2."""
    code = partition_main(argv)
    if code:
        raise SystemExit(code)
    return code


@pytest.fixture
def files(tmp_path) -> dict:
    """Damaged or awkward inputs: a corrupt --init, a corrupt summary, an empty layer, a file
    where a directory is expected."""
    out = {"corrupt_npz": tmp_path / "corrupt.npz", "run": tmp_path / "run",
           "net": tmp_path / "net", "file": tmp_path / "a_file"}
    save_init(out["corrupt_npz"], build_model("cnn", (1, 8, 8), 10, seed=0))
    data = out["corrupt_npz"].read_bytes()
    out["corrupt_npz"].write_bytes(data[:len(data) // 2])
    out["run"].mkdir()
    (out["run"] / "summary.json").write_text('{"system": "hsadmm", "traffic": {')
    write_challenge_network(out["net"], graph_challenge_network(1024, 2, seed=0).weights)
    (out["net"] / "neuron1024" / "n1024-l2.tsv").write_text("")
    out["file"].write_text("not a directory")
    return out


#: (id, runner, argv with {placeholders}, message fragment)
CASES = [
    ("hsadmm lr inf", _guarded(hsadmm_main), ["train", "--lr", "inf"],
     "--lr must be > 0 (a finite number), got inf"),
    ("hsadmm batch", _guarded(hsadmm_main), ["train", "--batch-size", BIG],
     f"--batch-size {BIG} is {SHARD}"),
    ("hsadmm inter-bw", _guarded(hsadmm_main), ["train", "--inter-bw", "-5"],
     "--inter-bw must be > 0 Gbit/s (a finite number), got -5 Gbit/s"),
    ("hsadmm momentum", _guarded(hsadmm_main), ["train", "--momentum", "1"],
     "--momentum must be >= 0 and < 1 (a finite number), got 1"),
    *[(f"{m} batch", _guarded(dp_main), ["train", "--method", m, "--batch-size", BIG],
       f"--batch-size {BIG} is {SHARD}") for m in DP_METHODS],
    ("dp lr nan", _guarded(dp_main), ["train", "--lr", "nan"],
     "--lr must be > 0 (a finite number), got nan"),
    ("ddp corrupt init", _guarded(dp_main),
     ["train", "--method", "ddp", "--init", "{corrupt_npz}"],
     "--init {corrupt_npz} is not a readable .npz (BadZipFile"),
    ("ddp density", _guarded(dp_main), ["train", "--method", "ddp", "--density", "0.5"],
     "--method ddp does not use --density (used by --method"),
    ("pactrain corrupt init", _guarded(dp_main),
     ["train", "--method", "pactrain", "--init", "{corrupt_npz}"],
     "--init {corrupt_npz} is not a readable .npz (BadZipFile"),
    ("dp out is a file", _guarded(dp_main), ["train", "--out", "{file}"],
     "--out {file} is an existing file, not a directory"),
    ("models batch", _guarded(models_main), ["train", "--batch-size", BIG],
     f"--batch-size {BIG} is larger than the digits training set (1438 samples)"),
    ("models lr inf", _guarded(models_main), ["train", "--lr", "inf"],
     "--lr must be a finite number, got inf"),
    ("sparse lr nan", _sparse, ["train", "--lr", "nan"],
     "--lr must be > 0 (a finite number), got nan"),
    ("sparse lr -1", _sparse, ["train", "--lr", "-1"],
     "--lr must be > 0 (a finite number), got -1"),
    ("sparse threshold nan", _sparse, ["train", "--threshold", "nan"],
     "--threshold must be >= 0 and < 1 (a finite number), got nan"),
    ("sparse batch", _sparse, ["train", "--batch-size", BIG, "--layers", "2"],
     f"--batch-size {BIG} is larger than the digits training set (1438 images"),
    ("sparse empty layer", _sparse, ["train", "--layers", "2", "--network-dir", "{net}"],
     "n1024-l2.tsv: no entries (empty file)"),
    ("partition parts", _sparse, ["partition", "--parts", "5000", "--layers", "2"],
     "--parts 5000 is larger than the 1024 neurons of a layer"),
    ("partition empty layer", _sparse,
     ["partition", "--parts", "4", "--layers", "2", "--network-dir", "{net}"],
     "n1024-l2.tsv: no entries (empty file)"),
    ("partition layer file", _partition, ["layers", "{file}", "--parts", "2"],
     "unknown layer format"),
    ("report corrupt summary", _guarded(commvol_main), ["report", "{run}"],
     "{run}/summary.json is not valid JSON"),
]


@pytest.mark.parametrize("runner,argv,message", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_hostile_input_fails_with_one_clear_message(runner, argv, message, files, tmp_path,
                                                    capsys):
    fill = {k: str(v) for k, v in files.items()}
    argv = [a.format(**fill) for a in argv]
    out = tmp_path / "out"
    if "--out" not in argv and argv[0] == "train":
        argv += ["--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        runner(argv)
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    want = message.format(**fill)
    assert want in err and err.count(want) == 1, err
    assert "Traceback" not in err, err
    assert not out.exists()  # nothing written, not even the directory
    assert files["file"].read_text() == "not a directory"


def test_mtkahypar_errors_are_rephrased():
    mtkahypar = pytest.importorskip("mtkahypar")
    with pytest.raises(ValueError) as exc, partitioner_errors():
        raise mtkahypar.InvalidInputError("\x1b[1;91m[Invalid Input] \x1b[0m bad hyperedges")
    text = str(exc.value)
    assert "Mt-KaHyPar rejected" in text and "bad hyperedges" in text and "\x1b" not in text
    with pytest.raises(KeyError), partitioner_errors():  # other errors pass through
        raise KeyError("x")


# -- on 2 ranks: one message for every rank, nothing written ------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("module,args,message", [
    ("dataparallel", ["train", "--method", "ddp", "--density", "0.5"],
     "--method ddp does not use --density"),
    ("hsadmm", ["train", "--batch-size", BIG], f"--batch-size {BIG} is larger than"),
    ("sparse_sgd", ["train", "--threshold", "nan"], "--threshold must be >= 0 and < 1"),
], ids=["before start", "after start", "sparse_sgd"])
def test_every_rank_fails_with_one_message(module, args, message, tmp_path):
    assert_fails_on_every_rank(module, args, message, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.mpi
def test_finished_run_and_file_out_refused_on_every_rank(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    summary = {"system": "dataparallel", "metrics": {"final_test_accuracy": 0.9}}
    (run / "summary.json").write_text(json.dumps(summary))
    assert_fails_on_every_rank("dataparallel", ["train", "--steps", "1"],
                               f"--out {run} already holds a finished run (summary.json): pass "
                               "--overwrite to replace it, --resume to continue it", run)
    assert json.loads((run / "summary.json").read_text()) == summary
    target = tmp_path / "f"
    target.write_text("x")
    assert_fails_on_every_rank("hsadmm", ["train"], "is an existing file, not a directory",
                               target)
    assert target.read_text() == "x"

