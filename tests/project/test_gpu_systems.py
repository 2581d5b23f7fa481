"""Every system's ``--device gpu`` command (``bench/gpu_check.py``'s list) at 4 ranks on 2
virtual nodes, on the strict CuPy stand-in, against the same command on the CPU: the same
traffic per phase, the same losses and accuracies (bitwise on the stand-in; the comparison
allows float round-off, as on a GPU), in the exact collectives mode and, for one command of
each kind of call, the native mode (H-SGD's commands in the native mode only).  The plans are made independent of timing (``--compute-source
flops``) so both runs execute the same plan."""

import pytest
from mpi_helpers import JobBatch, run_mpi
from strict_backend import strict_env

from bench.gpu_check import COMMANDS, compare_runs, system_command

pytestmark = pytest.mark.mpi

#: the native mode stages device buffers through the MPI library's own collectives: one command
#: per kind of call (all-reduce, all-gather, point-to-point)
NATIVE = ["ddp", "ssfusion", "sparse_sgd-train", "sparse_sgd-infer"]
#: H-SGD's exact mode on the stand-in is tests/sparse_sgd/test_gpu.py's (the net, both MPI
#: kinds, against the serial reference); its commands run here in the native mode
EXACT = [n for n in COMMANDS if not n.startswith("sparse_sgd")]
CASES = [(n, "exact") for n in EXACT] + [(n, "native") for n in NATIVE]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every command on the CPU (one launch) and on the stand-in (another), 4 ranks."""
    b = JobBatch(tmp_path_factory.mktemp("gpu_systems"))
    for name, mode in CASES:
        for device in ("cpu", "gpu"):
            job = f"{name}-{mode}-{device}"
            module, argv, n = system_command(name, b.root / job, 4, mode, device)
            b.add(job, n, module, *argv, env=strict_env() if device == "gpu" else None)
    return b


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_system_on_gpu_equals_cpu(jobs, name, mode):
    res = compare_runs(jobs.run(f"{name}-{mode}-cpu"), jobs.run(f"{name}-{mode}-gpu"),
                       loss_rtol=1e-6, acc_atol=1e-9)
    assert res["ok"], res["problems"]
    if (COMMANDS[name][2] or 4) > 1:   # four ranks, four devices of the stand-in: none shared
        assert len(set(res["devices"])) == 4 and not res["oversubscribed"]


def test_ssfusion_offload_keeps_momentum_on_the_gpu(tmp_path):
    """SSFusion-O with DGC momentum correction: the GPU run equals the CPU run step by step
    (the offloaded tensors' host velocity starts from the device's)."""
    res = run_mpi("dp_gpu_checks.py", 4, "offload_momentum", tmp_path, timeout=240,
                  env=strict_env())
    assert "OK offload_momentum" in res.stdout


@pytest.mark.parametrize("argv,names", [
    (["--parts", "env,bogus"], "--parts: unknown ['bogus']"),
    (["--systems", "ddp,nope"], "--systems: unknown ['nope']"),
    (["--jobs", "0"], "--jobs 0: give 1 or more"),
])
def test_gpu_check_refuses_unknown_parts_and_systems(tmp_path, capsys, argv, names):
    from bench.gpu_check import main

    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path)])
    assert names in capsys.readouterr().err
