"""``python -m commvol reproduce PAPER|all``: each seed paper's headline figure beside our
prediction of the same configuration.

A figure is a :class:`Figure`: the paper's numbers (:mod:`commvol.papers`' TOML files, every
value with the sentence it is quoted from), our prediction of each (the job simulation on the
paper's cluster file, :mod:`substrate.clusters`), their ratio, and the inputs the prediction
used (:class:`Input`: value and source; the inputs table in ``docs/`` lists them all).  One
module per paper (``prunex``, ``ssfusion``, ``pactrain``, ``hsgd``, ``sdp``) exposes
``figures(quick: bool) -> list[Figure]``; :data:`PAPERS` names them.

Nothing is derived from the result being predicted: a value a result implies may be printed in
a row's ``diagnosis`` beside a miss, never used as an input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PAPERS", "Figure", "Input", "Row"]

#: the papers ``reproduce`` knows, in the order ``all`` runs them (module names here)
PAPERS = ("prunex", "ssfusion", "pactrain", "hsgd", "sdp")


@dataclass(frozen=True)
class Input:
    """One input of a prediction: its value and where it comes from (the paper's text, a named
    datasheet, or a per-device constant measured or published once and used everywhere)."""

    name: str
    value: object
    unit: str
    source: str


@dataclass
class Row:
    """One number of a figure: the paper's (``None`` when only plotted) and ours."""

    series: str
    at: str                       # the x value, e.g. "64 GPUs"
    quantity: str                 # e.g. "speedup vs 8 GPUs"
    unit: str
    paper: float | None
    ours: float | None
    #: when |ours / paper - 1| > 15 %: the mechanism the model lacks, the single input that
    #: would have to change to match, its implied value and whether that is plausible
    diagnosis: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.paper in (None, 0) or self.ours is None:
            return None
        return self.ours / self.paper


@dataclass
class Figure:
    paper: str                    # a name of PAPERS
    id: str                       # the figure's id in the paper's TOML, e.g. "fig9"
    title: str
    rows: list[Row]
    inputs: list[Input] = field(default_factory=list)
    note: str = ""
