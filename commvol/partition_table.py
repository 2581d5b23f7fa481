"""``python -m commvol partition-table``: Table 1 of the H-SGD paper from real partitions.

    python -m commvol partition-table --neurons 1024 4096 --parts 32 64 128 256 512 \\
        [--layers 6] [--out table1.csv]

For every network size N and processor count P a RadiX-Net (:mod:`sparse_sgd.radixnet`, the Graph
Challenge family) is partitioned twice, as ``sparse_sgd train`` does: H-SGD's multi-phase
hypergraph model with fixed vertices (Mt-KaHyPar, km1, eps 0.01) and SGD's uniformly random
rows.  The rows are :meth:`partition.PartitionMetrics.table1`: average / maximum words and
messages a processor sends per layer (SpFF + SpBP of one input vector), and the computational
imbalance (max / average flops); the ``H/R`` row holds the ratios, as the paper's first row per
P.  The paper used 120 layers (§6.1); the default here, 6, is one full period of the radix-2
layers of N = 1024 (the statistics per layer repeat with the radix period, up to the random row
permutation of each block of layers), so the table finishes in minutes rather than hours.
"""

from __future__ import annotations

import csv
from pathlib import Path

from partition import partition_metrics

from .hsgd import PAPER_LAYERS, HSGDPredictOptions, partition_network, radixnet_weights

__all__ = ["TABLE_KEYS", "partition_table", "format_markdown", "write_csv", "add_parser",
           "run", "DEFAULT_LAYERS"]

DEFAULT_LAYERS = 6
#: Table-1 columns (per processor per layer) and the totals kept in the CSV
TABLE_KEYS = ("avg_volume", "max_volume", "avg_messages", "max_messages", "imbalance")
_CSV_KEYS = ("neurons", "layers", "parts", "method", *TABLE_KEYS, "total_volume",
             "total_messages", "partition_seconds")


def partition_table(neurons, parts, layers: int = DEFAULT_LAYERS, *, seed: int = 0,
                    permute: bool = True,
                    options: HSGDPredictOptions = HSGDPredictOptions()) -> list[dict]:
    """Rows ``H``, ``R`` and ``H/R`` for every ``(N, P)``.

    Parameters
    ----------
    neurons, parts : sequence of int
        Network widths N (``16 · 2^m``) and processor counts P (``1 <= P <= N``).
    layers : int
        Layers L of every network.
    seed : int
        Seed of the network's row permutations and of both partitioners.
    options : HSGDPredictOptions
        Mt-KaHyPar preset, imbalance ``epsilon`` and threads.

    Returns
    -------
    list of dict
        Keys ``neurons, layers, parts, method`` plus :data:`TABLE_KEYS`; ``H`` and ``R`` rows
        also carry ``total_volume``, ``total_messages``, ``partition_seconds``.
    """
    neurons, parts = [int(n) for n in neurons], [int(p) for p in parts]
    if not neurons or not parts:
        raise ValueError("--neurons and --parts need at least one value each")
    rows = []
    for N in neurons:
        bad = [P for P in parts if not 1 <= P <= N]
        if bad:
            raise ValueError(f"--parts {bad} outside 1..{N} for --neurons {N}")
        weights = radixnet_weights(N, layers, permute=permute, seed=seed)
        for P in parts:
            got = {}
            for label, method in (("H", "hypergraph"), ("R", "random")):
                part = partition_network(weights, P, method, seed=seed, options=options)
                t = partition_metrics(weights, part).table1()
                got[label] = {"neurons": N, "layers": layers, "parts": P, "method": label,
                              **{k: t[k] for k in TABLE_KEYS},
                              "total_volume": t["total_volume"],
                              "total_messages": t["total_messages"],
                              "partition_seconds": part.seconds}
            h, r = got["H"], got["R"]
            ratio = {k: (h[k] / r[k] if r[k] else float("nan")) for k in TABLE_KEYS}
            rows += [{"neurons": N, "layers": layers, "parts": P, "method": "H/R", **ratio},
                     h, r]
    return rows


def format_markdown(rows: list[dict]) -> str:
    """The rows as the paper lays Table 1 out: per N a block, per P the rows H/R, H, R."""
    out = []
    for N in dict.fromkeys(r["neurons"] for r in rows):
        block = [r for r in rows if r["neurons"] == N]
        out += [f"### N = {N} ({block[0]['layers']} layers; the paper: {PAPER_LAYERS})", "",
                "| P | row | avg volume | max volume | avg messages | max messages | imb |",
                "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in block:
            if r["method"] == "H/R":
                vals = [f"{r[k]:.2f}" for k in TABLE_KEYS]
            else:
                vals = [f"{r['avg_volume']:.1f}", f"{r['max_volume']:.1f}",
                        f"{r['avg_messages']:.2f}", f"{r['max_messages']:.2f}",
                        f"{r['imbalance']:.3f}"]
            out.append(f"| {r['parts']} | {r['method']} | " + " | ".join(vals) + " |")
        out.append("")
    out.append("volume: words (values of one input vector) a processor sends per layer in SpFF "
               "+ SpBP; messages likewise; imb: max/avg flops; H = hypergraph (H-SGD), R = "
               "random rows (SGD), H/R = ratio")
    return "\n".join(out)


def write_csv(rows: list[dict], path) -> Path:
    """Write the rows (ratio rows leave the totals empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_CSV_KEYS, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in _CSV_KEYS})
    return path


def add_parser(sub) -> None:
    import argparse  # noqa: PLC0415

    from partition.partitioners import PRESETS  # noqa: PLC0415

    d = HSGDPredictOptions()
    p = sub.add_parser("partition-table", help="H-SGD Table 1: hypergraph vs random partitions",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--neurons", type=int, nargs="+", default=[1024, 4096],
                   help="network widths N (default %(default)s)")
    p.add_argument("--parts", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                   help="processor counts P (default %(default)s)")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                   help=f"layers per network (default %(default)s; the paper: {PAPER_LAYERS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-permute", dest="permute", action="store_false",
                   help="RadiX-Net without the random row permutations")
    p.add_argument("--out", type=Path, default=None, help="write the rows as CSV")
    p.add_argument("--epsilon", type=float, default=d.epsilon,
                   help="allowed imbalance of the hypergraph partition (default %(default)s)")
    p.add_argument("--preset", choices=PRESETS, default=d.preset, help="Mt-KaHyPar preset")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="Mt-KaHyPar threads (default %(default)s: all cores)")
    p.set_defaults(func=run)


def run(args) -> list[dict]:
    options = HSGDPredictOptions(epsilon=args.epsilon, preset=args.preset, threads=args.threads)
    rows = partition_table(args.neurons, args.parts, args.layers, seed=args.seed,
                           permute=args.permute, options=options)
    print(format_markdown(rows))
    if args.out:
        print(f"wrote {write_csv(rows, args.out)}")
    return rows
