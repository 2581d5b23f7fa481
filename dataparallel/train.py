"""``python -m dataparallel train --method NAME``: one data-parallel trainer for every
gradient-sync strategy in :data:`dataparallel.strategy.STRATEGIES`.

Every rank trains the same model (same seed) on its own shard of the data; each step it computes
its local gradient, the strategy turns it into the synchronized gradient (``sync(state, buffers)
-> synced``), and the optimizer applies it.  Data, shards, model, optimizer and topology are the
ones ``hsadmm train`` uses, so the systems are compared on equal terms: the default budget of 8
epochs equals H-SADMM's default of 8 outer iterations of one local epoch.

The steps run in :class:`runner.loop.RunLoop`.  Rank 0 evaluates the synchronized model after
every ``--eval-every`` steps (default: once per epoch; 0: only after the last) and after the
last, and each evaluation writes a ``metrics.jsonl`` line (the schema of
``runner/metrics.schema.json``): the interval's bytes, per-step wall, simulated and no-overlap
times, the test accuracy and the evaluation's own wall time, the clock's totals, then the
interval's mean training loss and ``epoch`` (steps done / steps per epoch).  ``summary.json``
holds measured (ledger) and predicted (the plan's records, accounted step by step) traffic.

Checkpoints: ``--checkpoint-every N`` saves every rank's state after every N-th step and at the
end (:class:`runner.checkpoints.RunCheckpoints`): parameters, BatchNorm statistics, optimizer state
(momentum), the strategy's own state (:meth:`Strategy.state_dict`: error-feedback residuals,
masks, profiles, ...), the interval's losses and the run loop's own state (the position in the
mini-batch stream follows from the step).  ``--resume`` continues from the newest checkpoint
intact on every rank up to ``--steps`` (or ``--epochs``) in total; the result (parameters,
metrics lines, traffic) equals an uninterrupted run's.  Strategy options of other methods (e.g.
``--init`` with ``--method ddp``) are refused.  Progress: rank 0 prints the step, loss, last
test accuracy and inter-node bytes so far every ``--progress-every`` steps on stderr.
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
from models.arch import arch_help, parse_arch, split_arch
from models.data import check_batch_size
from models.optim import make_optimizer, make_schedule
from models.train import evaluate
from runner.loop import Evaluation, LoopBody, RunLoop
from runner.options import add_common_args, add_training_args
from runner.run import start_run
from substrate.executor import Pass
from substrate.options import add_dataclass_args, check_range, from_args, option

from .pactrain.init_file import INIT_FORMAT, check_init_file, load_init
from .program import StepBindings, step_program, unit_tensors
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
    model: str = option("cnn", "models/ name: cnn, resnet, mlp, vit (images), gpt (--dataset "
                        "text)")
    dataset: str = option("digits", "digits (embedded), mnist, cifar10, synthetic (images), "
                          "text (embedded bytes)")
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
                         f"dataset's window); keys per model: {arch_help()} (types, ranges "
                         "and defaults: models/arch.py)", append=True, metavar="KEY=VALUE")
    momentum: float = option(0.9, "SGD momentum (AdamW: beta1)")
    weight_decay: float = option(1e-4, "weight decay of conv and fc weights")
    eval_every: int | None = option(
        None, "evaluate the synchronized model on rank 0 after every N-th step and after the "
        "last (0: after the last only; default: once per epoch)", type=int, metavar="N")
    target_accuracy: float = option(0.9, "accuracy for the simulated time-to-accuracy metric")
    init: str | None = option(
        None, "start every method from a trained model (PacTrain prunes it at once): "
        f"{INIT_FORMAT}; anything else (an .npy, another model's file, NaN or Inf values) is "
        "refused before the run", type=str, metavar="FILE")
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
        parse_arch(self.arch, self.model, self.dataset)  # keys, types, ranges, combinations
        if self.init is not None:
            check_init_file(self.init)   # the format; load_init checks the arrays
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got "
                             f"{self.checkpoint_every}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: after the last step only), got "
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


#: configuration fields a resumed run may change (everything else must match the checkpoint);
#: a new total is refused where it changes the learning-rate schedule (:data:`SCHEDULE_WHY`)
RESUMABLE = ("steps", "epochs", "checkpoint_every", "resume")
#: how each --lr-schedule depends on the run's steps (the reason a resume that changes them is
#: refused)
SCHEDULE_WHY = {
    "constant": "the constant schedule does not depend on the run's steps",
    "cosine": "--lr-schedule cosine decays the learning rate over the run's steps (--steps, or "
              "the steps of --epochs) and --warmup is a fraction of them",
    "step": "--lr-schedule step divides the learning rate every third of the run's steps "
            "(--steps, or the steps of --epochs)",
}


def _host(run, a) -> np.ndarray:
    return np.array(run.backend.asnumpy(a), copy=True)


def _trainer_state(run, model, opt, strategy) -> dict:
    """This rank's model, optimizer and strategy state for a checkpoint (the trainer's own
    accumulators are added by the caller)."""
    state = {"model/params": _host(run, model.params.flat)}
    state.update({f"model/buffer/{k}": _host(run, v) for k, v in model.buffers.items()})
    for key, value in opt.state_dict().items():     # SGD: momentum; AdamW: both moments
        if value is not None:
            state[f"opt/{key}"] = np.int64(value) if key == "step_count" else value
    state.update({f"strategy/{k}": v for k, v in strategy.state_dict().items()})
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


class _Steps(LoopBody):
    """One optimizer step of the data-parallel trainer, for :class:`runner.loop.RunLoop`: the
    step's program (forward and backward, the strategy's records, the optimizer, and what the
    plan lists after the update, e.g. SDP's assembly before an evaluation), run by the
    executor; evaluation of the synchronized model on rank 0."""

    def __init__(self, run, cfg: DPConfig, model, opt, strategy, train_shard, test, eval_model,
                 steps_per_epoch: int) -> None:
        self.run, self.cfg = run, cfg
        self.model, self.opt, self.strategy = model, opt, strategy
        self.train, self.test, self.eval_model = train_shard, test, eval_model
        self.steps_per_epoch = steps_per_epoch
        #: losses of the steps since the last metrics line, the last step's, the simulated
        #: time at which rank 0 first evaluated at least --target-accuracy
        self.losses: list[float] = []
        self.loss, self.done = float("nan"), 0
        self.time_to_target = None
        self._epoch, self._batches = None, None
        self.units = model.compute_units()
        self.unit_tensors = unit_tensors(model)
        self.executor = strategy.executor
        self._programs: dict = {}


    def _batch(self, step: int):
        """The step's mini-batch: epoch ``step // steps per epoch``'s stream, entered where a
        resumed run stopped."""
        epoch = step // self.steps_per_epoch
        if epoch != self._epoch:
            batches = iterate_batches(self.train, self.cfg.batch_size, seed=self.cfg.seed,
                                      rank=self.run.rank, epoch=epoch)
            self._batches = itertools.islice(batches, step - epoch * self.steps_per_epoch, None)
            self._epoch = epoch
        return epoch, next(self._batches)

    def unit(self, due):
        return self._run_program(due)

    def _run_program(self, due):
        """The step as a program: the strategy's records of it laid between the model's
        backward and the optimizer (:func:`dataparallel.program.step_program`), run by the
        executor with the strategy bound to its calls and compute items."""
        run, strategy = self.run, self.strategy
        epoch, (x, y) = self._batch(due.index)
        state = StepState(step=due.index, epoch=epoch, loss=float("nan"), logged=due.log,
                          evaluated=due.eval)
        records = strategy.records(state)
        key = (id(records), run.recorder.overlap)
        program = self._programs.get(key)
        if program is None or program[0] is not records:
            program = (records, step_program(self.units, records, run.topo.placement, run.rank,
                                             overlap=run.recorder.overlap,
                                             leader_waits=strategy.leader_waits))
            self._programs = {key: program}
        loss = []

        def forward_backward(ready) -> None:
            loss.append(float(self.model.loss_and_grad(x, y, ready=ready)[0]))

        bind = StepBindings(strategy, Pass(forward_backward, self.unit_tensors), self.opt.step,
                            self.opt.flops())
        self.executor.run_step(program[1], bind)
        state.loss = loss[0]
        strategy.after_step(state)
        self.loss, self.done = state.loss, due.index + 1
        self.losses.append(self.loss)
        return records

    def evaluate(self) -> Evaluation:
        if self.run.rank != 0:
            return Evaluation()
        self.eval_model.params.flat[...] = self.strategy.eval_params()
        for name, buf in self.model.buffers.items():
            self.eval_model.buffers[name][...] = buf
        _, acc = evaluate(self.eval_model, self.test)
        if self.time_to_target is None and acc >= self.cfg.target_accuracy:
            self.time_to_target = self.run.clock.sim_s
        return Evaluation(acc)

    def line(self, interval) -> dict:
        line = {"epoch": self.done / self.steps_per_epoch, "loss": float(np.mean(self.losses))}
        self.losses = []
        return line

    def progress(self) -> dict:
        return {"loss": self.loss}

    def state_dict(self) -> dict:
        return {**_trainer_state(self.run, self.model, self.opt, self.strategy),
                "train/losses": np.array(self.losses, dtype=np.float64),
                "train/time_to_target": json.dumps(self.time_to_target)}

    def load_state_dict(self, state: dict) -> None:
        _load_trainer_state(self.run, self.model, self.opt, self.strategy, state)
        self.losses = state["train/losses"].tolist()
        self.time_to_target = json.loads(str(state["train/time_to_target"]))



def train(args) -> dict:
    """Train with the configured strategy; returns the summary (every rank)."""
    cfg = from_args(DPConfig, args)
    cls = STRATEGIES[cfg.method]
    check_unused_options(args, cfg.method, shared=DPConfig.__dataclass_fields__)
    options = options_from_args(cls.Options, args)
    run = start_run(args, system="dataparallel", method=cfg.method,
                    config={**vars(cfg), "options": vars(options) if vars(options) else {}})
    xp = run.xp
    arch, data_kw = split_arch(cfg.arch, cfg.model, cfg.dataset)
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
    fingerprint = {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE},
                   "options": dataclasses.asdict(options)}
    # a metrics line at every evaluation (--eval-every steps, default one epoch's) and the last;
    # the learning-rate schedule follows from the budget, so a resume may not change it
    # the total is said in the option the user gave (--epochs 1 (45 steps)) in resume messages
    asked = f"--steps {cfg.steps}" if cfg.steps is not None else f"--epochs {cfg.epochs:g}"
    loop = RunLoop(run, total=total, flag="--steps", given=asked, may_change=("--epochs",),
                   fingerprint=fingerprint,
                   checkpoint_every=cfg.checkpoint_every,
                   progress_every=getattr(args, "progress_every", 0),
                   eval_every=steps_per_epoch if cfg.eval_every is None else cfg.eval_every,
                   resume=cfg.resume,
                   schedule={"lr_schedule": cfg.lr_schedule, **dataclasses.asdict(schedule)},
                   schedule_why=SCHEDULE_WHY[cfg.lr_schedule])
    body = _Steps(run, cfg, model, opt, strategy, train_shard, test, eval_model,
                  steps_per_epoch)
    state = loop.resume()
    if state is not None:
        body.load_state_dict(state)
    # what the strategy ran while it was built (PacTrain's GraSP when it prunes at once): in
    # the first metrics line, as the calls ran before the first step
    loop.account(strategy.setup_records())
    # per-layer compute blocks: gradients become ready in backward order
    model.recorder = run.clock.layers
    loop.run(body)
    body.executor.verify()           # the last step, closed by the loop
    step = loop.done
    metrics = {"final_test_accuracy": loop.final_accuracy, "steps": step,
               "budget_steps": budget, "epochs": step / steps_per_epoch,
               "target_accuracy": cfg.target_accuracy, "sim_s_to_target": body.time_to_target,
               **strategy.report()}
    if cfg.resume:
        metrics["resumed_from_step"] = loop.start
    if run.recorder.program is not None:   # every step's recording held to its program
        metrics["program_steps_verified"] = body.executor.steps_verified
    if getattr(eval_model, "lm", False) and run.rank == 0:
        # a language model: held-out loss over every position, perplexity, bits per byte
        # on rank 0, which writes the summary (its eval_params are the assembled model)
        eval_model.params.flat[...] = strategy.eval_params()
        metrics.update({f"heldout_{k}": v for k, v in eval_model.evaluate_lm(test).items()})
    summary = run.finish(metrics=metrics, predicted=loop.predicted.block())
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
