"""The solver's configuration: one frozen dataclass whose fields are the command-line flags.

:class:`HSADMMConfig` configures both solvers of :mod:`hsadmm.solver` (H-SADMM and flat ADMM,
"PruneX (AR)", which differ only in topology).  ``python -m hsadmm train`` builds its flags from
it with :func:`substrate.options.add_dataclass_args`, and ``commvol`` uses it as the
``SystemModel.Options`` of ``hsadmm`` and ``flat-admm``, so a flag is written once.

Options that deviate from PruneX (each listed in the README's deviation table) are named and off
by default: ``--theta-weight-decay`` (lambda also as SGD weight decay in eq. 8),
``--rho-scope tensor`` (one penalty per parameter tensor instead of per layer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from substrate.options import check_choices, check_range, option

from .penalty import RHO_UPDATES
from .projection import keep_count, parse_sparsity

__all__ = ["PAPER_DEFAULTS", "RHO_SCOPES", "SOLVER", "HSADMMConfig", "read_keep_file"]

#: ``--rho-scope`` values: one penalty per layer (PruneX §3.4) or per parameter tensor
RHO_SCOPES = ("layer", "tensor")

SOLVER = "H-SADMM / flat ADMM solver (PruneX Algorithm 1)"


@dataclass(frozen=True)
class HSADMMConfig:
    """Configuration of the H-SADMM / flat-ADMM solver (frozen; written into ``summary.json``).

    ``weight_decay`` is ``lambda`` of eq. 4: it enters ``gamma = lambda/M + P rho1 + rho2`` of
    eq. 9 for every tensor (eq. 4 sums ``||z^l||^2`` over all layers, biases and BatchNorm
    included); eq. 8's local step has no weight decay unless ``theta_weight_decay``.
    """

    local_epochs: float = option(1.0, "local SGD epochs per outer iteration (eq. 8; PruneX "
                                      "§5.1.5: 5-10)", group=SOLVER)
    local_steps: int | None = option(None, "local SGD steps per outer iteration (overrides "
                                           "--local-epochs)", group=SOLVER)
    batch_size: int = option(32, "per-rank mini-batch of the local SGD (eq. 8)", group=SOLVER)
    lr: float = option(0.05, "local SGD learning rate eta (eq. 8)", group=SOLVER)
    momentum: float = option(0.9, "local SGD momentum", group=SOLVER)
    weight_decay: float = option(1e-4, "lambda of eq. 4 (the l2 weight on z; lambda/M in eq. 9's "
                                       "gamma for every tensor)", group=SOLVER)
    theta_weight_decay: bool = option(
        False, "deviation: also apply lambda as SGD weight decay to conv/fc weights in the local "
               "step (eq. 8 has none)", group=SOLVER)
    rho1: float = option(0.05, "initial intra-node penalty rho1 (eqs. 8-9)", group=SOLVER)
    rho2: float = option(0.005, "initial inter-node penalty rho2 (eq. 9)", group=SOLVER)
    keep: float = option(0.5, "keep rate in (0, 1]: alpha = keep x groups, rounded to the "
                              "nearest integer, ties up, at least 1", group=SOLVER)
    sparsity: str = option("channel", "structured set S (eq. 10): channel, filter, shape or an "
                                      "intersection like filter+channel", group=SOLVER)
    keep_file: str | None = option(None, 'JSON {"conv layer name": keep rate} overriding --keep '
                                         "per layer", group=SOLVER)
    adaptive_rho: bool = option(True, "residual balancing of rho1/rho2 (Boyd §3.4.1, PruneX "
                                      "§3.4)", group=SOLVER)
    rho_update: str = option("balance", "how rho1/rho2 adapt: balance (Boyd §3.4.1 residual "
                                        "balancing, mu 10, tau 2) or increase (x2 every "
                                        "iteration up to --rho-max; §4.5's increasing "
                                        "penalties)", choices=RHO_UPDATES, group=SOLVER)
    rho_scope: str = option("layer", "what one adaptive penalty covers: layer (PruneX §3.4: the "
                                     "tensors of one layer share rho) or tensor (deviation: one "
                                     "per parameter tensor)", choices=RHO_SCOPES, group=SOLVER)
    rho_max: float = option(10.0, "cap on rho1 and rho2 (PruneX §5.1.5: 10)", group=SOLVER)
    eps_abs: float = option(1e-4, "absolute tolerance of the stopping rule", group=SOLVER)
    eps_rel: float = option(1e-3, "relative tolerance of the stopping rule", group=SOLVER)
    freeze_iter: int | None = option(4, "T_freeze: masks are synchronized in iterations "
                                        "< this, frozen after (0: never)", group=SOLVER)
    freeze_patience: int = option(3, "also freeze after this many iterations without a mask "
                                     "change (0: never)", group=SOLVER)
    bucket_mib: float = option(32.0, "inter-node all-reduce bucket size in MiB (PruneX §4.4.2: "
                                     "~32 MB)", group=SOLVER)

    def __post_init__(self) -> None:
        keep_count(self.keep, 1)
        parse_sparsity(self.sparsity)
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.local_steps is not None and self.local_steps < 1:
            raise ValueError(f"--local-steps must be >= 1, got {self.local_steps}")
        for name in ("local_epochs", "lr", "rho1", "rho2", "rho_max", "bucket_mib"):
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), gt=0)
        check_range("--momentum", self.momentum, ge=0, lt=1)
        for name in ("weight_decay", "eps_abs", "eps_rel"):
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), ge=0)
        if self.freeze_iter is not None and self.freeze_iter < 0:
            raise ValueError(f"--freeze-iter must be >= 0 (0: never), got {self.freeze_iter}")
        if self.freeze_patience < 0:
            raise ValueError(f"--freeze-patience must be >= 0 (0: never), got "
                             f"{self.freeze_patience}")
        check_choices(self)

    @property
    def sparsity_kinds(self) -> tuple[str, ...]:
        return parse_sparsity(self.sparsity)

    def local_steps_for(self, shard_size: int) -> int:
        """SGD steps of phase 1: ``--local-steps`` or ``ceil(local_epochs * batches/epoch)``."""
        if self.local_steps is not None:
            return self.local_steps
        return max(1, math.ceil(self.local_epochs * math.ceil(shard_size / self.batch_size)))


#: PruneX §5.1.5 (``--paper-defaults``): SGD lr 1e-3, momentum 0.9, weight decay 1e-4, batch 128
#: per GPU, rho1 1.5e-3, rho2 1.5e-4 capped at 10, channel keep 0.5, 5-10 local epochs (5 here)
PAPER_DEFAULTS = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4, "batch_size": 128,
                  "rho1": 1.5e-3, "rho2": 1.5e-4, "rho_max": 10.0, "keep": 0.5,
                  "sparsity": "channel", "local_epochs": 5.0}


def read_keep_file(path) -> dict:
    """``--keep-file``: ``{conv layer name: keep rate}`` (``{}`` for ``None``), validated."""
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
