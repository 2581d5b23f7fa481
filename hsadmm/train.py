"""``python -m hsadmm train``: H-SADMM (or flat ADMM) on a ``models/`` network and dataset.

Defaults are tuned for the embedded digits run, which trains a small CNN from scratch in 8 outer
iterations: lr 0.05, rho1 0.05, rho2 0.005, masks frozen after iteration 4 (measured: 96.4 % test
accuracy at keep 0.5 channel on 2 virtual nodes x 2).

``--paper-defaults`` takes PruneX §5.1.5's values for every solver option not given on the
command line (lr 1e-3, batch 128, rho1 1.5e-3, rho2 1.5e-4, cap 10, 5 local epochs, keep 0.5
channel).  With them the channel masks flip to the complementary support every iteration (drift
0.97 for 16 iterations) instead of settling in 5-15 iterations (§4.5): eq. 8's local step moves
``theta`` towards its anchor ``z_i - u`` by only about ``eta rho1 steps / (1 - momentum)``
(2e-4 of the way), so the scaled dual ``u`` of a pruned channel grows by the channel's whole
weight each iteration while ``theta`` stays put; ``theta + u`` of the pruned channels is then
about twice the kept ones' and wins the next projection (eq. 10), and back.  Residual balancing
raises rho1 only while ``r > 10 s``, and the flips keep ``s = rho1 ||z_i^{k+1} - z_i^k||`` within
that factor, so rho1 stalls at 0.1-0.4, where ``theta`` still cannot follow.  With rho1 at the
paper's cap (10) from the start the drift is 0 from the second iteration; ``--rho-update
increase`` (rho doubled every iteration up to the cap, §4.5's "as the penalty parameters
increase") reaches the cap at iteration 13; the drift then falls to 0.55, 0.18 and is 0 from
iteration 17 on (95.5 % test accuracy after 24).  Measured per iteration in
``docs/bench_out/hsadmm.md``.

At the end rank 0 writes ``OUT/compact_model.npz`` (:mod:`hsadmm.export`: the consensus model
with pruned filters and channels physically removed), evaluates it, and records
``compact_test_accuracy`` (equal to ``final_test_accuracy``), ``compact_conv_params`` and
``dense_conv_params`` in the summary's metrics and the export's manifest under
``compact_export``.

Checkpoints: ``--checkpoint-every N`` saves every rank's complete solver state after every N-th
outer iteration and at the end to ``OUT/checkpoints/ckpt-r{rank}-s{iterations done:08d}.npz``
(:class:`runner.checkpoints.RunCheckpoints`, newest two kept).  ``--resume`` continues the run in
``--out`` from the newest iteration every rank has an intact checkpoint for, up to ``--iters``
iterations in total, and produces the same ``z`` as an uninterrupted run (runs resume at
iteration boundaries; the mini-batch stream position is part of the state).  The metrics lines,
traffic (measured and predicted) and compute time of the iterations before the checkpoint come
from the checkpoint, so ``metrics.jsonl`` and the summary's traffic equal an uninterrupted run's.
A finished run is continued only with a larger ``--iters``; a smaller one is refused.

Metrics and evaluation: the iterations run in :class:`runner.loop.RunLoop`; every iteration
writes a ``metrics.jsonl`` line (the schema of ``runner/metrics.schema.json``, then the solver's
values: ``iteration`` k from 0, loss, mask drift and sync, compact elements and the sizes of
the compact buckets (which the iteration's inter-node calls averaged), dense elements, residuals,
rho).  Rank 0 evaluates the consensus model ``z`` after every ``--eval-every`` iterations
(default 1; 0: after the last only) and after the last; the evaluation's wall time is
``eval_wall_s``, outside ``step_wall_s`` (the other ranks wait for it in the next iteration's
first collective: ``--eval-every 0`` removes that wait from a timing run).

Progress: rank 0 prints the iteration, loss, test accuracy of ``z`` and inter-node bytes so far
every ``--progress-every`` iterations (default 1) on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from models import MODELS, build_model, load_shard, zoo
from models.arch import check_model_dataset
from models.data import check_batch_size
from models.train import evaluate
from runner.loop import Evaluation, LoopBody, RunLoop
from runner.options import add_common_args, add_training_args
from runner.run import start_run
from substrate.options import add_dataclass_args, from_args, option

from .config import PAPER_DEFAULTS, HSADMMConfig, read_keep_file
from .export import export_compact, load_compact_model
from .solver import SOLVERS

__all__ = [
    "PAPER_DEFAULTS",
    "HSADMMConfig",
    "TrainConfig",
    "build_parser",
    "main",
    "solver_config",
    "train",
]

RUN = "what to train"
#: models the compact export can rebuild (a ``models.zoo.<name>_layers`` builder each)
COMPACT_MODELS = tuple(m for m in MODELS if hasattr(zoo, f"{m}_layers"))


@dataclass(frozen=True)
class TrainConfig:
    """What ``hsadmm train`` trains and for how long (the solver's options are
    :class:`HSADMMConfig`'s)."""

    method: str = option("hsadmm", "solver: hsadmm (Algorithm 1) or flat-admm (PruneX (AR): "
                                   "flat consensus, same masks and freezing)", group=RUN)
    model: str = option("cnn", "models/ name: cnn, resnet, mlp", group=RUN)
    dataset: str = option("digits", "digits (embedded), mnist, cifar10, synthetic", group=RUN)
    data_dir: str | None = option(None, "directory of MNIST/CIFAR-10 files", group=RUN)
    iters: int = option(8, "outer ADMM iterations K_max", group=RUN)
    eval_every: int = option(1, "evaluate the consensus model z on rank 0 after every N-th "
                             "iteration and after the last (0: after the last only)",
                             group=RUN, metavar="N")
    paper_defaults: bool = option(
        False, "PruneX §5.1.5's values for every solver option not given on the command line: "
               "lr 1e-3, batch 128, rho1 1.5e-3, rho2 1.5e-4, 5 local epochs", group=RUN)

    def __post_init__(self) -> None:
        if self.method not in SOLVERS:
            raise ValueError(f"unknown --method {self.method!r}; valid: {sorted(SOLVERS)}")
        check_model_dataset(self.model, self.dataset)
        if self.model not in COMPACT_MODELS:
            raise ValueError(f"--model {self.model}: hsadmm train ends with the compact export, "
                             "which rebuilds the model from its models.zoo layer tree; those "
                             f"exist for {', '.join(COMPACT_MODELS)}: pass one of them")
        if self.iters < 1:
            raise ValueError(f"--iters must be >= 1, got {self.iters}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: after the last iteration only), "
                             f"got {self.eval_every}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsadmm train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, TrainConfig)
    add_dataclass_args(p, HSADMMConfig)
    add_training_args(p, "iteration", progress_every=1)
    add_common_args(p)
    return p


def solver_config(args) -> HSADMMConfig:
    """:class:`HSADMMConfig` from parsed arguments; with ``--paper-defaults`` every field
    still at its ordinary default takes :data:`PAPER_DEFAULTS`' value."""
    cfg = from_args(HSADMMConfig, args)
    if getattr(args, "paper_defaults", False):
        base = HSADMMConfig()
        cfg = dataclasses.replace(cfg, **{k: v for k, v in PAPER_DEFAULTS.items()
                                          if getattr(cfg, k) == getattr(base, k)})
    return cfg


#: configuration fields a resumed run may change (everything else must match the checkpoint)
RESUMABLE = ("iters", "checkpoint_every", "resume")


def _run_config(tcfg: TrainConfig, cfg: HSADMMConfig, args) -> dict:
    """The run's whole configuration, flat (``summary.json``'s ``config``)."""
    if getattr(args, "checkpoint_every", 0) < 0:
        raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got "
                         f"{args.checkpoint_every}")
    return {**dataclasses.asdict(tcfg), **dataclasses.asdict(cfg),
            "checkpoint_every": int(getattr(args, "checkpoint_every", 0)),
            "resume": bool(getattr(args, "resume", False))}


class _Iterations(LoopBody):
    """One outer ADMM iteration for :class:`runner.loop.RunLoop`; the evaluation is the test
    accuracy of the consensus model ``z`` on rank 0 (BN statistics from rank 0's model)."""

    def __init__(self, run, solver, model, eval_model, test) -> None:
        self.run, self.solver, self.model = run, solver, model
        self.eval_model, self.test = eval_model, test
        self.out: dict = {}
        self.k, self.loss = -1, float("nan")

    def unit(self, due):
        # one simulated step per ADMM iteration: the iteration's program (HSADMM.iterate), its
        # step closed by the loop
        self.k = due.index
        self.out = self.solver.iterate(self.k)
        self.loss = self.out["loss"]
        return self.solver.iteration_calls(self.out["mask_synced"])

    def load_z(self) -> None:
        """The consensus model z with this rank's BN statistics, in ``eval_model``."""
        self.eval_model.params.flat[...] = self.solver.state.z
        for name, buf in self.model.buffers.items():
            self.eval_model.buffers[name][...] = buf

    def evaluate(self) -> Evaluation:
        if self.run.rank != 0:
            return Evaluation()
        self.load_z()
        return Evaluation(evaluate(self.eval_model, self.test)[1])

    def line(self, interval) -> dict:
        out = self.out
        return {"iteration": self.k, "loss": self.loss,
                "mask_sync_bytes": interval.phase_bytes.get("mask_sync", {"inter": 0})["inter"],
                **{key: out[key] for key in (
                    "mask_drift", "mask_synced", "frozen", "compact_elems", "compact_buckets",
                    "dense_elems", "r_intra", "s_intra", "r_inter", "s_inter", "rho1", "rho2",
                    "converged")}}

    def progress(self) -> dict:
        return {"loss": self.loss}

    def stopped(self) -> bool:
        return bool(self.solver.converged)

    def state_dict(self) -> dict:
        return {**self.solver.state_dict(), "train/loss": self.loss}


def train(args) -> dict:
    """Run the configured solver; returns the summary (every rank)."""
    tcfg = from_args(TrainConfig, args)
    cfg = solver_config(args)
    overrides = read_keep_file(cfg.keep_file)
    config = _run_config(tcfg, cfg, args)
    run = start_run(args, system="hsadmm", method=tcfg.method, config=config, unit="iteration")
    seed = run.common.seed
    xp = run.xp
    # each rank reads only its shard of the training set (CIFAR-10: batch file by batch file)
    data = load_shard(tcfg.dataset, tcfg.data_dir, rank=run.rank, size=run.size, seed=seed)
    train_shard = data.train.to(xp)
    check_batch_size(cfg.batch_size, len(train_shard),
                     f"each rank's shard of the {data.train_total} {tcfg.dataset} training "
                     f"samples split over {run.size} ranks")
    test = data.test.to(xp)
    model = build_model(tcfg.model, data.train.input_shape, data.train.num_classes, xp=xp,
                        seed=seed)
    solver = SOLVERS[tcfg.method](run, cfg, model, train_shard, overrides)
    # per-layer compute blocks of the local SGD (the FLOP source's counts)
    model.recorder = run.clock.layers
    eval_model = build_model(tcfg.model, data.train.input_shape, data.train.num_classes, xp=xp,
                             seed=seed)
    fingerprint = {k: v for k, v in config.items() if k not in RESUMABLE}
    # a metrics line per iteration; the consensus model evaluated every --eval-every of them
    loop = RunLoop(run, total=tcfg.iters, flag="--iters", fingerprint=fingerprint,
                   checkpoint_every=config["checkpoint_every"],
                   progress_every=getattr(args, "progress_every", 0),
                   eval_every=tcfg.eval_every, log_every=1, resume=config["resume"])
    body = _Iterations(run, solver, model, eval_model, test)
    state = loop.resume()
    if state is not None:
        body.loss = float(state.pop("train/loss"))
        solver.load_state_dict(state)
        if solver.converged and run.previous == "finished":
            raise ValueError(f"--resume: the run in {run.out} converged after {loop.done} "
                             "iterations (summary.json): there is nothing to continue; start "
                             "afresh with --overwrite")
    loop.run(body)
    verified = solver.iterations_verified()     # the last iteration, closed by the loop
    done = loop.done
    z = solver.state.z
    pruned = getattr(solver, "pruned", [])
    kept = sum(int(xp.count_nonzero(z[solver.slices[i]])) for i in pruned)
    total = sum(int(solver.layout.sizes[solver.names[i]]) for i in pruned)
    # physically compact export of z (every rank builds it; rank 0 writes and evaluates it)
    body.load_z()
    export = export_compact(eval_model, solver.global_masks())
    compact_acc = float("nan")
    if run.rank == 0:
        path = export.save(Path(run.out) / "compact_model.npz")
        compact_acc = evaluate(load_compact_model(path, xp=xp), test)[1]
    # test accuracy is evaluated on rank 0, which writes the summary (NaN on other ranks)
    metrics = {"final_test_accuracy": loop.final_accuracy,
               "final_loss": body.loss, "iterations": done,
               "conv_density": kept / total if total else 1.0,
               "compact_test_accuracy": compact_acc,
               "compact_conv_params": export.compact_conv_params,
               "dense_conv_params": export.dense_conv_params}
    if config["resume"]:
        metrics["resumed_from_iteration"] = loop.start
    if run.recorder.program is not None:   # every iteration's recording held to its program
        metrics["program_steps_verified"] = verified
    manifest = {"file": "compact_model.npz",
                **{k: v for k, v in export.manifest.items() if k != "format"}}
    summary = run.finish(metrics=metrics, predicted=loop.predicted.block(),
                         extra={"compact_export": manifest})
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
