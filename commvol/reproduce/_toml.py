"""The papers' TOML files (:mod:`commvol.papers`) as the H-SGD and SDP figures read them: a
figure's table, one stated point, one input with its source."""

from __future__ import annotations

import functools
from pathlib import Path

from . import Input

try:
    import tomllib
except ModuleNotFoundError:        # Python 3.10
    import tomli as tomllib

PAPERS_DIR = Path(__file__).resolve().parent.parent / "papers"


@functools.lru_cache(maxsize=8)
def paper(name: str) -> dict:
    return tomllib.loads((PAPERS_DIR / f"{name}.toml").read_text())


def figure(name: str, fig: str) -> dict:
    for f in paper(name)["figure"]:
        if f["id"] == fig:
            return f
    raise ValueError(f"{name}.toml has no figure {fig!r}")


def point(name: str, fig: str, series: str, quantity: str, **at) -> dict:
    """The TOML point of ``fig`` with that series, quantity and ``at`` (exactly)."""
    for pt in figure(name, fig).get("points", []):
        if pt["series"] == series and pt["quantity"] == quantity and pt["at"] == at:
            return pt
    raise ValueError(f"{name}.toml {fig}: no point {series!r} / {quantity!r} at {at}")


def toml_input(name: str, fig: str, key: str, value=None, unit: str | None = None) -> Input:
    """The input ``key`` of ``fig`` (``value`` / ``unit`` replace the TOML's when given); a
    value the paper does not state says so in its source."""
    spec = figure(name, fig)["inputs"][key]
    v = spec.get("value", spec.get("range")) if value is None else value
    src = spec.get("source", "")
    if not spec.get("stated", False):
        src = f"not stated in the paper: {src}"
    return Input(f"{name}.{key}", v, spec.get("unit", "") if unit is None else unit, src)
