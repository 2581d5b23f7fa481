"""hMetis export and import of the H-SGD phase hypergraphs and partitions.

Second sources: KaHyPar's own hMetis reader (``kahypar.createHypergraphFromFile``) parses what
we write, and the connectivity-1 cut it implies equals the SpFF + SpBP words that
``partition.metrics`` counts from the matrices; a partition computed by KaHyPar on our files
(fixed vertices from ``.fix``) loads back and is the one KaHyPar returned.
"""

import numpy as np
import pytest

from partition.hmetis import (
    load_partition,
    read_hgr,
    read_part,
    save_partition,
    write_hgr,
    write_part,
)
from partition.hypergraph import build_layer_hypergraph
from partition.metrics import partition_metrics
from partition.partitioners import HypergraphConfig, hypergraph_partition, random_partition
from sparse_sgd.radixnet import graph_challenge_network

kahypar = pytest.importorskip("kahypar")

P = 3  # odd part count; 1024 neurons do not split evenly


@pytest.fixture(scope="module")
def net():
    return graph_challenge_network(1024, 3, seed=11).weights


def _cut_from_kahypar_reader(path, blocks) -> int:
    """sum over nets of cost * (lambda - 1), parsing with KaHyPar, not with our reader."""
    h = kahypar.createHypergraphFromFile(str(path), P)
    return sum(h.edgeWeight(e) * (len({int(blocks[v]) for v in h.pins(e)}) - 1)
               for e in h.edges())


def _inputs_outside(W1, owner1, owner0) -> int:
    """Inputs x^0(j) whose part holds no row of W^1 that reads them."""
    A = W1.tocsc()
    return sum(1 for j in range(A.shape[1]) if A.indptr[j + 1] > A.indptr[j]
               and owner0[j] not in set(owner1[A.indices[A.indptr[j]:A.indptr[j + 1]]]))


@pytest.mark.parametrize("kind", ["random", "hypergraph"])
def test_export_is_what_kahypar_reads_and_its_cut_is_the_traffic(net, kind, tmp_path):
    part = (random_partition(net, P, seed=2) if kind == "random"
            else hypergraph_partition(net, P, HypergraphConfig(seed=2)))
    files = save_partition(net, part, tmp_path)
    assert {f.name for f in files} >= {f"layer_{k}.part.{P}" for k in range(4)}
    m = partition_metrics(net, part)
    for k in range(1, 4):
        hgr = tmp_path / f"layer_{k}.hgr"
        blocks = read_part(tmp_path / f"layer_{k}.part.{P}",
                           kahypar.createHypergraphFromFile(str(hgr), P).numNodes(), P)
        # net cost 2 = one SpFF word + one SpBP word per extra part; layer 1 sends no SpBP
        # (no gradient of x^0) and its nets have no fixed vertex: an input placed outside its
        # net's parts (the placement's balance cap allows a few) costs one more SpFF word
        cut = _cut_from_kahypar_reader(hgr, blocks)
        outside = _inputs_outside(net[0], part.owners[1], part.owners[0]) if k == 1 else 0
        assert cut + 2 * outside == 2 * int(m.spff_volume[k - 1].sum()) > 0
        if k > 1:
            assert cut == int(m.spff_volume[k - 1].sum() + m.spbp_volume[k - 1].sum())  # a free vertex per row, a fixed vertex per non-empty column
            h = kahypar.createHypergraphFromFile(str(hgr), P)
            assert h.numNodes() == net[k - 1].shape[0] + np.count_nonzero(
                np.diff(net[k - 1].tocsc().indptr))
    back = load_partition(net, tmp_path, P)
    for a, b in zip(part.owners, back.owners):
        np.testing.assert_array_equal(a, b)


def test_hgr_round_trip_keeps_every_field(net, tmp_path):
    owner1 = random_partition(net, P, seed=4).owners[1]
    hg = build_layer_hypergraph(net[1], owner1, fixed_weight=1)
    write_hgr(hg, tmp_path / "h.hgr", tmp_path / "h.fix")
    back = read_hgr(tmp_path / "h.hgr", tmp_path / "h.fix")
    assert back.num_rows == hg.num_rows
    for f in ("net_ptr", "pins", "vertex_weight", "net_cost", "fixed"):
        np.testing.assert_array_equal(getattr(back, f), getattr(hg, f), err_msg=f)


def test_a_partition_kahypar_computes_on_our_files_loads_back(net, tmp_path):
    """Partition phase by phase from the files alone, as a KaHyPar user would: read the .hgr
    with KaHyPar, fix the vertices the .fix names, partition, write the .part; the next phase's
    fixed vertices come from this one."""
    from partition.partitioners import _kahypar_ini

    owners = [None]
    for k in range(1, 4):
        prev = None if k == 1 else owners[-1]
        hg = build_layer_hypergraph(net[k - 1], prev, fixed_weight=1)
        write_hgr(hg, tmp_path / f"layer_{k}.hgr", tmp_path / f"layer_{k}.fix")
        h = kahypar.createHypergraphFromFile(str(tmp_path / f"layer_{k}.hgr"), P)
        if k > 1:
            fixed = np.loadtxt(tmp_path / f"layer_{k}.fix", dtype=np.int64)
            for v in np.flatnonzero(fixed >= 0):
                h.fixNodeToBlock(int(v), int(fixed[v]))
        ctx = kahypar.Context()
        ctx.loadINIconfiguration(_kahypar_ini("km1"))
        ctx.setK(P)
        ctx.setEpsilon(0.1)
        ctx.setSeed(k)
        ctx.suppressOutput(True)
        kahypar.partition(h, ctx)
        blocks = np.array([h.blockID(v) for v in range(h.numNodes())])
        write_part(blocks, tmp_path / f"layer_{k}.part.{P}")
        owners.append(blocks[:hg.num_rows])
    back = load_partition(net, tmp_path, P)
    for k in range(1, 4):
        np.testing.assert_array_equal(back.owners[k], owners[k])
    # x^0 (no layer_0 file) is placed from the connectivity: phase 1's cut is its SpFF traffic
    m = partition_metrics(net, back)
    blocks1 = read_part(tmp_path / f"layer_1.part.{P}", net[0].shape[0], P)
    outside = _inputs_outside(net[0], back.owners[1], back.owners[0])
    assert _cut_from_kahypar_reader(tmp_path / "layer_1.hgr", blocks1) + 2 * outside == 2 * int(
        m.spff_volume[0].sum())


@pytest.mark.parametrize("text,fix,msg", [
    ("", None, "empty"),
    ("2 3 7\n1 2\n2 3\n", None, "format 7 unknown"),
    ("2 3\n1 2\n", None, "truncated"),
    ("2 3\n1 2\n2 9\n", None, r"h.hgr:3: net 2 needs pins in \[1, 3\]"),
    ("2 3\n1 x\n2 3\n", None, r"h.hgr:2: expected integers"),
    ("1 2\n1 2\n", "0\n-1\n", "fixed vertices must follow"),
    ("1 2\n1 2\n", "0\n", "1 lines for the 2 vertices"),
])
def test_bad_hgr_names_file_line_and_fix(tmp_path, text, fix, msg):
    (tmp_path / "h.hgr").write_text(text)
    fix_path = None
    if fix is not None:
        fix_path = tmp_path / "h.fix"
        fix_path.write_text(fix)
    with pytest.raises(ValueError, match=msg):
        read_hgr(tmp_path / "h.hgr", fix_path)


def test_bad_part_and_missing_files(net, tmp_path):
    (tmp_path / "p").write_text("0\n5\n1\n")
    with pytest.raises(ValueError, match=r"p:2: block must be one integer in \[0, 3\)"):
        read_part(tmp_path / "p", 3, 3)
    with pytest.raises(ValueError, match="3 blocks for 4 vertices"):
        read_part(tmp_path / "p", 4, 3)
    with pytest.raises(ValueError, match="cannot read"):
        read_part(tmp_path / "nope", 3, 3)
    with pytest.raises(ValueError, match=r"layer_1.part.3 missing"):
        load_partition(net, tmp_path, 3)
    part = random_partition(net, P, seed=3)
    save_partition(net, part, tmp_path / "x")
    blocks = read_part(tmp_path / "x" / f"layer_2.part.{P}",
                       net[1].shape[0] + np.count_nonzero(np.diff(net[1].tocsc().indptr)), P)
    blocks[-1] = (blocks[-1] + 1) % P
    write_part(blocks, tmp_path / "x" / f"layer_2.part.{P}")
    with pytest.raises(ValueError, match="partition with the .fix file"):
        load_partition(net, tmp_path / "x", P)
