"""Numba's OpenMP workers wait passively: with libgomp's default (spinning) waits a
2-thread kernel beside busy processes ran 3-10x slower than one thread (bench/bench_sparse.py,
section threads).  Checked in fresh processes, because libgomp reads the policy when loaded."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import os
import numpy as np, scipy.sparse as sp, numba
from sparse_sgd.kernels import spmm_add
A = sp.random(64, 64, density=0.1, format="csr", random_state=0)
X, out = np.ones((64, 4)), np.zeros((64, 4))
spmm_add(A.indptr, A.indices, A.data, X, out)
assert np.allclose(out, A @ X)
print(os.environ.get("OMP_WAIT_POLICY"), numba.threading_layer())
"""


def _probe(**env):
    e = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    e.update(env, NUMBA_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True,
                          check=True, timeout=300).stdout.split()


def test_openmp_workers_wait_passively_by_default():
    policy, layer = _probe()
    assert layer in ("omp", "workqueue", "tbb")
    assert policy == "PASSIVE"


def test_an_explicit_wait_policy_is_kept():
    assert _probe(OMP_WAIT_POLICY="ACTIVE")[0] == "ACTIVE"
