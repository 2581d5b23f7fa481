import os
import signal
import sys
import tempfile
from pathlib import Path

# the checkout first, then tests/ (mpi_helpers.py and the other helpers): tests/models/ and the
# other per-package folders must never shadow the packages they test
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def _terminate(signum, frame):
    """SIGTERM ends the test run like Ctrl-C does: the running MPI job is ended with every
    process it started (``mpi_helpers.run_mpi``) before pytest exits."""
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _terminate)

# runs without --out (error-path cases, default run folders) land in a temporary results root,
# never in the checkout's results/ (runner.run: SPARDIST_RESULTS); MPI jobs inherit it
os.environ.setdefault("SPARDIST_RESULTS", tempfile.mkdtemp(prefix="spardist-test-results-"))


# every MPI job of the suite starts from bytecode even where PYTHONDONTWRITEBYTECODE is set
from runner.launch import byte_compile_checkout

byte_compile_checkout()


def pytest_collection_modifyitems(items):
    """Test files that launch MPI jobs or wire labs first (a stable sort, each file's tests in
    their order): the suite's workers (``run_mpi.sh --test``: pytest-xdist, a file per worker)
    take files in this order, so the long launches start early and the short files even out
    the end."""
    launches = {item.path for item in items
                if item.get_closest_marker("mpi") or item.get_closest_marker("wire")}
    items.sort(key=lambda item: item.path not in launches)
