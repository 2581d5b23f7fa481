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
all-reduce and the step's end; the evaluation is, per batch, ``eval_batch``, SpFF (prefix
``eval``) and ``eval_scores``, then the scores' all-reduce; an inference pass is the start
barrier, per batch ``infer_batch``, SpFF (prefix ``infer``: Graph Challenge semantics) and
``infer_categories``, then the categories' all-reduce; the set-up is the partition broadcast
(when rank 0 partitioned) and, for training, the net's set-up (``net_setup``: the maps and the
row blocks).  Collectives block, after everything before them.  With ``overlap`` false
(``--overlap off``) a send names no block: it goes out after everything before it.
"""

from __future__ import annotations

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
    "eval_program",
    "infer_program",
    "layer_of",
    "pass_program",
    "setup_program",
    "step_program",
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


class _Writer:
    """Lays an interval's records (``(record, tag)``, in order) into one rank's program."""

    def __init__(self, records, layers: int, placement, rank: int, *, overlap: bool,
                 receives_first: bool) -> None:
        self.b = Builder()
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
        me = self.rank
        rows = call.pairs.tolist()
        receives = [(src, nb) for src, dst, nb in rows if dst == me != src]
        sends = [Call(call.phase, "p2p", call.group, pairs=((me, dst, nb),),
                      label=f"{call.phase}[{k}]")
                 for src, dst, nb in rows if src == me != dst]
        return receives, sends

    def _receive(self, receives, tag: int, group) -> list[int]:
        return [self.b.receive(src, nb, tag, group) for src, nb in receives]

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
            group = call.group if call is not None else ()
            posted = self._receive(receives, k, group) if self.receives_first else []
            pack = b.block(block_label(prefix, PACK, k))
            sent = self._send(sends, pack, k)
            if not self.receives_first:
                posted = self._receive(receives, k, group)
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
                group = call.group if call is not None else ()
                posted = self._receive(receives, tag, group) if self.receives_first else []
                remote = b.block(block_label(BACKWARD, REMOTE, k))
                sent = self._send(sends, remote, tag)
                if not self.receives_first:
                    posted = self._receive(receives, tag, group)
                b.block(block_label(BACKWARD, LOCAL, k))
            update = b.block(block_label(BACKWARD, UPDATE, k))
            if exchange:
                if posted:
                    b.waitall(posted)
                b.block(block_label(BACKWARD, DELTA, k), deps=[update, *sent])
                if sent:
                    b.waitall(sent)


def _writer(records, layers, placement, rank, overlap, receives_first) -> _Writer:
    return _Writer(records, layers, placement, rank, overlap=overlap,
                   receives_first=receives_first)


def step_program(records, layers: int, placement, rank: int, *, overlap: bool = True,
                 receives_first: bool = True) -> list:
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
    """
    w = _writer(records, layers, placement, rank, overlap, receives_first)
    w.b.block(BATCH)
    w.forward(PHASE_SPFF)
    w.backward()
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

