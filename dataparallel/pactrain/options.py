"""PacTrain's flags (:class:`PacTrainOptions`: the trainer's and ``commvol predict``'s, one
declaration) and their choices (paper 002, Alg. 1: warm-up, prune ratio and score, stable
window, TernGrad, mask scope).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from substrate.options import check_choices, option

from .init_file import INIT_FORMAT
from .pruning import PRUNE_SCORES

__all__ = [
    "DEFAULT_WARMUP_STEPS",
    "MASK_SCOPES",
    "TERNARY_SCALES",
    "TERNARY_WAITS",
    "PacTrainOptions",
]

TERNARY_SCALES = ("tensor", "global")
#: ``--ternary-wait``: where the host waits for a ternary unit's scales before encoding it: when
#: the next bucket is ready (in the backward) or after the backward.
TERNARY_WAITS = ("bucket", "backward")
#: ``--mask-scope``: one mask tracker per gradient bucket (Algorithm 1) or one for all.
MASK_SCOPES = ("bucket", "global")
#: Dense warm-up steps before pruning when no ``--init`` model is given (the pre-training of
#: Algorithm 1's input model): two epochs of the digits CNN at 4 ranks and batch 32, after which
#: dense DDP reaches 0.90-0.91 test accuracy (the default 0.9 target); see
#: ``docs/bench_out/pactrain.md``.
DEFAULT_WARMUP_STEPS = 24


def _whole(flag: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{flag} takes a whole number of steps, got {v!r}")


@dataclass(frozen=True)
class PacTrainOptions:
    """Options of PacTrain (the trainer's and ``commvol predict``'s: one declaration)."""

    prune_ratio: float = option(0.5, "fraction of every conv/fc weight tensor pruned, in [0, 1)")
    prune_score: str = option(
        "grasp-abs", "pruning rank, per layer, from the GraSP score S = -theta*(H grad) (eq. 4): "
        "grasp-abs = keep the largest |S|; grasp = GraSP's rule, remove the highest S; "
        "magnitude = keep the largest |theta|", choices=PRUNE_SCORES)
    stable_window: int = option(
        5, "steps a bucket's mask must stay unchanged before its packed all-reduce is used")
    warmup_steps: int | None = option(
        None, "dense all-reduce steps on the unpruned model before pruning (the paper prunes "
        f"a pre-trained model); default: 0 with --init, else {DEFAULT_WARMUP_STEPS}", type=int)
    init: str | None = option(
        None, f"start from (and prune at once) a trained model: {INIT_FORMAT}", type=str,
        metavar="FILE")
    mask_scope: str = option(
        "bucket", "mask tracking and packing per gradient bucket (Algorithm 1) or one mask over "
        "the whole flat gradient (global, a deviation)", choices=MASK_SCOPES)
    ternary: bool = option(False, "TernGrad on the packed gradient: 2-bit codes all-gathered "
                                  "(eq. 3)")
    ternary_scale: str = option(
        "tensor", "TernGrad scale s = max|g|: one per tensor (TernGrad's layer-wise scaling) or "
        "one per packed vector", choices=TERNARY_SCALES)
    ternary_wait: str = option(
        "bucket", "--ternary with --overlap on: the encoding needs the scales' MAX all-reduce; "
        "the host waits for a unit's scales when the next bucket is ready (bucket: later "
        "buckets go out during the backward, which waits for the scales) or after the backward "
        "(backward: the backward never waits, the calls after the first unit's scales follow "
        "it)", choices=TERNARY_WAITS)
    bucket_mib: float = option(32.0, "gradient bucket size in MiB")

    def __post_init__(self) -> None:
        if not 0 <= self.prune_ratio < 1:
            raise ValueError(f"--prune-ratio must be in [0, 1) (the fraction of each conv/fc "
                             f"tensor removed, e.g. 0.5); got {self.prune_ratio}")
        check_choices(self)
        _whole("--stable-window", self.stable_window)
        if self.stable_window < 0:
            raise ValueError(f"--stable-window must be >= 0 (steps of unchanged mask before "
                             f"packing, e.g. 5); got {self.stable_window}")
        if self.warmup_steps is not None:
            _whole("--warmup-steps", self.warmup_steps)
            if self.warmup_steps < 0:
                raise ValueError(f"--warmup-steps must be >= 0 (0: prune at the start); got "
                                 f"{self.warmup_steps}")
        if self.init is not None and not os.path.isfile(self.init):
            raise ValueError(f"--init {self.init}: no such file; pass an .npz written by "
                             "dataparallel.pactrain.save_init(path, model)")
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")

    @property
    def warmup(self) -> int:
        """Dense steps before pruning: ``--warmup-steps``, or by default 0 with ``--init`` (the
        file is the pre-trained model) and :data:`DEFAULT_WARMUP_STEPS` without."""
        if self.warmup_steps is not None:
            return int(self.warmup_steps)
        return 0 if self.init is not None else DEFAULT_WARMUP_STEPS
