"""SDP's options (paper 003): the mode, the coverage ``p/n`` and the active blocks ``b/d``."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from substrate.options import check_choices, option

__all__ = ["SDP_MODES", "SDPOptions", "parse_active_blocks", "parse_fraction"]

SDP_MODES = ("neuron", "block", "block-backward")


def parse_fraction(text, flag: str = "--coverage") -> Fraction:
    """``"p/n"`` (positive integers) or a decimal fraction, as an exact :class:`Fraction`
    in ``(0, 1]``; anything else raises ``ValueError`` naming ``flag``."""
    s = str(text).strip()
    try:
        if "/" in s:
            a, b = s.split("/")
            num, den = int(a), int(b)
            if den <= 0:
                raise ValueError
            f = Fraction(num, den)
        else:
            f = Fraction(s)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{flag} {text!r} is malformed; write p/n (e.g. 3/4) or a fraction in "
                         f"(0, 1] (e.g. 0.75)") from None
    if not 0 < f <= 1:
        raise ValueError(f"{flag} must be in (0, 1] (p of n workers, 0 < p <= n), got {text!r}; "
                         f"e.g. {flag} 3/4")
    return f


def parse_active_blocks(text) -> tuple[int, int | None] | None:
    """``"b/d"`` -> ``(b, d)``, ``"b"`` -> ``(b, None)``, ``""`` -> ``None``; ``1 <= b <= d``."""
    s = str(text).strip()
    if not s:
        return None
    try:
        if "/" in s:
            a, c = s.split("/")
            b, d = int(a), int(c)
        else:
            b, d = int(s), None
    except ValueError:
        raise ValueError(f"--active-blocks {text!r} is malformed; write b/d, e.g. 2/3 for 2 of "
                         f"3 residual blocks per worker") from None
    if d is not None and d < 1:
        raise ValueError(f"--active-blocks {text!r}: d must be >= 1 (the model's residual "
                         f"blocks)")
    if b < 1:
        raise ValueError(f"--active-blocks {text!r}: every worker needs b >= 1 active block")
    if d is not None and b > d:
        raise ValueError(f"--active-blocks {text!r}: b = {b} exceeds the d = {d} blocks; use "
                         f"1 <= b <= d")
    return b, d


@dataclass(frozen=True)
class SDPOptions:
    """Options of SDP (paper 003)."""

    sdp_mode: str = option(
        "neuron", "neuron (N-SDP), block (B-SDP) or block-backward (B_b-SDP: full forward, "
                  "masked backward)", choices=SDP_MODES)
    coverage: str = option(
        "3/4", "coverage C = p/n: every masked parameter lives on exactly p of the n workers "
               "(N-SDP; paper §4); 'p/n' or a fraction in (0, 1]")
    active_blocks: str = option(
        "", "b/d residual blocks kept per worker (block modes); empty: b = round(C d)")
    flop_match: bool = option(
        False, "run T/N_active (block-backward: 3/(1+2A)) times the trainer's steps so the "
               "total FLOPs match DDP's (paper §4.1.1)")
    eval_rescale: bool = option(
        False, "not in the paper: evaluate the assembled model with the dropout / "
               "stochastic-depth weight-scaling rule (inputs of masked neurons times p/n, a "
               "block's output times its degree / n)")

    def __post_init__(self) -> None:
        check_choices(self)
        parse_fraction(self.coverage, "--coverage")
        blocks = parse_active_blocks(self.active_blocks)
        if blocks is not None and self.sdp_mode == "neuron":
            raise ValueError("--active-blocks applies to --sdp-mode block|block-backward; with "
                             "--sdp-mode neuron set --coverage p/n instead")
