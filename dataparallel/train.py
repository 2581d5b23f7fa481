"""``python -m dataparallel train --method NAME``: one data-parallel trainer for every
gradient-sync strategy in :data:`dataparallel.strategy.STRATEGIES`.

Every rank trains the same model (same seed) on its own shard of the data; each step it computes
its local gradient, the strategy turns it into the synchronized gradient (``sync(state, buffers)
-> synced``), and the optimizer applies it.  Data, shards, model, optimizer and topology are the
ones ``hsadmm train`` uses, so the systems are compared on equal terms: the default budget of 8
epochs equals H-SADMM's default of 8 outer iterations of one local epoch.

Per evaluation interval (``--eval-every`` steps, and the last step) ``metrics.jsonl`` holds the
rank-0 training loss, test accuracy of the synchronized model, the interval's inter/intra-node
bytes, modeled communication time per phase and the simulated clock.  ``summary.json`` holds
measured (ledger) and predicted (closed form, :mod:`volume.dataparallel`) traffic.

Checkpoints: ``--checkpoint-every N`` saves every rank's state after every N-th step and at the
end (:class:`runner.checkpoints.RunCheckpoints`): parameters, BatchNorm statistics, optimizer state
(momentum), the strategy's own state (:meth:`Strategy.state_dict`: error-feedback residuals,
masks, profiles, ...), the position in the mini-batch stream and the trainer's running
accumulators.  ``--resume`` continues from the newest checkpoint intact on every rank up to
``--steps`` (or ``--epochs``) in total; the result (parameters, metrics lines, traffic) equals an
uninterrupted run's.  Strategy options of other methods (e.g. ``--init`` with ``--method ddp``)
are refused.  Progress: rank 0 prints the step, loss, last test accuracy and inter-node bytes so
far every ``--progress-every`` steps on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from dataclasses import dataclass

import numpy as np

from models import OPTIMIZERS, SCHEDULES, build_model, iterate_batches, load_shard
from models.data import check_batch_size
from models.optim import make_optimizer, make_schedule
from models.train import evaluate, parse_arch
from runner.checkpoints import RunCheckpoints
from runner.options import add_common_args, add_training_args
from runner.progress import Progress
from runner.run import start_run
from substrate.ledger import Predicted
from substrate.options import add_dataclass_args, check_range, from_args, option

from .pactrain import load_init
from .strategy import (
    STRATEGIES,
    StepState,
    SyncContext,
    add_strategy_args,
    check_unused_options,
    options_from_args,
)

__all__ = ["DPConfig", "build_parser", "main", "train"]


@dataclass(frozen=True)
class DPConfig:
    """Trainer configuration shared by every strategy (frozen; written into ``summary.json``)."""

    method: str = option("ddp", "gradient-sync strategy: one of the registered methods "
                         "(ddp, topk, pactrain, sdp, ssfusion, ...)")
    model: str = option("cnn", "models/ name: cnn, resnet, mlp")
    dataset: str = option("digits", "digits (embedded), mnist, cifar10, synthetic")
    data_dir: str | None = option(None, "directory of MNIST/CIFAR-10 files")
    epochs: float = option(8.0, "passes over each shard")
    steps: int | None = option(None, "optimizer steps (overrides --epochs)")
    batch_size: int = option(32, "per-rank batch size")
    lr: float = option(0.05, "learning rate")
    optimizer: str = option("sgd", "optimizer: SGD with momentum, or AdamW (its beta1 is "
                            "--momentum)", choices=tuple(sorted(OPTIMIZERS)))
    lr_schedule: str = option("constant", "learning-rate schedule over the run's steps",
                              choices=tuple(sorted(SCHEDULES)))
    warmup: float = option(0.0, "fraction of the steps with a linear warm-up (--lr-schedule "
                           "cosine)")
    arch: tuple = option(default_factory=tuple, help="model factory argument, repeatable: "
                         "--arch depths=2,2 --arch planes=16,32 (--arch context=N: the text "
                         "dataset's window)", append=True, metavar="KEY=VALUE")
    momentum: float = option(0.9, "SGD momentum (AdamW: beta1)")
    weight_decay: float = option(1e-4, "weight decay of conv and fc weights")
    eval_every: int = option(0, "steps between test evaluations (0: once per epoch)")
    target_accuracy: float = option(0.9, "accuracy for the simulated time-to-accuracy metric")
    init: str | None = option(
        None, "start every method from this .npz of a trained model's flat parameters "
        "(dataparallel.pactrain.save_init; PacTrain prunes it at once)", type=str)
    #: from :func:`runner.options.add_training_args` / :func:`runner.options.add_common_args`
    checkpoint_every: int = option(0, cli=False)
    resume: bool = option(False, cli=False)
    seed: int = option(0, cli=False)

    def __post_init__(self) -> None:
        if self.method not in STRATEGIES:
            raise ValueError(f"unknown --method {self.method!r}; valid: {sorted(STRATEGIES)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        check_range("--epochs", self.epochs, gt=0)
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        check_range("--lr", self.lr, gt=0)
        check_range("--momentum", self.momentum, ge=0, lt=1)
        check_range("--weight-decay", self.weight_decay, ge=0)
        if not 0 <= self.warmup < 1:
            raise ValueError(f"--warmup is a fraction of the run's steps in [0, 1), got "
                             f"{self.warmup}")
        if self.warmup > 0 and self.lr_schedule != "cosine":
            raise ValueError("--warmup needs --lr-schedule cosine")
        parse_arch(self.arch)  # validates KEY=VALUE
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got "
                             f"{self.checkpoint_every}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: once per epoch), got "
                             f"{self.eval_every}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")

    def total_steps(self, shard_size: int) -> int:
        """``--steps`` or ``ceil(epochs * batches per epoch)``."""
        if self.steps is not None:
            return self.steps
        return max(1, math.ceil(self.epochs * math.ceil(shard_size / self.batch_size)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dataparallel train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, DPConfig, "training")
    add_strategy_args(p)
    add_training_args(p, "step", progress_every=20)
    add_common_args(p)
    return p


#: configuration fields a resumed run may change (everything else must match the checkpoint)
RESUMABLE = ("steps", "epochs", "checkpoint_every", "resume")


def _host(run, a) -> np.ndarray:
    return np.array(run.backend.asnumpy(a), copy=True)


def _trainer_state(run, model, opt, strategy, acc) -> dict:
    """This rank's model, optimizer and strategy state for a checkpoint (the trainer's own
    accumulators are added by the caller)."""
    state = {"model/params": _host(run, model.params.flat)}
    state.update({f"model/buffer/{k}": _host(run, v) for k, v in model.buffers.items()})
    for key, value in opt.state_dict().items():     # SGD: momentum; AdamW: both moments
        if value is not None:
            state[f"opt/{key}"] = np.int64(value) if key == "step_count" else value
    state.update({f"strategy/{k}": v for k, v in strategy.state_dict().items()})
    state["train/acc"] = np.float64(acc)
    return state


def _load_trainer_state(run, model, opt, strategy, state: dict) -> None:
    """Restore :func:`_trainer_state` output in place."""
    xp = run.xp
    params = state["model/params"]
    if params.shape != model.params.flat.shape:
        raise ValueError(f"--resume: the checkpoint holds {params.size} parameters, this model "
                         f"has {model.params.flat.size}: resume with the model of the run that "
                         "wrote it")
    model.params.flat[...] = xp.asarray(params)
    for k, v in model.buffers.items():
        v[...] = xp.asarray(state[f"model/buffer/{k}"])
    opt.load_state_dict({"step_count": int(state["opt/step_count"]),
                         **{k[len("opt/"):]: v for k, v in state.items()
                            if k.startswith("opt/") and k != "opt/step_count"},
                         "momentum_buffer": state.get("opt/momentum_buffer")})
    strategy.load_state_dict({k[len("strategy/"):]: v for k, v in state.items()
                              if k.startswith("strategy/")})


def train(args) -> dict:
    """Train with the configured strategy; returns the summary (every rank)."""
    cfg = from_args(DPConfig, args)
    cls = STRATEGIES[cfg.method]
    check_unused_options(args, cfg.method, shared=DPConfig.__dataclass_fields__)
    options = options_from_args(cls.Options, args)
    run = start_run(args, system="dataparallel", method=cfg.method,
                    config={**vars(cfg), "options": vars(options) if vars(options) else {}})
    xp = run.xp
    arch = dict(parse_arch(cfg.arch))
    data_kw = {"context": int(arch.pop("context"))} if "context" in arch else {}
    # each rank reads only its shard of the training set (CIFAR-10: batch file by batch file)
    data = load_shard(cfg.dataset, cfg.data_dir, rank=run.rank, size=run.size, seed=cfg.seed,
                      **data_kw)
    train_shard = data.train.to(xp)
    check_batch_size(cfg.batch_size, len(train_shard),
                     f"each rank's shard of the {data.train_total} {cfg.dataset} training "
                     f"samples split over {run.size} ranks")
    test = data.test.to(xp)
    shape, classes = data.train.input_shape, data.train.num_classes
    model = build_model(cfg.model, shape, classes, xp=xp, seed=cfg.seed, **arch)
    if cfg.init is not None:   # the same trained start for every method (a fair comparison)
        load_init(cfg.init, model)
    budget = cfg.total_steps(len(train_shard))
    schedule = make_schedule(cfg.lr_schedule, cfg.lr, budget,
                             warmup_steps=int(cfg.warmup * budget))
    opt = make_optimizer(cfg.optimizer, model.params, model.grads, lr=cfg.lr,
                         momentum=cfg.momentum, betas=(cfg.momentum, 0.999),
                         weight_decay=cfg.weight_decay, decay_kinds=("conv", "fc"),
                         schedule=schedule)
    strategy = cls(SyncContext(run=run, model=model, opt=opt, train=train_shard, config=cfg),
                   options)
    eval_model = build_model(cfg.model, shape, classes, xp=xp, seed=cfg.seed, **arch)

    steps_per_epoch = math.ceil(len(train_shard) / cfg.batch_size)
    total = strategy.total_steps(budget)
    eval_every = cfg.eval_every or steps_per_epoch
    fingerprint = {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE},
                   "options": dataclasses.asdict(options)}
    ckpt = RunCheckpoints(run, every=cfg.checkpoint_every, fingerprint=fingerprint, unit="step",
                          flag="--steps")
    predicted = Predicted()
    acc = float("nan")
    time_to_target = None
    step, losses = 0, []
    snap = run.ledger.snapshot()
    interval = {"intra": 0, "inter": 0}
    if cfg.resume:
        step, state = ckpt.resume(total)
        _load_trainer_state(run, model, opt, strategy, state)
        acc = float(state["train/acc"])
        losses = state["train/losses"].tolist()
        interval, snap, pred_state, time_to_target = (
            json.loads(str(state[f"train/{k}"]))
            for k in ("interval", "snap", "predicted", "time_to_target"))
        predicted = Predicted.from_state(pred_state)
    start = step

    progress = Progress(run, total=total, unit="step", every=getattr(args, "progress_every", 0),
                        start=start)
    epoch = step // steps_per_epoch
    # per-layer compute events (timeline clock): gradients become ready in backward order
    model.recorder = run.clock.layers
    # since the last metrics line: wall seconds of the training steps (forward, backward, sync,
    # update; no evaluation: the measured side of the per-step timeline comparison), simulated
    # step time (critical path) and the no-overlap sum
    wall_acc, sim_acc, serial_acc, wall_step = 0.0, 0.0, 0.0, step
    while step < total:
        batches = iterate_batches(train_shard, cfg.batch_size, seed=cfg.seed, rank=run.rank,
                                  epoch=epoch)
        # a resumed run continues the epoch's stream after the batches already consumed
        for x, y in itertools.islice(batches, step - epoch * steps_per_epoch, None):
            with run.clock.compute("forward+backward"):
                loss, _ = model.loss_and_grad(x, y, ready=strategy.on_ready)
            state = StepState(step=step, epoch=epoch, loss=float(loss))
            strategy.sync(state, model.grads)
            with run.clock.compute("optimizer", flops=opt.flops(),
                                   deps=run.clock.comm_events()):
                opt.step()
            strategy.after_step(state)
            step += 1
            evaluating = step % eval_every == 0 or step == total
            if evaluating:
                strategy.before_eval()
            timing = run.clock.step()
            wall_acc += run.clock.step_wall_s
            sim_acc += timing.step_s
            serial_acc += timing.no_overlap_s
            # the plan's records of the step, held against the calls that ran, priced
            b = predicted.add(run.recorder.account(strategy.step_calls()))
            interval["intra"] += b["intra"]
            interval["inter"] += b["inter"]
            losses.append(float(loss))
            if evaluating:
                if run.rank == 0:
                    eval_model.params.flat[...] = strategy.eval_params()
                    for name, buf in model.buffers.items():
                        eval_model.buffers[name][...] = buf
                    _, acc = evaluate(eval_model, test)
                    if time_to_target is None and acc >= cfg.target_accuracy:
                        time_to_target = run.clock.sim_s
                delta = run.ledger.since(snap)
                snap = run.ledger.snapshot()
                run.log(step, epoch=step / steps_per_epoch, loss=float(np.mean(losses)),
                        step_wall_s=wall_acc / max(1, step - wall_step),
                        step_sim_s=sim_acc / max(1, step - wall_step),
                        step_no_overlap_s=serial_acc / max(1, step - wall_step),
                        test_accuracy=acc, sim_s=run.clock.sim_s,
                        compute_s=run.clock.compute_s,
                        comm_modeled_s=run.clock.comm_modeled_s,
                        phase_modeled_s={p: e["modeled_s"] for p, e in delta.items()},
                        inter_node_bytes=interval["inter"], intra_node_bytes=interval["intra"])
                losses, interval = [], {"intra": 0, "inter": 0}
                wall_acc, sim_acc, serial_acc, wall_step = 0.0, 0.0, 0.0, step
                run.clock.mark()   # the evaluation is not part of the next step's wall time
            progress.update(step, loss=float(loss), test_accuracy=acc,
                            inter_bytes=predicted.total("inter"),
                            total_bytes=predicted.total("inter") + predicted.total("intra"))
            if ckpt.due(step, last=step == total):
                ckpt.save(step, {
                    **_trainer_state(run, model, opt, strategy, acc),
                    "train/losses": np.array(losses, dtype=np.float64),
                    **{f"train/{k}": json.dumps(v) for k, v in (
                        ("interval", interval), ("snap", snap), ("predicted", predicted.state()),
                        ("time_to_target", time_to_target))}})
            if step == total:
                break
        epoch += 1
    progress.close()
    metrics = {"final_test_accuracy": float(acc), "steps": step, "budget_steps": budget,
               "epochs": step / steps_per_epoch, "target_accuracy": cfg.target_accuracy,
               "sim_s_to_target": time_to_target, **strategy.report()}
    if cfg.resume:
        metrics["resumed_from_step"] = start
    if getattr(eval_model, "lm", False):
        # a language model: held-out loss over every position, perplexity, bits per byte
        # on rank 0, which writes the summary (its eval_params are the assembled model)
        if run.rank == 0:
            eval_model.params.flat[...] = strategy.eval_params()
            metrics.update({f"heldout_{k}": v for k, v in eval_model.evaluate_lm(test).items()})
    summary = run.finish(metrics=metrics, predicted=predicted.block())
    return {**summary, "_rank": run.rank}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataparallel")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", parents=[build_parser()], add_help=False,
                   help="data-parallel training with one gradient-sync strategy")
    args = p.parse_args(argv)
    summary = train(args)
    if summary["_rank"] == 0:
        m, t = summary["metrics"], summary["traffic"]
        print(f"{summary['method']}: test accuracy {m['final_test_accuracy']:.4f} after "
              f"{m['steps']} steps, inter-node bytes {t['measured']['inter_node_bytes']} "
              f"(predicted {t['predicted']['inter_node_bytes']}), simulated "
              f"{summary['timing']['sim_s']:.2f} s")
    return 0
