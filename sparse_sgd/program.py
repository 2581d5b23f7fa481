"""H-SGD's intervals as rank programs (:mod:`substrate.program`), generated from the plan.

Every interval of ``sparse_sgd train`` / ``infer`` (the set-up, a training step, the held-out
evaluation, an inference pass) is a program written here from the plan's records
(:meth:`sparse_sgd.plan.HSGDPlan.tagged_calls`) for one rank of any placement, without MPI,
and run by the one executor (:class:`substrate.executor.Executor`), the net binding only its
maps' buffers and the SpMM/SDDMM compute of each block (:class:`sparse_sgd.distributed.
DistributedSparseNet`).  A ``p2p`` record is one layer's exchange of every sender's messages
(the paper's send/recv maps, §4-§5); a rank's part of it is a receive ``R`` per message it gets
(from ``n``: the rows ``x̂^{k-1}_{mn}``) and a send ``C`` per message it sends, each one message
with the exchange's tag.

SpFF of layer k (Alg. 2), blocks named ``{prefix}_{part}[k]``::

    R ...                    line 8: the receives posted first (a CUDA-aware GPU net posts
                             them after its sends: see ``receives_first``)
    B pack[k]                line 4: the rows each receiver uses, gathered
    C ... after pack         line 5: one send per receiver, on the communication stream
    B local[k]               line 6: W^k_local x^{k-1}, while the messages travel
    A receives               line 8
    B remote[k] after local and the sends    lines 9-10: W^k_remote x̂^{k-1}, f
    A sends

SpBP of layer k (Alg. 3), for k = L..1 after ``spbp_output`` (line 2: delta^L)::

    R ...                    k >= 2: the partial sums of the rows this rank sent in SpFF
    B spbp_remote[k]         line 4, the part sent: W^k_remote^T delta^k
    C ... after it           lines 5-7: one send per owner of the received rows
    B spbp_local[k]          line 4, the local part
    B spbp_update[k]         lines 8-9: the SDDMM update and the bias, while the messages travel
    A receives
    B spbp_delta[k] after the update and the sends    lines 10-13: delta^{k-1}
    A sends

(``s^1`` would only give ``delta^0``: layer 1 has the update only.)  A training step is the
batch (``batch``), SpFF of every layer, SpBP, the class scores (``class_scores``), the loss
all-reduce and the step's end (with ``loss`` false: Alg. 1's lines 2-9 alone, the paper's
timed step, §6.2); the evaluation is, per batch, ``eval_batch``, SpFF (prefix
``eval``) and ``eval_scores``, then the scores' all-reduce; an inference pass is the start
barrier, per batch ``infer_batch``, SpFF (prefix ``infer``: Graph Challenge semantics) and
``infer_categories``, then the categories' all-reduce; the set-up is the partition broadcast
(when rank 0 partitioned) and, for training, the net's set-up (``net_setup``: the maps and the
row blocks).  Collectives block, after everything before them.  With ``overlap`` false
(``--overlap off``) a send names no block: it goes out after everything before it.

:func:`step_programs` writes every rank's step at once (a job at paper scale): each exchange is
split by rank once, not once per rank.  :func:`layer_counts` and :func:`block_work` give what
each block of a rank computes and moves through memory (FLOPs and bytes, the job simulation's
roofline at paper scale).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from sparse_sgd.plan import PHASE_EVAL, PHASE_SPBP, PHASE_SPFF
from substrate.calls import Call
from substrate.program import Builder

__all__ = [
    "BACKWARD",
    "BATCH",
    "CLASS_SCORES",
    "EVAL_BATCH",
    "EVAL_SCORES",
    "INFER",
    "INFER_BATCH",
    "INFER_CATEGORIES",
    "NET_SETUP",
    "block_label",
    "block_work",
    "eval_program",
    "infer_program",
    "layer_counts",
    "layer_of",
    "pass_program",
    "setup_program",
    "step_program",
    "step_programs",
]

#: blocks of the trainer around the net's passes
BATCH = "batch"
CLASS_SCORES = "class_scores"
EVAL_BATCH = "eval_batch"
EVAL_SCORES = "eval_scores"
INFER_BATCH = "infer_batch"
INFER_CATEGORIES = "infer_categories"
NET_SETUP = "net_setup"
#: block prefixes: a forward pass names its blocks after its records' phase (``spff``,
#: ``eval``), inference after itself; the backward pass after its records' phase (``spbp``)
INFER = "infer"
BACKWARD = PHASE_SPBP
#: the parts of a layer's SpFF and SpBP
PACK, LOCAL, REMOTE = "pack", "local", "remote"
OUTPUT, UPDATE, DELTA = "output", "update", "delta"


def block_label(prefix: str, part: str, k: int | None = None) -> str:
    """The label of a block: ``{prefix}_{part}[k]`` (``{prefix}_{part}`` without a layer)."""
    return f"{prefix}_{part}" if k is None else f"{prefix}_{part}[{k}]"


def layer_of(call: Call) -> int:
    """The layer ``k`` of a message of a generated program (its label ``{phase}[k]``)."""
    label = call.label or ""
    if not label.endswith("]") or "[" not in label:
        raise ValueError(f"call {call.phase!r} is not a message of an H-SGD program (label "
                         f"{call.label!r})")
    return int(label[label.rindex("[") + 1:-1])


class _Exchange:
    """One ``p2p`` record's messages split by rank once: a rank's receives ``(source,
    bytes)`` and its sends, one record per message, each in the record's order."""

    def __init__(self, call: Call, placement) -> None:
        self.call = call
        #: the group every receive entry of the exchange names (one list, shared)
        self.group = list(call.group)
        pairs = call.pairs
        src, dst = pairs[:, 0], pairs[:, 1]
        moved = np.flatnonzero(src != dst)
        by_src = moved[np.argsort(src[moved], kind="stable")]
        by_dst = moved[np.argsort(dst[moved], kind="stable")]
        self._send = (by_src, np.searchsorted(src[by_src], np.arange(placement.size + 1)))
        self._recv = (by_dst, np.searchsorted(dst[by_dst], np.arange(placement.size + 1)))

    def receives(self, rank: int) -> list[tuple[int, int]]:
        order, ptr = self._recv
        rows = self.call.pairs[order[ptr[rank]:ptr[rank + 1]]]
        return list(zip(rows[:, 0].tolist(), rows[:, 2].tolist()))

    def sends(self, rank: int, label: str) -> list[Call]:
        """One record per message ``rank`` sends.  The first is validated as any record; the others differ from it only in their pair and its
        bytes (rows of the validated exchange), so they are copies of it with those two set
        (a job of 512 ranks sends ~10^5 messages an exchange; each record's check walks the
        world group)."""
        order, ptr = self._send
        idx = order[ptr[rank]:ptr[rank + 1]]
        if not idx.size:
            return []
        pairs = self.call.pairs
        first = Call(self.call.phase, "p2p", self.call.group, pairs=pairs[idx[0]:idx[0] + 1],
                     label=label)
        out = [first]
        for i in idx[1:].tolist():
            m = object.__new__(Call)
            m.__dict__.update(first.__dict__)
            m.__dict__["pairs"] = pairs[i:i + 1]
            m.__dict__["nbytes"] = int(pairs[i, 2])
            out.append(m)
        return out


class _Writer:
    """Lays an interval's records (``(record, tag)``, in order) into one rank's program."""

    def __init__(self, records, layers: int, placement, rank: int, *, overlap: bool,
                 receives_first: bool, exchanges: dict | None = None) -> None:
        self.b = Builder()
        #: ``{id(record): _Exchange}``: every exchange split by rank once (shared by the writers
        #: of one set of records)
        self.exchanges = {} if exchanges is None else exchanges
        self.records = list(records)
        self.next = 0
        self.L = int(layers)
        self.placement = placement
        self.rank = int(rank)
        self.overlap = bool(overlap)
        self.receives_first = bool(receives_first)

    def _take(self, tag: int):
        """The next record when it is the exchange of ``tag`` (``None``: nobody sends in it)."""
        if self.next < len(self.records) and self.records[self.next][1] == tag:
            self.next += 1
            return self.records[self.next - 1][0]
        return None

    def collective(self) -> None:
        """The next record: a collective of the world, blocking, after everything before."""
        if self.next >= len(self.records):
            raise ValueError("the interval's records end before its collective")
        call, tag = self.records[self.next]
        if tag is not None or call.algorithm == "p2p" or not call.wait:
            raise ValueError(f"record {self.next} ({call.phase}) is not a blocking collective "
                             "where the interval has one")
        self.next += 1
        self.b.call(call, None)

    def end(self) -> list:
        if self.next != len(self.records):
            call, tag = self.records[self.next]
            raise ValueError(f"record {self.next} ({call.phase}, tag {tag}) has no place in "
                             "the program (records of another interval or network?)")
        return self.b.entries

    # -- an exchange -----------------------------------------------------------------------------
    def _messages(self, call: Call | None, k: int):
        """This rank's part of ``call``: ``(receives [(source, bytes)], sends [one record per
        message])``, each in the record's order (senders, then receivers, ascending)."""
        if call is None:
            return [], []
        ex = self.exchanges.get(id(call))
        if ex is None:
            ex = self.exchanges[id(call)] = _Exchange(call, self.placement)
        return ex.receives(self.rank), ex.sends(self.rank, f"{call.phase}[{k}]")

    def _receive(self, receives, tag: int, call: Call | None) -> list[int]:
        """Post ``receives``; their entries share one list of the exchange's group (a job
        of P ranks posts ~P messages' receives a layer, each naming the world)."""
        if not receives:
            return []
        group = self.exchanges[id(call)].group
        posted = [self.b.receive(src, nb, tag, ()) for src, nb in receives]
        for i in posted:
            self.b.entries[i][4] = group
        return posted

    def _send(self, sends, filled: int, tag: int) -> list[int]:
        """The sends of the block ``filled`` filled, on the communication stream after it."""
        after = [filled] if self.overlap else None
        return [self.b.call(m, after, wait=False, tag=tag) for m in sends]

    # -- the passes ------------------------------------------------------------------------------
    def forward(self, prefix: str) -> None:
        """SpFF of every layer (Alg. 2)."""
        b = self.b
        for k in range(1, self.L + 1):
            call = self._take(k)
            receives, sends = self._messages(call, k)
            posted = self._receive(receives, k, call) if self.receives_first else []
            pack = b.block(block_label(prefix, PACK, k))
            sent = self._send(sends, pack, k)
            if not self.receives_first:
                posted = self._receive(receives, k, call)
            local = b.block(block_label(prefix, LOCAL, k))
            if posted:
                b.waitall(posted)
            b.block(block_label(prefix, REMOTE, k), deps=[local, *sent])
            if sent:
                b.waitall(sent)

    def backward(self) -> None:
        """SpBP of every layer with the weight update (Alg. 3)."""
        b, L = self.b, self.L
        b.block(block_label(BACKWARD, OUTPUT))
        for k in range(L, 0, -1):
            tag = L + k
            exchange = k > 1            # s^1 would only give delta^0: nothing to send
            if exchange:
                call = self._take(tag)
                receives, sends = self._messages(call, k)
                posted = self._receive(receives, tag, call) if self.receives_first else []
                remote = b.block(block_label(BACKWARD, REMOTE, k))
                sent = self._send(sends, remote, tag)
                if not self.receives_first:
                    posted = self._receive(receives, tag, call)
                b.block(block_label(BACKWARD, LOCAL, k))
            update = b.block(block_label(BACKWARD, UPDATE, k))
            if exchange:
                if posted:
                    b.waitall(posted)
                b.block(block_label(BACKWARD, DELTA, k), deps=[update, *sent])
                if sent:
                    b.waitall(sent)


def _writer(records, layers, placement, rank, overlap, receives_first,
            exchanges=None) -> _Writer:
    return _Writer(records, layers, placement, rank, overlap=overlap,
                   receives_first=receives_first, exchanges=exchanges)


def step_program(records, layers: int, placement, rank: int, *, overlap: bool = True,
                 receives_first: bool = True, loss: bool = True) -> list:
    """The program of one training step of world rank ``rank``.

    Parameters
    ----------
    records : sequence
        The step's records with their tags (:meth:`~sparse_sgd.plan.HSGDPlan.tagged_calls`
        ``(interval="step")``).
    layers : int
        L.
    placement : substrate.calls.Placement
    rank : int
    overlap : bool
        ``--overlap``: the sends go out on the communication stream after the block that
        filled them (else blocking).
    receives_first : bool
        Post a layer's receives before its pack (the CPU and a host-staged GPU net); a
        CUDA-aware GPU net posts them after its sends, whose host wait covers the kernels
        that read the device block they land in.
    loss : bool
        The trainer's class scores and loss all-reduce after SpBP (default).  False: the step
        of Alg. 1 alone (lines 2-9: SpFF, SpBP and the update for one batch), the quantity the
        paper times (§6.2); ``records``' collectives are then left out.
    """
    if not loss:
        records = [(c, t) for c, t in records if t is not None]
    return _step(_writer(records, layers, placement, rank, overlap, receives_first), loss)


def step_programs(records, layers: int, placement, *, overlap: bool = True,
                  receives_first: bool = True, loss: bool = True) -> list[list]:
    """:func:`step_program` of every rank of ``placement`` (each exchange split by rank once)."""
    if not loss:
        records = [(c, t) for c, t in records if t is not None]
    exchanges: dict = {}
    return [_step(_writer(records, layers, placement, r, overlap, receives_first, exchanges),
                  loss) for r in range(placement.size)]


def _step(w: _Writer, loss: bool) -> list:
    w.b.block(BATCH)
    w.forward(PHASE_SPFF)
    w.backward()
    if loss:
        w.b.block(CLASS_SCORES)
        w.collective()
    w.b.step()
    return w.end()


def pass_program(records, layers: int, placement, rank: int, prefix: str, *,
                 overlap: bool = True, receives_first: bool = True) -> list:
    """One pass of the net alone (a check drives it pass by pass): SpFF (``prefix`` the
    blocks' prefix: ``spff``, ``eval`` or ``infer``) of ``records``' SpFF exchanges, or SpBP
    (``prefix`` ``spbp``) of their SpBP exchanges; no step end.  ``records`` as
    :func:`step_program`'s (a step's, or one inference batch's)."""
    backward = prefix == BACKWARD
    mine = [(c, t) for c, t in records if t is not None and (t > layers) == backward]
    w = _writer(mine, layers, placement, rank, overlap, receives_first)
    if backward:
        w.backward()
    else:
        w.forward(prefix)
    return w.end()


def eval_program(records, layers: int, batches: int, placement, rank: int, *,
                 overlap: bool = True, receives_first: bool = True) -> list:
    """The held-out evaluation (``records``: ``tagged_calls(interval="eval")``): per batch of
    ``batches`` its staging, SpFF and class scores, then the scores' all-reduce (none without
    images).  No step end: the run loop closes the evaluation's step."""
    w = _writer(records, layers, placement, rank, overlap, receives_first)
    for _ in range(batches):
        w.b.block(EVAL_BATCH)
        w.forward(PHASE_EVAL)
        w.b.block(EVAL_SCORES)
    if batches:
        w.collective()
    return w.end()


def infer_program(records, layers: int, batches: int, placement, rank: int, *,
                  overlap: bool = True, receives_first: bool = True) -> list:
    """Graph Challenge inference (``records``: ``tagged_calls(interval="infer")``): the start
    barrier, per batch its staging, SpFF (prefix ``infer``) and its categories, then the
    categories' all-reduce."""
    w = _writer(records, layers, placement, rank, overlap, receives_first)
    w.collective()
    for _ in range(batches):
        w.b.block(INFER_BATCH)
        w.forward(INFER)
        w.b.block(INFER_CATEGORIES)
    w.collective()
    return w.end()


def setup_program(records, placement, rank: int, *, net: bool) -> list:
    """The set-up: its records (``tagged_calls(interval="setup")`` when rank 0 partitioned, or
    none), then with ``net`` the net's set-up block."""
    w = _writer(records, 0, placement, rank, False, True)
    for _ in records:
        w.collective()
    if net:
        w.b.block(NET_SETUP)
    return w.end()



# -- what a rank's blocks compute, at any scale ----------------------------------------------------
#: bytes of a CSR column index or row pointer (SciPy's int32 for every network here) and of a
#: gather list entry (int64)
INDEX_BYTES = 4
GATHER_BYTES = 8


class LayerCounts:
    """Per layer ``k`` (index k - 1) and rank ``m``, shape ``(L, P)``: the rows of W^k it owns
    (``rows``), its entries of x^{k-1} (``prev_rows``), the nonzeros of its row block whose
    column it owns (``nnz_local``: W^k_local of Alg. 2, line 6) and the others (``nnz_remote``:
    W^k_remote, line 9), the words of x^{k-1} it sends in SpFF (``sent``: sum over n of
    D^k[n, m], eq. 8) and receives (``received``: sum over n of D^k[m, n], eq. 9)."""

    def __init__(self, rows, prev_rows, nnz_local, nnz_remote, sent, received) -> None:
        self.rows, self.prev_rows = rows, prev_rows
        self.nnz_local, self.nnz_remote = nnz_local, nnz_remote
        self.sent, self.received = sent, received

    @property
    def num_layers(self) -> int:
        return int(self.rows.shape[0])


def layer_counts(weights, partition, metrics) -> LayerCounts:
    """:class:`LayerCounts` of ``partition`` (its :class:`partition.PartitionMetrics`
    ``metrics``: ``pair_words[k-1, m, n]`` = D^k[m, n])."""
    P, owners = partition.parts, partition.owners
    shape = (len(weights), P)
    rows, prev, nl, nr = (np.zeros(shape, dtype=np.int64) for _ in range(4))
    for k, W in enumerate(weights, start=1):
        A = sp.coo_matrix(W)
        own_row, own_col = owners[k][A.row], owners[k - 1][A.col]
        local = own_row == own_col
        rows[k - 1] = np.bincount(owners[k], minlength=P)
        prev[k - 1] = np.bincount(owners[k - 1], minlength=P)
        nl[k - 1] = np.bincount(own_row[local], minlength=P)
        nr[k - 1] = np.bincount(own_row[~local], minlength=P)
    D = np.asarray(metrics.pair_words)
    return LayerCounts(rows, prev, nl, nr, D.sum(axis=1), D.sum(axis=2))


def block_work(counts: LayerCounts, rank: int, batch: int, itemsize: int,
               act_flops: int) -> dict[str, tuple[float, float]]:
    """``{label: (FLOPs, bytes)}`` of every block of ``rank``'s training step
    (:func:`step_program`) on ``batch`` input vectors of ``itemsize``-byte values.

    FLOPs are the net's own counts (:class:`sparse_sgd.distributed.DistributedSparseNet`'s
    block table: 2 a nonzero a vector, the bias, ``act_flops`` an element of f and f').  Bytes
    are each block's compulsory memory traffic (Williams et al., "Optimization of sparse
    matrix-vector multiplication on emerging multicore platforms", SC'07: a CSR product
    streams every value and column index once and reads and writes each vector once): a
    product of n nonzeros on r rows moves ``n (itemsize + 4) + 4 (r + 1)`` bytes of matrix,
    the SDDMM update reads and writes the values, a gather reads its index list; vectors are
    ``batch x itemsize`` bytes a row.  The batch staging and the class scores are not counted
    (O(N) once a step).
    """
    c, B, s = counts, int(batch), int(itemsize)
    v = B * s                                # bytes of one row of a vector block
    out: dict[str, tuple[float, float]] = {BATCH: (0.0, 0.0), CLASS_SCORES: (0.0, 0.0)}
    L = c.num_layers
    rows_L = float(c.rows[L - 1, rank])
    out[block_label(BACKWARD, OUTPUT)] = ((4 + act_flops) * rows_L * B, 3 * rows_L * v)
    for k in range(1, L + 1):
        r, rp = float(c.rows[k - 1, rank]), float(c.prev_rows[k - 1, rank])
        nl, nr = float(c.nnz_local[k - 1, rank]), float(c.nnz_remote[k - 1, rank])
        sent, got = float(c.sent[k - 1, rank]), float(c.received[k - 1, rank])
        ptr = INDEX_BYTES * (r + 1)
        out[block_label(PHASE_SPFF, PACK, k)] = (sent * B, 2 * sent * v + GATHER_BYTES * sent)
        out[block_label(PHASE_SPFF, LOCAL, k)] = ((2 * nl + r) * B,
                                                   nl * (s + INDEX_BYTES) + ptr + rp * v
                                                   + r * v + r * s)
        out[block_label(PHASE_SPFF, REMOTE, k)] = ((2 * nr + act_flops * r) * B,
                                                    nr * (s + INDEX_BYTES) + ptr + got * v
                                                    + 3 * r * v)
        out[block_label(BACKWARD, UPDATE, k)] = (2 * (nl + nr) * B + 2 * r * B,
                                                 (nl + nr) * (2 * s + INDEX_BYTES) + 2 * ptr
                                                 + r * v + (rp + got) * v + 2 * r * s)
        if k == 1:                  # s^1 would only give delta^0: layer 1 has the update only
            continue
        out[block_label(BACKWARD, REMOTE, k)] = (2 * nr * B, nr * (s + INDEX_BYTES) + ptr
                                                 + r * v + got * v)
        out[block_label(BACKWARD, LOCAL, k)] = (2 * nl * B, nl * (s + INDEX_BYTES) + ptr
                                                + r * v + rp * v)
        out[block_label(BACKWARD, DELTA, k)] = (sent * B + (1 + act_flops) * rp * B,
                                                2 * sent * v + GATHER_BYTES * sent + 3 * rp * v)
    return out
