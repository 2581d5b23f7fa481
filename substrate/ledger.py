"""The traffic ledger: every byte a wrapped call sends is recorded here, per phase.

Each rank records what *it* sends: payload bytes (its input buffer), wire bytes per link class
under the named algorithm (see :mod:`substrate.costmodel`), messages, and the modeled time of the
call.  :meth:`Ledger.totals` reduces the entries over the ranks at the end of a run: bytes and
messages are summed (so a collective's wire total is counted once), ``calls`` and ``modeled_s``
take the maximum over ranks (a collective is one call that every member waits for).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costmodel import INTER, INTRA

__all__ = ["Ledger", "PhaseEntry", "Predicted"]


@dataclass
class PhaseEntry:
    """Running totals of one phase label on one rank."""

    calls: int = 0
    payload_bytes: int = 0
    intra_bytes: int = 0
    inter_bytes: int = 0
    messages: int = 0
    modeled_s: float = 0.0
    links: set = field(default_factory=set)

    @property
    def link(self) -> str:
        if not self.links:
            return "none"
        if self.links == {INTRA}:
            return INTRA
        if self.links == {INTER}:
            return INTER
        return "mixed"

    def as_dict(self) -> dict:
        return {
            "link": self.link,
            "bytes": self.intra_bytes + self.inter_bytes,
            "intra_bytes": self.intra_bytes,
            "inter_bytes": self.inter_bytes,
            "payload_bytes": self.payload_bytes,
            "calls": self.calls,
            "messages": self.messages,
            "modeled_s": self.modeled_s,
        }


class Ledger:
    """Per-rank record of communication, keyed by phase label."""

    def __init__(self) -> None:
        self.entries: dict[str, PhaseEntry] = {}

    def record(self, phase: str, *, payload: int, intra: int = 0, inter: int = 0,
               messages: int = 0, modeled_s: float = 0.0, links=(), calls: int = 1) -> None:
        """Add one call's accounting to ``phase``."""
        self.add(phase, int(payload), int(intra), int(inter), int(messages), float(modeled_s),
                 links, int(calls))

    def add(self, phase: str, payload: int, intra: int, inter: int, messages: int,
            modeled_s: float, links=(), calls: int = 1) -> None:
        """:meth:`record` for values already checked: Python ``int`` counts and a ``float``
        time (a communicator's booking of a call, :class:`substrate.recorder.Booking`)."""
        e = self.entries.get(phase)
        if e is None:
            if not isinstance(phase, str) or not phase:
                raise ValueError("every communication call needs a non-empty phase label, "
                                 "e.g. phase='inter_allreduce'")
            e = self.entries[phase] = PhaseEntry()
        e.calls += calls
        e.payload_bytes += payload
        e.intra_bytes += intra
        e.inter_bytes += inter
        e.messages += messages
        e.modeled_s += modeled_s
        if links:
            e.links.update(links)

    # -- local views ----------------------------------------------------------------------------
    @property
    def modeled_s(self) -> float:
        return sum(e.modeled_s for e in self.entries.values())

    def local(self) -> dict:
        """This rank's entries as plain dicts (a copy: also the ``snap`` of :meth:`since`)."""
        return {k: v.as_dict() for k, v in self.entries.items()}

    def since(self, snap: dict) -> dict:
        """Local per-phase counters accumulated after ``snap`` (a :meth:`local`) was taken."""
        out = {}
        for k, v in self.local().items():
            old = snap.get(k)
            if old is None:
                out[k] = v
                continue
            d = {f: v[f] - old[f] for f in ("bytes", "intra_bytes", "inter_bytes",
                                             "payload_bytes", "calls", "messages", "modeled_s")}
            if d["calls"]:
                d["link"] = v["link"]
                out[k] = d
        return out

    def reset(self) -> None:
        self.entries.clear()

    # -- global view ---------------------------------------------------------------------------
    def totals(self, comm) -> dict:
        """Reduce every rank's entries over ``comm`` (a :class:`substrate.comm.Comm` or an
        mpi4py communicator).  Collective.  The reduction itself is bookkeeping and is not
        recorded.

        Returns
        -------
        dict
            ``{"inter_node_bytes", "intra_node_bytes", "messages", "modeled_s", "by_phase"}``
            in the ``traffic.measured`` schema of ``summary.json`` (docs/ARCHITECTURE.md).
        """
        mpi = getattr(comm, "mpi", comm)
        gathered = mpi.allgather(self.local())
        return merge_phase_dicts(gathered)


def merge_phase_dicts(per_rank: list[dict]) -> dict:
    """Merge per-rank ``{phase: entry}`` dicts: bytes/messages summed, calls/time maxed."""
    by_phase: dict[str, dict] = {}
    for entries in per_rank:
        for phase, e in entries.items():
            t = by_phase.get(phase)
            if t is None:
                by_phase[phase] = dict(e)
                continue
            for f in ("bytes", "intra_bytes", "inter_bytes", "payload_bytes", "messages"):
                t[f] += e[f]
            t["calls"] = max(t["calls"], e["calls"])
            t["modeled_s"] = max(t["modeled_s"], e["modeled_s"])
            if t["link"] != e["link"]:
                links = {t["link"], e["link"]} - {"none"}
                t["link"] = links.pop() if len(links) == 1 else "mixed"
    by_phase = dict(sorted(by_phase.items()))
    return {
        "inter_node_bytes": sum(e["inter_bytes"] for e in by_phase.values()),
        "intra_node_bytes": sum(e["intra_bytes"] for e in by_phase.values()),
        "messages": sum(e["messages"] for e in by_phase.values()),
        "by_phase": by_phase,
    }


class Predicted:
    """The closed-form side of a run's traffic, accumulated step by step (every rank alike).

    ``add({phase: {"intra": bytes, "inter": bytes}})`` after each step or iteration;
    :meth:`block` is the ``summary.json`` ``traffic.predicted`` block, in the measured block's
    schema (``inter_node_bytes``, ``intra_node_bytes``, ``by_phase: {phase: {"intra_bytes",
    "inter_bytes"}}``).  :meth:`state` / :meth:`from_state` carry it through a checkpoint.
    """

    def __init__(self, by_phase: dict | None = None) -> None:
        self.by_phase: dict[str, dict] = {p: dict(e) for p, e in (by_phase or {}).items()}

    def add(self, phase_bytes: dict) -> dict:
        """Add one step's ``{phase: {"intra", "inter"}}``; returns its ``{"intra", "inter"}``
        total (for the step's metrics line)."""
        step = {"intra": 0, "inter": 0}
        for phase, b in phase_bytes.items():
            e = self.by_phase.setdefault(phase, {"intra_bytes": 0, "inter_bytes": 0})
            e["intra_bytes"] += int(b["intra"])
            e["inter_bytes"] += int(b["inter"])
            step["intra"] += int(b["intra"])
            step["inter"] += int(b["inter"])
        return step

    def total(self, link: str) -> int:
        """Bytes so far on ``link`` (``"intra"`` or ``"inter"``)."""
        return sum(e[f"{link}_bytes"] for e in self.by_phase.values())

    def block(self) -> dict:
        return {"inter_node_bytes": self.total(INTER), "intra_node_bytes": self.total(INTRA),
                "by_phase": {p: dict(e) for p, e in self.by_phase.items()}}

    def state(self) -> dict:
        return {p: dict(e) for p, e in self.by_phase.items()}

    @classmethod
    def from_state(cls, state: dict) -> Predicted:
        return cls(state)
