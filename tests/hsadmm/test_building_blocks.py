"""H-SADMM building blocks against brute-force references (no MPI)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hsadmm.penalty import balance_penalty, eps_dual, eps_primal
from hsadmm.projection import (
    keep_count,
    parse_sparsity,
    project,
    structured_mask,
)
from hsadmm.shrink import MaskCodec, ShrinkPlan, kept_indices

GROUPS = {  # kind -> function giving the group id of every entry of a (Co, Ci, H, W) tensor
    "filter": lambda s: np.broadcast_to(np.arange(s[0])[:, None, None, None], s),
    "channel": lambda s: np.broadcast_to(np.arange(s[1])[None, :, None, None], s),
    "shape": lambda s: np.broadcast_to(
        np.arange(s[1] * s[2] * s[3]).reshape(1, s[1], s[2], s[3]), s),
}


def brute_force_projection(w, kind, keep):
    """Closest point of the set: try every support of alpha groups, keep the nearest."""
    gid = GROUPS[kind](w.shape)
    n = int(gid.max()) + 1
    alpha = keep_count(keep, n)
    best, best_d = None, np.inf
    for support in itertools.combinations(range(n), alpha):
        cand = np.where(np.isin(gid, support), w, 0.0)
        d = np.linalg.norm(w - cand)
        if d < best_d - 1e-12:
            best, best_d = cand, d
    return best, best_d, alpha


def n_active_groups(w, kind):
    gid = GROUPS[kind](w.shape)
    return len(np.unique(gid[w != 0]))


small = arrays(np.float64, (4, 3, 2, 2),
               elements=st.floats(-10, 10, allow_nan=False, allow_subnormal=False))


@settings(max_examples=40, deadline=None)
@given(w=small, keep=st.sampled_from([0.25, 0.5, 0.75, 1.0]),
       kind=st.sampled_from(["filter", "channel", "shape"]))
def test_projection_is_closest_point_of_its_set(w, keep, kind):
    ours = project(w, (kind,), keep)
    _ref, ref_d, alpha = brute_force_projection(w, kind, keep)
    assert n_active_groups(ours, kind) <= alpha  # in the set
    assert np.linalg.norm(w - ours) == pytest.approx(ref_d, rel=1e-9, abs=1e-9)  # and closest
    # kept entries are copied exactly, pruned ones are exactly zero
    assert np.all((ours == w) | (ours == 0))


def test_projection_ties_break_deterministically():
    w = np.ones((4, 2, 1, 1))
    a, b = project(w, ("filter",), 0.5), project(w.copy(), ("filter",), 0.5)
    assert np.array_equal(a, b) and n_active_groups(a, "filter") == 2
    assert np.array_equal(np.flatnonzero(a[:, 0, 0, 0]), [0, 1])


def test_composite_projection_is_sequential_and_in_every_set():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 6, 3, 3))
    both = project(w, parse_sparsity("channel+filter"), 0.5)
    assert np.array_equal(both, project(project(w, ("filter",), 0.5), ("channel",), 0.5))
    assert n_active_groups(both, "filter") <= 4 and n_active_groups(both, "channel") <= 3
    three = project(w, parse_sparsity("filter+channel+shape"), 0.5)
    assert n_active_groups(three, "shape") <= keep_count(0.5, 6 * 9)
    assert n_active_groups(three, "filter") <= 4
    m = structured_mask(w, ("filter", "channel"), 0.5)
    assert m.dtype == bool and np.array_equal(np.where(m, w, 0), both)


def test_fc_weight_is_treated_as_1x1_conv():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 7))
    p = project(w, ("channel",), 0.4)
    assert p.shape == w.shape
    assert np.count_nonzero(np.any(p != 0, axis=0)) == keep_count(0.4, 7)


@pytest.mark.parametrize("keep", [0, -0.1, 1.5, float("nan")])
def test_keep_outside_unit_interval_errors(keep):
    with pytest.raises(ValueError, match=r"keep rate must be in \(0, 1\]"):
        keep_count(keep, 10)


@pytest.mark.parametrize("spec", ["chanel", "filter+kernel", "", "filter+filter"])
def test_unknown_sparsity_name_errors_listing_valid(spec):
    with pytest.raises(ValueError, match="sparsity"):
        parse_sparsity(spec)
    if spec == "chanel":
        with pytest.raises(ValueError, match="filter, channel, shape"):
            parse_sparsity(spec)


def test_mask_codec_roundtrip_and_or_commutes_with_packing():
    shapes = [(4, 3, 3, 3), (10, 7), (2, 2, 1, 1)]
    rng = np.random.default_rng(2)
    codec = MaskCodec(shapes)
    a = [rng.random(s) < 0.3 for s in shapes]
    b = [rng.random(s) < 0.3 for s in shapes]
    pa, pb = codec.pack(a), codec.pack(b)
    assert pa.dtype == np.uint8 and pa.nbytes == codec.nbytes == (108 + 70 + 4 + 7) // 8
    assert all(np.array_equal(x, y) for x, y in zip(codec.unpack(pa), a))
    ored = codec.unpack(np.bitwise_or(pa, pb))  # what the bitwise-OR all-reduce computes
    assert all(np.array_equal(x, ya | yb) for x, ya, yb in zip(ored, a, b))
    with pytest.raises(ValueError, match="does not match"):
        codec.pack([a[1], a[0], a[2]])


def test_shrink_expand_roundtrip_and_layout():
    rng = np.random.default_rng(3)
    shapes = [(8, 6, 3, 3), (10,), (4, 8, 3, 3)]
    full = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    m0 = np.zeros(shapes[0], bool)
    m0[np.ix_([1, 4, 5], [0, 1, 2])] = True  # a filter+channel support
    m0[4, 1, 0, 0] = False  # a hole inside the product still travels (K_out x K_in slices)
    m2 = structured_mask(full[2], ("filter", "channel"), 0.5)
    plan = ShrinkPlan(shapes, [m0, None, m2], bucket_bytes=600)
    k_out, k_in = kept_indices(m0)
    assert k_out.tolist() == [1, 4, 5] and k_in.tolist() == [0, 1, 2]
    assert plan.compact_shape(0) == (3, 3, 3, 3) and plan.compact_shape(2) == (2, 4, 3, 3)
    assert plan.compact_size == 81 + 10 + 72
    assert plan.ratio == pytest.approx(163 / (432 + 10 + 288))
    buf = plan.shrink(full)
    assert buf is plan.buffer  # allocated once, reused
    assert np.array_equal(buf[:81].reshape(3, 3, 3, 3), full[0][np.ix_([1, 4, 5], [0, 1, 2])])
    out = [np.full(s, 7.0, np.float32) for s in shapes]
    plan.expand(buf, out)
    # recovery: compact values on K_out x K_in, exact zeros elsewhere (PruneX §4.4.3)
    ref0 = np.zeros_like(full[0])
    ref0[np.ix_([1, 4, 5], [0, 1, 2])] = full[0][np.ix_([1, 4, 5], [0, 1, 2])]
    assert np.array_equal(out[0], ref0)
    assert np.array_equal(out[1], full[1])
    ko, ki = kept_indices(m2)
    ref2 = np.zeros_like(full[2])
    ref2[np.ix_(ko, ki)] = full[2][np.ix_(ko, ki)]
    assert np.array_equal(out[2], ref2)
    # buckets tile the buffer at layer boundaries
    assert plan.buckets[0][0] == 0 and plan.buckets[-1][1] == plan.compact_size
    assert all(a[1] == b[0] for a, b in zip(plan.buckets, plan.buckets[1:]))
    assert all(e in plan.offsets for bk in plan.buckets for e in bk)


def test_balance_penalty_rules_cap_and_dual_rescale():
    rho = np.array([1.0, 1.0, 1.0, 8.0])
    r = np.array([100.0, 1.0, 1.0, 100.0])
    s = np.array([1.0, 100.0, 2.0, 1.0])
    new, scale = balance_penalty(rho, r, s)
    assert new.tolist() == [2.0, 0.5, 1.0, 10.0]  # up, down, unchanged, capped at 10
    assert scale.tolist() == [0.5, 2.0, 1.0, 0.8]
    with pytest.raises(ValueError, match="mu > 1"):
        balance_penalty(rho, r, s, mu=1.0)


def test_stopping_thresholds():
    assert eps_primal(100, 3.0, 4.0, 1e-2, 1e-1) == pytest.approx(10 * 1e-2 + 0.4)
    assert eps_dual([4, 9], [1.0, 2.0], 1.0, 0.5).tolist() == [2.5, 4.0]
