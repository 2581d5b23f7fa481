"""The codec layer (:mod:`dataparallel.codec`) against references written here with plain NumPy:
bit-exact ``[values | indices]`` round trips (signed zeros, NaN payloads, denormals included),
fused rows with a dense prefix and padded slots, the mean of gathered rows, error feedback
(``e = a - sparse(a)`` bit for bit), and bad input."""

import numpy as np
import pytest

from dataparallel.codec import (
    INDEX_BYTES,
    VALUE_BYTES,
    ErrorFeedback,
    SparseRow,
    exact_topk,
    scatter_mean,
)


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _awkward(n, seed=0):
    """float32 values with every awkward bit pattern a gradient can hold."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    x[:6] = [-0.0, 0.0, np.float32(1e-45), -np.float32(1e-40), np.float32(3.4e38), np.nan]
    x[6] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), dtype=np.float32)[0]  # NaN payload
    return x


def test_sparse_row_round_trip_is_bit_exact():
    """Values are bit-cast, not converted: every float32 pattern (−0, NaN payloads,
    denormals) comes back as it went in; indices come back shifted by the segment's base."""
    rng = np.random.default_rng(1)
    x = _awkward(1000)
    row = SparseRow(n_dense=7, K=30)
    buf = row.empty()
    assert buf.dtype == np.int32 and buf.size == row.words == 7 + 60
    assert row.nbytes == 7 * VALUE_BYTES + 30 * (VALUE_BYTES + INDEX_BYTES) == 4 * row.words
    dense = x[100:107]
    row.put_dense(buf, 0, dense)
    # two segments: 12 entries of x[0:500] at slot 0, 18 of x[500:1000] at slot 12
    i1 = rng.choice(500, 12, replace=False)
    i2 = rng.choice(500, 18, replace=False)
    i1[:7] = np.arange(7)                      # the awkward patterns are sent
    row.put(buf, 0, x[i1], i1, base=0)
    row.put(buf, 12, x[500:][i2], i2, base=500)
    rows = buf[None]
    assert np.array_equal(_bits(row.dense(rows)[0]), _bits(dense))
    assert np.array_equal(_bits(row.values(rows)), _bits(np.concatenate([x[i1], x[500 + i2]])))
    assert np.array_equal(row.indices(rows), np.concatenate([i1, 500 + i2]))
    assert row.indices(rows).dtype == np.int32


def test_padded_slots_carry_zero_at_the_segment_base():
    """A selector that returns fewer than k (Gaussian-k) leaves slots holding value 0 at the
    segment's first position: they add nothing when decoded."""
    row = SparseRow(0, 5)
    buf = np.full(row.words, -1, dtype=np.int32)
    row.put(buf, 0, np.array([2.5, -1.0], np.float32), np.array([3, 9]), base=40, k=5)
    assert row.values(buf[None]).tolist() == [2.5, -1.0, 0.0, 0.0, 0.0]
    assert row.indices(buf[None]).tolist() == [43, 49, 40, 40, 40]
    dense = scatter_mean(row.values(buf[None]), row.indices(buf[None]), 20, 1, base=40)
    want = np.zeros(20)
    want[3], want[9] = 2.5, -1.0
    assert np.array_equal(dense, want)


def test_gathered_rows_average_like_the_reference():
    """p ranks' rows: the dense prefixes averaged, the sparse entries scatter-added (duplicate
    positions across ranks add up) and divided by p, in float64 — a loop written here."""
    rng = np.random.default_rng(2)
    p, n, nd, K = 5, 64, 3, 6
    row = SparseRow(nd, K)
    rows = np.empty((p, row.words), dtype=np.int32)
    want_sparse = np.zeros(n)
    want_dense = np.zeros(nd)
    for j in range(p):
        d = rng.standard_normal(nd).astype(np.float32)
        idx = rng.choice(n, K, replace=False)
        v = rng.standard_normal(K).astype(np.float32)
        row.put_dense(rows[j], 0, d)
        row.put(rows[j], 0, v, idx, base=100)
        want_dense += d.astype(np.float64)
        for i, val in zip(idx, v):
            want_sparse[i] += float(val)
    assert np.array_equal(row.dense_mean(rows, p), want_dense / p)
    got = scatter_mean(row.values(rows), row.indices(rows), n, p, base=100)
    assert np.allclose(got, want_sparse / p, rtol=0, atol=1e-15)
    assert got.dtype == np.float64


def test_error_feedback_keeps_what_was_not_sent_bit_for_bit():
    """Over steps, a = e + g, the k largest |a| sent, e = a - sparse(a) bit for bit (a - a = 0
    where sent, a - 0 = a elsewhere), against a reference loop."""
    rng = np.random.default_rng(3)
    n, k = 300, 17
    e_ref = np.zeros(n, np.float32)
    resid = np.zeros(n, np.float32)
    ef = ErrorFeedback(resid)
    for _ in range(4):
        g = rng.standard_normal(n).astype(np.float32)
        a_ref = e_ref + g
        top = np.argsort(-np.abs(a_ref), kind="stable")[:k]
        e_ref = a_ref.copy()
        e_ref[top] = 0
        acc = ef.accumulate(g)
        idx = exact_topk(acc, k)
        assert sorted(idx.tolist()) == sorted(top.tolist())
        ef.sent(idx)
        assert np.array_equal(_bits(resid), _bits(e_ref))


def test_error_feedback_views_and_switch():
    """On a slice of the residual (a fused buffer's segment) only that slice changes; disabled,
    the input is returned as it is and nothing is kept."""
    resid = np.arange(10, dtype=np.float32)
    ef = ErrorFeedback(resid)
    acc = ef.accumulate(np.ones(4, np.float32), 3, 7)
    assert np.shares_memory(acc, resid) and acc.tolist() == [4.0, 5.0, 6.0, 7.0]
    ef.sent(np.array([0, 2]), 3, 7)
    assert resid.tolist() == [0, 1, 2, 0, 5, 0, 7, 7, 8, 9]
    off = ErrorFeedback(resid.copy(), enabled=False)
    x = np.full(4, 2.0, np.float32)
    assert off.accumulate(x, 3, 7) is x
    before = off.residual.copy()
    off.sent(np.array([1]), 3, 7)
    assert np.array_equal(off.residual, before)


def test_exact_topk_selects_the_largest_magnitudes():
    x = np.array([0.1, -5.0, 3.0, -0.2, 4.0], np.float32)
    assert sorted(exact_topk(x, 2).tolist()) == [1, 4]
    assert sorted(exact_topk(x, 9).tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kw", [{"n_dense": -1}, {"K": 1.5}, {"K": True}])
def test_bad_rows(kw):
    with pytest.raises(ValueError, match="sparse row needs a whole number >= 0"):
        SparseRow(**kw)
