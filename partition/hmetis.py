"""hMetis files: the hypergraph of each phase (``.hgr``, ``.fix``) and partitions (``.part.P``),
as hMetis, PaToH converters, KaHyPar and Mt-KaHyPar exchange them.

``.hgr`` (hMetis manual, §3.1): a header ``num_nets num_vertices 11`` (11: nets and vertices
carry weights), one line per net ``cost pin pin ...`` with 1-based vertex ids, then one line per
vertex with its weight.  ``.fix``: one line per vertex, its block or ``-1`` when free.
``.part.P``: one line per vertex, its block in ``[0, P)``.

The phase-phi_k hypergraph of H-SGD (§5, eq. 12) has a free vertex per row of W^k, a net per
non-empty column and a fixed vertex per net, pinned to the part that computed x^{k-1}(j).  The
model gives fixed vertices no weight; the hMetis format and KaHyPar require weights >= 1, so they
are written with weight 1 (as the Mt-KaHyPar backend passes them), and a block's capacity for
eq. 2 must then count its fixed vertices.

Layout of an exported partition (:func:`save_partition`): ``layer_k.hgr`` (and ``layer_k.fix``
for k >= 2) for every layer k, ``layer_k.part.P`` with every vertex's block (rows: owner of
x^k; fixed vertices: their fixed block), and ``layer_0.part.P``: the placement of x^0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partition.hypergraph import LayerHypergraph, build_layer_hypergraph
from partition.partitioners import Partition, input_owner_from_connectivity
from substrate.results import atomic_write_bytes

__all__ = ["load_partition", "read_hgr", "read_part", "save_partition", "write_hgr",
           "write_part"]

#: the weight written for a fixed vertex (hMetis and KaHyPar refuse 0)
FIXED_WEIGHT = 1


def _lines(path: Path) -> list[tuple[int, list[str]]]:
    """Non-comment lines (hMetis comments start with ``%``) as ``(line number, fields)``."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror}); check the path") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file; hMetis files are plain text") from None
    return [(no, line.split()) for no, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("%")]


def _ints(path, no: int, fields: list[str]) -> list[int]:
    try:
        return [int(x) for x in fields]
    except ValueError:
        raise ValueError(f"{path}:{no}: expected integers, got {' '.join(fields)!r}") from None


def write_hgr(hg: LayerHypergraph, path, fix_path=None) -> None:
    """Write ``hg`` as an hMetis ``.hgr`` with net costs and vertex weights (format 11), and its
    fixed vertices to ``fix_path`` when it has any (both atomically)."""
    lines = [f"{hg.num_nets} {hg.num_vertices} 11"]
    pins = hg.pins + 1
    for e in range(hg.num_nets):
        lines.append(" ".join(map(str, (int(hg.net_cost[e]),
                                        *pins[hg.net_ptr[e]:hg.net_ptr[e + 1]].tolist()))))
    lines.extend(map(str, np.maximum(hg.vertex_weight, FIXED_WEIGHT).tolist()))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    if fix_path is not None and hg.has_fixed:
        atomic_write_bytes(fix_path, ("\n".join(map(str, hg.fixed.tolist())) + "\n").encode())


def read_hgr(path, fix_path=None) -> LayerHypergraph:
    """Read an hMetis ``.hgr`` (formats 0, 1, 10, 11) and optionally its ``.fix`` file.

    Vertices listed as fixed must come after the free ones (as :func:`write_hgr` writes them);
    ``columns`` numbers the nets ``0 .. num_nets-1``.  Raises ``ValueError`` naming the file,
    the line and what is wrong.
    """
    rows = _lines(path)
    if not rows:
        raise ValueError(f"{path}: empty; an .hgr starts with 'num_nets num_vertices [fmt]'")
    no, head = rows[0]
    head = _ints(path, no, head)
    if len(head) not in (2, 3) or min(head[:2]) < 0:
        raise ValueError(f"{path}:{no}: header must be 'num_nets num_vertices [fmt]', got "
                         f"{head}")
    m, n = head[:2]
    fmt = head[2] if len(head) == 3 else 0
    if fmt not in (0, 1, 10, 11):
        raise ValueError(f"{path}:{no}: format {fmt} unknown; hMetis knows 0, 1, 10 and 11")
    net_w, vtx_w = fmt in (1, 11), fmt in (10, 11)
    expected = 1 + m + (n if vtx_w else 0)
    if len(rows) != expected:
        raise ValueError(f"{path}: {len(rows)} lines for {m} nets and {n} vertices in format "
                         f"{fmt} (expected {expected}); the file is truncated or its header "
                         "is wrong")
    cost, ptr, pins = np.ones(m, np.int64), [0], []
    for e, (no, fields) in enumerate(rows[1:1 + m]):
        vals = _ints(path, no, fields)
        if net_w:
            cost[e], vals = vals[0], vals[1:]
        if not vals or min(vals) < 1 or max(vals) > n:
            raise ValueError(f"{path}:{no}: net {e + 1} needs pins in [1, {n}], got "
                             f"{fields if not net_w else fields[1:]}")
        pins.extend(v - 1 for v in vals)
        ptr.append(len(pins))
    weight = np.ones(n, np.int64)
    if vtx_w:
        weight = np.array([_ints(path, no, f)[0] for no, f in rows[1 + m:]], np.int64)
    fixed = np.full(n, -1, np.int64)
    if fix_path is not None:
        frows = _lines(fix_path)
        if len(frows) != n:
            raise ValueError(f"{fix_path}: {len(frows)} lines for the {n} vertices of {path}; "
                             "write one block (or -1) per vertex")
        fixed = np.array([_ints(fix_path, no, f)[0] for no, f in frows], np.int64)
    free = int(np.count_nonzero(fixed < 0))
    if np.any(fixed[:free] >= 0):
        raise ValueError(f"{fix_path}: fixed vertices must follow the free ones (the layout "
                         "write_hgr uses)")
    return LayerHypergraph(num_rows=free, columns=np.arange(m), net_ptr=np.array(ptr, np.int64),
                           pins=np.array(pins, np.int64), vertex_weight=weight, net_cost=cost,
                           fixed=fixed)


def write_part(blocks, path) -> None:
    """Write one block per line (an hMetis/KaHyPar ``.part.P`` file), atomically."""
    atomic_write_bytes(path, ("\n".join(map(str, np.asarray(blocks).tolist())) + "\n").encode())


def read_part(path, num_vertices: int, parts: int) -> np.ndarray:
    """Read a ``.part.P`` file of ``num_vertices`` blocks in ``[0, parts)``; ``ValueError``
    naming the file and line otherwise."""
    rows = _lines(path)
    if len(rows) != num_vertices:
        raise ValueError(f"{path}: {len(rows)} blocks for {num_vertices} vertices; the file "
                         "belongs to another hypergraph or is truncated")
    out = np.empty(num_vertices, np.int64)
    for i, (no, fields) in enumerate(rows):
        vals = _ints(path, no, fields)
        if len(vals) != 1 or not 0 <= vals[0] < parts:
            raise ValueError(f"{path}:{no}: block must be one integer in [0, {parts}), got "
                             f"{' '.join(fields)!r}")
        out[i] = vals[0]
    return out


def _hypergraph(weights, partition: Partition, k: int) -> LayerHypergraph:
    prev = None if k == 1 else np.asarray(partition.owners[k - 1])
    return build_layer_hypergraph(weights[k - 1], prev, fixed_weight=FIXED_WEIGHT)


def save_partition(weights, partition: Partition, out_dir) -> list[Path]:
    """Export every phase of ``partition`` of the network ``weights`` as hMetis files into
    ``out_dir`` (see the module docstring); returns the files written."""
    partition.check_network(weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    P = partition.parts
    written = [out / f"layer_0.part.{P}"]
    write_part(partition.owners[0], written[0])
    for k in range(1, partition.num_layers + 1):
        hg = _hypergraph(weights, partition, k)
        hgr, fix, part = (out / f"layer_{k}.hgr", out / f"layer_{k}.fix",
                          out / f"layer_{k}.part.{P}")
        write_hgr(hg, hgr, fix)
        blocks = np.where(hg.fixed >= 0, hg.fixed, 0)
        blocks[:hg.num_rows] = partition.owners[k]
        write_part(blocks, part)
        written += [hgr, part] + ([fix] if hg.has_fixed else [])
    return written


def load_partition(weights, in_dir, parts: int, method: str = "hmetis") -> Partition:
    """Read a partition of ``weights`` from ``layer_k.part.P`` files (written by
    :func:`save_partition` or by a partitioner run on its ``.hgr`` files).  Each layer's file
    holds a block per vertex of its phase hypergraph; the free vertices' blocks own the rows.
    Without ``layer_0.part.P`` x^0 is placed from the first layer's connectivity, as the
    partitioner does.  A fixed vertex moved off its block is refused (the file does not belong
    to this phase chain)."""
    src = Path(in_dir)
    owners: list[np.ndarray] = []
    for k, W in enumerate(weights, start=1):
        path = src / f"layer_{k}.part.{parts}"
        if not path.exists():
            raise ValueError(f"{path} missing: {src} must hold one layer_K.part.{parts} per "
                             f"layer 1..{len(weights)}")
        n_rows, n_cols = W.shape
        if k == 1:
            nets = 0
        else:
            nets = int(np.count_nonzero(np.diff(W.tocsc().indptr)))
        blocks = read_part(path, n_rows + nets, parts)
        if k > 1:
            hg = build_layer_hypergraph(W, owners[-1], fixed_weight=FIXED_WEIGHT)
            moved = np.flatnonzero(blocks[n_rows:] != hg.fixed[n_rows:])
            if moved.size:
                raise ValueError(f"{path}: fixed vertex {n_rows + moved[0] + 1} is in block "
                                 f"{blocks[n_rows + moved[0]]}, its .fix says "
                                 f"{hg.fixed[n_rows + moved[0]]}; partition with the .fix file")
        if k == 1:
            first = blocks[:n_rows]
            p0 = src / f"layer_0.part.{parts}"
            x0 = (read_part(p0, n_cols, parts) if p0.exists()
                  else input_owner_from_connectivity(W, first, parts))
            owners.append(np.asarray(x0, np.int64))
        owners.append(blocks[:n_rows])
    return Partition(owners=tuple(owners), parts=parts, method=method)
