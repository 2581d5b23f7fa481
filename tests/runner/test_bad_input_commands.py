"""Hostile inputs, each run as the real command in a subprocess: ``--arch`` shapes,
``--init`` files, corrupt input files (layers, IDX, CIFAR, TSV, checkpoints, compute profiles)
and resumes that would change the schedule.

Every case must exit non-zero with ONE error line naming the input and the fix, no traceback,
and leave the results already in ``--out`` as they were: a training command is pointed at a
folder holding an earlier finished run with ``--overwrite`` (files are replaced only when a run
finishes), a resume at the interrupted or finished run it would continue.  The cases fail
before any training (a few set-up runs of 4 steps make the checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp
from mpi_helpers import ROOT

from dataparallel.pactrain import save_init
from models import build_model
from sparse_sgd.io import write_challenge_network
from sparse_sgd.radixnet import graph_challenge_network

#: the flags of a cheap serial data-parallel run
DP = ["train", "--model", "mlp", "--arch", "hidden=16", "--progress-every", "0"]


def _run(module: str, args, cwd) -> subprocess.CompletedProcess:
    """``python -m module args`` serially (no launcher), in ``cwd``, importing this checkout
    (not whichever spardist the interpreter has installed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPARDIST_NP", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """The hostile files and the runs the resume cases continue."""
    d = tmp_path_factory.mktemp("hostile27")
    f: dict = {"dir": d}
    # --init: a good CNN file, then damaged variants
    cnn = build_model("cnn", (1, 8, 8), 10, seed=0)
    save_init(d / "good.npz", cnn)
    good = dict(np.load(d / "good.npz"))
    np.save(d / "init.npy", good["params"])
    nan = good["params"].copy()
    nan[7] = np.nan
    np.savez(d / "nan.npz", params=nan)
    np.savez(d / "short.npz", params=good["params"][:100])
    np.savez(d / "weights.npz", weights=good["params"])
    (d / "text.npz").write_text("params = 1 2 3\n")
    resnet = build_model("resnet", (1, 8, 8), 10, seed=0)
    save_init(d / "resnet.npz", resnet)
    rn = dict(np.load(d / "resnet.npz"))
    np.savez(d / "resnet_nobuf.npz", params=rn["params"])
    (d / "init_dir").mkdir()
    # layer files
    W = sp.random(16, 16, density=0.3, format="csr", random_state=0)
    sp.save_npz(d / "layer.npz", W)
    raw = (d / "layer.npz").read_bytes()
    (d / "trunc.npz").write_bytes(raw[:len(raw) // 2])
    (d / "garbage.npz").write_bytes(b"not a zip archive " * 8)
    np.savez(d / "dense.npz", a=np.ones(3))
    scipy.io.mmwrite(d / "layer.mtx", W)
    lines = (d / "layer.mtx").read_text().splitlines()
    (d / "cut.mtx").write_text("\n".join(lines[:-5]) + "\n")
    lines[5] = "3 x 0.5"
    (d / "badline.mtx").write_text("\n".join(lines) + "\n")
    (d / "nan.mtx").write_text("%%MatrixMarket matrix coordinate real general\n2 2 1\n1 1 nan\n")
    # dataset files: MNIST with a labels file of another kind, CIFAR-10 batches of garbage
    mnist = d / "mnist"
    mnist.mkdir()
    for name, magic, shape in (("train-images-idx3-ubyte", 2051, (4, 28, 28)),
                               ("train-labels-idx1-ubyte", 2049, (4,)),
                               ("t10k-images-idx3-ubyte", 2051, (4, 28, 28)),
                               ("t10k-labels-idx1-ubyte", 2051, (4, 28, 28))):
        head = struct.pack(">I", magic) + b"".join(struct.pack(">I", n) for n in shape)
        (mnist / name).write_bytes(head + bytes(int(np.prod(shape))))
    cifar = d / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (cifar / name).write_bytes(b"\x80\x04garbage" * 10)
    # a Graph Challenge network with a malformed line
    write_challenge_network(d / "net", graph_challenge_network(1024, 2, seed=0).weights)
    tsv = d / "net" / "neuron1024" / "n1024-l2.tsv"
    rows = tsv.read_text().splitlines()
    rows[3] = "12\tabc\t0.0625"
    tsv.write_text("\n".join(rows) + "\n")
    # compute profiles: not JSON, not a profile, a NaN cost
    (d / "prof_text.json").write_text('{"format": ')
    (d / "prof_other.json").write_text(json.dumps({"format": "something else"}))
    (d / "prof_nan.json").write_text(json.dumps(
        {"format": "spardist-compute-profile", "version": 2,
         "ranks": [{"forward+backward": [{"min_s": float("nan"), "count": 1}]}]}))
    # an earlier finished run the failing commands must leave alone
    earlier = d / "earlier"
    earlier.mkdir()
    (earlier / "summary.json").write_text('{"system": "earlier", "metrics": {}}\n')
    (earlier / "metrics.jsonl").write_text('{"unit": "step", "index": 1}\n')
    f["earlier"] = earlier
    # checkpointed runs: cosine with warm-up, and step, 4 steps, a checkpoint every 2
    for name, sched in (("cosine", ["--lr-schedule", "cosine", "--warmup", "0.25"]),
                        ("step", ["--lr-schedule", "step"])):
        res = _run("dataparallel", [*DP, *sched, "--steps", "4", "--checkpoint-every", "2",
                                    "--out", d / name], d)
        assert res.returncode == 0, res.stderr
        # an interrupted copy: only the checkpoints of step 2
        mid = d / f"{name}_mid" / "checkpoints"
        mid.mkdir(parents=True)
        for p in (d / name / "checkpoints").glob("ckpt-r*-s00000002.npz"):
            shutil.copy(p, mid / p.name)
    garbage = d / "ck_garbage" / "checkpoints"
    garbage.mkdir(parents=True)
    for p in (d / "cosine" / "checkpoints").glob("*.npz"):
        (garbage / p.name).write_bytes(b"garbage\n")
    foreign = d / "ck_foreign" / "checkpoints"
    foreign.mkdir(parents=True)
    shutil.copy(d / "good.npz", foreign / "ckpt-r0-s00000002.npz")
    return f


#: class -> (id, module, argv with {placeholders} for the inputs' files, the --out to keep,
#: fragments of the one error line: the input and the fix)
EARLIER = "{dir}/earlier"
CASES = {
    "arch": [
        ("vit dim=abc", "models", ["train", "--model", "vit", "--arch", "dim=abc"], EARLIER,
         ["--arch dim=abc", "whole number from 1 to 65536", "e.g. --arch dim=32"]),
        ("vit mlp_ratio=0", "models", ["train", "--model", "vit", "--arch", "mlp_ratio=0"],
         EARLIER, ["--arch mlp_ratio=0", "> 0 and <= 64", "e.g. --arch mlp_ratio=1.5"]),
        ("vit context on digits", "models", ["train", "--model", "vit", "--arch",
                                             "context=16"],
         EARLIER, ["--arch context=16", "read by --dataset text", "e.g. --arch patch=2"]),
        ("vit on text", "models", ["train", "--model", "vit", "--dataset", "text"], EARLIER,
         ["--model vit reads images", "--dataset text", "use --dataset"]),
        ("gpt depth=1.5", "models", ["train", "--model", "gpt", "--dataset", "text", "--arch",
                                     "depth=1.5"],
         EARLIER, ["--arch depth=1.5", "whole number", "e.g. --arch depth=2"]),
        ("dp vit heads=3", "dataparallel", ["train", "--model", "vit", "--arch", "heads=3"],
         EARLIER, ["--arch heads=3", "must divide the width dim=64", "e.g. --arch heads=2"]),
        ("dp cnn unknown key", "dataparallel", ["train", "--arch", "foo=1"], EARLIER,
         ["--arch foo=1", "--model cnn has no key 'foo'", "e.g. --arch channels=16,32"]),
        ("dp resnet stages", "dataparallel", ["train", "--model", "resnet", "--arch",
                                              "depths=2,2"],
         EARLIER, ["--arch depths=2,2", "planes=16,32,64", "e.g. --arch depths=2,2,2"]),
    ],
    "init": [
        ("npy", "dataparallel", [*DP, "--init", "{dir}/init.npy"], EARLIER,
         ["--init {dir}/init.npy is a single .npy array", "numpy.savez(path, params=vector)"]),
        ("nan", "dataparallel", ["train", "--init", "{dir}/nan.npz"], EARLIER,
         ["--init {dir}/nan.npz: 'params' holds 1 non-finite value(s)", "save_init"]),
        ("other model", "dataparallel", [*DP, "--init", "{dir}/good.npz"], EARLIER,
         ["--init {dir}/good.npz: 'params' has shape (38282,)", "same --model, --arch"]),
        ("short", "dataparallel", ["train", "--method", "pactrain", "--init",
                                   "{dir}/short.npz"],
         EARLIER, ["--init {dir}/short.npz: 'params' has shape (100,)", "save_init"]),
        ("no params", "dataparallel", ["train", "--init", "{dir}/weights.npz"], EARLIER,
         ["--init {dir}/weights.npz: no 'params' array", "the file holds weights",
          "save_init"]),
        ("text file", "dataparallel", ["train", "--init", "{dir}/text.npz"], EARLIER,
         ["--init {dir}/text.npz is not an .npz archive", "save_init"]),
        ("directory", "dataparallel", ["train", "--init", "{dir}/init_dir"], EARLIER,
         ["--init {dir}/init_dir is a directory", "save_init"]),
        ("missing buffers", "dataparallel", ["train", "--model", "resnet", "--init",
                                             "{dir}/resnet_nobuf.npz"],
         EARLIER, ["--init {dir}/resnet_nobuf.npz: no 'buffer:", "save_init"]),
    ],
    "files": [
        ("truncated npz layer", "partition", ["layers", "{dir}/trunc.npz", "--parts", "2"],
         EARLIER, ["{dir}/trunc.npz: cannot read the layer (BadZipFile",
                   "scipy.sparse.save_npz"]),
        ("garbage npz layer", "partition", ["layers", "{dir}/garbage.npz", "--parts", "2"],
         EARLIER, ["{dir}/garbage.npz: cannot read the layer (not a zip archive",
                   "scipy.sparse.save_npz"]),
        ("dense npz layer", "partition", ["layers", "{dir}/dense.npz", "--parts", "2"],
         EARLIER, ["{dir}/dense.npz: cannot read the layer (no sparse matrix inside",
                   "scipy.sparse.save_npz"]),
        ("mtx bad line", "partition", ["layers", "{dir}/badline.mtx", "--parts", "2"], EARLIER,
         ["{dir}/badline.mtx:6: cannot read the layer (Invalid integer value",
          "scipy.io.mmwrite"]),
        ("mtx truncated", "partition", ["layers", "{dir}/cut.mtx", "--parts", "2"], EARLIER,
         [("{dir}/cut.mtx:75: the file ends after 72 of the 77 entries its size line (line 3) "
           "declares: it is truncated"), "scipy.io.mmwrite"]),
        ("mtx nan", "partition", ["layers", "{dir}/nan.mtx", "--parts", "2"], EARLIER,
         ["{dir}/nan.mtx: 1 non-finite weight(s)", "real finite weights"]),
        ("idx magic", "models", ["train", "--dataset", "mnist", "--data-dir", "{dir}/mnist"],
         EARLIER, ["{dir}/mnist/t10k-labels-idx1-ubyte: expected magic 2049 for labels",
                   "re-download it"]),
        ("cifar garbage", "dataparallel", ["train", "--dataset", "cifar10", "--data-dir",
                                           "{dir}/cifar"],
         EARLIER, ["{dir}/cifar/cifar-10-batches-py/data_batch_1: not a readable CIFAR-10",
                   "expected a complete pickle"]),
        ("missing mnist dir", "models", ["train", "--dataset", "mnist", "--data-dir",
                                         "{dir}/nowhere"],
         EARLIER, ["{dir}/nowhere: MNIST directory does not exist", "put train-images"]),
        ("tsv malformed line", "sparse_sgd", ["train", "--layers", "2", "--network-dir",
                                              "{dir}/net"],
         EARLIER, ["{dir}/net/neuron1024/n1024-l2.tsv:4: malformed line",
                   "format: row col value"]),
        ("garbage checkpoints", "dataparallel", [*DP, "--steps", "4", "--checkpoint-every",
                                                 "2", "--resume"],
         "{dir}/ck_garbage", ["ckpt-r0-s00000002.npz (not an .npz archive",
                              "restore the files or start afresh with --overwrite"]),
        ("foreign checkpoint", "dataparallel", [*DP, "--steps", "4", "--checkpoint-every", "2",
                                                "--resume"],
         "{dir}/ck_foreign", ["ckpt-r0-s00000002.npz is not a checkpoint of a spardist run",
                              "start afresh with --overwrite"]),
        ("profile not json", "dataparallel", [*DP, "--compute-source", "profile",
                                              "--compute-profile", "{dir}/prof_text.json"],
         EARLIER, ["--compute-profile {dir}/prof_text.json: is not valid JSON",
                   "--compute-profile-out"]),
        ("profile of another format", "dataparallel", [
            *DP, "--compute-source", "profile", "--compute-profile", "{dir}/prof_other.json"],
         EARLIER, ["--compute-profile {dir}/prof_other.json: is not a compute profile",
                   "--compute-profile-out"]),
        ("profile nan", "dataparallel", [*DP, "--compute-source", "profile",
                                         "--compute-profile", "{dir}/prof_nan.json"],
         EARLIER, ["--compute-profile {dir}/prof_nan.json: ranks[0]",
                   "['forward+backward'][0] must hold a finite", "--compute-profile-out"]),
    ],
    "resume-schedule": [
        ("cosine longer, interrupted", "dataparallel", [
            *DP, "--lr-schedule", "cosine", "--warmup", "0.25", "--steps", "8",
            "--checkpoint-every", "2", "--resume"],
         "{dir}/cosine_mid", ["--resume: --steps 8 would change the schedule",
                              "total_steps 4 -> 8, warmup_steps 1 -> 2",
                              "--lr-schedule cosine decays", "resume with --steps 4"]),
        ("cosine longer, finished", "dataparallel", [
            *DP, "--lr-schedule", "cosine", "--warmup", "0.25", "--steps", "6",
            "--checkpoint-every", "2", "--resume"],
         "{dir}/cosine", ["--resume: --steps 6 would change the schedule", "total_steps 4 -> 6",
                          "train further in a new run"]),
        ("cosine by --epochs", "dataparallel", [
            *DP, "--lr-schedule", "cosine", "--warmup", "0.25", "--epochs", "1",
            "--checkpoint-every", "2", "--resume"],
         "{dir}/cosine_mid", ["--resume: --epochs 1 (45 steps) would change the schedule",
                              "total_steps 4 -> 45",
                              "resume with --steps 4 (instead of --epochs)"]),
        ("warm-up only", "dataparallel", [
            *DP, "--lr-schedule", "cosine", "--warmup", "0.25", "--steps", "5",
            "--checkpoint-every", "2", "--resume"],
         "{dir}/cosine_mid", ["total_steps 4 -> 5", "--warmup is a fraction of them"]),
        ("step schedule longer", "dataparallel", [
            *DP, "--lr-schedule", "step", "--steps", "9", "--checkpoint-every", "2",
            "--resume"],
         "{dir}/step_mid", ["--resume: --steps 9 would change the schedule",
                            "step_size 1 -> 3", "--lr-schedule step divides",
                            "resume with --steps 4"]),
        ("step schedule, finished", "dataparallel", [
            *DP, "--lr-schedule", "step", "--steps", "12", "--checkpoint-every", "2",
            "--resume"],
         "{dir}/step", ["step_size 1 -> 4", "train further in a new run"]),
    ],
}
TABLE = [(cls, *case) for cls, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("cls,name,module,argv,out,fragments", TABLE,
                         ids=[f"{c[0]}: {c[1]}" for c in TABLE])
def test_hostile_input_is_refused_in_one_line(inputs, cls, name, module, argv, out, fragments):
    fill = {"dir": inputs["dir"]}
    out = Path(out.format(**fill))
    argv = [a.format(**fill) for a in argv]
    argv += ["--out", str(out)] + ([] if "--resume" in argv else ["--overwrite"])
    before = _snapshot(out)
    res = _run(module, argv, inputs["dir"])
    err = res.stderr
    assert res.returncode != 0, err
    errors = [x for x in err.splitlines() if x.startswith(("spardist: error on ",
                                                            "python -m partition: error: "))]
    assert len(errors) == 1, err
    for f in fragments:
        assert f.format(**fill) in errors[0], err
    assert "Traceback" not in err, err
    assert _snapshot(out) == before       # earlier results untouched, nothing added


def test_table_has_five_cases_per_class():
    assert all(len(cases) >= 5 for cases in CASES.values())


def test_constant_schedule_may_be_extended(inputs, tmp_path):
    """The refusal is about the schedule, not the total: a constant learning rate resumes into
    a longer run."""
    out = tmp_path / "const"
    assert _run("dataparallel", [*DP, "--steps", "2", "--checkpoint-every", "2", "--out", out],
                tmp_path).returncode == 0
    res = _run("dataparallel", [*DP, "--steps", "4", "--checkpoint-every", "2", "--out", out,
                                "--resume"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "summary.json").read_text())["metrics"]["steps"] == 4
