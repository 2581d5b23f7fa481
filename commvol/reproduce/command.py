"""The ``reproduce`` sub-command of ``python -m commvol`` (see :mod:`commvol.reproduce`): run
the figures of one paper or all of them, print their tables and, with ``--out``, write
``REPRODUCE.md``, ``INPUTS.md`` and the PNGs (:mod:`commvol.reproduce.render`)."""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

from . import PAPERS, Figure, paper_module, render
from . import __doc__ as DOC

__all__ = ["add_parser", "run", "run_papers"]


def run_papers(papers, quick: bool = False, *, full: bool = False, log=print) -> list[Figure]:
    """Every figure of ``papers`` (a paper without a module is skipped with a note); ``full``
    reaches the papers whose ``figures`` simulate a budgeted subset by default."""
    figs = []
    for paper in papers:
        mod = paper_module(paper)
        if mod is None:
            log(f"# {paper}: no commvol.reproduce.{paper} module yet: skipped")
            continue
        t = time.perf_counter()
        kw = {"full": True} if full and "full" in inspect.signature(mod.figures).parameters \
            else {}
        got = list(mod.figures(quick, **kw))
        log(f"# {paper}: {len(got)} figure(s) in {time.perf_counter() - t:.1f} s")
        figs += got
    return figs


def add_parser(sub) -> None:
    p = sub.add_parser("reproduce", help="each paper's headline figures: the paper's numbers, "
                       "our prediction, their ratio", description=DOC,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paper", choices=(*PAPERS, "all"), help="a paper, or all of them")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write REPRODUCE.md, INPUTS.md and one PNG per figure here")
    p.add_argument("--quick", action="store_true",
                   help="a reduced set of configurations (for tests)")
    p.add_argument("--full", action="store_true",
                   help="every configuration where the default simulates a subset to stay "
                        "within ten minutes (H-SGD Fig. 4: all 20 (N, P) cells, not 19)")
    p.set_defaults(func=run)


def run(args) -> list[Figure]:
    papers = PAPERS if args.paper == "all" else (args.paper,)
    figs = run_papers(papers, args.quick, full=args.full)
    print(render.terminal(figs))
    if args.out is not None:
        out = Path(args.out)
        name = "REPRODUCE.md" if args.paper == "all" else f"REPRODUCE-{args.paper}.md"
        command = (f"python -m commvol reproduce {args.paper} --out {args.out}"
                   + (" --quick" if args.quick else "") + (" --full" if args.full else ""))
        written = render.write(figs, out, name, command=command)
        for w in written:
            print(f"wrote {w}")
    return figs
