"""Data-parallel training with pluggable gradient-sync strategies (docs/ARCHITECTURE.md,
"Adding a system").

``python -m dataparallel train --method NAME``; the strategies register themselves in
:data:`STRATEGIES` on import: ``ddp`` (dense, bucketed ring or hierarchical all-reduce),
``topk`` (per-tensor Top-K with error feedback, all-gather of values and indices), ``pactrain``
(pruning, mask tracker, packed all-reduce, TernGrad), ``sdp`` (masked subnetworks, gated
averages among holders) and ``ssfusion`` (fusion buffers with selective sparsification).
"""

from . import ddp, fp16, pactrain, sdp, ssfusion, topk  # noqa: F401  (register the strategies)
from .strategy import STRATEGIES, NoOptions, StepState, Strategy, SyncContext, register

__all__ = ["STRATEGIES", "NoOptions", "StepState", "Strategy", "SyncContext", "register"]
