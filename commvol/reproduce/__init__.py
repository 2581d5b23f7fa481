"""``python -m commvol reproduce PAPER|all [--out DIR] [--quick]``: each seed paper's headline
figure beside our prediction of the same configuration.

A figure is a :class:`Figure`: the paper's numbers (:mod:`commvol.papers`' TOML files, every
value with the sentence it is quoted from), our prediction of each (the job simulation on the
paper's cluster file, :mod:`simulation.clusters`), their ratio, and the inputs the prediction
used (:class:`Input`: value and source; the inputs table in ``docs/`` lists them all).  One
module per paper (``prunex``, ``ssfusion``, ``pactrain``, ``hsgd``, ``sdp``) exposes
``figures(quick: bool) -> list[Figure]`` and, optionally, ``inputs() -> list[Input]`` (the
inputs of its figures without running them; a figure's inputs do not depend on ``quick``);
:data:`PAPERS` names them.

Nothing is derived from the result being predicted: a value a result implies may be printed in
a row's ``diagnosis`` beside a miss, never used as an input.  A row within :data:`TOLERANCE` of
the paper passes; any other row states in its ``diagnosis`` the mechanism the model lacks, the
single input that would have to change to match, its implied value and whether that is
plausible.

The command (:mod:`commvol.reproduce.command`) prints one table per figure, and with ``--out
DIR`` writes ``DIR/REPRODUCE.md`` (``REPRODUCE-<paper>.md`` for one paper), one PNG per figure
under ``DIR/reproduce/`` and ``DIR/INPUTS.md``, the one table of every input of every paper
(:func:`commvol.reproduce.render.inputs_markdown`).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:        # Python 3.10
    import tomli as tomllib

__all__ = [
    "PAPERS",
    "TOLERANCE",
    "Figure",
    "Input",
    "Row",
    "all_inputs",
    "cluster_inputs",
    "figure_toml",
    "load_paper",
    "paper_module",
    "paper_value",
    "serial_diagnosis",
    "serial_time",
]

#: the papers ``reproduce`` knows, in the order ``all`` runs them (module names here)
PAPERS = ("prunex", "ssfusion", "pactrain", "hsgd", "sdp")
#: a row within this fraction of the paper's number passes without a diagnosis
TOLERANCE = 0.15
#: the papers' stated numbers (:mod:`commvol.papers`)
PAPERS_DIR = Path(__file__).resolve().parent.parent / "papers"


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
    #: how ``paper`` follows from the paper's stated numbers when it is not one of them verbatim
    #: (e.g. ``"1 + 28.7 %"``); empty: the TOML's value itself
    derived: str = ""

    @property
    def ratio(self) -> float | None:
        if self.paper in (None, 0) or self.ours is None:
            return None
        return self.ours / self.paper

    @property
    def within(self) -> bool | None:
        """Whether ours is within :data:`TOLERANCE` of the paper (``None``: nothing to
        compare)."""
        r = self.ratio
        return None if r is None else abs(r - 1) <= TOLERANCE + 1e-12

    @property
    def status(self) -> str:
        """``ok`` (within), ``explained`` (a miss with its diagnosis), ``MISS`` (a miss
        without one: a failing row) or ``-`` (nothing to compare)."""
        w = self.within
        if w is None:
            return "-"
        if w:
            return "ok"
        return "explained" if self.diagnosis else "MISS"


@dataclass
class Figure:
    paper: str                    # a name of PAPERS
    id: str                       # the figure's id in the paper's TOML, e.g. "fig9"
    title: str
    rows: list[Row]
    inputs: list[Input] = field(default_factory=list)
    note: str = ""


# -- the papers' numbers ------------------------------------------------------------------------
def load_paper(paper: str) -> dict:
    """The paper's TOML (:mod:`commvol.papers`), parsed."""
    path = PAPERS_DIR / f"{paper}.toml"
    if not path.is_file():
        raise ValueError(f"no stated numbers for paper {paper!r} (expected {path}); papers: "
                         f"{', '.join(PAPERS)}")
    return tomllib.loads(path.read_text())


def figure_toml(paper: str, fig: str) -> dict:
    """The ``[[figure]]`` table ``fig`` of ``paper``'s TOML."""
    figs = {f["id"]: f for f in load_paper(paper).get("figure", [])}
    if fig not in figs:
        raise ValueError(f"{paper}: no figure {fig!r} in its TOML; figures: {sorted(figs)}")
    return figs[fig]


def paper_value(paper: str, fig: str, *, series: str, quantity: str, at: dict | None = None,
                vs: str | None = None, key: str | None = None):
    """The stated number of one point of ``paper``'s figure ``fig``: its ``value``, its
    ``range`` (a ``[lo, hi]`` pair), its ``values`` table or, with ``key``, one entry of it.

    Raises
    ------
    ValueError
        When no stated point or more than one matches (naming what was asked).
    """
    hits = []
    for pt in figure_toml(paper, fig).get("points", []):
        if not pt.get("stated", False) or pt.get("series") != series or \
                pt.get("quantity") != quantity:
            continue
        if vs is not None and pt.get("vs") != vs:
            continue
        if at is not None and any(pt.get("at", {}).get(k) != v for k, v in at.items()):
            continue
        hits.append(pt)
    what = f"{paper} {fig}: series {series!r}, quantity {quantity!r}, at {at}, vs {vs}"
    if len(hits) != 1:
        raise ValueError(f"{what}: {len(hits)} stated points match (need exactly one)")
    pt = hits[0]
    if key is not None:
        return pt["values"][key]
    if "value" in pt:
        return pt["value"]
    if "range" in pt:
        return tuple(pt["range"])
    if "values" in pt:
        return dict(pt["values"])
    raise ValueError(f"{what}: the point states no value, range or values")


# -- inputs ------------------------------------------------------------------------------------
#: the cluster file's numbers a prediction reads, as ``(section, key)``
CLUSTER_KEYS = (("device", "peak_tflops"), ("device", "memory_gbs"), ("device", "efficiency"),
                ("device", "launch_us"), ("node", "devices"), ("node", "fabric"),
                ("node", "fabric_gbps"), ("node", "fabric_latency_us"), ("node", "nics"),
                ("node", "nic_gbps"), ("node", "nic_latency_us"), ("library", "call_us"),
                ("library", "transport"))
_UNITS = {"peak_tflops": "TFLOP/s", "memory_gbs": "GB/s", "efficiency": "of peak",
          "launch_us": "us a kernel", "fabric_gbps": "Gbit/s", "nic_gbps": "Gbit/s",
          "fabric_latency_us": "us", "nic_latency_us": "us", "call_us": "us a call",
          "devices": "a node", "nics": "a node"}


def cluster_inputs(cluster) -> list[Input]:
    """The numbers of ``cluster`` (:class:`simulation.cluster.Cluster`) a job simulation reads,
    each with its source from the file (``"default of simulation.cluster"`` where the file sets
    none), named ``<cluster file>: <section>.<key>``."""
    name = Path(cluster.path).stem if cluster.path else cluster.name
    out = []
    for section, key in CLUSTER_KEYS:
        if section == "node" and key.startswith("fabric") and cluster.node.devices == 1:
            continue                     # one device a node: no fabric traffic
        value = getattr(getattr(cluster, section), key)
        src = cluster.sources.get(f"{section}.{key}",
                                  "default of simulation.cluster (the file sets none)")
        out.append(Input(f"{name}: {section}.{key}", value, _UNITS.get(key, ""), src))
    return out


def toml_input(paper: str, fig: str, name: str, *, value=None, unit: str | None = None,
               prefix: str | None = None) -> Input:
    """An input of the paper's TOML (``[figure.inputs.<name>]``) as an :class:`Input` named
    ``<prefix or paper>.<name>``; ``value`` overrides the TOML's (e.g. one of a list)."""
    spec = figure_toml(paper, fig).get("inputs", {}).get(name)
    if spec is None:
        raise ValueError(f"{paper} {fig}: no input {name!r} in its TOML")
    v = spec.get("value", spec.get("range")) if value is None else value
    src = spec.get("source", "")
    if not spec.get("stated", False):
        src = f"not stated in the paper: {src}"
    return Input(f"{prefix or paper}.{name}", v, unit if unit is not None else
                 spec.get("unit", ""), src)


def paper_module(paper: str):
    """The module of ``paper`` (``commvol.reproduce.<paper>``), or ``None`` when there is none
    yet."""
    if paper not in PAPERS:
        raise ValueError(f"unknown paper {paper!r}; papers: {', '.join(PAPERS)} (or all)")
    try:
        return importlib.import_module(f"{__name__}.{paper}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{paper}":
            return None
        raise


def all_inputs(papers=PAPERS) -> list[tuple[str, Input]]:
    """``(paper, input)`` of every paper's figures (a module's ``inputs()``, or the inputs of
    its quick figures), in order, each (name, value) once."""
    out, seen = [], set()
    for paper in papers:
        mod = paper_module(paper)
        if mod is None:
            continue
        if hasattr(mod, "inputs"):
            items = list(mod.inputs())
        else:
            items = [i for f in mod.figures(quick=True) for i in f.inputs]
        for i in items:
            k = (i.name, repr(i.value))
            if k not in seen:
                seen.add(k)
                out.append((paper, i))
    return out


# -- diagnoses ---------------------------------------------------------------------------------
def serial_time(t0: float, t1: float, speedup: float) -> float:
    """The fixed time ``c`` with ``(t0 + c) / (t1 + c) = speedup`` (Amdahl's serial part)."""
    return (t0 - speedup * t1) / (speedup - 1)


def serial_diagnosis(t0: float, t1: float, g0: int, g1: int, paper_speedup: float,
                     what: str = "epoch") -> str:
    """Amdahl's reading of a strong-scaling miss: the fixed time ``c`` a ``what`` would need,
    the same at every GPU count and absent from the model (data loading, evaluation, start-up,
    host synchronization), for ``(t0 + c) / (t1 + c)`` to equal the paper's speedup between
    ``g0`` and ``g1`` GPUs; ``c / t0`` says how plausible it is."""
    S = float(paper_speedup)
    ours = t0 / t1
    if S >= ours:
        return (f"the paper's {S:.2f}x is above ours ({ours:.2f}x) and the ideal "
                f"{g1 / g0:g}x bounds both: the model charges the {g1}-GPU {what} more than "
                "the paper measured (a cost that grows with the GPU count is overstated)")
    c = serial_time(t0, t1, S)
    share = c / t0
    verdict = ("plausible: a data loader's start-up and an evaluation pass take about that "
               "each epoch" if share <= 0.1 else
               "too large for data loading and evaluation alone: the cost must also grow "
               "with the GPU count, which the model does not charge")
    return (f"no serial part: every cost of the model shrinks with the GPU count (compute) or "
            f"hides under the backward (communication). The single input the model lacks: a "
            f"fixed time per {what} (data loading, evaluation, host synchronization), implied "
            f"{c:.3g} s ({100 * share:.0f} % of our {g0}-GPU {what} of {t0:.3g} s) for the "
            f"paper's {S:.2f}x; {verdict}")


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0 or not math.isfinite(v):
            return f"{v:g}"
        return f"{v:.{digits}g}"
    return str(v)
