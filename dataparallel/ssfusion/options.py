"""SSFusion's options (``--method ssfusion``; the fields become ``dataparallel train`` flags and
``commvol predict`` flags alike)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from substrate.options import check_choices, option

from ..topk import TopKOptions

__all__ = ["FIRST_BUFFER_RULES", "FUSION_MODES", "FUSION_POLICIES", "OFFLOAD_DEADLINES",
           "SPARSIFIERS", "SSFusionOptions", "needs_profile"]

FUSION_MODES = ("selective", "per-tensor", "multi-tensor")
FUSION_POLICIES = ("cupcake", "count")
FIRST_BUFFER_RULES = ("per-tensor", "exclude")
SPARSIFIERS = ("dgc", "gaussiank", "exact")
#: ``--offload-deadline``: a worker's tensor must be sparsified by the end of its buffer's
#: backward (the paper's rule: the buffer is communicated then) or of the whole backward
OFFLOAD_DEADLINES = ("buffer", "backward")


@dataclass(frozen=True)
class SSFusionOptions:
    """Options of SSFusion (``--method ssfusion``)."""

    density: float = option(0.01, "fraction of each tensor's entries sent per step")
    density_floor: float = option(
        0.001, "ssfusion: lowest density the density-aware adjustment may give a tensor")
    fusion: str = option("selective", "ssfusion: selective | per-tensor | multi-tensor "
                         "sparsification", choices=FUSION_MODES)
    fusion_policy: str = option(
        "cupcake", "ssfusion: fusion buffers: cupcake (the paper's Step 1, Cupcake's "
        "FindOptFusion: the contiguous cut minimizing the modeled backward + sparsify + "
        "all-gather pipeline on the warm-up profile) | count (--buffers equal tensor counts or "
        "a --buffer-mib budget)", choices=FUSION_POLICIES)
    buffers: int = option(4, "ssfusion: warm-up buffers of equal tensor count (backward "
                          "order); also the fusion buffers with --fusion-policy count")
    buffer_mib: float = option(0.0, "ssfusion: warm-up (and --fusion-policy count) buffer "
                               "byte budget in MiB (> 0 overrides --buffers)")
    first_buffer: str = option(
        "per-tensor", "ssfusion selective: the first buffer, which eq. 2 (2 <= i <= M) leaves "
        "out: per-tensor (every tensor sparsified) | exclude (T_cm^0 = 0: small tensors dense "
        "as far as the floor allows)", choices=FIRST_BUFFER_RULES)
    profile_steps: int = option(
        5, "ssfusion: dense warm-up steps; the timings profiled during them fix the fusion "
        "buffers and the selection (the paper's 5)")
    sparsifier: str = option("dgc", "ssfusion: dgc (DGC sampled threshold, exactly k) | "
                             "gaussiank (Gaussian-k threshold, at most k) | exact (full top-k)",
                             choices=SPARSIFIERS)
    sample_ratio: float = option(
        0.01, "ssfusion: fraction of a tensor sampled for the DGC threshold estimate")
    momentum_correction: bool = option(
        True, "ssfusion: DGC momentum correction and factor masking (the strategy takes the "
        "optimizer's momentum over; disable with --no-momentum-correction)")
    interleave: bool = option(True, "ssfusion: all-reduce the dense part, all-gather the "
                              "sparse part (disable with --no-interleave)")
    offload: bool = option(False, "ssfusion: sparsify large tensors on a CPU worker thread "
                           "during backward")
    offload_deadline: str = option(
        "buffer", "ssfusion --offload: a tensor goes to the CPU worker when the worker can "
        "finish it by the end of its buffer's backward (buffer: the paper's rule, the buffer is "
        "sent then) or by the end of the whole backward (backward: for --overlap off, where "
        "every buffer is sent after it)", choices=OFFLOAD_DEADLINES)
    error_feedback: bool = option(True, "accumulate unsent entries into the next step "
                                  "(disable with --no-error-feedback)")

    def __post_init__(self) -> None:
        TopKOptions(density=self.density)  # the shared --density flag, validated once
        if not 0 < self.density_floor <= 1:
            raise ValueError(f"--density-floor must be in (0, 1] (the paper uses 0.001), got "
                             f"{self.density_floor}")
        if self.density < self.density_floor:
            raise ValueError(f"--density {self.density} is below --density-floor "
                             f"{self.density_floor} (the lower bound against over-"
                             f"sparsification); raise --density or lower --density-floor")
        check_choices(self)
        for flag, v in (("--buffers", self.buffers), ("--profile-steps", self.profile_steps)):
            if np.asarray(v).dtype.kind not in "iu":  # bool, float, str: not a count
                raise ValueError(f"{flag} takes a whole number, got {v!r}")
        if self.buffers < 1:
            raise ValueError(f"--buffers must be an integer >= 1, got {self.buffers}")
        if not self.buffer_mib >= 0:
            raise ValueError(f"--buffer-mib must be >= 0 (0: use --buffers), got "
                             f"{self.buffer_mib}")
        if self.profile_steps < 0:
            raise ValueError(f"--profile-steps must be an integer >= 0, got "
                             f"{self.profile_steps}")
        if needs_profile(self) and self.profile_steps < 1:
            why = ("--fusion selective" if self.fusion == "selective"
                   else "--fusion-policy cupcake")
            raise ValueError(f"{why} plans on the timings profiled during the dense warm-up: "
                             f"--profile-steps must be >= 1 (the paper uses 5), or use "
                             f"--fusion-policy count with a non-selective --fusion")
        if not 0 < self.sample_ratio <= 1:
            raise ValueError(f"--sample-ratio must be in (0, 1] (DGC samples ~0.01), got "
                             f"{self.sample_ratio}")
        if self.momentum_correction and not self.error_feedback:
            raise ValueError("--momentum-correction accumulates the velocity of unsent entries "
                             "(DGC): it needs error feedback; add --no-momentum-correction to "
                             "--no-error-feedback")
        if self.offload and self.profile_steps < 2:
            raise ValueError(f"--offload profiles the backward with and without the CPU worker "
                             f"on alternate warm-up steps: use --profile-steps >= 2 (got "
                             f"{self.profile_steps})")
        if self.offload and self.fusion != "selective":
            raise ValueError(f"--offload is SSFusion-O on top of --fusion selective; drop "
                             f"--offload or use --fusion selective (got --fusion {self.fusion})")


def needs_profile(options: SSFusionOptions) -> bool:
    """Whether the plan depends on the warm-up profile (selective selection or Cupcake
    buffers): the run then max-reduces its timings and broadcasts the plan once."""
    return options.fusion == "selective" or options.fusion_policy == "cupcake"

