"""Layer files of ``python -m partition layers`` that declare more than they hold, or more than
any layer or this machine can have: refused from their headers, in one line naming the file,
what it declares and the fix, before anything is allocated (checked in a process whose address
space is capped a little above what it uses), with the results already in ``--out`` untouched.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import numpy.lib.format as npy
import pytest
import scipy.io
import scipy.sparse as sp
from mpi_helpers import ROOT

from partition import cli
from partition.cli import read_layer

MM = "%%MatrixMarket matrix coordinate real general\n"
#: address space the checked process may take beyond what it holds after its imports
HEADROOM = 192 << 20
#: a compressed array of zeros within deflate's ratio that the headroom cannot take
BOMB_FLOATS = 1 << 26

CHILD = r"""
import contextlib, io, json, resource, sys
from partition.cli import main, read_layer

def address_space():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))

limit = address_space() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
out, reads, clis = sys.argv[2], {}, {}
for path in sys.argv[3:]:
    try:
        read_layer(path)
        reads[path] = "read"
    except ValueError as exc:
        reads[path] = "ValueError: " + str(exc)
    except MemoryError as exc:
        reads[path] = "MemoryError: " + str(exc)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["layers", path, path, "--parts", "32", "--out", out])
    clis[path] = [code, err.getvalue()]
print(json.dumps({"read": reads, "cli": clis}))
"""


def _array_bytes(a) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _header(shape, dtype) -> bytes:
    """An ``.npy`` header alone: what a forged member declares."""
    b = io.BytesIO()
    npy.write_array_header_1_0(b, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                   "shape": shape})
    return b.getvalue()


def _npz(path: Path, members: dict, method=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=method) as z:
        for name, data in members.items():
            z.writestr(name + ".npy", data)
    return path


def _csr_members(shape, data, indices, indptr) -> dict:
    return {"format": _array_bytes(np.array("csr")), "shape": _array_bytes(np.array(shape)),
            "data": data, "indices": indices, "indptr": indptr}


def _bomb(path: Path) -> Path:
    """A 8192 x 8192 layer whose ``data`` honestly holds ``BOMB_FLOATS`` zeros, deflated:
    within every declared bound, and more than the capped process can allocate."""
    small = _csr_members((8192, 8192), b"", _array_bytes(np.zeros(1, np.int32)),
                         _array_bytes(np.zeros(8193, np.int32)))
    del small["data"]
    _npz(path, small)
    chunk = np.zeros(1 << 20).tobytes()
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as z, \
            z.open("data.npy", "w", force_zip64=True) as f:
        f.write(_header((BOMB_FLOATS,), "<f8"))
        for _ in range(BOMB_FLOATS >> 20):
            f.write(chunk)
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict:
    """``{file: fragments of its one error line}``."""
    d = tmp_path_factory.mktemp("layer_sizes")
    one = _array_bytes(np.ones(1))
    idx = _array_bytes(np.zeros(1, np.int32))
    cases = {}
    # three lines: 10^7 x 10^7 with 10^13 entries (mmread would allocate for all of them)
    (d / "huge.mtx").write_text(MM + "10000000 10000000 10000000000000\n1 1 1.0\n")
    cases[d / "huge.mtx"] = [(f"{d / 'huge.mtx'}:3: the file ends after 1 of the "
                             "10000000000000 entries its size line (line 2) declares"),
                             "write the layer again (scipy.io.mmwrite(path, W))"]
    # an .npz whose 'data' header declares 10^13 weights in 16 bytes
    path = _npz(d / "forged.npz", _csr_members(
        (10 ** 7, 10 ** 7), _header((10 ** 13,), "<f8") + b"\0" * 16, idx,
        _array_bytes(np.array([0, 1], np.int32))))
    cases[path] = [(f"{path}: its array 'data' declares shape (10000000000000,) of float64 "
                   "(80000000000000 bytes), more than the"), "truncated or forged",
                   "write the layer again (scipy.sparse.save_npz(path, W))"]
    # the same, deflated: deflate holds at most 1032 times its bytes
    path = _npz(d / "forged_deflated.npz", _csr_members(
        (4, 4), _header((10 ** 12,), "<f8"), idx, _array_bytes(np.array([0, 1, 1, 1, 1]))),
        method=zipfile.ZIP_DEFLATED)
    cases[path] = [f"{path}: its array 'data' declares shape (1000000000000,)",
                   "truncated or forged", "scipy.sparse.save_npz(path, W)"]
    # a coo layer of 2^40 x 2^40 with one weight (tocsr would allocate 2^40 row pointers)
    path = _npz(d / "shape.npz", {
        "format": _array_bytes(np.array("coo")), "shape": _array_bytes(np.array([2 ** 40] * 2)),
        "data": one, "row": _array_bytes(np.zeros(1, np.int64)),
        "col": _array_bytes(np.zeros(1, np.int64))})
    cases[path] = [(f"{path}: its 'shape' declares a 1099511627776 x 1099511627776 layer, "
                   "more than the 16777216 neurons a side"), "scipy.sparse.save_npz(path, W)"]
    # more weights than the matrix has
    path = _npz(d / "weights.npz", _csr_members(
        (2, 2), _array_bytes(np.ones(5)), _array_bytes(np.zeros(5, np.int32)),
        _array_bytes(np.array([0, 5, 5], np.int32))))
    cases[path] = [f"{path}: its 'data' declares 5 weights, more than the 2 x 2 layer has",
                   "scipy.sparse.save_npz(path, W)"]
    # within every declared bound, beyond what the process may allocate: one line all the same
    path = _bomb(d / "bomb.npz")
    cases[path] = [f"{path}: reading the layer needs more memory than this process may have",
                   "partition on a machine with more memory"]
    return cases


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_hostile_layer_files_are_refused_before_allocating(hostile, tmp_path):
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "summary.json").write_text('{"system": "partition", "metrics": {}}\n')
    (out / "metrics.jsonl").write_text('{"unit": "step", "index": 1}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPARDIST_NP", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", CHILD, str(HEADROOM), str(out),
                          *map(str, hostile)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    for path, fragments in hostile.items():
        text = got["read"][str(path)]
        assert text.startswith(f"ValueError: {path}"), text
        assert "\n" not in text
        for f in fragments:
            assert f in text, text
        code, err = got["cli"][str(path)]
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("python -m partition: error: "), err
        assert text.removeprefix("ValueError: ") in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_layer_file_larger_than_the_machine_is_refused_unread(tmp_path, monkeypatch):
    """What a well-formed file declares is held against the machine's memory: a layer that
    cannot fit is refused before :func:`scipy.io.mmread` or :func:`scipy.sparse.load_npz`."""
    W = sp.random(40, 30, density=0.2, format="csr", random_state=0)
    sp.save_npz(tmp_path / "w.npz", W)
    scipy.io.mmwrite(tmp_path / "w.mtx", W)
    for path in (tmp_path / "w.npz", tmp_path / "w.mtx"):
        assert (read_layer(path) != W).nnz == 0
    monkeypatch.setattr(cli, "_machine_memory", lambda: 1024)

    def unread(path, *args, **kwargs):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(sp, "load_npz", unread)
    monkeypatch.setattr(scipy.io, "mmread", unread)
    with pytest.raises(ValueError) as exc:
        read_layer(tmp_path / "w.npz")
    assert str(exc.value).startswith(f"{tmp_path / 'w.npz'}: it declares arrays of ")
    assert "for a 40 x 30 layer" in str(exc.value)
    assert "more than this machine's 9.54e-07 GiB of memory" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        read_layer(tmp_path / "w.mtx")
    assert str(exc.value).startswith(
        f"{tmp_path / 'w.mtx'}: it declares {W.nnz} entries of a 40 x 30 layer (size line, "
        f"line 3): reading them takes at least ")
    assert "partition on a machine with more memory" in str(exc.value)
