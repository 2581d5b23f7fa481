"""Run code on the strict CuPy stand-in (``tests/strictcupy``) from the test suite.

``strict_env()`` is the environment of an MPI job on the stand-in; ``strict_cupy()`` imports it
in this process for the duration of a block and removes it after, so a later
``pytest.importorskip("cupy")`` (the real-GPU tests) never sees it.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

STRICT_DIR = Path(__file__).resolve().parent / "strictcupy"
ROOT = STRICT_DIR.parents[1]


def strict_env(**extra) -> dict:
    """Variables for an MPI job whose ``import cupy`` gets the stand-in."""
    path = os.pathsep.join(filter(None, [str(STRICT_DIR), str(ROOT),
                                         os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "SPARDIST_CUDA_AWARE": "0", "STRICTCUPY_DEVICES": "4"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _drop_modules() -> None:
    for name in list(sys.modules):
        if name in ("cupy", "cupyx") or name.startswith(("cupy.", "cupyx.")):
            del sys.modules[name]


@contextmanager
def strict_cupy():
    """``import cupy`` gives the stand-in inside the block (its counters reset)."""
    from substrate import backend as backend_mod

    saved_path = list(sys.path)
    saved_backends = dict(backend_mod._BACKENDS)
    _drop_modules()
    sys.path.insert(0, str(STRICT_DIR))
    try:
        import cupy

        cupy._core.reset_for_tests()
        backend_mod._BACKENDS.clear()
        yield cupy
    finally:
        sys.path[:] = saved_path
        _drop_modules()
        backend_mod._BACKENDS.clear()
        backend_mod._BACKENDS.update(saved_backends)


def real_cupy_or_skip():
    """The real CuPy with a device, or ``pytest.skip`` naming why not."""
    import pytest

    cp = pytest.importorskip("cupy")
    if hasattr(cp, "_strict"):
        pytest.skip("cupy is the strict stand-in, not a GPU")
    from substrate.backend import cupy_available

    if not cupy_available():
        pytest.skip("no CUDA device visible")
    return cp
