"""The run's clock (simulation.clock): measured compute recorded as programs, simulated as a job
(simulation.jobsim), the model's per-layer recorder (models.network), compute sources and
profiles, and the wire lab's comparison of predicted and measured steps.

Steps are checked against times worked out by hand: compute blocks one after the other on the
rank's thread, a call on the communication stream beside them, an offload block on the worker,
a ring all-reduce of two lock-step ranks ``2 (alpha + (n / 2) / beta)``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest

from models.layers import Conv2d, Linear, ReLU, Sequential
from models.network import Model
from models.zoo import build_model
from simulation.clock import PendingSeconds, SimClock, make_source
from simulation.compute import (
    CalibratedSource,
    ComputeSource,
    CpuTimeSource,
    FlopSource,
)
from simulation.jobsim import JobSimOptions
from simulation.profile import ProfileRecorder, ProfileSource, load_profile, write_profile
from substrate.calls import Call, Placement
from substrate.costmodel import CostModel
from substrate.ledger import Ledger
from substrate.recorder import Recorder

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)  # noqa: E731


# -- the clock -------------------------------------------------------------------------------------

class _Fixed(ComputeSource):
    """Seconds by label (a layer's ``phase:name``, a block's key): exact, no measurement."""

    name = "fixed"

    def __init__(self, table):
        self.table = table

    @contextmanager
    def measure(self, flops=None, nbytes=None, label=None):
        m = self.Measurement()
        yield m
        m.seconds = self.table.get(label, 0.0)


def _clock(table, rank=0, ranks=1, cost=None, **kw):
    return SimClock(Ledger(), source=_Fixed(table), rank=rank, node_of=range(ranks),
                    jobsim=JobSimOptions(ack_overhead=0.0), **kw) if cost is None else \
        SimClock(Ledger(), source=_Fixed(table), rank=rank, node_of=range(ranks),
                 jobsim=JobSimOptions(ack_overhead=0.0),
                 network=JobSimOptions(ack_overhead=0.0).network(cost), **kw)


def _simulate(clocks):
    """The collective of :meth:`SimClock.simulate` done by hand for clocks of one process."""
    steps = clocks[0]._run([c._payload() for c in clocks])
    for c in clocks:
        c.simulated.extend(steps)
    return steps


def test_compute_blocks_are_recorded_and_a_step_is_their_sum():
    """Blocks run one after the other on the thread: the step is their sum; a block opened
    inside another is part of it (one entry, one measurement); the step's program holds the
    blocks in order and closes with ``S``."""
    clock = _clock({"fwd": 1.0, "inner": 5.0, "opt": 0.25})
    for _ in range(2):
        with clock.compute("fwd"), clock.compute("inner"):
            pass
        with clock.compute("opt"):
            pass
        clock.step()
    entries = clock.program.since(0)
    assert [e[0] for e in entries] == ["B", "E", "B", "E", "S"] * 2
    assert [e[2] for e in entries if e[0] == "B"] == ["fwd", "opt"] * 2
    assert clock.simulate() == [("unit", approx(1.25)), ("unit", approx(1.25))]
    assert clock.sim_s == approx(2.5) and clock.compute_s == approx(2.5)
    assert clock.unit_steps() == [approx(1.25)] * 2
    assert len(clock.program) == 10 and clock.program.entries == []   # simulated: dropped
    assert clock.simulate() == []


def test_offload_blocks_run_on_the_worker_beside_the_thread():
    """An offload block starts after its dependencies on the worker while the thread goes
    on; a block that depends on it waits: 1 + max(1, 3) + 0.5."""
    pending = PendingSeconds()
    clock = _clock({"a": 1.0, "b": 1.0, "c": 0.5})
    with clock.compute("a"):
        pass
    off = clock.offload("work", lambda: pending, deps=[clock.last_event])
    with clock.compute("b"):
        pass
    pending.set(3.0)                     # collected by the thread, e.g. before "c"
    with clock.compute("c", deps=[off]):
        pass
    clock.step()
    assert clock.simulate() == [("unit", approx(4.5))]
    assert clock.compute_s == approx(5.5)            # every stream's measured seconds


def _two_ranks(after_first, *, n=800, alpha=1e-3, beta=8e5):
    """Two ranks on two nodes: block ``a`` (1 s), an all-reduce of ``n`` bytes (blocking, or
    on the stream after ``a`` when ``after_first``), block ``b`` (2 s), a wait for the call,
    block ``c`` (0.5 s)."""
    cost = CostModel(inter_bw=beta, inter_lat=alpha)
    clocks = []
    for r in range(2):
        clock = _clock({"a": 1.0, "b": 2.0, "c": 0.5}, rank=r, ranks=2, cost=cost)
        rec = Recorder(Placement.node_major(2, 1), r, cost, clock.ledger)
        rec.program = clock.program
        with clock.compute("a"):
            pass
        call = Call("grad", "allreduce", (0, 1), nbytes=n, itemsize=4, wait=not after_first)
        h = rec.handle(call, rec.declare(call, clock.last_event if after_first else None,
                                         wait=not after_first), None)
        with clock.compute("b"):
            pass
        if after_first:
            clock.program.wait(h.event)
        with clock.compute("c"):
            pass
        clock.step()
        clocks.append(clock)
    return clocks, 2 * (alpha + (n / 2) / beta)


def test_a_blocking_call_waits_and_a_stream_call_overlaps():
    """A blocking all-reduce of two lock-step ranks takes its ring's two rounds between the
    blocks; issued on the stream after ``a`` it runs beside ``b`` and costs nothing more."""
    clocks, ring = _two_ranks(False)
    assert ring == approx(2e-3 + 1e-3 / 2 * 2)
    assert _simulate(clocks) == [("unit", approx(1.0 + ring + 2.0 + 0.5))]
    clocks, ring = _two_ranks(True)
    assert _simulate(clocks) == [("unit", approx(1.0 + 2.0 + 0.5))]
    clocks, ring = _two_ranks(True, n=8 * 10**6)           # 5 s on the wire: now exposed
    assert _simulate(clocks) == [("unit", approx(1.0 + ring + 0.5))]
    assert clocks[0].moved == {"inter": approx(2 * 8e6), "intra": 0.0}


def test_a_step_program_travels_once_and_mismatched_ranks_are_refused():
    clock = _clock({"a": 1.0})
    for _ in range(3):
        with clock.compute("a"):
            pass
        clock.step()
    sent = clock._payload()
    assert [p for p, entries, *_ in sent] == [0, 0, 0]
    assert [entries is None for _, entries, *_ in sent] == [False, True, True]
    other = _clock({"a": 1.0})
    with pytest.raises(ValueError, match="different numbers of steps"):
        other._run([sent, sent[:2]])


def test_readings_restore_on_resume_and_describe_the_model():
    clock = _clock({"a": 2.0})
    with clock.compute("a"):
        pass
    clock.step()
    clock.simulate()
    clock.ledger.record("x", payload=8, inter=8, modeled_s=0.5)
    assert set(clock.as_dict()) == {"wall_s", "compute_s", "comm_modeled_s", "sim_s", "steps"}
    assert clock.comm_modeled_s == approx(0.5)           # the alpha-beta bound, apart
    fresh = _clock({"a": 2.0})
    fresh.load_state(clock.state())
    with fresh.compute("a"):
        pass
    fresh.step()
    fresh.simulate()
    assert fresh.sim_s == approx(4.0) and fresh.compute_s == approx(4.0)
    d = json.loads(json.dumps(clock.describe()))         # JSON-able for summary.json
    assert d["model"].startswith("job simulation") and d["steps"] == 1
    assert d["last_step"]["ranks"]["0"][0]["label"] == "a"


def test_step_wall_time_is_the_whole_step_and_mark_starts_the_next():
    """Everything between two steps is the step's wall time (work outside compute blocks, such
    as a diagnostic, included); mark() leaves what came before it (an evaluation) out."""
    clock = SimClock(Ledger(), source="wall")
    with clock.compute("work"):
        time.sleep(0.02)
    time.sleep(0.03)                 # not a compute block: still the step's
    clock.step()
    assert clock.step_wall_s >= 0.05
    time.sleep(0.05)                 # e.g. an evaluation, then mark()
    clock.mark()
    clock.step()
    assert clock.step_wall_s < 0.04


def test_flops_source_needs_a_peak():
    with pytest.raises(ValueError, match="--device-tflops"):
        make_source("flops")
    with pytest.raises(ValueError, match="unknown compute source"):
        make_source("sundial")


# -- the model's recorder --------------------------------------------------------------------------

class _Rec:
    """Records the calls the model makes (a second implementation of the protocol)."""

    def __init__(self):
        self.calls = []

    def layer(self, phase, name, flops, nbytes):
        self.calls.append(("layer", phase, name, flops))
        from contextlib import nullcontext
        return nullcontext()

    def grads_ready(self, name, lo, hi):
        self.calls.append(("ready", name, lo, hi))


def _batch(model, n=5, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *model.input_shape)).astype(model.dtype)
    return x, rng.integers(0, model.num_classes, n)


def test_work_in_the_ready_hook_is_a_block_between_units_not_the_units():
    """The ready hook runs after the unit's block closed (its gradients reported, no unit
    open); a compute block it runs inside the outer backward block is a block of its own,
    after that unit's block and before the next unit's, and the outer block's own time leaves
    it out, as it leaves out the units: the step is the table's total once."""
    m = build_model("mlp", (20,), 5)
    units = [u.name for u in m.compute_units()]
    table = {f"{p}:{u}": 1.0 for u in units for p in ("forward", "backward")}
    table.update({"forward:loss": 1.0, "hook": 0.25, "nothing": 7.0})
    hooked = list(m.layout.names)
    table["fwdbwd"] = 2 * len(units) + 1 + 0.25 * len(hooked) + 0.5   # + a rest of 0.5
    clock = _clock(table)
    m.recorder = clock.layers
    seen = []

    def ready(name):
        assert clock.layers.open is None                   # between units
        sl = m.layout.slice(name)
        unit = clock.layers.ready_event(sl.start, sl.stop)  # its unit's block, closed
        with clock.compute("hook", deps=unit):
            pass
        seen.append((unit, clock.last_event))

    with clock.compute("outer"), clock.compute("nothing"):   # no unit yet: part of "outer"
        pass
    with clock.compute("fwdbwd"):
        m.loss_and_grad(*_batch(m), ready=ready)
    entries = clock.program.since(0)
    labels = [e[2] for e in entries if e[0] == "B"]
    assert "nothing" not in labels and labels.count("hook") == len(hooked)
    for unit, hook in seen:
        assert entries[unit][2].startswith("backward:") and entries[hook][2] == "hook"
        assert entries[hook][4] == [unit] and hook > unit
    back = [lb for lb in labels if lb.startswith("backward:") or lb == "hook"]
    want = []
    for u in reversed(units):
        want += [f"backward:{u}"] + ["hook"] * sum(n.startswith(u + ".") for n in hooked)
    assert back == want
    clock.step()
    assert clock.simulate() == [("unit", approx(table["fwdbwd"]))]
    assert clock.compute_s == approx(table["fwdbwd"])     # "nothing" was part of "outer" (0 s)


@pytest.mark.parametrize("name, shape", [("resnet", (3, 12, 12)), ("cnn", (1, 8, 8)),
                                         ("mlp", (20,)), ("vit", (1, 8, 8))])
def test_recorder_does_not_change_numerics_or_ready_order(name, shape):
    m1 = build_model(name, shape, 7, dtype=np.float64)
    m2 = build_model(name, shape, 7, dtype=np.float64)
    x, y = _batch(m1)
    names1, names2 = [], []
    l1, _ = m1.loss_and_grad(x, y, ready=names1.append)
    m2.recorder = _Rec()
    l2, _ = m2.loss_and_grad(x, y, ready=names2.append)
    assert l1 == l2
    np.testing.assert_array_equal(m1.grads.flat, m2.grads.flat)
    np.testing.assert_array_equal(m1.buffers[next(iter(m1.buffers))] if m1.buffers else 0,
                                  m2.buffers[next(iter(m2.buffers))] if m2.buffers else 0)
    assert names1 == names2 == list(m1.layout.names)


@pytest.mark.parametrize("name, shape", [("resnet", (3, 12, 12)), ("cnn", (1, 8, 8)),
                                         ("vit", (1, 8, 8))])
def test_grads_ready_ranges_tile_the_flat_vector_in_backward_order(name, shape):
    m = build_model(name, shape, 7)
    rec = _Rec()
    m.recorder = rec
    m.loss_and_grad(*_batch(m))
    ready = [c for c in rec.calls if c[0] == "ready"]
    spans = [(lo, hi) for _, _, lo, hi in ready if hi > lo]
    # backward order: the flat layout is filled from offset 0 upwards, without gaps
    assert spans[0][0] == 0 and spans[-1][1] == m.num_params
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    # each range is exactly the layout slices of the parameters under the unit's name
    for _, unit, lo, hi in ready:
        own = [m.layout.slice(n) for n in m.layout.names if n.startswith(unit + ".")]
        if own:
            assert (lo, hi) == (min(s.start for s in own), max(s.stop for s in own))
        else:
            assert lo == hi
    # every unit: forward once, backward once, and the loss between them
    phases = [(c[1], c[2]) for c in rec.calls if c[0] == "layer"]
    units = [u.name for u in m.compute_units()]
    assert phases == [("forward", u) for u in units] + [("forward", "loss")] + \
        [("backward", u) for u in reversed(units)]


def test_compute_units_of_a_bare_layer_tree_match_the_model():
    from models.network import compute_units
    from models.zoo import resnet_layers

    m = build_model("resnet", (3, 12, 12), 7)
    tree = resnet_layers((3, 12, 12), 7)                  # no parameters allocated
    strip = lambda us: [(u.name, u.lo, u.hi, u.forward_flops, u.activation_bytes)  # noqa: E731
                        for u in us]
    assert strip(compute_units(tree, (3, 12, 12), 4)) == strip(m.compute_units())


def test_eval_forward_is_not_recorded_and_none_removes_the_hooks():
    m = build_model("cnn", (1, 8, 8), 4)
    m.recorder = _Rec()
    m.predict(_batch(m)[0])
    assert m.recorder.calls == []
    rec = m.recorder
    m.recorder = None
    m.loss_and_grad(*_batch(m))
    assert rec.calls == []
    assert all("forward" not in vars(u.layer) and "backward" not in vars(u.layer)
               for u in m.compute_units())


def test_layer_flops_by_hand():
    # Linear(6 -> 4): 2*6*4 = 48; ReLU on 4: 4; Linear(4 -> 3): 24.  Conv 2->3, 3x3, pad 1 on 5x5:
    # 2 * (3*5*5 outputs) * (2*9) = 2700.
    m = Model(Sequential([("fc1", Linear(6, 4)), ("act", ReLU()), ("fc2", Linear(4, 3))]),
              (6,), 3)
    assert [(u.name, u.forward_flops, u.backward_flops) for u in m.compute_units()] == \
        [("fc1", 48, 96), ("act", 4, 8), ("fc2", 24, 48)]
    c = Model(Sequential([("c", Conv2d(2, 3, 3, padding=1))]), (2, 5, 5), None)
    assert c.compute_units()[0].forward_flops == 2700


def test_layer_blocks_answer_bucket_readiness_and_when_the_backward_wrote_them():
    m = build_model("mlp", (20,), 5)
    clock = SimClock(Ledger(), source=FlopSource(1e-6))    # 1 MFLOP/s: seconds = FLOPs * 1e-6
    m.recorder = clock.layers
    x, y = _batch(m, n=4)
    m.loss_and_grad(x, y)
    units = m.compute_units()
    entries = clock.program.since(0)
    last = units[-1]                                # the first unit of the backward
    ev = clock.layers.ready_event(last.lo, last.hi)
    assert entries[ev][2] == f"backward:{last.name}"
    whole = clock.layers.ready_event(0, m.num_params)
    first_param_unit = next(u for u in units if u.hi > u.lo)
    assert entries[whole][2] == f"backward:{first_param_unit.name}"
    fwd = sum(4 * u.forward_flops for u in units) + 5 * 4 * 5
    assert clock.compute_before(ev) == approx((fwd + 4 * last.backward_flops) * 1e-6)
    expected = sum(4 * (u.forward_flops + u.backward_flops) for u in units) + 5 * 4 * 5
    assert clock.compute_before(whole) == approx(expected * 1e-6)
    clock.step()
    assert clock.simulate() == [("unit", approx(expected * 1e-6))]
    with pytest.raises(ValueError, match="not covered"):
        clock.layers.ready_event(0, 10)             # new step: nothing reported yet


# -- load-independent compute ----------------------------------------------------------------------

def test_auto_source_is_cpu_time_on_the_host():
    assert make_source("auto").name.startswith("cpu_")
    assert SimClock(Ledger(), source="auto").source.name.startswith("cpu_")


@pytest.mark.gpu
def test_cuda_event_source_times_kernels():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no CUDA device: {exc}")
    src = make_source("auto", gpu=True)
    a = cp.ones((512, 512), dtype=cp.float32)
    with src.measure() as m:
        for _ in range(10):
            a = a @ a * 1e-3
    assert src.name == "cuda_events" and m.seconds > 0


class _Scripted(ComputeSource):
    """A base source that reports the given seconds in turn (and counts its calls)."""

    name = "scripted"

    def __init__(self, seconds):
        self.seconds, self.calls = list(seconds), 0

    def measure(self, flops=None, nbytes=None, label=None):
        from contextlib import contextmanager

        @contextmanager
        def cm():
            m = self.Measurement()
            yield m
            m.seconds = self.seconds[self.calls]
            self.calls += 1
        return cm()


def test_calibrated_source_keeps_the_least_of_the_first_samples_per_label():
    base = _Scripted([5.0, 3.0, 4.0, 9.0, 1.0, 7.0])
    src = CalibratedSource(base, samples=3)
    got = []
    for _ in range(5):
        with src.measure(label="fwd") as m:
            pass
        got.append(m.seconds)
    assert got == [5.0, 3.0, 3.0, 3.0, 3.0] and base.calls == 3   # frozen after 3 samples
    with src.measure(label="opt") as m:                              # its own calibration
        pass
    assert m.seconds == 9.0
    with src.measure() as m:                                         # unlabeled: measured
        pass
    assert m.seconds == 1.0 and base.calls == 5
    assert make_source("calibrated").name == "calibrated_" + make_source("cpu").name
    with pytest.raises(ValueError, match="samples"):
        CalibratedSource(base, samples=0)


def test_clock_calibrates_unnamed_blocks_per_call_site():
    base = _Scripted([2.0, 10.0, 1.0, 20.0] + [99.0] * 4)
    clock = SimClock(Ledger(), source=CalibratedSource(base, samples=2))
    for _ in range(3):
        with clock.compute():          # call site A: 2, 1, then 1 (calibrated)
            pass
        with clock.compute():          # call site B: 10, 20, then 10
            pass
    assert clock.compute_s == approx(2 + 1 + 1 + 10 + 10 + 10)


def test_cpu_source_names_its_mode():
    src = CpuTimeSource("process")
    assert src.name == "cpu_process" and "blas_threads" in src.describe()
    with pytest.raises(ValueError, match="auto, thread or process"):
        CpuTimeSource("fast")


# -- compute profiles (--compute-profile-out / --compute-source profile) ---------------------------

def _record(base, steps):
    """Run ``steps`` (lists of labels) through a ProfileRecorder over ``base``."""
    rec = ProfileRecorder(base)
    for labels in steps:
        for label in labels:
            with rec.measure(label=label):
                pass
        rec.new_step()
    return rec


def test_profile_round_trip_costs_each_event_its_least_measurement(tmp_path):
    # 3 steps of [a, b, a]: a#0 measures 5, 4, 6; b#0 2, 3, 1; a#1 (the second a of a step) 9, 7, 8
    base = _Scripted([5, 2, 9, 4, 3, 7, 6, 1, 8, 0.5])
    rec = _record(base, [["a", "b", "a"]] * 3)
    with rec.measure() as m:                          # unlabelled: measured, not recorded
        pass
    assert m.seconds == 0.5 and rec.unlabelled == 1
    table = rec.table()
    assert table == {"a": [{"min_s": 4, "median_s": 5, "count": 3},
                           {"min_s": 7, "median_s": 8, "count": 3}],
                     "b": [{"min_s": 1, "median_s": 2, "count": 3}]}
    path = tmp_path / "p.json"
    sha = write_profile(path, [table], {"source": base.describe(), "system": "test"})
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    prof = load_profile(path)
    assert prof["sha256"] == sha and prof["provenance"]["system"] == "test"
    assert prof["provenance"]["host"] and prof["provenance"]["date"]
    never = _Scripted([])                              # the fallback must not be asked
    src = ProfileSource(path, fallback=never)
    got = []
    for _ in range(2):
        for label in ("a", "b", "a"):
            with src.measure(label=label) as m:
                pass
            got.append(m.seconds)
        src.new_step()
    assert got == [4, 1, 7] * 2 and never.calls == 0 and src.fallback_blocks == 0
    info = src.profile_info()
    assert info["file"] == str(path) and info["sha256"] == sha
    assert sha in src.describe() and "0 blocks" in src.describe()


def test_profile_misses_are_measured_by_the_fallback_and_counted(tmp_path):
    path = tmp_path / "p.json"
    write_profile(path, [{"a": [{"min_s": 1.0, "median_s": 1.0, "count": 1}]}], {})
    fb = _Scripted([0.25, 0.5, 2.0])
    src = ProfileSource(path, fallback=fb)
    seconds = []
    for label in ("a", "a", "c", None):               # a#1 and c are not in the profile
        with src.measure(label=label) as m:
            pass
        seconds.append(m.seconds)
    assert seconds == [1.0, 0.25, 0.5, 2.0] and fb.calls == 3
    assert src.fallback_blocks == 3 and src.fallback_s == approx(2.75)
    assert src.fallback_labels == {"a": 1, "c": 1, "None": 1}
    assert src.profile_info()["fallback_blocks"] == 3 and "3 blocks" in src.describe()


def test_profile_tables_per_rank_or_least_over_ranks(tmp_path):
    path = tmp_path / "p.json"
    write_profile(path, [{"a": [{"min_s": 2.0, "count": 1}]},
                         {"a": [{"min_s": 1.0, "count": 1}, {"min_s": 5.0, "count": 1}]}], {})

    def cost(**kw):
        src = ProfileSource(path, fallback=_Scripted([9.0]), **kw)
        out = []
        for _ in range(2):
            with src.measure(label="a") as m:
                pass
            out.append(m.seconds)
        return out, src.table_of, src.fallback_blocks

    assert cost(rank=0, ranks=2) == ([2.0, 9.0], "rank 0 of 2", 1)   # no a#1 on rank 0
    assert cost(rank=1, ranks=2) == ([1.0, 5.0], "rank 1 of 2", 0)
    got, how, missed = cost(rank=0, ranks=4)          # another world size: least over ranks
    assert got == [1.0, 5.0] and missed == 0 and "least over the profile's 2 ranks" in how


def test_clock_over_a_profile_is_the_table_whatever_the_block_takes(tmp_path):
    """Per step: named block 'opt' (5 ms), then the same unnamed call site twice (1 ms, 2 ms in
    the profile); the clock's compute is the table's sum however long the blocks run."""
    path = tmp_path / "p.json"

    def step(clock):
        with clock.compute("opt"):
            time.sleep(0.002)
        for _ in range(2):
            with clock.compute():
                pass
        clock.step()

    rec_clock = SimClock(Ledger(), source=ProfileRecorder(CpuTimeSource()))
    step(rec_clock)
    labels = set(rec_clock.source.table())
    site = next(lb for lb in labels if lb.startswith("compute@"))
    assert labels == {"opt", site}
    assert site.startswith(("compute@tests.simulation.test_clock:", "compute@test_clock:"))
    assert "step" in site and "+" in site             # module:function+line within it
    write_profile(path, [{"opt": [{"min_s": 5e-3, "count": 1}],
                          site: [{"min_s": 1e-3, "count": 1}, {"min_s": 2e-3, "count": 1}]}], {})
    clock = SimClock(Ledger(), source="profile", profile=str(path))
    for _ in range(3):
        step(clock)
    assert clock.simulate() == [("unit", approx(8e-3))] * 3
    assert clock.compute_s == approx(24e-3)
    assert clock.sim_s == approx(24e-3) and clock.source.fallback_blocks == 0
    assert clock.describe()["compute_profile"]["file"] == str(path)


def _profile_doc(**kw):
    doc = {"format": "spardist-compute-profile", "version": 1,
           "ranks": [{"a": [{"min_s": 1.0, "count": 1}]}]}
    doc.update(kw)
    return json.dumps(doc)


@pytest.mark.parametrize("text,match", [
    (None, "no such file; record one first with --compute-profile-out"),
    ("{not json", "is not valid JSON"),
    ('{"format": "other"}', 'is not a compute profile'),
    (_profile_doc(version=7), r"has version 7, this spardist reads versions \[1, 2\]"),
    (_profile_doc(ranks=[]), "non-empty list of per-rank tables"),
    (_profile_doc(ranks=[{"a": [{"min_s": -1.0, "count": 1}]}]), r"ranks\[0\]\['a'\]\[0\]"),
    (_profile_doc(ranks=[{"a": [{"min_s": 1.0}]}]), '"count" >= 1'),
    (_profile_doc(ranks=[{"a": []}]), "must be a non-empty list"),
])
def test_bad_profiles_are_refused_naming_the_flag_and_the_fix(tmp_path, text, match):
    path = tmp_path / "p.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_profile(path)
    assert f"--compute-profile {path}" in str(err.value)
    with pytest.raises(ValueError, match="--compute-profile"):
        make_source("profile", profile=str(path))


@pytest.mark.parametrize("kw,match", [
    ({"compute_source": "profile"}, "--compute-source profile needs --compute-profile FILE"),
    ({"compute_profile": "p.json"}, "only read by --compute-source profile"),
    ({"compute_source": "profile", "compute_profile": "p.json",
      "compute_profile_out": "q.json"}, "--compute-profile-out records measured compute"),
    ({"compute_source": "flops", "device_tflops": 1.0, "compute_profile_out": "q.json"},
     "--compute-source flops measures none"),
])
def test_profile_flags_are_checked_together(kw, match):
    from runner.options import CommonConfig

    with pytest.raises(ValueError, match=match):
        CommonConfig(**kw)
    if "compute_profile_out" not in kw:
        with pytest.raises(ValueError, match=match):
            make_source(kw.get("compute_source", "cpu"), profile=kw.get("compute_profile"))


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_profiled_ddp_runs_give_identical_simulated_steps(tmp_path):
    """A 2 x 2 ddp run records a profile; two runs costed from it have the same step_sim_s on
    every metrics line (whatever the host's load), every event comes from the profile, and the
    summary names the file and its SHA-256."""
    from mpi_helpers import read_summary, run_mpi

    steps = 4
    base = ["train", "--method", "ddp", "--steps", steps, "--eval-every", 2,
            "--ranks-per-node", 2, "--progress-every", 0]
    prof = tmp_path / "profile.json"
    run_mpi(None, 4, *base, "--out", tmp_path / "rec", "--compute-profile-out", prof,
            module="dataparallel", timeout=300)
    doc = json.loads(prof.read_text())
    sha = hashlib.sha256(prof.read_bytes()).hexdigest()
    assert read_summary(tmp_path / "rec")["clock"]["compute_profile"]["sha256"] == sha
    assert len(doc["ranks"]) == 4 and doc["provenance"]["method"] == "ddp"
    for table in doc["ranks"]:
        layers = [lb for lb in table if lb.startswith(("forward:", "backward:"))]
        assert layers and "optimizer" in table
        for lb in layers + ["optimizer"]:           # one block per step: k = 0 only
            assert [e["count"] for e in table[lb]] == [steps], lb
    sims = []
    for i in range(2):
        out = tmp_path / f"replay{i}"
        run_mpi(None, 4, *base, "--out", out, "--compute-source", "profile",
                "--compute-profile", prof, module="dataparallel", timeout=300)
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        sims.append([x["step_sim_s"] for x in lines])
        info = read_summary(out)["clock"]["compute_profile"]
        assert info["file"] == str(prof) and info["sha256"] == sha
        assert info["fallback_blocks_all_ranks"] == 0, info
    assert sims[0] == sims[1] and len(sims[0]) == 2 and all(s > 0 for s in sims[0])


@pytest.mark.mpi
@pytest.mark.parametrize("flags,message", [
    (["--compute-source", "profile", "--compute-profile", "missing.json"],
     "--compute-profile missing.json: no such file"),
    (["--compute-profile-out", "EXISTING"], "already exists: pass --overwrite"),
])
def test_profile_input_errors_stop_every_rank(tmp_path, flags, message):
    from mpi_helpers import assert_fails_on_every_rank

    existing = tmp_path / "existing.json"
    existing.write_text("{}")
    flags = [str(existing) if f == "EXISTING" else f for f in flags]
    assert_fails_on_every_rank("dataparallel", ["train", "--steps", "1", *flags], message,
                               tmp_path / "x")
    assert existing.read_text() == "{}"


# -- wire-lab validation harness (lab) -------------------------------------------------------------

from pathlib import Path

import lab as wl


def _write_metrics(d: Path, lines):
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_compare_steps_per_step_and_cumulative(tmp_path):
    # cumulative sim_s at steps 2, 4, 8 -> per step 0.5, (1.6-1.0)/2 = 0.3, (3.2-1.6)/4 = 0.4
    _write_metrics(tmp_path / "a", [
        {"step": 2, "sim_s": 1.0, "step_wall_s": 0.8},
        {"step": 4, "sim_s": 1.6, "step_wall_s": 0.25},
        {"step": 8, "sim_s": 3.2, "step_wall_s": 0.5},
    ])
    r = wl.compare_steps(tmp_path / "a", skip=1)
    assert [row["predicted_s"] for row in r["rows"]] == [approx(0.5), approx(0.3), approx(0.4)]
    assert r["steps_compared"] == 2
    assert r["median_ratio"] == approx((0.3 / 0.25 + 0.4 / 0.5) / 2)
    assert "median" in wl.format_steps(r)
    # explicit per-step predictions win over the cumulative ones
    _write_metrics(tmp_path / "b", [{"iteration": 1, "step_sim_s": 2.0, "step_wall_s": 4.0},
                                    {"iteration": 2, "step_sim_s": 3.0, "step_wall_s": 3.0}])
    r = wl.compare_steps(tmp_path / "b", skip=0)
    assert [row["ratio"] for row in r["rows"]] == [approx(0.5), approx(1.0)]
    assert r["median_ratio"] == approx(0.75)


def test_compare_steps_divides_a_dilated_run_by_its_dilation(tmp_path):
    """A replay at --dilation K runs K times slower than the cluster it emulates: its measured
    step is step_wall_s / K (the prediction is already the emulated cluster's)."""
    _write_metrics(tmp_path, [
        {"step": 1, "step_sim_s": 0.5, "step_wall_s": 9.0, "time_dilation": 16.0},
        {"step": 2, "step_sim_s": 0.5, "step_wall_s": 8.0, "time_dilation": 16.0},
        {"step": 3, "step_sim_s": 0.5, "step_wall_s": 10.0, "time_dilation": 16.0}])
    r = wl.compare_steps(tmp_path, skip=1)
    assert [row["measured_s"] for row in r["rows"]] == [approx(9 / 16), approx(0.5),
                                                        approx(10 / 16)]
    assert r["median_ratio"] == approx((1.0 + 0.8) / 2)
    assert r["rows"][0]["time_dilation"] == 16.0


def test_cost_flags_of_a_dilated_lab_describe_the_emulated_cluster():
    """At dilation K the lab's links run at rate / K and its ping-pong is timed in dilated
    time: the flags give the emulated rate, the alphas / K and the probed bandwidths x K."""
    pp = {"links": {"inter": {"alpha_s": 160e-6, "bandwidth_gbps": 0.05},
                    "intra": {"alpha_s": 16e-6, "bandwidth_gbps": 2.0}}}
    flags = wl.cost_flags((1000.0, 0.0), pp, dilation=16)
    got = dict(zip(flags[::2], flags[1::2]))
    assert float(got["--inter-bw"]) == approx(1.0 * 1448 / 1514)
    assert float(got["--inter-lat"]) == approx(10.0)
    assert float(got["--intra-lat"]) == approx(1.0)
    assert float(got["--intra-bw"]) == approx(32.0)


def test_compare_steps_refuses_runs_without_the_readings(tmp_path):
    with pytest.raises(wl.LabError, match="metrics.jsonl not found"):
        wl.compare_steps(tmp_path)
    _write_metrics(tmp_path, [{"step": 1, "sim_s": 1.0}])
    with pytest.raises(wl.LabError, match="no step_wall_s"):
        wl.compare_steps(tmp_path)
    _write_metrics(tmp_path, [{"step": 1, "step_wall_s": 1.0}])
    with pytest.raises(wl.LabError, match="neither step_sim_s"):
        wl.compare_steps(tmp_path)
    _write_metrics(tmp_path, [{"step": 1, "sim_s": 1.0, "step_wall_s": 1.0}])
    with pytest.raises(wl.LabError, match="no step left"):
        wl.compare_steps(tmp_path, skip=1)
    assert wl.main(["--compare-steps", str(tmp_path / "nowhere")]) == 2


def test_cost_flags_from_the_link_setting_and_the_ping_pong():
    # 100 Mbit/s of frames; a full segment is 1448 payload bytes in a 1514-byte frame
    assert wl.link_payload_gbps(100) == approx(0.1 * 1448 / 1514)
    pp = {"links": {"inter": {"alpha_s": 40e-6, "bandwidth_gbps": 0.9},
                    "intra": {"alpha_s": 3e-6, "bandwidth_gbps": 8.0}}}
    flags = wl.cost_flags((100.0, 0.0), pp)
    got = dict(zip(flags[::2], flags[1::2]))
    assert float(got["--inter-bw"]) == approx(0.1 * 1448 / 1514)   # the setting, not the probe
    assert float(got["--inter-lat"]) == approx(40.0)
    assert float(got["--intra-lat"]) == approx(3.0) and float(got["--intra-bw"]) == approx(8.0)
    flags = wl.cost_flags(None, pp)                                  # unshaped: the probe's rate
    assert dict(zip(flags[::2], flags[1::2]))["--inter-bw"] == "0.9"


def test_per_step_from_a_pair_of_runs():
    short = {"steps": 4, "wire": {"wall_s": 10.0},
             "summary": {"timing": {"sim_s": 2.0, "compute_s": 1.0, "comm_modeled_s": 1.0}}}
    long = {"steps": 14, "wire": {"wall_s": 15.0},
            "summary": {"timing": {"sim_s": 6.0, "compute_s": 2.0, "comm_modeled_s": 4.0}}}
    r = wl.per_step_from_pair(short, long)
    assert (r["measured_s"], r["predicted_s"], r["ratio"]) == (approx(0.5), approx(0.4),
                                                             approx(0.8))
    with pytest.raises(wl.LabError, match="more steps"):
        wl.per_step_from_pair(long, short)


@pytest.mark.mpi
def test_pingpong_writes_alpha_per_link(tmp_path):
    from mpi_helpers import run_mpi

    # --budget-s 0: both ends stop together after the minimum of 5 timed round trips (a
    # disagreement would hang the pair and fail on the timeout)
    run_mpi(None, 3, "--pingpong", "--out", tmp_path, "--reps", "50", "--warmup", "1",
            "--sizes", "8,4096", "--budget-s", "0", module="lab", timeout=120)
    pp = json.loads((tmp_path / wl.PINGPONG_JSON).read_text())
    assert pp["sizes"] == [8, 4096] and pp["reps"] == 50
    assert [pp["links"]["intra"]["sizes"][k]["round_trips"] for k in ("8", "4096")] == [5, 5]
    intra = pp["links"]["intra"]                      # one node here: only an intra pair
    assert intra["peer"] == 1 and intra["alpha_s"] > 0
    assert set(intra["sizes"]) == {"8", "4096"}
    assert "inter" not in pp["links"]


def _lab_skip() -> str | None:
    if os.geteuid() != 0:
        return f"wire lab needs root; euid is {os.geteuid()}"
    try:
        wl.check_prerequisites()
        wl.find_hydra(sys.executable)
    except wl.LabError as exc:
        return str(exc)
    return None


@pytest.mark.wire
@pytest.mark.timeout(300)
def test_lab_ping_pong_on_a_shaped_link(tmp_path):
    reason = _lab_skip()
    if reason:
        pytest.skip(reason)
    with wl.Lab(2, 2, link=(100, 0), timeout=120) as lab:
        pp = lab.ping_pong(reps=20, sizes=(8, 1 << 20), out=tmp_path)
    inter = pp["links"]["inter"]
    assert inter["peer"] == 2                      # first rank of host 1
    assert inter["alpha_s"] > 0 and pp["link_setting"]["mbit"] == 100
    # the shaper holds the rate: 1 MiB cannot cross faster than 100 Mbit/s of frames allows
    # (two token buckets of rate/250 bytes in series: at most about 10 % early)
    assert inter["bandwidth_gbps"] < 1.1 * wl.link_payload_gbps(100)


def test_compare_steps_predicts_the_jobs_step_from_steps_max(tmp_path):
    """With the job simulation's steps in summary.json (steps_max, every step: a replay's
    lines carry none), a line's prediction is the mean of its steps; counters that do not line
    up with the entries fall back to the lines' own step_sim_s."""
    _write_metrics(tmp_path / "a", [
        {"index": 1, "step": 1, "step_sim_s": None, "step_wall_s": 1.0},
        {"index": 3, "step": 3, "step_sim_s": 0.5, "step_wall_s": 0.8}])
    (tmp_path / "a" / "summary.json").write_text(json.dumps(
        {"steps_max": {"step_s": [0.9, 0.7, 0.9]}}))
    r = wl.compare_steps(tmp_path / "a", skip=0)
    assert [row["predicted_s"] for row in r["rows"]] == [approx(0.9), approx(0.8)]
    assert r["predicted_from"].startswith("the job simulation, step by step")
    assert r["median_ratio"] == approx((0.9 / 1.0 + 0.8 / 0.8) / 2)
    (tmp_path / "a" / "summary.json").write_text(json.dumps(
        {"steps_max": {"step_s": [0.9, 0.7]}}))                 # 2 entries, 3 steps
    with pytest.raises(wl.LabError, match="neither step_sim_s"):
        wl.compare_steps(tmp_path / "a", skip=0)              # line 1 has no prediction


@pytest.mark.mpi
def test_summary_holds_the_last_step_of_rank0_and_the_slowest_rank(tmp_path):
    """Run.finish with 3 ranks whose last rank computes longest: the summary's clock block
    holds the job simulation's last step of rank 0 and of that rank only, each block its FLOP
    time, the step the slowest rank's."""
    from mpi_helpers import run_mpi
    res = run_mpi("finish_checks.py", 3, tmp_path / "run", timeout=120)
    assert "finish checks ok" in res.stdout, res.stdout + res.stderr
