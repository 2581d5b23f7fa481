"""PacTrain (paper 002): pruning, gradient sparsity enforcement, mask tracker, compact all-reduce.

One run follows Algorithm 1 of the paper:

1. **Start from a pre-trained model** (Alg. 1 "Data: Pre-trained model"; §III-B): ``--init
   FILE`` loads the flat parameters of a trained model (an ``.npz`` written by
   :func:`save_init`) and prunes it at once; without ``--init`` the first ``--warmup-steps``
   steps (default :data:`DEFAULT_WARMUP_STEPS`) are plain dense all-reduce steps (eq. 1) on the
   unpruned model, our stand-in for the paper's pre-training on a generic dataset.
2. **Prune** once (Alg. 1 l. 2), right after the warm-up (in the constructor when there is
   none): every conv and fc weight tensor ``l`` keeps ``n_l − ⌊r n_l⌋`` entries (``r =
   --prune-ratio``), ranked per layer, so ``K`` is known from the layout; biases and BatchNorm
   parameters are never pruned.  ``--prune-score`` picks the ranking, all from the GraSP score
   of eq. 4, ``S = −θ ⊙ (H ∇ℓ)``, or the weights:

   * ``grasp-abs`` (default): keep the largest ``|S|``, the entries whose removal changes the
     gradient flow most, PacTrain's "retain parameters critical for maintaining essential
     gradient directions" (§III-D);
   * ``grasp``: GraSP's own rule [45]: remove the entries of **highest** ``S`` (importance
     ``−S``).  GraSP ranks at initialization; on the warmed-up digits CNN it leaves 0.09 test
     accuracy right after pruning and 0.79 after 96 steps (``|S|``: 0.98), see
     ``docs/bench_out/pactrain.md``;
   * ``magnitude``: ``|θ|`` (paper §III-D: "determining the pruning mask based on weight
     ranking").

   ``H ∇ℓ`` is a central finite difference of gradients, ``(∇ℓ(θ + εv) − ∇ℓ(θ − εv)) / 2ε`` with
   ``v = ∇ℓ``, where ``∇ℓ`` and the difference are averaged over all ranks (two recorded
   all-reduces), so every rank gets the same scores and the same mask.  Weights already exactly
   zero are pruned first.
3. **Gradient sparsity enforcement** (eq. 2, Alg. 1 l. 5) every step: ``g ← (θ ≠ 0) ⊙ g`` on
   the conv/fc entries; a :class:`models.MaskHook` on the optimizer masks the update (weight
   decay included) and the momentum, so pruned weights stay exactly zero.
4. **Mask tracker, per bucket** (Alg. 1 l. 6-11: ``foreach update ∈ model_updates``, the
   gradient buckets a DDP communication hook sees): the flat gradient is cut into DDP's buckets
   (``--bucket-mib``) and every bucket ``b`` has its own :class:`MaskTracker` over its slice of
   the mask ``m_t = (θ_t ≠ 0)`` (1 on bias/BN).  A bucket whose mask has been unchanged for
   ``--stable-window`` comparisons packs ``g_b[idx_b]`` (``idx_b`` = the bucket's survivors,
   identical on every rank, so no index travels) and all-reduces the ``K_b`` values
   (``packed_allreduce``); any other bucket is all-reduced densely (``dense_allreduce``).  A
   change of a bucket's mask (a surviving weight reaching exactly 0) re-plans and sends that
   bucket densely until it is stable again.  ``--mask-scope global`` (a named deviation) tracks
   one mask over the whole flat gradient and all-reduces the packed vector in chunks of at most
   one bucket.
5. ``--ternary``: TernGrad on each packed vector (eq. 3): ``s = max_j max|g_j|`` by a MAX
   all-reduce (``ternary_scale``), by default one ``s`` per tensor (TernGrad's layer-wise
   scaling; ``--ternary-scale global``: one ``s`` per packed vector), ``b ~ Bernoulli(|g|/s)``
   from a per-rank, per-step stream seeded from the run seed (:func:`ternary_uniforms`), codes
   ``sign(g) · b`` packed 4 per byte (:func:`pack_2bit`) and all-gathered
   (``ternary_allgather``: a sum all-reduce of 2-bit codes is not closed), then every rank
   decodes and averages ``(s/p) Σ_j sign(g_j) b_j``, an unbiased estimate of the average.

**During the backward** (``--overlap on``, as DDP's communication hook runs): the step's
program (:func:`dataparallel.program.step_program` of :meth:`PacTrain.records`) sends every
bucket on the communication stream as soon as the backward wrote it, in the plan's order, each
after its compute (eq. 2 on a dense bucket, the packing of a unit); the unpacking follows the
backward.  A ternary unit's encoding needs its scales' MAX all-reduce: the host waits for it
when the next unit's gradients are written (``--ternary-wait bucket``) or after the backward
(``backward``), then encodes and all-gathers (the paper's comm hook chains them on the
all-reduce's future without the host waiting: see the README's deviations).  ``--overlap
off``: every call blocks, after the backward.

**One plan.** :meth:`PacTrainPlan.build` (pure: layout, options and the run's kept index set
or, for a prediction, the keep rate) gives ``K`` per tensor and bucket, the chunks, the TernGrad
segments, the dense-until-stable schedule and every step's call records
(:meth:`PacTrainPlan.calls`, which :mod:`commvol.systems.pactrain` prices; with the codec's
compute items :meth:`PacTrainPlan.records`, from which the run's step programs are generated,
and GraSP's scores as records of their own, :meth:`PacTrainPlan.grasp_records`: a set-up before
the first step, or after the update of the warm-up's last step).  The strategy binds their
buffers and compute and never issues a call itself.  Independent closed forms from the paper:
:mod:`volume.pactrain`.

Rooms: :mod:`.options` (the flags), :mod:`.pruning` (GraSP scores and the mask),
:mod:`.tracker` (the mask tracker), :mod:`.ternary` (the TernGrad codec), :mod:`.init_file`
(the pre-trained model file), :mod:`.plan` (:class:`PacTrainPlan`), :mod:`.strategy` (the run).
"""

from .init_file import INIT_FORMAT, check_init_file, load_init, save_init
from .options import (
    DEFAULT_WARMUP_STEPS,
    MASK_SCOPES,
    TERNARY_SCALES,
    TERNARY_WAITS,
    PacTrainOptions,
)
from .plan import PacTrainPlan
from .pruning import (
    GRASP_REL_STEP,
    GRASP_SAMPLES,
    PRUNABLE_KINDS,
    PRUNE_SCORES,
    grasp_score,
    hessian_vector_fd,
    prunable_flags,
    prune_importance,
    prune_mask,
)
from .strategy import PacTrain
from .ternary import TERNARY_STREAM, pack_2bit, ternarize, ternary_uniforms, unpack_2bit
from .tracker import MaskTracker

__all__ = [
    "DEFAULT_WARMUP_STEPS",
    "GRASP_REL_STEP",
    "GRASP_SAMPLES",
    "INIT_FORMAT",
    "MASK_SCOPES",
    "PRUNABLE_KINDS",
    "PRUNE_SCORES",
    "TERNARY_SCALES",
    "TERNARY_STREAM",
    "TERNARY_WAITS",
    "MaskTracker",
    "PacTrain",
    "PacTrainOptions",
    "PacTrainPlan",
    "check_init_file",
    "grasp_score",
    "hessian_vector_fd",
    "load_init",
    "pack_2bit",
    "prunable_flags",
    "prune_importance",
    "prune_mask",
    "save_init",
    "ternarize",
    "ternary_uniforms",
    "unpack_2bit",
]
