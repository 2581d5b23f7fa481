"""Replay a recorded run: compute replaced by the time its profile gives, communication real.

::

    python -m mpi4py -m runner.replay --compute-profile FILE [--node-map ...] [--out DIR]
    ./run_mpi.sh -n P runner.replay --compute-profile FILE ...

A run that recorded ``--compute-profile-out FILE`` also wrote every rank's program
(:mod:`substrate.program`) into ``FILE``.  The replay runs those programs again on
a world of the same size: each compute block costs its profile time (``--compute-source
profile``) and the rank sleeps that long instead of computing (``--sleep off``: not even
that); every communication call runs for real through the same :class:`~substrate.comm.Comm`
methods, on buffers of the recorded sizes, in the recorded order, with the recorded
dependencies, issued blocking or to the communication stream as the run issued it.  So

* the replay's calls are the run's, call for call (the call digests in ``summary.json`` agree)
  and its ledger is the run's, byte for byte, whatever the placement it was recorded on or is
  replayed on (the records carry world ranks; their links follow the replay's placement);
* its simulated time is what ``--compute-source profile --compute-profile FILE`` gives the same
  job: the job simulation of every rank's steps (the same blocks, costed the same, the same
  calls), done once when the replay finishes (``summary.json``: ``steps_max``, ``timing``), so
  that nothing but the recorded calls runs between its steps (its metrics lines carry the
  measured steps, ``step_sim_s`` null);
* many ranks fit on few cores: a sleeping rank leaves its core to the others (SimGrid SMPI's
  method), which is how the wire lab emulates 8-16 hosts on a small machine.

``--dilation K`` (time dilation, Gupta et al., "To Infinity and Beyond: Time-Warped Network
Emulation", NSDI 2006): every compute block sleeps K times its profile time.  On a lab whose
links are shaped to 1/K of the emulated rate, the whole run is the emulated run slowed K-fold,
while the CPU work per message (MPI, Python, the bridge's forwarding) is not: K ranks sharing a
core, or a bridge forwarding K links at once, then see each emulated host with a core of its
own.  The run's ``step_wall_s`` stays real (dilated) seconds; the metrics lines and the summary
carry ``time_dilation`` and the lab divides by it (:func:`lab.analysis.compare_steps`).

The programs run through the one executor (:class:`substrate.executor.Executor`) that runs a
training step; receives and the results of reductions are not meaningful (the buffers hold
zeros), sizes, order and timing are.  A program that used a pairwise all-to-all is refused (a
member's record holds its own row only).
"""

from __future__ import annotations

import argparse
import sys
import time

from substrate.calls import Call, wire_bytes
from substrate.executor import Executor, ZeroBindings

from .errors import main_guard
from .options import add_common_args
from .run import start_run

__all__ = ["Sleeper", "communicators", "main", "replay", "step_bytes"]


def _groups(programs) -> list[tuple]:
    """Every communicator group the programs use (members' calls and receives), sorted."""
    out = set()
    for prog in programs:
        for e in prog:
            if e[0] == "C" and e[3]:
                out.add(tuple(e[1]["group"]))
            elif e[0] == "R":
                out.add(tuple(e[4]))
    return sorted(out, key=lambda g: (len(g), g))


def communicators(topo, groups) -> dict:
    """``{group: Comm}`` for every group (world ranks in communicator order): the topology's
    world / node / leaders communicators, and a split of the world for every other group
    (collective: every rank must pass the same groups, and splits for each in the same
    order)."""
    pl = topo.placement
    comms = {c.group: c for c in (topo.world, topo.intra, topo.inter) if c is not None}
    known = {pl.world, pl.leaders, *(pl.members(m) for m in range(pl.num_nodes))}
    rank = topo.rank
    for g in sorted({tuple(g) for g in groups}, key=lambda g: (len(g), g)):
        if g in known:
            continue
        mine = rank in g
        c = topo.world.sub(0 if mine else -1, key=g.index(rank) if mine else rank)
        if mine:
            if c.group != g:
                raise ValueError(f"replay: communicator {list(g)} came out as {list(c.group)}")
            comms[g] = c
    return comms


class Sleeper:
    """Sleeps compute blocks so that their *sum* is the profile's: ``time.sleep`` overshoots
    by the timer slack (~80-100 us a call here), which over the dozens of short blocks of an
    H-SADMM iteration added milliseconds the profiled run never spent.  Each call sleeps its
    time less what earlier calls overslept (the debt), and measures the new overshoot."""

    def __init__(self, dilation: float = 1.0) -> None:
        self.debt = 0.0
        self.dilation = dilation

    def __call__(self, seconds: float) -> None:
        want = seconds * self.dilation - self.debt
        if want <= 0:                       # earlier oversleeping already covered this block
            self.debt = -want
            return
        t0 = time.perf_counter()
        time.sleep(want)
        self.debt = time.perf_counter() - t0 - want


class _Replay(ZeroBindings):
    """The replay's bindings: zeros of every call's sizes, and compute slept for what the
    profile charges it (as the job simulation charges it: a layer block its ``(label, k)``
    cost when it begins, a clock block the rest of its cost after its layers and nested
    blocks, when it ends)."""

    def __init__(self, source, sleep) -> None:
        self.source, self.sleep = source, sleep
        self.k: dict = {}
        self.open: list = []                 # open clock blocks: [cost, inner]

    def _cost(self, key) -> float:
        k = self.k.get(key, 0)
        self.k[key] = k + 1
        return self.source.cost(key, k) or 0.0

    def compute(self, label: str):
        return None

    def block_begin(self, label: str, key: str, kind: str) -> None:
        c = self._cost(key)
        if kind == "layer":
            for b in self.open:
                b[1] += c
            if self.sleep is not None:
                self.sleep(c)
        else:
            self.open.append([c, 0.0])

    def block_end(self, label: str, key: str, kind: str) -> None:
        if kind == "layer":
            return
        c, inner = self.open.pop()
        for b in self.open:
            b[1] += c
        if self.sleep is not None:
            self.sleep(max(0.0, c - inner))

    def new_step(self) -> None:
        self.k = {}


def replay(run, program: list, comms: dict, sleep: bool = True,
           world_bytes: list | None = None, dilation: float = 1.0) -> int:
    """Run one rank's ``program`` with the executor (:class:`substrate.executor.Executor`):
    calls on zeros of their recorded sizes, compute slept (:class:`_Replay`); returns the
    steps closed.  ``world_bytes``: the world's bytes per step (:func:`step_bytes`), for the
    metrics lines; ``dilation``: compute sleeps that many times its profile time
    (``--dilation``, module docstring)."""
    world_bytes = world_bytes or []
    clock = run.clock
    ex = Executor(run, comms, close_steps=True)
    bind = _Replay(clock.source, Sleeper(dilation) if sleep else None)
    steps, pos = 0, 0
    while pos < len(program):
        pos = ex.run_step(program, bind, pos)
        if program[pos - 1][0] != "S":
            break
        bind.new_step()
        steps += 1
        b = world_bytes[steps - 1] if steps - 1 < len(world_bytes) else {}
        run.log(steps, step_wall_s=clock.step_wall_s, step_sim_s=None,
                inter_node_bytes=b.get("inter", 0), intra_node_bytes=b.get("intra", 0),
                time_dilation=dilation)
    return steps


def step_bytes(programs, placement) -> list[dict]:
    """World ``{"intra", "inter"}`` bytes of every step of the programs, priced from their
    records on ``placement`` (a collective's record counted once, on its first member; a
    message on its sender): the metrics lines need world totals without communicating."""
    out: list[dict] = []
    for rank, prog in enumerate(programs):
        k = 0
        for e in prog:
            if e[0] == "S":
                k += 1
                continue
            if e[0] != "C" or not e[3]:
                continue
            d = e[1]
            if d["algorithm"] not in ("p2p", "alltoallv") and d["group"][0] != rank:
                continue
            while len(out) <= k:
                out.append({"intra": 0, "inter": 0})
            w = wire_bytes(Call.from_dict(d), placement)
            out[k]["intra"] += w["intra"]
            out[k]["inter"] += w["inter"]
    return out


@main_guard
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--sleep", choices=("on", "off"), default="on",
                        help="sleep each compute block's profile time (default on; off: the "
                             "calls back to back, same simulated time)")
    parser.add_argument("--dilation", type=float, default=1.0, metavar="K",
                        help="time dilation: sleep K x each compute block's profile time, for a "
                             "lab whose links are shaped to 1/K of the emulated rate (default 1; "
                             "see the module docstring)")
    args = parser.parse_args(argv)
    if not args.dilation >= 1:
        raise ValueError(f"--dilation {args.dilation:g}: must be >= 1 (1: real time; K: the "
                         "run slowed K-fold). Fix: e.g. --dilation 4")
    if args.compute_profile is None:
        raise ValueError("runner.replay needs --compute-profile FILE (a profile written by "
                         "--compute-profile-out)")
    args.compute_source = "profile"
    run = start_run(args, system="replay", method="replay", unit="step")
    doc = run.clock.source.profile
    programs = doc.get("programs")
    if programs is None:
        raise ValueError(f"--compute-profile {args.compute_profile}: holds no programs to replay "
                         "(recorded by an older spardist); record it again with "
                         "--compute-profile-out")
    if len(programs) != run.size:
        raise ValueError(f"--compute-profile {args.compute_profile}: recorded on "
                         f"{len(programs)} ranks; replay it on {len(programs)} (launch with "
                         f"-n {len(programs)})")
    comms = communicators(run.topo, _groups(programs))
    steps = replay(run, programs[run.rank], comms, sleep=args.sleep == "on",
                   world_bytes=step_bytes(programs, run.topo.placement) if run.rank == 0
                   else None, dilation=args.dilation)
    prov = doc.get("provenance", {})
    metrics = {"replay_of": str(args.compute_profile),
               "recorded_by": {k: prov.get(k) for k in ("system", "method", "model", "world")},
               "steps": steps, "time_dilation": args.dilation}
    summary = run.finish(metrics=metrics)
    if run.rank == 0:
        t = summary["traffic"]["measured"]
        print(f"replay of {args.compute_profile}: {steps} steps, inter-node bytes "
              f"{t['inter_node_bytes']}, intra-node bytes {t['intra_node_bytes']}, simulated "
              f"{summary['timing']['sim_s']:.4g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
