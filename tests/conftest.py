import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/mpi_helpers.py


def _terminate(signum, frame):
    """SIGTERM ends the test run like Ctrl-C does: the running MPI job is ended with every
    process it started (``mpi_helpers.run_mpi``) before pytest exits."""
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _terminate)

# runs without --out (error-path cases, default run folders) land in a temporary results root,
# never in the checkout's results/ (runner.run: SPARDIST_RESULTS); MPI jobs inherit it
os.environ.setdefault("SPARDIST_RESULTS", tempfile.mkdtemp(prefix="spardist-test-results-"))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``./run_mpi.sh --test`` runs the suite on every core) the wire-lab
    tests share one worker: each builds namespaces, bridges and shaped links on this host, and
    two labs at once would measure each other's traffic."""
    for item in items:
        if item.get_closest_marker("wire"):
            item.add_marker(pytest.mark.xdist_group("wire-lab"))
