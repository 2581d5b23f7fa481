"""Every system's ``--device gpu`` command (``bench/gpu_check.py``'s list) at 4 ranks on 2
virtual nodes, on the strict CuPy stand-in, against the same command on the CPU: the same
traffic per phase, the same losses and accuracies (bitwise on the stand-in; the comparison
allows float round-off, as on a GPU), in the exact collectives mode and, for one command of
each kind, the native mode.  The plans are made independent of timing (``--compute-source
flops``) so both runs execute the same plan."""

import pytest

from bench.gpu_check import COMMANDS, run_system

pytestmark = pytest.mark.mpi

#: the native mode stages device buffers through the MPI library's own collectives: one command
#: per kind of call (all-reduce, all-gather, point-to-point)
NATIVE = ["ddp", "ssfusion", "sparse_sgd-train"]
CASES = [(n, "exact") for n in COMMANDS] + [(n, "native") for n in NATIVE]


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_system_on_gpu_equals_cpu(name, mode, tmp_path):
    res = run_system(name, tmp_path, 4, strict=True, mode=mode, loss_rtol=1e-6,
                     acc_atol=1e-9)
    assert res["ok"], res["problems"]
    if res["ranks"] > 1:   # four ranks, four devices of the stand-in: none shared
        assert len(set(res["devices"])) == 4 and not res["oversubscribed"]


def test_ssfusion_offload_keeps_momentum_on_the_gpu(tmp_path):
    """SSFusion-O with DGC momentum correction: the GPU run equals the CPU run step by step
    (the offloaded tensors' host velocity starts from the device's)."""
    from mpi_helpers import run_mpi
    from strict_backend import strict_env

    res = run_mpi("dp_gpu_checks.py", 4, "offload_momentum", tmp_path, timeout=240,
                  env=strict_env())
    assert "OK offload_momentum" in res.stdout
