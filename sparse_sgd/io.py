"""Sparse DNN Graph Challenge file formats.

* layer files ``n{N}-l{k}.tsv``: ``row<TAB>col<TAB>value`` triples, 1-based, of the challenge's
  weight matrix, which multiplies row vectors (``Y W``): row = input neuron, column = output
  neuron.  spardist keeps the paper's orientation (``z = W x``, rows = outputs), so layer files
  hold the *transpose* of :mod:`sparse_sgd.radixnet`'s ``W^k``; :func:`read_challenge_layer` and
  :func:`write_challenge_layer` convert.
* input files (``sparse-images-{N}.tsv``): ``image<TAB>feature<TAB>value``, 1-based.
* category files: one 1-based image index per line (images with any nonzero output).

Folder layout (the challenge's downloads, written by ``python -m sparse_sgd generate``)::

    DIR/neuron{N}/n{N}-l{k}.tsv          layers k = 1..L
    DIR/sparse-images-{N}.tsv            inputs
    DIR/neuron{N}-l{L}-categories.tsv    truth categories

:func:`network_folder` accepts ``DIR`` or ``DIR/neuron{N}``.  Parsing streams the file in
chunks of lines and accepts any whitespace between fields.  A last line without a newline is read
like any other (POSIX-tolerant, as the challenge's reference reader); a file cut inside a line
leaves a malformed last line, which is refused with a hint.  Malformed lines, indices above the
neuron count, an empty file and repeated (row, col) entries raise ``ValueError`` naming the file
and the line (repeated entries are added instead with ``sum_duplicates=True``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp

__all__ = [
    "categories_path",
    "images_path",
    "layer_path",
    "network_folder",
    "read_categories",
    "read_challenge_layer",
    "read_challenge_network",
    "read_input_tsv",
    "read_triples",
    "write_categories",
    "write_challenge_layer",
    "write_challenge_network",
    "write_input_tsv",
    "write_triples",
]

CHUNK_LINES = 1 << 18


def _bad_line(line: str) -> str | None:
    """Why one line is not a triple (None if it is one)."""
    fields = line.split()
    if len(fields) != 3:
        return f"expected 3 whitespace-separated fields, found {len(fields)}"
    try:
        r, c, v = int(fields[0]), int(fields[1]), float(fields[2])
    except ValueError:
        return "row and column must be integers and value a number"
    if r < 1 or c < 1:
        return "row and column indices are 1-based (must be >= 1)"
    if not np.isfinite(v):
        return "value must be finite"
    return None


def _parse_chunk(lines: list[str], linenos: np.ndarray, path: str):
    """Parse ``lines`` of triples (any whitespace between fields); name the first bad line."""
    n = len(lines)
    try:
        vals = np.array(" ".join(lines).split(), dtype=np.float64)
        if vals.size != 3 * n or any(len(line.split()) != 3 for line in lines):
            raise ValueError
        vals = vals.reshape(n, 3)
        rc = vals[:, :2]
        if np.any(rc < 1) or np.any(rc != np.floor(rc)) or not np.all(np.isfinite(vals)):
            raise ValueError
        return rc[:, 0].astype(np.int64) - 1, rc[:, 1].astype(np.int64) - 1, vals[:, 2]
    except ValueError:
        pass
    for line, lineno in zip(lines, linenos.tolist()):
        what = _bad_line(line)
        if what:
            cut = ("; the file ends inside this line (no newline): truncated? Re-create or "
                   "re-download it" if not line.endswith("\n") else "")
            raise ValueError(f"{path}:{lineno}: malformed line {line.strip()!r}: {what} "
                             f"(format: row col value, 1-based, separated by tabs or spaces){cut}")
    raise ValueError(f"{path}: could not parse lines {linenos[0]}..{linenos[-1]}")


def _check_bounds(path: str, r, c, linenos, bounds) -> None:
    """Raise ValueError naming the first line whose row or column index is above ``bounds``."""
    for idx, limit, what in ((r, bounds[0], "row"), (c, bounds[1], "column")):
        if limit is None:
            continue
        over = np.flatnonzero(idx >= limit)
        if over.size:
            i = int(over[0])
            raise ValueError(f"{path}:{linenos[i]}: {what} index {idx[i] + 1} exceeds "
                             f"N={limit}; pass the network's neuron count (--neurons) or fix "
                             "the line")


def _loadtxt(path):
    """All triples of a well-formed file in one C pass (:func:`numpy.loadtxt`: any whitespace,
    blank lines skipped, a last line without newline read); None when the file is not a clean
    table of triples with integral indices >= 1 and finite values (the chunked parser then
    names the first bad line)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            data = np.loadtxt(path, dtype=np.float64, ndmin=2, comments=None,
                              encoding="ascii")
    except (ValueError, UnicodeDecodeError):
        return None
    if data.size == 0:
        return np.zeros((0, 3))
    if data.shape[1] != 3:
        return None
    rc = data[:, :2]
    if np.any(rc < 1) or np.any(rc != np.floor(rc)) or not np.all(np.isfinite(data)):
        return None
    return data


def _entry_lines(path) -> np.ndarray:
    """1-based line numbers of the non-blank lines of a file (the line of every triple)."""
    a = np.fromfile(path, dtype=np.uint8)
    ends = np.flatnonzero(a == 10)
    word = np.flatnonzero(~np.isin(a, (9, 10, 11, 12, 13, 32)))
    return np.unique(np.searchsorted(ends, word)) + 1


def read_triples(path, chunk_lines: int = CHUNK_LINES, *, allow_empty: bool = False,
                 sum_duplicates: bool = False, bounds=(None, None)):
    """Read ``row col value`` triples (1-based, any whitespace); returns 0-based
    (rows, cols, values).

    A well-formed file is parsed in one C pass (:func:`numpy.loadtxt`); otherwise the file is
    streamed in chunks of ``chunk_lines`` lines to name the first bad line.  Blank lines are
    skipped; the last line needs no newline (POSIX-tolerant, as the Graph Challenge reference
    reader).  Raises ValueError naming ``path`` and the 1-based line number of the first
    malformed line (with a truncation hint when it is an unterminated last line); of the first
    line whose 1-based row or column exceeds ``bounds = (rows, cols)`` (None: no bound); of the
    first repeated (row, col) entry unless ``sum_duplicates`` (then they are returned as they
    are and the matrix readers add them); and when the file holds no entry unless
    ``allow_empty``.
    """
    path_s = str(path)
    data = _loadtxt(path)
    if data is not None:
        r = data[:, 0].astype(np.int64) - 1
        c = data[:, 1].astype(np.int64) - 1
        rows, cols, vals = [r], [c], [data[:, 2]]
        over = any(lim is not None and idx.size and idx.max() >= lim
                   for idx, lim in zip((r, c), bounds))
        if over:
            _check_bounds(path_s, r, c, _entry_lines(path), bounds)
        linenos = None
    else:
        rows, cols, vals, linenos = _read_chunks(path_s, chunk_lines, bounds)
    if sum(x.size for x in rows) == 0:
        if allow_empty:
            return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
        raise ValueError(f"{path_s}: no entries (empty file): expected 'row col value' lines; "
                         "re-create the file (python -m sparse_sgd generate) or check the path")
    r, c, v = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    if not sum_duplicates:
        _check_duplicates(path_s, r, c, lambda: (np.concatenate(linenos) if linenos is not None
                                                 else _entry_lines(path)))
    return r, c, v


def _read_chunks(path_s: str, chunk_lines: int, bounds):
    """The line-by-line parser: chunks of ``chunk_lines`` lines; raises on the first bad line
    with its number.  Returns per-chunk lists of rows, columns, values and line numbers."""
    rows, cols, vals, linenos = [], [], [], []
    with open(path_s, encoding="ascii", errors="replace") as fh:
        lineno = 0
        while True:
            chunk, nums = [], []
            for line in fh:
                lineno += 1
                if not line.strip():
                    continue
                chunk.append(line)
                nums.append(lineno)
                if len(chunk) >= chunk_lines:
                    break
            if not chunk:
                break
            nums = np.asarray(nums, dtype=np.int64)
            r, c, v = _parse_chunk(chunk, nums, path_s)
            _check_bounds(path_s, r, c, nums, bounds)
            rows.append(r)
            cols.append(c)
            vals.append(v)
            linenos.append(nums)
    return rows, cols, vals, linenos


def _check_duplicates(path: str, r, c, lines) -> None:
    """Raise ValueError naming the first line that repeats an earlier (row, col) entry
    (``lines()`` gives the line number of every entry; only called when one repeats)."""
    key = r * (int(c.max()) + 1) + c
    ordered = np.sort(key)
    if not np.any(ordered[1:] == ordered[:-1]):
        return
    linenos = lines()
    order = np.lexsort((linenos, key))
    repeat = np.flatnonzero(np.diff(key[order]) == 0) + 1
    if repeat.size:
        bad = order[repeat]
        i = int(bad[np.argmin(linenos[bad])])
        first = int(linenos[order[np.searchsorted(key[order], key[i])]])
        raise ValueError(f"{path}:{linenos[i]}: duplicate entry ({r[i] + 1}, {c[i] + 1}), first "
                         f"given on line {first}; remove it or pass --sum-duplicates to add "
                         "repeated entries")


def write_triples(path, rows, cols, values, fmt: str = "%.17g") -> None:
    """Write 0-based (rows, cols, values) as 1-based ``row<TAB>col<TAB>value`` lines."""
    rows = np.asarray(rows, dtype=np.int64) + 1
    cols = np.asarray(cols, dtype=np.int64) + 1
    values = np.asarray(values, dtype=np.float64)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as fh:
        for s in range(0, rows.size, CHUNK_LINES):
            e = s + CHUNK_LINES
            fh.writelines(f"{r}\t{c}\t{fmt % v}\n" for r, c, v in
                          zip(rows[s:e].tolist(), cols[s:e].tolist(), values[s:e].tolist()))
    os.replace(tmp, path)


def layer_path(directory, neurons: int, k: int) -> Path:
    """``DIR/n{N}-l{k}.tsv`` (k is 1-based; DIR is the network folder ``neuron{N}``)."""
    return Path(directory) / f"n{neurons}-l{k}.tsv"


def network_folder(directory, neurons: int) -> Path:
    """The folder holding ``n{N}-l{k}.tsv``: ``DIR/neuron{N}`` if it exists, else ``DIR``."""
    sub = Path(directory) / f"neuron{neurons}"
    return sub if sub.is_dir() else Path(directory)


def images_path(directory, neurons: int) -> Path:
    """``DIR/sparse-images-{N}.tsv``."""
    return Path(directory) / f"sparse-images-{neurons}.tsv"


def categories_path(directory, neurons: int, layers: int) -> Path:
    """``DIR/neuron{N}-l{L}-categories.tsv``."""
    return Path(directory) / f"neuron{neurons}-l{layers}-categories.tsv"


def read_challenge_layer(path, neurons: int, *, sum_duplicates: bool = False) -> sp.csr_matrix:
    """Read a challenge layer file and return W^k in the paper orientation (rows = outputs)."""
    r, c, v = read_triples(path, sum_duplicates=sum_duplicates, bounds=(neurons, neurons))
    W = sp.csr_matrix((v, (c, r)), shape=(neurons, neurons))  # file is (input, output)
    W.sum_duplicates()
    W.sort_indices()
    return W


def write_challenge_layer(path, W: sp.spmatrix) -> None:
    """Write W^k (paper orientation) as a challenge layer file (transposed, 1-based)."""
    C = sp.coo_matrix(W)
    order = np.lexsort((C.row, C.col))
    write_triples(path, C.col[order], C.row[order], C.data[order])


def read_challenge_network(directory, neurons: int, layers: int, *,
                           sum_duplicates: bool = False) -> list[sp.csr_matrix]:
    """Read ``n{N}-l1.tsv .. n{N}-l{L}.tsv`` from :func:`network_folder` of ``directory``.

    Raises
    ------
    ValueError
        When a layer file is missing, empty, malformed or cut (see :func:`read_triples`), or
        holds only zero weights (an empty layer disconnects the network; neither training nor
        partitioning can use it).
    """
    folder = network_folder(directory, neurons)
    weights = []
    for k in range(1, layers + 1):
        path = layer_path(folder, neurons, k)
        if not path.is_file():
            raise ValueError(f"{path}: layer file not found ({folder} must hold n{neurons}-l1.tsv"
                             f" .. n{neurons}-l{layers}.tsv); pass the network folder or fewer "
                             "--layers")
        W = read_challenge_layer(path, neurons, sum_duplicates=sum_duplicates)
        W.eliminate_zeros()
        if W.nnz == 0:
            raise ValueError(f"{path}: layer {k} has no nonzero weight (an empty layer "
                             "disconnects the network): fix or regenerate the file (python -m "
                             "sparse_sgd generate), or pass fewer --layers")
        weights.append(W)
    return weights


def write_challenge_network(directory, weights) -> Path:
    """Write every layer as ``DIR/neuron{N}/n{N}-l{k}.tsv``; returns the network folder."""
    folder = Path(directory) / f"neuron{weights[0].shape[1]}"
    folder.mkdir(parents=True, exist_ok=True)
    for k, W in enumerate(weights, start=1):
        write_challenge_layer(layer_path(folder, W.shape[0], k), W)
    return folder


def read_input_tsv(path, neurons: int, num_inputs: int | None = None, *,
                   sum_duplicates: bool = False) -> sp.csr_matrix:
    """Read an input file as a (num_inputs, N) CSR matrix (rows = images).

    ``num_inputs`` keeps the first images (default: up to the largest image index in the file).
    """
    r, c, v = read_triples(path, sum_duplicates=sum_duplicates, bounds=(None, neurons))
    n_file = int(r.max()) + 1
    if num_inputs is None:
        num_inputs = n_file
    if num_inputs < 1:
        raise ValueError(f"--num-inputs must be >= 1, got {num_inputs}")
    keep = r < num_inputs
    Y = sp.csr_matrix((v[keep], (r[keep], c[keep])), shape=(num_inputs, neurons))
    Y.sum_duplicates()
    return Y


def write_input_tsv(path, Y0) -> None:
    """Write a (num_inputs, N) matrix of features as an input file (1-based)."""
    C = sp.coo_matrix(Y0)
    order = np.lexsort((C.col, C.row))
    write_triples(path, C.row[order], C.col[order], C.data[order], fmt="%g")


def read_categories(path) -> np.ndarray:
    """Read a category file (1-based image indices, one per line) as 0-based int64 array."""
    out = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            s = line.strip()
            if not s:
                continue
            try:
                v = int(s)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: malformed category line {s!r}: expected "
                                 "one 1-based integer image index") from None
            if v < 1:
                raise ValueError(f"{path}:{lineno}: category index {v} must be >= 1 (1-based)")
            out.append(v - 1)
    return np.asarray(out, dtype=np.int64)


def write_categories(path, categories) -> None:
    """Write 0-based image indices as a 1-based category file."""
    cats = np.asarray(categories, dtype=np.int64) + 1
    Path(path).write_text("".join(f"{c}\n" for c in cats.tolist()))
