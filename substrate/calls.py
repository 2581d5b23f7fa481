"""The call record: the one description of a communication, and what is derived from it.

Every communication of every system is a :class:`Call`: its ledger phase, its algorithm (ring
all-reduce, ring all-gather(v), binomial broadcast, dissemination barrier, direct messages,
pairwise all-to-all), the world ranks of its communicator in communicator order, its size, and
what it waits for (``after``).  The same record is

* **executed**: :class:`substrate.comm.Comm` builds the record of each call it runs, books the
  bytes its algorithm handed to MPI and records the call in the rank's program
  (:class:`substrate.recorder.Recorder`);
* **planned**: each system's pure plan lists the records of one step or iteration,
  ``plan.calls(placement)``, for any world and any rank-to-node map (:class:`Placement`),
  without MPI;
* **priced**: the functions below derive, from a record and a placement alone, the wire bytes per
  link class (:func:`wire_bytes`), the messages (:func:`messages`) and the α–β seconds each
  member books (:func:`rank_seconds`: a bound, nothing overlapped or shared); :func:`price`
  sums a list of records per phase and per rank.  Its time in a job is the job simulation's
  (:mod:`simulation.jobsim`, from the rounds of :mod:`substrate.schedule`).

Nothing else restates a call's bytes or time: a new system needs a plan with
``calls()`` and a strategy that executes it.  :mod:`volume` (closed forms written from the
papers) is the independent second source the plans' records are tested against.

Algorithms (``nbytes`` meaning in brackets), as :mod:`substrate.costmodel` defines them:

==============  =======================================================================
``allreduce``   ring reduce-scatter + all-gather [buffer bytes; ``itemsize`` fixes the chunks]
``allgather``   ring all-gather(v) [``blocks``: bytes contributed by each member]
``bcast``       binomial tree from ``root`` (communicator rank) [buffer bytes]
``barrier``     dissemination [no bytes]
``p2p``         direct messages ``pairs`` = ``(src, dst, bytes)`` world ranks; ``group`` is
                the communicator (the ranks of a node that send at once share its link)
``alltoallv``   pairwise direct [``blocks``: the ``p x p`` byte matrix, row = sender]
==============  =======================================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import schedule
from .costmodel import INTER, INTRA, CostModel

__all__ = [
    "ALGORITHMS",
    "Call",
    "CallLog",
    "Placement",
    "Priced",
    "Ready",
    "Work",
    "bytes_by_phase",
    "calls_of_rank",
    "messages",
    "price",
    "rank_seconds",
    "seconds_of",
    "slowest_link",
    "wire_bytes",
]

ALGORITHMS = ("allreduce", "allgather", "bcast", "barrier", "p2p", "alltoallv")


# -- placement ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Which node each world rank runs on (any layout a launcher or hostfile produces).

    Node ids are numbered ``0..M-1`` in the order of their lowest world rank (the order
    :func:`substrate.topology.assign_nodes` gives), so a node's **leader** is its lowest rank and
    the leaders' communicator lists them in node order.  The groups a topology builds follow the
    same rules: :attr:`world` (all ranks), :meth:`members` (one node's ranks, in rank order),
    :attr:`leaders`.

    Parameters
    ----------
    node_of : sequence of int
        Node of every world rank (any labels; renumbered to the canonical order).
    """

    node_of: tuple

    def __post_init__(self) -> None:
        raw = np.asarray(self.node_of)
        if raw.ndim != 1 or raw.size == 0:
            raise ValueError(f"a placement needs one node id per rank, got {self.node_of!r}")
        if raw.dtype.kind not in "iu" or (raw < 0).any():
            raise ValueError(f"node ids must be non-negative integers, got {raw.tolist()}")
        _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
        rank_of_label = np.argsort(np.argsort(first))      # label -> canonical id
        canon = rank_of_label[inverse].astype(np.int64)
        object.__setattr__(self, "node_of", tuple(int(n) for n in canon))
        object.__setattr__(self, "_nodes", canon)

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def node_major(cls, nodes: int, ranks_per_node: int) -> Placement:
        """``M`` nodes of ``P`` consecutive ranks (``mpiexec`` block placement, virtual nodes)."""
        M, P = _positive(nodes, "nodes"), _positive(ranks_per_node, "ranks per node")
        return cls(tuple(int(r) // P for r in range(M * P)))

    @classmethod
    def round_robin(cls, nodes: int, ranks_per_node: int) -> Placement:
        """Rank ``r`` on node ``r mod M`` (a hostfile of ``M`` hosts with one slot each, cycled;
        ``mpiexec -ppn 1`` over ``M`` hosts)."""
        M, P = _positive(nodes, "nodes"), _positive(ranks_per_node, "ranks per node")
        return cls(tuple(int(r) % M for r in range(M * P)))

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> Placement:
        """Consecutive ranks on nodes of the given (possibly unequal) sizes."""
        sizes = [_positive(s, "node size") for s in sizes]
        return cls(tuple(m for m, s in enumerate(sizes) for _ in range(s)))

    @classmethod
    def parse(cls, text: str, size: int) -> Placement:
        """A ``--node-map`` for ``size`` ranks: ``block:R`` (nodes of ``R`` consecutive ranks),
        ``round-robin:R`` (``size / R`` nodes, rank ``r`` on node ``r mod (size / R)``: a
        hostfile cycled over the hosts) or the node of every rank (``0,1,0,1``)."""
        text = str(text).strip()
        example = "e.g. --node-map round-robin:2, block:2 or 0,1,0,1"
        kind, _, arg = text.partition(":")
        if kind in ("block", "round-robin"):
            try:
                R = int(arg)
            except ValueError:
                R = 0
            if R < 1 or size % R:
                raise ValueError(f"--node-map {text!r}: {kind}:R needs R ranks per node, a "
                                 f"positive divisor of the {size} ranks; {example}")
            M = size // R
            return cls.node_major(M, R) if kind == "block" else cls.round_robin(M, R)
        try:
            nodes = [int(x) for x in text.replace(" ", "").split(",")]
        except ValueError:
            raise ValueError(f"--node-map {text!r}: not a placement; {example}") from None
        if len(nodes) != size or min(nodes) < 0:
            raise ValueError(f"--node-map {text!r}: gives {len(nodes)} node ids for {size} "
                             f"ranks (one non-negative id per rank); {example}")
        return cls(tuple(nodes))

    # -- views -----------------------------------------------------------------------------------
    @property
    def nodes_array(self) -> np.ndarray:
        return self._nodes  # type: ignore[attr-defined]

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return int(self.nodes_array.max()) + 1

    @property
    def node_sizes(self) -> tuple:
        return tuple(int(c) for c in np.bincount(self.nodes_array))

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks per node when every node holds the same number, else ``None``."""
        s = set(self.node_sizes)
        return s.pop() if len(s) == 1 else None

    @property
    def node_major_layout(self) -> bool:
        """True when the nodes hold consecutive ranks."""
        return bool(np.all(np.diff(self.nodes_array) >= 0))

    @property
    def world(self) -> tuple:
        return tuple(range(self.size))

    def _groups(self) -> tuple:
        """Every node's world ranks in rank order, computed once (a program generator asks
        for them once per rank and call: at 4,096 ranks a scan per question is quadratic)."""
        groups = self.__dict__.get("_members")
        if groups is None:
            order = np.argsort(self.nodes_array, kind="stable")
            cuts = np.cumsum(np.bincount(self.nodes_array))[:-1]
            groups = tuple(tuple(int(r) for r in g) for g in np.split(order, cuts))
            object.__setattr__(self, "_members", groups)
        return groups

    def members(self, node: int) -> tuple:
        """World ranks of ``node``, in rank order (its intra-node communicator)."""
        groups, node = self._groups(), int(node)
        return groups[node] if 0 <= node < len(groups) else ()

    @property
    def leaders(self) -> tuple:
        """The lowest world rank of every node, in node order (the leaders' communicator)."""
        return tuple(g[0] for g in self._groups())

    def node(self, rank: int) -> int:
        return self.node_of[int(rank)]

    def local_rank(self, rank: int) -> int:
        return self.members(self.node(rank)).index(int(rank))

    def is_leader(self, rank: int) -> bool:
        return self.local_rank(rank) == 0

    def link(self, a: int, b: int) -> str:
        return INTRA if self.node_of[int(a)] == self.node_of[int(b)] else INTER

    def spans(self, ranks) -> bool:
        """True when ``ranks`` live on more than one node."""
        node_of = self.node_of
        first = None
        for r in ranks:     # plain ints, stopping at the first other node: called per call
            n = node_of[r]
            if first is None:
                first = n
            elif n != first:
                return True
        return False

    def describe(self) -> str:
        if self.ranks_per_node and self.node_major_layout:
            return f"node-major, {self.num_nodes} x {self.ranks_per_node}"
        if self.ranks_per_node and self == Placement.round_robin(self.num_nodes,
                                                                 self.ranks_per_node):
            return f"round-robin, {self.num_nodes} x {self.ranks_per_node}"
        return f"node of each rank {list(self.node_of)}"


def _positive(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{what} must be a positive integer, got {v!r}")
    return int(v)


# -- the record -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """``after`` token of a plan: the backward event that writes gradients ``flat[lo:hi]``."""

    lo: int
    hi: int


@dataclass(frozen=True)
class Work:
    """A compute item of a plan beside the model's layers (a selection, a packing, a decode),
    listed among its calls so that a rank's program (:class:`substrate.program.Placer`) runs it
    where the system runs it: a block on ``stream`` (``"compute"``, or ``"offload"``: a CPU
    worker beside it) after what ``after`` names.  Every rank does it; executed it runs the
    system's compute callback of its ``label``, simulated it costs a roofline of ``flops`` and
    ``nbytes`` plus a launch overhead for each of its ``kernels`` (one item that works tensor by
    tensor launches its kernels once per tensor).  Not priced as communication."""

    label: str
    flops: float = 0.0
    nbytes: float = 0.0
    after: tuple = ()
    stream: str = "compute"
    kernels: int = 1

    def involves(self, rank: int) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class Call:
    """One communication (see the module docstring).

    Attributes
    ----------
    phase : str
        Ledger label.
    algorithm : str
        One of :data:`ALGORITHMS`.
    group : tuple of int
        World ranks of the communicator, in communicator order (the ring's order).
    nbytes : int
        ``allreduce`` / ``bcast``: the buffer's bytes.  Other algorithms: the sum of their
        ``blocks`` / ``pairs`` (set automatically).
    itemsize : int
        Bytes per element (fixes a ring all-reduce's chunks).
    blocks : tuple of int, optional
        ``allgather``: bytes each member contributes; ``alltoallv``: the ``p x p`` byte matrix,
        row-major (row = sender, in communicator order).
    pairs : numpy.ndarray, optional
        ``p2p``: ``(m, 3)`` int64 rows ``(src, dst, bytes)`` of world ranks.
    root : int
        ``bcast``: communicator rank of the root.
    op : str, optional
        Reduction (``sum``, ``avg``, ``max``, ``min``, ``bor``): not priced, part of the record.
    after : tuple
        What the call waits for: indices of earlier records of the same list, :class:`Ready`
        tokens, or other tokens the declaring code resolves (e.g. ``"local"``).  At run time
        the :class:`~substrate.comm.Comm` method's ``after=`` holds program entries instead.
    label : str, optional
        A name of the record in its plan (default: the phase).
    wait : bool
        How the system issues it: blocking (default), or handed to the communication stream
        (``False``: it runs while the rank computes, until its handle is waited for; only when
        the run overlaps, ``--overlap on``).  Not part of :meth:`key`.
    """

    phase: str
    algorithm: str
    group: tuple
    nbytes: int = 0
    itemsize: int = 1
    blocks: tuple | None = None
    pairs: np.ndarray | None = field(default=None, repr=False)
    root: int = 0
    op: str | None = None
    after: tuple = ()
    label: str | None = None
    wait: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.phase, str) or not self.phase:
            raise ValueError(f"a call needs a non-empty phase label, got {self.phase!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"call {self.phase!r}: unknown algorithm {self.algorithm!r}; use "
                             f"one of {ALGORITHMS}")
        group = tuple(int(r) for r in self.group)
        if not group or len(set(group)) != len(group):
            raise ValueError(f"call {self.phase!r}: group must list distinct world ranks, got "
                             f"{self.group!r}")
        object.__setattr__(self, "group", group)
        p = len(group)
        itemsize = int(self.itemsize)
        if itemsize < 1:
            raise ValueError(f"call {self.phase!r}: itemsize must be >= 1, got {itemsize}")
        object.__setattr__(self, "itemsize", itemsize)
        if self.algorithm in ("allreduce", "bcast"):
            nb = int(self.nbytes)
            if nb < 0 or nb % itemsize:
                raise ValueError(f"call {self.phase!r}: nbytes {self.nbytes} must be a "
                                 f"non-negative multiple of itemsize {itemsize}")
            object.__setattr__(self, "nbytes", nb)
            if self.algorithm == "bcast" and not 0 <= int(self.root) < p:
                raise ValueError(f"call {self.phase!r}: bcast root {self.root} outside a group "
                                 f"of {p}")
        elif self.algorithm == "allgather":
            blocks = tuple(int(b) for b in (self.blocks or ()))
            if len(blocks) != p or min(blocks) < 0:
                raise ValueError(f"call {self.phase!r}: an all-gather needs one block size >= 0 "
                                 f"per member ({p}), got {self.blocks!r}")
            object.__setattr__(self, "blocks", blocks)
            object.__setattr__(self, "nbytes", sum(blocks))
        elif self.algorithm == "alltoallv":
            blocks = tuple(int(b) for b in (self.blocks or ()))
            if len(blocks) != p * p or min(blocks) < 0:
                raise ValueError(f"call {self.phase!r}: an all-to-all needs a {p} x {p} byte "
                                 f"matrix, got {len(blocks)} entries")
            object.__setattr__(self, "blocks", blocks)
            object.__setattr__(self, "nbytes", sum(blocks))
        elif self.algorithm == "p2p":
            pairs = np.asarray(self.pairs if self.pairs is not None else np.zeros((0, 3)),
                               dtype=np.int64).reshape(-1, 3)
            if (pairs < 0).any():
                raise ValueError(f"call {self.phase!r}: message ranks and sizes must be >= 0")
            pairs.setflags(write=False)
            object.__setattr__(self, "pairs", pairs)
            object.__setattr__(self, "nbytes", int(pairs[:, 2].sum()))
        else:  # barrier
            object.__setattr__(self, "nbytes", 0)
        object.__setattr__(self, "after", tuple(self.after))

    # -- identity --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready record (``after`` and ``label`` left out: run-time dependencies are
        events, not plan tokens)."""
        d = {"phase": self.phase, "algorithm": self.algorithm, "group": list(self.group),
             "nbytes": self.nbytes, "itemsize": self.itemsize, "root": self.root,
             "op": self.op}
        if self.blocks is not None:
            d["blocks"] = list(self.blocks)
        if self.pairs is not None:
            d["pairs"] = self.pairs.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Call:
        return cls(d["phase"], d["algorithm"], tuple(d["group"]), nbytes=d.get("nbytes", 0),
                   itemsize=d.get("itemsize", 1), root=d.get("root", 0), op=d.get("op"),
                   blocks=tuple(d["blocks"]) if "blocks" in d else None,
                   pairs=np.asarray(d["pairs"], dtype=np.int64).reshape(-1, 3)
                   if "pairs" in d else None)

    def key(self) -> tuple:
        """Everything that defines the communication (not its dependencies or label): equal
        keys send the same messages."""
        pairs = None if self.pairs is None else self.pairs.tobytes()
        return (self.phase, self.algorithm, self.group, self.nbytes, self.itemsize, self.blocks,
                pairs, self.root if self.algorithm == "bcast" else 0, self.op)

    @cached_property
    def key_repr(self) -> str:
        """``repr(self.key())``, worked out once (the call log digests it per call)."""
        return repr(self.key())

    def __eq__(self, other) -> bool:
        return isinstance(other, Call) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    @property
    def size(self) -> int:
        return len(self.group)

    def involves(self, rank: int) -> bool:
        """Whether world rank ``rank`` takes part (for ``p2p``: sends in it)."""
        if self.algorithm == "p2p":
            return bool(np.any(self.pairs[:, 0] == int(rank)))
        return int(rank) in self.group


# -- pricing --------------------------------------------------------------------------------------
def _nodes(call: Call, placement: Placement) -> np.ndarray:
    return placement.nodes_array[np.asarray(call.group, dtype=np.int64)]


def slowest_link(call: Call, placement: Placement) -> str:
    """The link class a collective is timed at (the ledger's convention): ``inter`` when its
    communicator spans nodes (any ring or tree over it then crosses one), else ``intra``."""
    return INTER if placement.spans(call.group) else INTRA


def wire_bytes(call: Call, placement: Placement) -> dict:
    """``{"intra": bytes, "inter": bytes}`` the call puts on the wire (all members together):
    the messages of its algorithm's schedule (:func:`substrate.schedule.of_call`), each on the
    link between its two members' nodes."""
    src, dst, nb, _ = schedule.of_call(call).table()
    if not nb.size:
        return {INTRA: 0, INTER: 0}
    nodes = _nodes(call, placement)
    inter = int(nb[nodes[src] != nodes[dst]].sum())
    return {INTRA: int(nb.sum()) - inter, INTER: inter}


def messages(call: Call) -> int:
    """Messages of the call, summed over its members (the ledger's count): its schedule's."""
    return int(schedule.of_call(call).table()[3].sum())


def _collective_seconds(call: Call, cost: CostModel, link: str) -> float:
    p = call.size
    if call.algorithm == "allreduce":
        return cost.ring_allreduce_time(call.nbytes, p, link)
    if call.algorithm == "allgather":
        return cost.ring_allgather_time(call.nbytes, p, link)
    if call.algorithm == "bcast":
        return cost.bcast_time(call.nbytes, p, link)
    if call.algorithm == "barrier":
        return cost.barrier_time(p, link)
    raise AssertionError(call.algorithm)


def rank_seconds(call: Call, cost: CostModel, placement: Placement) -> dict:
    """``{world rank: seconds}``: the α–β time each member books for the call.

    A collective costs every member the algorithm's time at its slowest link (every member waits
    for the whole collective); direct messages cost their sender ``α + n β`` each; a pairwise
    all-to-all costs each sender the sum over its non-empty blocks.
    """
    a = call.algorithm
    if a == "p2p":
        # vectorized (H-SGD at P = 512 prices millions of messages): per message
        # alpha + n beta on its link, exactly CostModel.p2p_time, summed per sender in row order
        pr = call.pairs[call.pairs[:, 0] != call.pairs[:, 1]]
        if not pr.shape[0]:
            return {}
        src = pr[:, 0]
        cross = placement.nodes_array[src] != placement.nodes_array[pr[:, 1]]
        t = (np.where(cross, cost.alpha(INTER), cost.alpha(INTRA))
             + pr[:, 2] * np.where(cross, cost.beta(INTER), cost.beta(INTRA)))
        per = np.bincount(src, weights=t, minlength=placement.size)
        return {int(r): float(per[r]) for r in np.unique(src)}
    if a == "alltoallv":
        p = call.size
        m = np.asarray(call.blocks, dtype=np.int64).reshape(p, p)
        out = {}
        for i, src in enumerate(call.group):
            out[src] = sum(cost.p2p_time(int(m[i, j]), placement.link(src, dst))
                           for j, dst in enumerate(call.group) if j != i and m[i, j])
        return out
    t = _collective_seconds(call, cost, slowest_link(call, placement)) if call.size > 1 else 0.0
    return {r: t for r in call.group}


def seconds_of(call: Call, cost: CostModel, placement: Placement, rank: int) -> float:
    """World rank ``rank``'s entry of :func:`rank_seconds` (0 when it books nothing), priced
    for that rank alone: what a communicator books for its own part of every call, without
    building the whole group's dict (a collective costs every member the same)."""
    if call.algorithm in ("p2p", "alltoallv") or rank not in call.group:
        return rank_seconds(call, cost, placement).get(rank, 0.0)
    return _collective_seconds(call, cost, slowest_link(call, placement)) if call.size > 1 \
        else 0.0


@dataclass
class Priced:
    """A list of records priced (:func:`price`): per phase wire bytes, messages and the busiest
    rank's seconds, and every world rank's seconds."""

    phases: dict
    messages: dict
    seconds: dict
    rank_s: tuple

    @property
    def intra(self) -> int:
        return int(sum(v[INTRA] for v in self.phases.values()))

    @property
    def inter(self) -> int:
        return int(sum(v[INTER] for v in self.phases.values()))


def price(calls: Sequence[Call], placement: Placement, cost: CostModel | None = None) -> Priced:
    """Sum ``calls`` per phase: wire bytes per link class (:func:`wire_bytes`), messages
    (:func:`messages`), the phase's seconds on its busiest rank, and each world rank's total
    seconds (:func:`rank_seconds`; the ledger's ``modeled_s`` takes the same maximum)."""
    cost = cost or CostModel()
    phases: dict = {}
    msgs: dict = {}
    per_rank: dict = {}
    for c in calls:
        if not isinstance(c, Call):
            continue
        b = wire_bytes(c, placement)
        e = phases.setdefault(c.phase, {INTRA: 0, INTER: 0})
        e[INTRA] += b[INTRA]
        e[INTER] += b[INTER]
        msgs[c.phase] = msgs.get(c.phase, 0) + messages(c)
        v = per_rank.setdefault(c.phase, np.zeros(placement.size))
        for r, s in rank_seconds(c, cost, placement).items():
            v[r] += s
    seconds = {ph: float(v.max()) for ph, v in per_rank.items()}
    total = sum(per_rank.values(), np.zeros(placement.size))
    return Priced(phases, msgs, seconds, tuple(float(t) for t in total))


def bytes_by_phase(calls: Sequence[Call], placement: Placement) -> dict:
    """``{phase: {"intra": bytes, "inter": bytes}}`` of ``calls`` (the run's ``predicted``
    block, step by step)."""
    out: dict = {}
    for c in calls:
        if not isinstance(c, Call):
            continue
        b = wire_bytes(c, placement)
        e = out.setdefault(c.phase, {INTRA: 0, INTER: 0})
        e[INTRA] += b[INTRA]
        e[INTER] += b[INTER]
    return out


# -- a rank's records ---------------------------------------------------------------------------
def calls_of_rank(calls: Sequence[Call], rank: int) -> list[int]:
    """Indices of the records world rank ``rank`` has in its program: the calls it takes
    part in, and every call these wait for (through ``after`` indices) that it does not take
    part in (it waits for them: e.g. a follower's broadcast waits for the leaders' phase)."""
    need = [c.involves(rank) for c in calls]
    for i in range(len(calls) - 1, -1, -1):
        if need[i]:
            for d in calls[i].after:
                if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
                    if not 0 <= d < i:
                        raise ValueError(f"call {i} ({calls[i].phase}) waits for call {d}: "
                                         "after= may only name earlier calls of the list")
                    need[d] = True
    return [i for i, n in enumerate(need) if n]


def _own_records(calls: Sequence, rank: int) -> list[Call]:
    """The records of ``calls`` world rank ``rank`` executes, one per executed call (a direct-
    message record becomes one record per message ``rank`` sends, in order)."""
    out = []
    for c in calls:
        if not isinstance(c, Call) or not c.involves(rank):
            continue
        if c.algorithm == "p2p":
            mine = c.pairs[c.pairs[:, 0] == rank]
            out.extend(Call(c.phase, "p2p", c.group, pairs=row[None, :], op=c.op)
                       for row in mine)
        elif c.algorithm == "alltoallv":
            p = c.size
            m = np.zeros((p, p), dtype=np.int64)
            i = c.group.index(rank)
            m[i] = np.asarray(c.blocks, dtype=np.int64).reshape(p, p)[i]
            out.append(Call(c.phase, "alltoallv", c.group, blocks=tuple(m.reshape(-1).tolist()),
                            itemsize=c.itemsize, op=c.op))
        else:
            out.append(c)
    return out


class CallLog:
    """The records a rank executed (or waited for), in order: a count and a SHA-256 chained
    over their keys (a run and its replay, and a resumed run and the uninterrupted one, agree
    call for call), and the records since the last :meth:`check` (which holds them against the
    plan's).  :meth:`state` / :meth:`load_state` carry the count and the digest through a
    checkpoint."""

    #: records kept for one :meth:`check` at most (a command that never checks keeps counting)
    MAX_PENDING = 100_000

    def __init__(self) -> None:
        self.count = 0
        self.pending: list[tuple[Call, bool]] = []
        self.overflow = False
        self._digest = hashlib.sha256().digest()

    def add(self, call: Call, member: bool = True) -> None:
        self.count += 1
        # chained (digest of the previous digest and this record), so the state is two values
        # (the text is repr((call.key(), member)), with the key's repr kept by the record)
        line = f"({call.key_repr}, {member!r})".encode()
        self._digest = hashlib.sha256(self._digest + line).digest()
        if len(self.pending) < self.MAX_PENDING:
            self.pending.append((call, member))
        else:
            self.overflow = True

    def check(self, planned: Sequence, rank: int) -> None:
        """Hold the calls executed since the last check against ``planned`` (the plan's records
        of that interval): the records ``rank`` takes part in must be the same, in the same
        order (``ValueError`` naming the first difference); then start a new interval."""
        ran = [c for c, member in self.pending if member]
        overflow, self.pending, self.overflow = self.overflow, [], False
        if overflow:
            return          # more than MAX_PENDING calls in one interval: not checked
        want = _own_records(planned, rank)
        if [c.key() for c in ran] == [c.key() for c in want]:
            return
        for k, (a, b) in enumerate(zip(ran, want)):
            if a.key() != b.key():
                raise ValueError(f"rank {rank}: call {k} of the interval differs from the "
                                 f"plan: ran {_show(a)}, planned {_show(b)}")
        extra = ran[len(want):] or want[len(ran):]
        side = "ran" if len(ran) > len(want) else "planned"
        raise ValueError(f"rank {rank}: {len(ran)} calls ran, {len(want)} planned; first "
                         f"{side} only: {_show(extra[0])}")

    @property
    def digest(self) -> str:
        return self._digest.hex()

    def describe(self) -> dict:
        return {"count": self.count, "sha256": self.digest}

    def state(self) -> dict:
        """The count and digest (JSON-able), for a checkpoint."""
        return {"count": self.count, "sha256": self.digest}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state` (the calls since, still to be checked, are kept)."""
        self.count = int(state["count"])
        self._digest = bytes.fromhex(state["sha256"])


def _show(c: Call) -> str:
    if c.algorithm == "allgather":
        what = f"blocks {list(c.blocks)}"
    elif c.algorithm == "alltoallv":
        what = "a byte matrix"
    elif c.algorithm == "p2p":
        what = f"messages {c.pairs.tolist()}"
    elif c.algorithm == "barrier":
        what = "no bytes"
    else:
        what = f"{c.nbytes} bytes"
    return f"{c.phase} ({c.algorithm} over ranks {list(c.group)}, {what})"
