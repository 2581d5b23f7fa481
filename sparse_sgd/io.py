"""Sparse DNN Graph Challenge file formats.

* layer files ``n{N}-l{k}.tsv``: ``row<TAB>col<TAB>value`` triples, 1-based, of the challenge's
  weight matrix, which multiplies row vectors (``Y W``): row = input neuron, column = output
  neuron.  spardist keeps the paper's orientation (``z = W x``, rows = outputs), so layer files
  hold the *transpose* of :mod:`sparse_sgd.radixnet`'s ``W^k``; :func:`read_challenge_layer` and
  :func:`write_challenge_layer` convert.
* input files (``sparse-images-{N}.tsv``): ``image<TAB>feature<TAB>value``, 1-based.
* category files: one 1-based image index per line (images with any nonzero output).

Parsing streams the file in chunks of lines; a malformed line raises ``ValueError`` naming the
file and the line number.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp

__all__ = [
    "layer_path",
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

CHUNK_LINES = 1 << 16


def _parse_chunk(lines: list[str], path, first_lineno: int):
    """Parse ``lines`` of triples; fall back to a line loop to name the first bad line."""
    text = "".join(lines)
    n = len(lines)
    try:
        if text.count("\t") != 2 * n:
            raise ValueError
        vals = np.array(text.split(), dtype=np.float64)
        if vals.size != 3 * n:
            raise ValueError
        vals = vals.reshape(n, 3)
        rc = vals[:, :2]
        if np.any(rc < 1) or np.any(rc != np.floor(rc)) or not np.all(np.isfinite(vals)):
            raise ValueError
        return rc[:, 0].astype(np.int64) - 1, rc[:, 1].astype(np.int64) - 1, vals[:, 2]
    except ValueError:
        pass
    for i, line in enumerate(lines):
        lineno = first_lineno + i
        fields = line.rstrip("\r\n").split("\t")
        what = None
        if len(fields) != 3:
            what = f"expected 3 tab-separated fields, found {len(fields)}"
        else:
            try:
                r, c, v = int(fields[0]), int(fields[1]), float(fields[2])
            except ValueError:
                what = "row and column must be integers and value a number"
            else:
                if r < 1 or c < 1:
                    what = "row and column indices are 1-based (must be >= 1)"
                elif not np.isfinite(v):
                    what = "value must be finite"
        if what:
            raise ValueError(f"{path}:{lineno}: malformed line {line.rstrip()!r}: {what} "
                             "(format: row<TAB>col<TAB>value, 1-based)")
    raise ValueError(f"{path}: could not parse lines {first_lineno}..{first_lineno + n - 1}")


def read_triples(path, chunk_lines: int = CHUNK_LINES):
    """Stream ``row<TAB>col<TAB>value`` triples; returns 0-based (rows, cols, values).

    Blank lines are skipped.  Raises ValueError naming ``path`` and the 1-based line number of
    the first malformed line.
    """
    rows, cols, vals = [], [], []
    with open(path, encoding="ascii", errors="replace") as fh:
        lineno = 0
        while True:
            chunk, first = [], None
            for line in fh:
                lineno += 1
                if not line.strip():
                    continue
                if first is None or len(chunk) == 0:
                    first = lineno
                if not line.endswith("\n"):
                    line += "\n"
                chunk.append(line)
                if len(chunk) >= chunk_lines:
                    break
            if not chunk:
                break
            # line numbers inside a chunk are contiguous unless blank lines were skipped;
            # re-derive them exactly on error by re-reading when blanks were present
            try:
                r, c, v = _parse_chunk(chunk, path, first)
            except ValueError as exc:
                raise _exact_error(path, exc) from None
            rows.append(r)
            cols.append(c)
            vals.append(v)
    if not rows:
        return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)


def _exact_error(path, exc: ValueError) -> ValueError:
    """Re-scan the file line by line to report the exact line number of the first bad line."""
    with open(path, encoding="ascii", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                _parse_chunk([line if line.endswith("\n") else line + "\n"], path, lineno)
            except ValueError as e:
                return e
    return exc


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
    """``DIR/n{N}-l{k}.tsv`` (k is 1-based)."""
    return Path(directory) / f"n{neurons}-l{k}.tsv"


def read_challenge_layer(path, neurons: int) -> sp.csr_matrix:
    """Read a challenge layer file and return W^k in the paper orientation (rows = outputs)."""
    r, c, v = read_triples(path)
    if r.size and (r.max() >= neurons or c.max() >= neurons):
        raise ValueError(f"{path}: index {max(r.max(), c.max()) + 1} exceeds N={neurons}; "
                         "pass the network's neuron count")
    W = sp.csr_matrix((v, (c, r)), shape=(neurons, neurons))  # file is (input, output)
    W.sort_indices()
    return W


def write_challenge_layer(path, W: sp.spmatrix) -> None:
    """Write W^k (paper orientation) as a challenge layer file (transposed, 1-based)."""
    C = sp.coo_matrix(W)
    order = np.lexsort((C.row, C.col))
    write_triples(path, C.col[order], C.row[order], C.data[order])


def read_challenge_network(directory, neurons: int, layers: int) -> list[sp.csr_matrix]:
    """Read ``n{N}-l1.tsv .. n{N}-l{L}.tsv`` from ``directory``.

    Raises
    ------
    ValueError
        When a layer file holds no weight (an empty layer disconnects the network; neither
        training nor partitioning can use it).
    """
    weights = []
    for k in range(1, layers + 1):
        path = layer_path(directory, neurons, k)
        W = read_challenge_layer(path, neurons)
        if W.nnz == 0:
            raise ValueError(f"{path}: layer {k} has no weights (an empty layer disconnects the "
                             "network): fix or regenerate the file (python -m sparse_sgd "
                             "generate), or pass fewer --layers")
        weights.append(W)
    return weights


def write_challenge_network(directory, weights) -> None:
    """Write every layer as ``DIR/n{N}-l{k}.tsv``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for k, W in enumerate(weights, start=1):
        write_challenge_layer(layer_path(directory, W.shape[0], k), W)


def read_input_tsv(path, neurons: int, num_inputs: int | None = None) -> sp.csr_matrix:
    """Read an input file as a (num_inputs, N) CSR matrix (rows = images)."""
    r, c, v = read_triples(path)
    if c.size and c.max() >= neurons:
        raise ValueError(f"{path}: feature index {c.max() + 1} exceeds N={neurons}")
    n = int(r.max()) + 1 if num_inputs is None and r.size else (num_inputs or 0)
    return sp.csr_matrix((v, (r, c)), shape=(n, neurons))


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
