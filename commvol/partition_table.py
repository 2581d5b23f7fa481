"""``python -m commvol partition-table``: Table 1 of the H-SGD paper from real partitions.

    python -m commvol partition-table --neurons 1024 4096 --parts 32 64 128 256 512 \\
        [--layers 120] [--out DIR] [--overwrite]

For every network size N and processor count P a RadiX-Net (:mod:`sparse_sgd.radixnet`, the Graph
Challenge family) is partitioned as ``sparse_sgd train`` does (:func:`sparse_sgd.plan.
plan_partition`): H-SGD's multi-phase hypergraph model with fixed vertices and SGD's uniformly
random rows.  The columns are the paper's (:meth:`partition.PartitionMetrics.table1`): average
and maximum words a processor sends **in SpFF** per layer (one direction, one input vector),
messages likewise, and the computational imbalance (max / average flops).  Beside the measured
rows: ``E[R]``, the closed form of the random row, and ``LB``, a lower bound on the H row's
average volume (:func:`sparse_sgd.radixnet.spff_lower_bound`); ``H/R`` holds the ratios as the
paper's first row per P.  ``ff+bp`` is the SpFF + SpBP volume of a training step per processor
per layer.  The paper used 120 layers (§6.1), the default here; the hypergraph partition tiles
one period of the (relabelled) periodic network, so 120 layers take seconds.

``--out DIR`` writes ``DIR/table1.csv`` and ``DIR/table1.md`` atomically; a directory that holds
them is refused without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

from runner.options import add_common_args
from sparse_sgd.plan import METHODS, PartitionOptions
from sparse_sgd.radixnet import radixnet
from sparse_sgd.table1 import table1_rows
from substrate.options import add_dataclass_args, from_args
from substrate.results import atomic_write_bytes

from .hsgd import PAPER_LAYERS, radixnet_config

__all__ = [
    "DEFAULT_LAYERS",
    "TABLE_KEYS",
    "add_parser",
    "format_markdown",
    "partition_table",
    "run",
    "write_outputs",
]

DEFAULT_LAYERS = PAPER_LAYERS
#: Table-1 columns (per processor per layer, SpFF)
TABLE_KEYS = ("avg_volume", "max_volume", "avg_messages", "max_messages", "imbalance")
_CSV_KEYS = ("neurons", "layers", "parts", "method", *TABLE_KEYS, "total_volume",
             "total_messages", "spff_spbp_avg_volume", "partition_seconds",
             "partition_cpu_seconds")
_LABEL = {"hypergraph": "H", "random": "R", "E[R]": "E[R]", "LB": "LB"}


def partition_table(neurons, parts, layers: int = DEFAULT_LAYERS, *, seed: int = 0,
                    permute: bool = True,
                    options: PartitionOptions | None = None) -> list[dict]:
    """Rows ``H/R``, ``H``, ``R``, ``E[R]`` and ``LB`` for every ``(N, P)``.

    Parameters
    ----------
    neurons, parts : sequence of int
        Network widths N (``16 * 2^m``) and processor counts P (``1 <= P <= N``).
    layers : int
        Layers L of every network.
    seed : int
        Seed of the network's relabelling and of both partitioners.
    options : PartitionOptions
        Engine, preset, imbalance ``epsilon``, threads, tiling.

    Returns
    -------
    list of dict
        Keys ``neurons, layers, parts, method`` plus the :data:`TABLE_KEYS` a row has
        (``E[R]``: volume and messages; ``LB``: volume); ``H`` and ``R`` rows also carry
        ``total_volume``, ``total_messages``, ``spff_spbp_avg_volume``, ``partition_seconds``
        (wall) and ``partition_cpu_seconds``.
    """
    options = options or PartitionOptions()
    neurons, parts = [int(n) for n in neurons], [int(p) for p in parts]
    if not neurons or not parts:
        raise ValueError("--neurons and --parts need at least one value each")
    out = []
    for N in neurons:
        bad = [P for P in parts if not 1 <= P <= N]
        if bad:
            raise ValueError(f"--parts {bad} outside 1..{N} for --neurons {N}")
        network = radixnet_config(N, layers, permute=permute, seed=seed)
        weights = radixnet(network)
        for P in parts:
            rows, _ = table1_rows(weights, P, METHODS, options, seed=seed, network=network)
            got = {}
            for r in rows:
                row = {"neurons": N, "layers": layers, "parts": P, "method": _LABEL[r["method"]],
                       **{k: r[k] for k in (*TABLE_KEYS, "total_volume", "total_messages",
                                            "spff_spbp_avg_volume") if k in r}}
                if "seconds" in r:
                    row["partition_seconds"] = r["seconds"]
                    row["partition_cpu_seconds"] = r["cpu_seconds"]
                got[row["method"]] = row
            h, rnd = got["H"], got["R"]
            ratio = {k: (h[k] / rnd[k] if rnd[k] else float("nan")) for k in TABLE_KEYS}
            out += [{"neurons": N, "layers": layers, "parts": P, "method": "H/R", **ratio},
                    *got.values()]
    return out


def format_markdown(rows: list[dict]) -> str:
    """The rows as the paper lays Table 1 out: per N a block, per P the rows H/R, H, R, E[R],
    LB (missing values: ``-``)."""
    out = []

    def cell(r, k, fmt):
        return format(r[k], fmt) if k in r else "-"

    for N in dict.fromkeys(r["neurons"] for r in rows):
        block = [r for r in rows if r["neurons"] == N]
        out += [f"### N = {N} ({block[0]['layers']} layers; the paper: {PAPER_LAYERS})", "",
                ("| P | row | avg volume | max volume | avg messages | max messages | imb | "
                "ff+bp avg volume |"),
                "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in block:
            if r["method"] == "H/R":
                vals = [cell(r, k, ".3f") for k in TABLE_KEYS] + ["-"]
            else:
                vals = [cell(r, "avg_volume", ".2f"), cell(r, "max_volume", ".2f"),
                        cell(r, "avg_messages", ".2f"), cell(r, "max_messages", ".2f"),
                        cell(r, "imbalance", ".3f"), cell(r, "spff_spbp_avg_volume", ".2f")]
            out.append(f"| {r['parts']} | {r['method']} | " + " | ".join(vals) + " |")
        out.append("")
    out.append("volume: words (values of one input vector) a processor sends per layer in SpFF "
               "(the paper's Table 1 convention); messages likewise; imb: max/avg flops; "
               "ff+bp: SpFF + SpBP words of a training step; H = hypergraph (H-SGD), R = random "
               "rows (SGD), E[R] = (N/P)(P-1)(1-(1-1/P)^32) (closed form of R), LB = lower "
               "bound on any balanced partition's average volume, H/R = ratio")
    return "\n".join(out)


def write_outputs(rows: list[dict], directory, *, overwrite: bool = False) -> list[Path]:
    """Write ``table1.csv`` and ``table1.md`` into ``directory`` atomically (ratio and
    closed-form rows leave the missing columns empty)."""
    d = Path(directory)
    files = [d / "table1.csv", d / "table1.md"]
    if not overwrite and any(f.exists() for f in files):
        raise ValueError(f"--out {d} already holds a table (table1.csv / table1.md); pass "
                         "--overwrite to replace it or choose another --out")
    d.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_CSV_KEYS, restval="")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in _CSV_KEYS})
    atomic_write_bytes(files[0], buf.getvalue().encode())
    atomic_write_bytes(files[1], (format_markdown(rows) + "\n").encode())
    return files


def add_parser(sub) -> None:
    p = sub.add_parser("partition-table", help="H-SGD Table 1: hypergraph vs random partitions",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--neurons", type=int, nargs="+", default=[1024, 4096],
                   help="network widths N (default %(default)s)")
    p.add_argument("--parts", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                   help="processor counts P (default %(default)s)")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                   help="layers per network (default %(default)s, the paper's)")
    p.add_argument("--no-permute", dest="permute", action="store_false",
                   help="RadiX-Net without the random relabelling of hidden neurons")
    add_dataclass_args(p, PartitionOptions, "row partition (H-SGD §5)")
    add_common_args(p)
    p.set_defaults(func=run)


def run(args) -> list[dict]:
    options = from_args(PartitionOptions, args)
    rows = partition_table(args.neurons, args.parts, args.layers, seed=args.seed,
                           permute=args.permute, options=options)
    print(format_markdown(rows))
    if args.out:
        for f in write_outputs(rows, args.out, overwrite=args.overwrite):
            print(f"wrote {f}")
    return rows
