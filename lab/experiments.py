"""Experiments: set up a lab, run, read back, tear down.

* :func:`run_lab`: one measurement (what ``python -m lab`` does): real against booked bytes of
  one command, optionally with the lab's own cost model (``calibrate_cost``: alpha from a
  ping-pong on the lab, beta from the link rate) and predicted against measured time per step
  (``compare``).
* :func:`compare_systems`: predicted against measured time per step of several commands on
  several link rates and shapes (``bench/bench_wirelab.py``; table by
  :func:`lab.analysis.format_comparison`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .analysis import (
    STEPS_JSON,
    compare_steps,
    cost_flags,
    format_run,
    median_of,
    tcp_ack_overhead,
)
from .jobs import DEFAULT_TIMEOUT, Lab, write_json
from .netns import LabError
from .network import RTO_MIN_MS, parse_link

__all__ = ["DEFAULT_TIMER_SLACK_US", "KERNEL_RTO_MIN_MS", "compare_systems", "run_lab"]

#: Linux's default timer slack of a thread (``prctl(2)``, PR_SET_TIMERSLACK), microseconds
DEFAULT_TIMER_SLACK_US = 50.0
#: Linux's minimum TCP retransmission timeout (TCP_RTO_MIN), milliseconds
KERNEL_RTO_MIN_MS = 200.0


def run_lab(hosts: int, ranks_per_host: int, module_args, *, link=None, launch: str = "mpiexec",
            out=None, timeout: float = DEFAULT_TIMEOUT, force: bool = False,
            netmod: str = "ucx", offload: bool = False, env: dict | None = None,
            verbose: bool = False, calibrate_cost: bool = False, compare: bool = False,
            nice: int | None = None) -> dict:
    """Set up a lab, measure one run (after its start-up baseline), tear down.

    ``calibrate_cost``: ping-pong first (:meth:`Lab.ping_pong`) and append the cost-model flags
    of :func:`cost_flags` to the command (beta from ``--link``, alpha from the ping-pong).
    ``compare``: read the run's per-step wall time back (:func:`compare_steps`), write
    ``OUT/steps.json`` and put it under ``"steps"`` of the result.

    Returns the ``wire.json`` dict (also written to ``OUT/wire.json``).
    """
    with Lab(hosts, ranks_per_host, link=link, netmod=netmod, offload=offload, timeout=timeout,
             env=env, verbose=verbose, nice=nice) as lab:
        module_args = list(module_args)
        if calibrate_cost:
            flags = cost_flags(lab.link, lab.ping_pong(launch=launch))
            given = [f for f in flags[::2] if f in module_args]
            if given:
                raise LabError(f"--calibrate-cost sets {given} itself: drop them from the "
                               "command")
            module_args += flags
        result = lab.measure(module_args, out=out, launch=launch, force=force)
        if compare:
            steps = compare_steps(result["out"])
            write_json(Path(result["out"]) / STEPS_JSON, steps, True)
            result["steps"] = steps
        return result


def compare_systems(workloads: dict, *, shapes=((2, 1),), links=((100.0, 0.0),), repeat: int = 1,
                    out_root, nice: int | None = None, env: dict | None = None,
                    timeout: float = DEFAULT_TIMEOUT, launch: str = "mpiexec",
                    netmod: str = "ucx", verbose: bool = False, progress=None,
                    dilation=1.0, dilate_timer_slack: bool = False,
                    dilate_rto: bool = True) -> dict:
    """Predicted vs measured time per step of several spardist commands on shaped links.

    For every ``(hosts, ranks_per_host)`` of ``shapes`` and every ``(mbit, latency_us)`` of
    ``links`` one :class:`Lab` is set up; its alpha is measured once (:meth:`Lab.ping_pong`) and
    every workload runs ``repeat`` times with the cost model of :func:`cost_flags` (beta from the
    link setting, alpha from the ping-pong: nothing fitted per run); :func:`compare_steps` reads
    each run's per-step ``step_wall_s`` against the job simulation's step,
    skipping the workload's warm-up lines.

    ``workloads``: ``{name: {"args": [MODULE, ARGS...], "skip": warm-up lines}}``; a callable
    ``args(hosts, ranks_per_host)`` may stand for the list.  ``progress(text)`` is called after
    every run (e.g. ``print``).

    ``dilation`` (time dilation, :mod:`runner.replay`): a number K, or a callable
    ``dilation(hosts, ranks_per_host, mbit)`` giving K per lab.  The links are shaped to
    ``mbit / K``, the workloads (replays only: ``"replay": True`` in their dict) get
    ``--dilation K``, the cost flags describe the emulated cluster (:func:`cost_flags`) and the
    measured steps are divided by K.  Not dilated: the tbf bucket (1 ms of the shaped rate, i.e.
    1/K ms of the emulated link, nearer a link without a bucket; dilated to K ms it let 2 x 2
    steps at 1 Gbit/s run 5-15 % faster than the rate allows) and the kernel's TCP timers other
    than the minimum retransmission timeout.  ``dilate_rto`` (default): that timeout is K x the
    kernel's 200 ms (``ip route ... rto_min``), the timer in emulated time: the links cannot drop
    (drops are counted), so every RTO is spurious, and with 200 ms a replayed H-SGD at 8 x 2,
    K = 64, took 524 of them (0 dilated).  (A run once saw 2 x 2 ddp stall with it, under BBR,
    the machine's default then; with CUBIC, :data:`lab.network.TCP_CONGESTION`, it reads 0.98.)
    ``dilate_timer_slack``: the jobs' timer slack is K x Linux's
    50 us (:func:`lab.jobs._timer_slack_setter`): waiting ranks burn K times less CPU, but MPI's
    progress loop then notices a message 50 us of emulated time late, which the ping-pong's
    alpha shows (159 us at K = 16, against 1.5-14.7 us without).

    Returns ``{"labs": [...], "runs": [...], "rows": [...]}``: one ``runs`` entry per run (its
    medians over steps, the 1-minute load average before and after, or its error), one ``rows``
    entry per system x shape x link (medians over the repeats).
    """
    if not isinstance(repeat, int) or repeat < 1:
        raise LabError(f"repeat must be an integer >= 1, got {repeat!r}")
    if not workloads:
        raise LabError("compare_systems: give at least one workload")
    # every shape and link checked before the first lab is built (a lab takes seconds to set up)
    links = [parse_link(link) for link in links]
    def dilation_of(hosts, rph, mbit) -> float:
        k = float(dilation(hosts, rph, mbit) if callable(dilation) else dilation)
        if not k >= 1:
            raise LabError(f"time dilation {k:g} for {hosts}x{rph} at {mbit:g} Mbit/s: must be "
                           ">= 1. Fix: e.g. --dilation 4")
        if dilate_rto and KERNEL_RTO_MIN_MS * k > RTO_MIN_MS[1]:
            raise LabError(f"time dilation {k:g} for {hosts}x{rph} at {mbit:g} Mbit/s: TCP's "
                           f"minimum RTO would be {KERNEL_RTO_MIN_MS * k / 1e3:g} s, above the "
                           f"kernel's {RTO_MIN_MS[1] / 1e3:g} s. Fix: --dilation <= "
                           f"{RTO_MIN_MS[1] / KERNEL_RTO_MIN_MS:g}, or --real-time-rto")
        return k

    for hosts, rph in shapes:
        Lab(hosts, rph, netmod=netmod, timeout=timeout, nice=nice)   # validates; creates nothing
        for mbit, lat in links:
            if dilation_of(hosts, rph, mbit) != 1 and not all(w.get("replay")
                                                              for w in workloads.values()):
                raise LabError("time dilation slows only replayed compute: run the workloads "
                               "as replays (bench_wirelab.py --replay) or drop --dilation")
    out_root = Path(out_root)
    labs, runs = [], []
    for hosts, rph in shapes:
        for mbit, lat in links:
            k = dilation_of(hosts, rph, mbit)
            with Lab(hosts, rph, link=(mbit / k, lat * k), netmod=netmod, timeout=timeout,
                     env={**(env or {})}, verbose=verbose, nice=nice,
                     timer_slack_us=(DEFAULT_TIMER_SLACK_US * k if k != 1 and dilate_timer_slack
                                     else None),
                     rto_min_ms=KERNEL_RTO_MIN_MS * k if k != 1 and dilate_rto else None) as lab:
                tag = f"{hosts}x{rph}_{mbit:g}mbit"
                pp = lab.ping_pong(launch=launch, out=out_root / f"pingpong_{tag}")
                flags = cost_flags((mbit, lat), pp, dilation=k)
                alpha = {name: v["alpha_s"] / k for name, v in pp["links"].items()}
                labs.append({"lab_id": lab.id, "hosts": hosts, "ranks_per_host": rph,
                             "link": lab.shaping, "emulated_mbit": mbit, "time_dilation": k,
                             "alpha_s": alpha, "cost_flags": flags,
                             "ack_overhead": tcp_ack_overhead(),
                             "tcp": {"congestion": lab.features["tcp_congestion"],
                                     "rto_min_ms": lab.features["tcp_rto_min_ms"]},
                             "env": {k: v for k, v in lab.mpi_env().items()
                                     if k.startswith(("MPIR_CVAR_", "UCX_", "FI_"))},
                             "nice": nice, "loadavg": os.getloadavg()[0]})
                for rep in range(repeat):
                    for name, w in workloads.items():
                        args = w["args"](hosts, rph) if callable(w["args"]) else w["args"]
                        if k != 1:
                            args = [*args, "--dilation", f"{k:g}"]
                        if w.get("replay"):     # the job simulation's links carry TCP's ACKs
                            args = [*args, "--ack-overhead", f"{tcp_ack_overhead():.6g}"]
                        out = out_root / f"{name}_{tag}_r{rep}"
                        run = {"system": name, "hosts": hosts, "ranks_per_host": rph,
                               "mbit": mbit, "repeat": rep, "out": str(out),
                               "skip": int(w.get("skip", 1)), "alpha_s": alpha,
                               "time_dilation": k,
                               "load_before": os.getloadavg()[0]}
                        try:
                            wire = lab.measure([*args, *flags], out=out, launch=launch,
                                               force=True)
                            st = compare_steps(out, skip=run["skip"])
                            write_json(out / STEPS_JSON, st, True)
                        except LabError as exc:
                            run["error"] = str(exc).splitlines()[0][:300]
                        else:
                            run.update(
                                wall_s=wire["wall_s"], steps_compared=st["steps_compared"],
                                predicted_s=st["median_predicted_s"],
                                measured_s=st["median_measured_s"], ratio=st["median_ratio"],
                                payload_vs_booked=wire["ratios"]["payload_vs_booked"],
                                cost_model=st.get("cost_model"))
                        run["load_after"] = os.getloadavg()[0]
                        runs.append(run)
                        if progress is not None:
                            progress(format_run(run))
    rows = []
    for hosts, rph in shapes:
        for link in links:
            for name in workloads:
                rs = [r for r in runs if (r["system"], r["hosts"], r["ranks_per_host"],
                                          r["mbit"]) == (name, hosts, rph, float(link[0]))]
                ok = [r for r in rs if "error" not in r]
                rows.append({
                    "system": name, "hosts": hosts, "ranks_per_host": rph,
                    "mbit": float(link[0]), "alpha_s": rs[0]["alpha_s"] if rs else None,
                    "time_dilation": rs[0]["time_dilation"] if rs else None,
                    "runs": len(ok), "errors": [r["error"] for r in rs if "error" in r],
                    **{k: median_of([r.get(k) for r in ok]) for k in (
                        "predicted_s", "measured_s", "ratio", "load_before", "load_after")}})
    return {"labs": labs, "runs": runs, "rows": rows}
