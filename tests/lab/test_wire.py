"""Real bytes on the wire against the ledger's booked inter-node bytes (``python -m lab``):
emulated hosts in network + UTS namespaces, MPICH over TCP on veth links.

Needs root, working ``ip netns`` and MPICH's hydra ``mpiexec`` in ``.venv``; every test that
builds a lab is skipped with the precise reason otherwise.  One 2 x 2 lab (and its start-up
baseline) is shared by the per-system checks, so the file runs in about a minute on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lab_helpers import SKIP, leftovers, needs_lab

import lab

pytestmark = pytest.mark.wire

TOLERANCE = 0.02   # real inter-host TCP payload / booked inter-node bytes

#: small, fast settings (each books 0.6-3 MB inter-node at 2 x 2, so the few KB of unbooked
#: bookkeeping and MPI envelopes stay well under 2 %)
SYSTEMS = {
    "hsadmm": ["hsadmm", "train", "--iters", "5", "--local-steps", "3"],
    "flat-admm": ["hsadmm", "train", "--method", "flat-admm", "--iters", "2",
                  "--local-steps", "3"],
    "ddp": ["dataparallel", "train", "--method", "ddp", "--steps", "6", "--eval-every", "6"],
    "ddp-hierarchical": ["dataparallel", "train", "--method", "ddp", "--allreduce",
                         "hierarchical", "--steps", "6", "--eval-every", "6"],
    "topk": ["dataparallel", "train", "--method", "topk", "--density", "0.05", "--steps", "10",
             "--eval-every", "10"],
    "pactrain": ["dataparallel", "train", "--method", "pactrain", "--steps", "8",
                 "--warmup-steps", "1", "--stable-window", "2", "--eval-every", "8"],
    "sdp": ["dataparallel", "train", "--method", "sdp", "--steps", "6", "--eval-every", "6"],
    "ssfusion": ["dataparallel", "train", "--method", "ssfusion", "--steps", "6",
                 "--eval-every", "6"],
    "sparse_sgd": ["sparse_sgd", "train", "--neurons", "1024", "--layers", "4",
                   "--steps", "3", "--batch-size", "32"],
}


@pytest.fixture(scope="module")
def lab22():
    """One 2 x 2 lab for the whole module (its start-up baseline is measured once)."""
    if SKIP:
        pytest.skip(SKIP)
    with lab.Lab(2, 2, timeout=240) as the_lab:
        yield the_lab
    assert not leftovers(the_lab.id), leftovers(the_lab.id)


@needs_lab
def test_sendrecv_bytes_appear_on_the_wire(lab22, tmp_path):
    """Calibration: every rank Sendrecv's 4 MB to its peer on the other host; the counters see
    16 MB of TCP payload (within 1 %), split evenly over the two hosts."""
    r = lab22.measure(["lab", "--sendrecv", str(4_000_000)], out=tmp_path)
    assert r["booked_inter_node_bytes"] == 16_000_000
    assert r["ratios"]["payload_vs_booked"] == pytest.approx(1.0, abs=0.01), lab.format_table(r)
    for h in ("h0", "h1"):
        assert r["per_host"][h]["payload_bytes"] == pytest.approx(8_000_000, rel=0.01)
    assert r["calibration"]["header_bytes"] in (52, 66)
    assert r["topology"]["nodes"] == 2 and not r["topology"]["virtual_nodes"]
    saved = json.loads((tmp_path / lab.WIRE_JSON).read_text())
    assert saved["real"] == r["real"]
    # never overwritten silently
    with pytest.raises(lab.LabError, match="exists: pass --force"):
        lab22.measure(["lab", "--sendrecv", "1000"], out=tmp_path)


_SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 47001)); s.listen(1); s.settimeout(30)
c, _ = s.accept()
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
"""
_CLIENT = """
import socket, sys, time
for _ in range(300):
    try:
        c = socket.create_connection((sys.argv[1], 47001), timeout=5); break
    except OSError:
        time.sleep(0.05)
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
"""


@needs_lab
def test_inter_host_tcp_runs_the_pinned_congestion_control(lab22):
    """Whatever the machine's default (BBR on the development box, whose real-time probes
    stalled dilated runs), a connection between two emulated hosts runs lab.TCP_CONGESTION on
    both ends, and the lab records it."""
    h0, h1 = lab22.names[:2]
    server = subprocess.Popen(["ip", "netns", "exec", h1, sys.executable, "-c", _SERVER],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = subprocess.run(["ip", "netns", "exec", h0, sys.executable, "-c", _CLIENT,
                                 lab22.addrs[1]], check=False, capture_output=True, text=True,
                                timeout=60)
        out, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert client.returncode == 0 and server.returncode == 0, (client.stderr, err)
    assert client.stdout.strip() == out.strip() == lab.TCP_CONGESTION == "cubic"
    assert lab22.features["tcp_congestion"] == "cubic"
    route = subprocess.run(["ip", "-n", h0, "route", "show"], check=True, capture_output=True,
                           text=True)
    assert "congctl cubic" in route.stdout, route.stdout


@needs_lab
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_real_inter_host_payload_matches_booked(lab22, tmp_path, name):
    r = lab22.measure(SYSTEMS[name], out=tmp_path / name)
    table = lab.format_table(r)
    print(table)
    assert r["topology"]["nodes"] == 2 and r["topology"]["ranks_per_node"] == 2, table
    booked = r["booked_inter_node_bytes"]
    assert booked and booked == r["predicted_inter_node_bytes"], table
    assert abs(r["ratios"]["payload_vs_booked"] - 1) <= TOLERANCE, table


@needs_lab
def test_run_mpi_launch_gives_the_same_hydra_job(tmp_path):
    """--launch run_mpi: the project's launcher (python -m runner.launch) resolves to the lab's
    hydra command; the bytes agree as with plain mpiexec."""
    r = lab.run_lab(2, 2, SYSTEMS["ddp"], launch="run_mpi", out=tmp_path, timeout=240)
    table = lab.format_table(r)
    assert r["launch"] == "run_mpi"
    assert "-launcher-exec" in r["resolved_command"] and "-ppn 2" in r["resolved_command"]
    assert abs(r["ratios"]["payload_vs_booked"] - 1) <= TOLERANCE, table
    assert leftovers(r["lab_id"]) == []
