"""Table-1 metrics against a brute-force count, and the Xsend/Xrecv maps against the metrics."""

import numpy as np
import pytest
import scipy.sparse as sp

from partition.cli import main as partition_main
from partition.maps import build_maps
from partition.metrics import partition_metrics
from partition.partitioners import HypergraphConfig, hypergraph_partition, random_partition
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
    t = m.table1()
    assert t["total_volume"] == ff_vol.sum() + bp_vol.sum()
    assert t["max_volume"] == (ff_vol.sum(0) + bp_vol.sum(0)).max() / 4
    assert t["imbalance"] == pytest.approx(flops.max() / flops.mean())
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


def test_cli_prints_table1(capsys, tmp_path):
    assert partition_main(["radixnet", "--neurons", "1024", "--layers", "3", "--parts", "4",
                           "--method", "both", "--save", str(tmp_path / "p.npz")]) == 0
    out = capsys.readouterr().out
    assert "H (hypergraph)" in out and "R (random)" in out and "H/R ratios" in out
    assert (tmp_path / "p.npz").exists()
    assert partition_main(["radixnet", "--neurons", "1000", "--layers", "3", "--parts", "4"]) == 2
