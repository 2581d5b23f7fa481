"""``python -m hsadmm train``: H-SADMM (or flat ADMM) on a ``models/`` network and dataset.

Defaults are tuned for the embedded digits run, which trains a small CNN from scratch in 8 outer
iterations: lr 0.05, rho1 0.05, rho2 0.005, masks frozen at iteration 4 (measured: 96.9 % test
accuracy at keep 0.5 channel on 2 virtual nodes x 2).  With the paper's penalties (§5.1.5:
rho1 = 1.5e-3, rho2 = 1.5e-4, lr 1e-3, for ResNets trained many epochs) the proximal pull is too
weak for so few local steps and the channel masks oscillate between two supports until frozen.
``--paper-defaults`` selects §5.1.5's values (keep 0.5 channel, momentum 0.9 and weight decay
1e-4 are the paper's in both).

At the end rank 0 writes ``OUT/compact_model.npz`` (:mod:`hsadmm.export`: the consensus model
with pruned filters and channels physically removed), evaluates it, and records
``compact_test_accuracy`` (equal to ``final_test_accuracy``), ``compact_conv_params`` and
``dense_conv_params`` in the summary's metrics and the export's manifest under
``compact_export``.

Checkpoints: ``--checkpoint-every N`` saves every rank's complete solver state after every N-th
outer iteration and at the end to ``OUT/checkpoints/ckpt-r{rank}-s{iterations done:08d}.npz``
(:class:`substrate.cli.RunCheckpoints`, newest two kept).  ``--resume`` continues the run in
``--out`` from the newest iteration every rank has an intact checkpoint for, up to ``--iters``
iterations in total, and produces the same ``z`` as an uninterrupted run (runs resume at
iteration boundaries; the mini-batch stream position is part of the state).  The metrics lines,
traffic (measured and predicted) and compute time of the iterations before the checkpoint come
from the checkpoint, so ``metrics.jsonl`` and the summary's traffic equal an uninterrupted run's.
A finished run is continued only with a larger ``--iters``; a smaller one is refused.

Progress: rank 0 prints the iteration, loss, test accuracy of ``z`` and inter-node bytes so far
every ``--progress-every`` iterations (default 1) on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from models import build_model, load_dataset, shard
from models.data import check_batch_size
from models.train import evaluate
from substrate.cli import (Progress, RunCheckpoints, add_common_args, add_training_args,
                           check_range, start_run)

from .export import export_compact, load_compact_model
from .projection import keep_count, parse_sparsity
from .solver import SOLVERS

__all__ = ["HSADMMConfig", "build_parser", "main", "train"]


@dataclass(frozen=True)
class HSADMMConfig:
    """Configuration of one H-SADMM / flat-ADMM run (frozen; written into ``summary.json``)."""

    method: str = "hsadmm"
    model: str = "cnn"
    dataset: str = "digits"
    data_dir: str | None = None
    iters: int = 8
    local_epochs: float = 1.0
    local_steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    rho1: float = 0.05
    rho2: float = 0.005
    keep: float = 0.5
    sparsity: str = "channel"
    keep_file: str | None = None
    adaptive_rho: bool = True
    rho_max: float = 10.0
    eps_abs: float = 1e-4
    eps_rel: float = 1e-3
    freeze_iter: int | None = 4
    freeze_patience: int = 3
    bucket_mib: float = 32.0
    checkpoint_every: int = 0
    resume: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in SOLVERS:
            raise ValueError(f"unknown --method {self.method!r}; valid: {sorted(SOLVERS)}")
        keep_count(self.keep, 1)
        parse_sparsity(self.sparsity)
        for name in ("iters", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.local_steps is not None and self.local_steps < 1:
            raise ValueError(f"--local-steps must be >= 1, got {self.local_steps}")
        for name in ("local_epochs", "lr", "rho1", "rho2", "rho_max", "bucket_mib"):
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), gt=0)
        check_range("--momentum", self.momentum, ge=0, lt=1)
        for name in ("weight_decay", "eps_abs", "eps_rel"):
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), ge=0)
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got "
                             f"{self.checkpoint_every}")
        if self.freeze_iter is not None and self.freeze_iter < 0:
            raise ValueError(f"--freeze-iter must be >= 0 (0: never), got {self.freeze_iter}")

    @property
    def sparsity_kinds(self) -> tuple[str, ...]:
        return parse_sparsity(self.sparsity)

    def local_steps_for(self, shard_size: int) -> int:
        """SGD steps of phase 1: ``--local-steps`` or ``ceil(local_epochs * batches/epoch)``."""
        if self.local_steps is not None:
            return self.local_steps
        return max(1, math.ceil(self.local_epochs * math.ceil(shard_size / self.batch_size)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsadmm train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = HSADMMConfig()
    p.add_argument("--method", default=d.method, help=f"one of {sorted(SOLVERS)}")
    p.add_argument("--model", default=d.model, help="models/ name: cnn, resnet, mlp")
    p.add_argument("--dataset", default=d.dataset, help="digits (embedded), mnist, cifar10, "
                                                        "synthetic")
    p.add_argument("--data-dir", default=None, help="directory of MNIST/CIFAR-10 files")
    p.add_argument("--iters", type=int, default=d.iters, help="outer ADMM iterations")
    p.add_argument("--local-epochs", type=float, default=d.local_epochs)
    p.add_argument("--local-steps", type=int, default=None, help="overrides --local-epochs")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--rho1", type=float, default=d.rho1)
    p.add_argument("--rho2", type=float, default=d.rho2)
    p.add_argument("--keep", type=float, default=d.keep, help="keep rate in (0, 1]")
    p.add_argument("--sparsity", default=d.sparsity,
                   help="channel, filter, shape or an intersection like filter+channel")
    p.add_argument("--keep-file", default=None,
                   help='JSON {"conv layer name": keep rate} overriding --keep per layer')
    p.add_argument("--no-adaptive-rho", dest="adaptive_rho", action="store_false")
    p.add_argument("--rho-max", type=float, default=d.rho_max)
    p.add_argument("--eps-abs", type=float, default=d.eps_abs)
    p.add_argument("--eps-rel", type=float, default=d.eps_rel)
    p.add_argument("--freeze-iter", type=int, default=d.freeze_iter,
                   help="freeze the masks after this iteration (default %(default)s; 0: never)")
    p.add_argument("--freeze-patience", type=int, default=d.freeze_patience,
                   help="freeze masks after this many iterations without change (0: never)")
    p.add_argument("--bucket-mib", type=float, default=d.bucket_mib)
    p.add_argument("--paper-defaults", action="store_true",
                   help="PruneX §5.1.5 values: lr 1e-3, rho1 1.5e-3, rho2 1.5e-4")
    add_training_args(p, "iteration", progress_every=1)
    add_common_args(p)
    return p


PAPER_DEFAULTS = {"lr": 1e-3, "rho1": 1.5e-3, "rho2": 1.5e-4}


def _read_keep_file(path) -> dict:
    if path is None:
        return {}
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--keep-file {p} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--keep-file {p} is not valid JSON ({exc}); expected "
                         '{"layer name": keep rate}') from None
    if not isinstance(data, dict):
        raise ValueError(f"--keep-file {p} must hold a JSON object {{layer name: keep rate}}")
    for k, v in data.items():
        try:
            keep_count(v, 1)
        except ValueError as exc:
            raise ValueError(f"--keep-file {p}: layer {k!r}: {exc}") from None
    return data


#: configuration fields a resumed run may change (everything else must match the checkpoint)
RESUMABLE = ("iters", "checkpoint_every", "resume")


def train(args) -> dict:
    """Run the configured solver; returns the summary (every rank)."""
    fields = HSADMMConfig.__dataclass_fields__
    values = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    if getattr(args, "paper_defaults", False):
        values.update(PAPER_DEFAULTS)
    cfg = HSADMMConfig(**values)
    overrides = _read_keep_file(cfg.keep_file)
    run = start_run(args, system="hsadmm", method=cfg.method, config=cfg)
    xp = run.xp
    data = load_dataset(cfg.dataset, cfg.data_dir)
    train_shard = shard(data.train, run.rank, run.size, seed=cfg.seed).to(xp)
    check_batch_size(cfg.batch_size, len(train_shard),
                     f"each rank's shard of the {len(data.train)} {cfg.dataset} training "
                     f"samples split over {run.size} ranks")
    test = data.test.to(xp)
    model = build_model(cfg.model, data.train.input_shape, data.train.num_classes, xp=xp,
                        seed=cfg.seed)
    solver = SOLVERS[cfg.method](run, cfg, model, train_shard, overrides)
    eval_model = build_model(cfg.model, data.train.input_shape, data.train.num_classes, xp=xp,
                             seed=cfg.seed)
    predicted: dict[str, dict] = {}

    def add_predicted(phase, b):
        e = predicted.setdefault(phase, {"intra_bytes": 0, "inter_bytes": 0})
        e["intra_bytes"] += b["intra"]
        e["inter_bytes"] += b["inter"]

    fingerprint = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE}
    ckpt = RunCheckpoints(run, every=cfg.checkpoint_every, fingerprint=fingerprint,
                          unit="iteration", flag="--iters")
    start, loss = 0, float("nan")
    if cfg.resume:
        start, state = ckpt.resume(cfg.iters)
        predicted.update(json.loads(str(state.pop("train/predicted"))))
        loss = float(state.pop("train/loss"))
        solver.load_state_dict(state)
        if solver.converged and run.previous == "finished":
            raise ValueError(f"--resume: the run in {run.out} converged after {start} "
                             "iterations (summary.json): there is nothing to continue; start "
                             "afresh with --overwrite")

    def load_z():
        """The consensus model z with this rank's BN statistics, in ``eval_model``."""
        eval_model.params.flat[...] = solver.state.z
        for name, buf in model.buffers.items():
            eval_model.buffers[name][...] = buf

    def evaluate_z():
        # test accuracy of the consensus model z (rank 0; BN statistics from rank 0's model)
        if run.rank != 0:
            return float("nan")
        load_z()
        return evaluate(eval_model, test)[1]

    def bytes_so_far(link):
        return sum(e[f"{link}_bytes"] for e in predicted.values())

    progress = Progress(run, total=cfg.iters, unit="iteration",
                        every=getattr(args, "progress_every", 0),
                        start=start)
    acc = float("nan")
    done = start
    while done < cfg.iters and not solver.converged:
        k = done
        snap = run.ledger.snapshot()
        out = solver.iterate(k)
        it_bytes = solver.predicted_phase_bytes(out["mask_synced"])  # == measured (tested)
        for phase, b in it_bytes.items():
            add_predicted(phase, b)
        delta = run.ledger.since(snap)
        acc = evaluate_z()
        loss = out["loss"]
        run.log(iteration=k, loss=loss, test_accuracy=acc,
                sim_s=run.clock.sim_s, compute_s=run.clock.compute_s,
                comm_modeled_s=run.clock.comm_modeled_s,
                phase_modeled_s={p: e["modeled_s"] for p, e in delta.items()},
                inter_node_bytes=sum(b["inter"] for b in it_bytes.values()),
                mask_sync_bytes=it_bytes.get("mask_sync", {"inter": 0})["inter"],
                **{key: out[key] for key in (
                    "mask_drift", "mask_synced", "frozen", "compact_elems", "dense_elems",
                    "r_intra", "s_intra", "r_inter", "s_inter", "rho1", "rho2", "converged")})
        done = k + 1
        progress.update(done, loss=loss, test_accuracy=acc, inter_bytes=bytes_so_far("inter"),
                        total_bytes=bytes_so_far("inter") + bytes_so_far("intra"))
        if ckpt.due(done, last=done == cfg.iters or solver.converged):
            ckpt.save(done, {**solver.state_dict(), "train/predicted": json.dumps(predicted),
                             "train/loss": loss})
    progress.close()
    if done == start:  # resumed with nothing left to do: evaluate the loaded z
        acc = evaluate_z()
    z = solver.state.z
    pruned = getattr(solver, "pruned", [])
    kept = sum(int(xp.count_nonzero(z[solver.slices[i]])) for i in pruned)
    total = sum(int(solver.layout.sizes[solver.names[i]]) for i in pruned)
    # physically compact export of z (every rank builds it; rank 0 writes and evaluates it)
    load_z()
    export = export_compact(eval_model, solver.global_masks())
    compact_acc = float("nan")
    if run.rank == 0:
        path = export.save(Path(run.out) / "compact_model.npz")
        compact_acc = evaluate(load_compact_model(path, xp=xp), test)[1]
    # test accuracy is evaluated on rank 0, which writes the summary (NaN on other ranks)
    metrics = {"final_test_accuracy": float(acc),
               "final_loss": loss, "iterations": done,
               "conv_density": kept / total if total else 1.0,
               "compact_test_accuracy": compact_acc,
               "compact_conv_params": export.compact_conv_params,
               "dense_conv_params": export.dense_conv_params}
    if cfg.resume:
        metrics["resumed_from_iteration"] = start
    pred = {"inter_node_bytes": bytes_so_far("inter"), "intra_node_bytes": bytes_so_far("intra"),
            "by_phase": predicted}
    manifest = {"file": "compact_model.npz",
                **{k: v for k, v in export.manifest.items() if k != "format"}}
    summary = run.finish(metrics=metrics, predicted=pred, extra={"compact_export": manifest})
    return {**summary, "_rank": run.rank}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsadmm")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", parents=[build_parser()], add_help=False,
                   help="train with H-SADMM or flat ADMM")
    args = p.parse_args(argv)
    summary = train(args)
    if summary["_rank"] == 0:
        m, t = summary["metrics"], summary["traffic"]
        print(f"{summary['method']}: test accuracy {m['final_test_accuracy']:.4f}, conv density "
              f"{m['conv_density']:.3f}, inter-node bytes {t['measured']['inter_node_bytes']} "
              f"(predicted {t['predicted']['inter_node_bytes']}), simulated "
              f"{summary['timing']['sim_s']:.2f} s")
    return 0
