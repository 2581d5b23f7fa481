"""MPI checks of the substrate; run as ``python -m mpi4py substrate_checks.py CHECK [R]``.

Every check compares against an independent reference computed on every rank and against the
closed-form volumes; verdicts are collective (all ranks fail together).
"""

import sys

import numpy as np
from mpi4py import MPI

from substrate import Topology, bucketed_allreduce, collective_check
from volume import collectives as cm


def topo_2x2(R):
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
    p = t.size
    ok = (t.num_nodes == p // R and t.ranks_per_node == R and t.node == t.rank // R
          and t.local_rank == t.rank % R and t.is_leader == (t.rank % R == 0)
          and (t.inter is not None) == t.is_leader and t.intra.size == R
          and np.array_equal(t.node_of, np.arange(p) // R)
          # GPUs belong to the real node: on this one host every rank's device index is its
          # local rank on the host, never a virtual node's local rank
          and t.gpu_index == t.rank and t.real_node_ranks == p)
    if t.inter is not None:
        ok = ok and t.inter.size == p // R and t.inter.rank == t.node
        ok = ok and t.inter.link == ("inter" if p // R > 1 else "none")
    ok = ok and t.intra.link == ("intra" if R > 1 else "none")
    collective_check(t.world, ok, f"topology wrong: {t.describe()} local={t.local_rank}")


def ring_inter(R):
    """Ring all-reduce of n float32 on the leaders records exactly 2(M-1)*4n inter bytes."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
    M = t.num_nodes
    for n in (1000, 1001, 7):  # also counts the ring cannot split evenly: the total is exact
        t.recorder.ledger.reset()
        if t.inter is not None:
            x = np.full(n, t.node + 1.0, dtype=np.float32)
            t.inter.allreduce(x, phase="inter_allreduce")
            collective_check(t.inter, np.all(x == M * (M + 1) / 2), "wrong sum")
        tot = t.recorder.ledger.totals(t.world)
        e = tot["by_phase"].get("inter_allreduce", {})
        want = 2 * (M - 1) * 4 * n
        ok = (tot["inter_node_bytes"] == want and tot["intra_node_bytes"] == 0
              and e.get("calls") == 1 and e.get("messages") == 2 * (M - 1) * M
              and e.get("payload_bytes") == 4 * n * M)
        collective_check(t.world, ok, f"n={n}: measured {tot}, want inter {want}")
    # the same over all p = M*P ranks (node-major ring): M * 2(p-1)/p * n across nodes
    t.recorder.ledger.reset()
    p = t.size
    n = 64 * p
    x = np.ones(n, dtype=np.float32)
    t.world.allreduce(x, "avg", phase="world_allreduce")
    tot = t.recorder.ledger.totals(t.world)
    want = cm.ring_allreduce_wire_bytes(4 * n, p, M if M > 1 else 0)
    collective_check(t.world, np.all(x == 1) and tot["inter_node_bytes"] == want["inter"]
                     and tot["intra_node_bytes"] == want["intra"]
                     and want["inter"] == (M * 2 * (p - 1) * 4 * n // p if M > 1 else 0),
                     f"world ring: {tot} vs {want}")


def p2p(R):
    """Point-to-point bytes and message counts exact, per link class."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
    w, p, r = t.world, t.size, t.rank
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 500, size=(p, p))  # sizes[i, j] float64 from i to j (same everywhere)
    reqs, bufs = [], {}
    for j in range(p):
        if j != r:
            bufs[j] = np.empty(sizes[j, r], dtype=np.float64)
            reqs.append(w.irecv(bufs[j], j, tag=5, phase="p2p"))
    for j in range(p):
        if j != r:
            reqs.append(w.isend(np.full(sizes[r, j], r * 100.0 + j), j, tag=5, phase="p2p"))
    w.waitall(reqs)
    ok = all(np.all(bufs[j] == j * 100.0 + r) for j in bufs)
    tot = t.recorder.ledger.totals(w)
    node = np.arange(p) // R
    inter = sum(8 * sizes[i, j] for i in range(p) for j in range(p) if node[i] != node[j])
    intra = sum(8 * sizes[i, j] for i in range(p) for j in range(p)
                if i != j and node[i] == node[j])
    e = tot["by_phase"].get("p2p", {"inter_bytes": 0, "intra_bytes": 0, "messages": 0})
    ok = ok and e["inter_bytes"] == inter and e["intra_bytes"] == intra
    ok = ok and e["messages"] == p * (p - 1)
    collective_check(w, ok, f"p2p: measured {e}, want inter {inter} intra {intra}")


def mask_or(R):
    """Bitwise-OR all-reduce of packed uint8 masks equals the OR of every rank's mask."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
    nbits = 1237
    masks = [np.random.default_rng(100 + i).random(nbits) < 0.1 for i in range(t.size)]
    want = np.logical_or.reduce(masks)
    packed = np.packbits(masks[t.rank])
    t.world.allreduce(packed, "bor", phase="mask_or")
    got = np.unpackbits(packed, count=nbits).astype(bool)
    tot = t.recorder.ledger.totals(t.world)
    ok = np.array_equal(got, want)
    # 155 bytes do not split evenly over p ranks: the wire total is still exactly 2(p-1)n
    ok = ok and tot["inter_node_bytes"] + tot["intra_node_bytes"] == 2 * (t.size - 1) * packed.size
    collective_check(t.world, ok, f"mask OR wrong: {tot}")
    try:
        t.world.allreduce(np.zeros(3, np.float32), "bor", phase="x")
        collective_check(t.world, False, "bor on float32 did not raise")
    except ValueError as exc:
        collective_check(t.world, "packbits" in str(exc), str(exc))


def bucketed(R):
    """Bucketed all-reduce equals per-tensor all-reduce; plan and buffers reused."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
    rng = np.random.default_rng(t.rank)
    shapes = [(3, 5), (1000,), (7, 7, 3), (1,), (4096,), (2, 2)] * 5
    ts = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ref = [x.copy() for x in ts]
    for x in ref:
        t.world.allreduce(x, phase="per_tensor")
    bucket_bytes = 8192
    bucketed_allreduce(ts, t.world, bucket_bytes, phase="bucketed")
    ok = all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(ts, ref))
    plan = next(iter(t.world._bucket_plans.values()))
    nb = len(plan.buckets)
    ok = ok and all(sum(s for _, _, s in b) * 4 <= bucket_bytes or len(b) == 1
                    for b in plan.buckets)
    ids = [id(b) for b in plan.buffers]
    bucketed_allreduce(ts, t.world, bucket_bytes, phase="bucketed")
    plan2 = next(iter(t.world._bucket_plans.values()))
    ok = ok and plan2 is plan and [id(b) for b in plan2.buffers] == ids
    ok = ok and len(t.world._bucket_plans) == 1
    tot = t.recorder.ledger.totals(t.world)["by_phase"]
    ok = ok and tot["bucketed"]["calls"] == 2 * nb and tot["per_tensor"]["calls"] == len(shapes)
    # the ring's wire total is 2(p-1) n per call whatever the cut, so two bucketed rounds move
    # exactly twice the per-tensor bytes, in far fewer calls
    ok = ok and tot["bucketed"]["bytes"] == 2 * tot["per_tensor"]["bytes"]
    collective_check(t.world, ok, f"bucketed mismatch: {nb} buckets, {tot}")


def gathers(R):
    """allgather / allgatherv / alltoallv / bcast against explicit references."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
    w, p, r = t.world, t.size, t.rank
    g = w.allgather(np.array([r, r * r], dtype=np.int64), phase="ag").result
    ok = np.array_equal(g, np.array([[i, i * i] for i in range(p)]))
    v, counts = w.allgatherv(np.arange(r + 2, dtype=np.float64) + 10 * r, phase="agv").result
    ok = ok and np.array_equal(counts, np.arange(p) + 2) and np.array_equal(
        v, np.concatenate([np.arange(i + 2) + 10.0 * i for i in range(p)]))
    sc = np.array([(r + j) % 3 for j in range(p)])
    send = np.concatenate([np.full(sc[j], 1000 * r + j, dtype=np.int32) for j in range(p)])
    out, rc = w.alltoallv(send, sc, phase="a2a").result
    ok = ok and np.array_equal(rc, [(i + r) % 3 for i in range(p)]) and np.array_equal(
        out, np.concatenate([np.full((i + r) % 3, 1000 * i + r, dtype=np.int32)
                             for i in range(p)]))
    for root in range(p):
        b = np.arange(10.0) * (root + 1) if r == root else np.zeros(10)
        w.bcast(b, root, phase="bcast")
        ok = ok and np.array_equal(b, np.arange(10.0) * (root + 1))
    tot = t.recorder.ledger.totals(w)["by_phase"]
    # binomial bcast: p-1 tree edges of 80 bytes per call, whatever the root
    ok = ok and tot["bcast"]["bytes"] == p * (p - 1) * 80 and tot["bcast"]["messages"] == p * (p - 1)
    ok = ok and tot["ag"]["bytes"] == (p - 1) * p * 16
    collective_check(w, ok, f"gathers wrong: {tot}")


def _exercise(t, rng_seed=3):
    """Every collective the project uses, on uneven sizes, zero blocks and every root; returns
    the results (to compare between modes) and checks them against mpi4py's own collectives on
    COMM_WORLD (the library's algorithms: an independent reference)."""
    w, p, r = t.world, t.size, t.rank
    ref = MPI.COMM_WORLD
    res, ok, why = [], True, []
    for count in (1, p - 1 if p > 1 else 1, 7, 1001, 4099):
        for dtype, op, mop in ((np.float64, "sum", MPI.SUM), (np.int32, "sum", MPI.SUM),
                               (np.float32, "max", MPI.MAX), (np.int64, "min", MPI.MIN),
                               (np.uint8, "bor", MPI.BOR), (np.float64, "avg", MPI.SUM)):
            rng = np.random.default_rng(1000 * r + count)
            x = (rng.integers(0, 250, count) if dtype in (np.uint8, np.int32, np.int64)
                 else rng.standard_normal(count)).astype(dtype)
            want = np.empty_like(x)
            ref.Allreduce(x, want, op=mop)
            if op == "avg":
                want = want / p
            w.allreduce(x, op, phase=f"ar_{op}")
            same = (np.allclose(x, want, rtol=1e-12, atol=1e-12) if x.dtype.kind == "f"
                    else np.array_equal(x, want))
            # every rank must hold bitwise the same result (the ring reduces each chunk once)
            allsame = all(np.array_equal(x, y) for y in ref.allgather(x))
            if not (same and allsame):
                ok = False
                why.append(f"allreduce {op} {dtype.__name__} n={count}: same={same} "
                           f"identical={allsame}")
            res.append(x.copy())
    counts = np.array([(3 * i + 1) % 4 for i in range(p)], dtype=np.int64)  # zeros included
    mine = np.arange(counts[r], dtype=np.float32) + 100 * r
    v, _c = w.allgatherv(mine, counts, phase="agv").result
    want = np.concatenate([np.arange(counts[i], dtype=np.float32) + 100 * i for i in range(p)])
    if not np.array_equal(v, want):
        ok = False
        why.append(f"allgatherv {v} != {want}")
    res.append(v)
    g = w.allgather(np.array([[r, -r], [r * r, 7]], dtype=np.int16), phase="ag").result
    if not np.array_equal(g, np.array([[[i, -i], [i * i, 7]] for i in range(p)])):
        ok = False
        why.append("allgather wrong")
    sc = np.array([(r * 5 + 3 * j) % 4 for j in range(p)], dtype=np.int64)
    send = np.concatenate([np.full(sc[j], 1000 * r + j, dtype=np.int64) for j in range(p)])
    out, rc = w.alltoallv(send, sc, phase="a2a").result  # counts exchanged first (recorded)
    want = np.concatenate([np.full((i * 5 + 3 * r) % 4, 1000 * i + r, dtype=np.int64)
                           for i in range(p)])
    if not (np.array_equal(out, want) and np.array_equal(rc, [(i * 5 + 3 * r) % 4
                                                             for i in range(p)])):
        ok = False
        why.append("alltoallv wrong")
    res.append(out)
    for root in range(p):
        b = (np.arange(13, dtype=np.float64) * (root + 1) if r == root
             else np.full(13, np.nan))
        w.bcast(b, root, phase="bcast")
        if not np.array_equal(b, np.arange(13, dtype=np.float64) * (root + 1)):
            ok = False
            why.append(f"bcast root {root} wrong")
        res.append(b)
    for _ in range(3):
        w.barrier(phase="barrier")
    if t.intra.size > 1:
        y = np.full(5, float(t.local_rank))
        t.intra.allreduce(y, phase="intra")
        res.append(y)
    if t.inter is not None and t.inter.size > 1:
        z = np.packbits(np.random.default_rng(t.node).random(99) < 0.3)
        t.inter.allreduce(z, "bor", phase="inter_or")
        res.append(z)
    return res, ok, "; ".join(why)


def exact_vs_native(R):
    """Both collective modes give the library's results, and the exact mode's ledger (the bytes
    it really handed to MPI, per destination) equals the native mode's booking (closed-form
    per-rank accounting of :mod:`substrate.costmodel`) entry by entry, on every rank."""
    out = {}
    for mode in ("exact", "native"):
        t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R, collectives=mode)
        collective_check(t.world, t.world.mode == mode and t.intra.mode == mode,
                         f"mode not propagated: {t.world.mode}, {t.intra.mode}")
        res, ok, why = _exercise(t)
        collective_check(t.world, ok, f"{mode}: {why}")
        out[mode] = (res, t.recorder.ledger.local())
    (rx, lx), (rn, ln) = out["exact"], out["native"]
    same_res = all(a.dtype == b.dtype and np.allclose(a, b, rtol=1e-12, atol=1e-12)
                   for a, b in zip(rx, rn)) and len(rx) == len(rn)
    diffs = []
    for phase in sorted(set(lx) | set(ln)):
        a, b = lx.get(phase), ln.get(phase)
        if a is None or b is None:
            diffs.append(f"{phase}: only in one mode")
            continue
        for f in ("intra_bytes", "inter_bytes", "payload_bytes", "calls", "messages"):
            if a[f] != b[f]:
                diffs.append(f"{phase}.{f}: exact {a[f]} native {b[f]}")
        if not np.isclose(a["modeled_s"], b["modeled_s"], rtol=1e-12, atol=0):
            diffs.append(f"{phase}.modeled_s differs")
    collective_check(MPI.COMM_WORLD, same_res and not diffs,
                     f"results equal: {same_res}; ledger differences: {diffs[:6]}")


def records_price_the_ledger(R):
    """The records every call logged, priced by the generic rule (:func:`substrate.calls.
    wire_bytes`, written from the algorithms' definitions), equal the bytes the exact collectives
    really handed to MPI, per phase and link class, for every algorithm on uneven sizes and every
    root: one record, two derivations."""
    from substrate.calls import wire_bytes

    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R, collectives="exact")
    _exercise(t)
    mine: dict = {}
    for call, member in t.recorder.log.pending:
        # a collective's record is logged by every member: count it once (its first member); a
        # message by its sender; an all-to-all record carries its member's own row
        if member and (call.algorithm in ("p2p", "alltoallv") or call.group[0] == t.rank):
            b = wire_bytes(call, t.placement)
            e = mine.setdefault(call.phase, [0, 0])
            e[0] += b["intra"]
            e[1] += b["inter"]
    priced: dict = {}
    for d in MPI.COMM_WORLD.allgather(mine):
        for ph, (a, b) in d.items():
            e = priced.setdefault(ph, [0, 0])
            e[0] += a
            e[1] += b
    booked = t.recorder.ledger.totals(t.world)["by_phase"]
    diffs = [f"{ph}: priced {priced.get(ph, [0, 0])} booked "
             f"{[e['intra_bytes'], e['inter_bytes']]}"
             for ph, e in booked.items() if priced.get(ph, [0, 0]) != [e["intra_bytes"],
                                                                      e["inter_bytes"]]]
    collective_check(t.world, not diffs, "; ".join(diffs[:6]))


def exact_sent_equals_formula(R):
    """Per rank, the exact ring all-reduce hands MPI ``2n - c_(i+1) - c_(i+2)`` elements, all to
    the right neighbour (second source: the chunk arithmetic written out here)."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R, collectives="exact")
    w, p, i = t.world, t.size, t.rank
    ok, why = True, ""
    for count in (1, 5, 1000, 1001, 1003):
        t.recorder.ledger.reset()
        x = np.ones(count, dtype=np.float32)
        w.allreduce(x, phase="ar")
        base, extra = divmod(count, p)
        c = [base + (j < extra) for j in range(p)]
        want = 0 if p == 1 else 4 * (2 * count - c[(i + 1) % p] - c[(i + 2) % p])
        e = t.recorder.ledger.local()["ar"]
        right_is_other_node = (i + 1) % p // R != i // R
        got = e["inter_bytes"] if right_is_other_node else e["intra_bytes"]
        other = e["intra_bytes"] if right_is_other_node else e["inter_bytes"]
        if not (got == want and other == 0 and np.all(x == p)):
            ok, why = False, f"count {count}: sent {e}, want {want}"
            break
    collective_check(w, ok, why)


def racks(R):
    """nodes_per_rack=2 adds a rack level: rack groups of 2 node leaders and rack leaders."""
    t = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R, nodes_per_rack=2)
    rack = t.levels[1]
    ok = [lv.name for lv in t.levels] == ["node", "rack"]
    ok = ok and np.array_equal(rack.unit_of, (np.arange(t.size) // R) // 2)
    if t.is_leader:
        ok = ok and rack.group is not None and rack.group.size == 2
        is_rack_leader = t.node % 2 == 0
        ok = ok and (rack.leaders is not None) == is_rack_leader
        if is_rack_leader:
            ok = ok and rack.leaders.size == t.num_nodes // 2
            x = np.ones(4)
            rack.leaders.allreduce(x, phase="rack")
            ok = ok and np.all(x == t.num_nodes // 2)
    else:
        ok = ok and rack.group is None and rack.leaders is None
    collective_check(t.world, ok, f"rack level wrong on rank {t.rank}")


def collective_fail(R):
    """A check failing on rank 1 only must fail on every rank (not hang)."""
    comm = MPI.COMM_WORLD
    collective_check(comm, comm.rank != 1, "deliberate failure on rank 1")


CHECKS = {f.__name__: f for f in (topo_2x2, ring_inter, p2p, mask_or, bucketed, gathers,
                                   racks, collective_fail, exact_vs_native,
                                   exact_sent_equals_formula, records_price_the_ledger)}

if __name__ == "__main__":
    name = sys.argv[1]
    R = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    CHECKS[name](R)
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {name}")
