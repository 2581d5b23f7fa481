"""H-SGD's GPU path on the strict CuPy stand-in at 4 ranks: SpFF/SpBP training and
Graph Challenge inference equal the CPU path within float64 round-off and the serial reference,
with the same calls (held against the same plan records) and one host wait per layer and
direction; host-staged and CUDA-aware MPI."""

import pytest
from mpi_helpers import MPI_DIR, JobBatch, run_mpi
from strict_backend import strict_env

pytestmark = pytest.mark.mpi

CASES = [("train", "hypergraph", 2, "0"), ("train", "random", 1, "1"),
         ("infer", "hypergraph", 2, "0"), ("infer", "random", 1, "1")]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The cases in one MPI launch per MPI kind (host-staged, CUDA-aware)."""
    b = JobBatch(tmp_path_factory.mktemp("hsgd_gpu"))
    for mode, method, R, aware in CASES:
        env = strict_env(SPARDIST_CUDA_AWARE=aware)
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{MPI_DIR}"
        b.add(f"{mode}-{method}", 4, "sparse_gpu_checks.py", mode, method, R,
              b.root / f"{mode}-{method}", env=env)
    return b


@pytest.mark.parametrize("mode,method,R,aware", CASES,
                         ids=[f"{m}-{p}-R{r}-aware{a}" for m, p, r, a in CASES])
def test_hsgd_gpu_equals_cpu(jobs, mode, method, R, aware):
    assert f"OK gpu {mode} {method} P=4" in jobs.stdout(f"{mode}-{method}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_hsgd_on_a_real_gpu(mode, tmp_path):
    """The same comparison with the real CuPy and cuSPARSE (skipped without a GPU)."""
    import os

    from strict_backend import real_cupy_or_skip

    real_cupy_or_skip()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(MPI_DIR),
                                                       os.environ.get("PYTHONPATH")]))}
    res = run_mpi("sparse_gpu_checks.py", 2, mode, "hypergraph", 1, tmp_path / "run",
                  timeout=600, env=env)
    assert f"OK gpu {mode} hypergraph P=2" in res.stdout
