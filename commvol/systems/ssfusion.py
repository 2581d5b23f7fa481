"""SSFusion predictions (paper 004): the strategy's own plan, at any scale, without MPI.

The options are the strategy's (:class:`dataparallel.ssfusion.SSFusionOptions`); the plan is
:func:`dataparallel.ssfusion.plan_ssfusion`, the function the run executes.  What a run
measures and a prediction must assume lives in :class:`SSFusionAssumptions`: the warm-up
profile (``--backward-ns``, ``--sparsify-ns`` per parameter), on which the selective selection
and the Cupcake fusion buffers depend, or a recorded run's plan (``--selection-from RUN``:
reproduce a run; ``--dense-tensors`` / ``--interleave-split``: a given selection).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataparallel.ssfusion import (
    SSFusionOptions,
    needs_profile,
    plan_ssfusion,
    profile_length,
)
from substrate import costmodel as cm
from substrate.calls import Placement
from substrate.costmodel import CostModel
from substrate.options import option

from .core import (
    ITEMSIZE,
    IterCost,
    Prediction,
    SystemModel,
    _check_topology,
    _int_list,
    register,
)

__all__ = ["SSFusionAssumptions", "predict_ssfusion", "ssfusion_plan"]


def _name_list(text):
    """``"a,b c"`` or a sequence of names -> tuple of str (``None`` stays ``None``)."""
    if text is None:
        return None
    items = str(text).replace(",", " ").split() if isinstance(text, str) else list(text)
    return tuple(str(x) for x in items)


def _split_list(text):
    """``--interleave-split``: one integer ``l'_i`` per fusion buffer."""
    return _int_list(text, "--interleave-split",
                     "one integer l'_i per fusion buffer (comma-separated)")


@dataclass(frozen=True)
class SSFusionAssumptions:
    """What a run profiles and a prediction has to assume (no strategy option repeated)."""

    backward_ns: float = option(
        2.0, "ssfusion, assumed profile: backward time T_b per parameter in ns (stands in "
        "for the run's warm-up profile in eq. 2 and the Cupcake fusion)")
    sparsify_ns: float = option(
        5.0, "ssfusion, assumed profile: sparsification time T_sp per parameter in ns")
    selection_from: str = option(
        "", "ssfusion: reproduce a run: a run directory or its summary.json whose recorded "
        "fusion buffers (and selective selection) to use")
    dense_tensors: tuple | None = option(
        None, "ssfusion selective: the tensors left dense (comma-separated names, e.g. a run's "
        "summary.json metrics.selection.dense) instead of the eq. 2 rule on the assumed "
        "profile", type=_name_list)
    interleave_split: tuple | None = option(
        None, "ssfusion selective: l'_i per fusion buffer (a run's metrics.selection.split; "
        "with --dense-tensors) instead of the T1+T2 split on the assumed profile",
        type=_split_list)
    fusion_buffers: tuple | None = option(
        None, "ssfusion: the fusion buffers as (t0, t1) tensor ranges in backward order (e.g. "
        "Cupcake's on a cluster's alpha-beta, decided by the caller) instead of the fusion "
        "policy's on the assumed profile", cli=False)
    profile: tuple | None = option(
        None, "ssfusion: the warm-up profile per tensor, (T_b, T_sp, T_cpu) in seconds, one "
        "entry per tensor in backward order (e.g. from a device model) instead of the uniform "
        "--backward-ns / --sparsify-ns", cli=False)

    def __post_init__(self) -> None:
        for flag, v in (("--backward-ns", self.backward_ns),
                        ("--sparsify-ns", self.sparsify_ns)):
            if not (isinstance(v, (int, float, np.number)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be a finite time >= 0 in ns per parameter, "
                                 f"got {v!r}")
        object.__setattr__(self, "dense_tensors", _name_list(self.dense_tensors))
        object.__setattr__(self, "interleave_split", _split_list(self.interleave_split))
        if self.selection_from and (self.dense_tensors is not None
                                    or self.interleave_split is not None):
            raise ValueError("--selection-from takes the dense tensors and splits from the run; "
                             "drop --dense-tensors / --interleave-split, or --selection-from")
        if self.fusion_buffers is not None:
            object.__setattr__(self, "fusion_buffers",
                               tuple((int(a), int(b)) for a, b in self.fusion_buffers))
            if self.selection_from:
                raise ValueError("--selection-from takes the fusion buffers from the run; drop "
                                 "the given buffers, or --selection-from")
        if self.profile is not None:
            prof = tuple(tuple(float(v) for v in t) for t in self.profile)
            if len(prof) != 3 or len({len(t) for t in prof}) != 1 or \
                    not all(math.isfinite(v) and v >= 0 for t in prof for v in t):
                raise ValueError("profile must be (T_b, T_sp, T_cpu): three sequences of finite "
                                 "seconds >= 0, one entry per tensor")
            object.__setattr__(self, "profile", prof)
        if self.interleave_split is not None and self.dense_tensors is None:
            raise ValueError("--interleave-split needs --dense-tensors (the split places the "
                             "dense tensors); pass both, or --selection-from a run")


def _recorded(path: str, fusion: str) -> dict:
    """``metrics`` of a finished ssfusion run (a run directory or its summary.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise ValueError(f"--selection-from {path}: no summary.json there; pass a run directory "
                         "of `dataparallel train --method ssfusion` or its summary.json")
    metrics = json.loads(p.read_text()).get("metrics", {})
    if not isinstance(metrics.get("selection"), dict) or "buffer_tensors" not in metrics:
        raise ValueError(f"--selection-from {path}: not a finished ssfusion run past its "
                         "warm-up (its summary.json metrics has no selection)")
    if metrics.get("fusion") != fusion:
        raise ValueError(f"--selection-from {path}: the run used --fusion "
                         f"{metrics.get('fusion')}, not {fusion}; pass the run's --fusion")
    return metrics


def ssfusion_plan(spec, p: int, link: str, options: SSFusionOptions,
                  assumptions: SSFusionAssumptions | None = None, cost=None):
    """SSFusion's plan for ``spec`` on ``p`` ranks: :func:`dataparallel.ssfusion.plan_ssfusion`
    on the assumed profile ``T_b^l = backward_ns · n_l``, ``T_sp^l = T_cpu^l = sparsify_ns ·
    n_l``, or with a given / recorded selection.

    Returns
    -------
    (SSFusionPlan, str)
        The plan and how its timing-dependent parts were obtained.
    """
    o, a = options, assumptions or SSFusionAssumptions()
    names = list(spec.layout.names)
    sizes = [int(spec.layout.sizes[n]) for n in names]
    index = {n: i for i, n in enumerate(names)}
    n = np.asarray(sizes, dtype=np.float64)
    if a.profile is not None:
        if len(a.profile[0]) != len(names):
            raise ValueError(f"the given profile has {len(a.profile[0])} entries per field; "
                             f"model {spec.name!r} has {len(names)} tensors")
        profile = tuple(np.asarray(t, dtype=np.float64) for t in a.profile)
    else:
        profile = (a.backward_ns * 1e-9 * n, a.sparsify_ns * 1e-9 * n,
                   a.sparsify_ns * 1e-9 * n)
    given = [f for f, v in (("--dense-tensors", a.dense_tensors),
                            ("--interleave-split", a.interleave_split)) if v is not None]
    if given and o.fusion != "selective":
        raise ValueError(f"{', '.join(given)} set(s) the selective mode's selection; use "
                         f"--fusion selective or drop them (got --fusion {o.fusion})")
    kw: dict = {}
    assumed = ("the given per-tensor profile" if a.profile is not None else
               f"assumed profile (T_b = {a.backward_ns:g} ns, T_sp = {a.sparsify_ns:g} ns per "
               "parameter)")
    source = f"{assumed} and the alpha-beta model" if needs_profile(o) else "the options"
    if a.selection_from:
        m = _recorded(a.selection_from, o.fusion)
        bufs, t = [], 0
        for group in m["buffer_tensors"]:
            if list(group) != names[t:t + len(group)]:
                raise ValueError(f"--selection-from {a.selection_from}: the run's fusion buffers "
                                 f"{m['buffer_tensors']} do not cut model {spec.name!r}'s "
                                 f"tensors {names}; pass the run's --model")
            bufs.append((t, t + len(group)))
            t += len(group)
        kw["buffers"] = bufs
        if o.fusion == "selective":
            kw["dense"] = [index[nm] for nm in m["selection"]["dense"]]
            kw["split"] = [int(v) for v in m["selection"]["split"]]
        source = f"recorded by the run ({a.selection_from})"
    if a.fusion_buffers is not None:
        kw["buffers"] = list(a.fusion_buffers)
        source = "given fusion buffers; the rest on the " + source
    if a.dense_tensors is not None:
        unknown = [nm for nm in a.dense_tensors if nm not in index]
        if unknown:
            raise ValueError(f"--dense-tensors: {unknown} are not tensors of model "
                             f"{spec.name!r}; its tensors are {names}")
        kw["dense"] = [index[nm] for nm in a.dense_tensors]
        if a.interleave_split is not None:
            kw["split"] = list(a.interleave_split)
        source = "given (--dense-tensors" + (", --interleave-split)" if "split" in kw else ")") \
            + "; buffers and splits otherwise on the " + source
    plan = plan_ssfusion(sizes, p, link, o, cost or CostModel(), profile=profile,
                         itemsize=ITEMSIZE, **kw)
    if a.selection_from and o.fusion == "selective":
        recorded_k = dict(m["selection"].get("k", {}))
        mine = {names[l]: k for l, k in enumerate(plan.k) if k >= 0}
        if recorded_k != mine:
            raise ValueError(f"--selection-from {a.selection_from}: the run's counts "
                             f"{recorded_k} differ from density-aware ones {mine}; pass the "
                             "run's --density and --density-floor")
    return plan, source


def predict_ssfusion(spec, nodes, gpus_per_node, options: SSFusionOptions, cost=None,
                     assumptions: SSFusionAssumptions | None = None) -> Prediction:
    """SSFusion from :func:`ssfusion_plan`, priced from the plan's records
    (:meth:`dataparallel.ssfusion.SSFusionPlan.calls`, the ones the run executes):
    ``--profile-steps`` dense steps (a ring all-reduce per warm-up buffer); when the plan depends
    on timings, the one-off profile MAX all-reduce and plan broadcast at the end of warm-up; then
    per fusion buffer the all-reduce of ``Buffer_AR`` and the all-gather of ``Buffer_AG``, with
    the sparsification and decoding as compute items for the job simulation at scale (with
    ``--offload``, the offloaded tensors' on the CPU worker's stream).  The
    compute items assume the trainer's default optimizer (SGD with momentum: DGC's momentum
    correction moves it into the strategy when ``--momentum-correction`` is on)."""
    _check_topology(nodes, gpus_per_node)
    M, P = int(nodes), int(gpus_per_node)
    o = options
    placement = Placement.node_major(M, P)
    link = cm.INTER if M > 1 else cm.INTRA
    plan, source = ssfusion_plan(spec, M * P, link, o, assumptions, cost)
    names, L = list(spec.layout.names), plan.L
    T = spec.layout.total
    dense_payload = ITEMSIZE * T
    momentum = bool(o.momentum_correction)

    def step(kind: str, decided: bool = False, payload: int = dense_payload) -> IterCost:
        return IterCost.from_calls(plan.calls(placement, kind, decided, momentum=momentum),
                                   placement, cost, payload, dense_payload)

    def warm(decided: bool) -> IterCost:
        return step("warmup", decided)

    ar, agd, ks = plan.counts()
    payload = ITEMSIZE * (sum(ar) + sum(agd)) + 8 * sum(ks)   # one rank's rows and Buffer_AR
    ratio = payload / dense_payload
    sparse = step("sparse", payload=payload)
    w = int(o.profile_steps)
    stages = ([(w - 1, warm(False)), (1, warm(True)), (None, sparse)] if plan.profiled
              else [(w, warm(False)), (None, sparse)])
    stages = [(c, s) for c, s in stages if c != 0]
    sizes_of = [[t1 - t0 for t0, t1 in bufs] for bufs in (plan.warmup_buffers, plan.buffers)]
    warm_note = (f"steps 0..{w - 1}: dense ring all-reduce (avg) of the {len(sizes_of[0])} "
                 f"warm-up buffer(s) of {sizes_of[0]} tensors (--buffers / --buffer-mib)"
                 if w else "no warm-up step (--profile-steps 0)")
    fusion_note = (f"{len(plan.buffers)} fusion buffer(s) of {sizes_of[1]} tensors "
                   f"(--fusion-policy {o.fusion_policy}); from step {w}: per buffer a ring "
                   f"all-reduce of Buffer_AR ({ar} elements) and a ring all-gather of "
                   f"Buffer_AG ({agd} dense float32 + {ks} sparse float32 values with int32 "
                   f"indices per rank); payload ratio {ratio:.4f} of dense")
    notes = [fusion_note, warm_note, f"timing-dependent parts: {source}"]
    if plan.profiled:
        notes.append(f"step {w - 1}: + MAX all-reduce of the {profile_length(L)} float64 "
                     f"timings and binomial broadcast of the {plan.encode().size} int64 plan")
    if o.fusion == "selective":
        dense_note = (f"dense tensors {[names[l] for l in plan.dense()] or 'none'}, splits "
                      f"l'_i = {list(plan.split)}; the sparse ones at density-aware counts "
                      f"(--density {o.density:g}, --density-floor {o.density_floor:g}: every "
                      "buffer sends K_i = sum ceil(d n_l) elements)")
        notes += [dense_note,
                  ("the run's buffers and selection follow its profiled timings: pass "
                   "--selection-from RUN to reproduce a run; --offload, --sparsifier, "
                   "--sample-ratio and the error-feedback / momentum flags do not change the "
                   "traffic")]
    elif o.fusion == "multi-tensor":
        notes.append("multi-tensor: one top-K_i per buffer, the same bytes as per-tensor")
    return Prediction("ssfusion", spec.name, M, P, "1 step", tuple(stages), notes=tuple(notes),
                      num_params=T)


register(SystemModel("ssfusion", predict_ssfusion, SSFusionOptions,
                     Assumptions=SSFusionAssumptions,
                     description="SSFusion: fusion buffers, selective sparsification, "
                                 "all-reduce of the dense part + all-gather of the sparse part"))
