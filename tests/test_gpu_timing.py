"""CUDA-event compute timing on the strict CuPy stand-in (issue 25): a block's events are read
once per step with one host wait, not one wait per block; the timeline gets the same seconds;
reading a block early still works (it resolves then)."""

import inspect

import numpy as np
import pytest
from strict_backend import real_cupy_or_skip, strict_cupy

from substrate.clock import SimClock
from substrate.compute import CudaEventSource, LayerEvents
from substrate.costmodel import CostModel
from substrate.ledger import Ledger
from substrate.timeline import Timeline


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


def test_layer_events_get_their_seconds_at_the_step_end():
    with strict_cupy() as cp:
        tl = Timeline(CostModel())
        src = CudaEventSource()
        layers = LayerEvents(tl, src)
        for name in ("a", "b", "c"):
            with layers.layer("fwd", name):
                _work(cp)
        assert cp._strict.syncs == 0
        assert all(e.seconds == 0 for e in tl.open_events)
        src.new_step()
        assert cp._strict.syncs == 1
        assert all(e.seconds > 0 for e in tl.open_events)
        assert layers.recorded_s == pytest.approx(sum(e.seconds for e in tl.open_events))


def _clock_defers() -> bool:
    return "deferred" in inspect.getsource(SimClock.compute)


@pytest.mark.xfail(not _clock_defers(), strict=True,
                   reason="substrate/clock.py does not yet leave CUDA-event blocks to the step "
                          "end (the SimClock.compute change of the issue-25 report)")
def test_clock_steps_with_one_host_wait():
    with strict_cupy() as cp:
        clock = SimClock(Ledger(), source=CudaEventSource(), timeline=Timeline(CostModel()))
        for _ in range(3):
            base = cp._strict.syncs
            with clock.compute("forward+backward"):
                for name in ("l1", "l2"):
                    with clock.layers.layer("fwd", name):
                        _work(cp)
                _work(cp)
            with clock.compute("optimizer"):
                _work(cp)
            timing = clock.step()
            assert cp._strict.syncs - base == 1
            assert timing.compute_s > 0
            labels = {e.label: e for e in timing.events}
            assert labels["optimizer"].finish > labels["optimizer"].start


@pytest.mark.gpu
def test_cuda_events_on_a_real_gpu():
    cp = real_cupy_or_skip()
    src = CudaEventSource()
    with src.measure() as m:
        _work(cp, 512)
    src.new_step()
    assert m.seconds > 0
