"""SDP: subnetwork data parallelism with fixed masks and gated averaging (paper 003).

A fixed assignment mask ``m ∈ {0,1}^{n×|J|}`` (eq. "gate") puts every coordinate ``j`` of the
flat parameter vector on the ``d_j = Σ_i m_ij >= 1`` workers that *hold* it.  Worker ``i`` trains
its subnetwork; every step the gradients are combined by the gated average (eq. "average")

    ĝ_j = (1 / d_j) Σ_i m_ij g_ij ,

computed by reducing each coordinate only among its holders: coordinates are grouped by holder
set ``H`` (a bitmask over the ranks), each distinct set with ``|H| >= 2`` and at least one
coordinate gets one sub-communicator (built once, ``Comm.sub``) and one contiguous buffer
(planned once), all-reduced with SUM and divided by ``|H|``; a singleton set needs no message.
Coordinates outside every structured mask (stem, shortcut, classifier, normalisation of the
residual stream) are held by all ranks: a world all-reduce.

Everything a run communicates is decided once, without MPI, by :meth:`SDPPlan.for_model`
(model layers, nodes, ranks per node, :class:`SDPOptions`, seed): holder sets and their index
sets, the sub-communicators' member sets, B_b-SDP's broadcast roots and the evaluation senders.
:meth:`SDPPlan.calls` lists a step's call records (:class:`substrate.calls.Call`), which
``commvol``'s SDP model prices, and :meth:`SDPPlan.records` a rank's records with its compute
items (each held set's packing and unpacking), from which the run's step programs are generated
(:func:`dataparallel.program.step_program`; the strategy binds their buffers and compute, and
the trainer holds the run to them); their bytes are checked against :mod:`volume.sdp`'s closed
forms written from the paper's coverage and layer shapes (``tests/dataparallel/test_sdp_plan.py``).  With
``--overlap on`` each holder set's all-reduce goes to the communication stream during the
backward as soon as the set's span is written (in the plan's order); ``--overlap off`` runs
them blocking after the backward.  B_b-SDP's broadcasts and, in a step before an evaluation,
the assembly of the model on rank 0 follow the step's update.

The package, one idea per module: :mod:`~dataparallel.sdp.options` (flags),
:mod:`~dataparallel.sdp.masks` (holder sets from the layers), :mod:`~dataparallel.sdp.plan`
(the plan and its records), :mod:`~dataparallel.sdp.analysis` (memory, spectral gap) and
:mod:`~dataparallel.sdp.strategy` (the run).

Masks (identical on every rank: deterministic cyclic assignment, block order from the run seed):

``--sdp-mode neuron`` (N-SDP, forward masking, §3.2)
    Every masked parameter lives on exactly ``p`` of the ``n`` workers (``--coverage p/n``, the
    paper's §4 definition "for every parameter θ_j ... exactly p of the n workers participate").
    A masked layer's neurons / channels are cut into ``n`` contiguous chunks and chunk ``c``
    goes to the *window* ``{c, ..., c+p-1} mod n``; the layer's output rows (weight, bias,
    BatchNorm) and the next layer's input columns are masked together (§3.2: "dropping outputs
    of layer l naturally removes the corresponding inputs of layer l+1"), so both carry the
    neuron's ``p`` holders.  A weight between two masked layers would be held by the
    *intersection* of two holder sets, which has fewer than ``p`` members unless the sets are
    equal, so masked layers are never adjacent: the paper's construction masks pairs
    ``(W^l, W^{l+1})`` (its example, and the inner channels of a residual block or an MLP
    block).  On a plain chain the masked hidden layers are the non-adjacent set holding the most
    parameters (dynamic programming over the chain; the digits CNN masks conv1 and fc1, the
    conv2 channels stay on all workers); in a ResNet each block's inner channels (the residual
    stream is never masked).  Everything else is held by all ``n``.  ``summary.json`` reports
    the degree histogram and the realized coverage ``Σ_j d_j / (n |J|)``.
``--sdp-mode block`` (B-SDP, forward masking, eq. 4)
    Each worker keeps ``b`` of the ``d`` residual blocks (``--active-blocks b/d``): the blocks,
    in an order permuted by the run seed, are dealt cyclically, worker ``i`` taking slots
    ``i b, ..., i b + b - 1 (mod d)`` (block degrees ``floor`` / ``ceil`` of ``n b / d``).  A
    dropped block's main branch is zero, so the block computes its shortcut only
    (``m B(x) + x``; a projection shortcut is kept and held by all).
``--sdp-mode block-backward`` (B_b-SDP, backward masking, §3.1)
    The same block mask, but the forward pass uses the full model (``m_fwd = m_uni``): only the
    gradients, their reduction and the optimizer state are masked.  Since non-holders never
    update a parameter but run it forward, after each step the lowest-ranked holder of every
    set broadcasts the updated parameters to the non-holders (phase ``sdp_param_bcast``), so
    ``θ`` stays one global vector as in the paper's update ``θ ← θ − OptUpdate(ĝ)``.

Forward masking zeroes a worker's parameters outside its subnetwork; backward masking (all
modes) masks the update and freezes the momentum outside (:class:`models.MaskHook`).  Holders of
a coordinate apply identical updates, so they stay identical; the full model is assembled for
evaluation from any holder (the lowest rank of each set sends what rank 0 lacks, at evaluation
steps only, phase ``sdp_assemble``) and evaluated as assembled, as in the paper.  Not in the
paper, off by default: ``--eval-rescale`` multiplies it by the dropout / stochastic-depth
weight-scaling rule: weight ``W[j, k]`` by the fraction ``|H_j ∩ H_k| / |H_j|`` of the workers
running neuron ``j`` that also run input ``k`` (``p / n`` on the inputs from a masked layer), a
block's output (its last BatchNorm's scale and shift) by ``d_block / n``.

Reported (:meth:`SDP.report`): the degree histogram and realized coverage, per-worker memory of
parameters + gradients + momentum against DDP's ``(2 + 1) · 4 T`` bytes, the spectral gap ρ of
eq. (1) from the mask matrix, the bytes a step puts on the wire against DDP's
(``payload_ratio``: gated all-reduces plus B_b-SDP's broadcasts), and the FLOP-matching factor
``f``.  ``--flop-match`` makes the run ``floor(f · B)`` steps for the trainer's budget of ``B``
steps (:meth:`SDP.total_steps`; §4.1.1: "scaling training epochs inversely with the number of
active parameters", ``f = T / mean_i N_i`` with the exact per-worker counts; for B_b-SDP
``f = 3 / (1 + 2 A)``, ``A = mean_i N_i / T``, the backward costing twice the forward),
continuing the same data stream with the trainer's constant learning rate.  Memory is
accounted, not allocated: the simulator keeps full-length flat vectors on every rank and zeroes
(forward) or freezes (backward) what a worker does not hold.
"""

from .analysis import spectral_gap, worker_memory
from .masks import NeuronGroup, masked_groups, neuron_groups, residual_blocks, window_sets
from .options import SDP_MODES, SDPOptions, parse_active_blocks, parse_fraction
from .plan import ASSEMBLE, BCAST, GATED, SDPPlan, _check_connected, plan_masks  # noqa: F401
from .strategy import SDP

__all__ = [
           "ASSEMBLE",
           "BCAST",
           "GATED",
           "SDP",
           "SDP_MODES",
           "NeuronGroup",
           "SDPOptions",
           "SDPPlan",
           "masked_groups",
           "neuron_groups",
           "parse_active_blocks",
           "parse_fraction",
           "plan_masks",
           "residual_blocks",
           "spectral_gap",
           "window_sets",
           "worker_memory",
]

