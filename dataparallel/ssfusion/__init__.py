"""SSFusion: tensor fusion with selective sparsification (seed paper 004, §III-IV).

Everything a run sends is fixed by one pure plan, :class:`SSFusionPlan`, built by
:func:`plan_ssfusion` from the tensor sizes (backward order), ``p``, the slowest link, the α–β
cost model, :class:`SSFusionOptions` and — when the plan depends on timings — the warm-up
profile ``(T_b, T_sp, T_cpu)``.  Its records of one step (:meth:`SSFusionPlan.calls`: the
warm-up all-reduces, the decision's profile all-reduce and plan broadcast, per fusion buffer the
all-reduce of ``Buffer_AR`` and the all-gather of ``Buffer_AG`` with their dependencies, and the
sparsification, SSFusion-O's worker and the decoding as compute items) are the step's program
(:func:`dataparallel.program.step_program`), which the run executes with :class:`SSFusion`
bound to its calls and compute items, and what ``commvol`` prices and simulates at scale from
the same function on an assumed profile.  The plan names the ledger phases
(:data:`~dataparallel.ssfusion.plan.PHASES`).

Fusion buffers (§IV-B Step 1, ``--fusion-policy``):

``cupcake`` (default, the paper's)
    the buffers of Cupcake's ``FindOptFusion`` [28]: the contiguous cut of the tensors that
    minimizes the modeled end of the last all-gather under wait-free backpropagation with
    per-tensor sparsification (:func:`find_opt_fusion`, an exact dynamic program on the profile);
``count``
    ``--buffers N`` buffers of equal tensor count (or a ``--buffer-mib`` byte budget): the
    reference code's default partition, kept as an option.

The ``--profile-steps`` dense warm-up steps all-reduce the gradient in the ``--buffers`` /
``--buffer-mib`` warm-up buffers.  Then, per ``--fusion``:

``selective`` (SSFusion, §IV-B)
    in every buffer the smallest tensors ``D_i`` stay dense and the others ``S_i`` are
    sparsified one by one.  *Overlap-maximized selection* (:func:`select_dense`): walk ``B_i``'s
    tensors by ascending size and leave them dense until eq. 2 holds, ``T_cm^{i-1} ≥ Σ_{j∈B_i}
    (T_b^j + T_sp^j)`` (sparsification counted for sparse tensors only), for ``2 ≤ i ≤ M``; the
    first buffer keeps every tensor sparsified (``--first-buffer per-tensor``; ``exclude``:
    ``T_cm^0 = 0``).  *Density-aware sparsification* (:func:`density_aware_counts`): the counts
    of ``S_i`` are lowered so that the buffer still sends ``K_i = Σ_{l∈B_i} ⌈d n_l⌉``
    elements, never below ``⌈d_min n_l⌉`` (``--density-floor``, 0.001).  *Interleaved
    communication* (SSFusion-I, §IV-D, ``--interleave``): the split ``l'_i`` minimizing ``T1 +
    T2`` (:func:`interleave_split`) sends the dense tensors among the first ``l'_i`` with a
    ring all-reduce (``Buffer_AR``) and the rest with one all-gather (``Buffer_AG``: dense
    values, then float32 values and int32 indices of the sparse ones); ``--no-interleave``
    all-gathers the whole buffer (SSFusion "naive").  *Offloading* (SSFusion-O, §IV-C,
    ``--offload``): the sparsification of tensors whose CPU time fits under the rest of their
    buffer's backward (:func:`plan_offload`; ``--offload-deadline backward``: under the rest
    of the whole backward) runs on one CPU worker thread: the plan lists it on the
    ``offload`` stream where the backward writes the tensor (``ssf_offload[l]``) and the
    buffer's collection (``ssf_offload_wait[i]``) before its all-gather.
``per-tensor``
    every tensor sparsified at density ``d`` (``k_l = ⌈d n_l⌉``), each buffer all-gathered.
``multi-tensor``
    each buffer sparsified as one vector with ``K_i`` entries, all-gathered; tensors with no
    selected entry are *missing* (Table I's tensor-missing rate, reported).

Sparsifier (``--sparsifier``): ``dgc`` (DGC [44], the paper's: sampled threshold, refinement,
trim to exactly ``k``: :func:`dataparallel.sparsify.dgc_topk`), ``gaussiank`` (Gaussian-k
[22]: threshold from a normal fit, at most three rescalings, at most ``k`` sent and the slots
left padded with zeros: :func:`gaussiank_select`) or ``exact`` (full top-``k``).  DGC's
*momentum correction* (``--momentum-correction``, on): the strategy takes the optimizer's
momentum over, ``u ← μ u + g``, ``v ← v + u``, sends top-``k`` of ``v`` and zeroes ``u`` and
``v`` where it sent (momentum factor masking); dense tensors keep plain momentum ``u``.
Without it, error feedback accumulates the raw gradient (``a = g + e``) and the optimizer
applies momentum to the synchronized gradient.

Rooms: :mod:`.options` (the flags), :mod:`.selection` (the planning rules of §IV-B to
§IV-D), :mod:`.plan` (:class:`SSFusionPlan`, :func:`plan_ssfusion`), :mod:`.strategy` (the run),
:mod:`.profiling` (warm-up profiling, the decision, SSFusion-O's worker).  Packing and error
feedback: :mod:`dataparallel.codec`; sparsifiers: :mod:`dataparallel.sparsify`.  Closed forms
and the second source: :mod:`volume.ssfusion`.

Simulation notes: with ``--overlap on`` the run is the paper's pipeline (Fig. 10): the step's
program places each part of a buffer at the first unit boundary of the backward where the
backward has written it, and its collective right after on the communication stream, so the
collectives overlap the rest of the backward for real; the waits and the decoding follow the
backward.  The run records every call and compute item where it ran, after what the plan's
records name (the job simulation replays them so); SSFusion-O's worker items on the offload
stream, timed by the worker's own reading of the compute source.  ``--overlap off``: every record follows the
backward, each call blocking (the worker's items too: nothing overlaps the backward).  The
warm-up's timing of the backward per tensor is measurement, not program
(:meth:`SSFusion.on_ready`).  The tensor-missing count (a diagnostic, not part of the modeled
system) runs only on steps that write a metrics line, so an ordinary step does no diagnostic
work and ``step_wall_s`` is the whole step.  The ``flops`` source counts the sparsification's
element operations (:meth:`SSFusionPlan.segment_flops`), with no kernel-launch cost per tensor.
"""

from ..sparsify import exact_select, gaussiank_select
from .options import (
    FIRST_BUFFER_RULES,
    FUSION_MODES,
    FUSION_POLICIES,
    SPARSIFIERS,
    SSFusionOptions,
    needs_profile,
)
from .plan import (
    PROFILE_FIELDS,
    FusionBuffer,
    Segment,
    SSFusionPlan,
    plan_ssfusion,
    profile_length,
)
from .selection import (
    alpha_beta_times,
    count_buffers,
    density_aware_counts,
    feasible_dense,
    find_opt_fusion,
    interleave_split,
    per_tensor_counts,
    plan_offload,
    select_dense,
)
from .strategy import SSFusion

__all__ = [
    "FIRST_BUFFER_RULES",
    "FUSION_MODES",
    "FUSION_POLICIES",
    "PROFILE_FIELDS",
    "SPARSIFIERS",
    "FusionBuffer",
    "SSFusion",
    "SSFusionOptions",
    "SSFusionPlan",
    "Segment",
    "alpha_beta_times",
    "count_buffers",
    "density_aware_counts",
    "exact_select",
    "feasible_dense",
    "find_opt_fusion",
    "gaussiank_select",
    "interleave_split",
    "needs_profile",
    "per_tensor_counts",
    "plan_offload",
    "plan_ssfusion",
    "profile_length",
    "select_dense",
]
