"""``python -m partition layers W1 W2 ... --parts P [--method hypergraph|random|both]``.

Partitions the rows of a sparse network given layer by layer as SciPy sparse ``.npz`` files
(:func:`scipy.sparse.save_npz`) or Matrix Market ``.mtx`` files, in the paper's orientation
(W^k: rows = neurons of layer k, columns = neurons of layer k-1), and prints the Table-1
metrics (SpFF words and messages per processor per layer, imbalance; SpFF + SpBP words beside
them).  Writes ``OUT/partition.npz`` (the hypergraph partition with ``--method both``) and
``OUT/summary.json``.  RadiX-Net / Graph Challenge networks: ``python -m sparse_sgd partition``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sp

from partition.hmetis import save_partition as save_hmetis
from partition.metrics import format_table, partition_metrics
from partition.partitioners import (
    PartitionOptions,
    cpu_seconds,
    hypergraph_partition,
    partitioner_errors,
    random_partition,
)
from runner.options import add_common_args
from runner.run import start_run
from substrate.options import add_dataclass_args, from_args, option
from substrate.results import RunWriter

__all__ = ["LayersConfig", "build_parser", "main", "read_layer"]


@dataclass(frozen=True)
class LayersConfig(PartitionOptions):
    """Options of ``python -m partition layers`` (the partitioner's own:
    :class:`~partition.partitioners.PartitionOptions`)."""

    parts: int = option(2, "processors P")
    method: str = option("both", "partitions to compute", choices=("hypergraph", "random",
                                                                     "both"))
    hmetis: bool = option(False, "also write OUT/hmetis/: every phase's hypergraph as hMetis "
                          ".hgr/.fix and the saved partition as .part.P files")

    def __post_init__(self):
        if self.parts < 1:
            raise ValueError(f"--parts must be >= 1, got {self.parts}")
        super().__post_init__()


#: what a layer file may be (every refusal of one says it)
LAYER_FORMATS = ("a SciPy sparse .npz (scipy.sparse.save_npz(path, W)) or a Matrix Market .mtx "
                 "(scipy.io.mmwrite(path, W)), rows = neurons of the layer, real finite weights")
#: scipy.io.mmread's messages start with the line they are about
_MM_LINE = re.compile(r"^Line (\d+): (.*)$", re.DOTALL)
#: the most neurons a layer may have a side: 256 times the largest Graph Challenge network's
#: 65,536 (a Matrix Market size line beyond it is refused before anything is allocated)
MAX_LAYER_NEURONS = 1 << 24
#: the fewest bytes one value line of a Matrix Market file takes ("1 1\n", "1\n")
_MM_MIN_LINE = {"coordinate": 4, "array": 2}
#: the fewest bytes :func:`scipy.io.mmread` holds per value: row and column (int64) and the
#: weight (float64) of an entry, the weight of a dense value
_MM_VALUE_BYTES = {"coordinate": 24, "array": 8}
#: how many times its stored size a member of a zip archive may hold: deflate's limit (1032:1)
#: for a compressed member, the stored bytes themselves for an uncompressed one
_ZIP_RATIO = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: 1032}
#: what ``shape.npy`` and ``format.npy`` of :func:`scipy.sparse.save_npz` hold at most
_NPZ_SMALL_BYTES = 1 << 10


def read_layer(path) -> sp.csr_matrix:
    """W^k from a SciPy ``.npz`` or Matrix Market ``.mtx`` file.

    Raises
    ------
    ValueError
        One line naming the file (and the line of a Matrix Market file where the reader says
        which) and :data:`LAYER_FORMATS`: missing, a directory, another format, truncated or
        garbage, no sparse matrix inside, complex or non-finite weights; a Matrix Market size
        line or ``.npz`` arrays no layer can have (:func:`_check_mm_header`,
        :func:`_check_npz_header`), before anything is allocated.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a layer file; give {LAYER_FORMATS}")
    if not path.is_file():
        raise ValueError(f"{path}: layer file not found")
    if path.suffix not in (".npz", ".mtx", ".mm"):
        raise ValueError(f"{path}: unknown layer format {path.suffix!r}; give {LAYER_FORMATS}")
    header = _check_npz_header(path) if path.suffix == ".npz" else _check_mm_header(path)
    try:
        W = _load_npz(path) if path.suffix == ".npz" else scipy.io.mmread(path)
    except MemoryError as exc:   # what no declared size gave away: one line all the same
        raise ValueError(f"{path}: reading the layer needs more memory than this process may "
                         f"have ({exc}); partition on a machine with more memory, or give "
                         f"{LAYER_FORMATS}") from None
    except (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, OverflowError,
            zipfile.BadZipFile, zlib.error) as exc:
        if header is not None and "truncated" in str(exc).lower():
            raise ValueError(_mm_truncated(path, *header)) from None
        text = str(exc).strip().rstrip(".")
        line = _MM_LINE.match(text)
        where = f"{path}:{line.group(1)}" if line else str(path)
        why = line.group(2) if line else text if isinstance(exc, ValueError) else \
            f"{type(exc).__name__}: {text}"
        raise ValueError(f"{where}: cannot read the layer ({why}); give {LAYER_FORMATS}"
                         ) from None
    W = sp.csr_matrix(W)
    if W.dtype.kind not in "fiub":
        raise ValueError(f"{path}: the layer holds {W.dtype} weights; give {LAYER_FORMATS}")
    bad = ~np.isfinite(W.data) if W.dtype.kind == "f" else np.zeros(0, bool)
    if bad.any():
        r = int(np.searchsorted(W.indptr, int(np.flatnonzero(bad)[0]), side="right")) - 1
        raise ValueError(f"{path}: {int(bad.sum())} non-finite weight(s) (NaN or Inf; the first "
                         f"in row {r}); give {LAYER_FORMATS}")
    W.sort_indices()
    return W


def _check_mm_header(path: Path) -> tuple[int, int, str] | None:
    """Refuse a Matrix Market size line no network layer can have, before :func:`scipy.io.mmread`
    allocates what it declares: more than :data:`MAX_LAYER_NEURONS` rows or columns, more entries
    than the matrix has, or more than the rest of the file can hold (truncated).

    Returns ``(size line number, values declared, format)`` for :func:`_mm_truncated`, or
    ``None`` when the file does not start like a Matrix Market file (``mmread`` then says what
    is wrong).
    """
    with open(path, "rb") as f:
        banner = f.readline().split()
        if not banner or banner[0].lower() != b"%%matrixmarket" or len(banner) < 3:
            return None
        fmt = banner[2].decode("ascii", "replace").lower()
        line, size = 1, None
        while size is None:
            raw = f.readline()
            if not raw:
                return None
            line += 1
            if raw.strip() and not raw.lstrip().startswith(b"%"):
                size = raw.split()
        rest = os.fstat(f.fileno()).st_size - f.tell()
    try:
        dims = [int(t) for t in size]
    except ValueError:
        return None
    if fmt not in _MM_MIN_LINE or len(dims) != (3 if fmt == "coordinate" else 2):
        return None
    rows, cols = dims[:2]
    if max(rows, cols) > MAX_LAYER_NEURONS:
        raise ValueError(f"{path}:{line}: the size line declares a {rows} x {cols} layer, more "
                         f"than the {MAX_LAYER_NEURONS} neurons a side a layer may have: correct "
                         "the size line (rows columns entries) or write the layer again "
                         "(scipy.io.mmwrite(path, W))")
    values = dims[2] if fmt == "coordinate" else rows * cols
    if fmt == "coordinate" and values > rows * cols:
        raise ValueError(f"{path}:{line}: the size line declares {values} entries, more than the "
                         f"{rows} x {cols} layer has: correct the size line (rows columns "
                         "entries) or write the layer again (scipy.io.mmwrite(path, W))")
    if values * _MM_MIN_LINE[fmt] > rest:
        raise ValueError(_mm_truncated(path, line, values, fmt))
    what = "entries" if fmt == "coordinate" else "values"
    _check_memory(path, values * _MM_VALUE_BYTES[fmt], f"{values} {what} of a {rows} x {cols} "
                  f"layer (size line, line {line})")
    return line, values, fmt


def _mm_truncated(path: Path, size_line: int, declared: int, fmt: str) -> str:
    """The message of a Matrix Market file with fewer values than its size line declares: the
    line it ends at and how many values it holds (counted line by line, nothing kept)."""
    found, last = 0, size_line
    with open(path, "rb") as f:
        for last, raw in enumerate(f, start=1):
            if last > size_line and raw.strip() and not raw.lstrip().startswith(b"%"):
                found += 1
    what = "entries" if fmt == "coordinate" else "values"
    return (f"{path}:{last}: the file ends after {found} of the {declared} {what} its size "
            f"line (line {size_line}) declares: it is truncated; write the layer again "
            "(scipy.io.mmwrite(path, W))")


def _gib(nbytes: int) -> str:
    """``nbytes`` in GiB (TiB from 1024 GiB), for messages."""
    gib = nbytes / (1 << 30)
    return f"{gib:.3g} GiB" if gib < 1024 else f"{gib / 1024:.3g} TiB"


def _machine_memory() -> int | None:
    """The machine's physical memory in bytes, or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(path: Path, nbytes: int, what: str) -> None:
    """Refuse a layer file whose declared contents (``what``) need ``nbytes`` bytes to read,
    more than the machine has, before anything is allocated."""
    have = _machine_memory()
    if have is not None and nbytes > have:
        raise ValueError(f"{path}: it declares {what}: reading them takes at least "
                         f"{_gib(nbytes)}, more than this machine's {_gib(have)} of memory; "
                         f"correct or write the layer again, or partition on a machine with "
                         f"more memory")


def _npz_members(path: Path) -> dict | None:
    """``{name: (shape, dtype, declared bytes, stored bytes, compression)}`` of the ``.npy``
    members of an ``.npz``, read from the zip directory and the array headers alone; ``None``
    when the file is not a readable zip of ``.npy`` arrays (:func:`_load_npz` then says what is
    wrong)."""
    fmt = np.lib.format
    readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0,
               (3, 0): fmt.read_array_header_2_0}    # 3.0: 2.0 with UTF-8 field names
    members = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with z.open(info) as f:
                    version = fmt.read_magic(f)
                    if version not in readers:
                        return None
                    shape, _, dtype = readers[version](f)
                n = int(np.prod(shape, dtype=object)) * dtype.itemsize
                members[info.filename[:-4]] = (shape, dtype, n, info.compress_size,
                                               info.compress_type)
    except (OSError, EOFError, ValueError, TypeError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, RuntimeError):
        return None
    return members


def _check_npz_header(path: Path) -> None:
    """Refuse an ``.npz`` whose arrays no network layer can have, before
    :func:`scipy.sparse.load_npz` allocates what their headers declare: an array larger than its
    stored bytes can hold (truncated or forged), more than :data:`MAX_LAYER_NEURONS` rows or
    columns, more weights than the matrix has, or more bytes than the machine's memory.  A file
    that is not a readable zip of arrays is left to :func:`_load_npz`."""
    members = _npz_members(path)
    if members is None:
        return
    again = "write the layer again (scipy.sparse.save_npz(path, W))"
    for name, (shape, dtype, n, stored, method) in members.items():
        if method not in _ZIP_RATIO:
            raise ValueError(f"{path}: its array {name!r} is compressed with zip method "
                             f"{method}, which numpy.savez never writes; {again}")
        if n > stored * _ZIP_RATIO[method]:
            raise ValueError(f"{path}: its array {name!r} declares shape {tuple(shape)} of "
                             f"{dtype} ({n} bytes), more than the {stored} bytes stored for it "
                             f"can hold: the file is truncated or forged; {again}")
    small = [k for k in ("format", "shape") if k in members]
    if any(members[k][2] > _NPZ_SMALL_BYTES for k in small):
        big = next(k for k in small if members[k][2] > _NPZ_SMALL_BYTES)
        raise ValueError(f"{path}: its {big!r} array declares {members[big][2]} bytes, not the "
                         f"few that scipy.sparse.save_npz writes; {again}")
    try:
        with np.load(path, allow_pickle=False) as z:
            shape = [int(v) for v in z["shape"]] if "shape" in members else None
            kind = str(z["format"][()]) if "format" in members else None
    except (OSError, EOFError, ValueError, TypeError, KeyError, zipfile.BadZipFile, zlib.error):
        return
    if shape is None or len(shape) != 2:
        return                                   # load_npz says what is wrong
    rows, cols = shape
    if max(rows, cols) > MAX_LAYER_NEURONS:
        raise ValueError(f"{path}: its 'shape' declares a {rows} x {cols} layer, more than the "
                         f"{MAX_LAYER_NEURONS} neurons a side a layer may have: {again}")
    data = members.get("data")
    if data is not None and kind != "dia":       # dia stores its diagonals padded
        weights = int(np.prod(data[0], dtype=object))
        if weights > rows * cols:
            raise ValueError(f"{path}: its 'data' declares {weights} weights, more than the "
                             f"{rows} x {cols} layer has: {again}")
    total = sum(m[2] for m in members.values())
    _check_memory(path, total, f"arrays of {total} bytes for a {rows} x {cols} layer")


def _load_npz(path: Path):
    """``scipy.sparse.load_npz``, with the ways an ``.npz`` can be wrong said in words."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head.startswith(b"PK"):
        raise ValueError("not a zip archive: an .npz starts like a zip file; the file is "
                         "garbage or of another format")
    try:
        return sp.load_npz(path)
    except ValueError as exc:
        if "does not contain a sparse" not in str(exc):
            raise
        with np.load(path, allow_pickle=False) as z:
            names = ", ".join(z.files) or "nothing"
        raise ValueError(f"no sparse matrix inside (it holds {names})") from None


def _check_layers(paths, weights, parts: int) -> None:
    for k in range(1, len(weights)):
        if weights[k].shape[1] != weights[k - 1].shape[0]:
            raise ValueError(f"{paths[k]}: W^{k + 1} has {weights[k].shape[1]} columns but "
                             f"{paths[k - 1]} has {weights[k - 1].shape[0]} rows; give the "
                             "layers in order, rows = outputs")
    for path, W in zip(paths, weights):
        if W.nnz == 0:
            raise ValueError(f"{path}: the layer has no nonzero; every layer needs weights")
        if parts > W.shape[0]:
            raise ValueError(f"--parts {parts} is larger than the {W.shape[0]} rows of {path}: "
                             f"every part needs at least one row")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partition",
                                     description="H-SGD hypergraph / random row partitions")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("layers", help="partition a network given as one sparse matrix per layer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("files", nargs="+", metavar="LAYER", help="W^1 .. W^L (.npz or .mtx)")
    add_dataclass_args(r, LayersConfig, "partition")
    add_common_args(r)
    return parser


def _layers(args) -> dict:
    if args.device != "cpu":
        raise ValueError("partitioning runs on the CPU; use --device cpu")
    cfg = from_args(LayersConfig, args)
    # the layer files are read before the run starts: a bad one leaves --out as it was
    weights = [read_layer(p) for p in args.files]
    _check_layers(args.files, weights, cfg.parts)
    run = start_run(args, system="partition", method=cfg.method, config=cfg, unit="step")
    rows, saved = [], None
    if cfg.method in ("hypergraph", "both"):
        t0, w0 = cpu_seconds(), time.perf_counter()
        with partitioner_errors():
            h = hypergraph_partition(weights, cfg.parts, cfg.hypergraph_config(
                args.seed, cores=run.threads["threads"]))
        wall = time.perf_counter() - w0
        rows.append(("H (hypergraph)", partition_metrics(weights, h)))
        saved = h
        print(f"hypergraph partitioning: {wall:.2f} s wall, "
              f"{cpu_seconds() - t0:.2f} s CPU ({len(weights)} layers, P={cfg.parts}, "
              f"{h.info['engine']} preset {h.info['preset']}, {h.info['phases']} phases, period "
              f"{h.info['period'] or '-'}{' relabelled' if h.info.get('relabelled') else ''})")
    if cfg.method in ("random", "both"):
        rnd = random_partition(weights, cfg.parts, seed=args.seed)
        rows.append(("R (random)", partition_metrics(weights, rnd)))
        saved = saved or rnd
    print(f"P={cfg.parts} L={len(weights)}: per processor per layer, SpFF words and messages "
          "of one input vector; ff+bp avg: SpFF + SpBP words")
    print(format_table(rows))
    path = Path(run.out) / "partition.npz"
    if run.rank == 0:
        saved.save(path)
        print(f"saved the {saved.method} partition to {path}")
        if cfg.hmetis:
            save_hmetis(weights, saved, Path(run.out) / "hmetis")
            print(f"wrote its hMetis files to {Path(run.out) / 'hmetis'}")
    return run.finish(metrics={"table1": {label: m.table1() for label, m in rows},
                               "spff_spbp": {label: m.table1_spff_spbp() for label, m in rows},
                               "partition_file": str(path),
                               "partition_seconds": saved.seconds,
                               "total_volume_layers": [int(v) for v in np.asarray(
                                   rows[0][1].spff_volume.sum(axis=1))]})


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _layers(args)
    except ValueError as exc:
        RunWriter.abandon_open()   # a run that fails leaves no in-progress files behind
        print(f"python -m partition: error: {exc}", file=sys.stderr)
        return 2
    return 0
