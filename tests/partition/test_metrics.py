"""Table-1 metrics against a brute-force count and the random row against its closed form, the
Xsend/Xrecv maps against the metrics, and ``python -m partition layers``."""

import json

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp

from partition.cli import main as partition_main
from partition.cli import read_layer
from partition.maps import build_maps
from partition.metrics import expected_random_spff, partition_metrics
from partition.partitioners import (
    HypergraphConfig,
    Partition,
    hypergraph_partition,
    random_partition,
)
from sparse_sgd.radixnet import RadixNetConfig, graph_challenge_network, radixnet


def _brute_force(weights, part):
    P, L = part.parts, len(weights)
    ff_vol, bp_vol = np.zeros((L, P), int), np.zeros((L, P), int)
    ff_msg, bp_msg = np.zeros((L, P), int), np.zeros((L, P), int)
    flops = np.zeros(P, int)
    for k, W in enumerate(weights, start=1):
        C = sp.coo_matrix(W)
        users = {}
        for i, j in zip(C.row.tolist(), C.col.tolist()):
            users.setdefault(j, set()).add(int(part.owners[k][i]))
            flops[part.owners[k][i]] += 3
        ff_pairs, bp_pairs = set(), set()
        for j, parts in users.items():
            o = int(part.owners[k - 1][j])
            for m in parts - {o}:
                ff_vol[k - 1, o] += 1  # x^{k-1}(j) from o to m
                ff_pairs.add((o, m))
                if k > 1:
                    bp_vol[k - 1, m] += 1  # partial s^k(j) from m back to o
                    bp_pairs.add((m, o))
        for a, _ in ff_pairs:
            ff_msg[k - 1, a] += 1
        for a, _ in bp_pairs:
            bp_msg[k - 1, a] += 1
    return ff_vol, bp_vol, ff_msg, bp_msg, flops


@pytest.mark.parametrize("method", ["random", "hypergraph"])
def test_metrics_equal_brute_force(method):
    W = radixnet(RadixNetConfig(radices=(2, 2, 3), num_layers=4, blocks=(3,), seed=1))
    rng = np.random.default_rng(0)
    W[2] = sp.csr_matrix(W[2].multiply(rng.random(W[2].shape) < 0.5))  # irregular layer
    W[2].eliminate_zeros()
    part = (random_partition(W, 5, seed=2) if method == "random"
            else hypergraph_partition(W, 5, HypergraphConfig(seed=2)))
    m = partition_metrics(W, part)
    ff_vol, bp_vol, ff_msg, bp_msg, flops = _brute_force(W, part)
    np.testing.assert_array_equal(m.spff_volume, ff_vol)
    np.testing.assert_array_equal(m.spbp_volume, bp_vol)
    np.testing.assert_array_equal(m.spff_messages, ff_msg)
    np.testing.assert_array_equal(m.spbp_messages, bp_msg)
    np.testing.assert_array_equal(m.flops, flops)
    t = m.table1()  # the paper's Table 1: SpFF only, per processor per layer
    assert t["total_volume"] == ff_vol.sum() and t["total_messages"] == ff_msg.sum()
    assert t["avg_volume"] == pytest.approx(ff_vol.sum() / 5 / 4)
    assert t["max_volume"] == ff_vol.sum(0).max() / 4
    assert t["max_messages"] == ff_msg.sum(0).max() / 4
    assert t["imbalance"] == pytest.approx(flops.max() / flops.mean())
    b = m.table1_spff_spbp()
    assert b["total_volume"] == ff_vol.sum() + bp_vol.sum()
    assert b["max_volume"] == (ff_vol.sum(0) + bp_vol.sum(0)).max() / 4
    e = m.expected_traffic(batch=3, itemsize=8, iterations=2)
    assert e["spff"]["bytes"] == ff_vol.sum() * 48 and e["spbp"]["messages"] == 2 * bp_msg.sum()


def test_maps_agree_with_metrics_and_each_other():
    W = graph_challenge_network(1024, 3, seed=5).weights
    part = random_partition(W, 4, seed=3)
    m = partition_metrics(W, part)
    maps = [build_maps(W, part, r) for r in range(4)]
    for k in range(1, 4):
        for a in range(4):
            mp = maps[a][k - 1]
            # W^k_m reassembled from [local | received] columns is W^k's row block
            cols = np.concatenate((mp.prev_rows, mp.recv_global))
            Wm = sp.hstack([mp.W_local, mp.W_remote]).tocsr()
            rebuilt = sp.csr_matrix((Wm.data, cols[Wm.indices], Wm.indptr),
                                    shape=(mp.rows.size, 1024))
            assert (rebuilt != W[k - 1][mp.rows]).nnz == 0
            for n, ix in zip(mp.send_ranks, mp.send_index):
                other = maps[n][k - 1]
                i = int(np.flatnonzero(other.recv_ranks == a)[0])
                got = other.recv_global[other.recv_ptr[i]:other.recv_ptr[i + 1]]
                np.testing.assert_array_equal(mp.prev_rows[ix], got)  # Xsend_a,n == Xrecv_n,a
                assert ix.size == m.pair_words[k - 1, n, a]
            assert mp.send_words.sum() == m.spff_volume[k - 1, a]


def test_random_row_matches_its_closed_form():
    """Table 1's random row against E[R] = (N/P)(P-1)(1-(1-1/P)^32) (volume) and
    (P-1)(1-(1-q)^{N/P}) (messages) at the paper's N = 1024, P = 32: within 2 %."""
    W = graph_challenge_network(1024, 6, seed=1).weights
    t = partition_metrics(W, random_partition(W, 32, seed=4)).table1()
    e = expected_random_spff(1024, 32, 32)
    assert e["avg_volume"] == pytest.approx(32 * 31 * (1 - (31 / 32) ** 32))
    assert t["avg_volume"] == pytest.approx(e["avg_volume"], rel=0.02)
    assert t["avg_messages"] == pytest.approx(e["avg_messages"], rel=0.02)
    assert t["avg_messages"] == 31.0  # every processor needs entries of all 31 others


def test_cli_partitions_matrix_files(capsys, tmp_path):
    W = radixnet(RadixNetConfig(radices=(2, 2, 2), num_layers=4, blocks=(3,), seed=2))
    files = []
    for k, M in enumerate(W, start=1):
        files.append(str(tmp_path / f"w{k}.npz"))
        sp.save_npz(files[-1], M)
    sp_mtx = tmp_path / "w4.mtx"
    scipy.io.mmwrite(sp_mtx, W[3])
    files[-1] = str(sp_mtx)
    out = tmp_path / "run"
    assert partition_main(["layers", *files, "--parts", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "H (hypergraph)" in text and "R (random)" in text
    part = Partition.load(out / "partition.npz")
    s = json.loads((out / "summary.json").read_text())
    want = partition_metrics(W, part).table1()
    assert s["metrics"]["table1"]["H (hypergraph)"]["avg_volume"] == want["avg_volume"]
    # a finished run is not replaced without --overwrite; bad input names the file
    assert partition_main(["layers", *files, "--parts", "4", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    sp.save_npz(tmp_path / "odd.npz", sp.csr_matrix(np.ones((5, 7))))
    assert partition_main(["layers", files[0], str(tmp_path / "odd.npz"), "--parts", "2",
                           "--out", str(tmp_path / "r2")]) == 2
    assert "odd.npz" in capsys.readouterr().err
    (tmp_path / "bad.txt").write_text("x")
    assert partition_main(["layers", str(tmp_path / "bad.txt"), "--parts", "2",
                           "--out", str(tmp_path / "r3")]) == 2
    assert "bad.txt" in capsys.readouterr().err


MM = "%%MatrixMarket matrix coordinate real general\n"


@pytest.mark.parametrize("name,text,fragments", [
    ("huge.mtx", MM + "1000000000 1000000000 3\n1 1 1.0\n2 2 2.0\n3 3 3.0\n",
     [":2: the size line declares a 1000000000 x 1000000000 layer", "correct the size line"]),
    ("wide.mtx", MM + "% a comment\n4 100000000 1\n1 1 1.0\n",
     [":3: the size line declares a 4 x 100000000 layer", "16777216 neurons a side"]),
    ("dense.mtx", "%%MatrixMarket matrix array real general\n100000 100000\n1.0\n",
     [":3: the file ends after 1 of the 10000000000 values its size line (line 2) declares",
      "scipy.io.mmwrite"]),
    ("entries.mtx", MM + "3 3 1000000000000\n1 1 1.0\n",
     [":2: the size line declares 1000000000000 entries, more than the 3 x 3 layer has"]),
], ids=["huge", "wide", "dense", "entries"])
def test_matrix_market_size_line_is_checked_before_reading(tmp_path, monkeypatch, name, text,
                                                           fragments):
    """A size line no layer can have is refused, naming the file and the line, before
    ``scipy.io.mmread`` would allocate what it declares."""
    def mmread(path):
        raise AssertionError(f"mmread reached for {path}: it would allocate the declared size")

    monkeypatch.setattr(scipy.io, "mmread", mmread)
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as exc:
        read_layer(tmp_path / name)
    for f in fragments:
        assert f in str(exc.value)
    assert str(exc.value).startswith(f"{tmp_path / name}:")


def test_truncated_matrix_market_file_names_its_last_line(tmp_path):
    W = sp.random(16, 16, density=0.3, format="csr", random_state=0)
    scipy.io.mmwrite(tmp_path / "w.mtx", W)
    lines = (tmp_path / "w.mtx").read_text().splitlines()
    (tmp_path / "cut.mtx").write_text("\n".join(lines[:-5]) + "\n")
    with pytest.raises(ValueError) as exc:
        read_layer(tmp_path / "cut.mtx")
    assert str(exc.value).startswith(
        f"{tmp_path / 'cut.mtx'}:{len(lines) - 5}: the file ends after {W.nnz - 5} of the "
        f"{W.nnz} entries its size line (line 3) declares: it is truncated")
    assert (read_layer(tmp_path / "w.mtx") != W).nnz == 0     # the whole file still reads
