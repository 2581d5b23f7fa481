"""Per-device memory of a model spec: its weights, gradients, optimizer state and the
activations a batch keeps for the backward.

The accounting is the SDP paper's (seed 003, §3.2 "Memory, compute, and communication cost"):
every coordinate a device **materializes** costs its weight's bytes, every coordinate it
**trains** the bytes of its gradient and of its optimizer state.  Standard data parallelism
materializes and trains all N coordinates on every device (with bf16 weights, fp32 gradients
and Adam's two fp32 moments, "~14N bytes per-worker"); SDP's forward masking (N-SDP, B-SDP)
materializes and trains only a worker's subnetwork ("~14CN"), backward masking (B_b-SDP)
materializes all of them and trains its subnetwork ("(2 + 12C)N").  A worker's subnetwork is the
run's own plan (:class:`dataparallel.sdp.SDPPlan`: the coordinates it holds).

Activations are separate (the paper: "Activations scale ~C"): a batch's bytes per sample are
given, or, for a stack of transformer blocks, Korthikanti et al.'s count
(:func:`transformer_activation_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FP32_ADAM",
    "SDP_MIXED",
    "DeviceMemory",
    "Precision",
    "device_memory",
    "sdp_device_memory",
    "transformer_activation_bytes",
]


@dataclass(frozen=True)
class Precision:
    """Bytes of one coordinate's weight, gradient and optimizer state, and of one activation
    element."""

    weights: int = 4
    gradients: int = 4
    optimizer: int = 8          # Adam's first and second moments, fp32 each
    activations: int = 4

    def __post_init__(self) -> None:
        for k in ("weights", "gradients", "optimizer", "activations"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Precision.{k} must be an integer number of bytes >= 0, got "
                                 f"{v!r}")


#: SDP §3.2: "bf16 parameters (2 bytes), fp32 gradients (4 bytes), and Adam accumulators in fp32
#: (8 bytes)"; bf16 activations
SDP_MIXED = Precision(weights=2, gradients=4, optimizer=8, activations=2)
#: the project's trainers: float32 everything, Adam's two moments
FP32_ADAM = Precision(weights=4, gradients=4, optimizer=8, activations=4)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds."""

    weights: float
    gradients: float
    optimizer: float
    activations: float = 0.0

    @property
    def states(self) -> float:
        """Weights, gradients and optimizer state (the model's states, no activations)."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations


def device_memory(num_params: int, precision: Precision = FP32_ADAM, *,
                  materialized: int | None = None, trained: int | None = None,
                  batch: float = 0, activation_elements: float = 0.0) -> DeviceMemory:
    """One device's memory: ``materialized`` coordinates' weights (default all
    ``num_params``), ``trained`` coordinates' gradients and optimizer state (default the
    materialized ones), and ``batch`` samples of ``activation_elements`` elements each.

    Raises
    ------
    ValueError
        When ``trained > materialized`` or either exceeds ``num_params``, or a count is negative.
    """
    N = int(num_params)
    m = N if materialized is None else int(materialized)
    t = m if trained is None else int(trained)
    if N < 0 or not 0 <= t <= m <= N:
        raise ValueError(f"device_memory: need 0 <= trained ({t}) <= materialized ({m}) <= "
                         f"num_params ({N})")
    if batch < 0 or activation_elements < 0:
        raise ValueError(f"device_memory: batch ({batch}) and activation_elements "
                         f"({activation_elements}) must be >= 0")
    p = precision
    return DeviceMemory(float(p.weights * m), float(p.gradients * t), float(p.optimizer * t),
                        float(p.activations * batch * activation_elements))


def sdp_device_memory(plan, rank: int, precision: Precision = SDP_MIXED) -> DeviceMemory:
    """The model states of worker ``rank`` under SDP's ``plan`` (§3.2): forward masking
    (``neuron``, ``block``) materializes and trains the coordinates the worker holds; backward
    masking (``block-backward``) materializes every coordinate (the full forward) and trains the
    held ones."""
    held = plan.held(rank)
    materialized = plan.total if plan.mode == "block-backward" else held
    return device_memory(plan.total, precision, materialized=materialized, trained=held)


def transformer_activation_bytes(sequence: int, width: int, heads: int, blocks: int) -> float:
    """Bytes of activations a sequence keeps for the backward in ``blocks`` transformer blocks:
    ``s h (34 + 5 a s / h)`` a block (Korthikanti et al., "Reducing Activation Recomputation in
    Large Transformer Models", MLSys 2023, eq. 1 with batch 1: 16-bit activations, 1-byte
    dropout masks, a 4h MLP, no recomputation, no parallelism)."""
    s, h, a = int(sequence), int(width), int(heads)
    if min(s, h, a) < 1 or blocks < 0:
        raise ValueError(f"transformer_activation_bytes: sequence, width and heads must be >= 1 "
                         f"and blocks >= 0, got {sequence}, {width}, {heads}, {blocks}")
    return float(blocks * s * h * (34 + 5 * a * s / h))
