"""Device arrays through the communicators on the strict CuPy stand-in, 2 and 4 ranks, both
collective modes: an aliasing bug (a symmetric all-to-all, equal-shape all-reduces in
flight together), every collective and point-to-point call bitwise equal to the CPU path,
staging blocks reused only when free, no pinned allocation per message, and the CUDA-aware
hand-off (device memory given to MPI only after its stream is synchronized)."""

import pytest
from mpi_helpers import run_mpi
from strict_backend import strict_env

pytestmark = [pytest.mark.mpi]

CASES = [(2, 1), (4, 2)]


@pytest.mark.parametrize("n,R", CASES, ids=[f"{n}x{R}" for n, R in CASES])
@pytest.mark.parametrize("mode", ["exact", "native"])
@pytest.mark.parametrize("check", ["alltoallv_symmetric", "overlapped_same_shape", "chained_in_flight",
                                   "back_to_back", "receive_only", "collectives"])
def test_device_communication(check, mode, n, R):
    res = run_mpi("gpu_checks.py", n, check, mode, R, timeout=120, env=strict_env())
    assert f"OK {check} {mode}" in res.stdout


@pytest.mark.parametrize("mode", ["exact", "native"])
def test_cuda_aware_handoff(mode):
    res = run_mpi("gpu_checks.py", 4, "cuda_aware", mode, 2, timeout=120, env=strict_env())
    assert f"OK cuda_aware {mode}" in res.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "native"])
def test_device_communication_on_a_real_gpu(mode):
    """The same checks with the real CuPy on a GPU node (skipped without one)."""
    from strict_backend import real_cupy_or_skip

    real_cupy_or_skip()
    for check in ("alltoallv_symmetric", "overlapped_same_shape", "chained_in_flight",
                  "back_to_back", "receive_only", "collectives"):
        res = run_mpi("gpu_checks.py", 2, check, mode, 1, timeout=300)
        assert f"OK {check} {mode}" in res.stdout
