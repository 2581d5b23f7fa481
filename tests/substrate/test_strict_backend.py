"""The strict CuPy stand-in (``tests/strictcupy``) behaves as CuPy where it matters for the
device paths (refuses implicit host conversion and NumPy mixing, counts every host sync,
defers asynchronous copies), and the staging pool it exercises is bounded and never hands one
block to two buffers.  In process; no GPU."""

import threading

import numpy as np
import pytest
from strict_backend import real_cupy_or_skip, strict_cupy

from substrate.backend import Backend, StagingPool


def test_refuses_implicit_conversion_and_numpy_mixing():
    with strict_cupy() as cp:
        a = cp.arange(6.0).reshape(2, 3)
        with pytest.raises(TypeError, match="Implicit conversion"):
            np.asarray(a)
        for bad in (lambda: a + np.ones(3), lambda: np.ones(3) * a,
                    lambda: cp.concatenate([a, np.ones((1, 3))]),
                    lambda: np.add(a, np.ones(3), out=a)):
            with pytest.raises(TypeError, match="numpy.ndarray"):
                bad()
        with pytest.raises(ValueError, match="non-scalar numpy"):
            a[0] = np.ones(3)
        a[0] = 2.0                                        # scalars are fine
        assert isinstance(a * np.float32(2), cp.ndarray)
        assert cp._strict.syncs == 0


def test_host_reads_are_counted_syncs():
    with strict_cupy() as cp:
        a = cp.arange(10)
        s = a.sum()
        assert isinstance(s, cp.ndarray) and s.ndim == 0 and cp._strict.syncs == 0
        assert int(s) == 45 and float(a.max()) == 9.0 and bool(s > 0)
        assert cp._strict.syncs == 3
        a[a > 4]                                           # boolean mask: CuPy counts it
        cp.flatnonzero(a)
        cp.bincount(a)                                     # its sign check and its length
        assert cp._strict.by_kind["boolean mask"] == 1
        assert cp._strict.by_kind["flatnonzero"] == 1 and cp._strict.by_kind["bincount"] == 2
        a.get()
        assert cp._strict.syncs == 8
        assert isinstance(cp.count_nonzero(a), cp.ndarray)


def test_asynchronous_copies_land_when_the_stream_says_so():
    with strict_cupy() as cp:
        side = cp.cuda.Stream(non_blocking=True)
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(32), np.float64, 4)
        host[:] = 0
        compute = cp.cuda.get_current_stream()
        dev = cp.arange(4.0)
        with pytest.raises(RuntimeError, match="not ordered after the last write"):
            dev.get(out=host, stream=side, blocking=False)   # would race the arange on a GPU
        side.wait_event(compute.record())
        dev.get(out=host, stream=side, blocking=False)
        assert host.sum() == 0                             # not there before a sync
        side.synchronize()
        assert host.tolist() == [0, 1, 2, 3]
        # host to device from pinned memory reads the source when the stream next works
        host[:] = 7
        dst = cp.zeros(4)
        with pytest.raises(RuntimeError, match="not ordered after the last write"):
            dst.set(host, stream=side)    # the zeros, still queued, would overwrite the copy
        side.wait_event(compute.record())
        dst.set(host, stream=side)
        host[:] = 9                                        # overwritten too early
        ev = side.record()
        cp.cuda.get_current_stream().wait_event(ev)
        assert dst.get().tolist() == [9, 9, 9, 9]          # the GPU would read 9s too


def test_cross_stream_order_is_checked_per_byte_range():
    """Views of one allocation are written independently (DDP's buckets of one flat gradient):
    a copy of one part is ordered by the writes to that part only."""
    with strict_cupy() as cp:
        side = cp.cuda.Stream(non_blocking=True)
        compute = cp.cuda.get_current_stream()
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(64), np.float64, 8)
        flat = cp.zeros(8)
        flat[:4] += 1
        side.wait_event(compute.record())
        flat[4:] += 2                                      # written after the event
        flat[:4].get(out=host[:4], stream=side, blocking=False)
        with pytest.raises(RuntimeError, match="not ordered after the last write"):
            flat[4:].get(out=host[4:], stream=side, blocking=False)
        with pytest.raises(RuntimeError, match="not ordered after the last write"):
            flat[::2].get(out=host[:4], stream=side, blocking=False)   # strided: both parts
        side.synchronize()
        assert host[:4].tolist() == [1, 1, 1, 1]


def test_devices_are_per_thread_and_checked(monkeypatch):
    monkeypatch.setenv("STRICTCUPY_DEVICES", "2")
    with strict_cupy() as cp:
        cp.cuda.Device(1).use()
        a = cp.ones(3)
        errors = []

        def other_thread():           # a new thread starts on device 0, as in CUDA
            try:
                a + 1
            except ValueError as exc:
                errors.append(str(exc))
            with cp.cuda.Device(1):
                (a + 1).sum()

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert errors and "current device" in errors[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        assert cp.cuda.runtime.getDeviceCount() == 1
        assert cp.cuda.Device(0).pci_bus_id == "0000:02:00.0"


def test_cuda_array_interface_needs_a_synchronized_writer():
    with strict_cupy() as cp:
        a = cp.arange(4.0) * 2
        with pytest.raises(RuntimeError, match="before the stream that wrote it"):
            _ = a.__cuda_array_interface__
        cp.cuda.get_current_stream().synchronize()
        assert a.__cuda_array_interface__["shape"] == (4,)
        assert a.reshape(2, 2).__cuda_array_interface__["shape"] == (2, 2)   # a view: no write


def test_random_streams_differ_from_numpy():
    with strict_cupy() as cp:
        assert not np.array_equal(cp.random.default_rng(0).random(4).get(),
                                  np.random.default_rng(0).random(4))


def test_pool_bounds_distinct_leases_and_fences():
    done = {"f": False}
    allocs = []
    pool = StagingPool(lambda n: allocs.append(n) or bytearray(n), 64 << 10,
                       lambda f: done[f], lambda f: done.__setitem__(f, True))
    a, b = pool.acquire(1000), pool.acquire(1000)          # equal sizes: two blocks
    assert a.block is not b.block and len(allocs) == 2
    pool.release(a, fence="f")
    c = pool.acquire(1000)                                  # a's copy has not run: new block
    assert c.block is not a.block
    done["f"] = True
    pool.release(b)
    d = pool.acquire(900)                                   # free blocks are reused
    assert d.block in (a.block, b.block) and len(allocs) == 3
    big = pool.acquire(1 << 20)                             # larger than the pool: one-off
    assert pool.describe()["overflow"] == 1
    pool.release(big)
    assert pool.held <= pool.limit and pool.size_class(5000) == 8192


def test_backend_stages_through_its_own_blocks():
    with strict_cupy() as cp:
        be = Backend("gpu", 0)
        x, y = cp.arange(8.0), cp.arange(8.0) + 10
        sx, sy = be.stage(x), be.stage(y, send=False)
        assert sx.host is not sy.host and not np.shares_memory(sx.host, sy.host)
        assert sx.pull().tolist() == list(range(8))
        sy.pull()[...] = 5.0
        sx.push()
        sy.push()
        assert y.get().tolist() == [5.0] * 8 and x.get().tolist() == list(range(8))
        assert be.describe()["staging"]["acquires"] == 2


def test_real_cupy_tests_skip_cleanly_without_a_gpu():
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(pytest.skip.Exception, match="cupy"):
            real_cupy_or_skip()
    with strict_cupy(), pytest.raises(pytest.skip.Exception, match="stand-in"):
        real_cupy_or_skip()


def test_summarize_syncs_takes_the_steady_steps():
    from bench.gpu_check import summarize_syncs

    rec = {"steps": [{"syncs": 50, "main_syncs": 50, "by_site": {}},
                     {"syncs": 30, "main_syncs": 30, "by_site": {}},
                     {"syncs": 6, "main_syncs": 4, "by_site": {"a [get]": 5}},
                     {"syncs": 6, "main_syncs": 4, "by_site": {"a [get]": 5}}]}
    out = summarize_syncs([rec, rec])
    assert out["syncs_per_step"] == 6 and out["main_thread_per_step"] == 4
    assert out["sites"] == {"a [get]": 5}
