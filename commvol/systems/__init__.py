"""Registry of per-system communication models: bytes per link class, messages and α–β time.

Every entry of :data:`SYSTEMS` is a :class:`SystemModel` whose ``predict`` has one signature::

    predict(spec, nodes, gpus_per_node, options, cost=None) -> Prediction

``spec`` is a shape-only model (:class:`models.ModelSpec`; :class:`commvol.hsgd.RadixNetSpec` for
the sparse-DNN systems), ``options`` the system's frozen options dataclass (``SystemModel.Options``;
its fields become ``python -m commvol predict`` flags) and ``cost`` a
:class:`substrate.costmodel.CostModel`.  A :class:`Prediction` holds the per-iteration
``{phase: {"intra": bytes, "inter": bytes}}`` (as stages: H-SADMM synchronizes masks only until
the freeze), the messages of every phase summed over ranks and the modeled time of every phase on
its busiest rank — the ledger's conventions, so a run's ``traffic.measured`` and
``timing.comm_modeled_s`` are reproduced exactly (bytes, messages) and to rounding (time).

Every number comes from the system's own plan: its records (``plan.calls(placement)``, the
calls the run executes and accounts step by step) priced by the one generic rule,
:meth:`IterCost.from_calls` (:func:`substrate.calls.price`: wire bytes per link class,
messages, each rank's α–β time).  Nothing here restates a system's bytes; :mod:`volume` (closed
forms written from the papers) is what the tests hold the records against.

Adding a system is one :func:`register` call::

    register(SystemModel("pactrain", predict_pactrain, PacTrainOptions,
                         description="..."))

Assumptions of the PacTrain model (printed by ``predict``):

* ``K`` from ``--prune-ratio`` as the strategy prunes, per layer: every conv/fc weight tensor
  keeps ``n - floor(r n)`` entries, biases and BatchNorm parameters are dense
  (:func:`pactrain_kept`);
* the mask is stable from the pruning on (pruned weights stay exactly zero), so steps
  ``0 .. warmup_steps + stable_window - 1`` are dense and packing starts at step
  ``warmup_steps + stable_window`` (the run's ``mask_stable_step``); GraSP's two all-reduces of
  ``T`` belong to step ``max(warmup_steps - 1, 0)``.

Assumptions of the SDP model: the plan of :meth:`dataparallel.sdp.SDPPlan.for_model` (the run's own), the run seed and ``--eval-every`` (``SDPAssumptions``) for the model
named by the spec (built from its name: the masks follow its layers) and the run seed
(``--seed``, block order); the sub-communicators the strategy builds; the model is assembled on
rank 0 at the trainer's evaluations only (``--eval-every`` steps and the last step;
:attr:`Prediction.evaluation`), and since ranks sit in different holder sets the modeled time is
the busiest rank's over all phases (:attr:`IterCost.rank_s`).

Assumptions of the SSFusion model (printed by ``predict``): fusion buffers, counts and splits
from the strategy's own plan (:func:`dataparallel.ssfusion.plan_ssfusion`).  Cupcake buffers
(the default) and the selective selection depend on the warm-up profile: a prediction assumes
one (``SSFusionAssumptions``: ``--backward-ns``, ``--sparsify-ns``, α–β) or reproduces a run
(``--selection-from RUN``; ``--dense-tensors`` / ``--interleave-split``).  ``--fusion-policy
count`` with per-tensor or multi-tensor is fixed by the options alone.

Assumptions of the H-SADMM model (printed by ``predict``):

* residuals: 9 float64 per penalty group (a layer; ``--rho-scope tensor``: per tensor).
* masks from keep rates on the spec shapes, following eq. 15 literally: ``K_out`` = filters with
  any kept entry, ``K_in`` = input channels with any kept entry *of the same layer's mask*
  (:func:`keep_rate_mask`, now :mod:`hsadmm.shrink`'s, through
  :meth:`hsadmm.shrink.ShrinkPlan.from_keep_rates`, the plan the solver builds from its masks;
  ``alpha = keep x n`` rounded to nearest, ties up).  Channel sparsity at keep ``k`` keeps all filters and
  ``keep_count(k, C_in)`` channels; filter sparsity the converse; ``filter+channel`` both.
  A filter whose output channel the *next* layer prunes is not removed (eq. 15 does not look
  across layers).  Shape sparsity keeps ``alpha`` kernel columns spread over the live channels
  first (``K_in = min(live channels, alpha)``, the largest ``K_in`` a shape mask can have).
* all nodes agree on the masks (the OR of eq. 14 adds nothing).  A real run's OR over nodes can
  keep more; pass its measured sizes as ``compact_elems`` (``--compact-elems``).
* masks are synchronized in iterations ``0 .. freeze_iter - 1`` (the trainer's ``--freeze-iter``;
  the data-dependent ``--freeze-patience`` is not modeled).
"""

from . import dataparallel, hsadmm, hsgd, pactrain, sdp, ssfusion  # noqa: F401  (register)
from .core import *  # noqa: F403
from .dataparallel import *  # noqa: F403
from .hsadmm import *  # noqa: F403
from .hsgd import *  # noqa: F403
from .pactrain import *  # noqa: F403
from .sdp import *  # noqa: F403
from .ssfusion import *  # noqa: F403
