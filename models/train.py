"""Serial training: ``python -m models train --model cnn --dataset digits``.

The loop is also a library function (:func:`fit`) so tests and other packages can train a model
without the CLI.  The command runs the same epochs in :class:`runner.loop.RunLoop` (unit
``epoch``): one ``metrics.jsonl`` line per epoch in the schema of ``runner/metrics.schema.json``
(then the epoch's mean loss, training accuracy, learning rate, optimizer steps done), the test
set evaluated after every ``--eval-every`` epochs (default 1) and after the last.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from runner.loop import Evaluation, LoopBody, RunLoop
from runner.options import add_common_args
from runner.run import start_run

from .arch import arch_help, parse_arch, split_arch
from .data import DATASETS, Dataset, check_batch_size, iterate_batches, load_dataset, num_batches
from .layers import softmax_cross_entropy
from .network import Model
from .optim import OPTIMIZERS, SCHEDULES, SGD, SGDConfig, make_optimizer, make_schedule
from .text import unigram_entropy
from .zoo import MODELS, build_model

__all__ = ["TrainConfig", "build_parser", "evaluate", "fit", "main", "parse_arch"]


@dataclass(frozen=True)
class TrainConfig:
    """Configuration of a serial training run (written into ``summary.json``).

    Attributes
    ----------
    model : str
        Key of :data:`models.zoo.MODELS`.
    dataset : str
        Key of :data:`models.data.DATASETS`.
    data_dir : str or None
        Directory for ``mnist`` / ``cifar10``.
    epochs, batch_size : int
    steps : int or None
        Optimizer steps (overrides ``epochs``; the last epoch may be partial).
    lr, momentum, weight_decay : float
    nesterov : bool
    optimizer : {"sgd", "adamw"}
        ``adamw`` uses ``momentum`` as β1 and decays only ``conv``/``fc`` weights (decoupled).
    lr_schedule : {"constant", "step", "cosine"}
    warmup : float
        Fraction of all steps spent in linear warm-up (cosine schedule only).
    dtype : {"float32", "float64"}
    arch : tuple of (str, value) pairs
        Extra keyword arguments of the model factory, e.g. ``(("depths", (1, 1, 1)),)``, and
        of the dataset (``context`` of ``text``); checked by :func:`models.arch.parse_arch`.
    seed : int
        Initialization and shuffling seed.
    """

    model: str = "cnn"
    dataset: str = "digits"
    data_dir: str | None = None
    epochs: int = 10
    steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    optimizer: str = "sgd"
    lr_schedule: str = "cosine"
    warmup: float = 0.0
    dtype: str = "float32"
    arch: tuple = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; valid names: {sorted(MODELS)}")
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; valid names: {sorted(DATASETS)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, "
                             f"{self.batch_size}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.lr_schedule!r}; valid names: "
                             f"{sorted(SCHEDULES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; valid names: "
                             f"{sorted(OPTIMIZERS)}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"--warmup is a fraction of the run's steps in [0, 1), got "
                             f"{self.warmup}")
        if self.warmup > 0 and self.lr_schedule != "cosine":
            raise ValueError("--warmup needs --lr-schedule cosine")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        for name in ("lr", "momentum", "weight_decay"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got "
                                 f"{getattr(self, name)}")
        if self.optimizer == "sgd":
            SGDConfig(self.lr, self.momentum, self.nesterov, self.weight_decay)  # validates
        parse_arch(self.arch, self.model, self.dataset)  # keys, types, ranges, combinations

    def sgd_config(self) -> SGDConfig:
        return SGDConfig(lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                         weight_decay=self.weight_decay)

    def make_optimizer(self, model: Model, total_steps: int):
        """The configured optimizer and schedule over ``total_steps`` steps."""
        schedule = make_schedule(self.lr_schedule, self.lr, total_steps,
                                 warmup_steps=int(self.warmup * total_steps))
        if self.optimizer == "sgd":
            return SGD(model.params, model.grads, self.sgd_config(), schedule=schedule)
        return make_optimizer("adamw", model.params, model.grads, lr=self.lr,
                              weight_decay=self.weight_decay, betas=(self.momentum, 0.999),
                              decay_kinds=("conv", "fc"), schedule=schedule)


def evaluate(model: Model, data: Dataset, batch_size: int = 128) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``data`` in evaluation mode, ``batch_size``
    samples at a time (the transient im2col buffers, not the result, grow with it: 128 keeps an
    evaluating rank within the per-rank memory of a training one)."""
    total_loss, correct, n = 0.0, 0, 0
    for x, y in iterate_batches(data, batch_size, shuffle=False):
        logits = model.forward(x, training=False)
        loss, _ = softmax_cross_entropy(logits, y)
        total_loss += loss * len(y)
        correct += int((logits.argmax(axis=1) == y).sum())
        n += len(y)
    return total_loss / n, correct / n


def _epoch(model: Model, opt, train: Dataset, batch_size: int, *, seed: int, rank: int,
           epoch: int, steps: int, wrap=nullcontext, bar=None) -> dict:
    """Train one epoch (at most ``steps`` optimizer steps of it): ``{"loss": mean training
    loss, "train_accuracy", "lr": the last step's, "steps": steps taken}``."""
    loss_sum, correct, n, done, lr = 0.0, 0, 0, 0, float("nan")
    for x, y in iterate_batches(train, batch_size, seed=seed, rank=rank, epoch=epoch):
        if done >= steps:
            break
        with wrap():
            loss, logits = model.loss_and_grad(x, y)
            lr = opt.step()
        done += 1
        loss_sum += loss * len(y)
        correct += int((logits.argmax(axis=1) == y).sum())
        n += len(y)
        if bar is not None:
            bar.update(1)
    return {"loss": loss_sum / n, "train_accuracy": correct / n, "lr": lr, "steps": done}


def _evaluation(model: Model, test: Dataset) -> dict:
    """Held-out ``test_loss`` and ``test_accuracy`` (and a language model's ``test_lm_loss``,
    ``test_perplexity``, ``test_bits_per_byte``)."""
    test_loss, test_acc = evaluate(model, test)
    out = {"test_loss": test_loss, "test_accuracy": test_acc}
    if getattr(model, "lm", False):
        lm = model.evaluate_lm(test)
        out.update(test_lm_loss=lm["loss"], test_perplexity=lm["perplexity"],
                   test_bits_per_byte=lm["bits_per_byte"])
    return out


def _final(record: dict, train_s: float, steps: int) -> dict:
    out = {"final_test_accuracy": record["test_accuracy"], "final_loss": record["loss"],
           "final_test_loss": record["test_loss"], "train_time_s": train_s, "steps": steps}
    if "test_perplexity" in record:
        out.update(final_test_lm_loss=record["test_lm_loss"],
                   final_test_perplexity=record["test_perplexity"],
                   final_test_bits_per_byte=record["test_bits_per_byte"])
    return out


def fit(model: Model, opt: SGD, train: Dataset, test: Dataset, *, epochs: int, batch_size: int,
        steps: int | None = None, seed: int = 0, rank: int = 0, progress: bool = False,
        on_epoch: Callable[[dict], None] | None = None, compute=None) -> dict:
    """Train ``model`` with ``opt`` for ``epochs`` epochs; evaluate on ``test`` after each.

    Parameters
    ----------
    model, opt : Model, SGD or AdamW
    train, test : Dataset
        Arrays on the model's device.
    epochs, batch_size : int
    steps : int, optional
        Stop after this many optimizer steps (then ``epochs = ceil(steps / batches per epoch)``
        and the last epoch is partial; evaluation still follows every epoch).
    seed, rank : int
        Shuffling stream ``default_rng([seed, rank, epoch])``.
    progress : bool
        Show a tqdm bar over all steps.
    on_epoch : callable(record), optional
        Receives one dict per epoch (epoch, step, loss, train_accuracy, test_loss,
        test_accuracy, lr, time_s).
    compute : callable returning a context manager, optional
        Wraps each step (e.g. ``run.clock.compute``) so compute time is measured.

    Returns
    -------
    dict with ``final_test_accuracy``, ``final_loss`` (mean training loss of the last epoch),
    ``final_test_loss``, ``train_time_s``, ``steps``; for a language model also
    ``final_test_lm_loss`` (held-out next-byte loss over every position, nats),
    ``final_test_perplexity`` and ``final_test_bits_per_byte``.  (``final_test_accuracy`` /
    ``final_test_loss`` of a language model score the byte after each held-out window.)

    ``python -m models train`` runs the same epochs through :class:`runner.loop.RunLoop`.
    """
    steps_per_epoch = num_batches(len(train), batch_size)
    if steps is not None:
        epochs = -(-int(steps) // steps_per_epoch)
    total = epochs * steps_per_epoch if steps is None else int(steps)
    bar = _bar(total, model.name) if progress else None
    wrap = compute if compute is not None else nullcontext
    t0 = time.perf_counter()
    record: dict = {}
    train_s, done = 0.0, 0
    for epoch in range(epochs):
        t_epoch = time.perf_counter()
        ep = _epoch(model, opt, train, batch_size, seed=seed, rank=rank, epoch=epoch,
                    steps=total - done, wrap=wrap, bar=bar)
        done += ep["steps"]
        train_s += time.perf_counter() - t_epoch
        ev = _evaluation(model, test)
        record = {"epoch": epoch, "step": opt.step_count, "loss": ep["loss"],
                  "train_accuracy": ep["train_accuracy"], "test_loss": ev["test_loss"],
                  "test_accuracy": ev["test_accuracy"], "lr": ep["lr"],
                  "time_s": time.perf_counter() - t0,
                  **{k: v for k, v in ev.items() if k not in ("test_loss", "test_accuracy")}}
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.4f}", test_acc=f"{ev['test_accuracy']:.4f}")
        if on_epoch is not None:
            on_epoch(record)
    if bar is not None:
        bar.close()
    return _final(record, train_s, opt.step_count)


def _bar(total: int, desc: str):
    from tqdm.auto import tqdm  # noqa: PLC0415 (10 MiB; only a run that shows a bar)

    return tqdm(total=total, unit="step", desc=desc, leave=False)


class _Epochs(LoopBody):
    """One epoch of ``python -m models train`` for :class:`runner.loop.RunLoop` (serial: no
    communication); the evaluation is :func:`_evaluation` on the test set."""

    def __init__(self, run, config: TrainConfig, model: Model, opt, train: Dataset,
                 test: Dataset, total_steps: int, n_epochs: int, *, bar=None,
                 echo: bool = False) -> None:
        self.run, self.config, self.model, self.opt = run, config, model, opt
        self.train, self.test = train, test
        self.total_steps, self.n_epochs = total_steps, n_epochs
        self.bar, self.echo = bar, echo
        self.epoch: dict = {}
        self.last_eval: dict = {}
        self.done_steps, self.index, self.evaluated = 0, 0, False

    def unit(self, due):
        c = self.config
        self.index, self.evaluated = due.index, False
        self.epoch = _epoch(self.model, self.opt, self.train, c.batch_size, seed=c.seed,
                            rank=0, epoch=due.index, steps=self.total_steps - self.done_steps,
                            wrap=self.run.clock.compute, bar=self.bar)
        self.done_steps += self.epoch["steps"]
        return []

    def evaluate(self) -> Evaluation:
        self.last_eval, self.evaluated = _evaluation(self.model, self.test), True
        return Evaluation(self.last_eval["test_accuracy"],
                          values={k: v for k, v in self.last_eval.items()
                                  if k != "test_accuracy"})

    def line(self, interval) -> dict:
        ep = self.epoch
        ev = self.last_eval if self.evaluated else {}
        acc = f"{ev['test_accuracy']:.4f}" if ev else "-"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{ep['loss']:.4f}", test_acc=acc)
        elif self.echo:
            lm = (f"  test_lm_loss {ev['test_lm_loss']:.4f}  ppl {ev['test_perplexity']:.3f}"
                  if "test_perplexity" in ev else "")
            print(f"epoch {self.index + 1}/{self.n_epochs}  loss {ep['loss']:.4f}  "
                  f"test_acc {acc}{lm}", flush=True)
        return {"loss": ep["loss"], "train_accuracy": ep["train_accuracy"], "lr": ep["lr"],
                "optimizer_steps": self.opt.step_count}


#: training defaults that differ by model (everything else: :class:`TrainConfig`'s): the
#: transformers learn with AdamW, a short linear warm-up and a cosine decay (the ViT at
#: 2e-3 reaches 0.98 on digits in 30 epochs, the byte GPT at 3e-3 beats the corpus's unigram
#: entropy within its first epoch: docs/BENCHMARKS.md, transformers), the CNNs with SGD
MODEL_DEFAULTS = {
    "vit": {"optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.05, "warmup": 0.05,
            "lr_schedule": "cosine", "epochs": 30},
    "gpt": {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.05, "warmup": 0.05,
            "lr_schedule": "cosine", "epochs": 3},
}
#: the fields :data:`MODEL_DEFAULTS` may set (a flag left out takes the model's default)
PER_MODEL = ("optimizer", "lr", "weight_decay", "warmup", "lr_schedule", "epochs", "momentum")


def model_defaults(model: str, given: dict) -> dict:
    """``given`` (flag values, ``None`` where a flag was left out) completed with ``model``'s
    defaults (:data:`MODEL_DEFAULTS`), then :class:`TrainConfig`'s."""
    base = {f: TrainConfig.__dataclass_fields__[f].default for f in PER_MODEL}
    base.update(MODEL_DEFAULTS.get(model, {}))
    return {f: (given[f] if given.get(f) is not None else base[f]) for f in PER_MODEL}


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``python -m models``."""
    parser = argparse.ArgumentParser(prog="python -m models",
                                     description="Serial training of the spardist models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model serially")
    d = TrainConfig.__dataclass_fields__
    p.add_argument("--model", default=d["model"].default, choices=sorted(MODELS))
    p.add_argument("--dataset", default=d["dataset"].default, choices=sorted(DATASETS))
    p.add_argument("--data-dir", default=None, help="directory of the MNIST / CIFAR-10 files")
    p.add_argument("--epochs", type=int, default=None,
                   help="passes over the training set (default: the model's, see "
                        "MODEL_DEFAULTS; 10 for the CNNs)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (overrides --epochs; the last epoch may be partial)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: the model's: 0.05 SGD for the CNNs, 2e-3 / 3e-3 "
                        "AdamW for the ViT / GPT)")
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--optimizer", default=None, choices=sorted(OPTIMIZERS),
                   help="sgd (momentum) or adamw (--momentum is beta1); default: the model's "
                        "(adamw for the transformers, sgd otherwise)")
    p.add_argument("--warmup", type=float, default=None,
                   help="fraction of the steps in linear lr warm-up (cosine schedule)")
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--lr-schedule", default=None, choices=sorted(SCHEDULES))
    p.add_argument("--dtype", default=d["dtype"].default, choices=("float32", "float64"))
    p.add_argument("--arch", action="append", metavar="KEY=VALUE",
                   help="model factory argument, repeatable, e.g. --arch depths=2,2 --arch "
                        f"planes=16,32 or --arch mlp_ratio=1.5; keys per model: {arch_help()} "
                        "(types, ranges and defaults: models/arch.py)")
    p.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="evaluate on the test set after every N-th epoch and after the last "
                        "(0: after the last only; default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_common_args(p)
    return parser


def main(argv=None) -> dict:
    """Entry point of ``python -m models train``; returns the summary dict."""
    args = build_parser().parse_args(argv)
    per_model = model_defaults(args.model, {f: getattr(args, f) for f in PER_MODEL})
    config = TrainConfig(model=args.model, dataset=args.dataset, data_dir=args.data_dir,
                         steps=args.steps, batch_size=args.batch_size,
                         nesterov=args.nesterov, dtype=args.dtype,
                         arch=parse_arch(args.arch, args.model, args.dataset), seed=args.seed,
                         **per_model)
    run = start_run(args, system="models", unit="epoch", method=f"{config.model}_{config.dataset}",
                    config=config)
    if run.size != 1:
        raise ValueError("python -m models train is serial (world size 1); for multi-rank "
                         "training use python -m dataparallel train")
    arch, data_kw = split_arch(config.arch, config.model, config.dataset)
    split = load_dataset(config.dataset, config.data_dir, **data_kw)
    check_batch_size(config.batch_size, len(split.train),
                     f"the {config.dataset} training set")
    train, test = split.train.to(run.xp), split.test.to(run.xp)
    model = build_model(config.model, train.input_shape, train.num_classes, xp=run.xp,
                        dtype=np.dtype(config.dtype), seed=config.seed, **arch)
    per_epoch = num_batches(len(train), config.batch_size)
    steps = config.steps if config.steps is not None else config.epochs * per_epoch
    n_epochs = -(-steps // per_epoch)
    opt = config.make_optimizer(model, steps)
    bar = _bar(steps, model.name) if not args.quiet and sys.stderr.isatty() else None
    body = _Epochs(run, config, model, opt, train, test, steps, n_epochs, bar=bar,
                   echo=not args.quiet)
    # one metrics line per epoch; the test set evaluated every --eval-every epochs and last
    loop = RunLoop(run, total=n_epochs, flag="--epochs", eval_every=args.eval_every,
                   log_every=1)
    try:
        loop.run(body)
    finally:
        if bar is not None:
            bar.close()
    result = _final({"loss": body.epoch["loss"], **body.last_eval}, loop.units_wall_s,
                    opt.step_count)
    if getattr(model, "lm", False):
        result["unigram_entropy"] = unigram_entropy()
    summary = run.finish(metrics={**result, "num_params": model.num_params},
                         predicted=loop.predicted.block(),
                         extra={"model": {"name": model.name, "num_params": model.num_params,
                                          "layout": model.layout.describe()}})
    if not args.quiet:
        print(f"final test accuracy {result['final_test_accuracy']:.4f}, final loss "
              f"{result['final_loss']:.4f}; results in {run.out}", flush=True)
    return summary

