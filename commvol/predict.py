"""``python -m commvol predict``: per-iteration and total bytes of a system against its baseline.

    python -m commvol predict --system hsadmm --model resnet152 --nodes 16 --gpus-per-node 4 \\
        --keep 0.5 --sparsity channel --iters 60

Models are the shape-only specs of :mod:`models.specs` (``resnet18``, ``resnet152``,
``wide_resnet50_2`` alias ``wrn50_2``: CIFAR-10 shapes) or the trainable models of
:data:`models.MODELS` (``cnn``, ``resnet``, ``mlp``) built for ``--dataset``'s shapes (default
``digits``, as the trainers), so a prediction from the model name and the topology reproduces a
run's measured bytes.  The sparse-DNN systems (``hsgd``, ``sgd``) take ``--neurons``/``--layers``.

Units.  An H-SADMM/flat-ADMM **iteration** is one outer ADMM iteration; a data-parallel iteration
is ``--ddp-steps-per-iter`` optimizer steps (default 1: one synchronization of the whole model per
iteration, the convention of PruneX Fig. 6b, whose Dense DDP bar is 60 x the dense model =
13.00 GiB for ResNet-152).  ``wire`` bytes are the ledger's: every byte on every link, summed over
links of a class.  ``payload`` is what one sender contributes to the main exchange per iteration
(PruneX Fig. 6a's "message size": a leader's compact buffer; the dense model for DDP).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from runner.options import CommonConfig, add_cost_args
from substrate import costmodel as cm
from substrate.costmodel import CostModel
from substrate.options import add_dataclass_args, flag_of, from_args

from .hsgd import RadixNetSpec
from .specs import DATASET_SHAPES, MODEL_ALIASES, model_names, resolve_model
from .systems import SYSTEMS, Prediction, get_system

__all__ = [
    "DATASET_SHAPES",
    "MODEL_ALIASES",
    "add_cost_args",
    "add_parser",
    "cost_from_args",
    "fmt_bytes",
    "format_prediction",
    "model_names",
    "predict",
    "resolve_model",
    "resolve_spec",
    "run",
]

def resolve_spec(system: str, model: str | None = None, *, dataset: str = "digits",
                 neurons: int = 1024, layers: int = 12, seed: int = 0):
    """The spec a system's ``predict`` takes: a model spec, or a RadiX-Net for sparse SGD."""
    sm = get_system(system)
    if sm.spec_kind == "radixnet":
        return RadixNetSpec(int(neurons), int(layers), seed=int(seed))
    if model is None:
        raise ValueError(f"--system {system} needs --model (one of {', '.join(model_names())})")
    return resolve_model(model, dataset)


def predict(system: str, model: str | None = None, *, nodes: int, gpus_per_node: int,
            dataset: str = "digits", neurons: int = 1024, layers: int = 12, seed: int = 0,
            cost: CostModel | None = None, spec=None, **options) -> Prediction:
    """Predict ``system`` on ``model`` (or ``spec``) over ``nodes`` x ``gpus_per_node`` ranks.

    ``options`` are fields of the system's options dataclass (e.g. ``keep=0.5``,
    ``sparsity="channel"`` for ``hsadmm``; ``density=0.01`` for ``topk``).  ``seed`` is also
    the run seed of a system whose options have one (SDP's block order).

    Raises
    ------
    ValueError
        For unknown system/model names or options (the message lists the valid ones).
    """
    sm = get_system(system)
    fields = sm.fields()
    bad = sorted(set(options) - fields)
    if bad:
        raise ValueError(f"--system {system} has no option(s) {bad}; its options are "
                         f"{sorted(fields)}")
    if "seed" in fields:
        options = {"seed": seed, **options}
    if spec is None:
        spec = resolve_spec(system, model, dataset=dataset, neurons=neurons, layers=layers,
                            seed=seed)
    return sm(spec, nodes, gpus_per_node, options, cost)


# ---------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    """``1.23 GiB`` style (binary prefixes, as PruneX's GB figures are)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def _phase_rows(label: str, iters: str, cost) -> list[str]:
    rows = []
    for p in sorted(set(cost.phases) | set(cost.messages)):
        b = cost.phases.get(p, {cm.INTRA: 0, cm.INTER: 0})
        rows.append(f"| {label} | {iters} | {p} | {b[cm.INTRA]:,} | {b[cm.INTER]:,} | "
                    f"{cost.messages.get(p, 0):,} | {cost.modeled_s.get(p, 0.0):.6f} |")
    rows.append(f"| {label} | {iters} | **all** | {cost.intra:,} | {cost.inter:,} | "
                f"{cost.total_messages:,} | {cost.time_s:.6f} |")
    return rows


def format_prediction(pred: Prediction, iters: int, baseline: Prediction | None = None,
                      cost: CostModel | None = None) -> str:
    """Markdown report: per-iteration phases, totals against the baseline, assumptions."""
    cost = cost or CostModel()
    preds = [pred] + ([baseline] if baseline is not None else [])
    d = cost.describe()
    out = [(f"# {pred.system} on {pred.model} ({pred.num_params:,} parameters), {pred.nodes} "
           f"nodes x {pred.gpus_per_node} ranks = {pred.nodes * pred.gpus_per_node} ranks, "
           f"{iters} iterations"),
           "",
           (f"cost model: intra {d['intra_gbps']:g} Gbit/s, {d['intra_lat_us']:g} us; inter "
           f"{d['inter_gbps']:g} Gbit/s, {d['inter_lat_us']:g} us; ring all-reduce, ring "
           "all-gather, binomial broadcast (a ring that crosses nodes runs at the inter-node "
           "rate)"),
           "",
           ("## per iteration (wire bytes summed over all links; messages summed over ranks; "
           "modeled seconds on the busiest rank)"),
           "",
           "| system | iterations | phase | intra bytes | inter bytes | messages | modeled s |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for p in preds:
        if p.setup is not None:
            out += _phase_rows(p.system, "setup (once)", p.setup)
        for first, last, c in p.schedule(iters):
            out += _phase_rows(f"{p.system} ({p.unit})",
                               f"{first}" if first == last else f"{first}-{last}", c)
    out += ["", f"## totals over {iters} iterations", "",
            ("| system | unit | inter-node | intra-node | inter / iter | inter vs "
            f"{baseline.system if baseline else 'baseline'} | messages | modeled comm s | "
            "payload / sender | payload ratio |"),
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base_inter = baseline.total(iters).inter if baseline is not None else None
    for p in preds:
        t = p.total(iters)
        ratio = f"{t.inter / base_inter:.3f}" if base_inter else "-"
        pay = (f"{t.payload_bytes / t.dense_payload_bytes:.4f}" if t.dense_payload_bytes
               else "-")
        out.append(f"| {p.system} | {p.unit} | {fmt_bytes(t.inter)} | {fmt_bytes(t.intra)} | "
                   f"{fmt_bytes(t.inter / iters)} | {ratio} | {t.total_messages:,} | "
                   f"{t.time_s:.4f} | {fmt_bytes(t.payload_bytes)} | {pay} |")
    out += ["", "## assumptions", ""]
    for p in preds:
        out += [f"- {p.system}: {n}" for n in p.notes]
    out += [("- wire bytes: ring all-reduce of n bytes over g ranks puts 2(g-1)/g n on each of "
            "its g links (node-major world ring: M of the p links cross nodes); binomial "
            "broadcast: one copy per tree edge"),
            ("- payload / sender: bytes one leader (H-SADMM), rank (DDP, Top-K) or processor "
            "(sparse SGD, average) contributes per iteration, summed over the iterations "
            "(PruneX Fig. 6 plots this quantity in GiB: 60 x 232.6 MB = 13.00 GiB for dense "
            "ResNet-152)"),
            "- GiB = 2^30 bytes"]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def cost_from_args(args) -> CostModel:
    """:class:`CostModel` from the parsed cost flags (Gbit/s and microseconds)."""
    return from_args(CommonConfig, args).cost_model()


def add_system_option_args(p, exclude=()) -> None:
    """One flag per field of every registered system's options (shared fields share a flag);
    ``exclude``: fields the command declares itself."""
    classes = [(name, cls, suffix) for name, sm in sorted(SYSTEMS.items())
               for cls, suffix in ((sm.Options, ""), (sm.Assumptions, " (prediction assumptions)"))
               if cls is not None]
    # an option two systems declare with different defaults (e.g. --batch-size of a data-parallel
    # strategy and of the ADMM solver) is one flag whose default is each system's own
    defaults: dict[str, set] = {}
    for _, cls, _ in classes:
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                defaults.setdefault(f.name, set()).add(repr(f.default))
    clashing = sorted(n for n, d in defaults.items() if len(d) > 1 and n not in exclude)
    if clashing:
        g = p.add_argument_group("options whose default depends on --system")
        for name in clashing:
            cls = next(c for _, c, _ in classes if name in c.__dataclass_fields__)
            f = cls.__dataclass_fields__[name]
            g.add_argument(flag_of(cls, name), dest=name, default=None,
                           type=f.metadata.get("type", type(f.default) if f.default is not None
                                               else str),
                           help=f"{f.metadata.get('help', '')} (default: the system's own)")
    for name, cls, suffix in classes:
        add_dataclass_args(p, cls, f"--system {name}{suffix}", exclude=(*clashing, *exclude))


def system_options(system: str, args) -> dict:
    """The options of ``system`` from parsed arguments, as keyword arguments."""
    sm = get_system(system)
    return {f: getattr(args, f) for f in sorted(sm.fields())
            if hasattr(args, f) and getattr(args, f) is not None}


def _options_beside(kw: dict, system: str, args) -> dict:
    """:func:`system_options` less those ``predict`` takes itself (``seed``: one flag)."""
    return {k: v for k, v in system_options(system, args).items() if k not in kw}


def add_model_args(p) -> None:
    p.add_argument("--model", default=None,
                   help="resnet18, resnet152, wide_resnet50_2 (wrn50_2): CIFAR-10 specs; cnn, "
                        "resnet, mlp: trainable models on --dataset's shapes")
    p.add_argument("--dataset", default="digits", help=f"one of {sorted(DATASET_SHAPES)} "
                   "(shapes of the trainable models; default %(default)s)")
    p.add_argument("--neurons", type=int, default=1024, help="hsgd/sgd: neurons per layer")
    p.add_argument("--layers", type=int, default=12, help="hsgd/sgd: layers")
    p.add_argument("--seed", type=int, default=0,
                   help="network / partition seed (hsgd/sgd), run seed (sdp: block order)")


def add_parser(sub) -> None:
    p = sub.add_parser("predict", help="closed-form bytes of one system against its baseline",
                       description=__doc__, formatter_class=_raw())
    p.add_argument("--system", required=True, help=f"one of {', '.join(sorted(SYSTEMS))}")
    add_model_args(p)
    p.add_argument("--nodes", type=int, default=16, help="nodes M (default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=4,
                   help="ranks per node P (default %(default)s)")
    p.add_argument("--iters", type=int, default=60,
                   help="iterations (default %(default)s: PruneX §5.1.5's up to 60 outer "
                        "iterations)")
    p.add_argument("--baseline", default=None,
                   help="system to compare with (default: the system's own, dense DDP for the "
                        "data-parallel family; 'none' for none)")
    p.add_argument("--out", type=Path, default=None, help="also write the prediction as JSON")
    add_system_option_args(p)
    add_cost_args(p)
    p.set_defaults(func=run)


def _raw():
    return argparse.RawDescriptionHelpFormatter


def run(args) -> str:
    """Run ``predict`` from parsed arguments; prints and returns the report."""
    sm = get_system(args.system)
    cost = cost_from_args(args)
    kw = {"dataset": args.dataset, "neurons": args.neurons, "layers": args.layers,
          "seed": args.seed, "cost": cost}
    pred = predict(args.system, args.model, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   **kw, **_options_beside(kw, args.system, args))
    base_name = sm.baseline if args.baseline is None else (
        None if args.baseline == "none" else args.baseline)
    base = None
    if base_name and base_name != args.system:
        base = predict(base_name, args.model, nodes=args.nodes,
                       gpus_per_node=args.gpus_per_node, **kw,
                       **_options_beside(kw, base_name, args))
    text = format_prediction(pred, args.iters, base, cost)
    print(text)
    if args.out:
        doc = {"prediction": pred.as_dict(args.iters),
               "baseline": base.as_dict(args.iters) if base else None,
               "cost_model": cost.describe()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return text
