"""``python -m commvol {predict,partition-table,scale,report,gantt,plot-scaling,plot-tta,rerun,
trace,simulate,reproduce}``: the sub-commands of :mod:`commvol.predict`,
:mod:`commvol.partition_table`, :mod:`commvol.scale`, :mod:`commvol.report`,
:mod:`commvol.plots`, :mod:`commvol.rerun`, :mod:`commvol.trace`, :mod:`commvol.simulate` and
:mod:`commvol.reproduce`."""

from __future__ import annotations

import argparse
import sys

from runner.errors import offline_guard

from . import (
    partition_table,
    plots,
    predict,
    report,
    rerun,
    scale,
    simulate,
    trace,
)
from .reproduce import command as reproduce

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commvol",
                                description="closed-form communication volumes, the H-SGD "
                                            "partition table, strong scaling, run reports, "
                                            "plots of simulated steps and the papers' "
                                            "figures beside our predictions")
    sub = p.add_subparsers(dest="cmd", required=True)
    for mod in (predict, partition_table, scale, report, plots, rerun, trace, simulate,
                reproduce):
        mod.add_parser(sub)
    return p


def main(argv=None) -> int:
    """Parse ``argv`` and run the sub-command (errors are ``ValueError`` naming the flag)."""
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(offline_guard(main)())
