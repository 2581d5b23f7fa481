"""``python -m partition radixnet --neurons N --layers L --parts P --method METHOD``.

METHOD is ``hypergraph``, ``random`` or ``both``.

Partitions a RadiX-Net / Graph Challenge network and prints the Table-1 metrics of the paper
(average/maximum send volume and message count per processor per layer, computational imbalance,
totals); ``--method both`` also prints the H/R ratios.  ``--save file.npz`` keeps the partition
(``--method both`` saves the hypergraph one) for ``sparse_sgd train --partition-file``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

from partition.metrics import format_table, partition_metrics
from partition.partitioners import PRESETS, HypergraphConfig, hypergraph_partition, \
    random_partition

__all__ = ["main", "build_parser", "partitioner_errors"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def partitioner_errors():
    """Turn an error raised inside Mt-KaHyPar (ANSI-coloured, naming no input) into a
    ``ValueError`` that says which tool failed and what to check."""
    try:
        yield
    except Exception as exc:
        if not type(exc).__module__.startswith("mtkahypar"):
            raise
        text = _ANSI.sub("", str(exc)).strip()
        raise ValueError(f"Mt-KaHyPar rejected a layer's hypergraph ({type(exc).__name__}: "
                         f"{text}); check the network (every layer needs nonzero weights) or "
                         "use --method random / --partition random") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partition",
                                     description="H-SGD hypergraph / random row partitions")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("radixnet", help="partition a Graph Challenge RadiX-Net")
    r.add_argument("--neurons", type=int, default=1024)
    r.add_argument("--layers", type=int, default=120)
    r.add_argument("--parts", type=int, required=True)
    r.add_argument("--method", choices=("hypergraph", "random", "both"), default="both")
    r.add_argument("--preset", choices=PRESETS, default="default")
    r.add_argument("--epsilon", type=float, default=0.01)
    r.add_argument("--threads", type=int, default=0, help="Mt-KaHyPar threads (0: all cores)")
    r.add_argument("--no-compress", dest="compress", action="store_false",
                   help="give Mt-KaHyPar the full H(phi_k) instead of the compressed one")
    r.add_argument("--no-permute", dest="permute", action="store_false")
    r.add_argument("--network-dir", default=None, help="read n{N}-l{k}.tsv files instead")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--save", default=None, help="write the partition to this .npz file")
    return parser


def _check_args(args) -> None:
    """Fail fast on arguments that would only fail after the partitioning."""
    if args.parts < 1:
        raise ValueError(f"--parts must be >= 1, got {args.parts}")
    if args.parts > args.neurons:
        raise ValueError(f"--parts {args.parts} is larger than the {args.neurons} neurons of a "
                         f"layer: every part needs at least one row; pass --parts "
                         f"{args.neurons} or less")
    if args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.save:
        folder = Path(args.save).parent
        if not folder.is_dir():
            raise ValueError(f"--save {args.save}: the folder {folder} does not exist; create "
                             "it first or choose another path")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        # the CLI (not the library) uses sparse_sgd's generator and readers
        from sparse_sgd.io import read_challenge_network  # noqa: PLC0415
        from sparse_sgd.radixnet import graph_challenge_network  # noqa: PLC0415

        if args.network_dir:
            weights = read_challenge_network(args.network_dir, args.neurons, args.layers)
        else:
            weights = graph_challenge_network(args.neurons, args.layers, permute=args.permute,
                                              seed=args.seed).weights
        rows, saved = [], None
        if args.method in ("hypergraph", "both"):
            cfg = HypergraphConfig(epsilon=args.epsilon, preset=args.preset,
                                   threads=args.threads, seed=args.seed, compress=args.compress)
            with partitioner_errors():
                h = hypergraph_partition(weights, args.parts, cfg)
            rows.append(("H (hypergraph)", partition_metrics(weights, h)))
            saved = h
            print(f"hypergraph partitioning time: {h.seconds:.2f} s "
                  f"({args.layers} layers, P={args.parts}, preset {args.preset})")
        if args.method in ("random", "both"):
            r = random_partition(weights, args.parts, seed=args.seed)
            rows.append(("R (random)", partition_metrics(weights, r)))
            saved = saved or r
    except ValueError as exc:
        print(f"python -m partition: error: {exc}", file=sys.stderr)
        return 2
    print(f"N={args.neurons} L={args.layers} P={args.parts}: per processor per layer, "
          "SpFF+SpBP words of one input vector")
    print(format_table(rows))
    if len(rows) == 2:
        h, r = rows[0][1].table1(), rows[1][1].table1()
        print("H/R ratios: " + "  ".join(
            f"{k} {h[k] / r[k]:.3f}" for k in ("avg_volume", "max_volume", "avg_messages",
                                              "max_messages") if r[k]))
    if args.save:
        saved.save(args.save)
        print(f"saved {saved.method} partition to {args.save}")
    return 0
