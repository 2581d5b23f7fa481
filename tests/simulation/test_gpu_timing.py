"""CUDA-event compute timing on the strict CuPy stand-in: a block's events are read once per
step with one host wait, not one wait per block; the clock files the same seconds; reading a
block early still works (it resolves then); a clock whose blocks are read at the step end keeps
the same time as one that reads each block at its end."""

from contextlib import contextmanager

import numpy as np
import pytest
from strict_backend import real_cupy_or_skip, strict_cupy

from simulation.clock import SimClock
from simulation.compute import ComputeSource, CudaEventSource, DeferredMeasurement
from substrate.ledger import Ledger


def _work(cp, n=64):
    a = cp.ones((n, n), dtype=np.float32)
    for _ in range(3):
        a = a @ a * 1e-3
    return a


def test_events_read_once_per_step():
    with strict_cupy() as cp:
        src = CudaEventSource()
        ms = []
        for _ in range(5):
            with src.measure() as m:
                _work(cp)
            ms.append(m)
        assert cp._strict.syncs == 0 and not any(m.resolved for m in ms)
        src.new_step()
        assert cp._strict.syncs == 1 and all(m.resolved for m in ms)
        assert all(m.seconds > 0 for m in ms)
        src.new_step()                                   # nothing pending: no wait
        assert cp._strict.syncs == 1


def test_early_read_resolves_everything_pending():
    with strict_cupy() as cp:
        src = CudaEventSource()
        with src.measure() as a:
            _work(cp)
        with src.measure() as b:
            _work(cp)
        assert a.seconds > 0 and b.resolved and cp._strict.syncs == 1
        got = []
        with src.measure() as c:
            _work(cp)
        c.then(got.append)
        assert got == []
        src.new_step()
        assert got == [c.seconds] and cp._strict.syncs == 2


def test_layer_blocks_get_their_seconds_at_the_step_end():
    with strict_cupy() as cp:
        clock = SimClock(Ledger(), source=CudaEventSource())
        for name in ("a", "b", "c"):
            with clock.layers.layer("fwd", name):
                _work(cp)
        assert cp._strict.syncs == 0
        assert all(b.seconds is None for b in clock._blocks)
        clock.step()
        assert cp._strict.syncs == 1
        (_, _, seconds, _, _), = clock._payload()
        assert len(seconds) == 3 and min(seconds) > 0
        assert clock.compute_s == pytest.approx(sum(seconds))


def test_clock_steps_with_one_host_wait():
    with strict_cupy() as cp:
        clock = SimClock(Ledger(), source=CudaEventSource())
        for _ in range(3):
            base = cp._strict.syncs
            with clock.compute("forward+backward"):
                for name in ("l1", "l2"):
                    with clock.layers.layer("fwd", name):
                        _work(cp)
                _work(cp)
            with clock.compute("optimizer"):
                _work(cp)
            clock.step()
            assert cp._strict.syncs - base == 1
        base = cp._strict.syncs
        steps = clock.simulate()
        assert cp._strict.syncs == base              # nothing left to read
        assert len(steps) == 3 and min(s for _, s in steps) > 0
        assert clock.sim_s == pytest.approx(clock.compute_s)


#: seconds of every block and layer of :func:`_scripted_steps`, by label
SECONDS = {"fb": 5.0, "fwd:l1": 1.0, "fwd:l2": 2.0, "hook": 0.5, "opt": 0.25, "tail": 1.0,
           "fwd:l3": 1.0}


class _Scripted(ComputeSource):
    """Seconds by label, known when a block ends (as a CPU source)."""

    name = "scripted"

    @contextmanager
    def measure(self, flops=None, nbytes=None, label=None):
        m = self.Measurement()
        yield m
        m.seconds = SECONDS[label]


class _ScriptedDeferred(ComputeSource):
    """The same seconds, read at the step end with one 'host wait' (as CUDA events)."""

    name = "scripted_deferred"
    deferred = True

    def __init__(self) -> None:
        self._pending, self.reads = [], 0

    @contextmanager
    def measure(self, flops=None, nbytes=None, label=None):
        m = DeferredMeasurement(self)
        yield m
        self._pending.append((m, SECONDS[label]))

    def resolve(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self.reads += 1
        for m, sec in pending:
            m._set(sec)

    def new_step(self) -> None:
        self.resolve()


def _scripted_steps(clock: SimClock, steps: int = 2) -> list:
    out = []
    for _ in range(steps):
        with clock.compute("fb"):            # two layers, a hook between them: rest 1.5 s
            with clock.layers.layer("fwd", "l1"):
                pass
            with clock.compute("hook"):
                pass
            with clock.layers.layer("fwd", "l2"):
                pass
        fb = clock.last_event
        with clock.compute("tail"), clock.layers.layer("fwd", "l3"):   # all one layer: no rest
            pass
        with clock.compute("opt", deps=[fb]):
            pass
        mid = clock.compute_s                # a reading of the open step resolves it
        clock.step()
        out.append(mid)
    return out + clock.simulate() + [clock.last_step]


def test_deferred_blocks_keep_the_clock_of_blocks_read_at_their_end():
    """The same blocks, layers and nested hook give the same steps, compute, events and
    readings whether each block is read at its end or the step's blocks at the step end."""
    clocks = [SimClock(Ledger(), source=src) for src in (_Scripted(), _ScriptedDeferred())]
    now, later = (_scripted_steps(c) for c in clocks)
    assert now == later
    assert now[2] == ("unit", pytest.approx(5.0 + 1.0 + 0.25))
    assert now[0] == pytest.approx(6.25) and now[1] == pytest.approx(12.5)
    assert clocks[1].source.reads == 2       # once per step (the mid-step reading)
    assert clocks[0].as_dict()["sim_s"] == clocks[1].as_dict()["sim_s"]


@pytest.mark.gpu
def test_cuda_events_on_a_real_gpu():
    cp = real_cupy_or_skip()
    src = CudaEventSource()
    with src.measure() as m:
        _work(cp, 512)
    src.new_step()
    assert m.seconds > 0
